//! `warmgate operator`: the gateway in a cluster, driven by `ServingApp`
//! and `WarmPool` resources instead of a config file's `[[apps]]` and
//! `[[pools]]`.
//!
//! - One replica leads, through a `coordination.k8s.io` Lease
//!   (kube-lease-manager). The leader runs the gateway with the kubernetes
//!   backend: pool manager, autoscaler and data plane. The others stand by
//!   with `/readyz` at 503, so the Service sends them nothing, and take
//!   over within the lease's duration when the leader goes.
//! - On taking over, the leader deletes the replica pods an earlier
//!   leader left (their in-memory state died with it).
//! - A resource's status is patched every few seconds: replicas by state,
//!   revisions with their traffic, conditions.
//! - A new `spec.checkpoint` on a `ServingApp` is promoted (canary and
//!   automatic rollback, as `warmgate promote`). Any other spec change,
//!   and any resource added or deleted, restarts the leader's gateway on
//!   the new set (the replica pods are recreated).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use futures_util::StreamExt as _;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams};
use kube::{Resource, ResourceExt as _};
use serde_json::{Value, json};
use warmgate_deploy::crd::{
    Condition, ReplicaCounts, RevisionTraffic, ServingApp, ServingAppStatus, WarmPool,
    WarmPoolStatus,
};
use warmgate_deploy::{BackendKind, Config};
use warmgate_pool::kubernetes::{INSTANCE, KubeBackend, KubeSettings, MANAGED_BY};

/// How often statuses are written.
const STATUS_INTERVAL: Duration = Duration::from_secs(5);
/// The Lease's name.
const LEASE: &str = "warmgate-leader";

/// Which kind of resource.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResourceKind {
    /// A `ServingApp`.
    App,
    /// A `WarmPool`.
    Pool,
}

/// A resource the operator will not serve, and why: it is left out of the
/// gateway and its status says so, while every other resource is served.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    /// Its kind.
    pub kind: ResourceKind,
    /// Its `metadata.name`.
    pub name: String,
    /// The spec key at fault (`spec.promotion.gate_command`).
    pub key: String,
    /// Why.
    pub message: String,
}

/// The config the leader's gateway runs: `base` (limits, tenants, backend
/// settings from `--config`) with the apps and pools of the resources.
/// A resource's `metadata.name` is its name.
///
/// A resource that is invalid, collides with one taken before it, or sets
/// a field the operator's settings do not allow (`[operator]`) is refused
/// on its own; the error is only for a base config that is itself invalid.
pub fn config_from(
    mut base: Config,
    apps: &[ServingApp],
    pools: &[WarmPool],
) -> Result<(Config, Vec<Refusal>), (String, String)> {
    base.backend.kind = BackendKind::Kubernetes;
    // The resources' checkpoints are not the operator's word: the allowed
    // prefixes come from its own config only.
    let allowed = crate::weights::allowed_prefixes(&base);
    base.weights.allowed_prefixes = Some(allowed.clone());
    base.apps.clear();
    base.pools.clear();
    base.validate()?;
    // Relative URIs resolve as the gateway resolves them: against the
    // state folder's parent (the config's folder).
    let base_dir = base
        .state_dir
        .parent()
        .map_or_else(|| std::path::PathBuf::from("."), |p| p.to_path_buf());
    let allowed = warmgate_pool::weights::AllowList::new(&allowed, &base_dir)
        .map_err(|e| ("weights.allowed_prefixes".to_string(), e.to_string()))?;
    // Allowed, and one the store can open: a URI that passes the list but
    // that the store refuses would otherwise stop the gateway at start,
    // and with it every other resource.
    let uri_allowed = |key: &str, uri: Option<&String>| match uri {
        Some(uri) => allowed
            .check(uri, &base_dir)
            .and_then(|()| warmgate_pool::weights::Source::open(uri, &base_dir).map(drop))
            .map_err(|e| (key.to_string(), e.to_string())),
        None => Ok(()),
    };
    let mut refused = Vec::new();
    for a in apps {
        let mut spec = a.spec.clone();
        spec.name = a.name_any();
        let refusal = |e| Refusal::of(ResourceKind::App, a.name_any(), e);
        let checked = resource_fields_allowed(&base.operator, &spec.promotion)
            .and_then(|()| uri_allowed("checkpoint", spec.checkpoint.as_ref()))
            .and_then(|()| uri_allowed("promotion.watch", spec.promotion.watch.as_ref()));
        if let Err(e) = checked {
            refused.push(refusal(e));
            continue;
        }
        base.apps.push(spec);
        if let Err(e) = base.validate() {
            base.apps.pop();
            refused.push(refusal(e));
        }
    }
    for p in pools {
        let mut spec = p.spec.clone();
        spec.name = p.name_any();
        let refusal = |e| Refusal::of(ResourceKind::Pool, p.name_any(), e);
        if let Err(e) = uri_allowed("checkpoint", spec.checkpoint.as_ref()) {
            refused.push(refusal(e));
            continue;
        }
        base.pools.push(spec);
        if let Err(e) = base.validate() {
            base.pools.pop();
            refused.push(refusal(e));
        }
    }
    Ok((base, refused))
}

