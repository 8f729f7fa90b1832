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
/// The most chunks hashed of one prompt: 512 KiB of text, about 128,000
/// tokens, the context of the largest common models. A longer prompt is
/// routed on its first 512 KiB; and one request cannot fill more than a
/// sliver of the index (8 MiB holds about 150,000 chunks), so a few huge
/// prompts do not push everyone else's out.
pub const MAX_CHUNKS: usize = 4 * 1024;

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
    /// The same key in a space of its own: `salt`'s chunks match no other
    /// salt's (a tenant's prompts are indexed apart from another's).
    pub fn salted(self, salt: u64) -> RouteKey {
        let secrets = rapidhash::v3::RapidSecrets::seed_cpp(salt);
        let mix = |h: u64| rapidhash::v3::rapidhash_v3_seeded(&h.to_le_bytes(), &secrets);
        RouteKey {
            chunks: self.chunks.iter().map(|h| mix(*h)).collect(),
            home: mix(self.home),
        }
    }

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
    fn is_full(&self) -> bool {
        self.chunks.len() >= MAX_CHUNKS
    }

    fn feed(&mut self, mut bytes: &[u8]) {
        if self.is_full() {
            return;
        }
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
/// body; every other key is skipped unread. `messages` stays raw text,
/// read message by message into the chunker: a body of a million empty
/// messages builds nothing.
#[derive(Deserialize)]
struct Prompted<'a> {
    #[serde(borrow, default)]
    messages: Option<&'a RawValue>,
    #[serde(borrow, default)]
    prompt: Option<&'a RawValue>,
    #[serde(borrow, default)]
    input: Option<&'a RawValue>,
    #[serde(borrow, default)]
    instructions: Option<&'a RawValue>,
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

/// The prompt key of an OpenAI body, or `None` when it has no prompt (or
/// is not an object). Its text, in this order whatever the order of the
/// JSON keys: each message of `messages` (role, name, content, tool
/// calls), then `instructions`, `prompt` and `input`. At most
/// [`MAX_CHUNKS`] chunks are hashed; the rest is read past, not kept.
pub fn prompt_key(body: &[u8]) -> Option<RouteKey> {
    let p: Prompted = serde_json::from_slice(body).ok()?;
    let mut c = Chunker::default();
    let mut any = false;
    if let Some(m) = p.messages {
        any = true;
        feed_messages(m.get(), &mut c).ok()?;
    }
    for v in [p.instructions, p.prompt, p.input].into_iter().flatten() {
        any = true;
        c.feed(ROLE);
        c.feed(&text_of(v));
    }
    any.then(|| c.finish())
}

/// Feeds the messages of a raw JSON array to `c`, one at a time.
fn feed_messages(raw: &str, c: &mut Chunker) -> serde_json::Result<()> {
    use serde::de::{Deserializer as _, IgnoredAny, SeqAccess, Visitor};
    struct Feed<'c>(&'c mut Chunker);
    impl<'de> Visitor<'de> for Feed<'_> {
        type Value = ();
        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("an array of messages")
        }
        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
            while !self.0.is_full() {
                let Some(m) = seq.next_element::<Message<'de>>()? else {
                    return Ok(());
                };
                self.0.feed(ROLE);
                self.0.feed(m.role.as_bytes());
                if let Some(n) = &m.name {
                    self.0.feed(n.as_bytes());
                }
                self.0.feed(CONTENT);
                if let Some(content) = m.content {
                    self.0.feed(&text_of(content));
                }
                if let Some(t) = m.tool_calls {
                    self.0.feed(t.get().as_bytes());
                }
            }
            // Enough hashed: the rest is only read past.
            while seq.next_element::<IgnoredAny>()?.is_some() {}
            Ok(())
        }
    }
    serde_json::Deserializer::from_str(raw).deserialize_seq(Feed(c))
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
    #[test]
    fn a_salted_key_matches_its_own_salt_only() {
        let text = "a system prompt ".repeat(40);
        let k = RouteKey::prompt([text.as_bytes()]);
        let a = k.clone().salted(1);
        assert_eq!(a, k.clone().salted(1), "the same salt, the same key");
        let b = k.clone().salted(2);
        assert_eq!(a.chunks.len(), k.chunks.len());
        assert!(
            a.chunks
                .iter()
                .all(|h| !b.chunks.contains(h) && !k.chunks.contains(h))
        );
        assert_ne!(a.home, b.home);
    }

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
    fn a_million_empty_messages_build_nothing_and_a_huge_prompt_is_cut() {
        // Each message read and dropped in turn: no list of them is built.
        let mut body = br#"{"model":"m","messages":["#.to_vec();
        for i in 0..1_000_000 {
            if i > 0 {
                body.push(b',');
            }
            body.extend_from_slice(b"{}");
        }
        body.extend_from_slice(b"]}");
        let k = prompt_key(&body).expect("key");
        assert!(k.chunks.len() <= MAX_CHUNKS);
        // A prompt past the cap is hashed on its first MAX_CHUNKS chunks.
        let long = format!(
            r#"{{"model":"m","prompt":"{}"}}"#,
            "w".repeat((MAX_CHUNKS + 100) * CHUNK_BYTES)
        );
        assert_eq!(
            prompt_key(long.as_bytes()).expect("key").chunks.len(),
            MAX_CHUNKS
        );
        // Messages that are not objects end the key, not the request.
        assert!(prompt_key(br#"{"model":"m","messages":"nope"}"#).is_none());
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
