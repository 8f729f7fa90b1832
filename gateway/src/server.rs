//! The gateway: its state, the HTTP routes and the autoscaling loop.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::extract::{Path, Request, State};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{any, get, post};
use bytes::Bytes;
use futures_util::StreamExt;
use http::{HeaderValue, StatusCode, header};
use http_body_util::{BodyExt, Limited};
use serde::Serialize;
use serde_json::json;
use tokio::task::JoinHandle;
use warmgate_deploy::Config;
use warmgate_pool::{
    Backend, PoolManager, ReplicaHandle, ReplicaSink, TargetHealth, TargetSpec, TargetStatus,
};

use crate::dispatch::{Acquire, App};
use crate::error::{ApiError, ErrorKind};
use crate::proxy::{LimitedBody, Proxy};
use crate::serving::Served;
use crate::tenants::Tenant;

/// How often the autoscaler looks at demand. One second resolves the 6 s
/// panic window into six samples, as Knative's 2 s tick does for its window,
/// and keeps the policy cheap.
pub const AUTOSCALE_TICK: Duration = Duration::from_secs(1);

const X_REQUEST_ID: &str = "x-request-id";
const X_REPLICA: &str = "x-warmgate-replica";
const X_REVISION: &str = "x-warmgate-revision";
const X_QUEUED_MS: &str = "x-warmgate-queued-ms";
const X_COLD_START: &str = "x-warmgate-cold-start";
const X_TENANT: &str = "x-warmgate-tenant";
/// Request bodies up to this size are kept so that a request refused by a
/// dying replica can go to another; larger ones stream through once.
const MAX_REPLAY_BYTES: u64 = 64 * 1024;
/// Tries of a request whose replicas refuse the connection.
const MAX_CONNECT_ATTEMPTS: u32 = 3;
/// Pause before the next try, times the tries so far.
const CONNECT_RETRY_PAUSE: Duration = Duration::from_millis(20);
/// The longest timeout a client may ask for: past it, deadline arithmetic
/// could overflow, and no task or sync should wait a month.
const MAX_CLIENT_DURATION: Duration = Duration::from_secs(30 * 24 * 3600);
/// Client-supplied request ids longer than this are replaced.
const MAX_REQUEST_ID_LEN: usize = 128;

/// The gateway's shared state.
pub struct Gateway {
    pub(crate) config: Arc<Config>,
    /// The apps and pools served now, swapped whole on a change.
    pub(crate) registry: crate::registry::Live,
    /// Every app revision ever started, by id (for replica events).
    pub(crate) revisions: Revisions,
    pub(crate) pool: PoolManager,
    proxy: Proxy,
    started: Instant,
    draining: AtomicBool,
    metrics: Option<metrics_exporter_prometheus::PrometheusHandle>,
    pub(crate) weights: Arc<crate::weights::Weights>,
    pub(crate) tasks: Arc<crate::pools::TaskStore>,
    /// Where workers reach the gateway.
    pub(crate) reach: String,
    /// The workers' working directory.
    pub(crate) workdir: Option<std::path::PathBuf>,
    /// Revision history, on disk.
    pub(crate) store: parking_lot::Mutex<warmgate_deploy::store::Store>,
    /// `WARMGATE_ADMIN_TOKEN`: the control plane's bearer token.
    admin_token: Option<String>,
    /// Data-plane API keys and quotas (`None`: the data plane is open).
    tenants: Option<crate::tenants::Tenants>,
    /// Held by whoever changes the registry: one change at a time.
    pub(crate) changes: tokio::sync::Mutex<()>,
    /// Apps and pools a change is being applied to (a second change to
    /// one of them meanwhile gets 409).
    pub(crate) busy: parking_lot::Mutex<std::collections::HashSet<String>>,
    /// Deleted pools still finishing their tasks.
    pub(crate) retiring_pools: parking_lot::Mutex<std::collections::HashSet<String>>,
}

/// The admin token from the environment, when set and not empty.
pub fn admin_token() -> Option<String> {
    std::env::var("WARMGATE_ADMIN_TOKEN")
        .ok()
        .filter(|t| !t.is_empty())
}

/// App revisions by id, shared with the replica sink.
pub(crate) type Revisions = Arc<parking_lot::RwLock<HashMap<String, Arc<App>>>>;

/// Tells apps and pools about replicas as the pool manager starts and
/// stops them.
struct Sink {
    revisions: Revisions,
    registry: crate::registry::Live,
    /// Mints and revokes each replica's weights token.
    weights: Arc<crate::weights::Weights>,
}

impl ReplicaSink for Sink {
    /// A pool replica may read every weight version of its pool (it syncs
    /// in place); an app replica with a checkpoint, its revision's.
    fn replica_env(&self, spec: &TargetSpec, replica: &str) -> BTreeMap<String, String> {
        let grant = if spec.pool {
            crate::weights::Grant::Pool {
                target: spec.app.clone(),
            }
        } else if spec.checkpoint.is_some() {
            crate::weights::Grant::Revision {
                target: spec.app.clone(),
                revision: spec.revision.clone(),
            }
        } else {
            return BTreeMap::new();
        };
        match self.weights.issue(replica, grant) {
            Ok(token) => BTreeMap::from([("WARMGATE_WEIGHTS_TOKEN".to_string(), token)]),
            Err(e) => {
                // The worker then gets 401 for its weights and fails to
                // start, which its target reports.
                tracing::error!(%replica, error = %e.message, "could not mint a weights token");
                BTreeMap::new()
            }
        }
    }

    fn replica_ended(&self, replica: &str) {
        self.weights.revoke_replica(replica);
    }

    fn replica_ready(&self, replica: Arc<ReplicaHandle>) {
        let app = self.revisions.read().get(&replica.target).cloned();
        if let Some(app) = app {
            app.add_replica(replica);
        } else if let Some(pool) = self.registry.load().pool_of_target(&replica.target) {
            pool.add_replica(replica);
        }
    }

    fn replica_removed(&self, replica: &Arc<ReplicaHandle>) {
        let app = self.revisions.read().get(&replica.target).cloned();
        if let Some(app) = app {
            app.remove_replica(replica);
        } else if let Some(pool) = self.registry.load().pool_of_target(&replica.target) {
            pool.remove_replica(replica);
        }
    }

    fn start_failed(&self, target: &str, error: &warmgate_pool::Error, health: &TargetHealth) {
        if health.ready > 0 || health.starting > 0 {
            return;
        }
        let app = self.revisions.read().get(target).cloned();
        if let Some(app) = app {
            app.fail_waiters(&ApiError::new(
                ErrorKind::ReplicaFailed,
                format!("app '{}' failed to start: {error}", app.name),
            ));
        } else if let Some(pool) = self.registry.load().pool_of_target(target).cloned() {
            let err = ApiError::new(
                ErrorKind::ReplicaFailed,
                format!("pool '{target}' failed to start a replica: {error}"),
            );
            if pool.ondemand_target().as_deref() == Some(target) {
                pool.fail_fallback(&err);
            } else {
                pool.fail_pending(&err);
            }
        }
    }
}

// === impl Gateway ===

impl Gateway {
    /// Builds the gateway and its pool manager. Replicas start on demand.
    /// `addr` is where the gateway listens, for the workers' weights URL.
    /// Must be called within a tokio runtime.
    pub fn new(
        config: Config,
        backend: Arc<dyn Backend>,
        metrics: Option<metrics_exporter_prometheus::PrometheusHandle>,
        addr: std::net::SocketAddr,
    ) -> anyhow::Result<Arc<Self>> {
        use anyhow::Context as _;
        let workdir = config.state_dir.parent().map(|p| p.to_path_buf());
        let base = workdir
            .clone()
            .unwrap_or_else(|| std::path::PathBuf::from("."));
        // Owner only: it holds the state database, replica logs and the
        // weight cache.
        {
            use std::os::unix::fs::DirBuilderExt as _;
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(&config.state_dir)
                .with_context(|| format!("create {}", config.state_dir.display()))?;
        }
        let tenants =
            crate::tenants::Tenants::from_config(&config.tenants, |v| std::env::var(v).ok())
                .map_err(|(key, message)| anyhow::anyhow!("{key}: {message}"))?;
        let db = config.state_dir.join("state.db");
        let store = warmgate_deploy::store::Store::open(&db)
            .with_context(|| format!("open {}", db.display()))?;
        let w = &config.weights;
        let cache =
            warmgate_pool::weights::Cache::open(config.state_dir.join("cache"), w.cache_max_bytes)
                .context("open the weight cache")?;
        let allowed = warmgate_pool::weights::AllowList::new(
            &crate::weights::allowed_prefixes(&config),
            &base,
        )
        .context("weights.allowed_prefixes")?;
        let weights = Arc::new(crate::weights::Weights::new(
            cache,
            warmgate_pool::weights::StreamConfig {
                concurrency: w.concurrency,
                part_size: w.part_size_bytes,
                memory_limit: w.memory_limit_bytes,
            },
            allowed,
            base,
        ));
        // Pods reach the gateway at its advertised address (its Service);
        // workers on this machine on loopback when it listens on every
        // interface.
        let reach = match &config.backend.kubernetes.advertise {
            Some(a) if config.backend.kind == warmgate_deploy::BackendKind::Kubernetes => a.clone(),
            _ if addr.ip().is_unspecified() => {
                std::net::SocketAddr::from(([127, 0, 0, 1], addr.port())).to_string()
            }
            _ => addr.to_string(),
        };
        // The changes made through the API, over the file. The weights
        // allow-list above is the file's alone: a checkpoint put through
        // the API must lie under it.
        let overlay = store
            .overlay()
            .context("read the changes made through the API")?;
        let mut config = config;
        if !overlay.is_empty() {
            let names: Vec<String> = overlay
                .apps
                .keys()
                .map(|n| format!("app {n}"))
                .chain(overlay.pools.keys().map(|n| format!("pool {n}")))
                .collect();
            overlay.apply_to(&mut config);
            config.validate().map_err(|(key, message)| {
                anyhow::anyhow!(
                    "the changes made through the API ({}) do not fit the config file: {key}: {message}",
                    names.join(", ")
                )
            })?;
            tracing::info!(changes = %names.join(", "), "applying the changes made through the API over the config file");
        }
        let tasks = Arc::new(crate::pools::TaskStore::new(crate::pools::StoreLimits {
            max_pending_bytes: config.limits.max_pending_task_bytes,
            max_results_bytes: config.limits.max_task_results_bytes,
        }));
        let (journal, recovered) =
            crate::journal::Journal::open(&db, config.limits.max_journal_bytes)
                .with_context(|| format!("open the task journal in {}", db.display()))?;
        if recovered.failed > 0 {
            tracing::warn!(
                tasks = recovered.failed,
                "async tasks accepted before the last stop had not finished; they are marked failed (gateway_restarted)"
            );
        }
        metrics::counter!("warmgate_tasks_failed_by_restart_total").increment(recovered.failed);
        tasks.set_journal(Arc::new(journal));
        let revisions: Revisions = Arc::default();
        let registry: crate::registry::Live = Arc::default();
        let pool = PoolManager::new(
            backend,
            config.backend.gpus.clone(),
            Arc::new(Sink {
                revisions: revisions.clone(),
                registry: registry.clone(),
                weights: weights.clone(),
            }),
        );
        let gw = Arc::new(Gateway {
            config: Arc::new(config),
            registry,
            revisions,
            pool,
            proxy: Proxy::new(),
            started: Instant::now(),
            draining: AtomicBool::new(false),
            metrics,
            weights,
            tasks,
            reach,
            workdir,
            store: parking_lot::Mutex::new(store),
            admin_token: admin_token(),
            tenants,
            changes: tokio::sync::Mutex::new(()),
            busy: parking_lot::Mutex::default(),
            retiring_pools: parking_lot::Mutex::default(),
        });
        for spec in &gw.config.pools {
            gw.start_pool(spec.clone())?;
        }
        for spec in &gw.config.apps {
            gw.start_app(spec.clone())
                .with_context(|| format!("app '{}'", spec.name))?;
        }
        Ok(gw)
    }

