//! The gateway's HTTP client to workers and hooks. Forwarded requests and
//! tasks to `/invoke` go to a replica's address over [`conns`], the
//! gateway's own keep-alive connections per replica; weights to
//! `/weights`, promotion hooks and calls to the leader go through a
//! generic pooled client, since they name URLs.

pub mod conns;
pub mod vllm;

use std::sync::Arc;
use std::time::Duration;
use warmgate_pool::Endpoint;

use axum::body::Body;
use http::header;
use http::{Request, Response};
use http_body_util::{BodyExt as _, Limited};
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

/// Idle upstream connections are kept this long: under the keep-alive
/// timeout of the common worker servers (uvicorn's, and so vLLM's, is 5 s),
/// so the gateway closes an idle connection before the worker does. A
/// request sent on a connection the worker is closing at that moment has
/// been written and cannot be retried safely: it would fail with a 502.
const POOL_IDLE_TIMEOUT: Duration = Duration::from_secs(4);
/// Idle connections kept per replica; enough for a replica's concurrency.
const POOL_MAX_IDLE_PER_HOST: usize = 256;
/// The most of a worker's answer to `POST /weights` that is read: its
/// `weights_version`, or an error message.
const WEIGHTS_ANSWER_LIMIT: usize = 64 * 1024;

/// Why a worker did not load the weights it was sent.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LoadError {
    /// It has no in-place swap (`POST /weights` answered 404, 405 or
    /// 501): it still runs the weights it had.
    #[error("the worker does not support in-place weight sync (POST /weights answered {0})")]
    Unsupported(u16),
    /// It tried and failed, or did not answer: what it runs now is not
    /// known.
    #[error("{0}")]
    Failed(String),
}

/// A connect that has not finished by then fails.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

pub use conns::{Failed, Returned, SendError};

/// A pooled HTTP/1 client to replicas.
#[derive(Clone)]
pub struct Upstream {
    client: Client<HttpConnector, Body>,
    conns: Arc<conns::Conns>,
    /// The longest a replica may pause a forwarded answer.
    answer_idle: std::time::Duration,
}

impl Default for Upstream {
    fn default() -> Self {
        Self::new()
    }
}

impl Upstream {
    /// A client with keep-alive connections and Nagle off.
    pub fn new() -> Self {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        connector.set_connect_timeout(Some(CONNECT_TIMEOUT));
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(POOL_IDLE_TIMEOUT)
            .pool_max_idle_per_host(POOL_MAX_IDLE_PER_HOST)
            .build(connector);
        let conns = Arc::new(conns::Conns::new(conns::Settings {
            connect_timeout: CONNECT_TIMEOUT,
            idle_timeout: POOL_IDLE_TIMEOUT,
            max_idle_per_host: POOL_MAX_IDLE_PER_HOST,
        }));
        Upstream {
            client,
            conns,
            answer_idle: warmgate_deploy::defaults::IDLE_TIMEOUT,
        }
    }

    /// A forwarded answer the replica sends no byte of for `idle` is cut
    /// off (`limits.idle_timeout`; nginx's `proxy_read_timeout`).
    pub fn with_answer_idle(mut self, idle: std::time::Duration) -> Self {
        self.answer_idle = idle;
        self
    }

    /// See [`Upstream::with_answer_idle`].
    pub fn answer_idle(&self) -> std::time::Duration {
        self.answer_idle
    }

    /// Sends `req` to the replica at `addr` on one of its keep-alive
    /// connections: the path of a forwarded request and of a task. The
    /// URI goes in origin form; `Host` is `addr` unless the request has one.
    /// A request no connection could be made for comes back unsent.
    pub async fn send_to(
        &self,
        addr: &Endpoint,
        req: Request<Body>,
    ) -> Result<Response<Returned>, Failed> {
        self.conns.send(addr, req).await
    }

    /// Sends a request to the URL it names (weights to `/weights`, a call
    /// to the leader) through the generic pooled client.
    pub async fn send(
        &self,
        req: Request<Body>,
    ) -> Result<Response<Incoming>, hyper_util::client::legacy::Error> {
        self.client.request(req).await
    }

    /// `POST url` with a JSON body (for hooks); returns the status code.
    pub async fn post_json(&self, url: &str, body: &serde_json::Value) -> Result<u16, String> {
        let req = Request::post(url)
            .header(header::CONTENT_TYPE, "application/json")
            .body(Body::from(body.to_string()))
            .map_err(|e| format!("bad hook URL {url}: {e}"))?;
        let resp = self.send(req).await.map_err(|e| format!("{url}: {e}"))?;
        Ok(resp.status().as_u16())
    }

    /// `POST /weights {"url", "version"}` to the worker at `addr`: it loads
    /// them in place. A worker that answers with another
    /// `weights_version` than asked failed.
    pub async fn load_weights(
        &self,
        addr: &Endpoint,
        url: &str,
        version: u64,
    ) -> Result<(), LoadError> {
        let failed = |e: String| LoadError::Failed(e);
        let body = serde_json::json!({"url": url, "version": version}).to_string();
        let req = Request::post("/weights")
            .header(header::CONTENT_TYPE, "application/json")
            .body(Body::from(body))
            .map_err(|e| failed(e.to_string()))?;
        let resp = self.send_to(addr, req).await.map_err(|e| {
            failed(format!(
                "the worker did not answer POST /weights: {}",
                warmgate_pool::probe::error_chain(&e.error)
            ))
        })?;
        let status = resp.status();
        let body = Limited::new(resp.into_body(), WEIGHTS_ANSWER_LIMIT)
            .collect()
            .await
            .map(|b| b.to_bytes())
            .unwrap_or_default();
        if matches!(status.as_u16(), 404 | 405 | 501) {
            return Err(LoadError::Unsupported(status.as_u16()));
        }
        if !status.is_success() {
            let text = String::from_utf8_lossy(&body[..body.len().min(512)]).into_owned();
            return Err(failed(format!("the worker answered {status}: {text}")));
        }
        let reported = serde_json::from_slice::<serde_json::Value>(&body)
            .ok()
            .and_then(|v| v.get("weights_version").and_then(serde_json::Value::as_u64));
        match reported {
            Some(v) if v != version => Err(failed(format!(
                "the worker reports weights version {v} after loading {version}"
            ))),
            _ => Ok(()),
        }
    }
}
