//! Changes to the live desired state: an app or a pool put or deleted
//! while the gateway runs, as the API (and `warmgate apply`) asks.
//!
//! Every change is checked as a whole config would be (the same
//! validation as the config file, so names that collide with another
//! target are refused), saved in the state store, and only then carried
//! out, so it survives a restart and a failed save changes nothing. What
//! it does to replicas:
//! - an unchanged spec: nothing, the same processes serve;
//! - only autoscaling, queue, alias or promotion settings changed: applied
//!   in place, the same processes serve;
//! - anything else changed: a new revision from the new spec is started,
//!   takes all the traffic once ready, and the old one drains;
//! - deleted: it leaves the registry at once (new work gets 404), what it
//!   holds finishes, then its replicas stop.

use std::sync::Arc;
use std::time::Duration;

use warmgate_deploy::store::SpecKind;
use warmgate_deploy::{AppSpec, Config, PoolSpec, TargetId};

use crate::error::{Error, ErrorKind};
use crate::host::Host;
use crate::promote::Promotions;
use crate::serving::served::Served;

/// What a put did.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case", tag = "change")]
pub enum Changed {
    /// A new app or pool.
    Created,
    /// The same spec as before: nothing was done.
    Unchanged,
    /// Settings that need no new replica, applied to the running ones.
    InPlace,
    /// A new revision replaces the serving one as soon as it is ready.
    Rolled {
        /// The new revision.
        revision: String,
    },
}

/// How long a deleted app or pool may take to finish what it holds before
/// its replicas are stopped anyway.
const MAX_DRAIN: Duration = Duration::from_secs(30 * 60);

mod adapter_promote;
mod api;
mod apply;
pub(crate) mod lock;
mod start;

pub use adapter_promote::AdapterPromoteRequest;
pub(crate) use api::{AdapterChanged, PromoteAsked, Promoted};
pub use apply::Applied;
use lock::ChangeLock;

/// Changes to the live desired state, and the start of what they put:
/// it holds the services a change reaches (the registry and the revision
/// store, the pool manager, the weights, the task store, `Promotions` for
/// the rolls) and what keeps changes apart.
pub struct Changes {
    /// The process: the file's other settings, where workers reach it.
    pub(crate) host: Arc<Host>,
    /// The apps and pools served now.
    pub(crate) registry: crate::registry::Live,
    /// Where a change is saved before it is made.
    pub(crate) store: Arc<dyn warmgate_deploy::store::StateStore>,
    /// The replicas of every target.
    pub(crate) pool: warmgate_pool::PoolManager,
    /// The connections to the replicas (a pool's dispatcher uses them).
    pub(crate) upstream: crate::upstream::Upstream,
    /// Checkpoints served to workers.
    pub(crate) weights: Arc<crate::weights::Weights>,
    /// The pools' tasks.
    pub(crate) tasks: Arc<crate::tasks::store::TaskStore>,
    /// Rolls, restores and the checkpoint watchers of the apps.
    pub(crate) promotions: Arc<Promotions>,
    /// One change at a time, busy and retiring names, the API switch.
    pub(crate) lock: ChangeLock,
}

impl Changes {
    /// Refuses every change through the API from now on: under the
    /// operator the resources are the truth, and a put could carry what
    /// the operator refuses in a resource (a gate command).
    pub fn refuse_api_changes(&self) {
        self.lock.refuse_api();
    }

    /// The specs served now, under the file's other settings.
    pub(crate) fn desired_config(&self) -> Config {
        let r = self.registry.load();
        let mut c = (*self.host.config).clone();
        c.apps = r.apps().iter().map(|a| (*a.spec()).clone()).collect();
        c.pools = r.pools().map(|p| (*p.spec()).clone()).collect();
        c
    }

    /// Checks `candidate` as the config file is checked, and that the
    /// checkpoints it names (for `changed`) may be opened. The key in an
    /// error is the one inside the spec.
    fn check(&self, candidate: &Config, prefix: &str) -> Result<(), Error> {
        candidate.validate().map_err(|(key, message)| {
            let key = key
                .strip_prefix(prefix)
                .map_or(key.clone(), |k| k.trim_start_matches('.').to_string());
            Error::new(ErrorKind::BadRequest, format!("{key}: {message}"))
        })
    }