    /// Starts serving a pool: its targets (and on-demand fallback) in the
    /// pool manager at their minimum, its dispatcher, and its place in the
    /// registry.
    pub(crate) fn start_pool(
        self: &Arc<Self>,
        spec: warmgate_deploy::PoolSpec,
    ) -> anyhow::Result<Arc<crate::pools::Pool>> {
        let p = crate::pools::Pool::new(spec, self.tasks.clone());
        let revision = format!("{}-00001", p.name);
        let mut env = p.spec.env.clone();
        if let Some(uri) = &p.spec.checkpoint {
            // Opened here so a bad URI fails at start, not at first use.
            let src = self
                .weights
                .open(uri)
                .map_err(|e| anyhow::anyhow!("pool '{}': {}", p.name, e.message))?;
            self.weights.register(&p.name, &revision, src);
            env.insert(
                "WARMGATE_WEIGHTS_URL".into(),
                format!("http://{}/v1/weights/{}/{revision}", self.reach, p.name),
            );
            env.insert("WARMGATE_WEIGHTS_VERSION".into(), "0".into());
        }
        // In the registry before its targets exist: the replica sink finds
        // the pool by target as soon as a replica is ready.
        self.registry.rcu(|r| Arc::new(r.with_pool(p.clone())));
        let pool = &self.pool;
        let spot = TargetSpec {
            name: p.name.clone(),
            app: p.name.clone(),
            revision,
            command: p.spec.command.clone(),
            env,
            checkpoint: p.spec.checkpoint.clone(),
            workdir: self.workdir.clone(),
            concurrency: p.spec.concurrency,
            gpus: p.spec.gpus,
            startup_timeout: p.spec.startup_timeout,
            stop_grace: self.config.backend.stop_grace,
            image: p.spec.image.clone(),
            pod: p.spec.kubernetes.clone(),
            pool: true,
        };
        let od = p.ondemand_target();
        if let Some(od) = &od {
            let mut spec = spot.clone();
            spec.name = od.clone();
            spec.pod.interruptible = false;
            pool.add_target(spec);
            let (manager, pool_ref, od) = (pool.clone(), Arc::downgrade(&p), od.clone());
            p.set_ondemand_starter(Box::new(move || {
                if let Some(p) = pool_ref.upgrade() {
                    let starting = manager
                        .health(&od)
                        .map_or(0, |h| (h.starting + h.pending) as u32);
                    let want = p.ondemand_desired(starting);
                    if manager.desired(&od).unwrap_or(0) < want {
                        manager.scale(&od, want);
                    }
                }
            }));
        }
        pool.add_target(spot);
        let manager = pool.clone();
        let name = p.name.clone();
        p.set_replacer(Box::new(move |replica, reason| {
            let target = match &od {
                Some(od) if replica.starts_with(&format!("{od}-")) => od.as_str(),
                _ => name.as_str(),
            };
            if !manager.replace(target, replica, reason) {
                tracing::error!(pool = %name, %replica, "could not ask for the replica to be replaced");
            }
        }));
        pool.scale(&p.name, p.spec.replicas[0]);
        tokio::spawn(p.clone().run());
        Ok(p)
    }

    /// Starts serving an app: its history from the store, its revisions
    /// restored (a new one when its spec changed since), its checkpoint
    /// watcher, and its place in the registry.
    pub(crate) fn start_app(
        self: &Arc<Self>,
        spec: warmgate_deploy::AppSpec,
    ) -> anyhow::Result<Arc<Served>> {
        use anyhow::Context as _;
        let history = self
            .store
            .lock()
            .load(&spec.name)
            .context("read its revision history")?;
        let app = Arc::new(Served::new(spec, history));
        self.restore(&app).context("restore its revisions")?;
        self.registry.rcu(|r| Arc::new(r.with_app(app.clone())));
        if app.spec().promotion.watch.is_some() {
            tokio::spawn(self.clone().watch(app.clone()));
        }
        Ok(app)
    }

    /// The config it runs.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// Time since start: the autoscaler's clock.
    fn now(&self) -> Duration {
        self.started.elapsed()
    }

    /// Runs the autoscaler every [`AUTOSCALE_TICK`] until aborted.
    pub fn spawn_autoscaler(self: &Arc<Self>) -> JoinHandle<()> {
        let gw = self.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(AUTOSCALE_TICK);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                if gw.draining.load(Ordering::Acquire) {
                    return;
                }
                let now = gw.now();
                let registry = gw.registry.load_full();
                for served in registry.apps() {
                    let (mut desired, mut inflight, mut queued) = (0u32, 0u32, 0usize);
                    for app in served.live() {
                        app.tick(now, |n| {
                            gw.pool.scale(&app.revision, n);
                            desired += n;
                        });
                        let (i, q) = app.load();
                        inflight += i;
                        queued += q;
                    }
                    let name = served.name.clone();
                    metrics::gauge!("warmgate_replicas_desired", "app" => name.clone())
                        .set(f64::from(desired));
                    metrics::gauge!("warmgate_inflight", "app" => name.clone())
                        .set(f64::from(inflight));
                    metrics::gauge!("warmgate_queued", "app" => name).set(queued as f64);
                }
                let instant = Instant::now();
                for p in registry.pools() {
                    p.expire(instant);
                    let desired = p.desired(gw.starting(&p.name));
                    gw.pool.scale(&p.name, desired);
                    if let Some(od) = p.ondemand_target() {
                        gw.pool.scale(&od, p.ondemand_desired(gw.starting(&od)));
                    }
                    let (pending, inflight, _) = p.load();
                    metrics::gauge!("warmgate_tasks_pending", "pool" => p.name.clone())
                        .set(pending as f64);
                    metrics::gauge!("warmgate_tasks_inflight", "pool" => p.name.clone())
                        .set(f64::from(inflight));
                    metrics::gauge!("warmgate_replicas_desired", "app" => p.name.clone())
                        .set(f64::from(desired));
                }
                record_replica_metrics(&gw.pool.status(), AUTOSCALE_TICK);
            }
        })
    }

    /// Stops taking traffic: `/readyz` fails and the autoscaler stops.
    pub fn start_draining(&self) {
        self.draining.store(true, Ordering::Release);
    }

    /// Stops every replica and waits until they are gone.
    pub async fn shutdown(&self) {
        self.start_draining();
        self.pool.shutdown().await;
    }

    /// Serves one request of `served` on the revision the split (or a
    /// pinning `X-Warmgate-Revision`) picks, and counts the answer for
    /// that revision's health unless it was pinned.
    async fn serve(
        self: &Arc<Self>,
        served: &Served,
        mut req: Request,
        path_and_query: &str,
    ) -> (Option<Arc<App>>, Result<Response, ApiError>) {
        use tracing::Instrument as _;
        let traceparent = crate::trace::ensure_traceparent(req.headers_mut());
        let span = tracing::info_span!(
            "request",
            app = %served.name,
            trace_id = %crate::trace::trace_id(&traceparent),
            revision = tracing::field::Empty,
            replica = tracing::field::Empty,
            queued_ms = tracing::field::Empty,
            status = tracing::field::Empty,
        );
        crate::telemetry::set_parent(&span, req.headers());
        let pinned = req
            .headers()
            .get(X_REVISION)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        let app = match served.pick(pinned.as_deref()) {
            Ok(a) => a,
            Err(e) => return (None, Err(e)),
        };
        span.record("revision", app.revision.as_str());
        let t0 = Instant::now();
        let result = self
            .serve_app(&app, req, path_and_query)
            .instrument(span.clone())
            .await;
        match &result {
            Ok(r) => {
                let h = r.headers();
                let text = |n: &str| h.get(n).and_then(|v| v.to_str().ok()).unwrap_or("");
                span.record("replica", text(X_REPLICA));
                span.record("queued_ms", text(X_QUEUED_MS));
                span.record("status", r.status().as_u16());
            }
            Err(e) => {
                span.record("status", e.kind.as_str());
            }
        }
        tracing::debug!(parent: &span, took_ms = t0.elapsed().as_secs_f64() * 1e3, "request done");
        let failed = match &result {
            Ok(r) => r.status().is_server_error(),
            Err(e) => matches!(
                e.kind,
                ErrorKind::ReplicaFailed | ErrorKind::Timeout | ErrorKind::NoCapacity
            ),
        };
        // Only traffic the split routed judges a revision's health: a
        // client pinning a revision (an evaluation, or anyone who can
        // reach the data plane) must not be able to fail a canary, nor to
        // make a bad one look healthy.
        if pinned.is_none() {
            app.answered(failed, t0.elapsed());
        }
        (Some(app), result)
    }

    /// Serves one request with `app`: a slot now, or a wait in the hold
    /// queue, then the forward.
    async fn serve_app(
        self: &Arc<Self>,
        app: &Arc<App>,
        req: Request,
        path_and_query: &str,
    ) -> Result<Response, ApiError> {
        // A replica that refuses the connection (killed a moment ago, not
        // yet seen to exit) was sent nothing, so the request may try
        // another one, if its body can be sent again.
        let (parts, body) = req.into_parts();
        let bytes = match http_body::Body::size_hint(&body).exact() {
            Some(0) => Bytes::new(),
            Some(n) if n <= MAX_REPLAY_BYTES => body
                .collect()
                .await
                .map_err(|e| body_error(&e, self.config.limits.max_body_bytes))?
                .to_bytes(),
            _ => {
                let req = Request::from_parts(parts, body);
                return self.serve_once(app, req, path_and_query).await;
            }
        };
        let mut attempt = 1;
        loop {
            // What the proxy uses of the request; its extensions stay behind.
            let mut req = Request::new(Body::from(bytes.clone()));
            *req.method_mut() = parts.method.clone();
            *req.uri_mut() = parts.uri.clone();
            *req.version_mut() = parts.version;
            *req.headers_mut() = parts.headers.clone();
            match self.serve_once_or_refused(app, req, path_and_query).await {
                Err(crate::proxy::Forward::Refused(e)) if attempt < MAX_CONNECT_ATTEMPTS => {
                    metrics::counter!("warmgate_connect_retries_total").increment(1);
                    tracing::debug!(attempt, error = %e.message, "retrying on another replica");
                    // The pool manager sees a dead process within
                    // milliseconds; give it that long to drop the replica.
                    tokio::time::sleep(CONNECT_RETRY_PAUSE * attempt).await;
                    attempt += 1;
                }
                other => return other.map_err(crate::proxy::Forward::into_error),
            }
        }
    }

    async fn serve_once(
        self: &Arc<Self>,
        app: &Arc<App>,
        req: Request,
        path_and_query: &str,
    ) -> Result<Response, ApiError> {
        self.serve_once_or_refused(app, req, path_and_query)
            .await
            .map_err(crate::proxy::Forward::into_error)
    }

    async fn serve_once_or_refused(
        self: &Arc<Self>,
        app: &Arc<App>,
        req: Request,
        path_and_query: &str,
    ) -> Result<Response, crate::proxy::Forward> {
        use crate::proxy::Forward::Failed;
        if app.ready_replicas() == 0 {
            self.refuse_if_failing(app).map_err(Failed)?;
        }
        let (slot, queued, cold) = match app.acquire().map_err(Failed)? {
            Acquire::Ready(slot) => (slot, Duration::ZERO, false),
            Acquire::Held { pending, cold } => {
                if cold {
                    let pool = &self.pool;
                    app.wake(self.now(), |n| {
                        if pool.desired(&app.revision).unwrap_or(0) < n {
                            pool.scale(&app.revision, n);
                        }
                    });
                }
                let (slot, waited) = pending
                    .wait(app.spec().queue.timeout)
                    .await
                    .map_err(Failed)?;
                (slot, waited, cold)
            }
        };
        let replica = slot.replica().clone();
        let mut resp = self.proxy.forward(req, path_and_query, slot).await?;
        let h = resp.headers_mut();
        if let Ok(v) = HeaderValue::from_str(&replica.id) {
            h.insert(X_REPLICA, v);
        }
        if let Ok(v) = HeaderValue::from_str(&replica.revision) {
            h.insert(X_REVISION, v);
        }
        h.insert(X_QUEUED_MS, HeaderValue::from(queued.as_millis() as u64));
        if cold {
            h.insert(X_COLD_START, HeaderValue::from_static("true"));
        }
        Ok(resp)
    }

    /// With no replica ready and the last starts failing, a new request is
    /// refused at once instead of waiting out the crash-loop backoff.
    fn refuse_if_failing(&self, app: &App) -> Result<(), ApiError> {
        let Some(h) = self.pool.health(&app.revision) else {
            return Ok(());
        };
        if h.ready == 0
            && h.starting == 0
            && h.failing_to_start
            && let Some(retry) = h.retry_in
        {
            let secs = retry.as_secs_f64().ceil() as u64;
            return Err(ApiError::new(
                ErrorKind::NoCapacity,
                format!(
                    "app '{}' is failing to start ({}); next attempt in {secs}s",
                    app.name,
                    h.last_error.as_deref().unwrap_or("unknown error")
                ),
            )
            .retry_after(secs));
        }
        Ok(())
    }

    /// Queues a task and wakes its pool at once if it needs more replicas.
    fn enqueue(
        &self,
        pool: &crate::pools::Pool,
        submit: crate::pools::Submit,
    ) -> Result<
        (
            String,
            tokio::sync::oneshot::Receiver<crate::pools::Outcome>,
        ),
        ApiError,
    > {
        let out = pool.submit(submit)?;
        // Only a queue beyond the free slots can ask for more replicas at
        // once; everything else waits for the autoscaler's tick, which keeps
        // this path cheap.
        if !pool.queued_beyond_free_slots() {
            return Ok(out);
        }
        let desired = pool.desired(self.starting(&pool.name));
        if self.pool.desired(&pool.name).unwrap_or(0) < desired {
            self.pool.scale(&pool.name, desired);
        }
        Ok(out)
    }

    /// Replicas of a target started and not ready yet (or waiting for GPUs).
    fn starting(&self, target: &str) -> u32 {
        self.pool
            .health(target)
            .map_or(0, |h| (h.starting + h.pending) as u32)
    }

    /// An app's name for any of its aliases; a pool's name as it is.
    fn target_name(&self, name: &str) -> String {
        self.registry
            .load()
            .app(name)
            .map_or_else(|| name.to_string(), |a| a.name.clone())
    }

    /// An app's status: the serving revision's figures at the top, every
    /// live revision with its share below.
    fn status_of(&self, served: &Served, targets: &[TargetStatus]) -> AppStatus {
        let shares = served.shares();
        let serving = served.serving();
        let mut revisions = Vec::new();
        let (mut inflight, mut queued) = (0u32, 0usize);
        for app in served.live() {
            let (i, q) = app.load();
            inflight += i;
            queued += q;
            let t = targets.iter().find(|t| t.name == app.revision);
            revisions.push(RevisionStatus {
                id: app.revision.clone(),
                traffic: shares
                    .iter()
                    .find(|(id, _)| *id == app.revision)
                    .map_or(0, |(_, p)| *p),
                ready: app.ready_replicas(),
                desired: t.map_or(0, |t| t.desired),
                inflight: i,
                queued: q,
                replicas: t.map(|t| t.replicas.clone()).unwrap_or_default(),
            });
        }
        let spec = served.spec();
        let (revision, ready, target, handoff) = match &serving {
            Some(a) => (
                a.revision.clone(),
                a.ready_replicas(),
                targets.iter().find(|t| t.name == a.revision),
                a.last_handoff(),
            ),
            None => (String::new(), 0, None, None),
        };
        let promotion = served.history.lock().promotion.clone();
        AppStatus {
            name: served.name.clone(),
            aliases: spec.aliases.clone(),
            revision,
            desired: target.map_or(0, |t| t.desired),
            ready,
            inflight,
            queued,
            capacity: ready as u32 * spec.concurrency,
            concurrency: spec.concurrency,
            max_pending: spec.queue.max_pending,
            min: spec.autoscale.min,
            max: spec.autoscale.max,
            handoff_ms: handoff.map(|d| d.as_secs_f64() * 1e3),
            pool: target.cloned(),
            revisions,
            promotion: promotion.map(|p| json!(p)),
            watch_scans: spec
                .promotion
                .watch
                .as_ref()
                .map(|_| served.watch_scans.load(Ordering::Relaxed)),
        }
    }

    fn status(&self) -> Vec<AppStatus> {
        let targets = self.pool.status();
        self.registry
            .load()
            .apps()
            .iter()
            .map(|a| self.status_of(a, &targets))
            .collect()
    }
}

