//! A replica's lifecycle state, and the handle the gateway routes to.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use serde::Serialize;
use tokio::sync::Notify;

/// Where a replica is in its life.
///
/// ```text
/// Pending ──▶ Starting ──▶ Ready ──▶ Draining ──▶ Stopped
///    │            │                                  ▲
///    └────────────┴──────────────────────────────────┘
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "state", rename_all = "snake_case")]
pub enum ReplicaState {
    /// Waiting for resources (GPUs); `reason` says which.
    Pending {
        /// Why the replica cannot start yet.
        reason: String,
    },
    /// The process runs and is being probed until it answers `/healthz`.
    Starting,
    /// It answers `/healthz` and takes traffic.
    Ready,
    /// It takes no new traffic and finishes what it has.
    Draining,
    /// It is gone.
    Stopped,
}

/// What can happen to a replica.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Transition {
    /// Its resources were granted and its process was started.
    Launched,
    /// It answered `/healthz` with 200.
    BecameReady,
    /// It was asked to stop.
    Drain,
    /// Its process is gone (exited, crashed, killed or never started).
    Exited,
}

impl ReplicaState {
    /// The state after `t`, or `None` when `t` cannot happen in this state.
    pub fn next(&self, t: &Transition) -> Option<ReplicaState> {
        use ReplicaState::*;
        match (self, t) {
            (Pending { .. }, Transition::Launched) => Some(Starting),
            (Starting, Transition::BecameReady) => Some(Ready),
            (Pending { .. } | Starting | Ready, Transition::Drain) => Some(Draining),
            (Stopped, _) => None,
            (_, Transition::Exited) => Some(Stopped),
            _ => None,
        }
    }

    /// A short name for tables and metric labels.
    pub fn name(&self) -> &'static str {
        match self {
            ReplicaState::Pending { .. } => "pending",
            ReplicaState::Starting => "starting",
            ReplicaState::Ready => "ready",
            ReplicaState::Draining => "draining",
            ReplicaState::Stopped => "stopped",
        }
    }
}

/// A ready replica, shared between the pool manager and the gateway.
///
/// The gateway counts requests in flight on it; the pool manager reads those
/// counts to pick the replica idle longest and to drain before stopping.
#[derive(Debug)]
pub struct ReplicaHandle {
    /// Unique id, e.g. `minilm-3`.
    pub id: String,
    /// The target it belongs to.
    pub target: warmgate_deploy::TargetId,
    /// The revision it serves.
    pub revision: String,
    /// Where it listens.
    pub addr: crate::Endpoint,
    /// `id` as a header value, built once: every answer names the replica
    /// that gave it. `None` if the id cannot be a header value.
    pub id_header: Option<http::HeaderValue>,
    /// Concurrency limit of this replica.
    pub concurrency: u32,
    /// When `/healthz` first answered 200.
    pub ready_at: Instant,
    /// From asking the backend to start it until it was ready: the
    /// measured cold start the autoscaler plans with.
    pub startup: Duration,
    /// Weights version reported by `/healthz`, if any.
    pub weights_version: AtomicU64,
    inflight: AtomicU32,
    routable: AtomicBool,
    /// Its connection failed (refused, or broken before the answer ended)
    /// and it has not answered a probe since.
    ejected: AtomicBool,
    last_active_ns: AtomicU64,
    first_forward: AtomicBool,
    idle: Notify,
    share: Arc<Share>,
    /// Which gateway gets the remainder of the split for this replica.
    salt: u32,
    /// Its requests in flight at the other gateways serving it.
    elsewhere: parking_lot::Mutex<Elsewhere>,
    /// What its engine last said of its load (`[apps.engine]`).
    engine: parking_lot::Mutex<Option<crate::engine::EngineReading>>,
}

/// A replica's requests at the other gateways, as they last reported.
#[derive(Debug, Default, Clone, Copy)]
struct Elsewhere {
    inflight: u32,
    /// What the other gateways knew when they counted: the time the
    /// oldest replica list any of them had applied was made (`None`: no
    /// other gateway reports).
    as_of: Option<Instant>,
    /// When it was taken out of rotation.
    drained_at: Option<Instant>,
    /// When that was set.
    set_at: Option<Instant>,
}

