//! What a request offers to route on: its prompt cut into fixed-size
//! chunks, each hash chained to the one before (so a chunk's hash names the
//! whole prompt up to its end, as an engine's KV-cache block key does), or
//! its session.
//!
//! The gateway has no tokenizer, so it chunks the prompt's text, not its
//! tokens: [`CHUNK_BYTES`] of text are about 32 tokens of English, two of
//! vLLM's 16-token blocks. The text is the request's own, read in a fixed
//! order (for chat, each message's role and then its content, whatever the
//! order of the JSON keys), so the same conversation resent with one more
//! turn shares every chunk of the turns before.

use std::borrow::Cow;

use serde::Deserialize;
use serde_json::value::RawValue;

/// Bytes of prompt text per chunk.
pub const CHUNK_BYTES: usize = 128;
/// Chunks the replica a prompt calls home is chosen by: the first 1 KiB.
/// A longer span would send prompts that share a long system prompt but
/// not their question to different homes; a shorter one would give every
/// prompt that opens with the same few words the same home. The prefix
/// index refines it with the whole prompt.
pub const HOME_CHUNKS: usize = 8;
/// The most chunks hashed of one prompt (8 MiB of text): a longer prompt
/// is routed on its first 8 MiB.
pub const MAX_CHUNKS: usize = 64 * 1024;

/// A request's routing key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RouteKey {
    /// Chained hashes of the prompt's whole chunks (for a session, the
    /// session's hash alone): what the prefix index matches.
    pub chunks: Box<[u64]>,
    /// What rendezvous hashing places a key seen nowhere by: the chained
    /// hash of its first [`HOME_CHUNKS`] chunks (or of the whole text when
    /// shorter), or the session's hash.
    pub home: u64,
}

impl RouteKey {
    /// The key of a session id.
    pub fn session(id: &[u8]) -> RouteKey {
        let h = rapidhash::v3::rapidhash_v3(id);
        RouteKey {
            chunks: Box::new([h]),
            home: h,
        }
    }

    /// The key of a prompt's text, given in pieces as it is read.
    pub fn prompt<'a>(pieces: impl IntoIterator<Item = &'a [u8]>) -> RouteKey {
        let mut c = Chunker::default();
        for p in pieces {
            c.feed(p);
            if c.chunks.len() >= MAX_CHUNKS {
                break;
            }
        }
        c.finish()
    }
}

/// Cuts text fed in pieces into chained chunk hashes.
#[derive(Default)]
struct Chunker {
    /// The previous chunk's hash, then the bytes of the chunk being filled.
    buf: Vec<u8>,
    prev: u64,
    chunks: Vec<u64>,
    /// Hash of everything, for a text shorter than the home span.
    all: u64,
}

impl Chunker {
    fn feed(&mut self, mut bytes: &[u8]) {
        if self.buf.is_empty() {
            self.buf.reserve(8 + CHUNK_BYTES);
            self.buf.extend_from_slice(&self.prev.to_le_bytes());
        }
        self.all = rapidhash::v3::rapidhash_v3_seeded(
            bytes,
            &rapidhash::v3::RapidSecrets::seed_cpp(self.all),
        );
        while !bytes.is_empty() && self.chunks.len() < MAX_CHUNKS {
            let room = 8 + CHUNK_BYTES - self.buf.len();
            let (now, rest) = bytes.split_at(room.min(bytes.len()));
            self.buf.extend_from_slice(now);
            bytes = rest;
            if self.buf.len() == 8 + CHUNK_BYTES {
                let h = rapidhash::v3::rapidhash_v3(&self.buf);
                self.chunks.push(h);
                self.prev = h;
                self.buf.clear();
                self.buf.extend_from_slice(&h.to_le_bytes());
            }
        }
    }

    fn finish(self) -> RouteKey {
        let home = match self.chunks.len() {
            0 => self.all,
            n => self.chunks[n.min(HOME_CHUNKS) - 1],
        };
        RouteKey {
            chunks: self.chunks.into_boxed_slice(),
            home,
        }
    }
}

