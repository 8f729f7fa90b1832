//! The control plane for apps and pools: status, put and delete,
//! promote, rollback and revision history.

#[allow(unused_imports)]
use super::prelude::*;

#[utoipa::path(get, path = "/v1/status", tag = "control",
    responses((status = 200, description = "Apps (with revisions and replicas) and pools", body = Object)))]
pub(crate) async fn status(State(gw): State<Arc<Gateway>>) -> Response {
    axum::Json(gw.status_report()).into_response()
}

#[utoipa::path(get, path = "/v1/apps", tag = "control",
    responses((status = 200, description = "Every app's status", body = Object)))]
pub(crate) async fn list_apps(State(gw): State<Arc<Gateway>>) -> Response {
    axum::Json(json!({"apps": gw.status()})).into_response()
}

#[utoipa::path(get, path = "/v1/apps/{app}", tag = "control",
    params(("app" = String, Path, description = "App name or alias")),
    responses((status = 200, description = "The app's status", body = Object), (status = 404, description = "Unknown app", body = ErrorBody)))]
pub(crate) async fn get_app(State(gw): State<Arc<Gateway>>, Path(name): Path<String>) -> Response {
    match gw.registry.load().app(&name) {
        Some(app) => {
            let targets = gw.pool.status();
            axum::Json(gw.status_of(app, &crate::report::by_id(&targets))).into_response()
        }
        None => Error::new(ErrorKind::NotFound, format!("app '{name}' not found")).into_response(),
    }
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
/// relative paths are taken from the workers' folder.
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

pub(crate) fn changed_response(
    kind: &str,
    name: &str,
    changed: crate::change::Changed,
) -> Response {
    let status = if changed == crate::change::Changed::Created {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    let mut body = json!(changed);
    body[kind] = json!(name);
    (status, axum::Json(body)).into_response()
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
) -> Response {
    let result: Result<Response, Error> = async {
        check_path_name(&name, "app")?;
        gw.changes.lock.check_api_allowed()?;
        let (_, bytes) = read_body(req, &gw).await?;
        let mut spec: warmgate_deploy::AppSpec = spec_from_json(&bytes, "an app")?;
        name_from_path(&mut spec.name, &name, "app")?;
        if let Some(dir) = &gw.host.workdir {
            spec.resolve_paths(dir);
        }
        let changed = gw.changes.put_app(spec).await?;
        Ok(changed_response("app", &name, changed))
    }
    .await;
    result.unwrap_or_else(IntoResponse::into_response)
}

/// `DELETE /v1/apps/{app}`: the app takes no new request at once; those it
/// holds finish, then its replicas stop.
#[utoipa::path(delete, path = "/v1/apps/{app}", tag = "control",
    params(("app" = String, Path, description = "App name")),
    responses((status = 200, description = "`{app, change: \"deleted\"}`", body = Object), (status = 404, description = "Unknown app", body = ErrorBody), (status = 409, description = "Another change or a promotion of this app is running", body = ErrorBody)))]
pub(crate) async fn delete_app(
    State(gw): State<Arc<Gateway>>,
    Path(name): Path<String>,
) -> Response {
    let result: Result<Response, Error> = async {
        check_path_name(&name, "app")?;
        gw.changes.lock.check_api_allowed()?;
        gw.changes.delete_app(&name).await?;
        Ok(axum::Json(json!({"app": name, "change": "deleted"})).into_response())
    }
    .await;
    result.unwrap_or_else(IntoResponse::into_response)
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
) -> Response {
    let result: Result<Response, Error> = async {
        check_path_name(&app, "app")?;
        gw.changes.lock.check_api_allowed()?;
        let (_, bytes) = read_body(req, &gw).await?;
        let body: AdapterBody = spec_from_json(&bytes, "an adapter")?;
        if body.name.as_ref().is_some_and(|n| *n != name) {
            return Err(Error::new(
                ErrorKind::BadRequest,
                format!("the body names adapter {:?}, the path {name:?}", body.name),
            ));
        }
        let mut spec = current_spec(&gw, &app)?;
        let existed = spec.adapters.get(&name).is_some();
        spec.adapters.models.retain(|a| a.name != name);
        let mut adapter = warmgate_deploy::AdapterSpec::new(name.clone(), body.checkpoint);
        adapter.aliases = body.aliases;
        adapter.watch = body.watch;
        spec.adapters.models.push(adapter);
        if let Some(dir) = &gw.host.workdir {
            spec.resolve_paths(dir);
        }
        let changed = gw.changes.put_app(spec).await?;
        let (status, change) = match changed {
            crate::change::Changed::Unchanged => (StatusCode::OK, "unchanged"),
            _ if !existed => (StatusCode::CREATED, "created"),
            _ => (StatusCode::OK, "in_place"),
        };
        Ok((
            status,
            axum::Json(json!({"app": app, "adapter": name, "change": change})),
        )
            .into_response())
    }
    .await;
    result.unwrap_or_else(IntoResponse::into_response)
}