impl Refusal {
    /// A refusal of `name` for a config error `(key, message)`, its key
    /// given as the resource's (`spec.…`).
    fn of(kind: ResourceKind, name: String, (key, message): (String, String)) -> Self {
        Refusal {
            kind,
            name,
            key: spec_key(&key),
            message,
        }
    }
}

/// Refuses the promotion fields that run code in the operator's container
/// or reach the network from it, unless `[operator]` allows them.
fn resource_fields_allowed(
    allow: &warmgate_deploy::OperatorConfig,
    promotion: &warmgate_deploy::PromotionSpec,
) -> Result<(), (String, String)> {
    if !promotion.gate_command.is_empty() && !allow.allow_gate_command {
        return Err((
            "promotion.gate_command".into(),
            "runs a command inside the operator's container; refused unless the operator's \
             config sets [operator] allow_gate_command = true"
                .into(),
        ));
    }
    if promotion.gate_url.is_some() && !allow.allow_gate_url {
        return Err((
            "promotion.gate_url".into(),
            "makes the operator send a request from inside the cluster; refused unless the \
             operator's config sets [operator] allow_gate_url = true"
                .into(),
        ));
    }
    Ok(())
}

/// A config key (`apps[3].image`) as a key of the resource (`spec.image`).
fn spec_key(key: &str) -> String {
    let rest = ["apps[", "pools["]
        .iter()
        .find_map(|p| key.strip_prefix(p))
        .and_then(|r| r.split_once("]."))
        .map_or(key, |(_, r)| r);
    format!("spec.{rest}")
}

/// The status of a refused resource: not ready, with the reason.
fn refused_conditions(r: &Refusal, now: &str) -> Vec<Condition> {
    vec![Condition {
        type_: "Ready".into(),
        status: "False".into(),
        reason: "Refused".into(),
        message: format!("{}: {}", r.key, r.message),
        last_transition_time: now.into(),
    }]
}

/// The status of an app, from the gateway's `/v1/status` entry for it.
pub fn app_status(app: &Value, generation: Option<i64>, now: &str) -> ServingAppStatus {
    let counts = counts(app);
    let revisions: Vec<RevisionTraffic> = app["revisions"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|r| RevisionTraffic {
            id: r["id"].as_str().unwrap_or("").to_string(),
            checkpoint: None,
            traffic: r["traffic"].as_u64().unwrap_or(0).min(100) as u8,
            ready: r["ready"].as_u64().unwrap_or(0) as u32,
        })
        .collect();
    ServingAppStatus {
        conditions: conditions(&counts, app, now),
        replicas: counts,
        revision: app["revision"].as_str().map(str::to_string),
        revisions,
        observed_generation: generation,
    }
}

/// The status of a pool, from the gateway's `/v1/status` entry for it.
pub fn pool_status(pool: &Value, generation: Option<i64>, now: &str) -> WarmPoolStatus {
    let counts = counts(pool);
    WarmPoolStatus {
        conditions: conditions(&counts, pool, now),
        replicas: counts,
        weights_version: pool["weights_version"].as_u64().unwrap_or(0),
        pending_tasks: pool["pending"].as_u64().unwrap_or(0),
        observed_generation: generation,
    }
}

fn counts(v: &Value) -> ReplicaCounts {
    let mut c = ReplicaCounts {
        desired: v["pool"]["desired"].as_u64().unwrap_or(0) as u32,
        ..ReplicaCounts::default()
    };
    for r in v["pool"]["replicas"].as_array().into_iter().flatten() {
        match r["state"].as_str() {
            Some("ready") => c.ready += 1,
            Some("starting") => c.starting += 1,
            Some("pending") => c.pending += 1,
            _ => {}
        }
    }
    c
}

