//! Reading an engine's `usage` off its answer as the bytes pass, without
//! parsing the answer: a JSON body (`{"choices": …, "usage": {…}}`), or a
//! stream of server-sent events whose last chunk carries it. Pure; fed
//! frame by frame, whatever their boundaries.
//!
//! A key `"usage"` followed by `:` and an object is the only thing read.
//! Inside a JSON string a quote is escaped (`\"usage\"`), so the model's
//! own text cannot forge one. When the answer carries several (vLLM's
//! `continuous_usage_stats` puts a running total on every chunk), the
//! last one counts.

use memchr::memmem;
use serde::Deserialize;

/// Tokens one answer used, as the engine counted them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Tokens {
    /// Prompt (input) tokens, cached ones included.
    pub prompt: u64,
    /// Of those, the ones the engine's prefix cache held
    /// (`usage.prompt_tokens_details.cached_tokens`).
    pub cached: u64,
    /// Completion (output) tokens.
    pub completion: u64,
}

impl Tokens {
    /// Prompt and completion tokens together: what a token quota charges.
    pub fn total(&self) -> u64 {
        self.prompt.saturating_add(self.completion)
    }
}

/// The longest usage object read: vLLM's is under 200 bytes; anything
/// past this is not a usage object and is left unread.
const MAX_USAGE_BYTES: usize = 4096;

const KEY: &[u8] = b"\"usage\"";

/// The key's searcher, built once: building one costs more than
/// searching a frame.
static FINDER: std::sync::LazyLock<memmem::Finder<'static>> =
    std::sync::LazyLock::new(|| memmem::Finder::new(KEY));

/// Finds the usage objects in an answer fed to it in pieces.
#[derive(Debug)]
pub struct Scanner {
    finder: &'static memmem::Finder<'static>,
    /// The last bytes of the previous piece, so that a key split between
    /// two pieces is found.
    carry: Vec<u8>,
    state: State,
    last: Option<Tokens>,
}

#[derive(Debug)]
enum State {
    /// Looking for the key.
    Key,
    /// After the key: whitespace, then `:`.
    Colon,
    /// After the colon: whitespace, then `{` (or anything else: no usage).
    Open,
    /// Inside the object: its bytes so far, how deep, and whether in a
    /// string (and just after a backslash in it).
    Object {
        bytes: Vec<u8>,
        depth: u32,
        string: bool,
        escaped: bool,
    },
}

impl Default for Scanner {
    fn default() -> Self {
        Scanner {
            finder: &FINDER,
            carry: Vec::new(),
            state: State::Key,
            last: None,
        }
    }
}

impl Scanner {
    /// A scanner at the start of an answer.
    pub fn new() -> Self {
        Self::default()
    }

    /// Reads the next piece of the answer; whether a usage key was seen in
    /// it (or one read before is still open).
    pub fn feed(&mut self, piece: &[u8]) -> bool {
        let mut seen = !matches!(self.state, State::Key);
        let mut at = 0;
        while at < piece.len() {
            at = match &mut self.state {
                State::Key => match self.find_key(&piece[at..]) {
                    Some(after) => {
                        seen = true;
                        self.state = State::Colon;
                        at + after
                    }
                    None => piece.len(),
                },
                State::Colon => {
                    let b = piece[at];
                    if b == b':' {
                        self.state = State::Open;
                    } else if !b.is_ascii_whitespace() {
                        self.state = State::Key;
                        continue;
                    }
                    at + 1
                }
                State::Open => {
                    let b = piece[at];
                    if b == b'{' {
                        self.state = State::Object {
                            bytes: vec![b'{'],
                            depth: 1,
                            string: false,
                            escaped: false,
                        };
                    } else if !b.is_ascii_whitespace() {
                        // `null`, or not an object: look for the next key.
                        self.state = State::Key;
                        continue;
                    }
                    at + 1
                }
                State::Object {
                    bytes,
                    depth,
                    string,
                    escaped,
                } => {
                    let mut i = at;
                    let mut closed = false;
                    while i < piece.len() {
                        let b = piece[i];
                        i += 1;
                        if *string {
                            if *escaped {
                                *escaped = false;
                            } else if b == b'\\' {
                                *escaped = true;
                            } else if b == b'"' {
                                *string = false;
                            }
                            continue;
                        }
                        match b {
                            b'"' => *string = true,
                            b'{' => *depth += 1,
                            b'}' => {
                                *depth -= 1;
                                if *depth == 0 {
                                    closed = true;
                                    break;
                                }
                            }
                            _ => {}
                        }
                    }
                    if bytes.len() + (i - at) > MAX_USAGE_BYTES {
                        self.state = State::Key;
                        self.carry.clear();
                        continue;
                    }
                    bytes.extend_from_slice(&piece[at..i]);
                    if closed {
                        if let Some(t) = parse(bytes) {
                            self.last = Some(t);
                        }
                        self.state = State::Key;
                        self.carry.clear();
                    }
                    i
                }
            };
        }
        seen
    }

