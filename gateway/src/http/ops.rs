//! Health, readiness, metrics and the dashboard.

use std::sync::Arc;

use axum::Json;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use http::{StatusCode, header};
use serde_json::{Value, json};

use super::ErrorBody;
use crate::error::{Error, ErrorKind};
use crate::server::Gateway;

/// The live dashboard: one static page, embedded in the binary, that reads
/// `/v1/status` like the CLI does.
#[utoipa::path(get, path = "/ui", tag = "control",
    responses((status = 200, description = "The live dashboard", content_type = "text/html")))]
pub(crate) async fn dashboard() -> Response {
    (
        [
            (header::CONTENT_TYPE, "text/html; charset=utf-8"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        include_str!("../../ui/index.html"),
    )
        .into_response()
}

#[utoipa::path(get, path = "/healthz", tag = "control",
    responses((status = 200, description = "The process is up", body = Object)))]
pub(crate) async fn healthz() -> Json<Value> {
    Json(json!({"status": "ok"}))
}

#[utoipa::path(get, path = "/readyz", tag = "control",
    responses((status = 200, description = "Taking traffic"), (status = 503, description = "Shutting down", body = ErrorBody)))]
pub(crate) async fn readyz(State(gw): State<Arc<Gateway>>) -> Result<Json<Value>, Error> {
    if gw.host.draining() {
        return Err(
            Error::new(ErrorKind::NoCapacity, "the gateway is shutting down").retry_after(1),
        );
    }
    Ok(Json(json!({"status": "ready"})))
}

#[utoipa::path(get, path = "/metrics", tag = "control",
    responses((status = 200, description = "Prometheus text format", content_type = "text/plain")))]
pub(crate) async fn metrics_text(State(gw): State<Arc<Gateway>>) -> Response {
    // Read when scraped: the request path pays nothing for it.
    metrics::gauge!("warmgate_buffered_body_bytes").set(gw.buffered.held() as f64);
    match &gw.host.metrics {
        Some(h) => (
            [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
            h.render(),
        )
            .into_response(),
        None => (StatusCode::OK, "").into_response(),
    }
}