/// Counts from the other gateways older than this are not waited for:
/// they stopped reporting (they went, or this gateway stops).
pub const ELSEWHERE_STALE: Duration = Duration::from_secs(5);

/// How many gateways serve the same replicas and which of them this one
/// is. Each allows only its part of a replica's `concurrency` in flight,
/// so the per-replica limit holds in total, as Knative's activators split
/// a revision's capacity between them.
#[derive(Debug)]
pub struct Share {
    /// `index << 32 | count`, read on every request.
    packed: AtomicU64,
}

impl Default for Share {
    fn default() -> Self {
        Share {
            packed: AtomicU64::new(1),
        }
    }
}

impl Share {
    /// This gateway is number `index` (from 0) of `count`.
    pub fn set(&self, index: u32, count: u32) {
        let count = count.max(1);
        let index = index.min(count - 1);
        self.packed
            .store(u64::from(index) << 32 | u64::from(count), Ordering::Release);
    }

    /// (index, count).
    pub fn get(&self) -> (u32, u32) {
        let v = self.packed.load(Ordering::Acquire);
        ((v >> 32) as u32, (v as u32).max(1))
    }
}

/// Gateway `index`'s part of a replica's `concurrency` when `count`
/// gateways serve it: an even split, the remainder going one each to a
/// run of gateways that starts at `salt`, so the parts add up to
/// `concurrency` exactly and different replicas favour different
/// gateways. A part may be 0: that gateway sends the replica nothing, and
/// its waiting requests ask for more replicas.
pub fn part_of(concurrency: u32, index: u32, count: u32, salt: u32) -> u32 {
    let count = count.max(1);
    let rest = concurrency % count;
    let pos = (u64::from(index) + u64::from(salt)) % u64::from(count);
    concurrency / count + u32::from(pos < u64::from(rest))
}

/// Where the run of gateways that get the remainder of a replica's split
/// starts: from its address, the same in every gateway.
pub fn salt_of(addr: &crate::Endpoint) -> u32 {
    use std::hash::{Hash as _, Hasher as _};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    addr.hash(&mut h);
    h.finish() as u32
}

impl ReplicaHandle {
    /// A handle for a replica that just became ready.
    pub fn new(
        id: String,
        target: warmgate_deploy::TargetId,
        revision: String,
        addr: crate::Endpoint,
        concurrency: u32,
        ready_at: Instant,
    ) -> Self {
        let id_header = http::HeaderValue::from_str(&id).ok();
        ReplicaHandle {
            id,
            target,
            revision,
            addr,
            id_header,
            concurrency,
            ready_at,
            startup: Duration::ZERO,
            weights_version: AtomicU64::new(0),
            inflight: AtomicU32::new(0),
            routable: AtomicBool::new(true),
            ejected: AtomicBool::new(false),
            last_active_ns: AtomicU64::new(now_ns()),
            first_forward: AtomicBool::new(false),
            idle: Notify::new(),
            share: Arc::new(Share::default()),
            salt: 0,
            elsewhere: parking_lot::Mutex::new(Elsewhere::default()),
            engine: parking_lot::Mutex::new(None),
        }
    }

    /// Notes what its engine said of its load, unless a newer reading is
    /// already there (two reads may answer out of order).
    pub fn set_engine(&self, reading: crate::engine::EngineReading) {
        let mut e = self.engine.lock();
        if e.is_none_or(|old| old.at <= reading.at) {
            *e = Some(reading);
        }
    }

    /// Its engine's last reading, if any was taken.
    pub fn engine(&self) -> Option<crate::engine::EngineReading> {
        *self.engine.lock()
    }

    /// The same handle, its limit split as `share` says between the
    /// gateways that serve it. Which gateway gets the remainder follows
    /// from the replica's address, which every gateway knows it by.
    pub fn with_share(mut self, share: Arc<Share>) -> Self {
        self.salt = salt_of(&self.addr);
        self.share = share;
        self
    }

