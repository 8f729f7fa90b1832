//! A pool's replicas: added (and caught up to the latest weights) and
//! removed, replaced when they fail, the on-demand replicas of an
//! interruptible pool, the replica count scaling wants, and load and status.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use warmgate_deploy::TargetId;
use warmgate_pool::ReplicaHandle;

use super::{Pool, Replacer};

impl Pool {
    /// A replica is ready. One that comes up behind the latest synced
    /// weights (it was started before the sync) is caught up in place.
    pub fn add_replica(self: &Arc<Self>, r: Arc<ReplicaHandle>) {
        self.state.lock().replicas.push(r.clone());
        self.catch_up(&r);
        self.notify();
    }

    /// Syncs `r` to the latest weights in place when it is behind them and
    /// no sync runs (a sync in progress picks it up in its next round).
    pub(crate) fn catch_up(self: &Arc<Self>, r: &Arc<ReplicaHandle>) {
        let catch_up = {
            let mut st = self.state.lock();
            let behind = r.weights_version.load(Ordering::Relaxed) < st.latest_version;
            match (st.latest_url.clone(), st.syncing_to) {
                (Some(url), None) if behind && r.is_routable() && !st.syncing.contains(&r.id) => {
                    st.syncing.insert(r.id.clone());
                    Some((url, st.latest_version))
                }
                _ => None,
            }
        };
        if let Some((url, version)) = catch_up {
            let (pool, r) = (self.clone(), r.clone());
            tokio::spawn(async move {
                let deadline = Instant::now() + pool.spec().weight_sync_timeout;
                let result = pool.sync_replica(&r, &url, version, deadline).await;
                tracing::info!(pool = %pool.name, replica = %r.id, version, ok = result.ok, "caught up a replica that started behind");
                pool.state.lock().syncing.remove(&r.id);
                pool.notify();
            });
        }
    }

    /// Whether `r` is one of its replicas.
    pub fn holds(&self, r: &Arc<ReplicaHandle>) -> bool {
        self.state.lock().replicas.iter().any(|x| Arc::ptr_eq(x, r))
    }

    /// A connection to `r` failed: out of rotation until it answers its
    /// probe (see `serving::outlier`), then what waits is woken.
    pub fn eject(self: &Arc<Self>, r: &Arc<ReplicaHandle>, cause: crate::serving::outlier::Cause) {
        let (held, back, replica) = (self.clone(), self.clone(), r.clone());
        crate::serving::outlier::eject(
            r,
            self.spec().health.clone(),
            cause,
            move || held.holds(&replica),
            move || back.notify(),
        );
    }

    /// A replica must take no more tasks.
    pub fn remove_replica(&self, r: &Arc<ReplicaHandle>) {
        self.state.lock().replicas.retain(|x| !Arc::ptr_eq(x, r));
    }

    /// How the pool gets a failed replica replaced (set once, at start).
    pub fn set_replacer(&self, f: Replacer) {
        let _ = self.replacer.set(f);
    }

    /// The target of its own replicas.
    pub fn target(&self) -> TargetId {
        TargetId::Pool(self.name.clone())
    }

    /// The pool-manager target of an interruptible pool's on-demand
    /// replicas: a task's last try, after it lost replicas to preemption,
    /// runs there, so it cannot be preempted forever.
    pub fn ondemand_target(&self) -> Option<TargetId> {
        self.spec()
            .kubernetes
            .interruptible
            .then(|| TargetId::OnDemand(self.name.clone()))
    }

    /// How the pool asks for an on-demand replica (set once, at start).
    pub fn set_ondemand_starter(&self, f: Box<dyn Fn() + Send + Sync>) {
        let _ = self.wants_ondemand.set(f);
    }