    /// The position just past the key in `piece`, counting a key that
    /// began in the carried bytes of the piece before; otherwise keeps
    /// the piece's tail to carry.
    fn find_key(&mut self, piece: &[u8]) -> Option<usize> {
        let carried = self.carry.len();
        if carried > 0 {
            // A key across the boundary: the carry (at most 6 bytes) and
            // the first bytes of this piece.
            let head = &piece[..piece.len().min(KEY.len() - 1)];
            self.carry.extend_from_slice(head);
            if let Some(i) = self.finder.find(&self.carry)
                && i + KEY.len() > carried
            {
                self.carry.clear();
                return Some(i + KEY.len() - carried);
            }
        }
        if let Some(i) = self.finder.find(piece) {
            self.carry.clear();
            return Some(i + KEY.len());
        }
        // Carry the last bytes seen (of this piece, or with a short piece
        // of the carry and this piece, which `carry` now holds whole) from
        // the last quote on: only those can begin a key.
        let keep = KEY.len() - 1;
        if piece.len() >= keep {
            self.carry.clear();
            let tail = &piece[piece.len() - keep..];
            if let Some(q) = memchr::memrchr(b'"', tail) {
                self.carry.extend_from_slice(&tail[q..]);
            }
        } else {
            if carried == 0 {
                self.carry.extend_from_slice(piece);
            }
            let excess = self.carry.len().saturating_sub(keep);
            self.carry.drain(..excess);
            match memchr::memrchr(b'"', &self.carry) {
                Some(q) => {
                    self.carry.drain(..q);
                }
                None => self.carry.clear(),
            }
        }
        None
    }

    /// The last usage read, if any.
    pub fn tokens(&self) -> Option<Tokens> {
        self.last
    }
}

