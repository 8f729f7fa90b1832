//! The autoscale tick: once a second, every app revision's autoscaler and
//! every pool's policy are asked for a replica count, and the pool manager
//! is told; the gauges users chart are set on the way.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use tokio::task::JoinHandle;
use warmgate_pool::TargetStatus;

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
        loop {
            tick.tick().await;
            if gw.draining.load(Ordering::Acquire) {
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
                record_replica_metrics(&gw.pool.status(), AUTOSCALE_TICK);
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
                let name = served.name.clone();
                engine_gauges(served, &name);
                metrics::gauge!("warmgate_replicas_desired", "app" => name.clone())
                    .set(f64::from(desired));
                metrics::gauge!("warmgate_inflight", "app" => name.clone())
                    .set(f64::from(inflight));
                metrics::gauge!("warmgate_queued", "app" => name.clone()).set(queued as f64);
                metrics::gauge!("warmgate_autoscaler_panicking", "app" => name).set(if panicking {
                    1.0
                } else {
                    0.0
                });
            }
            let instant = Instant::now();
            for p in registry.pools() {
                p.expire(instant);
                let target = p.target();
                let desired = p.desired(gw.starting(&target));
                gw.pool.scale(&target, desired);
                if let Some(od) = p.ondemand_target() {
                    gw.pool.scale(&od, p.ondemand_desired(gw.starting(&od)));
                }
                let (pending, inflight, _) = p.load();
                metrics::gauge!("warmgate_tasks_pending", "pool" => p.name.clone())
                    .set(pending as f64);
                metrics::gauge!("warmgate_tasks_inflight", "pool" => p.name.clone())
                    .set(f64::from(inflight));
                metrics::gauge!("warmgate_replicas_desired", "pool" => p.name.clone())
                    .set(f64::from(desired));
            }
            record_replica_metrics(&gw.pool.status(), AUTOSCALE_TICK);
        }
    })
}

/// Replicas by state, and replica-seconds (the GPU bill: every replica that
/// exists, starting ones included), per app and per pool. An app's
/// revisions (during a canary, say) and a pool's on-demand fallback add up
/// into their owner's series instead of overwriting each other.
fn record_replica_metrics(targets: &[TargetStatus], tick: Duration) {
    for ((label, owner), by_state) in replicas_by_owner(targets) {
        for (i, state) in REPLICA_STATES.iter().enumerate() {
            metrics::gauge!("warmgate_replicas", label => owner.to_string(), "state" => *state)
                .set(f64::from(by_state[i]));
        }
        let live = by_state[1] + by_state[2] + by_state[3];
        metrics::counter!("warmgate_replica_seconds_total", label => owner.to_string())
            .increment((f64::from(live) * tick.as_secs_f64()).round() as u64);
    }
}

/// The states `warmgate_replicas` counts, in the order of the counts below.
const REPLICA_STATES: [&str; 4] = ["pending", "starting", "ready", "draining"];

/// Replica counts by state for each owner, keyed by its label (`app` or
/// `pool`) and its name.
fn replicas_by_owner(targets: &[TargetStatus]) -> BTreeMap<(&'static str, &str), [u32; 4]> {
    let mut out: BTreeMap<(&'static str, &str), [u32; 4]> = BTreeMap::new();
    for t in targets {
        let counts = out.entry((t.id.owner_label(), t.app.as_str())).or_default();
        for r in &t.replicas {
            if let Some(i) = REPLICA_STATES.iter().position(|s| *s == r.state.name()) {
                counts[i] += 1;
            }
        }
    }
    out
}

/// `warmgate_engine_*{app}`: what the app's engines said of their load,
/// over the readings still fresh (`[apps.engine]`): requests running and
/// waiting summed, and the fullest KV cache. Nothing is set for an app
/// whose engines are not read.
fn engine_gauges(served: &crate::serving::Served, name: &str) {
    let now = std::time::Instant::now();
    let max_age = served.spec().engine.max_age;
    if served.spec().engine.metrics_path.is_none() {
        return;
    }
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
    let app = name.to_string();
    metrics::gauge!("warmgate_engine_replicas_read", "app" => app.clone()).set(f64::from(read));
    metrics::gauge!("warmgate_engine_requests_running", "app" => app.clone()).set(running as f64);
    metrics::gauge!("warmgate_engine_requests_waiting", "app" => app.clone()).set(waiting as f64);
    metrics::gauge!("warmgate_engine_kv_cache_usage_max", "app" => app).set(cache);
}
