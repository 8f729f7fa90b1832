//! Forwarding a request to a replica and streaming the answer back,
//! the slot held until the answer's body ends.

use std::future::Future as _;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName};
use http::{Request, Response, Uri};
use http_body::{Body as HttpBody, Frame, SizeHint};

use std::sync::Arc;

use warmgate_pool::ReplicaHandle;

use super::outlier::Cause;
use crate::error::{Error, ErrorKind};
use crate::upstream::{Returned, SendError, Upstream};

/// A slot on a replica, freed when dropped: an app revision's
/// ([`SlotGuard`](super::dispatch::SlotGuard)) or a shared pool's.
pub trait Slot: Send + Sync + Unpin + 'static {
    /// The replica the slot is on.
    fn replica(&self) -> &Arc<ReplicaHandle>;
    /// The request is being forwarded now.
    fn note_forward(&self) {}
    /// The answer's first byte (or its end, when it has none) has passed.
    fn first_byte(&self) {}
    /// A connection to the replica failed: take it out of rotation until
    /// it answers its probe (see [`super::outlier`]).
    fn eject(&self, _cause: Cause) {}
}

/// Sends `req` to the slot's replica at `path_and_query`. The answer's
/// body holds the slot until it has been streamed to the end, or until the
/// replica sends no byte of it for [`Upstream::answer_idle`]
/// (`limits.idle_timeout`, as nginx's `proxy_read_timeout`): a worker hung
/// mid-stream gives its slot back, and the client sees its stream cut.
pub async fn forward<S: Slot>(
    upstream: &Upstream,
    mut req: Request<Body>,
    path_and_query: &str,
    slot: S,
) -> Result<Response<Body>, Forward> {
    let replica = slot.replica().clone();
    let uri = http::uri::PathAndQuery::try_from(path_and_query)
        .map(Uri::from)
        .map_err(|_| {
            Forward::Failed(Error::new(
                ErrorKind::BadRequest,
                "the request path is not valid",
            ))
        })?;
    *req.uri_mut() = uri;
    *req.version_mut() = http::Version::HTTP_11;
    strip_hop_by_hop(req.headers_mut());
    req.headers_mut().remove(header::HOST);
    slot.note_forward();
    let resp = match upstream.send_to(&replica.addr, req).await {
        Ok(r) => r,
        Err(failed) => {
            let err = upstream_error(&failed.error, &replica.id, replica.target.owner());
            if let Some(cause) = replica_at_fault(&failed.error) {
                slot.eject(cause);
            }
            return Err(match failed.unsent {
                Some(req) => Forward::Refused(err, req, replica.clone()),
                None => Forward::Failed(err),
            });
        }
    };
    let (mut parts, body) = resp.into_parts();
    strip_hop_by_hop(&mut parts.headers);
    // An app's answer shares the gateway's origin with the dashboard, which
    // keeps the admin token: it may not widen a service worker's scope to
    // the whole origin (`/ui` included).
    parts.headers.remove(SERVICE_WORKER_ALLOWED);
    let body = Body::new(GuardedBody {
        inner: body,
        slot: Some(slot),
        first: true,
        idle: IdleTimer::new(upstream.answer_idle()),
    });
    Ok(Response::from_parts(parts, body))
}

/// Why a forward failed.
#[derive(Debug)]
pub enum Forward {
    /// The replica could not be connected to: nothing was sent, and here
    /// is the request to send to another replica, and the one that refused.
    Refused(Error, Box<Request<Body>>, Arc<ReplicaHandle>),
    /// The request failed after it was (or may have been) sent.
    Failed(Error),
}

impl Forward {
    /// The error the client sees if no retry is made.
    pub fn into_error(self) -> Error {
        match self {
            Forward::Refused(e, ..) | Forward::Failed(e) => e,
        }
    }
}

pub use crate::error::{BodyIdle, BodyTooLarge};

