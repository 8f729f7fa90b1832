//! The gateway: the state it holds, and its construction (the apps and
//! pools of the config started, their stored histories restored).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use warmgate_deploy::{Config, TargetId};
use warmgate_pool::{Backend, PoolManager, TargetSpec};

use crate::error::{ApiError, ErrorKind};
use crate::serving::served::Served;
use crate::upstream::Upstream;

pub(crate) const X_REQUEST_ID: http::HeaderName = http::HeaderName::from_static("x-request-id");
pub(crate) const X_TENANT: &str = "x-warmgate-tenant";
/// The longest timeout a client may ask for: past it, deadline arithmetic
/// could overflow, and no task or sync should wait a month.
pub(crate) const MAX_CLIENT_DURATION: Duration = Duration::from_secs(30 * 24 * 3600);
/// Client-supplied request ids longer than this are replaced.
pub(crate) const MAX_REQUEST_ID_LEN: usize = 128;

/// The gateway's shared state.
pub struct Gateway {
    pub(crate) config: Arc<Config>,
    /// The apps and pools served now, swapped whole on a change.
    pub(crate) registry: crate::registry::Live,
    /// Every app revision ever started, by id (for replica events).
    pub(crate) revisions: Revisions,
    /// Revisions promoted in place, by the target whose replicas they
    /// borrow while the promotion runs (`inplace.rs`).
    pub(crate) guests: Revisions,
    pub(crate) pool: PoolManager,
    pub(crate) upstream: Upstream,
    /// A request's way from the traffic split to a replica.
    pub(crate) serving: crate::serving::pipeline::Pipeline,
    pub(crate) started: Instant,
    pub(crate) draining: AtomicBool,
    pub(crate) metrics: Option<metrics_exporter_prometheus::PrometheusHandle>,
    pub(crate) weights: Arc<crate::weights::Weights>,
    pub(crate) tasks: Arc<crate::tasks::store::TaskStore>,
    /// Where workers reach the gateway.
    pub(crate) reach: String,
    /// The workers' working directory.
    pub(crate) workdir: Option<std::path::PathBuf>,
    /// Revision history, on disk.
    pub(crate) store: Box<dyn warmgate_deploy::store::StateStore>,
    /// `WARMGATE_ADMIN_TOKEN`: the control plane's bearer token.
    pub(crate) admin_token: Option<String>,
    /// Data-plane API keys and quotas (`None`: the data plane is open).
    pub(crate) tenants: Option<crate::tenants::Tenants>,
    /// Request bodies being read, and inference bodies waiting for a
    /// replica, within `limits.max_buffered_body_bytes`.
    pub(crate) buffered: crate::serving::buffered::Buffered,
    /// Held by whoever changes the registry: one change at a time.
    pub(crate) changes: tokio::sync::Mutex<()>,
    /// Apps and pools a change is being applied to (a second change to
    /// one of them meanwhile gets 409).
    pub(crate) busy: parking_lot::Mutex<std::collections::HashSet<String>>,
    /// Deleted pools still finishing their tasks.
    pub(crate) retiring_pools: parking_lot::Mutex<std::collections::HashSet<String>>,
    /// Deleted apps still finishing their requests.
    pub(crate) retiring_apps: parking_lot::Mutex<std::collections::HashSet<String>>,
    /// Cleared under the operator: apps and pools come from resources, and
    /// the API may not change them.
    pub(crate) api_changes: AtomicBool,
    /// The other gateway replicas serving with this one.
    pub(crate) peers: crate::peers::Peers,
}

/// The admin token: from the environment when set and not empty, else the
/// one `warmgate serve` made for itself ([`use_generated_admin_token`]).
pub fn admin_token() -> Option<String> {
    std::env::var("WARMGATE_ADMIN_TOKEN")
        .ok()
        .filter(|t| !t.is_empty())
        .or_else(|| GENERATED_ADMIN_TOKEN.get().cloned())
}

/// The token `warmgate serve` keeps in its state folder when it was given
/// none (see `runtime::admin_token`); set once, before the gateway is made.
static GENERATED_ADMIN_TOKEN: std::sync::OnceLock<String> = std::sync::OnceLock::new();

