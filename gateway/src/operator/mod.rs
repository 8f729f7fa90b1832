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
    // config's folder.
    let base_dir = base
        .workers_folder()
        .unwrap_or_else(|| std::path::PathBuf::from("."));
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
    let base = base_config(&args)?;
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
    let (mut leading, _lease_task) = join_election(&client, &ns, &identity).await?;

    // Until this replica leads it follows: it serves the apps on the
    // leader's pods and passes the rest to the leader. Peers show each
    // other the admin token (or WARMGATE_PEER_TOKEN); with neither, it
    // stands by, alive and not ready.
    let peer_token = std::env::var("WARMGATE_PEER_TOKEN")
        .ok()
        .filter(|t| !t.is_empty())
        .or_else(crate::access::admin_token);
    tracing::info!(%identity, namespace = %ns, "waiting for the leader lease");
    let standby = match peer_token.clone() {
        Some(token) if !*leading.borrow() => Standby::Following(start_following(
            &base, &args, &client, &ns, &identity, token,
        )?),
        _ => Standby::Idle(tokio::spawn(standby_server(args.listen))),
    };
    if !wait_to_lead(standby, &mut leading, &mut term).await? {
        return Ok(());
    }
    tracing::info!(%identity, "leading");

    let apps_api: Api<ServingApp> = Api::namespaced(client.clone(), &ns);
    let pools_api: Api<WarmPool> = Api::namespaced(client.clone(), &ns);
    let (apps, pools) = list_resources(&apps_api, &pools_api).await?;
    let (config, refused) = leader_config(base, &apps, &pools, args.listen)?;
    let instance = std::env::var("WARMGATE_INSTANCE").unwrap_or_else(|_| "warmgate".into());
    let backend = leader_backend(&client, &ns, &instance, &config, &apps, &pools).await;
    let listener = tokio::net::TcpListener::bind(config.listen)
        .await
        .with_context(|| format!("listen on {}", config.listen))?;
    let state = claim_state(kube_config, &ns, &instance, &identity).await?;
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
            gw.changes.refuse_api_changes();
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

/// The operator's own config (`--config`, or the defaults): settings
/// only, no apps or pools.
fn base_config(args: &OperatorArgs) -> anyhow::Result<Config> {
    let base = match &args.config {
        Some(p) => Config::load(p).map_err(|e| anyhow::anyhow!("{e}"))?,
        None => Config::default(),
    };
    anyhow::ensure!(
        base.apps.is_empty() && base.pools.is_empty(),
        "the operator's --config holds settings only; apps and pools come from ServingApp and WarmPool resources"
    );
    Ok(base)
}

/// Joins the election for the leader lease: whether this replica leads,
/// as it changes, and the task that keeps the lease.
async fn join_election(
    client: &kube::Client,
    ns: &str,
    identity: &str,
) -> anyhow::Result<(
    tokio::sync::watch::Receiver<bool>,
    tokio::task::JoinHandle<kube_lease_manager::Result<kube_lease_manager::LeaseManager>>,
)> {
    let manager = kube_lease_manager::LeaseManagerBuilder::new(client.clone(), LEASE)
        .with_namespace(ns)
        .with_identity(identity)
        .build()
        .await
        .context("set up the leader election Lease")?;
    Ok(manager.watch().await)
}

/// The namespace's `ServingApp`s and `WarmPool`s as they are now.
async fn list_resources(
    apps_api: &Api<ServingApp>,
    pools_api: &Api<WarmPool>,
) -> anyhow::Result<(Vec<ServingApp>, Vec<WarmPool>)> {
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
    Ok((apps, pools))
}

/// The leader's config: the base with the resources' apps and pools,
/// listening on `listen`; and the resources refused (each logged).
fn leader_config(
    base: Config,
    apps: &[ServingApp],
    pools: &[WarmPool],
    listen: std::net::SocketAddr,
) -> anyhow::Result<(Config, Vec<Refusal>)> {
    let (mut config, refused) = config_from(base, apps, pools)
        .map_err(|(key, m)| anyhow::anyhow!("the operator's config is not valid: {key}: {m}"))?;
    for r in &refused {
        tracing::warn!(kind = ?r.kind, name = %r.name, key = %r.key, reason = %r.message, "refused a resource");
    }
    config.listen = listen;
    Ok((config, refused))
}

/// Stands by (following or idle) until this replica takes the lease:
/// true once it leads, false on SIGTERM. The standby is stopped either way.
async fn wait_to_lead(
    standby: Standby,
    leading: &mut tokio::sync::watch::Receiver<bool>,
    term: &mut tokio::signal::unix::Signal,
) -> anyhow::Result<bool> {
    while !*leading.borrow_and_update() {
        tokio::select! {
            r = leading.changed() => r.context("the lease manager stopped")?,
            _ = term.recv() => {
                standby.stop().await;
                return Ok(false);
            }
        }
    }
    standby.stop().await;
    Ok(true)
}

/// The leader's backend, holding the pods an earlier leader left and
/// owning each resource's pods by it.
async fn leader_backend(
    client: &kube::Client,
    ns: &str,
    instance: &str,
    config: &Config,
    apps: &[ServingApp],
    pools: &[WarmPool],
) -> KubeBackend {
    let backend = KubeBackend::new(
        client.clone(),
        KubeSettings {
            namespace: ns.to_string(),
            instance: instance.to_string(),
            config: config.backend.kubernetes.clone(),
            stop_grace: config.backend.stop_grace,
        },
    );
    // The pods an earlier leader left, to take over rather than start
    // again (before any target starts).
    crate::runtime::takeover::find_left(&backend).await;
    for a in apps {
        if let Some(o) = owner_of(a) {
            backend.set_owner(&a.name_any(), o);
        }
    }
    for p in pools {
        if let Some(o) = owner_of(p) {
            backend.set_owner(&p.name_any(), o);
        }
    }
    backend
}

/// Revision histories and promotions as the last leader left them, read
/// from the cluster and claimed for `identity`.
async fn claim_state(
    kube_config: kube::Config,
    ns: &str,
    instance: &str,
    identity: &str,
) -> anyhow::Result<state::KubeState> {
    let state_secret =
        std::env::var("WARMGATE_STATE_SECRET").unwrap_or_else(|_| format!("{instance}-state"));
    state::KubeState::load(
        move || kube::Client::try_from(kube_config).map_err(|e| e.to_string()),
        ns,
        &state_secret,
        identity,
    )
    .await
    .context("read and claim the apps' revision histories in the cluster")
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
mod tests;