    fn record(
        &self,
        kind: SpecKind,
        name: &str,
        body: Option<&str>,
        note: &str,
    ) -> Result<(), Error> {
        self.store.record_spec(kind, name, body, note).map_err(|e| {
            Error::new(
                ErrorKind::Internal,
                format!("the gateway could not save the change, so it did not make it: {e}"),
            )
            .caused_by(e)
        })
    }

    /// Puts an app: creates it, or changes the one of that name.
    pub async fn put_app(self: &Arc<Self>, spec: AppSpec) -> Result<Changed, Error> {
        self.put_app_from(spec, false).await
    }

    /// [`Changes::put_app`] for an adapter promotion's commit: a change
    /// of adapters alone is made in place, also while a promotion of the
    /// app's own revisions runs (it touches no revision).
    pub(crate) async fn put_app_adapters(
        self: &Arc<Self>,
        spec: AppSpec,
    ) -> Result<Changed, Error> {
        self.put_app_from(spec, true).await
    }

    async fn put_app_from(
        self: &Arc<Self>,
        mut spec: AppSpec,
        adapters_only: bool,
    ) -> Result<Changed, Error> {
        let name = spec.name.clone();
        let _busy = self.lock.claim(&format!("app '{name}'"))?;
        // One registry change at a time: each is checked against the
        // state the one before it left.
        let _one = self.lock.one_at_a_time().await;
        if self.lock.retiring_pools.lock().contains(&name) {
            return Err(Error::new(
                ErrorKind::Conflict,
                format!(
                    "a pool '{name}' was deleted and is still finishing its tasks; put the app once it is gone"
                ),
            ));
        }
        let current = self
            .registry
            .load()
            .apps()
            .iter()
            .find(|a| a.name == name)
            .cloned();
        if let Some(app) = &current {
            carry_adapter_revisions(app, &mut spec);
        }
        let json = self.vet_app(&spec)?;
        match current {
            None => self.create_app(spec, &json),
            Some(app) => self.change_app(&app, spec, &json, adapters_only),
        }
    }

    /// Checks a put app against the config it would make and the
    /// checkpoints and adapter folders it names; its spec as saved.
    fn vet_app(&self, spec: &AppSpec) -> Result<String, Error> {
        let mut candidate = self.desired_config();
        let index = match candidate.apps.iter().position(|a| a.name == spec.name) {
            Some(i) => {
                candidate.apps[i] = spec.clone();
                i
            }
            None => {
                candidate.apps.push(spec.clone());
                candidate.apps.len() - 1
            }
        };
        self.check(&candidate, &format!("apps[{index}]"))?;
        if let Some(uri) = &spec.checkpoint {
            self.weights.open(uri)?;
        }
        if let Some(uri) = &spec.promotion.watch {
            self.weights.open(uri)?;
        }
        // An adapter's folder is read by the engine, under the same
        // allow-list as checkpoints.
        for a in &spec.adapters.models {
            self.weights.open(&a.checkpoint)?;
        }
        encode_spec(spec)
    }

    /// A put of an app of a new name: saved, then started.
    fn create_app(self: &Arc<Self>, spec: AppSpec, json: &str) -> Result<Changed, Error> {
        let name = spec.name.clone();
        self.record(
            SpecKind::App,
            &name,
            Some(json),
            &format!("app {name} put through the API"),
        )?;
        if let Err(e) = self.start_app(spec) {
            // Not kept: a restart would trip on it.
            let _ = self.store.forget_spec(SpecKind::App, &name);
            return Err(Error::new(
                ErrorKind::Internal,
                format!("app '{name}': {e:#}"),
            ));
        }
        Ok(Changed::Created)
    }

