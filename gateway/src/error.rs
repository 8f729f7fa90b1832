//! The gateway's errors as its code raises them: a kind from a fixed set,
//! a sentence for a person, and what a client may do about it (try again
//! later, or not at all; the request field at fault). Nothing here is
//! HTTP: `http/error.rs` makes an error an answer (its status, the JSON
//! body, the retry headers) at the edge.

use serde::Serialize;

/// The fixed set of error kinds. The kind gives the JSON `kind` field and
/// the metric label, and at the edge the HTTP status (noted on each).
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
    /// 409: the task was cancelled (`DELETE /v1/tasks/{id}`, its batch
    /// cancelled, or its client gone) before it finished.
    Cancelled,
}

impl ErrorKind {
    /// Every kind, for pre-registering metrics.
    pub const ALL: [ErrorKind; 15] = [
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
        ErrorKind::Cancelled,
    ];

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
                | ErrorKind::Cancelled
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
            ErrorKind::Cancelled => "cancelled",
        }
    }
}

/// What caused an error: kept for the logs and `source()`, never sent to
/// a client.
pub type Cause = std::sync::Arc<dyn std::error::Error + Send + Sync + 'static>;

/// An error of the gateway's: what kind, a message for a person, what a
/// client may do about it, and what caused it. Answered at the edge as
/// `{"error": {"kind", "message", "type", "code", "param"}}`
/// (`http/error.rs`); the cause is logged there, not answered.
#[derive(Debug, Clone)]
pub struct Error {
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
    /// The error below this one (an I/O error, SQLite's, a parse), with
    /// its own chain.
    pub cause: Option<Cause>,
}

/// Two errors are equal when a client would see the same answer: the
/// cause is not compared.
impl PartialEq for Error {
    fn eq(&self, other: &Self) -> bool {
        self.kind == other.kind
            && self.message == other.message
            && self.retry_after == other.retry_after
            && self.param == other.param
            && self.no_retry == other.no_retry
    }
}

impl Eq for Error {}

impl Error {
    /// An error of `kind` with `message`.
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Error {
            kind,
            message: message.into(),
            retry_after: None,
            param: None,
            no_retry: false,
            cause: None,
        }
    }

    /// Keeps what caused it (see [`Error::chain`]).
    pub fn caused_by(mut self, cause: impl std::error::Error + Send + Sync + 'static) -> Self {
        self.cause = Some(std::sync::Arc::new(cause));
        self
    }

    /// The message and each cause below it, `: `-separated, for a log line.
    pub fn chain(&self) -> String {
        let mut out = self.message.clone();
        let mut next = std::error::Error::source(self);
        while let Some(e) = next {
            let text = e.to_string();
            // A message that already quotes its cause says it once.
            if !out.ends_with(&text) {
                out.push_str(": ");
                out.push_str(&text);
            }
            next = e.source();
        }
        out
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

impl std::fmt::Display for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.kind.as_str(), self.message)
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.cause
            .as_deref()
            .map(|c| c as &(dyn std::error::Error + 'static))
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
pub(crate) fn body_error(e: &(dyn std::error::Error + 'static)) -> Error {
    let mut cur = Some(e);
    while let Some(err) = cur {
        if let Some(BodyTooLarge(limit)) = err.downcast_ref::<BodyTooLarge>() {
            return too_large(*limit);
        }
        if let Some(idle) = err.downcast_ref::<BodyIdle>() {
            return Error::new(ErrorKind::Timeout, idle.to_string());
        }
        cur = err.source();
    }
    Error::new(ErrorKind::BadRequest, "could not read the request body")
}

pub(crate) fn too_large(limit: u64) -> Error {
    too_large_for(limit, "limits.max_body_bytes")
}

pub(crate) fn too_large_for(limit: u64, key: &str) -> Error {
    Error::new(
        ErrorKind::TooLarge,
        format!("the request body is larger than the limit of {limit} bytes ({key})"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Metric handles are indexed by `kind as usize`: `ALL` must list the
    /// kinds in their declaration order.
    #[test]
    fn the_cause_chain_is_kept_for_the_logs_and_not_compared() {
        let below = Error::new(ErrorKind::Internal, "the journal is full")
            .caused_by(std::io::Error::other("disk full"));
        let e = Error::new(ErrorKind::Internal, "could not save the change").caused_by(below);
        assert_eq!(
            e.chain(),
            "could not save the change: internal: the journal is full: disk full",
            "every level, as each says itself"
        );
        assert!(std::error::Error::source(&e).is_some());
        assert_eq!(
            e,
            Error::new(ErrorKind::Internal, "could not save the change"),
            "a client sees the same answer"
        );
        let quoted = Error::new(ErrorKind::Internal, "could not save: no space")
            .caused_by(std::io::Error::other("no space"));
        assert_eq!(quoted.chain(), "could not save: no space");
    }

    #[test]
    fn all_kinds_are_listed_in_declaration_order() {
        for (i, k) in ErrorKind::ALL.iter().enumerate() {
            assert_eq!(*k as usize, i, "{}", k.as_str());
        }
    }
}
