//! The `/v1/status` document built: each app's figures from its
//! revisions' dispatchers and the pool manager's targets, the pools, the
//! tenants and the changes made through the API.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use warmgate_deploy::{AppSpec, TargetId};
use warmgate_pool::TargetStatus;

use crate::server::Gateway;
use crate::serving::dispatch::App;
use crate::serving::served::Served;
use crate::status::{AppStatus, GatewayStatus, PoolStatus, RevisionStatus};

/// The pool manager's targets by id: an app's status finds its own at
/// once, whatever the number of apps.
pub(crate) type Targets<'a> = HashMap<&'a TargetId, &'a TargetStatus>;

/// The index of `all`.
pub(crate) fn by_id(all: &[TargetStatus]) -> Targets<'_> {
    all.iter().map(|t| (&t.id, t)).collect()
}

impl Gateway {
    /// An app's status: the serving revision's figures at the top, every
    /// live revision with its share below.
    pub(crate) fn status_of(&self, served: &Served, targets: &Targets<'_>) -> AppStatus {
        let spec = served.spec();
        if let Some(name) = &spec.pool {
            return self.pool_app_status(served, &spec, name, targets);
        }
        let shares = served.shares();
        let serving = served.serving();
        let mut revisions = Vec::new();
        let (mut inflight, mut queued) = (0u32, 0usize);
        let live = served.live();
        for app in &live {
            let (i, q) = app.load();
            inflight += i;
            queued += q;
            let t = targets.get(&app.target).copied();
            revisions.push(revision_status(app, &live, &shares, t, (i, q)));
        }
        let (revision, ready, target, handoff, linger) = match &serving {
            Some(a) => (
                a.revision.clone(),
                a.ready_replicas(),
                targets.get(&a.target).copied(),
                a.last_handoff(),
                Some(a.scale_to_zero_after()),
            ),
            None => (String::new(), 0, None, None, None),
        };
        let promotion = served.history.lock().promotion.clone();
        let adapters = adapter_statuses(served, &spec, &live);
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
            scale_to_zero_after_s: linger
                .filter(|_| spec.autoscale.min == 0)
                .map(|d| d.as_secs_f64()),
            pool: target.cloned(),
            revisions,
            promotion,
            watch_scans: spec
                .promotion
                .watch
                .as_ref()
                .map(|_| served.watch_scans.load(Ordering::Relaxed)),
            served_by: None,
            adapters,
        }
    }

    /// The status of an app served by a pool: the pool's figures, and no
    /// revisions of its own.
    fn pool_app_status(
        &self,
        served: &Served,
        spec: &AppSpec,
        name: &str,
        targets: &Targets<'_>,
    ) -> AppStatus {
        let p = self.registry.load().pool(name).map(|p| p.status());
        let target = targets.get(&TargetId::Pool(name.to_string())).copied();
        let p = p.unwrap_or_default();
        AppStatus {
            name: served.name.clone(),
            aliases: spec.aliases.clone(),
            revision: String::new(),
            desired: target.map_or(0, |t| t.desired),
            ready: p.ready,
            inflight: p.requests_inflight,
            queued: p.requests_waiting,
            capacity: p.ready as u32 * p.concurrency,
            concurrency: p.concurrency,
            max_pending: spec.queue.max_pending,
            min: p.min,
            max: p.max,
            handoff_ms: None,
            // A pool's idle replicas go by its `idle_ttl`.
            scale_to_zero_after_s: None,
            pool: target.cloned(),
            revisions: Vec::new(),
            promotion: None,
            watch_scans: None,
            served_by: Some(name.to_string()),
            adapters: Vec::new(),
        }
    }

    pub(crate) fn status(&self) -> Vec<AppStatus> {
        let all = self.pool.status();
        self.apps_status(&by_id(&all))
    }

    /// Every app's status, in config order.
    fn apps_status(&self, targets: &Targets<'_>) -> Vec<AppStatus> {
        self.registry
            .load()
            .apps()
            .iter()
            .map(|a| self.status_of(a, targets))
            .collect()
    }

    /// The `/v1/status` document: apps, pools and tenants.
    pub fn status_report(&self) -> GatewayStatus {
        let all = self.pool.status();
        let targets = by_id(&all);
        let mut pools: Vec<PoolStatus> = self
            .registry
            .load()
            .pools()
            .map(|p| {
                let mut s = p.status();
                let target = p.target();
                s.pool = targets.get(&target).map(|t| (*t).clone());
                if let Some(od) = p.ondemand_target() {
                    s.ondemand = targets.get(&od).map(|t| (*t).clone());
                }
                s
            })
            .collect();
        pools.sort_by(|a, b| a.name.cmp(&b.name));
        // What the API changed is kept over the file at the next start.
        let api_changes = self
            .store
            .overlay()
            .map(|o| {
                let name = |kind: &str, n: &str, deleted: bool| {
                    format!("{kind} {n}{}", if deleted { " (deleted)" } else { "" })
                };
                o.apps
                    .iter()
                    .map(|(n, s)| name("app", n, s.is_none()))
                    .chain(o.pools.iter().map(|(n, s)| name("pool", n, s.is_none())))
                    .collect()
            })
            .unwrap_or_default();
        GatewayStatus {
            apps: self.apps_status(&targets),
            pools,
            api_changes,
            tenants: self
                .access
                .tenants
                .as_ref()
                .map(|t| t.status())
                .unwrap_or_default(),
        }
    }
}