    /// A put of a running app: left as it is, retuned in place or
    /// rolled to a new revision.
    fn change_app(
        self: &Arc<Self>,
        app: &Arc<Served>,
        spec: AppSpec,
        json: &str,
        adapters_only: bool,
    ) -> Result<Changed, Error> {
        let name = spec.name.clone();
        let old = app.spec();
        refuse_pool_move(&name, &old, &spec)?;
        if spec.pool.is_some() {
            // Nothing of its own runs: its names and queue change in place.
            if *old == spec {
                return Ok(Changed::Unchanged);
            }
            self.record(
                SpecKind::App,
                &name,
                Some(json),
                &format!("app {name} retuned through the API"),
            )?;
            app.set_spec(spec);
            self.registry.rcu(|r| Arc::new(r.with_app(app.clone())));
            return Ok(Changed::InPlace);
        }
        if *old == spec && serves(app, &spec) {
            return Ok(Changed::Unchanged);
        }
        let old_json = serde_json::to_string(&*old).ok();
        let watch_changed = old.promotion.watch != spec.promotion.watch
            || old.promotion.marker != spec.promotion.marker
            || old.promotion.watch_interval != spec.promotion.watch_interval;
        let in_place = retunable(&old, &spec) && serves(app, &old);
        if !(adapters_only && in_place) {
            self.promotions.refuse_if_promoting(app)?;
        }
        if adapters_only && !in_place {
            return Err(Error::new(
                ErrorKind::Conflict,
                format!("app '{name}' changed in more than its adapters meanwhile"),
            ));
        }
        // The saved spec goes back to the running one when the change is
        // not made, so a restart does not make it either.
        let undo = |e: Error| {
            let _ = self.record(SpecKind::App, &name, old_json.as_deref(), "");
            e
        };
        let changed = if in_place {
            self.record(
                SpecKind::App,
                &name,
                Some(json),
                &format!("app {name} retuned through the API"),
            )?;
            self.retune_app(app, spec).map_err(undo)?;
            Changed::InPlace
        } else {
            self.record(SpecKind::App, &name, Some(json), "")?;
            let revision = self
                .promotions
                .roll(app, spec, "the spec changed through the API")
                .map_err(undo)?;
            Changed::Rolled { revision }
        };
        // Aliases may have changed: the app is routed by its new ones.
        self.registry.rcu(|r| Arc::new(r.with_app(app.clone())));
        self.watch_adapters(app);
        if watch_changed {
            // The running watcher sees a newer generation and stops.
            app.next_watcher();
            if app.spec().promotion.watch.is_some() {
                tokio::spawn(self.promotions.clone().watch(app.clone()));
            }
        }
        Ok(changed)
    }

    /// Records that the app's spec names `checkpoint` now (promoted by
    /// other means than a put, as the operator promotes a resource's new
    /// checkpoint).
    pub fn adopt_checkpoint(&self, name: &str, checkpoint: &str) {
        if let Ok(app) = self.registry.load().find_app(name) {
            let mut spec = (*app.spec()).clone();
            spec.checkpoint = Some(checkpoint.to_string());
            app.set_spec(spec);
        }
    }

    /// Applies a spec that differs only in settings the running replicas
    /// can take: every live revision takes its autoscaling and queue.
    fn retune_app(&self, app: &Arc<Served>, spec: AppSpec) -> Result<(), Error> {
        let config = encode_spec(&spec)?;
        {
            // Saved as the spec its revisions come from, so a restart does
            // not take it for a change that needs a new revision.
            let mut h = app.history.lock();
            let mut next = h.clone();
            next.config = Some(config);
            self.store.save(&app.name, &next, "").map_err(|e| {
                Error::new(ErrorKind::Internal, format!("could not save: {e}")).caused_by(e)
            })?;
            *h = next;
        }
        for rev in app.live() {
            rev.retune(&spec);
        }
        app.set_spec(spec);
        Ok(())
    }

