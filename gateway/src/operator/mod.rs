//! `warmgate operator`: the gateway in a cluster, driven by `ServingApp`
//! and `WarmPool` resources instead of a config file's `[[apps]]` and
//! `[[pools]]`.
//!
//! - One replica leads, through a `coordination.k8s.io` Lease
//!   (kube-lease-manager). The leader runs the gateway with the kubernetes
//!   backend: pool manager, autoscaler and data plane. The others follow
//!   (`follower.rs`, [`crate::peers`]): they serve the apps' traffic on
//!   the leader's pods, each with its part of every replica's
//!   concurrency, pass every other request to the leader, and take over
//!   within the lease's duration when it goes. Without a peer token (the
//!   admin token, or `WARMGATE_PEER_TOKEN`) they stand by with `/readyz`
//!   at 503.
//! - On taking over, the leader takes over the replica pods an earlier
//!   leader left that its apps and pools want as they are (same model,
//!   weights and settings: the pod's `warmgate.dev/interchangeable`
//!   digest), probing each before routing to it, so a failover cold-starts
//!   nothing; the pods nothing takes over within `runtime::takeover::ADOPTION_GRACE` are
//!   deleted.
//! - A resource's status is patched every few seconds: replicas by state,
//!   revisions with their traffic, conditions.
//! - Each resource is reconciled on its own by kube-runtime's
//!   `Controller` (`operator/reconcile.rs`). A new `spec.checkpoint` on a
//!   `ServingApp` is promoted (canary and automatic rollback, as
//!   `warmgate promote`). Any other change (a resource added, changed or
//!   deleted) is put into the running gateway as `warmgate apply` puts
//!   it: autoscaling and queue settings apply in place, other changes
//!   roll that resource's pods, deleted ones drain, and nothing else is
//!   touched. A resource refused after an edit keeps running as it was.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use kube::api::{Api, ListParams};
use kube::{Resource, ResourceExt as _};
use warmgate_deploy::crd::{ServingApp, WarmPool};

pub mod events;
pub mod follower;
mod reconcile;
pub mod state;
mod status;
use warmgate_deploy::{BackendKind, Config};
use warmgate_pool::kubernetes::{KubeBackend, KubeSettings};

use status::write_statuses;
pub use status::{app_status, patch_status, pool_status};

/// How often statuses are written.
const STATUS_INTERVAL: Duration = Duration::from_secs(5);
/// The Lease's name.
const LEASE: &str = "warmgate-leader";

