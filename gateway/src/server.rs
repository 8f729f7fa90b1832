//! The gateway: the services it is made of, and the start of an app or a
//! pool among them (its history restored, its replicas asked for, its
//! place in the registry). It is put together in `runtime/assemble.rs`.

use std::sync::Arc;
use std::time::Duration;

use warmgate_deploy::{Config, TargetId};
use warmgate_pool::{PoolManager, TargetSpec};

use crate::error::Error;
use crate::host::Host;
use crate::promote::Promotions;
use crate::serving::served::Served;
use crate::upstream::Upstream;

pub(crate) const X_REQUEST_ID: http::HeaderName = http::HeaderName::from_static("x-request-id");
pub(crate) const X_TENANT: &str = "x-warmgate-tenant";
/// The longest timeout a client may ask for: past it, deadline arithmetic
/// could overflow, and no task or sync should wait a month.
pub(crate) const MAX_CLIENT_DURATION: Duration = Duration::from_secs(30 * 24 * 3600);
/// Client-supplied request ids longer than this are replaced.
pub(crate) const MAX_REQUEST_ID_LEN: usize = 128;

/// The gateway: the services it is made of, each holding what it needs.
/// Built in `runtime/assemble.rs`; its methods here start apps and pools,
/// the ones in `change.rs` change them, `report.rs` reads them.
pub struct Gateway {
    /// The process: config, clock, where workers reach it, drain flag.
    pub(crate) host: Arc<Host>,
    /// The apps and pools served now, swapped whole on a change.
    pub(crate) registry: crate::registry::Live,
    /// The replicas of every target.
    pub(crate) pool: PoolManager,
    /// Connections to the replicas.
    pub(crate) upstream: Upstream,
    /// A request's way from the traffic split to a replica.
    pub(crate) serving: crate::serving::pipeline::Pipeline,
    /// Checkpoints served to workers.
    pub(crate) weights: Arc<crate::weights::Weights>,
    /// The pools' tasks and their journal.
    pub(crate) tasks: Arc<crate::tasks::store::TaskStore>,
    /// Revision histories and the changes made through the API.
    pub(crate) store: Arc<dyn warmgate_deploy::store::StateStore>,
    /// Promotions, rolls and rollbacks of the apps' revisions.
    pub(crate) promotions: Arc<Promotions>,
    /// What keeps changes to the registry apart.
    pub(crate) changes: crate::change_lock::ChangeLock,
    /// Who may call: the admin token and the tenants' keys.
    pub(crate) access: crate::access::Access,
    /// Request bodies being read, and inference bodies waiting for a
    /// replica, within `limits.max_buffered_body_bytes`.
    pub(crate) buffered: crate::serving::buffered::Buffered,
    /// The other gateway replicas serving with this one.
    pub(crate) peers: crate::peers::Peers,
}

// === impl Gateway ===

impl Gateway {
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
                self.host.weights_url(&p.name, &revision),
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
            workdir: self.host.workdir.clone(),
            concurrency: p.spec().concurrency,
            gpus: p.spec().gpus,
            startup_timeout: p.spec().startup_timeout,
            stop_grace: self.host.config.backend.stop_grace,
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
    pub(crate) fn prepare_app(
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
            self.promotions
                .restore(&app)
                .context("restore its revisions")?;
        }
        Ok(app)
    }

    /// The watchers of an app in the registry: its checkpoints' and its
    /// adapters'.
    pub(crate) fn watch_app(self: &Arc<Self>, app: &Arc<Served>) {
        if app.spec().promotion.watch.is_some() {
            tokio::spawn(self.promotions.clone().watch(app.clone()));
        }
        self.watch_adapters(app);
    }

    /// The config it runs.
    pub fn config(&self) -> &Config {
        &self.host.config
    }

    /// Time since start: the autoscaler's clock.
    pub(crate) fn now(&self) -> Duration {
        self.host.now()
    }

    /// Stops taking traffic: `/readyz` fails and the autoscaler stops.
    pub fn start_draining(&self) {
        self.host.start_draining();
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
        Error,
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
    pub fn app(&self, name: &str) -> Result<Arc<Served>, Error> {
        self.registry.load().find_app(name)
    }
}