/// Replicas by state, and replica-seconds (the GPU bill: every replica that
/// exists, starting ones included), per app.
fn record_replica_metrics(targets: &[TargetStatus], tick: Duration) {
    for t in targets {
        let mut by_state = [0u32; 4];
        for r in &t.replicas {
            let i = match r.state.name() {
                "pending" => 0,
                "starting" => 1,
                "ready" => 2,
                "draining" => 3,
                _ => continue,
            };
            by_state[i] += 1;
        }
        for (i, state) in ["pending", "starting", "ready", "draining"]
            .iter()
            .enumerate()
        {
            metrics::gauge!("warmgate_replicas", "app" => t.app.clone(), "state" => *state)
                .set(f64::from(by_state[i]));
        }
        let live = by_state[1] + by_state[2] + by_state[3];
        metrics::counter!("warmgate_replica_seconds_total", "app" => t.app.clone())
            .increment((f64::from(live) * tick.as_secs_f64()).round() as u64);
    }
}

/// One app in `/v1/status`.
#[derive(Debug, Clone, Serialize)]
pub struct AppStatus {
    /// Name.
    pub name: String,
    /// Other `model` names.
    pub aliases: Vec<String>,
    /// Revision served.
    pub revision: String,
    /// Replicas asked for.
    pub desired: u32,
    /// Replicas taking traffic.
    pub ready: usize,
    /// Requests in flight.
    pub inflight: u32,
    /// Requests held.
    pub queued: usize,
    /// Ready replicas × concurrency.
    pub capacity: u32,
    /// Per-replica limit.
    pub concurrency: u32,
    /// Queue bound.
    pub max_pending: u32,
    /// Fewest replicas.
    pub min: u32,
    /// Most replicas.
    pub max: u32,
    /// The gateway's share of the last cold start, in milliseconds.
    pub handoff_ms: Option<f64>,
    /// Replicas and their lifecycle (the serving revision's).
    pub pool: Option<TargetStatus>,
    /// Every live revision, with its share of the traffic.
    pub revisions: Vec<RevisionStatus>,
    /// The last promotion.
    pub promotion: Option<serde_json::Value>,
    /// Times the checkpoint watcher has looked (when it is on).
    pub watch_scans: Option<u64>,
}

/// One live revision in `/v1/status`.
#[derive(Debug, Clone, Serialize)]
pub struct RevisionStatus {
    /// Revision id.
    pub id: String,
    /// Percent of the app's traffic.
    pub traffic: u8,
    /// Replicas taking traffic.
    pub ready: usize,
    /// Replicas asked for.
    pub desired: u32,
    /// Requests in flight.
    pub inflight: u32,
    /// Requests held.
    pub queued: usize,
    /// Its replicas.
    pub replicas: Vec<warmgate_pool::ReplicaStatus>,
}

/// The HTTP routes, data plane and control plane.
pub fn router(gw: Arc<Gateway>) -> Router {
    // The control plane: with `WARMGATE_ADMIN_TOKEN` set, only callers that
    // present it may read status or change deployments.
    let control = Router::new()
        .route("/v1/status", get(status))
        .route("/v1/apps", get(list_apps))
        .route(
            "/v1/apps/{app}",
            get(get_app).put(put_app).delete(delete_app),
        )
        .route(
            "/v1/pools/{pool}",
            get(get_pool).put(put_pool).delete(delete_pool),
        )
        .route("/v1/apps/{app}/promote", post(promote))
        .route("/v1/apps/{app}/rollback", post(rollback))
        .route("/v1/apps/{app}/revisions", get(revisions))
        .route("/v1/pools/{pool}/weights", post(sync_weights))
        .route_layer(middleware::from_fn_with_state(gw.clone(), require_admin));
    // The data plane: with `[[tenants]]` configured, only callers with an
    // API key get through, each within its tenant's quotas.
    let mut data = Router::new()
        .route("/v1/chat/completions", post(openai))
        .route("/v1/completions", post(openai))
        .route("/v1/embeddings", post(openai))
        .route("/v1/models", get(models))
        .route("/apps/{*rest}", any(passthrough))
        .route("/v1/pools/{pool}/tasks", post(submit_task))
        .route("/v1/pools/{pool}/tasks/batch", post(submit_batch))
        .route("/v1/tasks/{id}", get(get_task));
    // Without tenants the layer would only cost time on every request.
    if gw.tenants.is_some() {
        data = data.route_layer(middleware::from_fn_with_state(gw.clone(), require_tenant));
    }
    Router::new()
        .route("/v1/weights/{target}/{revision}", get(weights_manifest))
        .route("/v1/weights/{target}/{revision}/{*file}", get(weights_file))
        .merge(data)
        .route("/ui", get(dashboard))
        .route("/ui/", get(dashboard))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics_text))
        .route("/openapi.json", get(openapi))
        .merge(control)
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(middleware::from_fn(request_id))
        .with_state(gw)
}

/// Lets a control-plane request through when no admin token is configured,
/// or when it carries `Authorization: Bearer <token>`; the comparison takes
/// the same time wherever the tokens differ.
async fn require_admin(State(gw): State<Arc<Gateway>>, req: Request, next: Next) -> Response {
    let Some(token) = &gw.admin_token else {
        return next.run(req).await;
    };
    let presented = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or("");
    if crate::tenants::same_secret(presented, token) {
        next.run(req).await
    } else {
        ApiError::new(
            ErrorKind::Unauthorized,
            "this endpoint needs Authorization: Bearer <the gateway's WARMGATE_ADMIN_TOKEN>",
        )
        .into_response()
    }
}

/// With `[[tenants]]` configured: identifies the caller's tenant by its API
/// key (401 without a known one), admits the request within the tenant's
/// rate and in-flight quotas (429 `quota_exceeded` past them), and sets
/// `X-Warmgate-Tenant` to the tenant's name, so fairness cannot be gamed by
/// the header. The key is not passed on to workers. The in-flight slot is
/// held until the response body ends, so a streamed answer counts.
async fn require_tenant(State(gw): State<Arc<Gateway>>, mut req: Request, next: Next) -> Response {
    let Some(tenants) = &gw.tenants else {
        return next.run(req).await;
    };
    let Some(tenant) = tenants.identify(req.headers()) else {
        return ApiError::new(
            ErrorKind::Unauthorized,
            "this endpoint needs Authorization: Bearer <an API key of a [[tenants]] entry>",
        )
        .into_response();
    };
    let guard = match tenant.admit() {
        Ok(g) => g,
        Err(e) => return e.into_response(),
    };
    let headers = req.headers_mut();
    headers.remove(header::AUTHORIZATION);
    if let Ok(v) = HeaderValue::from_str(&tenant.name) {
        headers.insert(X_TENANT, v);
    }
    req.extensions_mut().insert(tenant);
    let resp = next.run(req).await;
    resp.map(|body| Body::new(crate::tenants::HeldBody::new(body, guard)))
}

// === handlers ===

#[utoipa::path(post, path = "/v1/chat/completions", tag = "inference",
    description = "OpenAI-compatible: routed by the body's `model` to an app (or an alias), streamed when the worker streams. `/v1/completions` and `/v1/embeddings` work the same way.",
    request_body(content = Object, description = "An OpenAI request with a `model` field"),
    responses((status = 200, description = "The worker's answer, passed through"), (status = 404, description = "Unknown model", body = ErrorBody), (status = 429, description = "Queue full", body = ErrorBody), (status = 503, description = "Starting or no capacity", body = ErrorBody)))]
