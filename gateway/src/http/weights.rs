//! `/v1/weights`: checkpoints served to workers, under their tokens.

use std::sync::Arc;

use axum::Json;
use axum::extract::{Path, State};
use axum::response::IntoResponse;
use http::{HeaderValue, header};
use serde_json::{Value, json};

use super::ErrorBody;
use crate::error::{Error, ErrorKind};
use crate::server::Gateway;

/// Lets a weights read through with `Authorization: Bearer` and the
/// admin token, or a worker's `WARMGATE_WEIGHTS_TOKEN` whose grant covers
/// this checkpoint; nothing else (no tenant key, no open access).
pub(crate) fn weights_auth(
    gw: &Gateway,
    headers: &http::HeaderMap,
    target: &str,
    revision: &str,
) -> Result<(), Error> {
    let presented = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or("");
    let admin = gw
        .access
        .admin_token
        .as_ref()
        .is_some_and(|t| crate::tenants::same_secret(presented, t));
    if admin || gw.weights.authorized(target, revision, presented) {
        return Ok(());
    }
    Err(Error::new(
        ErrorKind::Unauthorized,
        "weights need Authorization: Bearer <the worker's WARMGATE_WEIGHTS_TOKEN, \
         or the gateway's WARMGATE_ADMIN_TOKEN>",
    ))
}

/// The files of a revision's checkpoint.
#[utoipa::path(get, path = "/v1/weights/{target}/{revision}", tag = "weights",
    params(("target" = String, Path, description = "App or pool"), ("revision" = String, Path, description = "Revision id, or v<N> for a pool")),
    responses((status = 200, description = "`{target, revision, checkpoint, files}`", body = Object), (status = 401, description = "No weights or admin token", body = ErrorBody), (status = 404, description = "No such checkpoint", body = ErrorBody)))]
pub(crate) async fn weights_manifest(
    State(gw): State<Arc<Gateway>>,
    Path((target, revision)): Path<(String, String)>,
    headers: http::HeaderMap,
) -> Result<Json<Value>, Error> {
    let target = gw.target_name(&target);
    weights_auth(&gw, &headers, &target, &revision)?;
    let files = gw.weights.files(&target, &revision).await?;
    // Workers on this machine may read a file where it lies, at the
    // page cache's speed; on Kubernetes they are on other nodes.
    let local = gw.config().backend.kind == warmgate_deploy::BackendKind::Local;
    let list: Vec<_> = files
        .items
        .iter()
        .map(|f| {
            let mut entry = json!({"name": f.relative.to_string_lossy(), "size": f.meta.size});
            if let Some(path) = local.then(|| gw.weights.local_path(f)).flatten() {
                entry["path"] = json!(path.to_string_lossy());
            }
            entry
        })
        .collect();
    Ok(Json(json!({
        "target": target,
        "revision": revision,
        "checkpoint": gw.weights.uri(&target, &revision),
        "files": list,
    })))
}

/// One file of a revision's checkpoint, streamed.
#[utoipa::path(get, path = "/v1/weights/{target}/{revision}/{file}", tag = "weights",
    params(("target" = String, Path, description = "App or pool"), ("revision" = String, Path, description = "Revision id"), ("file" = String, Path, description = "File in the checkpoint")),
    responses((status = 200, description = "The file, streamed from the cache", content_type = "application/octet-stream"), (status = 401, description = "No weights or admin token", body = ErrorBody), (status = 404, description = "No such file", body = ErrorBody)))]
pub(crate) async fn weights_file(
    State(gw): State<Arc<Gateway>>,
    Path((target, revision, file)): Path<(String, String, String)>,
    headers: http::HeaderMap,
) -> Result<impl IntoResponse, Error> {
    let target = gw.target_name(&target);
    weights_auth(&gw, &headers, &target, &revision)?;
    let (body, size) = gw.weights.file(&target, &revision, &file).await?;
    Ok((
        [
            (
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/octet-stream"),
            ),
            (header::CONTENT_LENGTH, HeaderValue::from(size)),
        ],
        body,
    ))
}