/// `Ready`, and `Unschedulable` while the scheduler cannot place a
/// replica (with its reason): an app waiting for GPUs is not failed.
fn conditions(c: &ReplicaCounts, v: &Value, now: &str) -> Vec<Condition> {
    let cond = |type_: &str, ok: bool, reason: &str, message: String| Condition {
        type_: type_.to_string(),
        status: if ok { "True" } else { "False" }.to_string(),
        reason: reason.to_string(),
        message,
        last_transition_time: now.to_string(),
    };
    let ready = if c.desired == 0 {
        cond(
            "Ready",
            true,
            "ScaledToZero",
            "no traffic: no replicas".into(),
        )
    } else if c.ready > 0 {
        cond(
            "Ready",
            true,
            "Serving",
            format!("{} of {} replicas ready", c.ready, c.desired),
        )
    } else {
        cond("Ready", false, "Starting", "no replica is ready yet".into())
    };
    let reasons: Vec<String> = v["pool"]["replicas"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|r| r["state"] == "pending")
        .filter_map(|r| r["reason"].as_str().map(str::to_string))
        .collect();
    let mut out = vec![ready];
    if let Some(first) = reasons.first() {
        out.push(Condition {
            status: "True".to_string(),
            ..cond(
                "Unschedulable",
                true,
                "Unschedulable",
                format!("{} replica(s) cannot be scheduled: {first}", reasons.len()),
            )
        });
    }
    out
}

/// Writes a resource's status through the status subresource (a merge
/// patch: the spec is never touched).
pub async fn patch_status<K>(
    api: &Api<K>,
    name: &str,
    status: &impl serde::Serialize,
) -> kube::Result<()>
where
    K: Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    let patch = json!({ "status": status });
    api.patch_status(name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .map(|_| ())
}

/// The owner reference that makes a resource's pods its dependents.
fn owner_of<K: Resource<DynamicType = ()>>(
    obj: &K,
) -> Option<k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference> {
    obj.controller_owner_ref(&())
}

/// Options of `warmgate operator`.
pub struct OperatorArgs {
    /// Base config (limits, tenants, backend settings); its apps and pools
    /// must be empty.
    pub config: Option<std::path::PathBuf>,
    /// Namespace to watch (default: the pod's own).
    pub namespace: Option<String>,
    /// Listen address.
    pub listen: std::net::SocketAddr,
}

/// Runs the operator until SIGTERM.
pub async fn run(args: OperatorArgs) -> anyhow::Result<()> {
    let base = match &args.config {
        Some(p) => Config::load(p).map_err(|e| anyhow::anyhow!("{e}"))?,
        None => Config::default(),
    };
    anyhow::ensure!(
        base.apps.is_empty() && base.pools.is_empty(),
        "the operator's --config holds settings only; apps and pools come from ServingApp and WarmPool resources"
    );
    let client = kube::Client::try_default().await.map_err(|e| {
        anyhow::anyhow!(
            "cannot reach the Kubernetes API (no in-cluster config, and no KUBECONFIG): {e}"
        )
    })?;
    let ns = args
        .namespace
        .clone()
        .or_else(|| base.backend.kubernetes.namespace.clone())
        .unwrap_or_else(|| client.default_namespace().to_string());
    let identity =
        std::env::var("POD_NAME").unwrap_or_else(|_| format!("warmgate-{:x}", fastrand::u64(..)));
    let manager = kube_lease_manager::LeaseManagerBuilder::new(client.clone(), LEASE)
        .with_namespace(&ns)
        .with_identity(&identity)
        .build()
        .await
        .context("set up the leader election Lease")?;
    let (mut leading, _lease_task) = manager.watch().await;

    // Standby: alive, not ready, until this replica leads.
    tracing::info!(%identity, namespace = %ns, "waiting for the leader lease");
    let standby = tokio::spawn(standby_server(args.listen));
    while !*leading.borrow_and_update() {
        tokio::select! {
            r = leading.changed() => r.context("the lease manager stopped")?,
            () = crate::cli::shutdown_signal() => {
                standby.abort();
                return Ok(());
            }
        }
    }
    standby.abort();
    let _ = standby.await;
    tracing::info!(%identity, "leading");

    let apps_api: Api<ServingApp> = Api::namespaced(client.clone(), &ns);
    let pools_api: Api<WarmPool> = Api::namespaced(client.clone(), &ns);
    let apps = apps_api
        .list(&ListParams::default())
        .await
        .context("list ServingApps")?
        .items;
    let pools = pools_api
        .list(&ListParams::default())
        .await
        .context("list WarmPools")?
        .items;
    let (mut config, refused) = config_from(base, &apps, &pools)
        .map_err(|(key, m)| anyhow::anyhow!("the operator's config is not valid: {key}: {m}"))?;
    for r in &refused {
        tracing::warn!(kind = ?r.kind, name = %r.name, key = %r.key, reason = %r.message, "refused a resource");
    }
    config.listen = args.listen;
    let instance = std::env::var("WARMGATE_INSTANCE").unwrap_or_else(|_| "warmgate".into());
    clean_previous_pods(&client, &ns, &instance).await;
    let backend = KubeBackend::new(
        client.clone(),
        KubeSettings {
            namespace: ns.clone(),
            instance,
            config: config.backend.kubernetes.clone(),
            stop_grace: config.backend.stop_grace,
        },
    );
    for a in &apps {
        if let Some(o) = owner_of(a) {
            backend.set_owner(&a.name_any(), o);
        }
    }
    for p in &pools {
        if let Some(o) = owner_of(p) {
            backend.set_owner(&p.name_any(), o);
        }
    }
    let listener = tokio::net::TcpListener::bind(config.listen)
        .await
        .with_context(|| format!("listen on {}", config.listen))?;
    let generations: BTreeMap<String, Option<i64>> = apps
        .iter()
        .map(|a| (format!("app/{}", a.name_any()), a.metadata.generation))
        .chain(
            pools
                .iter()
                .map(|p| (format!("pool/{}", p.name_any()), p.metadata.generation)),
        )
        .collect();
    let checkpoints: BTreeMap<String, Option<String>> = apps
        .iter()
        .map(|a| (a.name_any(), a.spec.checkpoint.clone()))
        .collect();
    crate::cli::serve_with(config, Arc::new(backend), listener, move |gw| async move {
        let reason = tokio::select! {
            r = leading.wait_for(|l| !*l) => match r {
                Ok(_) => "lost the leader lease".to_string(),
                Err(_) => "the lease manager stopped".to_string(),
            },
            r = reconcile(gw, apps_api, pools_api, generations, checkpoints, refused) => r,
        };
        reason
    })
    .await
}