    /// Deletes an app: it leaves routing at once; its revisions finish what
    /// they hold, then stop.
    pub async fn delete_app(self: &Arc<Self>, name: &str) -> Result<(), Error> {
        let _busy = self.lock.claim(&format!("app '{name}'"))?;
        let _one = self.lock.one_at_a_time().await;
        let Some(app) = self
            .registry
            .load()
            .apps()
            .iter()
            .find(|a| a.name == name)
            .cloned()
        else {
            return Err(Error::new(
                ErrorKind::NotFound,
                format!("app '{name}' not found"),
            ));
        };
        self.promotions.refuse_if_promoting(&app)?;
        self.record(
            SpecKind::App,
            name,
            None,
            &format!("app {name} deleted through the API"),
        )?;
        if let Err(e) = self.promotions.forget_spec(&app, "") {
            // A promotion began meanwhile: the app stays, and so does its
            // saved spec.
            if let Ok(json) = serde_json::to_string(&*app.spec()) {
                let _ = self.record(SpecKind::App, name, Some(&json), "");
            }
            return Err(e);
        }
        self.registry.rcu(|r| Arc::new(r.without_app(name)));
        self.lock.retiring_apps.lock().insert(name.to_string());
        let gw = self.clone();
        tokio::spawn(async move { gw.retire_app(app).await });
        Ok(())
    }

    /// Waits for a deleted app's requests to end, then stops its replicas
    /// and forgets its targets.
    async fn retire_app(self: Arc<Self>, app: Arc<Served>) {
        let revisions = app.live();
        let started = tokio::time::Instant::now();
        let mut tick = tokio::time::interval(Duration::from_millis(50));
        loop {
            tick.tick().await;
            let busy = revisions.iter().any(|r| r.load() != (0, 0));
            if !busy || started.elapsed() >= MAX_DRAIN {
                break;
            }
        }
        for rev in &revisions {
            rev.hold(0);
            self.weights.unregister(&app.name, &rev.revision);
            app.remove_live(&rev.revision);
            self.pool.scale(&rev.target, 0);
        }
        // Every revision it ever started goes, the retired ones (kept at
        // zero for a rollback) too; not those of an app of the same name
        // put again meanwhile.
        let again: Vec<TargetId> = self
            .registry
            .load()
            .app(&app.name)
            .filter(|a| !Arc::ptr_eq(a, &app))
            .map(|a| a.live().iter().map(|r| r.target.clone()).collect())
            .unwrap_or_default();
        let all: Vec<TargetId> = self
            .promotions
            .revisions
            .read()
            .iter()
            .filter(|(id, r)| r.name == app.name && !again.contains(id))
            .map(|(id, _)| id.clone())
            .collect();
        for id in &all {
            self.weights.unregister(&app.name, &id.to_string());
            self.pool.scale(id, 0);
        }
        for id in &all {
            self.pool.remove_target(id).await;
            self.promotions.revisions.write().remove(id);
        }
        // Its history too, where the store is shared and bounded; not if
        // an app of that name was put again meanwhile. One registry change
        // at a time: a put of that name waits for this, or this sees it.
        {
            let _one = self.lock.one_at_a_time().await;
            if self.registry.load().app(&app.name).is_none()
                && let Err(e) = self.store.forget(&app.name)
            {
                tracing::warn!(app = %app.name, error = %e, "could not drop the deleted app's state; it stays in the store");
            }
            self.lock.retiring_apps.lock().remove(&app.name);
        }
        tracing::info!(app = %app.name, "deleted app's replicas stopped");
    }

    /// Puts a pool: creates it. A pool of that name with the same spec is
    /// left as it is; changing a running pool is refused (delete it, then
    /// put it again).
    pub async fn put_pool(self: &Arc<Self>, spec: PoolSpec) -> Result<Changed, Error> {
        let name = spec.name.clone();
        let _busy = self.lock.claim(&format!("pool '{name}'"))?;
        let _one = self.lock.one_at_a_time().await;
        if self.lock.retiring_pools.lock().contains(&name) {
            return Err(Error::new(
                ErrorKind::Conflict,
                format!(
                    "pool '{name}' was deleted and is still finishing its tasks; put it again once it is gone"
                ),
            ));
        }
        if self.lock.retiring_apps.lock().contains(&name) {
            return Err(Error::new(
                ErrorKind::Conflict,
                format!(
                    "an app '{name}' was deleted and is still finishing its requests; put the pool once it is gone"
                ),
            ));
        }
        if let Some(p) = self.registry.load().pool(&name).cloned() {
            return self.change_pool(&p, spec);
        }
        // A name a revision or target still holds (an app's retired
        // revision kept for a rollback) would take that target's replicas.
        if self.pool.has_target_named(&name) {
            return Err(Error::new(
                ErrorKind::BadRequest,
                format!(
                    "name: '{name}' is the name of a running target (an app's revision); choose another"
                ),
            ));
        }
        let mut candidate = self.desired_config();
        candidate.pools.push(spec.clone());
        self.check(&candidate, &format!("pools[{}]", candidate.pools.len() - 1))?;
        if let Some(uri) = &spec.checkpoint {
            self.weights.open(uri)?;
        }
        let json = encode_spec(&spec)?;
        self.record(SpecKind::Pool, &name, Some(&json), "")?;
        if let Err(e) = self.start_pool(spec) {
            let _ = self.store.forget_spec(SpecKind::Pool, &name);
            return Err(Error::new(
                ErrorKind::Internal,
                format!("pool '{name}': {e:#}"),
            ));
        }
        Ok(Changed::Created)
    }