async fn openai(State(gw): State<Arc<Gateway>>, req: Request) -> Response {
    let path = req
        .uri()
        .path_and_query()
        .map_or("/", |p| p.as_str())
        .to_string();
    within_deadline(&gw, async {
        match read_model(&gw, req).await {
            Ok((served, req)) => {
                let (app, result) = gw.serve(&served, req, &path).await;
                finish(app.as_deref(), result)
            }
            Err(e) => finish(None, Err(e)),
        }
    })
    .await
}

/// Runs an inference request under `limits.request_timeout`, from its
/// arrival to its response's headers: past it the client gets `504 timeout`
/// and the request gives up its place in the queue or its replica slot.
async fn within_deadline(gw: &Gateway, work: impl Future<Output = Response>) -> Response {
    let limit = gw.config.limits.request_timeout;
    match tokio::time::timeout(limit, work).await {
        Ok(resp) => resp,
        Err(_) => {
            metrics::counter!("warmgate_request_deadline_exceeded_total").increment(1);
            ApiError::new(
                ErrorKind::Timeout,
                format!(
                    "no response within {} (limits.request_timeout)",
                    humantime::format_duration(limit)
                ),
            )
            .into_response()
        }
    }
}

async fn read_model(gw: &Gateway, req: Request) -> Result<(Arc<Served>, Request), ApiError> {
    let (parts, bytes) = read_body(req, &gw.config.limits).await?;
    let model = model_field(&bytes)?;
    let registry = gw.registry.load();
    let app = registry.app(model.as_ref()).cloned().ok_or_else(|| {
        let mut names: Vec<&str> = registry.route_names().collect();
        names.sort_unstable();
        // A name can be as long as the body: echo only its start.
        let shown: String = model.chars().take(MAX_ECHOED_CHARS).collect();
        let more = if shown.len() < model.len() { "…" } else { "" };
        ApiError::new(
            ErrorKind::NotFound,
            format!(
                "model '{shown}{more}' not found; available models: {}",
                if names.is_empty() {
                    "none".to_string()
                } else {
                    names.join(", ")
                }
            ),
        )
    })?;
    Ok((app, Request::from_parts(parts, Body::from(bytes))))
}

/// The error for a request body that could not be read.
fn body_error(e: &axum::Error, limit: u64) -> ApiError {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = cur {
        if err.is::<crate::proxy::BodyTooLarge>() || err.is::<http_body_util::LengthLimitError>() {
            return too_large(limit);
        }
        cur = err.source();
    }
    ApiError::new(ErrorKind::BadRequest, "could not read the request body")
}

/// The whole request body, within `limits.max_body_bytes` (413 past it).
/// A body that trickles in is cut off at `limits.request_timeout`.
async fn read_body(
    req: Request,
    limits: &warmgate_deploy::LimitsConfig,
) -> Result<(http::request::Parts, Bytes), ApiError> {
    read_body_within(req, limits, BodyLimit::Inference).await
}

/// Which size limit a body is read within.
#[derive(Debug, Clone, Copy)]
enum BodyLimit {
    /// `limits.max_body_bytes`: inference and control-plane bodies (a
    /// weight sync, a promotion).
    Inference,
    /// `limits.max_task_body_bytes`: task submissions and batches, which
    /// are held until a replica takes them.
    Task,
}

/// The whole request body, within the `which` limit (413 past it), read
/// into one buffer of the announced length: the body is in memory once,
/// never twice.
async fn read_body_within(
    req: Request,
    limits: &warmgate_deploy::LimitsConfig,
    which: BodyLimit,
) -> Result<(http::request::Parts, Bytes), ApiError> {
    let (limit, key) = match which {
        BodyLimit::Inference => (limits.max_body_bytes, "limits.max_body_bytes"),
        BodyLimit::Task => (limits.max_task_body_bytes, "limits.max_task_body_bytes"),
    };
    let announced = content_length(&req);
    if announced.is_some_and(|n| n > limit) {
        return Err(too_large_for(limit, key));
    }
    let (parts, body) = req.into_parts();
    let read = async move {
        let mut body = std::pin::pin!(Limited::new(body, limit as usize));
        let mut buf = bytes::BytesMut::with_capacity(announced.unwrap_or(0).min(limit) as usize);
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|e| {
                if e.is::<http_body_util::LengthLimitError>() {
                    too_large_for(limit, key)
                } else {
                    ApiError::new(ErrorKind::BadRequest, "could not read the request body")
                }
            })?;
            if let Ok(data) = frame.into_data() {
                buf.extend_from_slice(&data);
            }
        }
        Ok::<_, ApiError>(buf.freeze())
    };
    let bytes = tokio::time::timeout(limits.request_timeout, read)
        .await
        .map_err(|_| {
            ApiError::new(
                ErrorKind::Timeout,
                "the request body did not arrive within limits.request_timeout",
            )
        })??;
    Ok((parts, bytes))
}

/// The pool named in the path, the request's headers, and its body, read
/// within the `which` limit (parse it with [`parse_json`]).
async fn pool_request(
    gw: &Gateway,
    name: &str,
    req: Request,
    which: BodyLimit,
) -> Result<(Arc<crate::pools::Pool>, http::HeaderMap, Bytes), ApiError> {
    let pool =
        gw.registry.load().pool(name).cloned().ok_or_else(|| {
            ApiError::new(ErrorKind::NotFound, format!("pool '{name}' not found"))
        })?;
    let (parts, bytes) = read_body_within(req, &gw.config.limits, which).await?;
    Ok((pool, parts.headers, bytes))
}

/// A JSON body as `B`, which may borrow from it; `shape` tells the client
/// what was expected.
fn parse_json<'a, B: serde::Deserialize<'a>>(bytes: &'a [u8], shape: &str) -> Result<B, ApiError> {
    serde_json::from_slice(bytes).map_err(|e| {
        ApiError::new(
            ErrorKind::BadRequest,
            format!("the body must be {shape} ({e})"),
        )
    })
}

/// Characters of a client's string echoed back in an error.
const MAX_ECHOED_CHARS: usize = 200;

/// A JSON value read without building it: a number, a string (borrowed
/// from the body when it has no escapes), or anything else, skipped
/// without keeping it (an array of a million numbers costs nothing).
#[derive(Debug, Clone, Default, PartialEq)]
enum Scalar<'a> {
    /// The key is not in the body.
    #[default]
    Absent,
    /// A number.
    Number(serde_json::Number),
    /// A string.
    Str(std::borrow::Cow<'a, str>),
    /// `null`, a boolean, an array or an object.
    Other,
}

impl<'de: 'a, 'a> serde::Deserialize<'de> for Scalar<'a> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        use serde::de::{IgnoredAny, MapAccess, SeqAccess, Visitor};
        struct V<'a>(std::marker::PhantomData<&'a ()>);
        impl<'de: 'a, 'a> Visitor<'de> for V<'a> {
            type Value = Scalar<'a>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("any JSON value")
            }
            fn visit_bool<E>(self, _: bool) -> Result<Self::Value, E> {
                Ok(Scalar::Other)
            }
            fn visit_i64<E>(self, v: i64) -> Result<Self::Value, E> {
                Ok(Scalar::Number(v.into()))
            }
            fn visit_u64<E>(self, v: u64) -> Result<Self::Value, E> {
                Ok(Scalar::Number(v.into()))
            }
            fn visit_f64<E>(self, v: f64) -> Result<Self::Value, E> {
                Ok(serde_json::Number::from_f64(v).map_or(Scalar::Other, Scalar::Number))
            }
            fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Self::Value, E> {
                Ok(Scalar::Str(std::borrow::Cow::Borrowed(v)))
            }
            fn visit_str<E>(self, v: &str) -> Result<Self::Value, E> {
                Ok(Scalar::Str(std::borrow::Cow::Owned(v.to_owned())))
            }
            fn visit_string<E>(self, v: String) -> Result<Self::Value, E> {
                Ok(Scalar::Str(std::borrow::Cow::Owned(v)))
            }
            fn visit_unit<E>(self) -> Result<Self::Value, E> {
                Ok(Scalar::Other)
            }
            fn visit_none<E>(self) -> Result<Self::Value, E> {
                Ok(Scalar::Other)
            }
            fn visit_some<D: serde::Deserializer<'de>>(
                self,
                d: D,
            ) -> Result<Self::Value, D::Error> {
                <Scalar<'a> as serde::Deserialize<'de>>::deserialize(d)
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                while seq.next_element::<IgnoredAny>()?.is_some() {}
                Ok(Scalar::Other)
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
                Ok(Scalar::Other)
            }
        }
        d.deserialize_any(V(std::marker::PhantomData))
    }
}

/// The JSON `model` field, without parsing the rest of the body into
/// values: other keys are skipped as they are read, and `model` itself is
/// borrowed from the body (a non-string is skipped, not built).
pub fn model_field(body: &[u8]) -> Result<std::borrow::Cow<'_, str>, ApiError> {
    #[derive(serde::Deserialize)]
    struct Model<'a> {
        #[serde(borrow, default)]
        model: Scalar<'a>,
    }
    let not_object = |why: String| {
        ApiError::new(
            ErrorKind::BadRequest,
            format!("the request body must be a JSON object with a \"model\" field ({why})"),
        )
    };
    // serde reads a struct from an array too (`["m"]`); only an object is
    // an OpenAI request.
    if body.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
        return Err(not_object("it is not an object".into()));
    }
    let parsed: Model = serde_json::from_slice(body).map_err(|e| not_object(e.to_string()))?;
    match parsed.model {
        Scalar::Str(s) if !s.is_empty() => Ok(s),
        Scalar::Str(_) => Err(ApiError::new(
            ErrorKind::BadRequest,
            "the \"model\" field is empty; name an app (see GET /v1/models)",
        )),
        Scalar::Number(_) | Scalar::Other => Err(ApiError::new(
            ErrorKind::BadRequest,
            "the \"model\" field must be a string naming an app (see GET /v1/models)",
        )),
        Scalar::Absent => Err(ApiError::new(
            ErrorKind::BadRequest,
            "the request body has no \"model\" field; name an app (see GET /v1/models)",
        )),
    }
}

#[utoipa::path(get, path = "/apps/{app}/{path}", tag = "inference",
    description = "Any method and path, forwarded to one of the app's replicas. `X-Warmgate-Revision` pins a revision.",
    params(("app" = String, Path, description = "App name or alias"), ("path" = String, Path, description = "The worker's path")),
    responses((status = 200, description = "The worker's answer, passed through"), (status = 404, description = "Unknown app", body = ErrorBody)))]
async fn passthrough(State(gw): State<Arc<Gateway>>, req: Request) -> Response {
    let path = req.uri().path();
    let rest = path.strip_prefix("/apps/").unwrap_or("");
    let (name, sub) = match rest.find('/') {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, "/"),
    };
    let Some(app) = gw.registry.load().app(name).cloned() else {
        let err = ApiError::new(ErrorKind::NotFound, format!("app '{name}' not found"));
        return finish(None, Err(err));
    };
    let target = match req.uri().query() {
        Some(q) => format!("{sub}?{q}"),
        None => sub.to_string(),
    };
    let limit = gw.config.limits.max_body_bytes;
    if let Err(e) = check_content_length(&req, limit) {
        return finish(None, Err(e));
    }
    let req = req.map(|b| Body::new(LimitedBody::new(b, limit)));
    within_deadline(&gw, async {
        let (app, result) = gw.serve(&app, req, &target).await;
        finish(app.as_deref(), result)
    })
    .await
}

fn finish(app: Option<&App>, result: Result<Response, ApiError>) -> Response {
    match result {
        Ok(resp) => {
            if let Some(app) = app {
                app.count(None);
            }
            resp
        }
        Err(e) => {
            if let Some(app) = app {
                app.count(Some(e.kind));
            }
            e.into_response()
        }
    }
}

