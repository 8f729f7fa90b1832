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
    /// off before it).
    fn charge(&self, tokens: Option<Tokens>);
}

/// What an answer's end is recorded into.
pub struct Meter {
    /// The ledger's counters for the request's tenant, app and model.
    pub cell: Arc<Cell>,
    /// The tenant's token budget, if it has one.
    pub charge: Option<Box<dyn Charge>>,
}

impl Meter {
    fn record(self, tokens: Option<Tokens>) {
        self.cell.add(tokens);
        if let Some(c) = self.charge {
            c.charge(tokens);
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
        }
    }

    fn end(&mut self) {
        if let Some(m) = self.meter.take() {
            m.record(self.scanner.tokens());
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
                    self.end();
                    self.finished = true;
                    let rest = self.strip.as_mut().map(DropUsageChunk::finish);
                    match rest.filter(|r| !r.is_empty()) {
                        Some(r) => Poll::Ready(Some(Ok(Frame::data(r)))),
                        None => Poll::Ready(None),
                    }
                }
                Poll::Ready(Some(Err(e))) => {
                    self.end();
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
    /// A client that left before the end: what usage passed counts, or
    /// the answer is counted as one without usage.
    fn drop(&mut self) {
        self.end();
    }
}
