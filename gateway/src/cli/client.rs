//! The API client of the client commands: one call to the gateway's API,
//! its errors and their exit codes.

use std::path::PathBuf;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::BodyExt;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::Value;

use super::{EXIT_UNAVAILABLE, EXIT_USAGE};

/// The CA file `--cacert` named, for every call this CLI process makes.
pub(super) static CACERT: std::sync::OnceLock<Option<PathBuf>> = std::sync::OnceLock::new();

/// Why a call to the gateway's API failed, and the exit code each class
/// gets (from sysexits.h), so scripts can tell "fix the request" from
/// "try again" from "unreachable".
#[derive(Debug, thiserror::Error)]
pub enum CallError {
    /// No answer: the gateway is down, the address is wrong, or it timed
    /// out. Exit 69 (`EX_UNAVAILABLE`).
    #[error("{0}")]
    Unreachable(String),
    /// The gateway answered with an error status.
    #[error("{url} answered {status}: {message}")]
    Answered {
        /// What was called.
        url: String,
        /// The HTTP status.
        status: u16,
        /// The gateway's `error.message`.
        message: String,
    },
    /// The answer was not what the API returns (not JSON). Exit 76
    /// (`EX_PROTOCOL`).
    #[error("{0}")]
    Protocol(String),
    /// The command line itself is wrong (a `--gateway` that is not a URL,
    /// a token that cannot be sent). Exit 64 (`EX_USAGE`).
    #[error("{0}")]
    Usage(String),
}

impl CallError {
    /// The process exit code:
    /// - 65 (`EX_DATAERR`): the request was refused as it stands (400,
    ///   405, 413, 422);
    /// - 66 (`EX_NOINPUT`): no such app, pool, task or revision (404);
    /// - 69 (`EX_UNAVAILABLE`): no answer;
    /// - 70 (`EX_SOFTWARE`): the gateway or a worker failed (500, 502);
    /// - 75 (`EX_TEMPFAIL`): try again later (409 while a promotion runs,
    ///   429, 503, 504);
    /// - 64 (`EX_USAGE`): the command line is wrong (`--gateway` is not
    ///   an `http://` or `https://` URL);
    /// - 76 (`EX_PROTOCOL`): the answer was not the API's;
    /// - 77 (`EX_NOPERM`): a token is missing or wrong (401, 403).
    pub fn exit_code(&self) -> i32 {
        match self {
            CallError::Unreachable(_) => EXIT_UNAVAILABLE,
            CallError::Usage(_) => EXIT_USAGE,
            CallError::Protocol(_) => 76,
            CallError::Answered { status, .. } => match status {
                401 | 403 => 77,
                404 => 66,
                409 | 429 | 503 | 504 => 75,
                400..=499 => 65,
                _ => 70,
            },
        }
    }
}

/// The single-threaded runtime a client command runs on; exit 70 when
/// it cannot be had.
pub(super) fn client_runtime() -> Result<tokio::runtime::Runtime, i32> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| {
            eprintln!("error: could not start a runtime: {e}");
            70
        })
}

pub(super) async fn get_json(gateway: &str, path: &str) -> Result<Value, CallError> {
    call(
        gateway,
        http::Method::GET,
        path,
        None,
        Duration::from_secs(10),
    )
    .await
}