/// Answers `/healthz` 200 and `/readyz` 503 while this replica stands by.
async fn standby_server(addr: std::net::SocketAddr) {
    use axum::routing::get;
    let router = axum::Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route(
            "/readyz",
            get(|| async {
                (
                    http::StatusCode::SERVICE_UNAVAILABLE,
                    "standing by for the leader lease",
                )
            }),
        );
    match tokio::net::TcpListener::bind(addr).await {
        Ok(l) => {
            let _ = axum::serve(l, router).await;
        }
        Err(e) => tracing::error!(%addr, error = %e, "standby: cannot listen"),
    }
}

/// Deletes the pods an earlier leader created: their state (weights
/// version, tasks in flight) died with it.
async fn clean_previous_pods(client: &kube::Client, ns: &str, instance: &str) {
    let api: Api<Pod> = Api::namespaced(client.clone(), ns);
    let lp = ListParams::default().labels(&format!("{MANAGED_BY}=warmgate,{INSTANCE}={instance}"));
    match api.list(&lp).await {
        Ok(list) => {
            for pod in list.items {
                let name = pod.name_any();
                if let Err(e) = api.delete(&name, &DeleteParams::default()).await {
                    tracing::warn!(pod = %name, error = %e, "could not delete a previous leader's pod");
                } else {
                    tracing::warn!(pod = %name, "deleted a replica pod a previous leader left");
                }
            }
        }
        Err(e) => tracing::warn!(error = %e, "could not list a previous leader's pods"),
    }
}