    /// How many on-demand replicas the pool wants: enough for the tasks on
    /// their last try, and idle ones kept for `idle_ttl`.
    pub fn ondemand_desired(&self, starting: u32) -> u32 {
        if self.ondemand_target().is_none() {
            return 0;
        }
        let st = self.state.lock();
        let ours: Vec<&Arc<ReplicaHandle>> = st
            .replicas
            .iter()
            .filter(|r| matches!(r.target, TargetId::OnDemand(_)))
            .collect();
        let idle: Vec<Duration> = ours
            .iter()
            .filter(|r| r.is_routable())
            .map(|r| r.idle_for())
            .collect();
        let inflight: u32 = ours.iter().map(|r| r.inflight()).sum();
        warmgate_autoscaler::pool::pool_desired(
            &warmgate_autoscaler::pool::PoolScaling {
                min: 0,
                max: self.spec().replicas[1].max(1),
                concurrency: self.spec().concurrency,
                idle_ttl: self.spec().idle_ttl,
                buffer: 0,
            },
            &warmgate_autoscaler::pool::PoolLoad {
                pending: st.fallback.len(),
                inflight,
                starting,
                idle: &idle,
            },
        )
    }

    /// (pending, in flight, ready replicas).
    pub fn load(&self) -> (usize, u32, usize) {
        let st = self.state.lock();
        (st.queue.pending(), st.inflight, st.replicas.len())
    }

    /// Status for `/v1/status`.
    pub fn status(&self) -> crate::status::PoolStatus {
        let st = self.state.lock();
        crate::status::PoolStatus {
            name: self.name.clone(),
            pending: st.queue.pending(),
            inflight: st.inflight,
            ready: st.replicas.len(),
            min: self.spec().replicas[0],
            max: self.spec().replicas[1],
            concurrency: self.spec().concurrency,
            weights_version: st.latest_version,
            syncing_to: st.syncing_to,
            max_staleness: self.spec().max_staleness,
            ondemand_waiting: st.fallback.len(),
            suspended: st.suspended,
            requests_waiting: st.requests_waiting,
            requests_inflight: st.requests_inflight,
            pool: None,
            ondemand: None,
        }
    }

    /// Whether more tasks wait than the ready replicas have free slots.
    pub fn queued_beyond_free_slots(&self) -> bool {
        let st = self.state.lock();
        let spot = st
            .replicas
            .iter()
            .filter(|r| matches!(r.target, TargetId::Pool(_)))
            .count();
        let slots = spot as u64 * u64::from(self.spec().concurrency);
        let waiting = (st.queue.pending() + st.requests_waiting) as u64;
        waiting > slots.saturating_sub(u64::from(st.inflight + st.requests_inflight))
    }

    /// The replica count the pool wants now, by the warm-pool policy:
    /// enough slots for its queued tasks, `buffer` spare, and idle replicas
    /// stopped after `idle_ttl`, never below `min`. `starting` counts the
    /// replicas started and not ready yet.
    pub fn desired(&self, starting: u32) -> u32 {
        let mut st = self.state.lock();
        let idle: Vec<Duration> = st
            .replicas
            .iter()
            .filter(|r| r.is_routable() && matches!(r.target, TargetId::Pool(_)))
            .map(|r| r.idle_for())
            .collect();
        let spec = self.spec();
        let cfg = warmgate_autoscaler::pool::PoolScaling {
            min: spec.replicas[0],
            max: spec.replicas[1],
            concurrency: spec.concurrency,
            idle_ttl: spec.idle_ttl,
            buffer: spec.buffer,
        };
        // Scaling sees both kinds of work: the tasks and the requests of
        // the app the pool serves.
        let load = warmgate_autoscaler::pool::PoolLoad {
            pending: st.queue.pending() + st.requests_waiting,
            inflight: st.inflight + st.requests_inflight,
            starting,
            idle: &idle,
        };
        let suspended =
            warmgate_autoscaler::pool::suspended(spec.suspend_after, st.suspended, &load);
        if suspended && !st.suspended {
            tracing::info!(pool = %self.name, after = ?spec.suspend_after, "pool idle: stopping every replica until a task comes");
        }
        st.suspended = suspended;
        if suspended {
            return 0;
        }
        warmgate_autoscaler::pool::pool_desired(&cfg, &load)
    }
}