    /// How many requests this gateway may have in flight on it: its part
    /// of `concurrency`.
    pub fn limit(&self) -> u32 {
        let (index, count) = self.share.get();
        part_of(self.concurrency, index, count, self.salt)
    }

    /// The same handle with its measured cold start.
    pub fn with_startup(mut self, startup: Duration) -> Self {
        self.startup = startup;
        self
    }

    /// Requests in flight on this replica.
    pub fn inflight(&self) -> u32 {
        self.inflight.load(Ordering::Acquire)
    }

    /// Whether it has a free slot.
    pub fn has_free_slot(&self) -> bool {
        self.inflight() < self.limit()
    }

    /// Whether the gateway may send it new requests: it is not draining,
    /// and not ejected for a failed connection.
    pub fn is_routable(&self) -> bool {
        self.routable.load(Ordering::Acquire) && !self.ejected.load(Ordering::Acquire)
    }

    /// A connection to it failed: no request is routed to it until
    /// [`ReplicaHandle::readmit`]. Returns whether this call ejected it
    /// (it was not out already).
    pub fn eject(&self) -> bool {
        !self.ejected.swap(true, Ordering::AcqRel)
    }

    /// It answered its probe after it was ejected: routable again (unless
    /// it drains).
    pub fn readmit(&self) {
        self.ejected.store(false, Ordering::Release);
    }

    /// Whether it is ejected (see [`ReplicaHandle::eject`]).
    pub fn is_ejected(&self) -> bool {
        self.ejected.load(Ordering::Acquire)
    }

    /// Stops new requests from being routed to it.
    pub fn set_unroutable(&self) {
        self.routable.store(false, Ordering::Release);
        self.elsewhere
            .lock()
            .drained_at
            .get_or_insert_with(Instant::now);
        self.idle.notify_waiters();
    }

    /// The other gateways have `inflight` requests on it, counted when
    /// each had applied a replica list made at `as_of` or later (`None`:
    /// no other gateway serves it).
    pub fn set_elsewhere(&self, inflight: u32, as_of: Option<Instant>) {
        {
            let mut e = self.elsewhere.lock();
            e.inflight = inflight;
            e.as_of = as_of;
            e.set_at = Some(Instant::now());
        }
        self.idle.notify_waiters();
    }

    /// Whether the other gateways have nothing on it: none serves it, they
    /// stopped reporting, or each counted nothing on it after applying a
    /// replica list made after it left rotation (so none sends it more).
    fn idle_elsewhere(&self) -> bool {
        let e = *self.elsewhere.lock();
        if e.set_at.is_none_or(|t| t.elapsed() > ELSEWHERE_STALE) {
            return true;
        }
        match (e.as_of, e.drained_at) {
            (None, _) => true,
            (Some(knew), Some(drained)) => e.inflight == 0 && knew > drained,
            (Some(_), None) => e.inflight == 0,
        }
    }

    /// Counts one more request in flight. The caller enforces the limit.
    pub fn acquire(&self) {
        self.inflight.fetch_add(1, Ordering::AcqRel);
        self.last_active_ns.store(now_ns(), Ordering::Relaxed);
    }

    /// Counts one request less; wakes a drain that waits for zero.
    pub fn release(&self) {
        let before = self.inflight.fetch_sub(1, Ordering::AcqRel);
        debug_assert!(before > 0, "release without acquire");
        self.last_active_ns.store(now_ns(), Ordering::Relaxed);
        if before == 1 {
            self.idle.notify_waiters();
        }
    }

    /// How long it has had nothing in flight (zero while busy).
    pub fn idle_for(&self) -> Duration {
        if self.inflight() > 0 {
            return Duration::ZERO;
        }
        let last = self.last_active_ns.load(Ordering::Relaxed);
        Duration::from_nanos(now_ns().saturating_sub(last))
    }