/// Writes statuses, promotes new checkpoints, and returns when the set of
/// resources changes in a way that needs a restart.
async fn reconcile(
    gw: Arc<crate::Gateway>,
    apps: Api<ServingApp>,
    pools: Api<WarmPool>,
    mut generations: BTreeMap<String, Option<i64>>,
    mut checkpoints: BTreeMap<String, Option<String>>,
    refused: Vec<Refusal>,
) -> String {
    use kube::runtime::watcher;
    let app_events = watcher(apps.clone(), watcher::Config::default()).boxed();
    let pool_events = watcher(pools.clone(), watcher::Config::default()).boxed();
    let mut events = futures_util::stream::select(
        app_events.map(|e| e.map(|e| map_event(e, Kind::App))),
        pool_events.map(|e| e.map(|e| map_event(e, Kind::Pool))),
    );
    let mut tick = tokio::time::interval(STATUS_INTERVAL);
    loop {
        tokio::select! {
            _ = tick.tick() => write_statuses(&gw, &apps, &pools, &generations, &refused).await,
            ev = events.next() => {
                let Some(ev) = ev else { return "the resource watch ended".into() };
                let ev = match ev {
                    Ok(ev) => ev,
                    Err(e) => {
                        tracing::warn!(error = %e, "the resource watch failed; it restarts");
                        continue;
                    }
                };
                match ev {
                    watcher::Event::Apply(Kind::App(a)) | watcher::Event::InitApply(Kind::App(a)) => {
                        let key = format!("app/{}", a.name_any());
                        let Some(seen) = generations.get(&key) else {
                            return format!("ServingApp {} was added", a.name_any());
                        };
                        if *seen == a.metadata.generation {
                            continue;
                        }
                        // Only the checkpoint changed: promote it.
                        let old = checkpoints.get(&a.name_any()).cloned().flatten();
                        if let Some(new) = a.spec.checkpoint.clone().filter(|c| Some(c) != old.as_ref())
                            && only_checkpoint_changed(&gw, &a)
                        {
                            match gw.promote_checkpoint(&a.name_any(), &new).await {
                                Ok(rev) => tracing::info!(app = %a.name_any(), revision = %rev, "promoting the new checkpoint"),
                                Err(e) => tracing::warn!(app = %a.name_any(), error = %e.message, "could not promote the new checkpoint"),
                            }
                            checkpoints.insert(a.name_any(), Some(new));
                            generations.insert(key, a.metadata.generation);
                            continue;
                        }
                        return format!("ServingApp {} changed", a.name_any());
                    }
                    watcher::Event::Apply(Kind::Pool(p)) | watcher::Event::InitApply(Kind::Pool(p)) => {
                        match generations.get(&format!("pool/{}", p.name_any())) {
                            Some(seen) if *seen == p.metadata.generation => continue,
                            Some(_) => return format!("WarmPool {} changed", p.name_any()),
                            None => return format!("WarmPool {} was added", p.name_any()),
                        }
                    }
                    watcher::Event::Delete(Kind::App(a)) => return format!("ServingApp {} was deleted", a.name_any()),
                    watcher::Event::Delete(Kind::Pool(p)) => return format!("WarmPool {} was deleted", p.name_any()),
                    watcher::Event::Init | watcher::Event::InitDone => {}
                }
            }
        }
    }
}

fn map_event<K>(
    e: kube::runtime::watcher::Event<K>,
    f: fn(Box<K>) -> Kind,
) -> kube::runtime::watcher::Event<Kind> {
    use kube::runtime::watcher::Event as E;
    match e {
        E::Apply(k) => E::Apply(f(Box::new(k))),
        E::InitApply(k) => E::InitApply(f(Box::new(k))),
        E::Delete(k) => E::Delete(f(Box::new(k))),
        E::Init => E::Init,
        E::InitDone => E::InitDone,
    }
}

enum Kind {
    App(Box<ServingApp>),
    Pool(Box<WarmPool>),
}

/// Whether `a`'s spec differs from the running one in its checkpoint only.
fn only_checkpoint_changed(gw: &crate::Gateway, a: &ServingApp) -> bool {
    let Some(running) = gw.config().apps.iter().find(|x| x.name == a.name_any()) else {
        return false;
    };
    let mut incoming = a.spec.clone();
    incoming.name = running.name.clone();
    incoming.checkpoint = running.checkpoint.clone();
    incoming == *running
}

async fn write_statuses(
    gw: &crate::Gateway,
    apps: &Api<ServingApp>,
    pools: &Api<WarmPool>,
    generations: &BTreeMap<String, Option<i64>>,
    refused: &[Refusal],
) {
    let now = now_rfc3339();
    for r in refused {
        let result = match r.kind {
            ResourceKind::App => {
                let g = generations
                    .get(&format!("app/{}", r.name))
                    .copied()
                    .flatten();
                let status = ServingAppStatus {
                    conditions: refused_conditions(r, &now),
                    observed_generation: g,
                    ..ServingAppStatus::default()
                };
                patch_status(apps, &r.name, &status).await
            }
            ResourceKind::Pool => {
                let g = generations
                    .get(&format!("pool/{}", r.name))
                    .copied()
                    .flatten();
                let status = WarmPoolStatus {
                    conditions: refused_conditions(r, &now),
                    observed_generation: g,
                    ..WarmPoolStatus::default()
                };
                patch_status(pools, &r.name, &status).await
            }
        };
        if let Err(e) = result {
            tracing::warn!(name = %r.name, error = %e, "could not write a refused resource's status");
        }
    }
    let status = gw.status_json();
    for a in status["apps"].as_array().into_iter().flatten() {
        let Some(name) = a["name"].as_str() else {
            continue;
        };
        let g = generations.get(&format!("app/{name}")).copied().flatten();
        if let Err(e) = patch_status(apps, name, &app_status(a, g, &now)).await {
            tracing::warn!(app = %name, error = %e, "could not write the ServingApp status");
        }
    }
    for p in status["pools"].as_array().into_iter().flatten() {
        let Some(name) = p["name"].as_str() else {
            continue;
        };
        let g = generations.get(&format!("pool/{name}")).copied().flatten();
        if let Err(e) = patch_status(pools, name, &pool_status(p, g, &now)).await {
            tracing::warn!(pool = %name, error = %e, "could not write the WarmPool status");
        }
    }
}

