//! A replica's lifecycle state, and the handle the gateway routes to.

use std::net::SocketAddr;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
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
    pub addr: SocketAddr,
    /// `addr` as a URI authority, built once for every request to reuse.
    pub authority: http::uri::Authority,
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
    last_active_ns: AtomicU64,
    first_forward: AtomicBool,
    idle: Notify,
}

impl ReplicaHandle {
    /// A handle for a replica that just became ready.
    pub fn new(
        id: String,
        target: warmgate_deploy::TargetId,
        revision: String,
        addr: SocketAddr,
        concurrency: u32,
        ready_at: Instant,
    ) -> Self {
        ReplicaHandle {
            id,
            target,
            revision,
            addr,
            authority: http::uri::Authority::try_from(addr.to_string().as_str())
                .expect("a socket address is a valid authority"),
            concurrency,
            ready_at,
            startup: Duration::ZERO,
            weights_version: AtomicU64::new(0),
            inflight: AtomicU32::new(0),
            routable: AtomicBool::new(true),
            last_active_ns: AtomicU64::new(now_ns()),
            first_forward: AtomicBool::new(false),
            idle: Notify::new(),
        }
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
        self.inflight() < self.concurrency
    }

    /// Whether the gateway may send it new requests.
    pub fn is_routable(&self) -> bool {
        self.routable.load(Ordering::Acquire)
    }

    /// Stops new requests from being routed to it.
    pub fn set_unroutable(&self) {
        self.routable.store(false, Ordering::Release);
        self.idle.notify_waiters();
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

    /// Waits until nothing is in flight, or `deadline` passes.
    pub async fn wait_idle(&self, deadline: tokio::time::Instant) {
        loop {
            let notified = self.idle.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.inflight() == 0 {
                return;
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
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
    pub addr: Option<SocketAddr>,
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
            "127.0.0.1:1".parse().expect("addr"),
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
