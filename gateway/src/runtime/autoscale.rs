//! The autoscale tick: once a second, every app revision's autoscaler and
//! every pool's policy are asked for a replica count, and the pool manager
//! is told; the gauges users chart are set on the way.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::task::JoinHandle;
use warmgate_deploy::TargetId;
use warmgate_pool::ReplicaCounts;

use crate::server::Gateway;

/// How often the autoscaler looks at demand. One second resolves the 6 s
/// panic window into six samples, as Knative's 2 s tick does for its window,
/// and keeps the policy cheap.
pub const AUTOSCALE_TICK: Duration = Duration::from_secs(1);

/// Runs the autoscaler every [`AUTOSCALE_TICK`] until aborted.
pub fn spawn(gw: &Arc<Gateway>) -> JoinHandle<()> {
    let gw = gw.clone();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(AUTOSCALE_TICK);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut gauges = Gauges::default();
        loop {
            tick.tick().await;
            gauges.round += 1;
            if gw.host.draining() {
                return;
            }
            let now = gw.now();
            let registry = gw.registry.load_full();
            gw.expire_peers();
            // A follower sizes nothing: each revision has the replicas the
            // leader lists, and what it saw goes to the leader.
            if let Some(peer) = gw.peers.follower() {
                for served in registry.apps() {
                    for app in served.live() {
                        gw.pool.scale(&app.target, peer.listed(&app.revision));
                        gw.peers
                            .note(&app.revision, app.take_reading(), app.health());
                    }
                }
                gauges.replicas(&gw.pool.replica_counts(), AUTOSCALE_TICK);
                gauges.forget_unseen();
                continue;
            }
            for served in registry.apps() {
                let (mut desired, mut inflight, mut queued) = (0u32, 0u32, 0usize);
                let mut panicking = false;
                for app in served.live() {
                    // A revision promoted in place borrows its host's
                    // target, which the host's autoscaler sizes.
                    let owns = !app.is_guest();
                    panicking |= app.tick(now, |n| {
                        if owns {
                            gw.pool.scale(&app.target, n);
                            desired += n;
                        }
                    });
                    let (i, q) = app.load();
                    inflight += i;
                    queued += q;
                }
                let g = gauges.app(served);
                if let Some(engine) = &g.engine {
                    engine.set(served);
                }
                g.desired.set(f64::from(desired));
                g.inflight.set(f64::from(inflight));
                g.queued.set(queued as f64);
                g.panicking.set(if panicking { 1.0 } else { 0.0 });
            }
            let instant = Instant::now();
            for p in registry.pools() {
                p.expire(instant);
                let target = p.target();
                let desired = p.desired(gw.pool.starting(&target));
                gw.pool.scale(&target, desired);
                if let Some(od) = p.ondemand_target() {
                    gw.pool
                        .scale(&od, p.ondemand_desired(gw.pool.starting(&od)));
                }
                let (pending, inflight, _) = p.load();
                let g = gauges.pool(&p.name);
                g.pending.set(pending as f64);
                g.inflight.set(f64::from(inflight));
                g.desired.set(f64::from(desired));
            }
            gauges.replicas(&gw.pool.replica_counts(), AUTOSCALE_TICK);
            gauges.forget_unseen();
        }
    })
}

/// The handles of the gauges the tick sets, looked up by name and labels
/// once per app, pool and owner rather than on every tick: with thousands
/// of apps the lookups were most of an idle gateway's CPU. An entry not
/// seen in a round (its app deleted) is dropped.
#[derive(Default)]
struct Gauges {
    round: u64,
    apps: HashMap<String, (u64, AppGauges)>,
    pools: HashMap<String, (u64, PoolGauges)>,
    /// By label (`app`, `pool`), then owner.
    owners: HashMap<&'static str, HashMap<String, (u64, OwnerGauges)>>,
}

/// The entry of `key`, made by `make` the first time, marked seen in
/// `round`. Looked up by `&str`: no allocation once it exists.
fn seen<'a, G>(
    map: &'a mut HashMap<String, (u64, G)>,
    key: &str,
    round: u64,
    make: impl FnOnce() -> G,
) -> &'a mut G {
    if !map.contains_key(key) {
        map.insert(key.to_string(), (round, make()));
    }
    let entry = map.get_mut(key).expect("inserted above");
    entry.0 = round;
    &mut entry.1
}

struct AppGauges {
    desired: metrics::Gauge,
    inflight: metrics::Gauge,
    queued: metrics::Gauge,
    panicking: metrics::Gauge,
    /// For an app whose engines are read (`[apps.engine] metrics_path`).
    engine: Option<EngineGauges>,
}

struct PoolGauges {
    pending: metrics::Gauge,
    inflight: metrics::Gauge,
    desired: metrics::Gauge,
}

struct OwnerGauges {
    /// `warmgate_replicas` by [`REPLICA_STATES`].
    states: [metrics::Gauge; 4],
    seconds: metrics::Counter,
    unschedulable: metrics::Gauge,
}

impl Gauges {
    fn app(&mut self, served: &crate::serving::Served) -> &AppGauges {
        let read = served.spec().engine.metrics_path.is_some();
        let g = seen(&mut self.apps, &served.name, self.round, || {
            AppGauges::new(&served.name, read)
        });
        // `[apps.engine]` changed by a reload.
        if g.engine.is_some() != read {
            g.engine = read.then(|| EngineGauges::new(&served.name));
        }
        g
    }

