//! The control plane for apps and pools: status, put and delete,
//! promote, rollback and revision history.

use std::sync::Arc;

use axum::Json;
use axum::extract::{Path, Request, State};
use axum::response::IntoResponse;
use http::StatusCode;
use serde_json::{Value, json};

use super::ErrorBody;
use super::body::{MAX_ECHOED_CHARS, Scalar, duration_value, read_body};
use crate::change::{AdapterChanged, Changed, PromoteAsked, Promoted};
use crate::error::{Error, ErrorKind};
use crate::server::Gateway;
use crate::status::{AppStatus, GatewayStatus, PoolStatus};

#[utoipa::path(get, path = "/v1/status", tag = "control",
    responses((status = 200, description = "Apps (with revisions and replicas) and pools", body = Object)))]
pub(crate) async fn status(State(gw): State<Arc<Gateway>>) -> Json<GatewayStatus> {
    Json(gw.status_report())
}

#[utoipa::path(get, path = "/v1/apps", tag = "control",
    responses((status = 200, description = "Every app's status", body = Object)))]
pub(crate) async fn list_apps(State(gw): State<Arc<Gateway>>) -> Json<Value> {
    Json(json!({"apps": gw.status()}))
}

#[utoipa::path(get, path = "/v1/apps/{app}", tag = "control",
    params(("app" = String, Path, description = "App name or alias")),
    responses((status = 200, description = "The app's status", body = Object), (status = 404, description = "Unknown app", body = ErrorBody)))]
pub(crate) async fn get_app(
    State(gw): State<Arc<Gateway>>,
    Path(name): Path<String>,
) -> Result<Json<AppStatus>, Error> {
    let registry = gw.registry.load();
    let app = registry
        .app(&name)
        .ok_or_else(|| Error::new(ErrorKind::NotFound, format!("app '{name}' not found")))?;
    let targets = gw.pool.status();
    Ok(Json(gw.status_of(app, &crate::report::by_id(&targets))))
}

/// A name in a control-plane path: a DNS label, or 400 before anything
/// else is looked at.
pub(crate) fn check_path_name(name: &str, what: &str) -> Result<(), Error> {
    warmgate_deploy::check_dns_label(name).map_err(|why| {
        let shown: String = why.chars().take(MAX_ECHOED_CHARS + 100).collect();
        Error::new(ErrorKind::BadRequest, format!("{what} name: {shown}"))
    })
}

/// A spec from a JSON body, as a `[[apps]]` or `[[pools]]` entry of the
/// config file; its `name`, when given, must be the one in the path. Its
/// relative paths are left as written: the put reads them from the
/// config's folder.
pub(crate) fn spec_from_json<S: serde::de::DeserializeOwned>(
    bytes: &[u8],
    what: &str,
) -> Result<S, Error> {
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let spec = serde_path_to_error::deserialize(&mut de).map_err(|e| {
        let key = match e.path().to_string() {
            p if p == "." || p.is_empty() => "(top level)".to_string(),
            p => p,
        };
        Error::new(
            ErrorKind::BadRequest,
            format!(
                "the body must be {what} spec as JSON: {key}: {}",
                e.into_inner()
            ),
        )
    })?;
    de.end().map_err(|e| {
        Error::new(
            ErrorKind::BadRequest,
            format!("the body must be {what} spec as JSON: {e}"),
        )
    })?;
    Ok(spec)
}

pub(crate) fn name_from_path(spec_name: &mut String, path: &str, what: &str) -> Result<(), Error> {
    if spec_name.is_empty() {
        *spec_name = path.to_string();
        return Ok(());
    }
    if spec_name != path {
        return Err(Error::new(
            ErrorKind::BadRequest,
            format!("name: the body names {what} '{spec_name}' but the path names '{path}'"),
        ));
    }
    Ok(())
}