// === reading a request ===

/// The parts of an OpenAI request that make its prompt, borrowed from the
/// body; every other key is skipped unread.
#[derive(Deserialize)]
struct Prompted<'a> {
    #[serde(borrow, default)]
    messages: Option<Vec<Message<'a>>>,
    #[serde(borrow, default)]
    prompt: Option<&'a RawValue>,
    #[serde(borrow, default)]
    input: Option<&'a RawValue>,
    #[serde(borrow, default)]
    instructions: Option<Cow<'a, str>>,
}

#[derive(Deserialize)]
struct Message<'a> {
    #[serde(borrow, default)]
    role: Cow<'a, str>,
    #[serde(borrow, default)]
    content: Option<&'a RawValue>,
    #[serde(borrow, default)]
    name: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    tool_calls: Option<&'a RawValue>,
}

/// A message's separators: bytes JSON text cannot hold unescaped, so no
/// content can forge a message boundary.
const ROLE: &[u8] = b"\x1e";
const CONTENT: &[u8] = b"\x1f";

/// The prompt key of an OpenAI body (`messages`, `prompt`, `input`), or
/// `None` when it has none (or is not an object).
pub fn prompt_key(body: &[u8]) -> Option<RouteKey> {
    let p: Prompted = serde_json::from_slice(body).ok()?;
    let mut pieces: Vec<Cow<'_, [u8]>> = Vec::new();
    if let Some(i) = &p.instructions {
        pieces.push(Cow::Borrowed(ROLE));
        pieces.push(Cow::Borrowed(i.as_bytes()));
    }
    if let Some(messages) = &p.messages {
        for m in messages {
            pieces.push(Cow::Borrowed(ROLE));
            pieces.push(Cow::Borrowed(m.role.as_bytes()));
            if let Some(n) = &m.name {
                pieces.push(Cow::Borrowed(n.as_bytes()));
            }
            pieces.push(Cow::Borrowed(CONTENT));
            if let Some(c) = m.content {
                pieces.push(text_of(c));
            }
            if let Some(t) = m.tool_calls {
                pieces.push(Cow::Borrowed(t.get().as_bytes()));
            }
        }
    }
    for v in [p.prompt, p.input].into_iter().flatten() {
        pieces.push(Cow::Borrowed(ROLE));
        pieces.push(text_of(v));
    }
    if pieces.is_empty() {
        return None;
    }
    Some(RouteKey::prompt(pieces.iter().map(|c| c.as_ref())))
}

/// The session key of a request: `X-Session-Id`, else the body's `user`.
pub fn session_key(header: Option<&[u8]>, body: &[u8]) -> Option<RouteKey> {
    if let Some(id) = header.filter(|h| !h.is_empty()) {
        return Some(RouteKey::session(id));
    }
    #[derive(Deserialize)]
    struct User<'a> {
        #[serde(borrow, default)]
        user: Option<Cow<'a, str>>,
    }
    let u: User = serde_json::from_slice(body).ok()?;
    u.user
        .filter(|u| !u.is_empty())
        .map(|u| RouteKey::session(u.as_bytes()))
}