fn check_content_length(req: &Request, limit: u64) -> Result<(), ApiError> {
    match content_length(req) {
        Some(n) if n > limit => Err(too_large(limit)),
        _ => Ok(()),
    }
}

/// The announced `Content-Length`, if any.
fn content_length(req: &Request) -> Option<u64> {
    req.headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
}

fn too_large(limit: u64) -> ApiError {
    too_large_for(limit, "limits.max_body_bytes")
}

fn too_large_for(limit: u64, key: &str) -> ApiError {
    ApiError::new(
        ErrorKind::TooLarge,
        format!("the request body is larger than the limit of {limit} bytes ({key})"),
    )
}

#[utoipa::path(get, path = "/v1/models", tag = "inference",
    responses((status = 200, description = "The apps and their aliases, as OpenAI models", body = Object)))]
async fn models(State(gw): State<Arc<Gateway>>) -> Response {
    let mut data = Vec::new();
    for app in gw.registry.load().apps() {
        for id in std::iter::once(&app.name).chain(app.spec().aliases.iter()) {
            data.push(json!({"id": id, "object": "model", "created": 0, "owned_by": "warmgate"}));
        }
    }
    axum::Json(json!({"object": "list", "data": data})).into_response()
}

#[utoipa::path(get, path = "/v1/status", tag = "control",
    responses((status = 200, description = "Apps (with revisions and replicas) and pools", body = Object)))]
async fn status(State(gw): State<Arc<Gateway>>) -> Response {
    axum::Json(gw.status_json()).into_response()
}

impl Gateway {
    /// The `/v1/status` document: apps, pools and tenants.
    pub fn status_json(&self) -> serde_json::Value {
        let gw = self;
        let targets = gw.pool.status();
        let mut pools: Vec<serde_json::Value> = gw
            .registry
            .load()
            .pools()
            .map(|p| {
                let mut v = p.status();
                v["pool"] = json!(targets.iter().find(|t| t.name == p.name));
                if let Some(od) = p.ondemand_target() {
                    v["ondemand"] = json!(targets.iter().find(|t| t.name == od));
                }
                v
            })
            .collect();
        pools.sort_by(|a, b| a["name"].as_str().cmp(&b["name"].as_str()));
        let tenants = gw.tenants.as_ref().map(|t| t.status()).unwrap_or_default();
        json!({"apps": gw.status(), "pools": pools, "tenants": tenants})
    }

    /// Promotes `checkpoint` on app `name` with the app's own promotion
    /// settings (what `warmgate promote` does without flags). Returns the
    /// new revision's id.
    pub async fn promote_checkpoint(
        self: &Arc<Self>,
        name: &str,
        checkpoint: &str,
    ) -> Result<String, ApiError> {
        let app = served(self, name)?;
        self.promote(
            &app,
            crate::promote::PromoteRequest {
                checkpoint: checkpoint.to_string(),
                canary: None,
                bake: None,
            },
        )
        .await
    }
}

#[utoipa::path(get, path = "/v1/apps", tag = "control",
    responses((status = 200, description = "Every app's status", body = Object)))]
async fn list_apps(State(gw): State<Arc<Gateway>>) -> Response {
    axum::Json(json!({"apps": gw.status()})).into_response()
}

#[utoipa::path(get, path = "/v1/apps/{app}", tag = "control",
    params(("app" = String, Path, description = "App name or alias")),
    responses((status = 200, description = "The app's status", body = Object), (status = 404, description = "Unknown app", body = ErrorBody)))]
async fn get_app(State(gw): State<Arc<Gateway>>, Path(name): Path<String>) -> Response {
    match gw.registry.load().app(&name) {
        Some(app) => {
            let targets = gw.pool.status();
            axum::Json(gw.status_of(app, &targets)).into_response()
        }
        None => {
            ApiError::new(ErrorKind::NotFound, format!("app '{name}' not found")).into_response()
        }
    }
}

/// A name in a control-plane path: a DNS label, or 400 before anything
/// else is looked at.
fn check_path_name(name: &str, what: &str) -> Result<(), ApiError> {
    warmgate_deploy::check_dns_label(name).map_err(|why| {
        let shown: String = why.chars().take(MAX_ECHOED_CHARS + 100).collect();
        ApiError::new(ErrorKind::BadRequest, format!("{what} name: {shown}"))
    })
}

/// A spec from a JSON body, as a `[[apps]]` or `[[pools]]` entry of the
/// config file; its `name`, when given, must be the one in the path. Its
/// relative paths are taken from the workers' folder.
fn spec_from_json<S: serde::de::DeserializeOwned>(bytes: &[u8], what: &str) -> Result<S, ApiError> {
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let spec = serde_path_to_error::deserialize(&mut de).map_err(|e| {
        let key = match e.path().to_string() {
            p if p == "." || p.is_empty() => "(top level)".to_string(),
            p => p,
        };
        ApiError::new(
            ErrorKind::BadRequest,
            format!(
                "the body must be {what} spec as JSON: {key}: {}",
                e.into_inner()
            ),
        )
    })?;
    de.end().map_err(|e| {
        ApiError::new(
            ErrorKind::BadRequest,
            format!("the body must be {what} spec as JSON: {e}"),
        )
    })?;
    Ok(spec)
}

fn name_from_path(spec_name: &mut String, path: &str, what: &str) -> Result<(), ApiError> {
    if spec_name.is_empty() {
        *spec_name = path.to_string();
        return Ok(());
    }
    if spec_name != path {
        return Err(ApiError::new(
            ErrorKind::BadRequest,
            format!("name: the body names {what} '{spec_name}' but the path names '{path}'"),
        ));
    }
    Ok(())
}

fn changed_response(kind: &str, name: &str, changed: crate::change::Changed) -> Response {
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
async fn put_app(
    State(gw): State<Arc<Gateway>>,
    Path(name): Path<String>,
    req: Request,
) -> Response {
    let result: Result<Response, ApiError> = async {
        check_path_name(&name, "app")?;
        let (_, bytes) = read_body(req, &gw.config.limits).await?;
        let mut spec: warmgate_deploy::AppSpec = spec_from_json(&bytes, "an app")?;
        name_from_path(&mut spec.name, &name, "app")?;
        if let Some(dir) = &gw.workdir {
            spec.resolve_paths(dir);
        }
        let changed = gw.put_app(spec).await?;
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
async fn delete_app(State(gw): State<Arc<Gateway>>, Path(name): Path<String>) -> Response {
    let result: Result<Response, ApiError> = async {
        check_path_name(&name, "app")?;
        gw.delete_app(&name).await?;
        Ok(axum::Json(json!({"app": name, "change": "deleted"})).into_response())
    }
    .await;
    result.unwrap_or_else(IntoResponse::into_response)
}

/// `GET /v1/pools/{pool}`: one pool's status, as in `/v1/status`.
#[utoipa::path(get, path = "/v1/pools/{pool}", tag = "control",
    params(("pool" = String, Path, description = "Pool name")),
    responses((status = 200, description = "The pool's status", body = Object), (status = 404, description = "Unknown pool", body = ErrorBody)))]
async fn get_pool(State(gw): State<Arc<Gateway>>, Path(name): Path<String>) -> Response {
    let status = gw.status_json();
    let found = status["pools"]
        .as_array()
        .and_then(|ps| {
            ps.iter()
                .find(|p| p["name"].as_str() == Some(name.as_str()))
        })
        .cloned();
    match found {
        Some(p) => axum::Json(p).into_response(),
        None => {
            ApiError::new(ErrorKind::NotFound, format!("pool '{name}' not found")).into_response()
        }
    }
}

/// `PUT /v1/pools/{pool}`: creates a pool (the same spec again changes
/// nothing; another spec for a running pool is refused).
#[utoipa::path(put, path = "/v1/pools/{pool}", tag = "control",
    params(("pool" = String, Path, description = "Pool name")),
    request_body(content = Object, description = "A `[[pools]]` entry of the config file, as JSON"),
    responses((status = 201, description = "Created: `{pool, change}`", body = Object), (status = 200, description = "`{pool, change: \"unchanged\"}`", body = Object), (status = 400, description = "Bad name or spec; the key is named", body = ErrorBody), (status = 409, description = "Another change to this pool is running, or it runs with another spec", body = ErrorBody)))]
async fn put_pool(
    State(gw): State<Arc<Gateway>>,
    Path(name): Path<String>,
    req: Request,
) -> Response {
    let result: Result<Response, ApiError> = async {
        check_path_name(&name, "pool")?;
        let (_, bytes) = read_body(req, &gw.config.limits).await?;
        let mut spec: warmgate_deploy::PoolSpec = spec_from_json(&bytes, "a pool")?;
        name_from_path(&mut spec.name, &name, "pool")?;
        if let Some(dir) = &gw.workdir {
            spec.resolve_paths(dir);
        }
        let changed = gw.put_pool(spec).await?;
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
async fn delete_pool(State(gw): State<Arc<Gateway>>, Path(name): Path<String>) -> Response {
    let result: Result<Response, ApiError> = async {
        check_path_name(&name, "pool")?;
        gw.delete_pool(&name).await?;
        Ok(axum::Json(json!({"pool": name, "change": "deleted"})).into_response())
    }
    .await;
    result.unwrap_or_else(IntoResponse::into_response)
}

#[derive(serde::Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
struct PromoteBody<'a> {
    checkpoint: String,
    canary: Option<u8>,
    #[serde(borrow, default)]
    #[schema(value_type = Option<Object>)]
    bake: Scalar<'a>,
    #[serde(default)]
    wait: bool,
}

fn served(gw: &Gateway, name: &str) -> Result<Arc<Served>, ApiError> {
    gw.registry
        .load()
        .app(name)
        .cloned()
        .ok_or_else(|| ApiError::new(ErrorKind::NotFound, format!("app '{name}' not found")))
}

/// `POST /v1/apps/{app}/promote`: a new revision from a checkpoint; 202
/// with its id, or with `"wait": true` the promotion's outcome.
#[utoipa::path(post, path = "/v1/apps/{app}/promote", tag = "promotion",
    params(("app" = String, Path, description = "App name")),
    request_body = PromoteBody,
    responses((status = 202, description = "Promotion started: `{app, revision}`", body = Object), (status = 200, description = "With `wait`: `{app, revision, promotion}` once it ended", body = Object), (status = 400, description = "Bad checkpoint URI or body", body = ErrorBody), (status = 404, description = "Unknown app or missing checkpoint", body = ErrorBody), (status = 409, description = "A promotion is running", body = ErrorBody)))]
async fn promote(
    State(gw): State<Arc<Gateway>>,
    Path(name): Path<String>,
    req: Request,
) -> Response {
    let result: Result<Response, ApiError> = async {
        let app = served(&gw, &name)?;
        let (_, bytes) = read_body(req, &gw.config.limits).await?;
        let body: PromoteBody<'_> = serde_json::from_slice(&bytes).map_err(|e| {
            ApiError::new(
                ErrorKind::BadRequest,
                format!(
                    "the body must be {{\"checkpoint\": \"s3://…\", \"canary\"?: 1-100, \"bake\"?, \"wait\"?}} ({e})"
                ),
            )
        })?;
        if body.canary.is_some_and(|c| c == 0 || c > 100) {
            return Err(ApiError::new(ErrorKind::BadRequest, "canary must be 1 to 100 (percent)"));
        }
        let bake = duration_value(&body.bake, "bake")?;
        let id = gw
            .promote(
                &app,
                crate::promote::PromoteRequest {
                    checkpoint: body.checkpoint,
                    canary: body.canary,
                    bake,
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
async fn rollback(State(gw): State<Arc<Gateway>>, Path(name): Path<String>) -> Response {
    let result = served(&gw, &name).and_then(|app| {
        let id = gw.rollback(&app)?;
        Ok(axum::Json(json!({"app": app.name, "revision": id})).into_response())
    });
    result.unwrap_or_else(IntoResponse::into_response)
}

/// `GET /v1/apps/{app}/revisions`: the history, newest first, with notes.
#[utoipa::path(get, path = "/v1/apps/{app}/revisions", tag = "promotion",
    params(("app" = String, Path, description = "App name")),
    responses((status = 200, description = "`{app, revisions, promotion, notes}`", body = Object), (status = 404, description = "Unknown app", body = ErrorBody)))]