/// Which kind of resource.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
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
            .and_then(|_| warmgate_pool::weights::Source::open(uri, &base_dir).map(drop))
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
    // Listened for from the first moment to the last: a SIGTERM while
    // this replica stands by, takes the lease or restores its apps stops
    // it cleanly rather than being lost.
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .context("listen for SIGTERM")?;
    let base = match &args.config {
        Some(p) => Config::load(p).map_err(|e| anyhow::anyhow!("{e}"))?,
        None => Config::default(),
    };
    anyhow::ensure!(
        base.apps.is_empty() && base.pools.is_empty(),
        "the operator's --config holds settings only; apps and pools come from ServingApp and WarmPool resources"
    );
    // Inferred once: the operator's client and the state store's own (on
    // its thread) are made from it.
    let kube_config = kube::Config::infer().await.map_err(|e| {
        anyhow::anyhow!(
            "cannot reach the Kubernetes API (no in-cluster config, and no KUBECONFIG): {e}"
        )
    })?;
    let client =
        kube::Client::try_from(kube_config.clone()).context("make the Kubernetes client")?;
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

    // Until this replica leads it follows: it serves the apps on the
    // leader's pods and passes the rest to the leader. Peers show each
    // other the admin token (or WARMGATE_PEER_TOKEN); with neither, it
    // stands by, alive and not ready.
    let peer_token = std::env::var("WARMGATE_PEER_TOKEN")
        .ok()
        .filter(|t| !t.is_empty())
        .or_else(crate::server::admin_token);
    tracing::info!(%identity, namespace = %ns, "waiting for the leader lease");
    let standby = match peer_token.clone() {
        Some(token) if !*leading.borrow() => Standby::Following(start_following(
            &base, &args, &client, &ns, &identity, token,
        )?),
        _ => Standby::Idle(tokio::spawn(standby_server(args.listen))),
    };
    while !*leading.borrow_and_update() {
        tokio::select! {
            r = leading.changed() => r.context("the lease manager stopped")?,
            _ = term.recv() => {
                standby.stop().await;
                return Ok(());
            }
        }
    }
    standby.stop().await;
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
    let backend = KubeBackend::new(
        client.clone(),
        KubeSettings {
            namespace: ns.clone(),
            instance: instance.clone(),
            config: config.backend.kubernetes.clone(),
            stop_grace: config.backend.stop_grace,
        },
    );
    // The pods an earlier leader left, to take over rather than start
    // again (before any target starts).
    crate::runtime::takeover::find_left(&backend).await;
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
    // Revision histories and promotions as the last leader left them.
    let state_secret =
        std::env::var("WARMGATE_STATE_SECRET").unwrap_or_else(|_| format!("{instance}-state"));
    let state = state::KubeState::load(
        move || kube::Client::try_from(kube_config).map_err(|e| e.to_string()),
        &ns,
        &state_secret,
        &identity,
    )
    .await
    .context("read and claim the apps' revision histories in the cluster")?;
    let backend = Arc::new(backend);
    let sweeper = backend.clone();
    let leaver = backend.clone();
    let settings = base_settings(&config);
    crate::runtime::serve_with(
        config,
        backend.clone(),
        Some(Box::new(state)),
        listener,
        move |gw| {
            // Before the listener opens.
            gw.refuse_api_changes();
            if let Some(t) = peer_token {
                gw.set_peer_token(t);
            }
            // Every app and pool has been restored (from the state in the
            // cluster, however slow it was to read): the grace for taking
            // over the earlier leader's pods counts from now.
            // An app that could not start yet (its state unreadable, say)
            // keeps its pods for a few more rounds, to take them over once
            // it starts; an app or pool that runs has taken what it wanted.
            crate::runtime::takeover::sweep_left(gw.clone(), sweeper);
            async move {
                let reason = tokio::select! {
                    _ = term.recv() => "SIGTERM".to_string(),
                    r = leading.wait_for(|l| !*l) => match r {
                        Ok(_) => "lost the leader lease".to_string(),
                        Err(_) => "the lease manager stopped".to_string(),
                    },
                    r = reconcile::run(gw, settings, backend, apps_api, pools_api, refused) => r,
                };
                // Whoever leads next takes the pods over: stopping here
                // leaves them running (an upgrade cold-starts nothing).
                leaver.leave_pods();
                reason
            }
        },
    )
    .await
}

/// Reconciles the namespace's `ServingApp`s and `WarmPool`s into `gw`,
/// which runs on `backend`, until a controller ends: what the leader does
/// once its gateway serves (public for the tests against a mocked API
/// server).
pub async fn reconcile_into(
    gw: Arc<crate::Gateway>,
    backend: Arc<KubeBackend>,
    client: kube::Client,
    namespace: &str,
) -> String {
    let settings = base_settings(gw.config());
    reconcile::run(
        gw,
        settings,
        backend,
        Api::namespaced(client.clone(), namespace),
        Api::namespaced(client, namespace),
        Vec::new(),
    )
    .await
}

/// The running config without its apps and pools: what `config_from`
/// builds the resources on.
fn base_settings(config: &Config) -> Config {
    let mut base = config.clone();
    base.apps.clear();
    base.pools.clear();
    base
}

/// The resources the leader serves, as last seen, and those refused.
struct Resources {
    apps: BTreeMap<String, ServingApp>,
    pools: BTreeMap<String, WarmPool>,
    refused: Vec<Refusal>,
}

impl Resources {
    /// Each resource's `metadata.generation`, by `app/<name>` or
    /// `pool/<name>`.
    fn generations(&self) -> BTreeMap<String, Option<i64>> {
        generations_of(&self.apps, &self.pools)
    }
}

