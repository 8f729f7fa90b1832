//! What a target's actor knows ([`Shared`], one [`Slot`] per replica),
//! readable by status calls, and how a failure feeds the crash-loop
//! backoff.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

use super::{
    CRASH_LOOP_AFTER, ColdStart, STABLE_RESET, TargetHealth, TargetSpec, TargetStatus,
    crash_backoff,
};
use crate::replica::{ReplicaHandle, ReplicaState, ReplicaStatus};

/// What the actor knows, readable by status calls.
pub(super) struct Shared {
    pub(super) spec: Arc<TargetSpec>,
    pub(super) desired: u32,
    pub(super) replicas: BTreeMap<u64, Slot>,
    pub(super) consecutive_failures: u32,
    pub(super) backoff_until: Option<Instant>,
    pub(super) last_error: Option<String>,
    /// `last_error` in brief, without the worker's output.
    pub(super) last_failure: Option<String>,
    pub(super) last_failure_at_start: bool,
    /// See [`TargetHealth::crash_loop`].
    pub(super) crash_loop: bool,
    pub(super) restarts: u64,
    pub(super) last_cold_start: Option<ColdStart>,
}

pub(super) struct Slot {
    pub(super) id: String,
    pub(super) state: ReplicaState,
    pub(super) gpus: Vec<u32>,
    pub(super) created: Instant,
    pub(super) addr: Option<crate::Endpoint>,
    pub(super) pid: Option<u32>,
    pub(super) log: Option<String>,
    pub(super) handle: Option<Arc<ReplicaHandle>>,
    pub(super) stop: Option<oneshot::Sender<()>>,
}

// === impl Shared ===

impl Shared {
    pub(super) fn health(&self, now: Instant) -> TargetHealth {
        let mut h = TargetHealth::default();
        for slot in self.replicas.values() {
            match slot.state {
                ReplicaState::Ready => h.ready += 1,
                ReplicaState::Starting => h.starting += 1,
                ReplicaState::Pending { .. } => h.pending += 1,
                _ => {}
            }
        }
        h.last_error = self.last_error.clone();
        h.last_failure = self.last_failure.clone();
        h.failing_to_start = self.last_failure_at_start && self.consecutive_failures > 0;
        h.failures = self.consecutive_failures;
        h.crash_loop = self.crash_loop;
        h.retry_in = self
            .backoff_until
            .filter(|until| *until > now)
            .map(|until| until - now);
        h
    }

    pub(super) fn status(&self) -> TargetStatus {
        let now = Instant::now();
        let replicas = self
            .replicas
            .values()
            .map(|s| {
                let h = s.handle.as_ref();
                ReplicaStatus {
                    id: s.id.clone(),
                    state: s.state.clone(),
                    revision: self.spec.revision.clone(),
                    addr: s.addr.clone(),
                    pid: s.pid,
                    gpus: s.gpus.clone(),
                    inflight: h.map_or(0, |h| h.inflight()),
                    concurrency: self.spec.concurrency,
                    idle_seconds: h
                        .filter(|_| s.state == ReplicaState::Ready)
                        .map(|h| h.idle_for().as_secs_f64()),
                    age_seconds: (now - s.created).as_secs_f64(),
                    weights_version: h
                        .map(|h| h.weights_version.load(std::sync::atomic::Ordering::Relaxed)),
                    log: s.log.clone(),
                    engine: h
                        .and_then(|h| h.engine())
                        .map(|r| crate::replica::EngineStatus::of(&r, now)),
                }
            })
            .collect();
        TargetStatus {
            id: self.spec.id.clone(),
            name: self.spec.id.to_string(),
            app: self.spec.id.owner().to_string(),
            revision: self.spec.revision.clone(),
            desired: self.desired,
            replicas,
            restarts: self.restarts,
            health: self.health(now),
            last_cold_start: self.last_cold_start.clone(),
        }
    }
}

impl Shared {
    /// Counts a failure: `error` in full (for admins) and `summary`, the
    /// same without the worker's output (for the data plane).
    pub(super) fn record_failure(
        &mut self,
        error: String,
        summary: String,
        at_start: bool,
        ready_for: Duration,
    ) {
        if ready_for >= STABLE_RESET {
            self.consecutive_failures = 0;
        }
        self.consecutive_failures = self.consecutive_failures.saturating_add(1);
        self.restarts += 1;
        self.last_error = Some(error);
        self.last_failure = Some(summary);
        self.last_failure_at_start = at_start;
        let delay = crash_backoff(self.consecutive_failures);
        self.backoff_until = (!delay.is_zero()).then(|| Instant::now() + delay);
        if self.consecutive_failures >= CRASH_LOOP_AFTER && !self.crash_loop {
            self.crash_loop = true;
            tracing::warn!(
                target_name = %self.spec.id,
                failures = self.consecutive_failures,
                retry_in_s = delay.as_secs(),
                error = self.last_error.as_deref().unwrap_or_default(),
                "the target is in a crash loop (CrashLoopBackOff): requests are answered with its last error until a replica is ready"
            );
        }
    }
}