/// The answer to a put: 201 for a new app or pool, 200 otherwise, with
/// what was done.
pub(crate) fn changed_response(
    kind: &str,
    name: &str,
    changed: Changed,
) -> (StatusCode, Json<Value>) {
    let status = if changed == Changed::Created {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    let mut body = json!(changed);
    body[kind] = json!(name);
    (status, Json(body))
}

/// `PUT /v1/apps/{app}`: creates or changes an app. An unchanged spec
/// keeps its replicas; autoscaling, queue, alias and promotion settings
/// apply in place; anything else rolls to a new revision.
#[utoipa::path(put, path = "/v1/apps/{app}", tag = "control",
    params(("app" = String, Path, description = "App name")),
    request_body(content = Object, description = "An `[[apps]]` entry of the config file, as JSON"),
    responses((status = 201, description = "Created: `{app, change}`", body = Object), (status = 200, description = "`{app, change}`: `unchanged`, `in_place`, or `rolled` with the new `revision`", body = Object), (status = 400, description = "Bad name or spec; the key is named", body = ErrorBody), (status = 409, description = "Another change or a promotion of this app is running", body = ErrorBody)))]
pub(crate) async fn put_app(
    State(gw): State<Arc<Gateway>>,
    Path(name): Path<String>,
    req: Request,
) -> Result<impl IntoResponse, Error> {
    check_path_name(&name, "app")?;
    let changes = gw.changes.through_api()?;
    let (_, bytes) = read_body(req, &gw).await?;
    let mut spec: warmgate_deploy::AppSpec = spec_from_json(&bytes, "an app")?;
    name_from_path(&mut spec.name, &name, "app")?;
    let changed = changes.put_app(spec).await?;
    Ok(changed_response("app", &name, changed))
}

/// `DELETE /v1/apps/{app}`: the app takes no new request at once; those it
/// holds finish, then its replicas stop.
#[utoipa::path(delete, path = "/v1/apps/{app}", tag = "control",
    params(("app" = String, Path, description = "App name")),
    responses((status = 200, description = "`{app, change: \"deleted\"}`", body = Object), (status = 404, description = "Unknown app", body = ErrorBody), (status = 409, description = "Another change or a promotion of this app is running", body = ErrorBody)))]
pub(crate) async fn delete_app(
    State(gw): State<Arc<Gateway>>,
    Path(name): Path<String>,
) -> Result<Json<Value>, Error> {
    check_path_name(&name, "app")?;
    gw.changes.through_api()?.delete_app(&name).await?;
    Ok(Json(json!({"app": name, "change": "deleted"})))
}

/// What `PUT /v1/apps/{app}/adapters/{name}` takes: an
/// `[[apps.adapters.models]]` entry as JSON.
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct AdapterBody {
    name: Option<String>,
    checkpoint: String,
    #[serde(default)]
    aliases: Vec<String>,
    watch: Option<String>,
}

/// `PUT /v1/apps/{app}/adapters/{name}`: adds an adapter to an app, or
/// points one at another folder; applied in place (no replica restarts):
/// it is loaded where its first request goes.
#[utoipa::path(put, path = "/v1/apps/{app}/adapters/{name}", tag = "control",
    params(("app" = String, Path, description = "App name"), ("name" = String, Path, description = "Adapter name (a model name; may contain '/')")),
    request_body(content = Object, description = "`{\"checkpoint\": \"file://...\"}`: an `[[apps.adapters.models]]` entry as JSON"),
    responses((status = 201, description = "Added: `{app, adapter, change}`", body = Object), (status = 200, description = "`{app, adapter, change}`: `unchanged` or `in_place`", body = Object), (status = 400, description = "Bad name, body or checkpoint", body = ErrorBody), (status = 404, description = "Unknown app", body = ErrorBody), (status = 409, description = "Another change or a promotion of this app is running", body = ErrorBody)))]
pub(crate) async fn put_adapter(
    State(gw): State<Arc<Gateway>>,
    Path((app, name)): Path<(String, String)>,
    req: Request,
) -> Result<impl IntoResponse, Error> {
    check_path_name(&app, "app")?;
    let changes = gw.changes.through_api()?;
    let (_, bytes) = read_body(req, &gw).await?;
    let body: AdapterBody = spec_from_json(&bytes, "an adapter")?;
    if body.name.as_ref().is_some_and(|n| *n != name) {
        return Err(Error::new(
            ErrorKind::BadRequest,
            format!("the body names adapter {:?}, the path {name:?}", body.name),
        ));
    }
    let mut adapter = warmgate_deploy::AdapterSpec::new(name.clone(), body.checkpoint);
    adapter.aliases = body.aliases;
    adapter.watch = body.watch;
    let changed = changes.put_adapter(&app, adapter).await?;
    let status = if changed == AdapterChanged::Created {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    Ok((
        status,
        Json(json!({"app": app, "adapter": name, "change": changed.as_str()})),
    ))
}

/// `DELETE /v1/apps/{app}/adapters/{name}`: the adapter is no longer
/// served; replicas that hold it unload it when they need the room.
#[utoipa::path(delete, path = "/v1/apps/{app}/adapters/{name}", tag = "control",
    params(("app" = String, Path, description = "App name"), ("name" = String, Path, description = "Adapter name")),
    responses((status = 200, description = "`{app, adapter, change: \"deleted\"}`", body = Object), (status = 404, description = "Unknown app or adapter", body = ErrorBody), (status = 409, description = "Another change or a promotion of this app is running", body = ErrorBody)))]