/// Whether a failed send was the replica's connection failing (and how),
/// not the request's own body (too large, stalled, broken off).
fn replica_at_fault(e: &SendError) -> Option<Cause> {
    if e.is_connect() {
        return Some(Cause::Refused);
    }
    let mut chain = std::iter::successors(Some(e as &(dyn std::error::Error + 'static)), |e| {
        e.source()
    });
    let the_request =
        chain.any(|e| e.is::<BodyTooLarge>() || e.is::<BodyIdle>() || e.is::<axum::Error>());
    (!the_request).then_some(Cause::Broke)
}

fn upstream_error(e: &SendError, replica: &str, app: &str) -> Error {
    let chain = || {
        std::iter::successors(Some(e as &(dyn std::error::Error + 'static)), |e| {
            e.source()
        })
    };
    if let Some(too_large) = chain().find_map(|e| e.downcast_ref::<BodyTooLarge>()) {
        return Error::new(ErrorKind::TooLarge, too_large.to_string());
    }
    if let Some(idle) = chain().find_map(|e| e.downcast_ref::<BodyIdle>()) {
        return Error::new(ErrorKind::Timeout, idle.to_string());
    }
    // The client's body broke off while it streamed to the replica.
    if chain().any(|e| e.is::<axum::Error>()) {
        return Error::new(ErrorKind::BadRequest, "could not read the request body");
    }
    if e.is_connect() {
        tracing::warn!(%replica, %app, error = %e, "replica refused the connection");
        return Error::new(
            ErrorKind::ReplicaFailed,
            format!("replica {replica} of app '{app}' refused the connection"),
        );
    }
    tracing::warn!(%replica, %app, error = %warmgate_pool::probe::error_chain(e), "replica failed before answering");
    Error::new(
        ErrorKind::ReplicaFailed,
        format!(
            "replica {replica} of app '{app}' closed the connection before answering: it stopped or failed with this request sent, which it may or may not have begun; send it again if it is safe to repeat"
        ),
    )
}

/// The header that lets a service worker control paths above its script's.
const SERVICE_WORKER_ALLOWED: &str = "service-worker-allowed";

/// Removes the headers that belong to one connection, not to the message
/// (RFC 9110 §7.6.1), including any named by `Connection`.
pub(crate) fn strip_hop_by_hop(headers: &mut HeaderMap) {
    if headers.contains_key(header::CONNECTION) {
        strip_connection_named(headers);
    }
    for name in [
        header::CONNECTION,
        header::TE,
        header::TRAILER,
        header::TRANSFER_ENCODING,
        header::UPGRADE,
        header::PROXY_AUTHORIZATION,
        header::PROXY_AUTHENTICATE,
    ] {
        headers.remove(name);
    }
    headers.remove("keep-alive");
    headers.remove("proxy-connection");
}

/// Removes the headers that `Connection` names, except those the gateway
/// sets itself or the message needs: a client must not be able to strip
/// the tenant the gateway vouches for, the request id, the trace context
/// or the body's framing by naming them.
fn strip_connection_named(headers: &mut HeaderMap) {
    let named: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|name| HeaderName::from_bytes(name.trim().as_bytes()).ok())
        .filter(|name| !kept_end_to_end(name))
        .collect();
    for name in named {
        headers.remove(name);
    }
}

/// Whether `name` stays even when `Connection` names it.
fn kept_end_to_end(name: &HeaderName) -> bool {
    let n = name.as_str();
    n.starts_with("x-warmgate-")
        || n == "x-request-id"
        || *name == crate::trace::TRACEPARENT
        || n == "tracestate"
        || *name == header::CONTENT_LENGTH
        || *name == header::CONTENT_TYPE
}

/// A response body that frees its slot when it ends, fails or is dropped
/// (the client went away), and fails when the replica sends nothing for
/// `idle` while the client waits for more.
struct GuardedBody<S> {
    inner: Returned,
    slot: Option<S>,
    /// No byte of the body has passed yet.
    first: bool,
    /// Runs while the replica keeps the body waiting; never polled while
    /// the client is the slow one (hyper asks for the next frame only once
    /// it wrote the last).
    idle: IdleTimer,
}

/// A replica that sent no byte of its answer for `limits.idle_timeout`.
#[derive(Debug)]
struct AnswerIdle {
    replica: String,
    idle: Duration,
}

impl std::fmt::Display for AnswerIdle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "replica {} sent no byte of its answer for {} (limits.idle_timeout)",
            self.replica,
            humantime::format_duration(self.idle)
        )
    }
}