/// A JSON string's text (unescaped), or any other value's JSON text as
/// sent (token ids, content parts).
fn text_of(v: &RawValue) -> Cow<'_, [u8]> {
    let raw = v.get();
    if raw.starts_with('"') {
        match serde_json::from_str::<Cow<'_, str>>(raw) {
            Ok(Cow::Borrowed(s)) => Cow::Borrowed(s.as_bytes()),
            Ok(Cow::Owned(s)) => Cow::Owned(s.into_bytes()),
            Err(_) => Cow::Borrowed(raw.as_bytes()),
        }
    } else {
        Cow::Borrowed(raw.as_bytes())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chat(turns: &[(&str, &str)]) -> Vec<u8> {
        let messages: Vec<_> = turns
            .iter()
            .map(|(r, c)| serde_json::json!({"role": r, "content": c}))
            .collect();
        serde_json::to_vec(&serde_json::json!({"model": "m", "messages": messages})).expect("json")
    }

    #[test]
    fn a_conversation_resent_with_a_turn_more_shares_every_earlier_chunk() {
        let system = "You are a careful assistant. ".repeat(40);
        let first = chat(&[("system", &system), ("user", "What is a KV cache?")]);
        let second = chat(&[
            ("system", &system),
            ("user", "What is a KV cache?"),
            (
                "assistant",
                &"It holds attention keys and values. ".repeat(10),
            ),
            ("user", "And prefix caching?"),
        ]);
        let a = prompt_key(&first).expect("key");
        let b = prompt_key(&second).expect("key");
        assert!(a.chunks.len() >= 8, "{}", a.chunks.len());
        // Every whole chunk of the first is a chunk of the second, at the
        // same place; the second has more.
        assert_eq!(&b.chunks[..a.chunks.len()], &a.chunks[..]);
        assert!(b.chunks.len() > a.chunks.len());
        assert_eq!(a.home, b.home);
    }

    #[test]
    fn the_order_of_json_keys_does_not_change_the_key() {
        let x = br#"{"model":"m","messages":[{"role":"user","content":"hello there, this is a prompt that is long enough to fill a chunk or two of text at least, surely by now it is"}]}"#;
        let y = br#"{"messages":[{"content":"hello there, this is a prompt that is long enough to fill a chunk or two of text at least, surely by now it is","role":"user"}],"model":"m"}"#;
        assert_eq!(prompt_key(x), prompt_key(y));
    }

    #[test]
    fn a_chained_chunk_names_everything_before_it() {
        // The same second chunk after a different first one is another key.
        let common = "b".repeat(CHUNK_BYTES);
        let one = RouteKey::prompt([format!("{}{common}", "a".repeat(CHUNK_BYTES)).as_bytes()]);
        let two = RouteKey::prompt([format!("{}{common}", "c".repeat(CHUNK_BYTES)).as_bytes()]);
        assert_ne!(one.chunks[1], two.chunks[1]);
        // Pieces cut anywhere give the same key as the whole text.
        let text = "x".repeat(3 * CHUNK_BYTES + 17);
        let whole = RouteKey::prompt([text.as_bytes()]);
        let cut = RouteKey::prompt([
            &text.as_bytes()[..5],
            &text.as_bytes()[5..200],
            &text.as_bytes()[200..],
        ]);
        assert_eq!(whole.chunks, cut.chunks);
        assert_eq!(whole.chunks.len(), 3);
    }

    #[test]
    fn prompts_of_every_openai_shape_have_keys_and_others_none() {
        assert!(prompt_key(br#"{"model":"m","prompt":"once upon a time"}"#).is_some());
        assert!(prompt_key(br#"{"model":"m","prompt":[1,2,3,4]}"#).is_some());
        assert!(prompt_key(br#"{"model":"m","input":"hello"}"#).is_some());
        let parts = br#"{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"hi"}]}]}"#;
        assert!(prompt_key(parts).is_some());
        assert!(prompt_key(br#"{"model":"m"}"#).is_none());
        assert!(prompt_key(b"[1,2]").is_none());
        assert!(prompt_key(b"not json").is_none());
        // A short prompt still has a home, different from another's.
        let a = prompt_key(br#"{"model":"m","prompt":"a"}"#).expect("key");
        let b = prompt_key(br#"{"model":"m","prompt":"b"}"#).expect("key");
        assert!(a.chunks.is_empty());
        assert_ne!(a.home, b.home);
    }

    #[test]
    fn a_session_is_its_header_else_its_user() {
        let body = br#"{"model":"m","user":"alice"}"#;
        let by_user = session_key(None, body).expect("user");
        assert_eq!(by_user, RouteKey::session(b"alice"));
        let by_header = session_key(Some(b"s-1"), body).expect("header");
        assert_eq!(by_header, RouteKey::session(b"s-1"));
        assert!(session_key(None, br#"{"model":"m"}"#).is_none());
    }
}
