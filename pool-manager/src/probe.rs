//! Health probes, kept apart from the decision they feed.
//!
//! [`Prober::probe`] only reports what one `GET` of the health path saw. [`HealthRule`]
//! is a pure rule with hysteresis that turns a run of reports into a decision,
//! so one slow answer does not take a replica out of rotation.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Empty, Limited};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use warmgate_deploy::HealthSpec;

use crate::Endpoint;

/// The first readiness probe goes out this soon after the process starts: a
/// worker that binds its port at once is seen within milliseconds.
pub const FIRST_PROBE_DELAY: Duration = Duration::from_millis(2);
/// Readiness probes back off up to this interval. A refused connect costs
/// microseconds, so a small cap keeps cold starts from waiting on the prober.
pub const MAX_PROBE_INTERVAL: Duration = Duration::from_millis(20);
/// Idle probe connections are kept this long (a few liveness periods).
const PROBE_POOL_IDLE: Duration = Duration::from_secs(6);
/// A probe's connect gives up after this long, within its own timeout.
const PROBE_CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// A `/healthz` body larger than this is not parsed.
const MAX_HEALTH_BODY: usize = 64 * 1024;
/// An engine's metrics larger than this are not read: vLLM's run to a few
/// hundred KiB with every histogram; 4 MiB leaves room for many models.
const MAX_METRICS_BODY: usize = 4 * 1024 * 1024;

/// What one probe saw.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ProbeResult {
    /// A ready status, with the weights version if the body named one.
    Healthy {
        /// `weights_version` from the JSON body.
        weights_version: Option<u64>,
        /// `weights_seconds` from the JSON body (how long the worker took
        /// to load its weights), in milliseconds.
        weights_ms: Option<u64>,
    },
    /// Any other answer, a refused connect or a timeout.
    Unhealthy(String),
}

/// Sends `GET /healthz` to workers.
#[derive(Clone, Debug)]
pub struct Prober {
    client: Client<HttpConnector, Empty<Bytes>>,
}

impl Default for Prober {
    fn default() -> Self {
        Self::new()
    }
}

impl Prober {
    /// A prober with its own small connection pool.
    pub fn new() -> Self {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        connector.set_connect_timeout(Some(PROBE_CONNECT_TIMEOUT));
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(PROBE_POOL_IDLE)
            .pool_max_idle_per_host(1)
            .build(connector);
        Prober { client }
    }

    /// Probes `addr` once, as `health` says.
    pub async fn probe(&self, addr: &Endpoint, health: &HealthSpec) -> ProbeResult {
        let path = health.path.as_str();
        let fut = async {
            let (status, body) = self.get(addr, path, MAX_HEALTH_BODY).await?;
            let body = body.unwrap_or_default();
            if !health.is_ready(status.as_u16()) {
                let text = String::from_utf8_lossy(&body[..body.len().min(200)]);
                let text = text.trim();
                return Err(if text.is_empty() {
                    format!("GET {path} answered {status}")
                } else {
                    format!("GET {path} answered {status}: {text}")
                });
            }
            Ok(parse_health(&body))
        };
        match tokio::time::timeout(health.timeout, fut).await {
            Ok(Ok((weights_version, weights_ms))) => ProbeResult::Healthy {
                weights_version,
                weights_ms,
            },
            Ok(Err(e)) => ProbeResult::Unhealthy(e),
            Err(_) => ProbeResult::Unhealthy(format!("GET {path} took over {:?}", health.timeout)),
        }
    }
}

impl Prober {
    /// Reads the engine's load from its Prometheus endpoint at `path`,
    /// within `timeout`.
    pub async fn read_engine(
        &self,
        addr: &Endpoint,
        path: &str,
        names: &warmgate_deploy::EngineMetricNames,
        timeout: Duration,
    ) -> Result<crate::engine::EngineLoad, String> {
        let fut = async {
            let (status, body) = self.get(addr, path, MAX_METRICS_BODY).await?;
            if !status.is_success() {
                return Err(format!("GET {path} answered {status}"));
            }
            let body = body.ok_or_else(|| {
                format!("GET {path}: the answer broke off or passed {MAX_METRICS_BODY} bytes")
            })?;
            Ok(crate::engine::parse_named(
                &String::from_utf8_lossy(&body),
                names,
            ))
        };
        tokio::time::timeout(timeout, fut)
            .await
            .map_err(|_| format!("GET {path} took over {timeout:?}"))?
    }
}

impl Prober {
    /// One `GET path` at `addr`: its status, and its body when it came
    /// whole within `limit` bytes (`None` otherwise).
    async fn get(
        &self,
        addr: &Endpoint,
        path: &str,
        limit: usize,
    ) -> Result<(http::StatusCode, Option<Bytes>), String> {
        let resp = match addr {
            Endpoint::Tcp(a) => {
                let req = http::Request::get(format!("http://{a}{path}"))
                    .body(Empty::new())
                    .map_err(|e| format!("bad request for {path}: {e}"))?;
                self.client
                    .request(req)
                    .await
                    .map_err(|e| format!("GET {path} failed: {}", error_chain(&e)))?
            }
            // A socket is probed on a connection of its own: a connect to
            // one costs microseconds, and the pooled client speaks TCP.
            Endpoint::Unix(_) => {
                let req = http::Request::get(path)
                    .body(Empty::<Bytes>::new())
                    .map_err(|e| format!("bad request for {path}: {e}"))?;
                let once = addr.send_once(req);
                tokio::time::timeout(PROBE_CONNECT_TIMEOUT, once)
                    .await
                    .map_err(|_| format!("GET {path}: no answer within {PROBE_CONNECT_TIMEOUT:?}"))?
                    .map_err(|e| format!("GET {path} failed: {e}"))?
            }
        };
        let status = resp.status();
        let body = Limited::new(resp.into_body(), limit)
            .collect()
            .await
            .ok()
            .map(|c| c.to_bytes());
        Ok((status, body))
    }
}