/// A live revision's status: its share, and the replicas it routes to.
fn revision_status(
    app: &Arc<App>,
    live: &[Arc<App>],
    shares: &[(String, u8)],
    t: Option<&TargetStatus>,
    (inflight, queued): (u32, usize),
) -> RevisionStatus {
    // Two revisions share a target while one is promoted in place:
    // each shows the replicas it routes to, the target's own
    // revision the rest (those starting among them).
    let elsewhere: std::collections::HashSet<String> = live
        .iter()
        .filter(|o| !Arc::ptr_eq(o, app) && o.target == app.target)
        .flat_map(|o| o.replicas())
        .map(|r| r.id.clone())
        .collect();
    let own: std::collections::HashSet<String> =
        app.replicas().iter().map(|r| r.id.clone()).collect();
    let replicas = t
        .map(|t| {
            t.replicas
                .iter()
                .filter(|r| own.contains(&r.id) || (!app.is_guest() && !elsewhere.contains(&r.id)))
                .cloned()
                .collect()
        })
        .unwrap_or_default();
    RevisionStatus {
        id: app.revision.clone(),
        traffic: shares
            .iter()
            .find(|(id, _)| *id == app.revision)
            .map_or(0, |(_, p)| *p),
        ready: app.ready_replicas(),
        desired: if app.is_guest() {
            own.len() as u32
        } else {
            t.map_or(0, |t| t.desired)
        },
        inflight,
        queued,
        replicas,
    }
}

/// The status of each of an app's adapters, and of its promotion.
fn adapter_statuses(
    served: &Served,
    spec: &AppSpec,
    live: &[Arc<App>],
) -> Vec<crate::status::AdapterStatus> {
    spec.adapters
        .models
        .iter()
        .map(|a| {
            let engine = a.engine_name();
            let promotion = served.adapter_promotion(&a.name);
            crate::status::AdapterStatus {
                name: a.name.clone(),
                aliases: a.aliases.clone(),
                revision: a.revision,
                checkpoint: a.checkpoint.clone(),
                requests: served.adapter_requests(&a.name),
                replicas: live
                    .iter()
                    .flat_map(|r| r.adapter_holders(&engine))
                    .collect(),
                promotion: promotion.map(|c| {
                    let mut p = c.promotion.lock().clone();
                    if !p.phase.is_terminal() {
                        (p.answered, p.failed) = c.counts();
                    }
                    crate::status::AdapterPromotionStatus {
                        replicas: live
                            .iter()
                            .flat_map(|r| r.adapter_holders(&c.engine))
                            .collect(),
                        promotion: p,
                    }
                }),
            }
        })
        .collect()
}
