//! `GET /v1/apps/{app}/logs` and `GET /v1/pools/{pool}/logs`: replicas'
//! output through the API, for `warmgate logs` (admin only, like the rest
//! of the control plane).

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::Json;
use axum::extract::{Path, Request, State};
use serde_json::{Value, json};

use super::ErrorBody;
use crate::error::{Error, ErrorKind};
use crate::replica_logs::{self, LogOwner, LogQuery};
use crate::server::Gateway;

#[utoipa::path(get, path = "/v1/apps/{app}/logs", tag = "control",
    params(
        ("app" = String, Path, description = "App name or alias"),
        ("replica" = Option<String>, Query, description = "Which replica (default: the one whose log was written last)"),
        ("offset" = Option<u64>, Query, description = "Where to start reading (default: the last `lines` lines); `next_offset` of the previous read follows the log"),
        ("lines" = Option<u64>, Query, description = "Lines of the end, without `offset` (default 100)"),
        ("max_bytes" = Option<u64>, Query, description = "At most this many bytes (default 64 KiB, at most 1 MiB)")),
    responses((status = 200, description = "`{app, replica, replicas, offset, next_offset, size, text}`: whole lines, secrets redacted", body = Object), (status = 404, description = "Unknown app, or no log (the Kubernetes backend keeps them in the cluster)", body = ErrorBody)))]
pub(crate) async fn app_logs(
    State(gw): State<Arc<Gateway>>,
    Path(name): Path<String>,
    req: Request,
) -> Result<Json<Value>, Error> {
    let (app, env) = gw
        .registry
        .load()
        .app(&name)
        .map(|a| (a.name.clone(), a.spec().env.clone()))
        .ok_or_else(|| Error::new(ErrorKind::NotFound, format!("app '{name}' not found")))?;
    answer(&gw, LogOwner::App(app), &env, req.uri().query())
}

#[utoipa::path(get, path = "/v1/pools/{pool}/logs", tag = "control",
    params(
        ("pool" = String, Path, description = "Pool name"),
        ("replica" = Option<String>, Query, description = "Which replica (default: the one whose log was written last)"),
        ("offset" = Option<u64>, Query, description = "Where to start reading (default: the last `lines` lines)"),
        ("lines" = Option<u64>, Query, description = "Lines of the end, without `offset` (default 100)"),
        ("max_bytes" = Option<u64>, Query, description = "At most this many bytes (default 64 KiB, at most 1 MiB)")),
    responses((status = 200, description = "`{pool, replica, replicas, offset, next_offset, size, text}`", body = Object), (status = 404, description = "Unknown pool, or no log", body = ErrorBody)))]
pub(crate) async fn pool_logs(
    State(gw): State<Arc<Gateway>>,
    Path(name): Path<String>,
    req: Request,
) -> Result<Json<Value>, Error> {
    let (pool, env) = gw
        .registry
        .load()
        .pool(&name)
        .map(|p| (p.name.clone(), p.spec().env.clone()))
        .ok_or_else(|| Error::new(ErrorKind::NotFound, format!("pool '{name}' not found")))?;
    answer(&gw, LogOwner::Pool(pool), &env, req.uri().query())
}

fn answer(
    gw: &Gateway,
    owner: LogOwner,
    env: &BTreeMap<String, String>,
    query: Option<&str>,
) -> Result<Json<Value>, Error> {
    let q = LogQuery::parse(query)?;
    let config = gw.config();
    if config.backend.kind != warmgate_deploy::BackendKind::Local {
        return Err(Error::new(
            ErrorKind::NotFound,
            format!(
                "the kubernetes backend keeps the logs of {}'s replicas in the cluster: `kubectl logs -n NAMESPACE pod/REPLICA` (the replicas are listed by `warmgate status`)",
                owner.describe()
            ),
        ));
    }
    let dir = config.state_dir.join("logs");
    let replicas = replica_logs::replicas(&dir, &owner);
    let replica = match q.replica {
        Some(r) if owner.owns(&r) => r,
        Some(r) => {
            return Err(Error::new(
                ErrorKind::NotFound,
                format!("'{r}' is not a replica of {}", owner.describe()),
            )
            .param("replica"));
        }
        None => replicas.first().cloned().ok_or_else(|| {
            Error::new(
                ErrorKind::NotFound,
                format!("{} has no replica logs yet", owner.describe()),
            )
        })?,
    };
    // What the replicas' environment holds that looks like a secret:
    // the spec's, and what the gateway passes on.
    let secrets: Vec<String> = env
        .iter()
        .filter(|(k, _)| warmgate_pool::logs::is_secret_name(k))
        .map(|(_, v)| v.clone())
        .chain(config.backend.pass_env.iter().filter_map(|k| {
            warmgate_pool::logs::is_secret_name(k)
                .then(|| std::env::var(k).ok())
                .flatten()
        }))
        .collect();
    let chunk = replica_logs::read(
        &dir,
        &replica,
        q.offset,
        q.max_bytes.unwrap_or(replica_logs::DEFAULT_BYTES),
        q.lines.unwrap_or(replica_logs::DEFAULT_LINES),
        &secrets,
    )?;
    let (key, name) = match &owner {
        LogOwner::App(n) => ("app", n),
        LogOwner::Pool(n) => ("pool", n),
    };
    let mut body = serde_json::to_value(&chunk).unwrap_or_default();
    body[key] = json!(name);
    body["replicas"] = json!(replicas);
    Ok(Json(body))
}