    /// True exactly once: for the first request forwarded to it. The gateway
    /// uses it to measure its own share of a cold start.
    pub fn take_first_forward(&self) -> bool {
        !self.first_forward.swap(true, Ordering::AcqRel)
    }

    /// Waits until nothing is in flight, here or at the other gateways
    /// serving it, or `deadline` passes. Looks again at least every
    /// second, so counts from gateways that stopped reporting go stale.
    pub async fn wait_idle(&self, deadline: tokio::time::Instant) {
        loop {
            let notified = self.idle.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.inflight() == 0 && self.idle_elsewhere() {
                return;
            }
            let wake = deadline.min(tokio::time::Instant::now() + Duration::from_secs(1));
            if tokio::time::timeout_at(wake, notified).await.is_err()
                && tokio::time::Instant::now() >= deadline
            {
                return;
            }
        }
    }
}

/// One replica in a status report.
#[derive(Debug, Clone, Serialize)]
pub struct ReplicaStatus {
    /// Unique id.
    pub id: String,
    /// Lifecycle state.
    #[serde(flatten)]
    pub state: ReplicaState,
    /// Revision served.
    pub revision: String,
    /// Where it listens, once started.
    pub addr: Option<crate::Endpoint>,
    /// Process id (local backend).
    pub pid: Option<u32>,
    /// GPUs assigned.
    pub gpus: Vec<u32>,
    /// Requests in flight.
    pub inflight: u32,
    /// Concurrency limit.
    pub concurrency: u32,
    /// Seconds with nothing in flight (ready replicas only).
    pub idle_seconds: Option<f64>,
    /// Seconds since the replica was created.
    pub age_seconds: f64,
    /// Weights version reported by the worker.
    pub weights_version: Option<u64>,
    /// Where its stdout and stderr go.
    pub log: Option<String>,
    /// What its engine last said of its load (`[apps.engine]`), with the
    /// reading's age; absent when never read.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub engine: Option<EngineStatus>,
}

/// An engine's last reading as `status` shows it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct EngineStatus {
    /// Requests it runs.
    pub running: Option<u32>,
    /// Requests waiting in its own queue.
    pub waiting: Option<u32>,
    /// Its KV cache's fill, 0 to 1.
    pub kv_cache_usage: Option<f64>,
    /// Seconds since it was read.
    pub age_seconds: f64,
}

impl EngineStatus {
    /// The status of `reading` at `now`.
    pub fn of(reading: &crate::engine::EngineReading, now: Instant) -> Self {
        EngineStatus {
            running: reading.load.running,
            waiting: reading.load.waiting,
            kv_cache_usage: reading.load.kv_cache_usage,
            age_seconds: now.saturating_duration_since(reading.at).as_secs_f64(),
        }
    }
}

