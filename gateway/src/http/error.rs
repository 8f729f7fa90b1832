//! An error made an HTTP answer, here at the edge only: the kind's status
//! and OpenAI error type, the JSON body, and the headers that tell a
//! client whether and when to try again.

use axum::Json;
use axum::response::{IntoResponse, Response};
use http::{HeaderValue, StatusCode, header};
use serde::Serialize;

use crate::error::{Error, ErrorKind};

impl ErrorKind {
    /// The HTTP status.
    pub fn status(self) -> StatusCode {
        match self {
            ErrorKind::BadRequest => StatusCode::BAD_REQUEST,
            ErrorKind::Unauthorized => StatusCode::UNAUTHORIZED,
            ErrorKind::NotFound => StatusCode::NOT_FOUND,
            ErrorKind::MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
            ErrorKind::MisdirectedRequest => StatusCode::MISDIRECTED_REQUEST,
            ErrorKind::Conflict | ErrorKind::Cancelled => StatusCode::CONFLICT,
            ErrorKind::TooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            ErrorKind::QueueFull | ErrorKind::QuotaExceeded => StatusCode::TOO_MANY_REQUESTS,
            ErrorKind::ReplicaFailed => StatusCode::BAD_GATEWAY,
            ErrorKind::NoCapacity | ErrorKind::Starting => StatusCode::SERVICE_UNAVAILABLE,
            ErrorKind::Timeout => StatusCode::GATEWAY_TIMEOUT,
            ErrorKind::Internal => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// The OpenAI error `type` clients sort errors by.
    pub fn openai_type(self) -> &'static str {
        match self {
            ErrorKind::BadRequest
            | ErrorKind::NotFound
            | ErrorKind::MethodNotAllowed
            | ErrorKind::MisdirectedRequest
            | ErrorKind::Conflict
            | ErrorKind::Cancelled
            | ErrorKind::TooLarge => "invalid_request_error",
            ErrorKind::Unauthorized => "authentication_error",
            ErrorKind::QueueFull | ErrorKind::QuotaExceeded => "rate_limit_error",
            ErrorKind::ReplicaFailed
            | ErrorKind::NoCapacity
            | ErrorKind::Starting
            | ErrorKind::Timeout
            | ErrorKind::Internal => "server_error",
        }
    }
}

#[derive(Serialize)]
struct Body<'a> {
    error: Inner<'a>,
}

#[derive(Serialize)]
struct Inner<'a> {
    kind: &'static str,
    message: &'a str,
    #[serde(rename = "type")]
    kind_type: &'static str,
    code: &'static str,
    param: Option<&'static str>,
}

impl IntoResponse for Error {
    fn into_response(self) -> Response {
        // The cause is for the operator, not the client.
        if self.cause.is_some() {
            tracing::warn!(kind = self.kind.as_str(), error = %self.chain(), "answered an error");
        }
        let body = Body {
            error: Inner {
                kind: self.kind.as_str(),
                message: &self.message,
                kind_type: self.kind.openai_type(),
                code: self.kind.as_str(),
                param: self.param,
            },
        };
        let mut resp = (self.kind.status(), Json(body)).into_response();
        if !self.kind.retryable() || self.no_retry {
            resp.headers_mut().insert(
                http::HeaderName::from_static("x-should-retry"),
                HeaderValue::from_static("false"),
            );
        }
        if let Some(secs) = self.retry_after {
            resp.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        // The rest of a body too large is left unread, so the connection
        // ends with this answer; said in advance, a client does not send
        // its next request on it as it closes.
        if self.kind == ErrorKind::TooLarge {
            resp.headers_mut()
                .insert(header::CONNECTION, HeaderValue::from_static("close"));
        }
        resp.extensions_mut().insert(self.kind);
        resp
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_body_too_large_ends_its_connection_and_nothing_else_does() {
        for kind in ErrorKind::ALL {
            let resp = Error::new(kind, "x").into_response();
            let close = resp.headers().get(header::CONNECTION).map(|v| v.as_bytes());
            let expected = (kind == ErrorKind::TooLarge).then_some(&b"close"[..]);
            assert_eq!(close, expected, "{kind:?}");
        }
    }
}