/// `DELETE /v1/apps/{app}/adapters/{name}`: the adapter is no longer
/// served; replicas that hold it unload it when they need the room.
#[utoipa::path(delete, path = "/v1/apps/{app}/adapters/{name}", tag = "control",
    params(("app" = String, Path, description = "App name"), ("name" = String, Path, description = "Adapter name")),
    responses((status = 200, description = "`{app, adapter, change: \"deleted\"}`", body = Object), (status = 404, description = "Unknown app or adapter", body = ErrorBody), (status = 409, description = "Another change or a promotion of this app is running", body = ErrorBody)))]
pub(crate) async fn delete_adapter(
    State(gw): State<Arc<Gateway>>,
    Path((app, name)): Path<(String, String)>,
) -> Response {
    let result: Result<Response, Error> = async {
        check_path_name(&app, "app")?;
        gw.changes.lock.check_api_allowed()?;
        let mut spec = current_spec(&gw, &app)?;
        if spec.adapters.get(&name).is_none() {
            return Err(Error::new(
                ErrorKind::NotFound,
                format!("app '{app}' has no adapter {name:?}"),
            ));
        }
        spec.adapters.models.retain(|a| a.name != name);
        gw.changes.put_app(spec).await?;
        Ok(axum::Json(json!({"app": app, "adapter": name, "change": "deleted"})).into_response())
    }
    .await;
    result.unwrap_or_else(IntoResponse::into_response)
}

/// The spec app `name` was put with (its name, not an alias), or 404.
fn current_spec(gw: &Gateway, name: &str) -> Result<warmgate_deploy::AppSpec, Error> {
    gw.registry
        .load()
        .apps()
        .iter()
        .find(|a| a.name == name)
        .map(|a| (*a.spec()).clone())
        .ok_or_else(|| Error::new(ErrorKind::NotFound, format!("app '{name}' not found")))
}

/// `GET /v1/pools/{pool}`: one pool's status, as in `/v1/status`.
#[utoipa::path(get, path = "/v1/pools/{pool}", tag = "control",
    params(("pool" = String, Path, description = "Pool name")),
    responses((status = 200, description = "The pool's status", body = Object), (status = 404, description = "Unknown pool", body = ErrorBody)))]
pub(crate) async fn get_pool(State(gw): State<Arc<Gateway>>, Path(name): Path<String>) -> Response {
    let found = gw
        .status_report()
        .pools
        .into_iter()
        .find(|p| p.name == name);
    match found {
        Some(p) => axum::Json(p).into_response(),
        None => Error::new(ErrorKind::NotFound, format!("pool '{name}' not found")).into_response(),
    }
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
) -> Response {
    let result: Result<Response, Error> = async {
        check_path_name(&name, "pool")?;
        gw.changes.lock.check_api_allowed()?;
        let (_, bytes) = read_body(req, &gw).await?;
        let mut spec: warmgate_deploy::PoolSpec = spec_from_json(&bytes, "a pool")?;
        name_from_path(&mut spec.name, &name, "pool")?;
        if let Some(dir) = &gw.host.workdir {
            spec.resolve_paths(dir);
        }
        let changed = gw.changes.put_pool(spec).await?;
        Ok(changed_response("pool", &name, changed))
    }
    .await;
    result.unwrap_or_else(IntoResponse::into_response)
}

/// `DELETE /v1/pools/{pool}`: the pool takes no new task at once; the tasks
/// it holds finish, then its replicas stop.
#[utoipa::path(delete, path = "/v1/pools/{pool}", tag = "control",
    params(("pool" = String, Path, description = "Pool name")),
    responses((status = 200, description = "`{pool, change: \"deleted\"}`", body = Object), (status = 404, description = "Unknown pool", body = ErrorBody), (status = 409, description = "Another change to this pool is running", body = ErrorBody)))]