impl std::error::Error for AnswerIdle {}

/// Pauses of a body, measured while it is polled and has nothing: armed
/// the first time it waits (a body that arrived whole never needs one),
/// pushed back after each frame.
struct IdleTimer {
    idle: Duration,
    timer: Option<Pin<Box<tokio::time::Sleep>>>,
    moved: bool,
}

impl IdleTimer {
    fn new(idle: Duration) -> Self {
        IdleTimer {
            idle,
            timer: None,
            moved: false,
        }
    }

    /// A frame passed.
    fn moved(&mut self) {
        self.moved = true;
    }

    /// The body is waiting: whether it has waited `idle` since it last
    /// moved (and if not, `cx` is woken when it has).
    fn expired(&mut self, cx: &mut Context<'_>) -> bool {
        let idle = self.idle;
        let timer = self
            .timer
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(idle)));
        if std::mem::take(&mut self.moved) {
            timer.as_mut().reset(tokio::time::Instant::now() + idle);
        }
        timer.as_mut().poll(cx).is_ready()
    }
}

impl<S: Slot> HttpBody for GuardedBody<S> {
    type Data = Bytes;
    type Error = Box<dyn std::error::Error + Send + Sync>;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        if self.first {
            let first_byte = match &polled {
                Poll::Ready(Some(Ok(frame))) => frame.data_ref().is_some_and(|d| !d.is_empty()),
                Poll::Ready(None) => true,
                _ => false,
            };
            if first_byte {
                self.first = false;
                if let Some(slot) = &self.slot {
                    slot.first_byte();
                }
            }
        }
        match polled {
            Poll::Ready(Some(Ok(frame))) => {
                self.idle.moved();
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(None) => {
                self.slot = None;
                Poll::Ready(None)
            }
            Poll::Ready(Some(Err(e))) => {
                if let Some(slot) = &self.slot {
                    tracing::warn!(
                        replica = %slot.replica().id,
                        error = %e,
                        "replica failed mid-response"
                    );
                    slot.eject(Cause::Broke);
                }
                self.slot = None;
                Poll::Ready(Some(Err(Box::new(e))))
            }
            Poll::Pending => {
                if self.slot.is_none() || !self.idle.expired(cx) {
                    return Poll::Pending;
                }
                let Some(slot) = self.slot.take() else {
                    return Poll::Pending;
                };
                let err = AnswerIdle {
                    replica: slot.replica().id.to_string(),
                    idle: self.idle.idle,
                };
                tracing::warn!(error = %err, "cut off a stalled answer");
                metrics::counter!("warmgate_stalled_answers_total").increment(1);
                drop(slot);
                Poll::Ready(Some(Err(Box::new(err))))
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// A request body that fails once more than `limit` bytes have passed, or
/// when it moves no byte for `idle` (`limits.idle_timeout`): a client
/// trickling a streamed body cannot hold a replica's slot for longer.
pub struct LimitedBody {
    inner: Body,
    limit: u64,
    seen: u64,
    idle: IdleTimer,
}

impl LimitedBody {
    /// Wraps `inner`, allowing at most `limit` bytes and pauses of `idle`.
    pub fn new(inner: Body, limit: u64, idle: Duration) -> Self {
        LimitedBody {
            inner,
            limit,
            seen: 0,
            idle: IdleTimer::new(idle),
        }
    }
}

impl HttpBody for LimitedBody {
    type Data = Bytes;
    type Error = Box<dyn std::error::Error + Send + Sync>;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        match Pin::new(&mut self.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref() {
                    self.seen += data.len() as u64;
                    if self.seen > self.limit {
                        return Poll::Ready(Some(Err(Box::new(BodyTooLarge(self.limit)))));
                    }
                }
                self.idle.moved();
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(e))) => Poll::Ready(Some(Err(Box::new(e)))),
            Poll::Ready(None) => Poll::Ready(None),
            Poll::Pending if self.idle.expired(cx) => {
                Poll::Ready(Some(Err(Box::new(BodyIdle(self.idle.idle)))))
            }
            Poll::Pending => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}
