//! A request of an app served by a warm pool (`[[apps]] pool = ...`): a
//! slot on one of the pool's replicas, shared with the pool's tasks under
//! one per-replica limit, on weights at least as new as the request asks
//! (`X-Warmgate-Min-Weights-Version`) and within the pool's
//! `max_staleness`; then the forward, the slot held until the answer ends.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use axum::extract::Request;
use axum::response::Response;
use http::HeaderValue;
use warmgate_deploy::QueueSpec;

use super::pool::Pool;
use crate::error::{Error, ErrorKind};
use crate::serving::pipeline::{X_QUEUED_MS, X_REPLICA};
use crate::serving::proxy::{Forward, Slot as _};
use crate::upstream::Upstream;

/// On a request: the oldest weights version it may run on. On an answer:
/// the version of the replica that ran it.
pub const X_MIN_WEIGHTS_VERSION: http::HeaderName =
    http::HeaderName::from_static("x-warmgate-min-weights-version");
/// The weights version of the replica that answered.
pub const X_WEIGHTS_VERSION: http::HeaderName =
    http::HeaderName::from_static("x-warmgate-weights-version");

/// The version a request asks for at least: 0 without the header.
pub fn min_version(req: &Request) -> Result<u64, Error> {
    let Some(v) = req.headers().get(X_MIN_WEIGHTS_VERSION) else {
        return Ok(0);
    };
    v.to_str()
        .ok()
        .and_then(|s| s.trim().parse::<u64>().ok())
        .ok_or_else(|| {
            Error::new(
                ErrorKind::BadRequest,
                format!("{X_MIN_WEIGHTS_VERSION} must be a whole number (a weights version)"),
            )
        })
}

/// Tries of a request whose replicas refuse the connection.
const MAX_CONNECT_ATTEMPTS: u32 = 3;
/// Pause before the next try, times the tries so far.
const CONNECT_RETRY_PAUSE: std::time::Duration = std::time::Duration::from_millis(20);

/// Serves `req` of app `app` on one of `pool`'s replicas at
/// `path_and_query`. `on_wait` runs once if the request must wait for a
/// slot (to wake the pool at once rather than at its next tick). When a
/// replica refuses the connection (its process is gone), nothing was
/// sent, and the request tries another replica.
pub async fn serve(
    pool: &Arc<Pool>,
    app: &str,
    upstream: &Upstream,
    queue: &QueueSpec,
    req: Request,
    path_and_query: &str,
    on_wait: impl FnOnce(),
) -> Result<Response, Error> {
    let min = min_version(&req)?;
    let mut req = crate::serving::pipeline::read_small_body(req).await?;
    let mut on_wait = Some(on_wait);
    let mut attempt = 1;
    let mut refused: Vec<String> = Vec::new();
    loop {
        let (slot, queued) = pool
            .acquire_request(app, min, &refused, queue.timeout, queue.max_pending, || {
                if let Some(f) = on_wait.take() {
                    f();
                }
            })
            .await?;
        metrics::histogram!("warmgate_request_queued_seconds", "app" => app.to_string())
            .record(queued.as_secs_f64());
        let replica = slot.replica().clone();
        let version = replica.weights_version.load(Ordering::Relaxed);
        match crate::serving::proxy::forward(upstream, req, path_and_query, slot).await {
            Ok(mut resp) => {
                let h = resp.headers_mut();
                if let Some(v) = &replica.id_header {
                    h.insert(X_REPLICA, v.clone());
                }
                h.insert(X_WEIGHTS_VERSION, HeaderValue::from(version));
                h.insert(X_QUEUED_MS, crate::serving::pipeline::queued_ms(queued));
                return Ok(resp);
            }
            Err(Forward::Refused(e, back, _)) if attempt < MAX_CONNECT_ATTEMPTS => {
                // Nothing was sent: the process is gone (the pool manager
                // removes it within moments). It takes nothing more until
                // it answers its probe; the request, handed back whole,
                // tries another or waits for one.
                req = *back;
                refused.push(replica.id.clone());
                metrics::counter!("warmgate_connect_retries_total").increment(1);
                tracing::debug!(attempt, replica = %replica.id, error = %e.message, "retrying on another replica");
                tokio::time::sleep(CONNECT_RETRY_PAUSE * attempt).await;
                attempt += 1;
            }
            Err(Forward::Refused(e, ..) | Forward::Failed(e)) => return Err(e),
        }
    }
}
