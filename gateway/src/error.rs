//! The errors clients see: a fixed set of kinds, each with its HTTP status.

use axum::Json;
use axum::response::{IntoResponse, Response};
use http::{HeaderValue, StatusCode, header};
use serde::Serialize;

/// The fixed set of error kinds. The kind gives the HTTP status, the JSON
/// `kind` field and the metric label.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorKind {
    /// 400: the request is malformed.
    BadRequest,
    /// 401: a bearer token is missing or wrong.
    Unauthorized,
    /// 404: no such app, model or route.
    NotFound,
    /// 405: the route exists but not for this method.
    MethodNotAllowed,
    /// 421: the request names a `Host` this gateway does not serve
    /// (`[access] allowed_hosts`).
    MisdirectedRequest,
    /// 409: the request clashes with the current state (an older weights
    /// version, a sync already running).
    Conflict,
    /// 413: the body is over the size limit.
    TooLarge,
    /// 429: the hold queue is full.
    QueueFull,
    /// 429: the tenant is over one of its quotas (in flight, pending, rate).
    QuotaExceeded,
    /// 502: the replica failed (refused, crashed, or failed to start).
    ReplicaFailed,
    /// 503: no capacity can be had now.
    NoCapacity,
    /// 503: the app is starting and cannot hold more requests.
    Starting,
    /// 504: a held request waited longer than the queue timeout.
    Timeout,
    /// 500: the gateway failed on its side (e.g. its state could not be
    /// saved); nothing the request asked for was done.
    Internal,
}

impl ErrorKind {
    /// Every kind, for pre-registering metrics.
    pub const ALL: [ErrorKind; 14] = [
        ErrorKind::BadRequest,
        ErrorKind::Unauthorized,
        ErrorKind::NotFound,
        ErrorKind::MethodNotAllowed,
        ErrorKind::MisdirectedRequest,
        ErrorKind::Conflict,
        ErrorKind::TooLarge,
        ErrorKind::QueueFull,
        ErrorKind::QuotaExceeded,
        ErrorKind::ReplicaFailed,
        ErrorKind::NoCapacity,
        ErrorKind::Starting,
        ErrorKind::Timeout,
        ErrorKind::Internal,
    ];

    /// The HTTP status.
    pub fn status(self) -> StatusCode {
        match self {
            ErrorKind::BadRequest => StatusCode::BAD_REQUEST,
            ErrorKind::Unauthorized => StatusCode::UNAUTHORIZED,
            ErrorKind::NotFound => StatusCode::NOT_FOUND,
            ErrorKind::MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
            ErrorKind::MisdirectedRequest => StatusCode::MISDIRECTED_REQUEST,
            ErrorKind::Conflict => StatusCode::CONFLICT,
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

    /// Whether trying the same request again can help. Where it cannot,
    /// the answer says `x-should-retry: false`, which the OpenAI clients
    /// obey (they retry 408, 409, 429 and 5xx twice otherwise): a request
    /// that waited out `queue.timeout` would wait it out again.
    pub fn retryable(self) -> bool {
        !matches!(
            self,
            ErrorKind::BadRequest
                | ErrorKind::Unauthorized
                | ErrorKind::NotFound
                | ErrorKind::MethodNotAllowed
                | ErrorKind::MisdirectedRequest
                | ErrorKind::TooLarge
                | ErrorKind::Timeout
        )
    }

    /// The JSON `kind` and metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorKind::BadRequest => "bad_request",
            ErrorKind::Unauthorized => "unauthorized",
            ErrorKind::NotFound => "not_found",
            ErrorKind::MethodNotAllowed => "method_not_allowed",
            ErrorKind::MisdirectedRequest => "misdirected_request",
            ErrorKind::Conflict => "conflict",
            ErrorKind::TooLarge => "too_large",
            ErrorKind::QueueFull => "queue_full",
            ErrorKind::QuotaExceeded => "quota_exceeded",
            ErrorKind::ReplicaFailed => "replica_failed",
            ErrorKind::NoCapacity => "no_capacity",
            ErrorKind::Starting => "starting",
            ErrorKind::Timeout => "timeout",
            ErrorKind::Internal => "internal",
        }
    }
}