/// A usage object, in the chat and completions form (`prompt_tokens`,
/// `completion_tokens`, `prompt_tokens_details.cached_tokens`) or the
/// Responses API's (`input_tokens`, `output_tokens`,
/// `input_tokens_details.cached_tokens`); an embedding's has no
/// completion tokens.
fn parse(bytes: &[u8]) -> Option<Tokens> {
    #[derive(Deserialize)]
    struct Details {
        #[serde(default)]
        cached_tokens: Option<u64>,
    }
    #[derive(Deserialize)]
    struct Usage {
        prompt_tokens: Option<u64>,
        completion_tokens: Option<u64>,
        input_tokens: Option<u64>,
        output_tokens: Option<u64>,
        prompt_tokens_details: Option<Details>,
        input_tokens_details: Option<Details>,
    }
    let u: Usage = serde_json::from_slice(bytes).ok()?;
    // No answer uses a trillion tokens: a larger figure is not a usage
    // (and would overflow the ledger's sums).
    const MAX: u64 = 1 << 40;
    let prompt = u.prompt_tokens.or(u.input_tokens)?.min(MAX);
    let cached = u
        .prompt_tokens_details
        .or(u.input_tokens_details)
        .and_then(|d| d.cached_tokens)
        .unwrap_or(0);
    Some(Tokens {
        prompt,
        cached: cached.min(prompt),
        completion: u
            .completion_tokens
            .or(u.output_tokens)
            .unwrap_or(0)
            .min(MAX),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scan_in(pieces: &[&[u8]]) -> Option<Tokens> {
        let mut s = Scanner::new();
        for p in pieces {
            s.feed(p);
        }
        s.tokens()
    }

    const CHAT: &[u8] = br#"{"id":"x","choices":[{"message":{"content":"say \"usage\": {\"prompt_tokens\": 999}"}}],"usage":{"prompt_tokens":12,"total_tokens":19,"completion_tokens":7,"prompt_tokens_details":{"cached_tokens":8}},"prompt_logprobs":null}"#;

    #[test]
    fn a_chat_answer_s_usage_is_read_and_the_model_s_text_cannot_forge_one() {
        let want = Tokens {
            prompt: 12,
            cached: 8,
            completion: 7,
        };
        assert_eq!(scan_in(&[CHAT]), Some(want));
        // Cut at every place: the same.
        for cut in 0..CHAT.len() {
            assert_eq!(
                scan_in(&[&CHAT[..cut], &CHAT[cut..]]),
                Some(want),
                "cut at {cut}"
            );
        }
        // A byte at a time.
        let bytes: Vec<&[u8]> = CHAT.chunks(1).collect();
        assert_eq!(scan_in(&bytes), Some(want));
    }

    #[test]
    fn a_stream_s_last_usage_counts_and_null_ones_are_skipped() {
        let stream = concat!(
            "data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}],\"usage\":null}\n\n",
            "data: {\"choices\":[{\"delta\":{\"content\":\"b\"}}],\"usage\":{\"prompt_tokens\":5,\"completion_tokens\":1}}\n\n",
            "data: {\"choices\":[],\"usage\" : {\"prompt_tokens\":5,\"completion_tokens\":2}}\n\n",
            "data: [DONE]\n\n"
        );
        assert_eq!(
            scan_in(&[stream.as_bytes()]),
            Some(Tokens {
                prompt: 5,
                cached: 0,
                completion: 2
            })
        );
    }

    #[test]
    fn responses_and_embeddings_forms_are_read() {
        let responses = br#"{"type":"response.completed","response":{"usage":{"input_tokens":30,"input_tokens_details":{"cached_tokens":16},"output_tokens":4,"total_tokens":34}}}"#;
        assert_eq!(
            scan_in(&[responses]),
            Some(Tokens {
                prompt: 30,
                cached: 16,
                completion: 4
            })
        );
        let embedding =
            br#"{"data":[{"embedding":[0.1]}],"usage":{"prompt_tokens":3,"total_tokens":3}}"#;
        assert_eq!(
            scan_in(&[embedding]),
            Some(Tokens {
                prompt: 3,
                cached: 0,
                completion: 0
            })
        );
    }

    #[test]
    fn no_usage_is_none_not_a_guess() {
        assert_eq!(scan_in(&[br#"{"choices":[],"usage":null}"#]), None);
        assert_eq!(scan_in(&[br#"{"choices":[]}"#]), None);
        assert_eq!(scan_in(&[br#"{"usage":{"total_tokens":3}}"#]), None);
        // An object past the bound is not read.
        let big = format!(
            r#"{{"usage":{{"prompt_tokens":1,"x":"{}"}}}}"#,
            "a".repeat(MAX_USAGE_BYTES)
        );
        assert_eq!(scan_in(&[big.as_bytes()]), None);
        // Nor is a usage object never closed.
        assert_eq!(scan_in(&[br#"{"usage":{"prompt_tokens":1"#]), None);
    }

    #[test]
    fn cached_tokens_never_exceed_the_prompt() {
        let odd = br#"{"usage":{"prompt_tokens":2,"completion_tokens":1,"prompt_tokens_details":{"cached_tokens":9}}}"#;
        assert_eq!(scan_in(&[odd]).map(|t| t.cached), Some(2));
    }
}
