//! The leader's reconcile loop: kube-runtime's [`Controller`], one for
//! `ServingApp`s and one for `WarmPool`s, calls [`reconcile_app`] or
//! [`reconcile_pool`] for one resource at a time, level-triggered (on a
//! change, on a re-list, on a requeue), and each call puts that one
//! resource into the running gateway's registry, which rolls, scales in
//! place or leaves alone only that resource's pods.
//!
//! - A resource is checked together with all the others the controllers'
//!   stores hold (names are shared between apps and pools), so a clash
//!   clears once the resource it clashed with goes.
//! - A refused resource is not touched: a running one keeps running as it
//!   was, and its status says why. It is checked again every
//!   [`REFUSED_RECHECK`].
//! - A change the gateway refuses (during a promotion, say) is tried again
//!   every [`STATUS_INTERVAL`] until it goes through.
//! - A deleted resource has no reconcile call (its object is gone from the
//!   store); [`sweep`] drains what the gateway runs and no store holds,
//!   once both stores have been listed, every [`SWEEP_INTERVAL`].
//! - Statuses are written every [`STATUS_INTERVAL`], only where they
//!   changed.
//!
//! Reconciles and sweeps hold one lock while they change the gateway, so
//! a sweep never acts on a store older than what a reconcile just put.

use std::collections::{BTreeMap, BTreeSet};
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt as _;
use kube::ResourceExt as _;
use kube::api::Api;
use kube::runtime::controller::{Action, Controller};
use kube::runtime::reflector::Store;
use kube::runtime::watcher;
use warmgate_deploy::crd::{ServingApp, WarmPool};
use warmgate_deploy::{AppSpec, Config};
use warmgate_pool::kubernetes::KubeBackend;

use super::{
    Refusal, ResourceKind, Resources, STATUS_INTERVAL, checkpoint_only_change, config_from, events,
    owner_of, write_statuses,
};
use crate::Gateway;
use crate::change::Changed;
use crate::error::Error;

/// How often a refused resource is checked again: the resource it
/// clashed with may have gone, or the operator's settings changed.
pub const REFUSED_RECHECK: Duration = Duration::from_secs(30);
/// How often a resource that is served as it asks is reconciled anyway.
pub const RESYNC: Duration = Duration::from_secs(300);
/// How often the apps and pools no resource asks for any more are looked
/// for (a deletion is seen within this).
pub const SWEEP_INTERVAL: Duration = Duration::from_secs(1);

/// What every reconcile shares.
struct Ctx {
    gw: Arc<Gateway>,
    /// The running config's settings, without apps and pools.
    base: Config,
    backend: Arc<KubeBackend>,
    apps: Store<ServingApp>,
    pools: Store<WarmPool>,
    /// Why each refused resource is refused.
    refused: parking_lot::Mutex<BTreeMap<(ResourceKind, String), Vec<Refusal>>>,
    /// Held while the gateway is changed.
    applying: tokio::sync::Mutex<()>,
}

impl Ctx {
    /// Every resource the stores hold, by name (the order in which a clash
    /// of names is settled: the first name keeps it), checked together.
    fn checked(&self) -> Result<(Config, Vec<Refusal>), (String, String)> {
        let mut apps: Vec<ServingApp> = self.apps.state().iter().map(|a| (**a).clone()).collect();
        let mut pools: Vec<WarmPool> = self.pools.state().iter().map(|p| (**p).clone()).collect();
        apps.sort_by_key(|a| a.name_any());
        pools.sort_by_key(|p| p.name_any());
        config_from(self.base.clone(), &apps, &pools)
    }

    fn set_refused(&self, kind: ResourceKind, name: &str, why: Vec<Refusal>) {
        let mut refused = self.refused.lock();
        if why.is_empty() {
            refused.remove(&(kind, name.to_string()));
        } else {
            refused.insert((kind, name.to_string()), why);
        }
    }

    /// The resources as the stores hold them, and the refusals.
    fn resources(&self) -> Resources {
        Resources {
            apps: self
                .apps
                .state()
                .iter()
                .map(|a| (a.name_any(), (**a).clone()))
                .collect(),
            pools: self
                .pools
                .state()
                .iter()
                .map(|p| (p.name_any(), (**p).clone()))
                .collect(),
            refused: self.refused.lock().values().flatten().cloned().collect(),
        }
    }
}