fn generations_of(
    apps: &BTreeMap<String, ServingApp>,
    pools: &BTreeMap<String, WarmPool>,
) -> BTreeMap<String, Option<i64>> {
    apps.iter()
        .map(|(n, a)| (format!("app/{n}"), a.metadata.generation))
        .chain(
            pools
                .iter()
                .map(|(n, p)| (format!("pool/{n}"), p.metadata.generation)),
        )
        .collect()
}

/// What a replica that does not lead runs.
enum Standby {
    /// Serving with the leader.
    Following(Following),
    /// `/healthz` only.
    Idle(tokio::task::JoinHandle<()>),
}

/// A follower's gateway and its tasks.
struct Following {
    gw: Arc<crate::Gateway>,
    /// Its listener, which stops on `closing`.
    serve: tokio::task::JoinHandle<()>,
    closing: tokio::sync::oneshot::Sender<()>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Standby {
    /// Stops serving, and frees the listen address for the leader's
    /// gateway. The leader's pods are not touched.
    async fn stop(self) {
        match self {
            Standby::Idle(t) => {
                t.abort();
                let _ = t.await;
            }
            Standby::Following(f) => {
                for t in &f.tasks {
                    t.abort();
                }
                for t in f.tasks {
                    let _ = t.await;
                }
                // Its connections close too (a keep-alive one would go on
                // asking the follower's router), within a few seconds.
                let _ = f.closing.send(());
                let mut serve = f.serve;
                if tokio::time::timeout(Duration::from_secs(5), &mut serve)
                    .await
                    .is_err()
                {
                    serve.abort();
                    let _ = serve.await;
                }
                f.gw.start_draining();
                let _ = tokio::time::timeout(Duration::from_secs(5), f.gw.shutdown()).await;
            }
        }
    }
}

/// Starts following: a gateway on the leader's replicas (its own state
/// folder beside the leader's), its autoscale tick (which sizes each
/// revision as the leader lists it), the reports, and the listener.
fn start_following(
    base: &Config,
    args: &OperatorArgs,
    client: &kube::Client,
    ns: &str,
    identity: &str,
    token: String,
) -> anyhow::Result<Following> {
    let mut config = base.clone();
    config.listen = args.listen;
    config.state_dir = base.state_dir.join("follower");
    let peer = Arc::new(warmgate_pool::peer::PeerBackend::new());
    let gw = crate::Gateway::new(
        config,
        peer.clone(),
        crate::runtime::install_metrics(),
        args.listen,
    )
    .context("start the follower's gateway")?;
    gw.set_peer_token(token);
    gw.set_follower(peer);
    let leader: follower::LeaderAddr = Arc::default();
    let listen = args.listen;
    let router = follower::router(gw.clone(), leader.clone());
    let (closing, closed) = tokio::sync::oneshot::channel::<()>();
    let serve = tokio::spawn(async move {
        match tokio::net::TcpListener::bind(listen).await {
            Ok(l) => {
                let _ = axum::serve(l, router)
                    .with_graceful_shutdown(async move {
                        let _ = closed.await;
                    })
                    .await;
            }
            Err(e) => tracing::error!(addr = %listen, error = %e, "follower: cannot listen"),
        }
    });
    let instance = std::env::var("WARMGATE_INSTANCE").unwrap_or_else(|_| "warmgate".into());
    let (client, ns, me) = (client.clone(), ns.to_string(), identity.to_string());
    let find = move || {
        let (client, ns, me, instance) = (client.clone(), ns.clone(), me.clone(), instance.clone());
        async move { find_leader(&client, &ns, &me, &instance, listen.port()).await }
    };
    let reports = tokio::spawn(follower::follow(
        gw.clone(),
        identity.to_string(),
        leader,
        find,
    ));
    let tick = crate::runtime::autoscale::spawn(&gw);
    tracing::info!("following: serving the apps on the leader's replicas");
    Ok(Following {
        gw,
        serve,
        closing,
        tasks: vec![reports, tick],
    })
}

/// The leader's address: the Lease's holder, and that pod's IP, when the
/// pod is one of this release's operator pods (the chart's labels): the
/// token is not sent to whatever pod a Lease names.
async fn find_leader(
    client: &kube::Client,
    ns: &str,
    me: &str,
    instance: &str,
    port: u16,
) -> Option<std::net::SocketAddr> {
    use k8s_openapi::api::coordination::v1::Lease;
    use k8s_openapi::api::core::v1::Pod;
    let lease = Api::<Lease>::namespaced(client.clone(), ns)
        .get(LEASE)
        .await
        .ok()?;
    let holder = lease.spec?.holder_identity.filter(|h| h != me)?;
    let pod = Api::<Pod>::namespaced(client.clone(), ns)
        .get(&holder)
        .await
        .ok()?;
    let labels = pod.labels();
    let ours = labels.get("app.kubernetes.io/name").map(String::as_str) == Some("warmgate")
        && labels.get("app.kubernetes.io/instance").map(String::as_str) == Some(instance);
    if !ours {
        tracing::warn!(pod = %holder, "the leader Lease names a pod that is not one of this release's operator pods; not reporting to it");
        return None;
    }
    let ip: std::net::IpAddr = pod.status?.pod_ip?.parse().ok()?;
    Some(std::net::SocketAddr::new(ip, port))
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

/// When `spec` differs from the running app of its name in its checkpoint
/// only: the running checkpoint and the new one, to promote.
fn checkpoint_only_change(
    spec: &warmgate_deploy::AppSpec,
    running: &Config,
) -> Option<(Option<String>, String)> {
    let old = running.apps.iter().find(|a| a.name == spec.name)?;
    let new = spec
        .checkpoint
        .clone()
        .filter(|c| Some(c) != old.checkpoint.as_ref())?;
    let mut rest = spec.clone();
    rest.checkpoint = old.checkpoint.clone();
    (rest == *old).then(|| (old.checkpoint.clone(), new))
}

#[cfg(test)]
mod tests {
    use super::status::{Was, refused_conditions, settle, write_if_changed};
    use super::*;
    use serde_json::json;
    use warmgate_deploy::crd::{ReplicaCounts, ServingAppStatus};
    use warmgate_pool::{ReplicaState, TargetStatus};

    use crate::status::AppStatus;
    use bytes::Bytes;
    use http::{Request, Response};
    use http_body_util::Full;
    use serde_json::Value;

    fn app(name: &str, spec: Value) -> ServingApp {
        serde_json::from_value(json!({
            "apiVersion": "warmgate.dev/v1alpha1", "kind": "ServingApp",
            "metadata": {"name": name, "namespace": "ml", "uid": "u-app", "generation": 3},
            "spec": spec,
        }))
        .expect("a ServingApp")
    }

    #[test]
    fn a_checkpoint_only_edit_is_a_promotion_and_other_edits_are_applied() {
        let dir = tempfile::tempdir().expect("dir");
        for v in ["1", "2"] {
            std::fs::create_dir_all(dir.path().join("ck").join(v)).expect("mkdir");
        }
        let ck = |v: &str| format!("file://{}/ck/{v}", dir.path().display());
        let mut base = Config::default();
        base.weights.allowed_prefixes = Some(vec![format!("file://{}/ck", dir.path().display())]);
        let running = config_from(
            base.clone(),
            &[app("m", json!({"image": "r/m:1", "checkpoint": ck("1")}))],
            &[],
        )
        .expect("valid")
        .0;
        // Only the checkpoint: promoted, from the running one.
        let (edited, _) = config_from(
            base.clone(),
            &[app("m", json!({"image": "r/m:1", "checkpoint": ck("2")}))],
            &[],
        )
        .expect("valid");
        assert_eq!(
            checkpoint_only_change(&edited.apps[0], &running),
            Some((Some(ck("1")), ck("2")))
        );
        // The checkpoint and the image: a roll, not a promotion.
        let (edited, _) = config_from(
            base.clone(),
            &[app("m", json!({"image": "r/m:2", "checkpoint": ck("2")}))],
            &[],
        )
        .expect("valid");
        assert_eq!(checkpoint_only_change(&edited.apps[0], &running), None);
        // Unchanged, or a new app: nothing to promote.
        assert_eq!(checkpoint_only_change(&running.apps[0], &running), None);
        let (other, _) =
            config_from(base, &[app("n", json!({"image": "r/n:1"}))], &[]).expect("valid");
        assert_eq!(checkpoint_only_change(&other.apps[0], &running), None);
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

    fn target(desired: u32, replicas: &[(&str, ReplicaState)]) -> TargetStatus {
        TargetStatus {
            id: warmgate_deploy::TargetId::revision("minilm", 2),
            name: "minilm-00002".into(),
            app: "minilm".into(),
            revision: "minilm-00002".into(),
            desired,
            replicas: replicas
                .iter()
                .map(|(id, state)| warmgate_pool::ReplicaStatus {
                    id: (*id).into(),
                    state: state.clone(),
                    revision: "minilm-00002".into(),
                    addr: None,
                    pid: None,
                    gpus: Vec::new(),
                    inflight: 0,
                    concurrency: 1,
                    idle_seconds: None,
                    age_seconds: 0.0,
                    weights_version: None,
                    log: None,
                    engine: None,
                })
                .collect(),
            restarts: 0,
            health: Default::default(),
            last_cold_start: None,
        }
    }

    fn gateway_app_status() -> AppStatus {
        let revision = |id: &str, traffic| crate::status::RevisionStatus {
            id: id.into(),
            traffic,
            ready: 1,
            ..Default::default()
        };
        AppStatus {
            name: "minilm".into(),
            revision: "minilm-00002".into(),
            revisions: vec![revision("minilm-00002", 90), revision("minilm-00001", 10)],
            pool: Some(target(
                3,
                &[
                    ("minilm-00002-1", ReplicaState::Ready),
                    ("minilm-00002-2", ReplicaState::Starting),
                    (
                        "minilm-00002-3",
                        ReplicaState::Pending {
                            reason: "0/4 nodes are available: 4 Insufficient nvidia.com/gpu."
                                .into(),
                        },
                    ),
                ],
            )),
            ..Default::default()
        }
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
            &AppStatus {
                name: "m".into(),
                pool: Some(target(0, &[])),
                ..Default::default()
            },
            None,
            "t",
        );
        assert_eq!(zero.conditions[0].reason, "ScaledToZero");
        assert_eq!(zero.conditions[0].status, "True");
    }

    #[test]
    fn conditions_keep_their_transition_time_and_an_unchanged_status_is_not_written() {
        let t0 = "2026-11-29T20:00:00Z";
        let t1 = "2026-11-29T20:00:05Z";
        let first = app_status(&gateway_app_status(), Some(3), t0);
        // Five seconds on, nothing changed: the same status, so no write.
        let mut again = app_status(&gateway_app_status(), Some(3), t1);
        assert_ne!(again, first, "a naive status differs by its times alone");
        settle(Some(&first.conditions), &mut again.conditions, t1);
        assert_eq!(again, first, "settled, it is the same: nothing to write");
        // Ready's message changes (2 of 3 ready) but its status does not:
        // its transition time stays.
        let mut more = gateway_app_status();
        if let Some(t) = more.pool.as_mut() {
            t.desired = 4;
        }
        let mut next = app_status(&more, Some(3), t1);
        settle(Some(&first.conditions), &mut next.conditions, t1);
        let ready = next
            .conditions
            .iter()
            .find(|c| c.type_ == "Ready")
            .expect("ready");
        assert_eq!(ready.last_transition_time, t0);
        assert_ne!(next, first, "a changed message is written");
        // The scheduler places everything: Unschedulable turns False at
        // t1 rather than disappearing.
        let placed = app_status(
            &AppStatus {
                name: "m".into(),
                pool: Some(target(0, &[])),
                ..Default::default()
            },
            Some(3),
            t1,
        );
        let mut placed_next = placed.clone();
        settle(Some(&first.conditions), &mut placed_next.conditions, t1);
        let unsched = placed_next
            .conditions
            .iter()
            .find(|c| c.type_ == "Unschedulable")
            .expect("kept");
        assert_eq!(unsched.status, "False");
        assert_eq!(unsched.last_transition_time, t1);
        // Ready went from True (Serving) to True (ScaledToZero): no
        // transition.
        let ready = placed_next
            .conditions
            .iter()
            .find(|c| c.type_ == "Ready")
            .expect("ready");
        assert_eq!(ready.last_transition_time, t0);
    }

    /// A resource that is refused: `Ready=False` with the key at fault, and
    /// a Warning event about it with the same reason; the same status
    /// again writes nothing and says nothing.
    #[tokio::test]
    async fn a_refused_resource_gets_its_condition_and_a_warning_event_once() {
        let (service, mut handle) =
            tower_test::mock::pair::<Request<kube::client::Body>, Response<Full<Bytes>>>();
        let client = kube::Client::new(service, "ml");
        let api: Api<ServingApp> = Api::namespaced(client.clone(), "ml");
        let recorder = events::Events::new(client, Some("wg-0".into()));
        let mut resource = app("minilm", json!({"image": "r/e:1", "concurrency": 0}));
        resource.metadata.uid = Some("u-7".into());
        let refusal = Refusal {
            kind: ResourceKind::App,
            name: "minilm".into(),
            key: "spec.concurrency".into(),
            message: "must be at least 1".into(),
        };
        let now = "2026-12-01T00:00:00Z";
        let status = ServingAppStatus {
            conditions: refused_conditions(&refusal, now),
            ..ServingAppStatus::default()
        };
        let echo = serde_json::to_value(&resource).expect("json");
        let verifier = tokio::spawn(async move {
            let (req, send) = handle.next_request().await.expect("the status patch");
            assert_eq!(req.method(), http::Method::PATCH);
            assert!(req.uri().path().ends_with("/servingapps/minilm/status"));
            send.send_response(
                Response::builder()
                    .header("content-type", "application/json")
                    .body(Full::new(Bytes::from(echo.to_string())))
                    .expect("response"),
            );
            let (req, send) = handle.next_request().await.expect("the event");
            assert_eq!(req.method(), http::Method::POST);
            assert_eq!(
                req.uri().path(),
                "/apis/events.k8s.io/v1/namespaces/ml/events"
            );
            let body: Value =
                serde_json::from_slice(&req.into_body().collect_bytes().await.expect("body"))
                    .expect("json");
            assert_eq!(body["type"], "Warning", "{body}");
            assert_eq!(body["reason"], "Refused", "{body}");
            assert_eq!(
                body["note"], "spec.concurrency: must be at least 1",
                "{body}"
            );
            assert_eq!(body["regarding"]["kind"], "ServingApp", "{body}");
            assert_eq!(body["regarding"]["name"], "minilm", "{body}");
            assert_eq!(body["regarding"]["uid"], "u-7", "{body}");
            assert_eq!(body["reportingController"], "warmgate-operator", "{body}");
            send.send_response(
                Response::builder()
                    .header("content-type", "application/json")
                    .body(Full::new(Bytes::from(body.to_string())))
                    .expect("response"),
            );
            handle
        });
        let was = Was {
            status: None,
            regarding: Some(resource.object_ref(&())),
            events: &recorder,
        };
        write_if_changed(&api, "minilm", was, status.clone(), now)
            .await
            .expect("written");
        let mut handle = verifier.await.expect("the verifier saw both calls");
        // Written once: the same status again is neither patched nor told.
        let again = Was {
            status: Some(status.clone()),
            regarding: Some(resource.object_ref(&())),
            events: &recorder,
        };
        write_if_changed(&api, "minilm", again, status, now)
            .await
            .expect("nothing to write");
        assert!(
            tokio::time::timeout(Duration::from_millis(100), handle.next_request())
                .await
                .is_err(),
            "no call for an unchanged status"
        );
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