    /// A running pool put again: nothing for the same spec; in place for
    /// settings that need no new replica; refused (409) otherwise.
    fn change_pool(&self, pool: &crate::tasks::Pool, spec: PoolSpec) -> Result<Changed, Error> {
        let name = spec.name.clone();
        let old = pool.spec();
        if *old == spec {
            return Ok(Changed::Unchanged);
        }
        if old.retuned(&spec) != spec {
            return Err(Error::new(
                ErrorKind::Conflict,
                format!(
                    "pool '{name}': changing its command, image, env, checkpoint, concurrency, gpus, queue fairness or pod settings needs new replicas, which a running pool does not roll to yet: delete it, then put it again (replica bounds, idle_ttl, suspend_after, buffer, retries, timeouts, max_staleness, inference_share and queue bounds change in place)"
                ),
            ));
        }
        let mut candidate = self.desired_config();
        let at = candidate
            .pools
            .iter()
            .position(|p| p.name == name)
            .unwrap_or(candidate.pools.len());
        if at == candidate.pools.len() {
            candidate.pools.push(spec.clone());
        } else {
            candidate.pools[at] = spec.clone();
        }
        self.check(&candidate, &format!("pools[{at}]"))?;
        let json = encode_spec(&spec)?;
        self.record(
            SpecKind::Pool,
            &name,
            Some(&json),
            &format!("pool {name} retuned through the API"),
        )?;
        pool.retune(&spec);
        let startup = spec.startup_timeout;
        for target in std::iter::once(pool.target()).chain(pool.ondemand_target()) {
            self.pool
                .update_target(&target, |t| t.startup_timeout = startup);
        }
        let target = pool.target();
        self.pool
            .scale(&target, pool.desired(self.pool.starting(&target)));
        Ok(Changed::InPlace)
    }

    /// Deletes a pool: it takes no new task at once; the tasks it holds
    /// finish, then its replicas stop.
    pub async fn delete_pool(self: &Arc<Self>, name: &str) -> Result<(), Error> {
        let _busy = self.lock.claim(&format!("pool '{name}'"))?;
        let _one = self.lock.one_at_a_time().await;
        let Some(pool) = self.registry.load().pool(name).cloned() else {
            return Err(Error::new(
                ErrorKind::NotFound,
                format!("pool '{name}' not found"),
            ));
        };
        if let Some(app) = self
            .registry
            .load()
            .apps()
            .iter()
            .find(|a| a.spec().pool.as_deref() == Some(name))
        {
            return Err(Error::new(
                ErrorKind::Conflict,
                format!(
                    "pool '{name}' serves app '{}'; delete the app first",
                    app.name
                ),
            ));
        }
        self.record(SpecKind::Pool, name, None, "")?;
        pool.close();
        self.lock.retiring_pools.lock().insert(name.to_string());
        self.registry.rcu(|r| Arc::new(r.without_pool(name)));
        let gw = self.clone();
        tokio::spawn(async move {
            // Told when the last task ends; checked now and then as well,
            // and given up on after MAX_DRAIN.
            // Out of the registry, the autoscale tick no longer sees it:
            // its tasks' timeouts and its replicas are looked after here.
            let started = tokio::time::Instant::now();
            while !pool.is_empty() && started.elapsed() < MAX_DRAIN {
                let _ = tokio::time::timeout(Duration::from_millis(200), pool.drained()).await;
                pool.expire(std::time::Instant::now());
                let target = pool.target();
                gw.pool
                    .scale(&target, pool.desired(gw.pool.starting(&target)));
            }
            if !pool.is_empty() {
                let err = Error::new(
                    ErrorKind::ReplicaFailed,
                    format!(
                        "pool '{}' was deleted and its tasks did not finish within {}",
                        pool.name,
                        humantime::format_duration(MAX_DRAIN)
                    ),
                );
                pool.fail_pending(&err);
                pool.fail_fallback(&err);
            }
            let mut targets = vec![pool.target()];
            targets.extend(pool.ondemand_target());
            for t in &targets {
                gw.pool.scale(t, 0);
            }
            for t in &targets {
                gw.pool.remove_target(t).await;
            }
            gw.registry
                .rcu(|r| Arc::new(r.forget_pool_targets(&pool.name)));
            gw.weights.unregister_all(&pool.name);
            gw.lock.retiring_pools.lock().remove(&pool.name);
            tracing::info!(pool = %pool.name, "deleted pool's replicas stopped");
        });
        Ok(())
    }
}

