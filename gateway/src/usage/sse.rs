//! The usage chunk the gateway asked a stream for, kept from a client that
//! did not ask for it. To count a stream's tokens the gateway sets
//! `stream_options.include_usage`; the engine then ends the stream with
//! one more event, `{"choices": [], "usage": {…}}`, before `data: [DONE]`.
//! A client that did not ask would read that event as a chunk without a
//! choice, so it is taken out. Pure; fed frame by frame.

use std::sync::LazyLock;

use bytes::{Bytes, BytesMut};
use memchr::memmem;

/// An event longer than this is passed on as it is, unfiltered: no usage
/// chunk is that long, and the filter must not hold a stream's bytes.
const MAX_EVENT_BYTES: usize = 1 << 20;

/// Searchers built once (building one costs more than searching a frame).
static CHOICES: LazyLock<memmem::Finder<'static>> =
    LazyLock::new(|| memmem::Finder::new(b"\"choices\""));
static USAGE: LazyLock<memmem::Finder<'static>> =
    LazyLock::new(|| memmem::Finder::new(b"\"usage\""));
static EVENT_END: LazyLock<memmem::Finder<'static>> =
    LazyLock::new(|| memmem::Finder::new(b"\n\n"));
static EVENT_END_REV: LazyLock<memmem::FinderRev<'static>> =
    LazyLock::new(|| memmem::FinderRev::new(b"\n\n"));

/// Passes a stream of server-sent events on, without its usage-only
/// chunk.
#[derive(Debug, Default)]
pub struct DropUsageChunk {
    /// The start of an event whose end has not come yet.
    pending: BytesMut,
}

impl DropUsageChunk {
    /// A filter at the start of a stream.
    pub fn new() -> Self {
        Self::default()
    }

    /// What of `piece` goes to the client now: the events it completes,
    /// less a usage-only chunk. An event's start is held until its end
    /// comes (a client acts on whole events only). `may_hold_usage`:
    /// whether a `"usage"` key was seen in it (the [`Scanner`] says); a
    /// piece of whole events without one passes as it is, unsearched.
    ///
    /// [`Scanner`]: super::scan::Scanner
    pub fn pass(&mut self, piece: Bytes, may_hold_usage: bool) -> Bytes {
        if self.pending.is_empty() && piece.ends_with(b"\n\n") && !may_hold_usage {
            return piece;
        }
        self.pending.extend_from_slice(&piece);
        let Some(end) = EVENT_END_REV.rfind(&self.pending).map(|i| i + 2) else {
            if self.pending.len() > MAX_EVENT_BYTES {
                return self.pending.split().freeze();
            }
            return Bytes::new();
        };
        let whole = self.pending.split_to(end).freeze();
        if !has_empty_choices(&whole) {
            return whole;
        }
        let mut out = BytesMut::with_capacity(whole.len());
        let mut at = 0;
        for i in EVENT_END.find_iter(&whole) {
            let event = &whole[at..i + 2];
            if !is_usage_only(event) {
                out.extend_from_slice(event);
            }
            at = i + 2;
        }
        out.freeze()
    }

    /// The rest of the stream, once it ended: an event left without its
    /// end goes as it is.
    pub fn finish(&mut self) -> Bytes {
        self.pending.split().freeze()
    }
}

/// Whether `bytes` may hold an event with `"choices": []`.
fn has_empty_choices(bytes: &[u8]) -> bool {
    CHOICES
        .find_iter(bytes)
        .any(|i| empty_list_after(&bytes[i + 9..]))
}

/// Whether `rest` starts (past whitespace) with `: []`.
fn empty_list_after(rest: &[u8]) -> bool {
    let mut it = rest.iter().copied().filter(|b| !b.is_ascii_whitespace());
    it.next() == Some(b':') && it.next() == Some(b'[') && it.next() == Some(b']')
}

/// Whether one event is a chunk with no choice and a usage object: the
/// one `include_usage` adds.
fn is_usage_only(event: &[u8]) -> bool {
    has_empty_choices(event)
        && USAGE.find_iter(event).any(|i| {
            let mut it = event[i + 7..]
                .iter()
                .copied()
                .filter(|b| !b.is_ascii_whitespace());
            it.next() == Some(b':') && it.next() == Some(b'{')
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    const STREAM: &str = concat!(
        "data: {\"id\":\"c\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"hi\"}}]}\n\n",
        "data: {\"id\":\"c\",\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}]}\n\n",
        "data: {\"id\":\"c\",\"choices\": [],\"usage\": {\"prompt_tokens\":3,\"completion_tokens\":2}}\n\n",
        "data: [DONE]\n\n"
    );

    fn through(pieces: &[&[u8]]) -> String {
        let mut f = DropUsageChunk::new();
        let mut out = Vec::new();
        let mut scan = crate::usage::scan::Scanner::new();
        for p in pieces {
            let seen = scan.feed(p);
            out.extend_from_slice(&f.pass(Bytes::copy_from_slice(p), seen));
        }
        out.extend_from_slice(&f.finish());
        String::from_utf8(out).unwrap()
    }

    fn without_usage() -> String {
        STREAM
            .split_inclusive("\n\n")
            .filter(|e| !e.contains("\"usage\""))
            .collect()
    }

    #[test]
    fn the_usage_chunk_is_dropped_however_the_stream_is_cut() {
        let bytes = STREAM.as_bytes();
        assert_eq!(through(&[bytes]), without_usage());
        for cut in 0..bytes.len() {
            assert_eq!(
                through(&[&bytes[..cut], &bytes[cut..]]),
                without_usage(),
                "cut at {cut}"
            );
        }
        let singles: Vec<&[u8]> = bytes.chunks(1).collect();
        assert_eq!(through(&singles), without_usage());
    }

    #[test]
    fn other_events_pass_untouched() {
        // A choice-less chunk without usage, and usage on a chunk with a
        // choice (continuous usage stats), both stay.
        let s = concat!(
            "data: {\"choices\":[]}\n\n",
            "data: {\"choices\":[{\"delta\":{}}],\"usage\":{\"prompt_tokens\":1}}\n\n",
            "data: [DONE]\n\n"
        );
        assert_eq!(through(&[s.as_bytes()]), s);
        // A stream cut short keeps its last piece.
        assert_eq!(
            through(&[b"data: {\"choices\":[{"]),
            "data: {\"choices\":[{"
        );
    }
}