async fn revisions(State(gw): State<Arc<Gateway>>, Path(name): Path<String>) -> Response {
    let result = served(&gw, &name).and_then(|app| {
        let h = app.history.lock().clone();
        let notes = gw.store.lock().notes(&app.name, 50).map_err(|e| {
            ApiError::new(
                ErrorKind::NoCapacity,
                format!("cannot read the history: {e}"),
            )
        })?;
        let mut revisions = h.revisions.clone();
        revisions.reverse();
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

/// A task submission. The input is kept as the client's text (validated,
/// never built into values) and sent to the worker as it is.
#[derive(serde::Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
struct TaskBody<'a> {
    #[serde(borrow)]
    #[schema(value_type = Object)]
    input: &'a serde_json::value::RawValue,
    priority: Option<i32>,
    #[serde(borrow, default)]
    #[schema(value_type = Option<Object>)]
    timeout: Scalar<'a>,
    retries: Option<u32>,
    min_weights_version: Option<u64>,
}

#[derive(serde::Deserialize)]
struct TaskQuery {
    #[serde(rename = "async", default)]
    is_async: bool,
}

/// `POST /v1/pools/{pool}/tasks`: queue a task; wait for its output, or
/// answer 202 with its id when `?async=true`.
#[utoipa::path(post, path = "/v1/pools/{pool}/tasks", tag = "pools",
    params(("pool" = String, Path, description = "Pool name"), ("async" = Option<bool>, Query, description = "Answer 202 with the id at once")),
    request_body = TaskBody,
    responses((status = 200, description = "`{id, output, replica, weights_version, attempts}`", body = Object), (status = 202, description = "`{id}`", body = Object), (status = 409, description = "min_weights_version not synced", body = ErrorBody), (status = 429, description = "Queue full or tenant quota", body = ErrorBody), (status = 502, description = "Failed in the worker", body = ErrorBody), (status = 504, description = "Timed out", body = ErrorBody)))]
async fn submit_task(
    State(gw): State<Arc<Gateway>>,
    Path(name): Path<String>,
    axum::extract::Query(q): axum::extract::Query<TaskQuery>,
    req: Request,
) -> Response {
    let result: Result<Response, ApiError> = async {
        let tenant_key = req.extensions().get::<Arc<Tenant>>().cloned();
        let tenant_owner = tenant_key.as_ref().map(|t| t.name.clone());
        let (pool, headers, bytes) = pool_request(&gw, &name, req, BodyLimit::Task).await?;
        let body: TaskBody<'_> = parse_json(
            &bytes,
            "{\"input\": …, \"priority\"?, \"timeout\"?, \"retries\"?, \"min_weights_version\"?}",
        )?;
        let (priority, tenant, timeout) = task_options(&headers, body.priority, &body.timeout)?;
        let priority = tenant_key
            .as_ref()
            .map_or(priority, |t| t.priority(priority));
        let input = Bytes::copy_from_slice(body.input.get().as_bytes());
        let hold = tenant_key.map(|t| t.pending_permit()).transpose()?;
        // An async task is on disk before it is queued: one that cannot be
        // recorded is refused and never runs, and a crash after the 202
        // cannot lose it silently (it reads back as failed after the
        // restart).
        let journal = gw.tasks.journal().filter(|_| q.is_async);
        let id = match journal {
            Some(j) => {
                let id = pool.new_id();
                let record = crate::pools::TaskRecord {
                    id: id.clone(),
                    pool: pool.name.clone(),
                    state: crate::pools::TaskState::Pending,
                    output: None,
                    error: None,
                    attempts: 0,
                    replica: None,
                    weights_version: None,
                    owner: tenant_owner,
                    durable: true,
                };
                j.accept(&record).await.map_err(|e| {
                    tracing::error!(pool = %pool.name, error = %e, "could not journal an async task; refused it");
                    ApiError::new(
                        ErrorKind::Internal,
                        "the gateway could not record the task, so it was not accepted",
                    )
                })?;
                Some(id)
            }
            None => None,
        };
        let submit = crate::pools::Submit {
            input,
            priority,
            tenant,
            timeout,
            retries: body.retries,
            min_weights_version: body.min_weights_version,
            traceparent: traceparent(&headers),
            hold,
            durable: q.is_async,
            id: id.clone(),
        };
        let (id, rx) = match gw.enqueue(&pool, submit) {
            Ok(accepted) => accepted,
            Err(e) => {
                if let (Some(j), Some(id)) = (journal, &id) {
                    j.forget(id);
                }
                return Err(e);
            }
        };
        if q.is_async {
            return Ok((StatusCode::ACCEPTED, axum::Json(json!({"id": id}))).into_response());
        }
        let record = rx.await.map_err(|_| {
            ApiError::new(ErrorKind::NoCapacity, "the gateway is shutting down").retry_after(1)
        })??;
        Ok(axum::Json(json!({
            "id": record.id,
            "output": record.output,
            "replica": record.replica,
            "weights_version": record.weights_version,
            "attempts": record.attempts,
        }))
        .into_response())
    }
    .await;
    result.unwrap_or_else(IntoResponse::into_response)
}

/// The client's `traceparent`, if it sent one.
fn traceparent(headers: &http::HeaderMap) -> Option<String> {
    headers
        .get(crate::trace::TRACEPARENT)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
}

/// Priority (body, else `X-Warmgate-Priority`), tenant and timeout of a
/// task submission.
fn task_options(
    headers: &http::HeaderMap,
    priority: Option<i32>,
    timeout: &Scalar<'_>,
) -> Result<(i32, String, Option<Duration>), ApiError> {
    let parsed = duration_value(timeout, "timeout")?;
    let header = |n: &str| headers.get(n).and_then(|v| v.to_str().ok());
    let priority = match (priority, header("x-warmgate-priority")) {
        (Some(p), _) => p,
        (None, Some(h)) => h.parse().map_err(|_| {
            ApiError::new(
                ErrorKind::BadRequest,
                "X-Warmgate-Priority must be an integer",
            )
        })?,
        (None, None) => 0,
    };
    let tenant = header("x-warmgate-tenant")
        .filter(|t| !t.is_empty())
        .unwrap_or(crate::pools::DEFAULT_TENANT)
        .to_string();
    Ok((priority, tenant, parsed))
}

/// A batch. `inputs` is validated as it is read but kept as text; its
/// elements are taken one at a time as the batch's window moves on.
#[derive(serde::Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
struct BatchBody<'a> {
    #[serde(borrow)]
    #[schema(value_type = Vec<Object>)]
    inputs: &'a serde_json::value::RawValue,
    priority: Option<i32>,
    #[serde(borrow, default)]
    #[schema(value_type = Option<Object>)]
    timeout: Scalar<'a>,
    retries: Option<u32>,
    min_weights_version: Option<u64>,
}

/// The elements of a JSON array already validated, one at a time, each as
/// its own text: a batch never holds its inputs as values.
struct RawElements {
    body: Bytes,
    /// Where the next element (or the closing bracket) starts, past
    /// whitespace and a comma.
    pos: usize,
}

impl RawElements {
    /// The elements of the array whose text is `array`, a part of `body`.
    fn new(body: Bytes, array: &str) -> Option<RawElements> {
        let start = (array.as_ptr() as usize).checked_sub(body.as_ptr() as usize)?;
        if start + array.len() > body.len() || !array.starts_with('[') {
            return None;
        }
        Some(RawElements {
            body,
            pos: start + 1,
        })
    }
}

impl Iterator for RawElements {
    type Item = Bytes;

    fn next(&mut self) -> Option<Bytes> {
        use serde::Deserialize as _;
        let rest = self.body.get(self.pos..)?;
        let skip = rest.iter().position(|b| !b.is_ascii_whitespace())?;
        let rest = &rest[skip..];
        if rest.first() == Some(&b']') {
            self.pos = self.body.len();
            return None;
        }
        let mut de = serde_json::Deserializer::from_slice(rest);
        let Ok(raw) = <&serde_json::value::RawValue>::deserialize(&mut de) else {
            self.pos = self.body.len();
            return None;
        };
        let item = Bytes::copy_from_slice(raw.get().as_bytes());
        let end = (raw.get().as_ptr() as usize + raw.get().len())
            .saturating_sub(self.body.as_ptr() as usize);
        let after = self.body.get(end..).unwrap_or_default();
        let sep = after.iter().position(|b| !b.is_ascii_whitespace());
        self.pos = match sep.map(|i| (i, after[i])) {
            Some((i, b',')) => end + i + 1,
            _ => self.body.len(),
        };
        Some(item)
    }
}

/// `POST /v1/pools/{pool}/tasks/batch`: one NDJSON line per input, in input
/// order, streamed as results complete. At most a window of tasks is
/// submitted ahead of the line being written, so a batch of 10,000 never
/// holds 10,000 results while it waits for the first.
#[utoipa::path(post, path = "/v1/pools/{pool}/tasks/batch", tag = "pools",
    params(("pool" = String, Path, description = "Pool name")),
    request_body = BatchBody,
    responses((status = 200, description = "NDJSON, one line per input, in input order", content_type = "application/x-ndjson")))]
async fn submit_batch(
    State(gw): State<Arc<Gateway>>,
    Path(name): Path<String>,
    req: Request,
) -> Response {
    let result = async {
        let tenant_key = req.extensions().get::<Arc<Tenant>>().cloned();
        let (pool, headers, bytes) = pool_request(&gw, &name, req, BodyLimit::Task).await?;
        let shape = "{\"inputs\": [...], \"priority\"?, \"timeout\"?, \"retries\"?, \"min_weights_version\"?}";
        let body: BatchBody<'_> = parse_json(&bytes, shape)?;
        let (priority, tenant, timeout) = task_options(&headers, body.priority, &body.timeout)?;
        let priority = tenant_key.as_ref().map_or(priority, |t| t.priority(priority));
        let inputs = RawElements::new(bytes.clone(), body.inputs.get()).ok_or_else(|| {
            ApiError::new(
                ErrorKind::BadRequest,
                format!("the body must be {shape} (inputs is not an array)"),
            )
        })?;
        let window = (pool.spec.replicas[1] * pool.spec.concurrency * 2).clamp(1, 1024) as usize;
        let retries = body.retries;
        let min_version = body.min_weights_version;
        let traceparent = traceparent(&headers);
        let lines = futures_util::stream::iter(inputs.enumerate())
            .map(move |(index, input)| {
                let (gw, pool, tenant) = (gw.clone(), pool.clone(), tenant.clone());
                let traceparent = traceparent.clone();
                let tenant_key = tenant_key.clone();
                async move {
                    let submit = BatchTask {
                        tenant_key,
                        traceparent,
                        priority,
                        tenant,
                        timeout,
                        retries,
                        min_weights_version: min_version,
                    };
                    let line = match batch_one(&gw, &pool, input, submit).await
                    {
                        Ok(r) => json!({
                            "index": index, "id": r.id, "output": r.output, "replica": r.replica,
                            "weights_version": r.weights_version, "attempts": r.attempts,
                        }),
                        Err(e) => json!({
                            "index": index,
                            "error": {"kind": e.kind.as_str(), "message": e.message},
                        }),
                    };
                    Ok::<_, std::convert::Infallible>(Bytes::from(format!("{line}\n")))
                }
            })
            .buffered(window);
        Ok::<_, ApiError>(
            (
                [(header::CONTENT_TYPE, "application/x-ndjson")],
                Body::from_stream(lines),
            )
                .into_response(),
        )
    }
    .await;
    result.unwrap_or_else(IntoResponse::into_response)
}

/// The options every task of a batch shares.
struct BatchTask {
    tenant_key: Option<Arc<Tenant>>,
    traceparent: Option<String>,
    priority: i32,
    tenant: String,
    timeout: Option<Duration>,
    retries: Option<u32>,
    min_weights_version: Option<u64>,
}

