//! A request body its handler left unread, and what that does to the
//! client's connection.
//!
//! A refusal made on the headers alone (a wrong key, a tenant over its
//! rate, an unknown host) is answered before the body arrives. hyper then
//! ends the connection after the answer, since the body's bytes would be
//! read as the next request, but the answer was written saying the
//! connection stays open: a client that sends its next request on it in
//! that moment (the official `openai` client does, at once) gets
//! "server disconnected" for a request that never reached the gateway.
//!
//! [`Watched`] hands the handler the body and takes back, when the handler
//! drops it, whatever was left unread; [`settle`] then reads and discards
//! that rest before the answer goes out, as nginx discards the body of a
//! request it refuses, so the connection is kept. A rest too large to read
//! for nothing, one that does not arrive within [`DRAIN_WITHIN`], or one
//! the client waits to be asked for (`Expect: 100-continue`) is not read:
//! the answer says `Connection: close` instead, and the client opens a new
//! connection for its next request.

use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, header};
use http_body::{Body as _, Frame, SizeHint};
use http_body_util::BodyExt as _;
use hyper::body::Incoming;

/// The most of an unread body read for nothing to keep a connection.
pub const DRAIN_MAX_BYTES: u64 = 1 << 20;

/// How long the unread rest of a body may take to arrive.
pub const DRAIN_WITHIN: Duration = Duration::from_secs(2);

/// Where a dropped [`Watched`] leaves its unread rest.
#[derive(Clone, Default)]
pub struct Leftover(Arc<Mutex<Option<Incoming>>>);

impl Leftover {
    /// The unread rest of the body, if its handler left one.
    fn take(&self) -> Option<Incoming> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).take()
    }
}

/// A request body that gives its unread rest back to its [`Leftover`] when
/// dropped.
pub struct Watched {
    inner: Option<Incoming>,
    leftover: Leftover,
}

impl Watched {
    /// `body`, watched; the handle to its rest beside it.
    pub fn new(body: Incoming) -> (Self, Leftover) {
        let leftover = Leftover::default();
        let watched = Watched {
            inner: Some(body),
            leftover: leftover.clone(),
        };
        (watched, leftover)
    }
}

impl http_body::Body for Watched {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        match self.inner.as_mut() {
            Some(body) => Pin::new(body).poll_frame(cx),
            None => Poll::Ready(None),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.as_ref().is_none_or(|b| b.is_end_stream())
    }

    fn size_hint(&self) -> SizeHint {
        self.inner
            .as_ref()
            .map_or_else(|| SizeHint::with_exact(0), |b| b.size_hint())
    }
}

impl Drop for Watched {
    fn drop(&mut self) {
        if let Some(body) = self.inner.take()
            && !body.is_end_stream()
        {
            *self.leftover.0.lock().unwrap_or_else(|e| e.into_inner()) = Some(body);
        }
    }
}

/// What of the request matters to its leftover, read before the handler
/// takes the request.
#[derive(Clone, Copy)]
pub struct Asked {
    /// The client waits for `100 Continue` before it sends the body.
    expects_continue: bool,
}

impl Asked {
    /// What `req` asks that bears on its leftover.
    pub fn of<B>(req: &http::Request<B>) -> Self {
        let expects_continue = req
            .headers()
            .get(header::EXPECT)
            .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"100-continue"));
        Asked { expects_continue }
    }
}

/// `resp`, once the body `leftover` holds (if any) is read to its end;
/// marked `Connection: close` when that rest is not read (see the module's
/// text).
pub async fn settle<B>(
    mut resp: http::Response<B>,
    leftover: &Leftover,
    asked: Asked,
) -> http::Response<B> {
    let Some(rest) = leftover.take() else {
        return resp;
    };
    if resp.headers().contains_key(header::CONNECTION) {
        // The answer ends the connection already (a body too large).
        return resp;
    }
    let kept = !asked.expects_continue
        && tokio::time::timeout(DRAIN_WITHIN, discard(rest, DRAIN_MAX_BYTES))
            .await
            .unwrap_or(false);
    if !kept {
        metrics::counter!("warmgate_unread_bodies_closed_total").increment(1);
        resp.headers_mut()
            .insert(header::CONNECTION, HeaderValue::from_static("close"));
    }
    resp
}

/// Reads `body` to its end, keeping nothing; false if it errs or would
/// pass `max` bytes.
async fn discard<B>(mut body: B, max: u64) -> bool
where
    B: http_body::Body + Unpin,
{
    if body.size_hint().lower() > max {
        return false;
    }
    let mut read = 0u64;
    while let Some(frame) = body.frame().await {
        let Ok(frame) = frame else {
            return false;
        };
        if let Some(data) = frame.data_ref() {
            read += bytes::Buf::remaining(data) as u64;
            if read > max {
                return false;
            }
        }
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::{Full, StreamBody};

    #[tokio::test]
    async fn a_rest_within_the_limit_is_read_and_one_past_it_is_not() {
        assert!(discard(Full::new(Bytes::from_static(b"abc")), 3).await);
        assert!(!discard(Full::new(Bytes::from_static(b"abcd")), 3).await);
        // A body that does not say its length is stopped as it passes.
        let chunks =
            futures_util::stream::iter((0..4).map(|_| {
                Ok::<_, std::convert::Infallible>(Frame::data(Bytes::from_static(b"ab")))
            }));
        assert!(!discard(StreamBody::new(chunks), 7).await);
        let chunks =
            futures_util::stream::iter((0..4).map(|_| {
                Ok::<_, std::convert::Infallible>(Frame::data(Bytes::from_static(b"ab")))
            }));
        assert!(discard(StreamBody::new(chunks), 8).await);
    }

    #[tokio::test]
    async fn an_answer_without_a_leftover_is_left_as_it_is() {
        let resp = settle(
            http::Response::new(()),
            &Leftover::default(),
            Asked {
                expects_continue: false,
            },
        )
        .await;
        assert!(resp.headers().get(header::CONNECTION).is_none());
    }
}
