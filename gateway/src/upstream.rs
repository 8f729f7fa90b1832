//! The gateway's one HTTP client to workers and hooks: forwarded
//! requests, tasks to `/invoke`, weights to `/weights` and promotion hooks
//! share its keep-alive connections and settings.

use std::time::Duration;

use axum::body::Body;
use http::header;
use http::{Request, Response};
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

/// Idle upstream connections are kept this long: about as long as a burst
/// of traffic lasts, shorter than a typical worker's keep-alive timeout.
const POOL_IDLE_TIMEOUT: Duration = Duration::from_secs(30);
/// Idle connections kept per replica; enough for a replica's concurrency.
const POOL_MAX_IDLE_PER_HOST: usize = 256;

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
}
