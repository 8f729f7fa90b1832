//! The gateway's one HTTP client to workers and hooks: forwarded
//! requests, tasks to `/invoke`, weights to `/weights` and promotion hooks
//! share its keep-alive connections and settings.

use std::net::SocketAddr;
use std::time::Duration;

use axum::body::Body;
use http::header;
use http::{Request, Response};
use http_body_util::{BodyExt as _, Limited};
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

/// Idle upstream connections are kept this long: about as long as a burst
/// of traffic lasts, shorter than a typical worker's keep-alive timeout.
const POOL_IDLE_TIMEOUT: Duration = Duration::from_secs(30);
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

/// A pooled HTTP/1 client to replicas.
#[derive(Clone)]
pub struct Upstream {
    client: Client<HttpConnector, Body>,
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
        connector.set_connect_timeout(Some(Duration::from_secs(5)));
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(POOL_IDLE_TIMEOUT)
            .pool_max_idle_per_host(POOL_MAX_IDLE_PER_HOST)
            .build(connector);
        Upstream { client }
    }

    /// Sends a request of the gateway's own (a task to `/invoke`, weights
    /// to `/weights`) through the same pooled client as forwarded traffic.
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
        addr: SocketAddr,
        url: &str,
        version: u64,
    ) -> Result<(), LoadError> {
        let failed = |e: String| LoadError::Failed(e);
        let body = serde_json::json!({"url": url, "version": version}).to_string();
        let req = Request::post(format!("http://{addr}/weights"))
            .header(header::CONTENT_TYPE, "application/json")
            .body(Body::from(body))
            .map_err(|e| failed(e.to_string()))?;
        let resp = self
            .send(req)
            .await
            .map_err(|e| failed(format!("the worker did not answer POST /weights: {e}")))?;
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