pub(crate) async fn delete_adapter(
    State(gw): State<Arc<Gateway>>,
    Path((app, name)): Path<(String, String)>,
) -> Result<Json<Value>, Error> {
    check_path_name(&app, "app")?;
    gw.changes
        .through_api()?
        .delete_adapter(&app, &name)
        .await?;
    Ok(Json(
        json!({"app": app, "adapter": name, "change": "deleted"}),
    ))
}

/// `GET /v1/pools/{pool}`: one pool's status, as in `/v1/status`.
#[utoipa::path(get, path = "/v1/pools/{pool}", tag = "control",
    params(("pool" = String, Path, description = "Pool name")),
    responses((status = 200, description = "The pool's status", body = Object), (status = 404, description = "Unknown pool", body = ErrorBody)))]
pub(crate) async fn get_pool(
    State(gw): State<Arc<Gateway>>,
    Path(name): Path<String>,
) -> Result<Json<PoolStatus>, Error> {
    gw.status_report()
        .pools
        .into_iter()
        .find(|p| p.name == name)
        .map(Json)
        .ok_or_else(|| Error::new(ErrorKind::NotFound, format!("pool '{name}' not found")))
}

/// `PUT /v1/pools/{pool}`: creates a pool, or changes a running one in
/// place (replica bounds, idle TTL, buffer, retries, timeouts, staleness,
/// queue bounds); a change that needs new replicas is refused with 409.
#[utoipa::path(put, path = "/v1/pools/{pool}", tag = "control",
    params(("pool" = String, Path, description = "Pool name")),
    request_body(content = Object, description = "A `[[pools]]` entry of the config file, as JSON"),
    responses((status = 201, description = "Created: `{pool, change}`", body = Object), (status = 200, description = "`{pool, change}`: `unchanged` or `in_place`", body = Object), (status = 400, description = "Bad name or spec; the key is named", body = ErrorBody), (status = 409, description = "Another change to this pool is running, or the change needs new replicas", body = ErrorBody)))]
pub(crate) async fn put_pool(
    State(gw): State<Arc<Gateway>>,
    Path(name): Path<String>,
    req: Request,
) -> Result<impl IntoResponse, Error> {
    check_path_name(&name, "pool")?;
    let changes = gw.changes.through_api()?;
    let (_, bytes) = read_body(req, &gw).await?;
    let mut spec: warmgate_deploy::PoolSpec = spec_from_json(&bytes, "a pool")?;
    name_from_path(&mut spec.name, &name, "pool")?;
    let changed = changes.put_pool(spec).await?;
    Ok(changed_response("pool", &name, changed))
}

/// `DELETE /v1/pools/{pool}`: the pool takes no new task at once; the tasks
/// it holds finish, then its replicas stop.
#[utoipa::path(delete, path = "/v1/pools/{pool}", tag = "control",
    params(("pool" = String, Path, description = "Pool name")),
    responses((status = 200, description = "`{pool, change: \"deleted\"}`", body = Object), (status = 404, description = "Unknown pool", body = ErrorBody), (status = 409, description = "Another change to this pool is running", body = ErrorBody)))]
pub(crate) async fn delete_pool(
    State(gw): State<Arc<Gateway>>,
    Path(name): Path<String>,
) -> Result<Json<Value>, Error> {
    check_path_name(&name, "pool")?;
    gw.changes.through_api()?.delete_pool(&name).await?;
    Ok(Json(json!({"pool": name, "change": "deleted"})))
}

