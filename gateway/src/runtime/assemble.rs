//! The gateway put together: its services built from the config, each
//! given what it needs (and no more), then the config's pools and apps
//! started, every app's stored history read at once.

use std::sync::Arc;

use anyhow::Context as _;
use warmgate_deploy::Config;
use warmgate_deploy::store::{Overlay, StateStore};
use warmgate_pool::{Backend, PoolManager};

use crate::access::Access;
use crate::change::Changes;
use crate::change::lock::ChangeLock;
use crate::host::Host;
use crate::promote::Promotions;
use crate::replica_sink::{Revisions, Sink};
use crate::runtime::state_db::StateDb;
use crate::server::Gateway;
use crate::upstream::Upstream;

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
        let workdir = config.workers_folder();
        let base = workdir
            .clone()
            .unwrap_or_else(|| std::path::PathBuf::from("."));
        make_state_dir(&config)?;
        let tenants = tenants_of(&config)?;
        // `state.db` holds the task journal in every mode (tasks are the
        // pools' and last as long as their gateway), and the revisions
        // unless the operator keeps them in the cluster.
        let db = StateDb::open(&config.state_dir)?;
        let tolerant = state.is_some();
        let store: Arc<dyn StateStore> = match state {
            Some(s) => Arc::from(s),
            None => db.store()?,
        };
        let (weights, adapter_files) = weights_of(&config, base)?;
        let reach = reach_of(&config, addr);
        // The changes made through the API, over the file. The weights
        // allow-list above is the file's alone: a checkpoint put through
        // the API must lie under it.
        let overlay = store
            .overlay()
            .context("read the changes made through the API")?;
        let config = lay_over(config, overlay);
        let tasks = tasks_of(&config, &db)?;
        let usage = Arc::new(db.usage(config.limits.max_usage_bytes)?);
        let host = Arc::new(Host::new(config, reach, workdir, metrics));
        let revisions: Revisions = Arc::default();
        let guests: Revisions = Arc::default();
        let registry: crate::registry::Live = Arc::default();
        let pool = PoolManager::new(
            backend,
            host.config.backend.gpus.clone(),
            Arc::new(Sink {
                revisions: revisions.clone(),
                guests: guests.clone(),
                registry: registry.clone(),
                weights: weights.clone(),
                gateway_url: format!("http://{}", host.reach),
            }),
        );
        let upstream = Upstream::new().with_answer_idle(host.config.limits.idle_timeout);
        let buffered =
            crate::serving::buffered::Buffered::new(host.config.limits.max_buffered_body_bytes);
        let promotions = Arc::new(Promotions {
            host: host.clone(),
            registry: registry.clone(),
            store: store.clone(),
            revisions,
            guests,
            pool: pool.clone(),
            upstream: upstream.clone(),
            weights: weights.clone(),
        });
        let changes = Arc::new(Changes {
            host: host.clone(),
            registry: registry.clone(),
            store: store.clone(),
            pool: pool.clone(),
            upstream: upstream.clone(),
            weights: weights.clone(),
            tasks: tasks.clone(),
            promotions: promotions.clone(),
            lock: ChangeLock::default(),
        });
        let gw = Arc::new(Gateway {
            serving: crate::serving::pipeline::Pipeline::new(
                upstream.clone(),
                pool.clone(),
                host.started,
                adapter_files,
            ),
            host,
            registry,
            pool,
            upstream,
            weights,
            tasks,
            store,
            promotions,
            changes,
            access: Access {
                admin_token: crate::access::admin_token(),
                tenants,
            },
            buffered,
            peers: crate::peers::Peers::default(),
            usage,
        });
        gw.start_all(tolerant)?;
        Ok(gw)
    }
}