/// An error answered to a client as `{"error": {"kind", "message", "type",
/// "code", "param"}}`: `kind` and `message` are warmgate's, `type`, `code`
/// (= `kind`) and `param` are what OpenAI clients read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    /// What went wrong, from the fixed set.
    pub kind: ErrorKind,
    /// A sentence for a person, free of internals.
    pub message: String,
    /// Seconds for `Retry-After`, when trying again later can work.
    pub retry_after: Option<u64>,
    /// The request field at fault, when there is one (`model`).
    pub param: Option<&'static str>,
    /// Trying again now cannot help, whatever the kind (a worker in a
    /// crash loop): the answer says `x-should-retry: false`.
    pub no_retry: bool,
}

impl ApiError {
    /// An error of `kind` with `message`.
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        ApiError {
            kind,
            message: message.into(),
            retry_after: None,
            param: None,
            no_retry: false,
        }
    }

    /// Says that trying again now cannot help (`x-should-retry: false`).
    pub fn no_retry(mut self) -> Self {
        self.no_retry = true;
        self
    }

    /// Names the request field at fault.
    pub fn param(mut self, field: &'static str) -> Self {
        self.param = Some(field);
        self
    }

    /// Adds a `Retry-After` of at least one second.
    pub fn retry_after(mut self, secs: u64) -> Self {
        self.retry_after = Some(secs.max(1));
        self
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.kind.as_str(), self.message)
    }
}

impl std::error::Error for ApiError {}

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

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
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

/// Marks a body that broke the size limit, so the proxy can answer 413.
#[derive(Debug)]
pub struct BodyTooLarge(pub u64);

impl std::fmt::Display for BodyTooLarge {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "the request body is larger than {} bytes", self.0)
    }
}

impl std::error::Error for BodyTooLarge {}

/// Marks a streamed request body that moved no byte for this long.
#[derive(Debug)]
pub struct BodyIdle(pub std::time::Duration);

impl std::fmt::Display for BodyIdle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "the request body sent no byte for {} (limits.idle_timeout)",
            humantime::format_duration(self.0)
        )
    }
}

impl std::error::Error for BodyIdle {}

/// The error for a request body that could not be read: too large when
/// it ran past its limit, else a bad request.
pub(crate) fn body_error(e: &axum::Error) -> ApiError {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = cur {
        if let Some(BodyTooLarge(limit)) = err.downcast_ref::<BodyTooLarge>() {
            return too_large(*limit);
        }
        if let Some(idle) = err.downcast_ref::<BodyIdle>() {
            return ApiError::new(ErrorKind::Timeout, idle.to_string());
        }
        cur = err.source();
    }
    ApiError::new(ErrorKind::BadRequest, "could not read the request body")
}

pub(crate) fn too_large(limit: u64) -> ApiError {
    too_large_for(limit, "limits.max_body_bytes")
}

pub(crate) fn too_large_for(limit: u64, key: &str) -> ApiError {
    ApiError::new(
        ErrorKind::TooLarge,
        format!("the request body is larger than the limit of {limit} bytes ({key})"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_body_too_large_ends_its_connection_and_nothing_else_does() {
        for kind in ErrorKind::ALL {
            let resp = ApiError::new(kind, "x").into_response();
            let close = resp.headers().get(header::CONNECTION).map(|v| v.as_bytes());
            let expected = (kind == ErrorKind::TooLarge).then_some(&b"close"[..]);
            assert_eq!(close, expected, "{kind:?}");
        }
    }

    /// Metric handles are indexed by `kind as usize`: `ALL` must list the
    /// kinds in their declaration order.
    #[test]
    fn all_kinds_are_listed_in_declaration_order() {
        for (i, k) in ErrorKind::ALL.iter().enumerate() {
            assert_eq!(*k as usize, i, "{}", k.as_str());
        }
    }
}