/// Gives the put spec's adapters the revisions the running app's hold:
/// an adapter whose checkpoint changed is a new revision, never one an
/// engine may hold already.
fn carry_adapter_revisions(app: &Served, spec: &mut AppSpec) {
    let incoming = spec.adapters.clone();
    spec.adapters.carry_revisions(&app.spec().adapters, |n| {
        let given = incoming.get(n).map(|a| (a.revision, a.checkpoint.as_str()));
        app.adapter_revision_floor(n, given)
    });
}

/// Refuses a put that would move an app into or out of a pool.
fn refuse_pool_move(name: &str, old: &AppSpec, spec: &AppSpec) -> Result<(), Error> {
    if old.pool == spec.pool {
        return Ok(());
    }
    Err(Error::new(
        ErrorKind::Conflict,
        format!(
            "app '{name}' would move {} {}: delete it and put it again",
            old.pool
                .as_ref()
                .map_or("from its own replicas".to_string(), |p| format!(
                    "from pool '{p}'"
                )),
            spec.pool
                .as_ref()
                .map_or("to replicas of its own".to_string(), |p| format!(
                    "to pool '{p}'"
                )),
        ),
    ))
}

/// Whether `spec` differs from `old` only in what running replicas can
/// take in place.
fn retunable(old: &AppSpec, spec: &AppSpec) -> bool {
    let mut tuned = old.clone();
    tuned.autoscale = spec.autoscale.clone();
    tuned.queue = spec.queue.clone();
    tuned.aliases = spec.aliases.clone();
    tuned.promotion = spec.promotion.clone();
    // Routing is the gateway's alone; `engine` changes what the pool
    // manager reads of each replica, so it rolls like the command.
    tuned.routing = spec.routing.clone();
    // Adapters are loaded where requests go, at runtime.
    tuned.adapters = spec.adapters.clone();
    tuned == *spec
}

/// Whether the app's serving revision runs `spec` in what needs new
/// replicas (its checkpoint aside, which promotions change): false after a
/// roll to it failed, so the same put tries again.
fn serves(app: &Served, spec: &AppSpec) -> bool {
    let h = app.history.lock();
    let Some(rev) = h.serving() else {
        // Nothing serves (at zero with no revision yet): nothing to redo.
        return true;
    };
    let Ok(mut running) = serde_json::from_str::<AppSpec>(&rev.spec) else {
        return true;
    };
    // Only what needs new replicas counts: the rest is applied in place
    // and not kept in the revision.
    running.checkpoint = spec.checkpoint.clone();
    running.autoscale = spec.autoscale.clone();
    running.queue = spec.queue.clone();
    running.aliases = spec.aliases.clone();
    running.promotion = spec.promotion.clone();
    running.adapters = spec.adapters.clone();
    running == *spec
}

/// A spec as saved in `state.db`.
fn encode_spec(spec: &impl serde::Serialize) -> Result<String, Error> {
    serde_json::to_string(spec)
        .map_err(|e| Error::new(ErrorKind::Internal, format!("cannot encode the spec: {e}")))
}