pub(crate) async fn delete_pool(
    State(gw): State<Arc<Gateway>>,
    Path(name): Path<String>,
) -> Response {
    let result: Result<Response, Error> = async {
        check_path_name(&name, "pool")?;
        gw.changes.lock.check_api_allowed()?;
        gw.changes.delete_pool(&name).await?;
        Ok(axum::Json(json!({"pool": name, "change": "deleted"})).into_response())
    }
    .await;
    result.unwrap_or_else(IntoResponse::into_response)
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

pub(crate) fn served(gw: &Gateway, name: &str) -> Result<Arc<Served>, Error> {
    gw.app(name)
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
) -> Response {
    let result: Result<Response, Error> = async {
        let app = served(&gw, &name)?;
        let (_, bytes) = read_body(req, &gw).await?;
        let mut body: PromoteBody<'_> = serde_json::from_slice(&bytes).map_err(|e| {
            Error::new(
                ErrorKind::BadRequest,
                format!(
                    "the body must be {{\"checkpoint\": \"s3://…\", \"canary\"?: 1-100, \"bake\"?, \"wait\"?, \"in_place\"?, \"adapter\"?}} ({e})"
                ),
            )
        })?;
        // Relative to the config's folder, as in the file.
        if let Some(dir) = &gw.host.workdir {
            warmgate_deploy::resolve_checkpoint(&mut body.checkpoint, dir);
        }
        if body.canary.is_some_and(|c| c == 0 || c > 100) {
            return Err(Error::new(ErrorKind::BadRequest, "canary must be 1 to 100 (percent)"));
        }
        let bake = duration_value(&body.bake, "bake")?;
        if let Some(adapter) = body.adapter {
            if body.in_place.is_some() {
                return Err(Error::new(
                    ErrorKind::BadRequest,
                    "in_place is for the app's revisions: an adapter is always loaded into the running replicas",
                ));
            }
            let c = gw
                .changes
                .promote_adapter(
                    &app,
                    crate::change::AdapterPromoteRequest {
                        adapter,
                        checkpoint: body.checkpoint,
                        canary: body.canary,
                        bake,
                    },
                )
                .await?;
            let answer = |c: &crate::serving::adapter_split::AdapterCanary| {
                let p = c.promotion.lock().clone();
                json!({"app": app.name, "adapter": p.adapter, "revision": &*c.engine, "promotion": p})
            };
            if !body.wait {
                return Ok((StatusCode::ACCEPTED, axum::Json(answer(&c))).into_response());
            }
            while c.running() {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            return Ok(axum::Json(answer(&c)).into_response());
        }
        let id = gw
            .promotions
            .promote(
                &app,
                crate::promote::PromoteRequest {
                    checkpoint: body.checkpoint,
                    canary: body.canary,
                    bake,
                    in_place: body.in_place,
                },
            )
            .await?;
        if !body.wait {
            return Ok((
                StatusCode::ACCEPTED,
                axum::Json(json!({"app": app.name, "revision": id})),
            )
                .into_response());
        }
        loop {
            let p = app.history.lock().promotion.clone();
            if let Some(p) = p.filter(|p| p.to == id && p.phase.is_terminal()) {
                return Ok(axum::Json(json!({"app": app.name, "revision": id, "promotion": p}))
                    .into_response());
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    .await;
    result.unwrap_or_else(IntoResponse::into_response)
}

/// `POST /v1/apps/{app}/rollback`.
#[utoipa::path(post, path = "/v1/apps/{app}/rollback", tag = "promotion",
    params(("app" = String, Path, description = "App name")),
    responses((status = 200, description = "`{app, revision}`: the revision that will serve", body = Object), (status = 409, description = "No earlier revision", body = ErrorBody)))]
pub(crate) async fn rollback(State(gw): State<Arc<Gateway>>, Path(name): Path<String>) -> Response {
    let result = served(&gw, &name).and_then(|app| {
        let id = gw.promotions.rollback(&app)?;
        Ok(axum::Json(json!({"app": app.name, "revision": id})).into_response())
    });
    result.unwrap_or_else(IntoResponse::into_response)
}

/// `GET /v1/apps/{app}/revisions`: the history, newest first, with notes.
#[utoipa::path(get, path = "/v1/apps/{app}/revisions", tag = "promotion",
    params(("app" = String, Path, description = "App name")),
    responses((status = 200, description = "`{app, revisions, promotion, notes}`", body = Object), (status = 404, description = "Unknown app", body = ErrorBody)))]
pub(crate) async fn revisions(
    State(gw): State<Arc<Gateway>>,
    Path(name): Path<String>,
) -> Response {
    let result = served(&gw, &name).and_then(|app| {
        let h = app.history.lock().clone();
        let notes = gw.store.notes(&app.name, 50).map_err(|e| {
            Error::new(
                ErrorKind::NoCapacity,
                format!("cannot read the history: {e}"),
            )
        })?;
        // Each revision's spec as the object it is, not a string of JSON.
        let revisions: Vec<serde_json::Value> = h
            .revisions
            .iter()
            .rev()
            .map(|r| {
                let mut v = json!(r);
                if let Ok(spec) = serde_json::from_str::<serde_json::Value>(&r.spec) {
                    v["spec"] = spec;
                }
                v
            })
            .collect();
        Ok(axum::Json(json!({
            "app": app.name,
            "revisions": revisions,
            "promotion": h.promotion,
            "notes": notes,
        }))
        .into_response())
    });
    result.unwrap_or_else(IntoResponse::into_response)
}

#[cfg(test)]
mod tests {
    use super::PromoteBody;

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