/// The delay before readiness probe number `attempt` (0-based): starts at
/// [`FIRST_PROBE_DELAY`] and doubles up to [`MAX_PROBE_INTERVAL`].
pub fn readiness_delay(attempt: u32) -> Duration {
    FIRST_PROBE_DELAY
        .saturating_mul(1u32 << attempt.min(16))
        .min(MAX_PROBE_INTERVAL)
}

/// Hysteresis for liveness: a replica is declared unhealthy after
/// `failure_threshold` failures in a row, and any success resets the count.
#[derive(Debug, Clone)]
pub struct HealthRule {
    failure_threshold: u32,
    failures: u32,
}

impl HealthRule {
    /// Consecutive failures needed to declare a replica unhealthy.
    pub const DEFAULT_FAILURES: u32 = 3;

    /// A rule that trips after `failure_threshold` failures in a row.
    pub fn new(failure_threshold: u32) -> Self {
        HealthRule {
            failure_threshold: failure_threshold.max(1),
            failures: 0,
        }
    }

    /// Feeds one probe result; returns true when the replica is now unhealthy.
    pub fn observe(&mut self, healthy: bool) -> bool {
        if healthy {
            self.failures = 0;
        } else {
            self.failures = self.failures.saturating_add(1);
        }
        self.failures >= self.failure_threshold
    }
}

/// `weights_version` and `weights_seconds` (as milliseconds) from a
/// `/healthz` body, when it is JSON that has them.
fn parse_health(body: &[u8]) -> (Option<u64>, Option<u64>) {
    #[derive(serde::Deserialize)]
    struct Health {
        weights_version: Option<u64>,
        weights_seconds: Option<f64>,
    }
    match serde_json_lite::<Health>(body) {
        Some(h) => (
            h.weights_version,
            h.weights_seconds
                .filter(|s| s.is_finite() && *s >= 0.0)
                .map(|s| (s * 1e3).round() as u64),
        ),
        None => (None, None),
    }
}

#[cfg(test)]
fn parse_weights_version(body: &[u8]) -> Option<u64> {
    parse_health(body).0
}

/// Parses JSON if the body is JSON; a worker may answer `ok` in plain text.
fn serde_json_lite<T: serde::de::DeserializeOwned>(body: &[u8]) -> Option<T> {
    serde_json::from_slice(body).ok()
}

/// `a: b: c` from an error and its sources, each cause left out when the
/// text already says it (hyper's and rustls's errors often repeat their
/// source).
pub fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(inner) = cur {
        let t = inner.to_string();
        if !s.contains(&t) {
            s.push_str(": ");
            s.push_str(&t);
        }
        cur = inner.source();
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn readiness_backoff_starts_fast_and_caps_low() {
        assert_eq!(readiness_delay(0), Duration::from_millis(2));
        assert_eq!(readiness_delay(1), Duration::from_millis(4));
        assert_eq!(readiness_delay(3), Duration::from_millis(16));
        assert_eq!(readiness_delay(4), MAX_PROBE_INTERVAL);
        assert_eq!(readiness_delay(1000), MAX_PROBE_INTERVAL);
    }

    #[test]
    fn health_rule_needs_consecutive_failures() {
        let mut r = HealthRule::new(3);
        assert!(!r.observe(false));
        assert!(!r.observe(false));
        assert!(!r.observe(true), "a success resets the count");
        assert!(!r.observe(false));
        assert!(!r.observe(false));
        assert!(r.observe(false));
    }

    #[test]
    fn weights_version_is_read_from_json_only() {
        assert_eq!(parse_weights_version(br#"{"weights_version": 7}"#), Some(7));
        assert_eq!(parse_weights_version(b"ok"), None);
        assert_eq!(parse_weights_version(br#"{"status":"ok"}"#), None);
        assert_eq!(
            parse_health(br#"{"weights_version": 2, "weights_seconds": 1.2345}"#),
            (Some(2), Some(1235))
        );
        assert_eq!(parse_health(br#"{"weights_seconds": -1}"#), (None, None));
    }

    #[tokio::test]
    async fn refused_connection_is_unhealthy() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = l.local_addr().expect("addr");
        drop(l);
        match Prober::new()
            .probe(&addr.into(), &HealthSpec::default())
            .await
        {
            ProbeResult::Unhealthy(msg) => assert!(msg.contains("/healthz"), "{msg}"),
            other => panic!("expected unhealthy, got {other:?}"),
        }
    }
}