    fn pool(&mut self, name: &str) -> &PoolGauges {
        seen(&mut self.pools, name, self.round, || {
            let pool = || name.to_string();
            PoolGauges {
                pending: metrics::gauge!("warmgate_tasks_pending", "pool" => pool()),
                inflight: metrics::gauge!("warmgate_tasks_inflight", "pool" => pool()),
                desired: metrics::gauge!("warmgate_replicas_desired", "pool" => pool()),
            }
        })
    }

    /// Replicas by state, and replica-seconds (the GPU bill: every replica
    /// that exists, starting ones included), per app and per pool. An
    /// app's revisions (during a canary, say) and a pool's on-demand
    /// fallback add up into their owner's series instead of overwriting
    /// each other.
    fn replicas(&mut self, targets: &[(TargetId, ReplicaCounts)], tick: Duration) {
        for ((label, owner), by_state) in replicas_by_owner(targets) {
            let owners = self.owners.entry(label).or_default();
            let g = seen(owners, owner, self.round, || {
                let owner = || owner.to_string();
                OwnerGauges {
                    states: REPLICA_STATES.map(|state| {
                        metrics::gauge!("warmgate_replicas", label => owner(), "state" => state)
                    }),
                    seconds: metrics::counter!("warmgate_replica_seconds_total", label => owner()),
                    unschedulable: metrics::gauge!("warmgate_replicas_unschedulable", label => owner()),
                }
            });
            let c = by_state;
            let states = [c.pending, c.starting, c.ready, c.draining];
            for (gauge, n) in g.states.iter().zip(states) {
                gauge.set(f64::from(n));
            }
            g.unschedulable.set(f64::from(c.unschedulable));
            let live = c.starting + c.ready + c.draining;
            g.seconds
                .increment((f64::from(live) * tick.as_secs_f64()).round() as u64);
        }
    }

    /// Drops the handles of what this round did not see.
    fn forget_unseen(&mut self) {
        let round = self.round;
        self.apps.retain(|_, (seen, _)| *seen == round);
        self.pools.retain(|_, (seen, _)| *seen == round);
        for owners in self.owners.values_mut() {
            owners.retain(|_, (seen, _)| *seen == round);
        }
    }
}

impl AppGauges {
    fn new(app: &str, engine: bool) -> Self {
        let app_ = || app.to_string();
        AppGauges {
            desired: metrics::gauge!("warmgate_replicas_desired", "app" => app_()),
            inflight: metrics::gauge!("warmgate_inflight", "app" => app_()),
            queued: metrics::gauge!("warmgate_queued", "app" => app_()),
            panicking: metrics::gauge!("warmgate_autoscaler_panicking", "app" => app_()),
            engine: engine.then(|| EngineGauges::new(app)),
        }
    }
}

/// The states `warmgate_replicas` counts, in the order of
/// [`OwnerGauges::states`].
const REPLICA_STATES: [&str; 4] = ["pending", "starting", "ready", "draining"];

/// Replica counts for each owner (an app's revisions, a pool and its
/// on-demand fallback added up), keyed by its label (`app` or `pool`) and
/// its name.
fn replicas_by_owner(
    targets: &[(TargetId, ReplicaCounts)],
) -> HashMap<(&'static str, &str), ReplicaCounts> {
    let mut out: HashMap<(&'static str, &str), ReplicaCounts> = HashMap::new();
    for (id, c) in targets {
        let sum = out.entry((id.owner_label(), id.owner())).or_default();
        sum.pending += c.pending;
        sum.starting += c.starting;
        sum.ready += c.ready;
        sum.draining += c.draining;
        sum.unschedulable += c.unschedulable;
    }
    out
}

/// `warmgate_engine_*{app}`: what the app's engines said of their load,
/// over the readings still fresh (`[apps.engine]`): requests running and
/// waiting summed, and the fullest KV cache.
struct EngineGauges {
    read: metrics::Gauge,
    running: metrics::Gauge,
    waiting: metrics::Gauge,
    cache: metrics::Gauge,
}

impl EngineGauges {
    fn new(app: &str) -> Self {
        let app = || app.to_string();
        EngineGauges {
            read: metrics::gauge!("warmgate_engine_replicas_read", "app" => app()),
            running: metrics::gauge!("warmgate_engine_requests_running", "app" => app()),
            waiting: metrics::gauge!("warmgate_engine_requests_waiting", "app" => app()),
            cache: metrics::gauge!("warmgate_engine_kv_cache_usage_max", "app" => app()),
        }
    }

    fn set(&self, served: &crate::serving::Served) {
        let now = std::time::Instant::now();
        let max_age = served.spec().engine.max_age;
        let (mut running, mut waiting, mut cache, mut read) = (0u64, 0u64, 0f64, 0u32);
        for app in served.live() {
            for r in app.replicas() {
                if let Some(load) = r.engine().and_then(|e| e.fresh(now, max_age)) {
                    read += 1;
                    running += u64::from(load.running.unwrap_or(0));
                    waiting += u64::from(load.waiting.unwrap_or(0));
                    cache = cache.max(load.kv_cache_usage.unwrap_or(0.0));
                }
            }
        }
        self.read.set(f64::from(read));
        self.running.set(running as f64);
        self.waiting.set(waiting as f64);
        self.cache.set(cache);
    }
}