/// Runs the two controllers, the deletion sweep and the status writes
/// until a controller ends. `resources` are those the gateway started
/// with, with their refusals.
pub(super) async fn run(
    gw: Arc<Gateway>,
    base: Config,
    backend: Arc<KubeBackend>,
    apps_api: Api<ServingApp>,
    pools_api: Api<WarmPool>,
    started: Vec<Refusal>,
) -> String {
    let app_controller = Controller::new(apps_api.clone(), watcher::Config::default());
    let pool_controller = Controller::new(pools_api.clone(), watcher::Config::default());
    let mut refused: BTreeMap<(ResourceKind, String), Vec<Refusal>> = BTreeMap::new();
    for r in started {
        refused.entry((r.kind, r.name.clone())).or_default().push(r);
    }
    let ctx = Arc::new(Ctx {
        gw,
        base,
        backend,
        apps: app_controller.store(),
        pools: pool_controller.store(),
        refused: parking_lot::Mutex::new(refused),
        applying: tokio::sync::Mutex::new(()),
    });
    let recorder = events::Events::new(
        apps_api.clone().into_client(),
        std::env::var("POD_NAME").ok(),
    );
    let apps = app_controller
        .run(reconcile_app, requeue_on_error, ctx.clone())
        .for_each(|r| async move { log_outcome("ServingApp", r.map(|(o, _)| o.name)) });
    let pools = pool_controller
        .run(reconcile_pool, requeue_on_error, ctx.clone())
        .for_each(|r| async move { log_outcome("WarmPool", r.map(|(o, _)| o.name)) });
    let upkeep = async {
        // Until both stores are listed, an app missing from them may just
        // not be listed yet: nothing is swept.
        if ctx.apps.wait_until_ready().await.is_err() || ctx.pools.wait_until_ready().await.is_err()
        {
            return;
        }
        let mut sweeps = tokio::time::interval(SWEEP_INTERVAL);
        sweeps.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut statuses = tokio::time::interval(STATUS_INTERVAL);
        statuses.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = sweeps.tick() => sweep(&ctx).await,
                _ = statuses.tick() => {
                    let seen = ctx.resources();
                    write_statuses(&ctx.gw, &apps_api, &pools_api, &seen, &recorder).await;
                }
            }
        }
    };
    tokio::select! {
        () = apps => "the ServingApp controller ended".into(),
        () = pools => "the WarmPool controller ended".into(),
        () = upkeep => "a resource store was dropped".into(),
    }
}

fn log_outcome<E: std::fmt::Display>(kind: &str, r: Result<String, E>) {
    match r {
        Ok(name) => tracing::trace!(kind, %name, "reconciled"),
        // A requeue of a resource deleted since, or a watch that failed
        // and restarts: the controller carries on either way.
        Err(e) => tracing::debug!(kind, error = %e, "a reconcile did not run"),
    }
}

/// Never called: the reconcilers settle every outcome as a requeue.
fn requeue_on_error<K>(_: Arc<K>, e: &Infallible, _: Arc<Ctx>) -> Action {
    match *e {}
}

/// Puts one `ServingApp` into the gateway.
async fn reconcile_app(app: Arc<ServingApp>, ctx: Arc<Ctx>) -> Result<Action, Infallible> {
    let _applying = ctx.applying.lock().await;
    let name = app.name_any();
    if let Some(o) = owner_of(&*app) {
        ctx.backend.set_owner(&name, o);
    }
    let config = match checked_alone(&ctx, ResourceKind::App, &name) {
        Ok(c) => c,
        Err(requeue) => return Ok(requeue),
    };
    let Some(spec) = config.apps.into_iter().find(|a| a.name == name) else {
        return Ok(Action::requeue(REFUSED_RECHECK));
    };
    let outcome = put_app(&ctx.gw, spec).await;
    Ok(settle(
        &ctx,
        ResourceKind::App,
        &name,
        outcome,
        Action::requeue(STATUS_INTERVAL),
    ))
}

/// The config of every resource checked together, when the one named is
/// not refused; else the requeue of a refused resource, its refusals
/// kept for its status.
fn checked_alone(ctx: &Ctx, kind: ResourceKind, name: &str) -> Result<Config, Action> {
    let (config, refused) = ctx.checked().map_err(|(key, message)| {
        tracing::error!(%key, %message, "the operator's own config is not valid; nothing applied");
        Action::requeue(REFUSED_RECHECK)
    })?;
    let mine: Vec<Refusal> = refused
        .into_iter()
        .filter(|r| r.kind == kind && r.name == name)
        .collect();
    if mine.is_empty() {
        return Ok(config);
    }
    for r in &mine {
        tracing::warn!(?kind, %name, key = %r.key, reason = %r.message, "refused a resource; as it runs, it keeps running");
    }
    ctx.set_refused(kind, name, mine);
    Err(Action::requeue(REFUSED_RECHECK))
}

/// What reconciling one resource did to the gateway.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Reconciled {
    /// Its spec was put, and this is what changed.
    Put(Changed),
    /// Its checkpoint alone changed: promoted as this revision.
    Promoting(String),
}

impl std::fmt::Display for Reconciled {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Reconciled::Put(c) => f.write_str(&c.describe()),
            Reconciled::Promoting(rev) => write!(f, "promoting the new checkpoint as {rev}"),
        }
    }
}