impl Gateway {
    /// Starts the config's pools, then its apps from their stored state
    /// (read in one go where the store can, written in one batch). Under
    /// the operator (`tolerant`) an app that cannot start is left out and
    /// reported; otherwise it fails the start.
    fn start_all(self: &Arc<Self>, tolerant: bool) -> anyhow::Result<()> {
        let gw = self;
        for spec in &gw.host.config.pools {
            gw.changes.start_pool(spec.clone())?;
        }
        let mut apps = Vec::with_capacity(gw.host.config.apps.len());
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
            for spec in &gw.host.config.apps {
                let history = stored
                    .as_mut()
                    .map(|all| all.remove(&spec.name).unwrap_or_default());
                match gw.changes.prepare_app(spec.clone(), history) {
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
            gw.changes.watch_app(app);
        }
        Ok(())
    }
}

/// The state folder, owner only: it holds the state database, replica
/// logs and the weight cache.
fn make_state_dir(config: &Config) -> anyhow::Result<()> {
    use std::os::unix::fs::DirBuilderExt as _;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(&config.state_dir)
        .with_context(|| format!("create {}", config.state_dir.display()))
}

/// The tenants of `[[tenants]]`, their keys read from the environment.
fn tenants_of(config: &Config) -> anyhow::Result<Option<crate::tenants::Tenants>> {
    Ok(
        crate::tenants::Tenants::from_config(&config.tenants, |v| std::env::var(v).ok())
            .map_err(|(key, message)| anyhow::anyhow!("{key}: {message}"))?
            .map(|t| {
                t.with_byte_shares(
                    config.limits.max_pending_task_bytes,
                    config.limits.max_task_body_bytes,
                )
            }),
    )
}

/// The checkpoints the gateway serves its workers (the weight cache, the
/// file's allow-list, relative URIs against `base`), and the folders
/// adapters are pulled into for the engines, which share the cache's byte
/// budget.
fn weights_of(
    config: &Config,
    base: std::path::PathBuf,
) -> anyhow::Result<(
    Arc<crate::weights::Weights>,
    Arc<crate::serving::adapter_files::AdapterFiles>,
)> {
    let w = &config.weights;
    // Adapters pulled for the engines share the cache's byte budget.
    let adapters_dir = config.state_dir.join("adapters");
    let cache =
        warmgate_pool::weights::Cache::open(config.state_dir.join("cache"), w.cache_max_bytes)
            .context("open the weight cache")?
            .sharing_with(&adapters_dir);
    let allowed =
        warmgate_pool::weights::AllowList::new(&crate::weights::allowed_prefixes(config), &base)
            .context("weights.allowed_prefixes")?;
    let stream = warmgate_pool::weights::StreamConfig {
        concurrency: w.concurrency,
        part_size: w.part_size_bytes,
        memory_limit: w.memory_limit_bytes,
    };
    let weights = Arc::new(crate::weights::Weights::new(
        cache.clone(),
        stream.clone(),
        allowed,
        base,
    ));
    let adapter_files = Arc::new(crate::serving::adapter_files::AdapterFiles::new(
        weights.clone(),
        cache,
        stream,
        adapters_dir,
    ));
    Ok((weights, adapter_files))
}

/// Where workers reach the gateway: pods at its advertised address (its
/// Service), workers on this machine on loopback when it listens on every
/// interface.
fn reach_of(config: &Config, addr: std::net::SocketAddr) -> String {
    match &config.backend.kubernetes.advertise {
        Some(a) if config.backend.kind == warmgate_deploy::BackendKind::Kubernetes => a.clone(),
        _ if addr.ip().is_unspecified() => {
            std::net::SocketAddr::from(([127, 0, 0, 1], addr.port())).to_string()
        }
        _ => addr.to_string(),
    }
}

/// The task store, bounded by the limits, with its journal in `state.db`:
/// the async tasks of the last run that had not finished are marked failed.
fn tasks_of(config: &Config, db: &StateDb) -> anyhow::Result<Arc<crate::tasks::store::TaskStore>> {
    let tasks = Arc::new(crate::tasks::store::TaskStore::new(
        crate::tasks::store::StoreLimits {
            max_pending_bytes: config.limits.max_pending_task_bytes,
            max_results_bytes: config.limits.max_task_results_bytes,
        },
    ));
    let (journal, recovered) = db.journal(config.limits.max_journal_bytes)?;
    if recovered.failed > 0 {
        tracing::warn!(
            tasks = recovered.failed,
            "async tasks accepted before the last stop had not finished; they are marked failed (gateway_restarted)"
        );
    }
    metrics::counter!("warmgate_tasks_failed_by_restart_total").increment(recovered.failed);
    tasks.set_journal(Arc::new(journal));
    Ok(tasks)
}

/// The changes made through the API laid over the file's `config`, one at
/// a time, each kept only if the config it makes is valid: a change that
/// no longer fits the file (an edited alias, narrowed prefixes) is
/// skipped with a warning, not a failed start. The weights allow-list is
/// the file's alone: a checkpoint put through the API must lie under it.
fn lay_over(mut config: Config, overlay: Overlay) -> Config {
    let mut changes: Vec<(String, Overlay)> = Vec::new();
    for (name, spec) in &overlay.apps {
        let mut one = Overlay::default();
        one.apps.insert(name.clone(), spec.clone());
        changes.push((format!("app {name}"), one));
    }
    for (name, spec) in &overlay.pools {
        let mut one = Overlay::default();
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
    config
}