async fn batch_one(
    gw: &Gateway,
    pool: &crate::pools::Pool,
    input: Bytes,
    o: BatchTask,
) -> Result<crate::pools::TaskRecord, ApiError> {
    let (_, rx) = gw.enqueue(
        pool,
        crate::pools::Submit {
            input,
            priority: o.priority,
            tenant: o.tenant,
            timeout: o.timeout,
            retries: o.retries,
            min_weights_version: o.min_weights_version,
            traceparent: o.traceparent,
            hold: o.tenant_key.map(|t| t.pending_permit()).transpose()?,
            durable: false,
            id: None,
        },
    )?;
    rx.await
        .map_err(|_| ApiError::new(ErrorKind::NoCapacity, "the gateway is shutting down"))?
}

#[derive(serde::Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
struct SyncBody<'a> {
    checkpoint: String,
    version: u64,
    #[serde(borrow, default)]
    #[schema(value_type = Option<Object>)]
    timeout: Scalar<'a>,
    #[serde(borrow, default)]
    #[schema(value_type = Option<Object>)]
    max_unavailable: Scalar<'a>,
}

/// `POST /v1/pools/{pool}/weights`: swap the weights of the pool's warm
/// replicas in place, a few at a time, within a deadline; answer with
/// per-replica results once every replica has the new weights or was
/// replaced by one that starts with them.
#[utoipa::path(post, path = "/v1/pools/{pool}/weights", tag = "pools",
    params(("pool" = String, Path, description = "Pool name")),
    request_body = SyncBody,
    responses((status = 200, description = "`{pool, version, checkpoint, seconds, synced, replaced, replicas}`", body = Object), (status = 409, description = "Older version, or a sync is running", body = ErrorBody)))]
async fn sync_weights(
    State(gw): State<Arc<Gateway>>,
    Path(name): Path<String>,
    req: Request,
) -> Response {
    let result: Result<Response, ApiError> = async {
        let (pool, _, bytes) = pool_request(&gw, &name, req, BodyLimit::Inference).await?;
        let body: SyncBody<'_> = parse_json(
            &bytes,
            "{\"checkpoint\": \"s3://…\", \"version\": N, \"timeout\"?, \"max_unavailable\"?}",
        )?;
        let timeout =
            duration_value(&body.timeout, "timeout")?.unwrap_or(pool.spec.weight_sync_timeout);
        let ready = pool.load().2;
        let max_unavailable = max_unavailable(&body.max_unavailable, ready)?;
        let version = body.version;
        pool.check_sync(version)?;
        let source = gw.weights.open(&body.checkpoint)?;
        let revision = format!("v{version}");
        let fresh = gw.weights.uri(&pool.name, &revision).is_none();
        gw.weights.register(&pool.name, &revision, source);
        // The checkpoint must exist and list before any replica is touched.
        let listed = match gw.weights.files(&pool.name, &revision).await {
            Ok(files) if files.items.is_empty() => Err(ApiError::new(
                ErrorKind::BadRequest,
                format!("checkpoint {} has no files", body.checkpoint),
            )),
            other => other.map(|_| ()),
        };
        let url = format!("http://{}/v1/weights/{}/{revision}", gw.reach, pool.name);
        let begun = listed.and_then(|()| pool.begin_sync(version, url.clone()));
        if let Err(e) = begun {
            if fresh {
                gw.weights.unregister(&pool.name, &revision);
            }
            return Err(e);
        }
        // Older versions are no longer served: replicas that start from
        // now on, and the ones synced in place, read this one.
        gw.weights.retain_only(&pool.name, &revision);
        let checkpoint = body.checkpoint.clone();
        for target in std::iter::once(pool.name.clone()).chain(pool.ondemand_target()) {
            gw.pool.update_target(&target, |t| {
                t.env.insert("WARMGATE_WEIGHTS_URL".into(), url.clone());
                t.env
                    .insert("WARMGATE_WEIGHTS_VERSION".into(), version.to_string());
                t.checkpoint = Some(checkpoint.clone());
            });
        }
        let started = Instant::now();
        let deadline = started + timeout;
        // In its own task: a client that hangs up does not cut a rollout
        // short and leave replicas out of dispatch.
        let job = {
            let pool = pool.clone();
            tokio::spawn(async move { pool.sync_weights(max_unavailable, deadline).await })
        };
        let results = job.await.map_err(|e| {
            ApiError::new(ErrorKind::ReplicaFailed, format!("the weight sync failed: {e}"))
        })?;
        let synced = results.iter().filter(|r| r.ok).count();
        tracing::info!(pool = %pool.name, version, synced, replaced = results.len() - synced, "weight sync done");
        Ok(axum::Json(json!({
            "pool": pool.name,
            "version": version,
            "checkpoint": body.checkpoint,
            "seconds": started.elapsed().as_secs_f64(),
            "synced": synced,
            "replaced": results.len() - synced,
            "replicas": results,
        }))
        .into_response())
    }
    .await;
    result.unwrap_or_else(IntoResponse::into_response)
}

/// A duration given as seconds (a number) or a string like `"30s"`.
fn duration_value(v: &Scalar<'_>, key: &str) -> Result<Option<Duration>, ApiError> {
    let parsed = match v {
        Scalar::Absent => return Ok(None),
        Scalar::Number(n) => n
            .as_f64()
            .filter(|s| *s > 0.0)
            .and_then(|s| Duration::try_from_secs_f64(s).ok()),
        Scalar::Str(s) => humantime::parse_duration(s).ok().filter(|d| !d.is_zero()),
        Scalar::Other => None,
    };
    parsed
        .filter(|d| *d <= MAX_CLIENT_DURATION)
        .map(Some)
        .ok_or_else(|| {
            ApiError::new(
                ErrorKind::BadRequest,
                format!(
                    "{key} must be seconds (a number above 0) or a duration like \"30s\", \
                     at most 30 days"
                ),
            )
        })
}

/// Replicas a sync may take out of dispatch at once: a count, or a
/// percentage of the ready replicas (rounded up). Kubernetes' rolling
/// update default, 25%, when absent.
fn max_unavailable(v: &Scalar<'_>, ready: usize) -> Result<usize, ApiError> {
    let pct = |p: f64| ((ready as f64 * p / 100.0).ceil() as usize).max(1);
    let bad = || {
        ApiError::new(
            ErrorKind::BadRequest,
            "max_unavailable must be a count (1 or more) or a percentage like \"50%\"",
        )
    };
    match v {
        Scalar::Absent => Ok(pct(25.0)),
        Scalar::Number(n) => match n.as_u64() {
            Some(k) if k >= 1 => Ok(k as usize),
            _ => Err(bad()),
        },
        Scalar::Str(s) => match s.strip_suffix('%').map(str::parse::<f64>) {
            Some(Ok(p)) if p > 0.0 && p <= 100.0 => Ok(pct(p)),
            _ => Err(bad()),
        },
        Scalar::Other => Err(bad()),
    }
}

/// `GET /v1/tasks/{id}`.
#[utoipa::path(get, path = "/v1/tasks/{id}", tag = "pools",
    params(("id" = String, Path, description = "Task id")),
    responses((status = 200, description = "The task's state and output", body = Object), (status = 404, description = "Unknown or evicted task", body = ErrorBody)))]
async fn get_task(
    State(gw): State<Arc<Gateway>>,
    Path(id): Path<String>,
    req: Request,
) -> Response {
    let caller = req
        .extensions()
        .get::<Arc<Tenant>>()
        .map(|t| t.name.as_str());
    // With API keys, a tenant sees only its own tasks; another's reads as
    // unknown, so ids cannot be probed.
    let mine = |owner: Option<&str>| caller.is_none() || owner == caller;
    if let Some(r) = gw.tasks.get(&id) {
        if mine(r.owner.as_deref()) {
            return axum::Json(r).into_response();
        }
    } else if let Some((v, owner)) = gw.tasks.journal().and_then(|j| j.get(&id))
        && mine(owner.as_deref())
    {
        // Ended before this gateway started, or evicted from memory.
        return axum::Json(v).into_response();
    }
    ApiError::new(ErrorKind::NotFound, format!("task '{id}' not found")).into_response()
}

/// Lets a weights read through with `Authorization: Bearer` and the
/// admin token, or a worker's `WARMGATE_WEIGHTS_TOKEN` whose grant covers
/// this checkpoint; nothing else (no tenant key, no open access).
fn weights_auth(
    gw: &Gateway,
    headers: &http::HeaderMap,
    target: &str,
    revision: &str,
) -> Result<(), ApiError> {
    let presented = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or("");
    let admin = gw
        .admin_token
        .as_ref()
        .is_some_and(|t| crate::tenants::same_secret(presented, t));
    if admin || gw.weights.authorized(target, revision, presented) {
        return Ok(());
    }
    Err(ApiError::new(
        ErrorKind::Unauthorized,
        "weights need Authorization: Bearer <the worker's WARMGATE_WEIGHTS_TOKEN, \
         or the gateway's WARMGATE_ADMIN_TOKEN>",
    ))
}

/// The files of a revision's checkpoint.
#[utoipa::path(get, path = "/v1/weights/{target}/{revision}", tag = "weights",
    params(("target" = String, Path, description = "App or pool"), ("revision" = String, Path, description = "Revision id, or v<N> for a pool")),
    responses((status = 200, description = "`{target, revision, checkpoint, files}`", body = Object), (status = 401, description = "No weights or admin token", body = ErrorBody), (status = 404, description = "No such checkpoint", body = ErrorBody)))]
async fn weights_manifest(
    State(gw): State<Arc<Gateway>>,
    Path((target, revision)): Path<(String, String)>,
    headers: http::HeaderMap,
) -> Response {
    let result = async {
        let target = gw.target_name(&target);
        weights_auth(&gw, &headers, &target, &revision)?;
        let files = gw.weights.files(&target, &revision).await?;
        let list: Vec<_> = files
            .items
            .iter()
            .map(|f| json!({"name": f.relative.to_string_lossy(), "size": f.meta.size}))
            .collect();
        Ok::<_, ApiError>(axum::Json(json!({
            "target": target,
            "revision": revision,
            "checkpoint": gw.weights.uri(&target, &revision),
            "files": list,
        })))
    }
    .await;
    match result {
        Ok(j) => j.into_response(),
        Err(e) => e.into_response(),
    }
}

/// One file of a revision's checkpoint, streamed.
#[utoipa::path(get, path = "/v1/weights/{target}/{revision}/{file}", tag = "weights",
    params(("target" = String, Path, description = "App or pool"), ("revision" = String, Path, description = "Revision id"), ("file" = String, Path, description = "File in the checkpoint")),
    responses((status = 200, description = "The file, streamed from the cache", content_type = "application/octet-stream"), (status = 401, description = "No weights or admin token", body = ErrorBody), (status = 404, description = "No such file", body = ErrorBody)))]
async fn weights_file(
    State(gw): State<Arc<Gateway>>,
    Path((target, revision, file)): Path<(String, String, String)>,
    headers: http::HeaderMap,
) -> Response {
    let target = gw.target_name(&target);
    if let Err(e) = weights_auth(&gw, &headers, &target, &revision) {
        return e.into_response();
    }
    match gw.weights.file(&target, &revision, &file).await {
        Ok((body, size)) => (
            [
                (
                    header::CONTENT_TYPE,
                    HeaderValue::from_static("application/octet-stream"),
                ),
                (header::CONTENT_LENGTH, HeaderValue::from(size)),
            ],
            body,
        )
            .into_response(),
        Err(e) => e.into_response(),
    }
}

/// The live dashboard: one static page, embedded in the binary, that reads
/// `/v1/status` like the CLI does.
#[utoipa::path(get, path = "/ui", tag = "control",
    responses((status = 200, description = "The live dashboard", content_type = "text/html")))]