/// Logs what putting a resource did and keeps its refusal, if the
/// gateway refused; the refused are reconciled again as `retry` says.
fn settle(
    ctx: &Ctx,
    kind: ResourceKind,
    name: &str,
    outcome: Result<Reconciled, Error>,
    retry: Action,
) -> Action {
    match outcome {
        Ok(Reconciled::Put(Changed::Unchanged)) => {
            tracing::debug!(?kind, %name, "unchanged");
            ctx.set_refused(kind, name, Vec::new());
            Action::requeue(RESYNC)
        }
        Ok(what) => {
            tracing::info!(?kind, %name, "{what}");
            ctx.set_refused(kind, name, Vec::new());
            Action::requeue(RESYNC)
        }
        Err(Error { message, .. }) => {
            tracing::warn!(?kind, %name, reason = %message, "the gateway refused the change");
            ctx.set_refused(
                kind,
                name,
                vec![Refusal {
                    kind,
                    name: name.to_string(),
                    key: "(change)".into(),
                    message,
                }],
            );
            retry
        }
    }
}

/// Makes the gateway serve `spec`: a change of checkpoint only is
/// promoted; an app that moves between its own replicas and a pool is
/// deleted and put again; anything else is put as `warmgate apply` puts
/// it. Returns what was done, or why the gateway refused.
async fn put_app(gw: &Arc<Gateway>, mut spec: AppSpec) -> Result<Reconciled, Error> {
    let running = gw.changes.desired_config();
    if let Some((old, new)) = checkpoint_only_change(&spec, &running) {
        match gw.promotions.promote_checkpoint(&spec.name, &new).await {
            Ok(rev) => {
                // The app's spec names it now, so the put below finds the
                // app unchanged, and so does the next reconcile.
                gw.changes.adopt_checkpoint(&spec.name, &new);
                return Ok(Reconciled::Promoting(rev));
            }
            Err(e) => {
                tracing::warn!(app = %spec.name, error = %e.message, "could not promote the new checkpoint");
                // Left as it runs; tried again at the next reconcile.
                spec.checkpoint = old;
            }
        }
    }
    let moves = running
        .apps
        .iter()
        .any(|a| a.name == spec.name && a.pool != spec.pool);
    if moves {
        tracing::info!(app = %spec.name, "the app changes where it runs: deleting it to put it again");
        gw.changes.delete_app(&spec.name).await?;
    }
    gw.changes.put_app(spec).await.map(Reconciled::Put)
}

/// Puts one `WarmPool` into the gateway. A change the gateway refuses
/// (a running pool's settings) is not tried again until the resource
/// changes.
async fn reconcile_pool(pool: Arc<WarmPool>, ctx: Arc<Ctx>) -> Result<Action, Infallible> {
    let _applying = ctx.applying.lock().await;
    let name = pool.name_any();
    if let Some(o) = owner_of(&*pool) {
        ctx.backend.set_owner(&name, o);
    }
    let config = match checked_alone(&ctx, ResourceKind::Pool, &name) {
        Ok(c) => c,
        Err(requeue) => return Ok(requeue),
    };
    let Some(spec) = config.pools.into_iter().find(|p| p.name == name) else {
        return Ok(Action::requeue(REFUSED_RECHECK));
    };
    let outcome = ctx.gw.changes.put_pool(spec).await.map(Reconciled::Put);
    Ok(settle(
        &ctx,
        ResourceKind::Pool,
        &name,
        outcome,
        Action::await_change(),
    ))
}

/// Deletes from the gateway the apps and then the pools no resource asks
/// for any more (each drains its own pods), and forgets their refusals.
async fn sweep(ctx: &Ctx) {
    let _applying = ctx.applying.lock().await;
    let apps: BTreeSet<String> = ctx.apps.state().iter().map(|a| a.name_any()).collect();
    let pools: BTreeSet<String> = ctx.pools.state().iter().map(|p| p.name_any()).collect();
    let running = ctx.gw.changes.desired_config();
    for a in running.apps.iter().filter(|a| !apps.contains(&a.name)) {
        match ctx.gw.changes.delete_app(&a.name).await {
            Ok(()) => tracing::info!(app = %a.name, "its ServingApp was deleted: drained"),
            Err(e) => {
                tracing::warn!(app = %a.name, error = %e.message, "could not delete the app of a deleted ServingApp; tried again")
            }
        }
    }
    for p in running.pools.iter().filter(|p| !pools.contains(&p.name)) {
        match ctx.gw.changes.delete_pool(&p.name).await {
            Ok(()) => tracing::info!(pool = %p.name, "its WarmPool was deleted: drained"),
            Err(e) => {
                tracing::warn!(pool = %p.name, error = %e.message, "could not delete the pool of a deleted WarmPool; tried again")
            }
        }
    }
    ctx.refused.lock().retain(|(kind, name), _| match kind {
        ResourceKind::App => apps.contains(name),
        ResourceKind::Pool => pools.contains(name),
    });
}