#[derive(serde::Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct PromoteBody<'a> {
    checkpoint: String,
    /// Percent of traffic to the new revision while it bakes;
    /// `canary_percent` is the same (the name `INTERFACE.md` uses).
    #[serde(alias = "canary_percent")]
    canary: Option<u8>,
    #[serde(borrow, default)]
    #[schema(value_type = Option<Object>)]
    bake: Scalar<'a>,
    #[serde(default)]
    wait: bool,
    /// Swap the weights into the serving replicas instead of starting new
    /// ones (default: the app's `promotion.in_place`).
    in_place: Option<bool>,
    /// Promote this LoRA adapter of the app (`[[apps.adapters.models]]`)
    /// to the checkpoint instead: a new revision of the adapter, with the
    /// canary as a share of that adapter's requests.
    adapter: Option<String>,
}

/// `POST /v1/apps/{app}/promote`: a new revision from a checkpoint (of the
/// app, or with `adapter` of one of its LoRA adapters); 202 with its id,
/// or with `"wait": true` the promotion's outcome.
#[utoipa::path(post, path = "/v1/apps/{app}/promote", tag = "promotion",
    params(("app" = String, Path, description = "App name")),
    request_body = PromoteBody,
    responses((status = 202, description = "Promotion started: `{app, revision}`", body = Object), (status = 200, description = "With `wait`: `{app, revision, promotion}` once it ended", body = Object), (status = 400, description = "Bad checkpoint URI or body", body = ErrorBody), (status = 404, description = "Unknown app or missing checkpoint", body = ErrorBody), (status = 409, description = "A promotion is running", body = ErrorBody)))]
pub(crate) async fn promote(
    State(gw): State<Arc<Gateway>>,
    Path(name): Path<String>,
    req: Request,
) -> Result<impl IntoResponse, Error> {
    let app = gw.app(&name)?;
    let (_, bytes) = read_body(req, &gw).await?;
    let body: PromoteBody<'_> = serde_json::from_slice(&bytes).map_err(|e| {
        Error::new(
            ErrorKind::BadRequest,
            format!(
                "the body must be {{\"checkpoint\": \"s3://…\", \"canary\"?: 1-100, \"bake\"?, \"wait\"?, \"in_place\"?, \"adapter\"?}} ({e})"
            ),
        )
    })?;
    if body.canary.is_some_and(|c| c == 0 || c > 100) {
        return Err(Error::new(
            ErrorKind::BadRequest,
            "canary must be 1 to 100 (percent)",
        ));
    }
    let asked = PromoteAsked {
        bake: duration_value(&body.bake, "bake")?,
        checkpoint: body.checkpoint,
        canary: body.canary,
        in_place: body.in_place,
        adapter: body.adapter,
        wait: body.wait,
    };
    let status = if asked.wait {
        StatusCode::OK
    } else {
        StatusCode::ACCEPTED
    };
    let answer = match gw.changes.promote_as_asked(&app, asked).await? {
        Promoted::Revision {
            revision,
            promotion: None,
        } => json!({"app": app.name, "revision": revision}),
        Promoted::Revision {
            revision,
            promotion: Some(p),
        } => json!({"app": app.name, "revision": revision, "promotion": p}),
        Promoted::Adapter {
            revision,
            promotion: p,
        } => json!({"app": app.name, "adapter": p.adapter, "revision": revision, "promotion": p}),
    };
    Ok((status, Json(answer)))
}

/// `POST /v1/apps/{app}/rollback`.
#[utoipa::path(post, path = "/v1/apps/{app}/rollback", tag = "promotion",
    params(("app" = String, Path, description = "App name")),
    responses((status = 200, description = "`{app, revision}`: the revision that will serve", body = Object), (status = 409, description = "No earlier revision", body = ErrorBody)))]
pub(crate) async fn rollback(
    State(gw): State<Arc<Gateway>>,
    Path(name): Path<String>,
) -> Result<Json<Value>, Error> {
    let app = gw.app(&name)?;
    let id = gw.promotions.rollback(&app)?;
    Ok(Json(json!({"app": app.name, "revision": id})))
}

/// `GET /v1/apps/{app}/revisions`: the history, newest first, with notes.
#[utoipa::path(get, path = "/v1/apps/{app}/revisions", tag = "promotion",
    params(("app" = String, Path, description = "App name")),
    responses((status = 200, description = "`{app, revisions, promotion, notes}`", body = Object), (status = 404, description = "Unknown app", body = ErrorBody)))]