fn now_rfc3339() -> String {
    humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use http::{Request, Response};
    use http_body_util::Full;

    fn app(name: &str, spec: Value) -> ServingApp {
        serde_json::from_value(json!({
            "apiVersion": "warmgate.dev/v1alpha1", "kind": "ServingApp",
            "metadata": {"name": name, "namespace": "ml", "uid": "u-app", "generation": 3},
            "spec": spec,
        }))
        .expect("a ServingApp")
    }

    #[test]
    fn resources_become_the_config_with_their_names() {
        let a = app(
            "minilm",
            json!({"image": "r/embedder:1", "gpus": 1, "autoscale": {"max": 2}}),
        );
        let p: WarmPool = serde_json::from_value(json!({
            "apiVersion": "warmgate.dev/v1alpha1", "kind": "WarmPool",
            "metadata": {"name": "rollouts"},
            "spec": {"image": "r/cartpole:1", "replicas": [1, 3]},
        }))
        .expect("a WarmPool");
        let (c, refused) =
            config_from(Config::default(), std::slice::from_ref(&a), &[p]).expect("valid");
        assert_eq!(refused, []);
        assert_eq!(c.backend.kind, BackendKind::Kubernetes);
        assert_eq!(c.apps[0].name, "minilm");
        assert_eq!(c.apps[0].autoscale.max, 2);
        assert_eq!(c.pools[0].name, "rollouts");
        assert_eq!(c.pools[0].replicas, [1, 3]);
        // The pods are owned by the resource.
        let owner = owner_of(&a).expect("owner");
        assert_eq!(
            (owner.kind.as_str(), owner.name.as_str(), owner.uid.as_str()),
            ("ServingApp", "minilm", "u-app")
        );
        assert_eq!(owner.controller, Some(true));
        // A resource without an image is refused with the key at fault,
        // and the others are still served.
        let bad = app("x", json!({"command": ["./w"]}));
        let (c, refused) = config_from(Config::default(), &[bad, a], &[]).expect("base is valid");
        assert_eq!(c.apps.len(), 1);
        assert_eq!(c.apps[0].name, "minilm");
        assert_eq!(refused.len(), 1);
        assert_eq!(
            (refused[0].name.as_str(), refused[0].key.as_str()),
            ("x", "spec.image")
        );
    }

    #[test]
    fn resources_may_not_run_commands_or_reach_addresses_from_the_operator() {
        let gate_command = app(
            "evil",
            json!({"image": "r/e:1", "promotion": {"gate_command": ["sh", "-c", "cat /var/run/secrets/kubernetes.io/serviceaccount/token"]}}),
        );
        let gate_url = app(
            "probe",
            json!({"image": "r/e:1", "promotion": {"gate_url": "http://10.0.0.1:6443/api"}}),
        );
        let plain = app("plain", json!({"image": "r/e:1"}));
        let all = [gate_command, gate_url, plain];
        let (c, refused) = config_from(Config::default(), &all, &[]).expect("base is valid");
        assert_eq!(
            c.apps.iter().map(|a| a.name.as_str()).collect::<Vec<_>>(),
            ["plain"],
            "only the resource without gates is served"
        );
        let keys: Vec<(&str, &str)> = refused
            .iter()
            .map(|r| (r.name.as_str(), r.key.as_str()))
            .collect();
        assert_eq!(
            keys,
            [
                ("evil", "spec.promotion.gate_command"),
                ("probe", "spec.promotion.gate_url")
            ]
        );
        assert!(refused[0].message.contains("allow_gate_command"));
        // The refusal reaches the resource's status as a condition.
        let cond = &refused_conditions(&refused[0], "t")[0];
        assert_eq!(
            (
                cond.type_.as_str(),
                cond.status.as_str(),
                cond.reason.as_str()
            ),
            ("Ready", "False", "Refused")
        );
        assert!(cond.message.starts_with("spec.promotion.gate_command: "));
        // The operator's own config may allow them.
        let mut base = Config::default();
        base.operator.allow_gate_command = true;
        base.operator.allow_gate_url = true;
        let (c, refused) = config_from(base, &all, &[]).expect("base is valid");
        assert_eq!(refused, []);
        assert_eq!(c.apps.len(), 3);
    }

    #[test]
    fn a_resource_reading_a_checkpoint_outside_the_operator_s_prefixes_is_refused() {
        let inside = app(
            "minilm",
            json!({"image": "r/e:1", "checkpoint": "s3://models/minilm/v1"}),
        );
        let outside = app(
            "other",
            json!({"image": "r/e:1", "checkpoint": "s3://models-private/secret"}),
        );
        let watch = app(
            "watcher",
            json!({"image": "r/e:1", "promotion": {"watch": "file:///etc"}}),
        );
        let pool: WarmPool = serde_json::from_value(json!({
            "apiVersion": "warmgate.dev/v1alpha1", "kind": "WarmPool",
            "metadata": {"name": "rollouts"},
            "spec": {"image": "r/c:1", "checkpoint": "gs://elsewhere/ckpt"},
        }))
        .expect("a WarmPool");
        let mut base = Config::default();
        base.weights.allowed_prefixes = Some(vec!["s3://models/".into()]);
        let (c, refused) =
            config_from(base, &[inside, outside, watch], &[pool]).expect("base is valid");
        assert_eq!(
            c.apps.iter().map(|a| a.name.as_str()).collect::<Vec<_>>(),
            ["minilm"]
        );
        assert!(c.pools.is_empty());
        let keys: Vec<(&str, &str)> = refused
            .iter()
            .map(|r| (r.name.as_str(), r.key.as_str()))
            .collect();
        assert_eq!(
            keys,
            [
                ("other", "spec.checkpoint"),
                ("watcher", "spec.promotion.watch"),
                ("rollouts", "spec.checkpoint")
            ]
        );
        // A URI the list allows but the store cannot open (an empty
        // segment) is refused alone instead of stopping the gateway.
        let odd = app(
            "odd",
            json!({"image": "r/e:1", "checkpoint": "s3://models//x"}),
        );
        let mut base = Config::default();
        base.weights.allowed_prefixes = Some(vec!["s3://models/".into()]);
        let (_, refused) = config_from(base, &[odd], &[]).expect("base is valid");
        assert_eq!(refused.len(), 1, "{refused:?}");
        // Without a list in the operator's config, no resource may name a
        // checkpoint: its own spec cannot vouch for itself.
        let a = app(
            "m",
            json!({"image": "r/e:1", "checkpoint": "s3://models/m"}),
        );
        let (_, refused) = config_from(Config::default(), &[a], &[]).expect("base is valid");
        assert_eq!(refused.len(), 1);
    }

    #[test]
    fn a_resource_colliding_with_an_earlier_one_is_refused_alone() {
        let first = app("minilm", json!({"image": "r/e:1", "aliases": ["embed"]}));
        let second = app("other", json!({"image": "r/e:1", "aliases": ["embed"]}));
        let (c, refused) = config_from(Config::default(), &[first, second], &[]).expect("valid");
        assert_eq!(c.apps.len(), 1);
        assert_eq!(refused[0].name, "other");
        assert!(refused[0].key.starts_with("spec."), "{}", refused[0].key);
    }

    #[test]
    fn a_resource_naming_a_service_account_not_allowed_is_refused() {
        let a = app(
            "minilm",
            json!({"image": "r/e:1", "kubernetes": {"service_account": "warmgate"}}),
        );
        let (c, refused) =
            config_from(Config::default(), std::slice::from_ref(&a), &[]).expect("base is valid");
        assert!(c.apps.is_empty());
        assert_eq!(refused[0].key, "spec.kubernetes.service_account");
        assert!(
            refused[0].message.contains("allowed_service_accounts"),
            "{}",
            refused[0].message
        );
        // Allowed by the operator's own settings: accepted.
        let mut base = Config::default();
        base.backend.kubernetes.allowed_service_accounts = vec!["warmgate".into()];
        let (c, refused) = config_from(base, &[a], &[]).expect("allowed");
        assert_eq!(refused, []);
        assert_eq!(
            c.apps[0].kubernetes.service_account.as_deref(),
            Some("warmgate")
        );
    }

    fn gateway_app_status() -> Value {
        json!({
            "name": "minilm", "revision": "minilm-00002",
            "revisions": [{"id": "minilm-00002", "traffic": 90, "ready": 1}, {"id": "minilm-00001", "traffic": 10, "ready": 1}],
            "pool": {"desired": 3, "replicas": [
                {"id": "minilm-00002-1", "state": "ready"},
                {"id": "minilm-00002-2", "state": "starting"},
                {"id": "minilm-00002-3", "state": "pending", "reason": "0/4 nodes are available: 4 Insufficient nvidia.com/gpu."}
            ]}
        })
    }

    #[test]
    fn app_status_counts_replicas_and_names_the_scheduler_reason() {
        let s = app_status(&gateway_app_status(), Some(3), "2026-11-29T20:00:00Z");
        assert_eq!(
            s.replicas,
            ReplicaCounts {
                ready: 1,
                starting: 1,
                pending: 1,
                desired: 3
            }
        );
        assert_eq!(s.revision.as_deref(), Some("minilm-00002"));
        assert_eq!(
            s.revisions.iter().map(|r| r.traffic).collect::<Vec<_>>(),
            [90, 10]
        );
        assert_eq!(s.observed_generation, Some(3));
        let ready = &s.conditions[0];
        assert_eq!(
            (ready.type_.as_str(), ready.status.as_str()),
            ("Ready", "True")
        );
        let unsched = s
            .conditions
            .iter()
            .find(|c| c.type_ == "Unschedulable")
            .expect("condition");
        assert!(
            unsched.message.contains("Insufficient nvidia.com/gpu"),
            "{}",
            unsched.message
        );
        // Scaled to zero is ready, not failed.
        let zero = app_status(
            &json!({"name": "m", "pool": {"desired": 0, "replicas": []}}),
            None,
            "t",
        );
        assert_eq!(zero.conditions[0].reason, "ScaledToZero");
        assert_eq!(zero.conditions[0].status, "True");
    }

    #[tokio::test]
    async fn a_new_leader_deletes_the_pods_of_its_instance_only() {
        let (service, mut handle) =
            tower_test::mock::pair::<Request<kube::client::Body>, Response<Full<Bytes>>>();
        let client = kube::Client::new(service, "ml");
        let verifier = tokio::spawn(async move {
            let (req, send) = handle.next_request().await.expect("a list");
            assert_eq!(req.method(), http::Method::GET);
            assert_eq!(req.uri().path(), "/api/v1/namespaces/ml/pods");
            let q = req.uri().query().unwrap_or("").to_string();
            assert!(
                q.contains("labelSelector=app.kubernetes.io%2Fmanaged-by%3Dwarmgate%2Cwarmgate.dev%2Finstance%3Dwg"),
                "only this instance's pods: {q}"
            );
            let pod = |n: &str| json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": n, "namespace": "ml"}});
            let list = json!({"apiVersion": "v1", "kind": "PodList", "metadata": {"resourceVersion": "5"},
                "items": [pod("m-00001-1"), pod("rollouts-2")]});
            send.send_response(
                Response::builder()
                    .body(Full::new(Bytes::from(list.to_string())))
                    .expect("response"),
            );
            let mut deleted = Vec::new();
            for _ in 0..2 {
                let (req, send) = handle.next_request().await.expect("a delete");
                assert_eq!(req.method(), http::Method::DELETE);
                let name = req
                    .uri()
                    .path()
                    .rsplit('/')
                    .next()
                    .unwrap_or("")
                    .to_string();
                send.send_response(
                    Response::builder()
                        .body(Full::new(Bytes::from(pod(&name).to_string())))
                        .expect("response"),
                );
                deleted.push(name);
            }
            deleted
        });
        clean_previous_pods(&client, "ml", "wg").await;
        let deleted = verifier.await.expect("verifier");
        assert_eq!(deleted, ["m-00001-1", "rollouts-2"]);
    }

    #[tokio::test]
    async fn status_is_written_through_the_status_subresource_as_a_merge_patch() {
        let (service, mut handle) =
            tower_test::mock::pair::<Request<kube::client::Body>, Response<Full<Bytes>>>();
        let client = kube::Client::new(service, "ml");
        let api: Api<ServingApp> = Api::namespaced(client, "ml");
        let status = app_status(&gateway_app_status(), Some(3), "2026-11-29T20:00:00Z");
        let expected = serde_json::to_value(&status).expect("json");
        let verifier = tokio::spawn(async move {
            let (req, send) = handle.next_request().await.expect("a call");
            assert_eq!(req.method(), http::Method::PATCH);
            assert_eq!(
                req.uri().path(),
                "/apis/warmgate.dev/v1alpha1/namespaces/ml/servingapps/minilm/status"
            );
            assert_eq!(
                req.headers()["content-type"],
                "application/merge-patch+json"
            );
            let body: Value =
                serde_json::from_slice(&req.into_body().collect_bytes().await.expect("body"))
                    .expect("json");
            assert_eq!(body, json!({"status": expected}), "only the status is sent");
            let mut obj =
                serde_json::to_value(app("minilm", json!({"image": "r/e:1"}))).expect("json");
            obj["status"] = expected;
            send.send_response(
                Response::builder()
                    .header("content-type", "application/json")
                    .body(Full::new(Bytes::from(obj.to_string())))
                    .expect("response"),
            );
        });
        patch_status(&api, "minilm", &status)
            .await
            .expect("patched");
        verifier.await.expect("the verifier saw the call");
    }
}