/// Nanoseconds since the first call in this process: a monotonic clock that
/// fits in an atomic.
fn now_ns() -> u64 {
    static BASE: OnceLock<Instant> = OnceLock::new();
    let base = *BASE.get_or_init(Instant::now);
    u64::try_from(base.elapsed().as_nanos()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_parts_of_a_replica_s_limit_add_up_to_it_whoever_gets_the_rest() {
        for concurrency in 0..12u32 {
            for count in 1..6u32 {
                for salt in [0u32, 1, 7, u32::MAX] {
                    let parts: Vec<u32> = (0..count)
                        .map(|i| part_of(concurrency, i, count, salt))
                        .collect();
                    assert_eq!(parts.iter().sum::<u32>(), concurrency, "{parts:?}");
                    let (lo, hi) = (parts.iter().min().unwrap(), parts.iter().max().unwrap());
                    assert!(hi - lo <= 1, "an even split: {parts:?}");
                }
            }
        }
        // One gateway has it all.
        assert_eq!(part_of(8, 0, 1, 3), 8);
    }

    /// A handle of `m-00001` at 127.0.0.1:1.
    fn revision_handle(id: &str, concurrency: u32) -> ReplicaHandle {
        ReplicaHandle::new(
            id.into(),
            warmgate_deploy::TargetId::Revision {
                app: "m".into(),
                seq: 1,
            },
            "m-00001".into(),
            "127.0.0.1:1".parse().unwrap(),
            concurrency,
            Instant::now(),
        )
    }

    #[test]
    fn a_drain_waits_for_the_other_gateways_to_count_nothing_on_it_after_they_knew() {
        let h = revision_handle("m-1", 2);
        assert!(h.idle_elsewhere(), "no other gateway: nothing to wait for");
        let before = Instant::now();
        std::thread::sleep(Duration::from_millis(2));
        h.set_unroutable();
        h.set_elsewhere(0, Some(before));
        assert!(
            !h.idle_elsewhere(),
            "counted by a gateway that still had it in rotation"
        );
        let after = Instant::now();
        h.set_elsewhere(1, Some(after));
        assert!(!h.idle_elsewhere(), "one still runs there");
        h.set_elsewhere(0, Some(after));
        assert!(h.idle_elsewhere());
        h.set_elsewhere(0, None);
        assert!(h.idle_elsewhere(), "the others went");
    }

    #[test]
    fn a_handle_allows_only_its_gateway_s_part() {
        let share = Arc::new(Share::default());
        let h = revision_handle("m-1", 3).with_share(share.clone());
        assert_eq!(h.limit(), 3);
        let parts: Vec<u32> = (0..2)
            .map(|i| {
                share.set(i, 2);
                h.limit()
            })
            .collect();
        assert_eq!(parts.iter().sum::<u32>(), 3, "{parts:?}");
        share.set(0, 2);
        for _ in 0..h.limit() {
            assert!(h.has_free_slot());
            h.acquire();
        }
        assert!(!h.has_free_slot(), "full at its part, not at 3");
        // Another gateway may name the same replica otherwise: the parts
        // follow its address, so they still add up.
        let other = revision_handle("follower-slot-7", 3);
        let theirs = Arc::new(Share::default());
        theirs.set(1, 2);
        let other = other.with_share(theirs);
        assert_eq!(h.limit() + other.limit(), 3);
    }

    #[test]
    fn lifecycle_transitions() {
        let pending = ReplicaState::Pending {
            reason: "needs 1 GPU".into(),
        };
        let starting = pending.next(&Transition::Launched).expect("launch");
        assert_eq!(starting, ReplicaState::Starting);
        let ready = starting.next(&Transition::BecameReady).expect("ready");
        assert_eq!(ready, ReplicaState::Ready);
        assert_eq!(ready.next(&Transition::Launched), None);
        let draining = ready.next(&Transition::Drain).expect("drain");
        assert_eq!(draining.next(&Transition::BecameReady), None);
        assert_eq!(
            draining.next(&Transition::Exited),
            Some(ReplicaState::Stopped)
        );
        assert_eq!(
            ReplicaState::Starting.next(&Transition::Exited),
            Some(ReplicaState::Stopped)
        );
        assert_eq!(ReplicaState::Stopped.next(&Transition::Exited), None);
    }

    #[tokio::test]
    async fn wait_idle_returns_when_the_last_request_ends() {
        let h = std::sync::Arc::new(ReplicaHandle::new(
            "a-1".into(),
            warmgate_deploy::TargetId::Pool("a".into()),
            "a-00001".into(),
            "127.0.0.1:1".parse::<crate::Endpoint>().expect("addr"),
            2,
            Instant::now(),
        ));
        h.acquire();
        h.acquire();
        assert!(!h.has_free_slot());
        let h2 = h.clone();
        let waiter = tokio::spawn(async move {
            h2.wait_idle(tokio::time::Instant::now() + Duration::from_secs(30))
                .await;
        });
        h.release();
        assert!(!waiter.is_finished());
        h.release();
        tokio::time::timeout(Duration::from_secs(5), waiter)
            .await
            .expect("drain finished once idle")
            .expect("task");
        assert!(h.take_first_forward());
        assert!(!h.take_first_forward());
    }
}
