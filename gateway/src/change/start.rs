//! An app or a pool started among the services: its history restored,
//! its replicas asked for, its dispatcher or watchers running, its place
//! in the registry. At start (`runtime/assemble.rs`) and on a put.

use std::sync::Arc;

use warmgate_pool::TargetSpec;

use crate::serving::served::Served;

use super::Changes;

impl Changes {
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
            listen: p.spec().listen,
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
                    let want = p.ondemand_desired(manager.starting(&od));
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
}