/// One call to the gateway's API; a non-2xx answer is an error with the
/// gateway's message.
async fn call(
    gateway: &str,
    method: http::Method,
    path: &str,
    body: Option<Value>,
    timeout: Duration,
) -> Result<Value, CallError> {
    check_gateway_url(gateway)?;
    let url = format!("{}{path}", gateway.trim_end_matches('/'));
    let client = http_client(gateway)?;
    let bytes = body.map_or_else(Bytes::new, |b| Bytes::from(b.to_string()));
    let mut req = http::Request::builder()
        .method(method)
        .uri(&url)
        .header(http::header::CONTENT_TYPE, "application/json")
        .body(http_body_util::Full::new(bytes))
        .map_err(|e| CallError::Unreachable(format!("bad gateway URL {url:?}: {e}")))?;
    // The token given, else a tenant's API key given (for what a tenant
    // may read: its usage, its tasks), else the one a gateway of this
    // user made for itself and published for its address.
    let given = |var: &str| std::env::var(var).ok().filter(|t| !t.is_empty());
    let token = given("WARMGATE_ADMIN_TOKEN")
        .or_else(|| given("WARMGATE_API_KEY"))
        .or_else(|| crate::runtime::admin_token::find_for(gateway));
    if let Some(token) = token {
        let v = http::HeaderValue::from_str(&format!("Bearer {token}")).map_err(|_| {
            CallError::Usage(
                "the token (WARMGATE_ADMIN_TOKEN or WARMGATE_API_KEY) is not a valid header value"
                    .into(),
            )
        })?;
        req.headers_mut().insert(http::header::AUTHORIZATION, v);
    }
    let resp = tokio::time::timeout(timeout, client.request(req))
        .await
        .map_err(|_| {
            CallError::Unreachable(format!(
                "{url} did not answer within {}",
                humantime::format_duration(timeout)
            ))
        })?
        .map_err(|e| {
            CallError::Unreachable(format!(
                "cannot reach the gateway at {gateway} (is `warmgate serve` running? set WARMGATE_GATEWAY): {}",
                warmgate_pool::probe::error_chain(&e)
            ))
        })?;
    let status = resp.status();
    let body = resp
        .into_body()
        .collect()
        .await
        .map_err(|e| CallError::Unreachable(format!("{url}: the answer broke off: {e}")))?
        .to_bytes();
    let v: Option<Value> = serde_json::from_slice(&body).ok();
    if !status.is_success() {
        let message = v
            .as_ref()
            .and_then(|v| v["error"]["message"].as_str())
            .map_or_else(
                || String::from_utf8_lossy(&body[..body.len().min(200)]).into_owned(),
                str::to_string,
            );
        return Err(CallError::Answered {
            url,
            status: status.as_u16(),
            message,
        });
    }
    v.ok_or_else(|| CallError::Protocol(format!("{url}: the answer is not JSON")))
}

/// A client for `gateway`: plain HTTP, or HTTPS trusting the system's
/// roots and `--cacert`.
fn http_client(
    gateway: &str,
) -> Result<
    Client<
        hyper_rustls::HttpsConnector<hyper_util::client::legacy::connect::HttpConnector>,
        http_body_util::Full<Bytes>,
    >,
    CallError,
> {
    let https = gateway.starts_with("https://");
    let cacert = CACERT.get().and_then(Option::as_deref).filter(|_| https);
    let tls = crate::tls::client_config(cacert, https)
        .map_err(|e| CallError::Unreachable(format!("--cacert: {e}")))?;
    let builder = hyper_rustls::HttpsConnectorBuilder::new().with_tls_config(tls);
    let connector = if https {
        builder.https_only()
    } else {
        builder.https_or_http()
    }
    .enable_http1()
    .build();
    Ok(Client::builder(TokioExecutor::new()).build(connector))
}

/// Runs one API call on a small runtime; prints errors; returns the exit
/// code and the answer.
pub(super) fn api(
    gateway: &str,
    method: http::Method,
    path: &str,
    body: Option<Value>,
    timeout: Duration,
) -> Result<Value, i32> {
    block_on_call(gateway, method, path, body, timeout).map_err(|e| {
        eprintln!("error: {e}");
        e.exit_code()
    })
}

/// `--gateway` (or `$WARMGATE_GATEWAY`) must be an `http://` or
/// `https://` URL with a host: `localhost:8000` alone is a usage error,
/// not an unreachable gateway.
fn check_gateway_url(gateway: &str) -> Result<(), CallError> {
    let uri: Result<http::Uri, _> = gateway.parse();
    let ok = uri
        .is_ok_and(|u| matches!(u.scheme_str(), Some("http" | "https")) && u.authority().is_some());
    if ok {
        Ok(())
    } else {
        Err(CallError::Usage(format!(
            "--gateway {gateway:?} is not a URL: give http://HOST:PORT (or https://)"
        )))
    }
}

/// One API call on a small runtime of its own.
pub(super) fn block_on_call(
    gateway: &str,
    method: http::Method,
    path: &str,
    body: Option<Value>,
    timeout: Duration,
) -> Result<Value, CallError> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| CallError::Unreachable(format!("could not start a runtime: {e}")))?;
    rt.block_on(call(gateway, method, path, body, timeout))
}