async fn dashboard() -> Response {
    (
        [
            (header::CONTENT_TYPE, "text/html; charset=utf-8"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        include_str!("../ui/index.html"),
    )
        .into_response()
}

#[utoipa::path(get, path = "/healthz", tag = "control",
    responses((status = 200, description = "The process is up", body = Object)))]
async fn healthz() -> Response {
    axum::Json(json!({"status": "ok"})).into_response()
}

#[utoipa::path(get, path = "/readyz", tag = "control",
    responses((status = 200, description = "Taking traffic"), (status = 503, description = "Shutting down", body = ErrorBody)))]
async fn readyz(State(gw): State<Arc<Gateway>>) -> Response {
    if gw.draining.load(Ordering::Acquire) {
        ApiError::new(ErrorKind::NoCapacity, "the gateway is shutting down")
            .retry_after(1)
            .into_response()
    } else {
        axum::Json(json!({"status": "ready"})).into_response()
    }
}

#[utoipa::path(get, path = "/metrics", tag = "control",
    responses((status = 200, description = "Prometheus text format", content_type = "text/plain")))]
async fn metrics_text(State(gw): State<Arc<Gateway>>) -> Response {
    match &gw.metrics {
        Some(h) => (
            [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
            h.render(),
        )
            .into_response(),
        None => (StatusCode::OK, "").into_response(),
    }
}

/// The error format every endpoint uses.
#[derive(utoipa::ToSchema)]
#[allow(dead_code)]
struct ErrorBody {
    /// `{"kind": "queue_full", "message": "…"}`
    error: ErrorDetail,
}

/// One error.
#[derive(utoipa::ToSchema)]
#[allow(dead_code)]
struct ErrorDetail {
    /// `bad_request`, `unauthorized`, `not_found`, `method_not_allowed`,
    /// `conflict`, `too_large`, `queue_full`, `replica_failed`,
    /// `no_capacity`, `starting` or `timeout`.
    kind: String,
    /// What went wrong, for people.
    message: String,
}

/// The HTTP API, generated from the handlers above.
#[derive(utoipa::OpenApi)]
#[openapi(
    info(title = "warmgate", description = "The warmgate gateway's HTTP API."),
    paths(
        openai,
        passthrough,
        models,
        status,
        list_apps,
        get_app,
        put_app,
        delete_app,
        get_pool,
        put_pool,
        delete_pool,
        promote,
        rollback,
        revisions,
        submit_task,
        submit_batch,
        sync_weights,
        get_task,
        weights_manifest,
        weights_file,
        dashboard,
        healthz,
        readyz,
        metrics_text
    ),
    components(schemas(ErrorBody, ErrorDetail, PromoteBody, TaskBody, BatchBody, SyncBody))
)]
pub struct ApiDoc;

async fn openapi() -> Response {
    use utoipa::OpenApi as _;
    axum::Json(ApiDoc::openapi()).into_response()
}

async fn not_found(req: Request) -> Response {
    ApiError::new(
        ErrorKind::NotFound,
        format!("no route for {} {}", req.method(), req.uri().path()),
    )
    .into_response()
}

async fn method_not_allowed(req: Request) -> Response {
    ApiError::new(
        ErrorKind::MethodNotAllowed,
        format!("{} is not allowed on {}", req.method(), req.uri().path()),
    )
    .into_response()
}

/// Echoes `X-Request-Id`, generating one when the client sent none, and
/// passes it on to the worker.
async fn request_id(mut req: Request, next: Next) -> Response {
    let id = match req.headers().get(X_REQUEST_ID) {
        Some(v) if !v.is_empty() && v.len() <= MAX_REQUEST_ID_LEN => v.clone(),
        _ => {
            let v = HeaderValue::from_str(&format!("{:016x}", fastrand::u64(..)))
                .expect("hex is a valid header value");
            req.headers_mut().insert(X_REQUEST_ID, v.clone());
            v
        }
    };
    let mut resp = next.run(req).await;
    resp.headers_mut().insert(X_REQUEST_ID, id);
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn model_field_errors_are_clear() {
        assert_eq!(
            model_field(br#"{"model":"a","input":[1,2]}"#).expect("ok"),
            "a"
        );
        let kinds = [
            &b"not json"[..],
            br#"{"input":"x"}"#,
            br#"{"model":7}"#,
            br#"{"model":""}"#,
            br#"[1,2]"#,
            br#"{"model":null}"#,
            br#"{"model":[0,0,[{"a":1}]]}"#,
            br#"{"model":{"a":[1]}}"#,
        ];
        for body in kinds {
            let err = model_field(body).expect_err("error");
            assert_eq!(err.kind, ErrorKind::BadRequest);
            assert!(err.message.contains("model"), "{}", err.message);
        }
        assert_eq!(
            model_field(br#"{"x":[1,{"y":2}],"model":"b\u0061"}"#).expect("ok"),
            "ba"
        );
    }

    #[test]
    fn batch_inputs_are_taken_one_at_a_time_as_text() {
        let body = Bytes::from_static(br#" {"inputs" : [ 1 , {"a": [2, "]"]},"x,y" ,[] ] } "#);
        let parsed: BatchBody<'_> = parse_json(&body, "a batch").expect("batch");
        let items: Vec<Bytes> = RawElements::new(body.clone(), parsed.inputs.get())
            .expect("an array")
            .collect();
        assert_eq!(
            items,
            vec![
                Bytes::from_static(b"1"),
                Bytes::from_static(br#"{"a": [2, "]"]}"#),
                Bytes::from_static(br#""x,y""#),
                Bytes::from_static(b"[]"),
            ]
        );
        let empty = Bytes::from_static(br#"{"inputs":[]}"#);
        let parsed: BatchBody<'_> = parse_json(&empty, "a batch").expect("batch");
        let mut items = RawElements::new(empty.clone(), parsed.inputs.get()).expect("array");
        assert!(items.next().is_none());
        let not_array = Bytes::from_static(br#"{"inputs":{"a":1}}"#);
        let parsed: BatchBody<'_> = parse_json(&not_array, "a batch").expect("batch");
        assert!(RawElements::new(not_array.clone(), parsed.inputs.get()).is_none());
    }

    use proptest::prelude::any;
    use proptest::prelude::*;

    /// Arbitrary JSON values, nested a few levels.
    fn json_value() -> impl Strategy<Value = serde_json::Value> {
        let leaf = prop_oneof![
            Just(serde_json::Value::Null),
            any::<bool>().prop_map(serde_json::Value::from),
            any::<i64>().prop_map(serde_json::Value::from),
            any::<u64>().prop_map(serde_json::Value::from),
            any::<f64>()
                .prop_filter("JSON has no NaN or infinity", |f| f.is_finite())
                .prop_map(serde_json::Value::from),
            prop_oneof![
                ".{0,12}",
                Just("30s".to_string()),
                Just("-1s".to_string()),
                Just("99999999999y".to_string()),
                Just("50%".to_string()),
                Just("1e308%".to_string()),
                Just("NaN%".to_string()),
            ]
            .prop_map(serde_json::Value::from),
        ];
        leaf.prop_recursive(3, 24, 4, |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..4).prop_map(serde_json::Value::from),
                proptest::collection::btree_map(
                    prop_oneof![
                        Just("input".to_string()),
                        Just("inputs".to_string()),
                        Just("model".to_string()),
                        Just("priority".to_string()),
                        Just("timeout".to_string()),
                        Just("retries".to_string()),
                        Just("min_weights_version".to_string()),
                        Just("checkpoint".to_string()),
                        Just("version".to_string()),
                        Just("max_unavailable".to_string()),
                        ".{0,6}",
                    ],
                    inner,
                    0..5
                )
                .prop_map(|m| serde_json::Value::Object(m.into_iter().collect())),
            ]
        })
    }

    fn header_map(pairs: &[(&'static str, Vec<u8>)]) -> http::HeaderMap {
        let mut h = http::HeaderMap::new();
        for (name, value) in pairs {
            if let Ok(v) = HeaderValue::from_bytes(value) {
                h.insert(*name, v);
            }
        }
        h
    }

    /// Every way a task or sync body can be read, as the handlers read it.
    fn read_task_like(bytes: &[u8]) {
        if let Ok(b) = parse_json::<TaskBody<'_>>(bytes, "a task") {
            let h = http::HeaderMap::new();
            if let Ok((_, _, Some(t))) = task_options(&h, b.priority, &b.timeout) {
                assert!(!t.is_zero() && t <= MAX_CLIENT_DURATION);
                // The deadline arithmetic the pool does must not overflow.
                let _ = std::time::Instant::now() + t;
            }
        }
        if let Ok(b) = parse_json::<BatchBody<'_>>(bytes, "a batch") {
            let _ = duration_value(&b.timeout, "timeout");
            let body = Bytes::copy_from_slice(bytes);
            let parsed: BatchBody<'_> = parse_json(&body, "a batch").expect("parsed once");
            if let Some(items) = RawElements::new(body.clone(), parsed.inputs.get()) {
                let want: Vec<serde_json::Value> =
                    serde_json::from_str(parsed.inputs.get()).expect("an array");
                let got: Vec<serde_json::Value> = items
                    .map(|i| serde_json::from_slice(&i).expect("each element is JSON"))
                    .collect();
                assert_eq!(got, want);
            }
        }
        if let Ok(b) = parse_json::<SyncBody<'_>>(bytes, "a sync") {
            let _ = duration_value(&b.timeout, "timeout");
            if let Ok(n) = max_unavailable(&b.max_unavailable, 7) {
                assert!(n >= 1);
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(1000))]

        /// The `model` field extraction never panics on any bytes, and
        /// what it accepts is a non-empty name.
        #[test]
        fn model_field_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
            if let Ok(m) = model_field(&bytes) {
                prop_assert!(!m.is_empty());
            }
        }

        /// Nor on JSON of any shape, with `model` anywhere.
        #[test]
        fn model_field_on_any_json(v in json_value()) {
            let bytes = serde_json::to_vec(&v).expect("serialises");
            let got = model_field(&bytes);
            match v.get("model") {
                Some(serde_json::Value::String(s)) if !s.is_empty() => {
                    prop_assert_eq!(got.expect("a name"), s.clone());
                }
                _ => prop_assert_eq!(got.expect_err("no name").kind, ErrorKind::BadRequest),
            }
        }

        /// Task, batch and sync bodies: arbitrary bytes and arbitrary JSON
        /// either parse into options within bounds or are refused.
        #[test]
        fn task_bodies_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..256), v in json_value()) {
            read_task_like(&bytes);
            read_task_like(&serde_json::to_vec(&v).expect("serialises"));
        }

        /// Routing headers with arbitrary bytes: priority, tenant,
        /// traceparent and a pinned revision.
        #[test]
        fn routing_headers_never_panic(
            priority in proptest::collection::vec(any::<u8>(), 0..24),
            tenant in proptest::collection::vec(any::<u8>(), 0..24),
            trace in prop_oneof![
                proptest::collection::vec(any::<u8>(), 0..64),
                "00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}".prop_map(String::into_bytes),
            ],
            pinned in ".{0,24}",
        ) {
            let mut h = header_map(&[
                ("x-warmgate-priority", priority),
                ("x-warmgate-tenant", tenant),
                (crate::trace::TRACEPARENT, trace),
            ]);
            if let Ok((_, tenant, _)) = task_options(&h, None, &Scalar::Absent) {
                prop_assert!(!tenant.is_empty());
            }
            let tp = crate::trace::ensure_traceparent(&mut h);
            prop_assert!(crate::trace::is_valid(&tp));
            prop_assert_eq!(crate::trace::trace_id(&tp).len(), 32);
            let served = Served::new(
                warmgate_deploy::AppSpec { name: "m".into(), ..Default::default() },
                warmgate_deploy::revision::History::default(),
            );
            let err = served.pick(Some(&pinned)).err().expect("no live revision");
            prop_assert_eq!(err.kind, ErrorKind::NotFound);
            prop_assert_eq!(served.pick(None).err().expect("no split").kind, ErrorKind::NoCapacity);
        }
    }
}