pub(crate) async fn revisions(
    State(gw): State<Arc<Gateway>>,
    Path(name): Path<String>,
) -> Result<Json<Value>, Error> {
    let app = gw.app(&name)?;
    let h = app.history.lock().clone();
    let notes = gw.store.notes(&app.name, 50).map_err(|e| {
        Error::new(
            ErrorKind::NoCapacity,
            format!("cannot read the history: {e}"),
        )
    })?;
    // Each revision's spec as the object it is, not a string of JSON.
    let revisions: Vec<Value> = h
        .revisions
        .iter()
        .rev()
        .map(|r| {
            let mut v = json!(r);
            if let Ok(spec) = serde_json::from_str::<Value>(&r.spec) {
                v["spec"] = spec;
            }
            v
        })
        .collect();
    Ok(Json(json!({
        "app": app.name,
        "revisions": revisions,
        "promotion": h.promotion,
        "notes": notes,
    })))
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use axum::body::Body;
    use http::StatusCode;
    use tower::ServiceExt as _;

    use super::PromoteBody;
    use crate::server::Gateway;

    /// A gateway with no app or pool, its state in `dir`.
    fn empty_gateway(dir: &std::path::Path) -> Arc<Gateway> {
        let path = dir.join("warmgate.toml");
        let state = dir.join("state");
        std::fs::write(
            &path,
            format!("state_dir = {:?}\n", state.display().to_string()),
        )
        .expect("write the config");
        let config = warmgate_deploy::Config::load(&path).expect("a valid config");
        let backend = Arc::new(warmgate_pool::LocalBackend::new(dir.join("logs")));
        Gateway::new(
            config,
            backend,
            None,
            "127.0.0.1:8080".parse().expect("addr"),
        )
        .expect("the gateway starts")
    }

    async fn status_of(
        gw: &Arc<Gateway>,
        method: &str,
        uri: &str,
        body: &'static str,
    ) -> StatusCode {
        let req = http::Request::builder()
            .method(method)
            .uri(uri)
            .body(Body::from(body))
            .expect("a request");
        let resp = crate::http::router(gw.clone())
            .oneshot(req)
            .await
            .expect("infallible");
        resp.status()
    }

    #[tokio::test]
    async fn under_the_operator_a_change_is_refused_after_the_name_is_checked_and_before_the_body_is_read()
     {
        let dir = tempfile::tempdir().expect("a folder");
        let gw = empty_gateway(dir.path());
        // Before: a body that is no spec is a 400.
        assert_eq!(
            status_of(&gw, "PUT", "/v1/apps/a", "not json").await,
            StatusCode::BAD_REQUEST
        );
        gw.changes().refuse_api_changes();
        for (method, uri) in [
            ("PUT", "/v1/apps/a"),
            ("DELETE", "/v1/apps/a"),
            ("PUT", "/v1/pools/p"),
            ("DELETE", "/v1/pools/p"),
            ("PUT", "/v1/apps/a/adapters/x"),
            ("DELETE", "/v1/apps/a/adapters/x"),
        ] {
            assert_eq!(
                status_of(&gw, method, uri, "not json").await,
                StatusCode::CONFLICT,
                "{method} {uri}"
            );
        }
        // A bad name is still a 400 first.
        assert_eq!(
            status_of(&gw, "PUT", "/v1/apps/Not_A_Label", "not json").await,
            StatusCode::BAD_REQUEST
        );
        gw.shutdown().await;
    }

    #[test]
    fn canary_percent_is_the_same_as_canary_and_both_at_once_is_refused() {
        let b: PromoteBody<'_> =
            serde_json::from_str(r#"{"checkpoint": "file:///c", "canary_percent": 10}"#)
                .expect("parses");
        assert_eq!(b.canary, Some(10));
        let b: PromoteBody<'_> =
            serde_json::from_str(r#"{"checkpoint": "file:///c", "canary": 20}"#).expect("parses");
        assert_eq!(b.canary, Some(20));
        assert!(
            serde_json::from_str::<PromoteBody<'_>>(
                r#"{"checkpoint": "file:///c", "canary": 20, "canary_percent": 10}"#
            )
            .is_err()
        );
    }
}
