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
use crate::error::{ApiError, ErrorKind};
use crate::serving::pipeline::{X_QUEUED_MS, X_REPLICA};
use crate::serving::proxy::Slot as _;
use crate::upstream::Upstream;

/// On a request: the oldest weights version it may run on. On an answer:
/// the version of the replica that ran it.
pub const X_MIN_WEIGHTS_VERSION: &str = "x-warmgate-min-weights-version";
/// The weights version of the replica that answered.
pub const X_WEIGHTS_VERSION: &str = "x-warmgate-weights-version";

/// The version a request asks for at least: 0 without the header.
pub fn min_version(req: &Request) -> Result<u64, ApiError> {
    let Some(v) = req.headers().get(X_MIN_WEIGHTS_VERSION) else {
        return Ok(0);
    };
    v.to_str()
        .ok()
        .and_then(|s| s.trim().parse::<u64>().ok())
        .ok_or_else(|| {
            ApiError::new(
                ErrorKind::BadRequest,
                format!("{X_MIN_WEIGHTS_VERSION} must be a whole number (a weights version)"),
            )
        })
}

/// Serves `req` of app `app` on one of `pool`'s replicas at
/// `path_and_query`. `on_wait` runs once if the request must wait for a
/// slot (to wake the pool at once rather than at its next tick).
pub async fn serve(
    pool: &Arc<Pool>,
    app: &str,
    upstream: &Upstream,
    queue: &QueueSpec,
    req: Request,
    path_and_query: &str,
    on_wait: impl FnOnce(),
) -> Result<Response, ApiError> {
    let min = min_version(&req)?;
    let (slot, queued) = pool
        .acquire_request(app, min, queue.timeout, queue.max_pending, on_wait)
        .await?;
    metrics::histogram!("warmgate_request_queued_seconds", "app" => app.to_string())
        .record(queued.as_secs_f64());
    let replica = slot.replica().clone();
    let version = replica.weights_version.load(Ordering::Relaxed);
    let mut resp = crate::serving::proxy::forward(upstream, req, path_and_query, slot)
        .await
        .map_err(crate::serving::proxy::Forward::into_error)?;
    let h = resp.headers_mut();
    if let Ok(v) = HeaderValue::from_str(&replica.id) {
        h.insert(X_REPLICA, v);
    }
    h.insert(X_WEIGHTS_VERSION, HeaderValue::from(version));
    h.insert(X_QUEUED_MS, HeaderValue::from(queued.as_millis() as u64));
    Ok(resp)
}
