//! An answer's body read for its usage as it streams to the client: each
//! frame passes through the [`Scanner`] (and, for a stream whose usage
//! chunk the gateway asked for, the [`DropUsageChunk`] filter); at the end
//! the tokens are added to the ledger and charged to the tenant.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::body::Body;
use bytes::Bytes;
use http_body::{Body as HttpBody, Frame, SizeHint};

use super::ledger::Cell;
use super::scan::{Scanner, Tokens};
use super::sse::DropUsageChunk;

/// Whom an answer's tokens are charged to, once it ends.
pub trait Charge: Send + Sync + 'static {
    /// The answer ended with `tokens` (none: it carried no usage, or broke
    /// off before its end), after `chunks` frames of it passed.
    fn charge(&self, tokens: Option<Tokens>, chunks: u64);
}

/// What an answer's end is recorded into.
pub struct Meter {
    /// The ledger's counters for the request's tenant, app and model.
    pub cell: Arc<Cell>,
    /// The tenant's token budget, if it has one.
    pub charge: Option<Box<dyn Charge>>,
}

impl Meter {
    fn record(self, tokens: Option<Tokens>, chunks: u64) {
        self.cell.add(tokens);
        if let Some(c) = self.charge {
            c.charge(tokens, chunks);
        }
    }
}

/// A response body whose usage is read as it passes.
pub struct Metered {
    inner: Body,
    scanner: Scanner,
    strip: Option<DropUsageChunk>,
    meter: Option<Meter>,
    /// The inner body ended (and what the filter held was sent).
    finished: bool,
    /// Data frames passed.
    chunks: u64,
}

impl Metered {
    /// `inner`, read for usage into `meter`; `strip` takes out the usage
    /// chunk the gateway asked the engine for.
    pub fn new(inner: Body, meter: Meter, strip: bool) -> Self {
        Metered {
            inner,
            scanner: Scanner::new(),
            strip: strip.then(DropUsageChunk::new),
            meter: Some(meter),
            finished: false,
            chunks: 0,
        }
    }

    /// The answer ended: `whole`, or broken off (its client left, or the
    /// replica failed). Only a whole answer's usage counts: a usage seen
    /// before a break is not the answer's (a Responses stream echoes the
    /// request's own objects first, which may hold a `usage` key).
    fn end(&mut self, whole: bool) {
        if let Some(m) = self.meter.take() {
            let tokens = self.scanner.tokens().filter(|_| whole);
            m.record(tokens, self.chunks);
        }
    }
}

impl HttpBody for Metered {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        if self.finished {
            return Poll::Ready(None);
        }
        loop {
            let polled = Pin::new(&mut self.inner).poll_frame(cx);
            return match polled {
                Poll::Ready(Some(Ok(frame))) => {
                    let frame = match frame.into_data() {
                        Ok(data) => {
                            self.chunks += 1;
                            let seen = self.scanner.feed(&data);
                            match &mut self.strip {
                                Some(f) => {
                                    let out = f.pass(data, seen);
                                    if out.is_empty() {
                                        continue;
                                    }
                                    Frame::data(out)
                                }
                                None => Frame::data(data),
                            }
                        }
                        Err(other) => other,
                    };
                    Poll::Ready(Some(Ok(frame)))
                }
                Poll::Ready(None) => {
                    self.end(true);
                    self.finished = true;
                    let rest = self.strip.as_mut().map(DropUsageChunk::finish);
                    match rest.filter(|r| !r.is_empty()) {
                        Some(r) => Poll::Ready(Some(Ok(Frame::data(r)))),
                        None => Poll::Ready(None),
                    }
                }
                Poll::Ready(Some(Err(e))) => {
                    self.end(false);
                    Poll::Ready(Some(Err(e)))
                }
                Poll::Pending => Poll::Pending,
            };
        }
    }

    fn is_end_stream(&self) -> bool {
        self.finished
    }

    fn size_hint(&self) -> SizeHint {
        match self.strip {
            // Taking a chunk out changes the length.
            Some(_) => SizeHint::default(),
            None => self.inner.size_hint(),
        }
    }
}

impl Drop for Metered {
    /// Dropped: whole if its last byte passed (a body of known length is
    /// not asked for its end once its length is sent), else its client
    /// left before the end and it counts as an answer without usage.
    fn drop(&mut self) {
        let whole = self.inner.is_end_stream();
        self.end(whole);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::usage::ledger::{Bucket, Query};
    use crate::usage::{Ledger, UsageKey};

    fn frames(parts: &'static [&'static str]) -> Body {
        Body::from_stream(futures_util::stream::iter(parts.iter().map(|p| {
            Ok::<_, std::convert::Infallible>(Bytes::from_static(p.as_bytes()))
        })))
    }

    /// Polls `body` for `n` frames (all, when `None`); the bytes it gave.
    fn read(body: &mut Metered, n: Option<usize>) -> Vec<u8> {
        let mut cx = Context::from_waker(std::task::Waker::noop());
        let mut out = Vec::new();
        let mut taken = 0;
        while n.is_none_or(|n| taken < n) {
            match Pin::new(&mut *body).poll_frame(&mut cx) {
                Poll::Ready(Some(Ok(f))) => {
                    out.extend_from_slice(f.data_ref().map_or(&[][..], |d| &d[..]));
                    taken += 1;
                }
                _ => break,
            }
        }
        out
    }

    fn requests(ledger: &Ledger) -> (u64, u64, u64) {
        ledger.flush_at(3600).expect("flush");
        let r = ledger
            .query(&Query {
                since: 0,
                until: i64::MAX,
                bucket: Bucket::Total,
                group_by: vec![],
                tenant: None,
                app: None,
                model: None,
            })
            .expect("query");
        let row = &r.data[0];
        (row.requests, row.requests_without_usage, row.prompt_tokens)
    }

    static STREAM: [&str; 3] = [
        "data: {\"response\":{\"tools\":[{\"parameters\":{\"usage\":{\"prompt_tokens\":0,\"completion_tokens\":0}}}]}}\n\n",
        "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":900,\"completion_tokens\":40}}\n\n",
        "data: [DONE]\n\n",
    ];

    #[test]
    fn a_whole_answer_counts_its_last_usage_and_one_cut_short_counts_none() {
        let dir = tempfile::tempdir().expect("dir");
        let ledger = Ledger::open(&dir.path().join("state.db"), 1 << 20).expect("ledger");
        let key = UsageKey {
            tenant: "t".into(),
            app: "a".into(),
            model: "a".into(),
        };
        let meter = || Meter {
            cell: ledger.cell(&key),
            charge: None,
        };
        let mut whole = Metered::new(frames(&STREAM), meter(), true);
        let text = String::from_utf8(read(&mut whole, None)).expect("text");
        assert!(
            !text.contains("900"),
            "the usage chunk asked for is taken out: {text}"
        );
        drop(whole);
        assert_eq!(requests(&ledger), (1, 0, 900));
        // Cut after the echoed objects: the forged usage is not taken.
        let mut cut = Metered::new(frames(&STREAM), meter(), true);
        read(&mut cut, Some(1));
        drop(cut);
        assert_eq!(requests(&ledger), (2, 1, 900));
    }
}
