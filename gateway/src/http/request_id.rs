//! `X-Request-Id`: a client's own (non-empty, at most
//! [`MAX_REQUEST_ID_LEN`] bytes of visible ASCII) is kept, a request
//! without one (or with another) gets 16 hex digits; either is passed on to
//! the worker and echoed on the answer. Tabs, spaces and bytes past ASCII
//! would otherwise reach logs and workers as they came.
//!
//! A tower layer of its own rather than `axum::middleware::from_fn`, which
//! boxes the inner service and its future on every request: this one adds
//! no allocation beyond the id's header value.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use axum::extract::Request;
use axum::response::Response;
use http::HeaderValue;

use crate::server::{MAX_REQUEST_ID_LEN, X_REQUEST_ID};

/// Wraps a service in [`RequestId`].
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct RequestIdLayer;

impl<S> tower::Layer<S> for RequestIdLayer {
    type Service = RequestId<S>;

    fn layer(&self, inner: S) -> RequestId<S> {
        RequestId { inner }
    }
}

/// Sets `X-Request-Id` on the request when missing, and on its answer.
#[derive(Debug, Clone)]
pub(crate) struct RequestId<S> {
    inner: S,
}

impl<S> tower::Service<Request> for RequestId<S>
where
    S: tower::Service<Request, Response = Response>,
{
    type Response = Response;
    type Error = S::Error;
    type Future = WithId<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: Request) -> Self::Future {
        let id = assign(&mut req);
        WithId::new(self.inner.call(req), id)
    }
}

/// The request's id, set on it first when it has none (or one that is
/// empty or too long): what its answer must carry.
pub(crate) fn assign(req: &mut Request) -> HeaderValue {
    match req.headers().get(X_REQUEST_ID) {
        Some(v)
            if !v.is_empty()
                && v.len() <= MAX_REQUEST_ID_LEN
                && v.as_bytes().iter().all(u8::is_ascii_graphic) =>
        {
            v.clone()
        }
        _ => {
            // Made twice rather than cloned: a clone of a fresh header
            // value allocates as much as a second one.
            let n = fastrand::u64(..);
            req.headers_mut().insert(X_REQUEST_ID, hex_id(n));
            hex_id(n)
        }
    }
}

pin_project_lite::pin_project! {
    /// The inner service's answer, with the request's id set on it.
    pub(crate) struct WithId<F> {
        #[pin]
        inner: F,
        id: Option<HeaderValue>,
    }
}

impl<F> WithId<F> {
    /// `inner`'s answer, to carry `id`.
    pub(crate) fn new(inner: F, id: HeaderValue) -> Self {
        WithId {
            inner,
            id: Some(id),
        }
    }
}

impl<F, E> Future for WithId<F>
where
    F: Future<Output = Result<Response, E>>,
{
    type Output = Result<Response, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let mut resp = std::task::ready!(this.inner.poll(cx))?;
        if let Some(id) = this.id.take() {
            resp.headers_mut().insert(X_REQUEST_ID, id);
        }
        Poll::Ready(Ok(resp))
    }
}

/// `n` as 16 lowercase hex digits.
fn hex_id(n: u64) -> HeaderValue {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut buf = [0u8; 16];
    for (i, b) in buf.iter_mut().enumerate() {
        *b = HEX[((n >> (60 - 4 * i)) & 0xf) as usize];
    }
    HeaderValue::from_bytes(&buf).expect("hex is a valid header value")
}

#[cfg(test)]
mod tests {
    use super::*;
    use tower::{Layer as _, ServiceExt as _};

    #[test]
    fn request_ids_are_sixteen_hex_digits() {
        assert_eq!(hex_id(0), "0000000000000000");
        assert_eq!(hex_id(0x0123_4567_89ab_cdef), "0123456789abcdef");
        assert_eq!(hex_id(u64::MAX), "ffffffffffffffff");
    }

    /// Answers with the id the request carried, in its body.
    fn echo() -> impl tower::Service<
        Request,
        Response = Response,
        Error = std::convert::Infallible,
        Future = impl Send,
    > + Clone {
        tower::service_fn(|req: Request| async move {
            let seen = req
                .headers()
                .get(X_REQUEST_ID)
                .map(|v| v.to_str().unwrap_or("").to_string())
                .unwrap_or_default();
            Ok::<_, std::convert::Infallible>(Response::new(axum::body::Body::from(seen)))
        })
    }

    async fn call(id: Option<&str>) -> (String, String) {
        let mut req = Request::new(axum::body::Body::empty());
        if let Some(id) = id {
            req.headers_mut()
                .insert(X_REQUEST_ID, HeaderValue::from_str(id).unwrap());
        }
        let resp = RequestIdLayer.layer(echo()).oneshot(req).await.unwrap();
        let answered = resp.headers()[X_REQUEST_ID].to_str().unwrap().to_string();
        let body = axum::body::to_bytes(resp.into_body(), 1024).await.unwrap();
        (answered, String::from_utf8(body.to_vec()).unwrap())
    }

    #[tokio::test]
    async fn a_client_s_id_is_kept_and_a_missing_or_oversized_one_replaced() {
        let (answered, seen) = call(Some("abc-123")).await;
        assert_eq!((answered.as_str(), seen.as_str()), ("abc-123", "abc-123"));
        for bad in [
            None,
            Some(""),
            Some(&*"x".repeat(MAX_REQUEST_ID_LEN + 1)),
            Some("a\tb"),
            Some("a b"),
        ] {
            let (answered, seen) = call(bad).await;
            assert_eq!(answered, seen, "the worker and the client see the same id");
            assert_eq!(answered.len(), 16, "{answered}");
            assert!(answered.bytes().all(|b| b.is_ascii_hexdigit()));
        }
    }
}