/// The token `serve` made for itself, when it did.
pub(crate) fn generated_admin_token() -> Option<String> {
    GENERATED_ADMIN_TOKEN.get().cloned()
}

/// Makes `token` the admin token of the gateway this process runs, when
/// the environment gives none.
pub(crate) fn use_generated_admin_token(token: String) {
    let _ = GENERATED_ADMIN_TOKEN.set(token);
}

pub(crate) use crate::replica_sink::Revisions;
use crate::replica_sink::Sink;

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
        Self::with_state(config, backend, metrics, addr, None)
    }

    /// [`Gateway::new`] with the state kept in `state` (the operator's,
    /// in the API server) instead of the SQLite database under
    /// `state_dir`.
    pub fn with_state(
        config: Config,
        backend: Arc<dyn Backend>,
        metrics: Option<metrics_exporter_prometheus::PrometheusHandle>,
        addr: std::net::SocketAddr,
        state: Option<Box<dyn warmgate_deploy::store::StateStore>>,
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
                .map_err(|(key, message)| anyhow::anyhow!("{key}: {message}"))?
                .map(|t| {
                    t.with_byte_shares(
                        config.limits.max_pending_task_bytes,
                        config.limits.max_task_body_bytes,
                    )
                });
        // The task journal stays here in every mode: tasks are the pools'
        // and last as long as their gateway.
        let db = config.state_dir.join("state.db");
        let tolerant = state.is_some();
        let store: Box<dyn warmgate_deploy::store::StateStore> = match state {
            Some(s) => s,
            None => Box::new(
                warmgate_deploy::store::SqliteState::open(&db)
                    .with_context(|| format!("open {}", db.display()))?,
            ),
        };
        let w = &config.weights;
        let cache =
            warmgate_pool::weights::Cache::open(config.state_dir.join("cache"), w.cache_max_bytes)
                .context("open the weight cache")?;
        let allowed = warmgate_pool::weights::AllowList::new(
            &crate::weights::allowed_prefixes(&config),
            &base,
        )
        .context("weights.allowed_prefixes")?;
        let stream = warmgate_pool::weights::StreamConfig {
            concurrency: w.concurrency,
            part_size: w.part_size_bytes,
            memory_limit: w.memory_limit_bytes,
        };
        let weights = Arc::new(crate::weights::Weights::new(
            cache,
            stream.clone(),
            allowed,
            base,
        ));
        let adapter_files = Arc::new(crate::serving::adapter_files::AdapterFiles::new(
            weights.clone(),
            stream,
            config.state_dir.join("adapters"),
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
        // One change at a time, each kept only if the config it makes is
        // valid: a change that no longer fits the file (an edited alias,
        // narrowed prefixes) is skipped with a warning, not a failed start.
        let mut changes: Vec<(String, warmgate_deploy::store::Overlay)> = Vec::new();
        for (name, spec) in &overlay.apps {
            let mut one = warmgate_deploy::store::Overlay::default();
            one.apps.insert(name.clone(), spec.clone());
            changes.push((format!("app {name}"), one));
        }
        for (name, spec) in &overlay.pools {
            let mut one = warmgate_deploy::store::Overlay::default();
            one.pools.insert(name.clone(), spec.clone());
            changes.push((format!("pool {name}"), one));
        }
        for (what, one) in changes {
            let mut candidate = config.clone();
            one.apply_to(&mut candidate);
            match candidate.validate() {
                Ok(()) => {
                    tracing::warn!(change = %what, "a change made through the API is kept over the config file (`warmgate apply FILE`, SIGHUP or `serve --config-wins` makes the file win)");
                    config = candidate;
                }
                Err((key, message)) => tracing::warn!(
                    change = %what, %key, %message,
                    "a change made through the API no longer fits the config file; skipped (SIGHUP re-reads the file and drops such changes)"
                ),
            }
        }
        let tasks = Arc::new(crate::tasks::store::TaskStore::new(
            crate::tasks::store::StoreLimits {
                max_pending_bytes: config.limits.max_pending_task_bytes,
                max_results_bytes: config.limits.max_task_results_bytes,
            },
        ));
        let (journal, recovered) =
            crate::tasks::journal::Journal::open(&db, config.limits.max_journal_bytes)
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
        let guests: Revisions = Arc::default();
        let registry: crate::registry::Live = Arc::default();
        let pool = PoolManager::new(
            backend,
            config.backend.gpus.clone(),
            Arc::new(Sink {
                revisions: revisions.clone(),
                guests: guests.clone(),
                registry: registry.clone(),
                weights: weights.clone(),
            }),
        );
        let (upstream, started) = (
            Upstream::new().with_answer_idle(config.limits.idle_timeout),
            Instant::now(),
        );
        let buffered =
            crate::serving::buffered::Buffered::new(config.limits.max_buffered_body_bytes);
        let gw = Arc::new(Gateway {
            serving: crate::serving::pipeline::Pipeline::new(
                upstream.clone(),
                pool.clone(),
                started,
                adapter_files,
            ),
            config: Arc::new(config),
            registry,
            revisions,
            guests,
            pool,
            upstream,
            started,
            draining: AtomicBool::new(false),
            metrics,
            weights,
            tasks,
            reach,
            workdir,
            store,
            admin_token: admin_token(),
            buffered,
            tenants,
            changes: tokio::sync::Mutex::new(()),
            busy: parking_lot::Mutex::default(),
            retiring_pools: parking_lot::Mutex::default(),
            retiring_apps: parking_lot::Mutex::default(),
            api_changes: AtomicBool::new(true),
            peers: crate::peers::Peers::default(),
        });
        for spec in &gw.config.pools {
            gw.start_pool(spec.clone())?;
        }
        let mut apps = Vec::with_capacity(gw.config.apps.len());
        // Every app's stored state in one read where the store can, and
        // what the start changes of it in one write.
        // A row it cannot read (of an app no longer configured, say)
        // leaves each app to be read alone, as before, so only the apps
        // that are served can fail the start.
        let mut stored = gw.store.load_all().unwrap_or_else(|e| {
            tracing::warn!(error = %e, "the stored histories cannot be read at once; each app's is read alone");
            None
        });
        gw.store.batch(&mut || {
            for spec in &gw.config.apps {
                let history = stored
                    .as_mut()
                    .map(|all| all.remove(&spec.name).unwrap_or_default());
                match gw.prepare_app(spec.clone(), history) {
                    Ok(app) => apps.push(app),
                    // Under the operator one app that cannot start (its
                    // state in the cluster unreadable, a step it cannot
                    // store) is left out, and the operator reports it on
                    // its resource and tries again; the others serve.
                    Err(e) if tolerant => tracing::error!(
                        app = %spec.name, error = format!("{e:#}"),
                        "the app cannot start; it is left out until its next try"
                    ),
                    Err(e) => return Err(e.context(format!("app '{}'", spec.name))),
                }
            }
            Ok(())
        })?;
        // One registry for them all: built per app, it was a copy of
        // everything before it each time.
        gw.registry
            .rcu(|r| Arc::new(r.with_apps(apps.iter().cloned())));
        for app in &apps {
            gw.watch_app(app);
        }
        Ok(gw)
    }

    /// Starts serving a pool: its targets (and on-demand fallback) in the
    /// pool manager at their minimum, its dispatcher, and its place in the
    /// registry.
    pub(crate) fn start_pool(
        self: &Arc<Self>,
        spec: warmgate_deploy::PoolSpec,
    ) -> anyhow::Result<Arc<crate::tasks::pool::Pool>> {
        let p = crate::tasks::pool::Pool::new(spec, self.tasks.clone(), self.upstream.clone());
        let revision = format!("{}-00001", p.name);
        let mut env = p.spec().env.clone();
        if let Some(uri) = &p.spec().checkpoint {
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
            id: p.target(),
            health: p.spec().health.clone(),
            engine: warmgate_deploy::EngineSpec::default(),
            revision,
            command: p.spec().command.clone(),
            env,
            checkpoint: p.spec().checkpoint.clone(),
            workdir: self.workdir.clone(),
            concurrency: p.spec().concurrency,
            gpus: p.spec().gpus,
            startup_timeout: p.spec().startup_timeout,
            stop_grace: self.config.backend.stop_grace,
            image: p.spec().image.clone(),
            pod: p.spec().kubernetes.clone(),
        };
        let od = p.ondemand_target();
        if let Some(od) = &od {
            let mut spec = spot.clone();
            spec.id = od.clone();
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
        p.set_replacer(Box::new(move |replica, reason| {
            if !manager.replace(&replica.target, &replica.id, reason) {
                tracing::error!(target_name = %replica.target, replica = %replica.id, "could not ask for the replica to be replaced");
            }
        }));
        // Replicas an earlier leader left for this pool stay warm: the
        // pool's idle TTL decides when they go, as for any idle replica.
        let adoptable = pool.adoptable(&p.target());
        pool.scale(&p.target(), p.spec().replicas[0].max(adoptable));
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
        let app = self.prepare_app(spec, None)?;
        self.registry.rcu(|r| Arc::new(r.with_app(app.clone())));
        self.watch_app(&app);
        Ok(app)
    }

    /// An app ready to serve, not yet in the registry: its history read
    /// and its revisions restored.
    fn prepare_app(
        self: &Arc<Self>,
        spec: warmgate_deploy::AppSpec,
        history: Option<warmgate_deploy::revision::History>,
    ) -> anyhow::Result<Arc<Served>> {
        use anyhow::Context as _;
        let history = match history {
            Some(h) => h,
            None => self
                .store
                .load(&spec.name)
                .context("read its revision history")?,
        };
        let app = Arc::new(Served::new(spec, history));
        // An app served by a pool runs on the pool's replicas: it has no
        // revision to restore.
        if app.spec().pool.is_none() {
            self.restore(&app).context("restore its revisions")?;
        }
        Ok(app)
    }

    /// The watchers of an app in the registry: its checkpoints' and its
    /// adapters'.
    fn watch_app(self: &Arc<Self>, app: &Arc<Served>) {
        if app.spec().promotion.watch.is_some() {
            tokio::spawn(self.clone().watch(app.clone()));
        }
        self.watch_adapters(app);
    }

    /// The config it runs.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// Time since start: the autoscaler's clock.
    pub(crate) fn now(&self) -> Duration {
        self.started.elapsed()
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

    /// Queues a task and wakes its pool at once if it needs more replicas.
    pub(crate) fn enqueue(
        &self,
        pool: &crate::tasks::pool::Pool,
        submit: crate::tasks::pool::Submit,
    ) -> Result<
        (
            String,
            tokio::sync::oneshot::Receiver<crate::tasks::pool::Outcome>,
        ),
        ApiError,
    > {
        // In a crash loop, while its backoff runs: one answer, at once,
        // rather than a wait that ends in a bare timeout.
        if let Some(h) = self.pool.health(&pool.target())
            && h.retry_in.is_some()
            && let Some(e) =
                crate::serving::crash_loop::crash_loop_error(&format!("pool '{}'", pool.name), &h)
        {
            return Err(e);
        }
        let out = pool.submit(submit)?;
        self.nudge_pool(pool);
        Ok(out)
    }

    /// Asks for more of a pool's replicas at once when more work waits
    /// than its ready replicas have free slots (tasks, or requests of the
    /// app it serves); everything else waits for the autoscaler's tick,
    /// which keeps this path cheap.
    pub(crate) fn nudge_pool(&self, pool: &crate::tasks::pool::Pool) {
        if !pool.queued_beyond_free_slots() {
            return;
        }
        let target = pool.target();
        let desired = pool.desired(self.starting(&target));
        if self.pool.desired(&target).unwrap_or(0) < desired {
            self.pool.scale(&target, desired);
        }
    }

    /// Replicas of a target started and not ready yet (or waiting for GPUs).
    pub(crate) fn starting(&self, target: &TargetId) -> u32 {
        self.pool
            .health(target)
            .map_or(0, |h| (h.starting + h.pending) as u32)
    }

    /// An app's name for any of its aliases; a pool's name as it is.
    pub(crate) fn target_name(&self, name: &str) -> String {
        self.registry
            .load()
            .app(name)
            .map_or_else(|| name.to_string(), |a| a.name.clone())
    }
}

impl Gateway {
    /// An app by name or alias, or 404.
    pub fn app(&self, name: &str) -> Result<Arc<Served>, ApiError> {
        self.registry
            .load()
            .app(name)
            .cloned()
            .ok_or_else(|| ApiError::new(ErrorKind::NotFound, format!("app '{name}' not found")))
    }
}
