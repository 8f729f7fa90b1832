//! The pool manager: one actor task per target brings its replicas to the
//! desired count.
//!
//! The actor owns every decision (start, stop, which replica, when to retry).
//! Each replica has a task of its own that only drives the process through
//! its life (spawn, probe, watch, stop) and reports back on a bounded channel.

mod actor;
mod lifecycle;
mod state;
mod types;

pub use types::{ColdStart, ReplicaCounts, TargetHealth, TargetSpec, TargetStatus};

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Mutex, RwLock};
use tokio::sync::{Notify, mpsc, watch};
use tokio::task::JoinHandle;
use warmgate_deploy::TargetId;

use crate::Error;
use crate::backend::Backend;
use crate::gpu::GpuInventory;
use crate::probe::Prober;
use crate::replica::{ReplicaHandle, ReplicaState};

use actor::{Actor, Event};
use lifecycle::launch_for;
use state::Shared;

/// A replica that stayed ready this long before it crashed resets the
/// crash-loop backoff: it was a one-off, not a loop.
const STABLE_RESET: Duration = Duration::from_secs(10);
/// First delay of the crash-loop backoff (after the second failure in a row).
const BACKOFF_BASE: Duration = Duration::from_millis(500);
/// Cap of the crash-loop backoff, Kubernetes' own: a broken worker that
/// something keeps asking for is retried every five minutes.
const BACKOFF_CAP: Duration = Duration::from_secs(300);
/// Failures in a row after which a target is in a crash loop (Kubernetes'
/// `CrashLoopBackOff`): callers stop waiting for it and are told why.
pub const CRASH_LOOP_AFTER: u32 = 5;
/// Events in flight from replica tasks to their actor; a replica sends a
/// handful in its life, so this only fills if the actor is stuck.
const EVENT_QUEUE: usize = 256;

/// Where the pool manager tells the gateway what may take traffic.
pub trait ReplicaSink: Send + Sync + 'static {
    /// A replica answers `/healthz` and may take traffic now.
    fn replica_ready(&self, replica: Arc<ReplicaHandle>);
    /// A replica must take no new traffic (it is draining, or gone).
    fn replica_removed(&self, replica: &Arc<ReplicaHandle>);
    /// A replica failed to start; `health` is the target's state after it.
    fn start_failed(&self, target: &TargetId, error: &Error, health: &TargetHealth);
    /// Environment of one replica's own, added to its target's `env` as it
    /// launches (a credential minted for that replica alone).
    fn replica_env(&self, _spec: &TargetSpec, _replica: &str) -> BTreeMap<String, String> {
        BTreeMap::new()
    }
    /// A launched replica has ended, however it ended (stopped, crashed,
    /// failed to start): what was made for it alone can go.
    fn replica_ended(&self, _replica: &str) {}
    /// A replica an earlier run left was taken over, with the environment
    /// it was started with: what [`ReplicaSink::replica_env`] made for it
    /// then (its weights token) is honoured again.
    fn replica_adopted(&self, _spec: &TargetSpec, _replica: &str, _env: &BTreeMap<String, String>) {
    }
}

/// Keeps targets at their desired replica counts.
#[derive(Clone)]
pub struct PoolManager {
    inner: Arc<Inner>,
}

struct Inner {
    backend: Arc<dyn Backend>,
    sink: Arc<dyn ReplicaSink>,
    gpus: Mutex<GpuInventory>,
    gpu_freed: Notify,
    prober: Prober,
    targets: RwLock<HashMap<TargetId, Target>>,
    /// This gateway's part of every replica's concurrency.
    share: Arc<crate::replica::Share>,
    /// The app replicas' handles made, while anything holds them (their
    /// requests in flight included).
    shared_handles: Mutex<Vec<std::sync::Weak<ReplicaHandle>>>,
}

struct Target {
    desired: watch::Sender<u32>,
    events: mpsc::Sender<Event>,
    shutdown: watch::Sender<bool>,
    shared: Arc<Mutex<Shared>>,
    task: Mutex<Option<JoinHandle<()>>>,
    /// Its actor until first asked for a replica, and the runtime it was
    /// added in, where it will run: a target at zero since it was added
    /// has nothing to do, and 10,000 apps at `min = 0` need no 10,000
    /// tasks (nor their memory) to start.
    idle: Mutex<Option<(Actor, tokio::runtime::Handle)>>,
}

impl Target {
    /// Runs the target's actor, if it does not run yet (from any thread:
    /// it runs on the runtime the target was added in).
    fn wake(&self) {
        if let Some((actor, runtime)) = self.idle.lock().take() {
            *self.task.lock() = Some(runtime.spawn(actor.run()));
        }
    }
}

// === impl PoolManager ===

impl PoolManager {
    /// A pool manager with this backend, these local GPU ids, telling `sink`
    /// about replicas.
    pub fn new(backend: Arc<dyn Backend>, gpus: Vec<u32>, sink: Arc<dyn ReplicaSink>) -> Self {
        PoolManager {
            inner: Arc::new(Inner {
                backend,
                sink,
                gpus: Mutex::new(GpuInventory::new(gpus)),
                gpu_freed: Notify::new(),
                prober: Prober::new(),
                targets: RwLock::new(HashMap::new()),
                share: Arc::new(crate::replica::Share::default()),
                shared_handles: Mutex::new(Vec::new()),
            }),
        }
    }

    /// How this gateway splits every replica's `concurrency` with the
    /// others that serve the same replicas (one gateway, all of it, until
    /// told otherwise).
    pub fn share(&self) -> &Arc<crate::replica::Share> {
        &self.inner.share
    }

    /// Every app replica's handle still held: ready, draining, or with a
    /// request in flight after it left its target.
    pub fn shared_handles(&self) -> Vec<Arc<ReplicaHandle>> {
        let mut v = self.inner.shared_handles.lock();
        v.retain(|w| w.strong_count() > 0);
        v.iter().filter_map(std::sync::Weak::upgrade).collect()
    }

    /// Starts managing a target, at zero replicas; its actor runs from the
    /// first time a replica is asked for. Must be called from within a
    /// tokio runtime.
    pub fn add_target(&self, spec: TargetSpec) {
        let (desired_tx, desired_rx) = watch::channel(0);
        let (shutdown_tx, shutdown_rx) = watch::channel(false);
        let (ev_tx, ev_rx) = mpsc::channel(EVENT_QUEUE);
        let ev_tx_for_target = ev_tx.clone();
        let name = spec.id.clone();
        let shared = Arc::new(Mutex::new(Shared {
            spec: Arc::new(spec),
            desired: 0,
            replicas: BTreeMap::new(),
            consecutive_failures: 0,
            backoff_until: None,
            last_error: None,
            last_failure: None,
            last_failure_at_start: false,
            crash_loop: false,
            restarts: 0,
            last_cold_start: None,
        }));
        let actor = Actor {
            inner: self.inner.clone(),
            shared: shared.clone(),
            desired_rx,
            shutdown_rx,
            ev_tx,
            ev_rx,
            next_seq: std::cell::Cell::new(1),
            shutting_down: false,
        };
        self.inner.targets.write().insert(
            name,
            Target {
                desired: desired_tx,
                events: ev_tx_for_target,
                shutdown: shutdown_tx,
                shared,
                task: Mutex::new(None),
                idle: Mutex::new(Some((actor, tokio::runtime::Handle::current()))),
            },
        );
    }

    /// Asks for `n` replicas of `target`. Returns false for an unknown target.
    pub fn scale(&self, target: &TargetId, n: u32) -> bool {
        match self.inner.targets.read().get(target) {
            Some(t) => {
                if n > 0 {
                    t.wake();
                }
                t.desired.send_if_modified(|cur| {
                    let changed = *cur != n;
                    *cur = n;
                    changed
                });
                true
            }
            None => false,
        }
    }

    /// Changes how the target's *next* replicas start (their environment,
    /// checkpoint or revision); running replicas are left alone. Returns
    /// false for an unknown target.
    pub fn update_target(&self, target: &TargetId, f: impl FnOnce(&mut TargetSpec)) -> bool {
        let targets = self.inner.targets.read();
        let Some(t) = targets.get(target) else {
            return false;
        };
        let mut shared = t.shared.lock();
        let mut spec = (*shared.spec).clone();
        f(&mut spec);
        shared.spec = Arc::new(spec);
        true
    }

    /// Stops one replica (drain, SIGTERM, grace, SIGKILL) and starts a fresh
    /// one in its place, from the target's current spec. Returns false when
    /// the target is unknown or its actor is too busy to take the request.
    pub fn replace(&self, target: &TargetId, replica: &str, reason: &str) -> bool {
        let targets = self.inner.targets.read();
        let Some(t) = targets.get(target) else {
            return false;
        };
        t.wake();
        t.events
            .try_send(Event::Replace {
                id: replica.to_string(),
                reason: reason.to_string(),
            })
            .is_ok()
    }

    /// Stops every replica of `target` (drain, SIGTERM, grace, SIGKILL)
    /// and forgets the target. Returns once they are gone; false for an
    /// unknown target.
    pub async fn remove_target(&self, target: &TargetId) -> bool {
        let task = {
            let Some(t) = self.inner.targets.write().remove(target) else {
                return false;
            };
            let _ = t.shutdown.send(true);
            t.task.lock().take()
        };
        if let Some(task) = task
            && let Err(e) = task.await
        {
            tracing::error!(%target, error = %e, "pool manager task failed");
        }
        true
    }

    /// Whether a target, of any kind, is shown under `name`: its replicas'
    /// ids and pods would collide with another's of the same name.
    pub fn has_target_named(&self, name: &str) -> bool {
        self.inner
            .targets
            .read()
            .keys()
            .any(|t| t.to_string() == name)
    }

    /// How many replicas an earlier run left that this target could take
    /// over (the Kubernetes backend after a failover): its owner scales it
    /// to at least that, so they stay warm instead of being replaced.
    pub fn adoptable(&self, target: &TargetId) -> u32 {
        let spec = match self.inner.targets.read().get(target) {
            Some(t) => t.shared.lock().spec.clone(),
            None => return 0,
        };
        let launch = launch_for(&spec, String::new(), Vec::new());
        u32::try_from(self.inner.backend.adoptable(&launch)).unwrap_or(u32::MAX)
    }

    /// A replica's weights are about to be swapped in place (see
    /// [`crate::Backend::weights_swapped`]).
    pub async fn weights_swapped(&self, replica: &str) -> std::result::Result<(), String> {
        self.inner.backend.weights_swapped(replica).await
    }

    /// The replica count last asked for.
    pub fn desired(&self, target: &TargetId) -> Option<u32> {
        self.inner
            .targets
            .read()
            .get(target)
            .map(|t| *t.desired.borrow())
    }

    /// A target's health in brief.
    pub fn health(&self, target: &TargetId) -> Option<TargetHealth> {
        let targets = self.inner.targets.read();
        let t = targets.get(target)?;
        let s = t.shared.lock();
        Some(s.health(Instant::now()))
    }

    /// Replicas of a target started and not ready yet, or waiting for
    /// GPUs (0 for an unknown target): what a scale-up already has coming.
    pub fn starting(&self, target: &TargetId) -> u32 {
        self.health(target)
            .map_or(0, |h| (h.starting + h.pending) as u32)
    }

    /// Every target's status, by name.
    pub fn status(&self) -> Vec<TargetStatus> {
        let targets = self.inner.targets.read();
        let mut out: Vec<TargetStatus> =
            targets.values().map(|t| t.shared.lock().status()).collect();
        out.sort_by(|a, b| a.name.cmp(&b.name));
        // A replica the backend cannot place yet (an unschedulable pod)
        // shows as pending, with the backend's reason.
        for t in &mut out {
            let mut pending = 0;
            for r in &mut t.replicas {
                if r.state == ReplicaState::Starting
                    && let Some(reason) = self.inner.backend.pending_reason(&r.id)
                {
                    r.state = ReplicaState::Pending { reason };
                    pending += 1;
                }
            }
            t.health.starting = t.health.starting.saturating_sub(pending);
            t.health.pending += pending;
        }
        out
    }

    /// Each target's replicas by state, as [`PoolManager::status`] counts
    /// them (a replica the backend cannot place yet is pending), without
    /// building the rest of the status.
    pub fn replica_counts(&self) -> Vec<(TargetId, ReplicaCounts)> {
        let targets = self.inner.targets.read();
        targets
            .iter()
            .map(|(id, t)| {
                let mut counts = ReplicaCounts::default();
                for slot in t.shared.lock().replicas.values() {
                    match &slot.state {
                        ReplicaState::Pending { .. } => counts.pending += 1,
                        ReplicaState::Starting
                            if self.inner.backend.pending_reason(&slot.id).is_some() =>
                        {
                            counts.pending += 1;
                            counts.unschedulable += 1;
                        }
                        ReplicaState::Starting => counts.starting += 1,
                        ReplicaState::Ready => counts.ready += 1,
                        ReplicaState::Draining => counts.draining += 1,
                        ReplicaState::Stopped => {}
                    }
                }
                (id.clone(), counts)
            })
            .collect()
    }

    /// Stops every replica (drain, SIGTERM, grace, SIGKILL) and waits until
    /// all are gone.
    pub async fn shutdown(&self) {
        let tasks: Vec<JoinHandle<()>> = {
            let targets = self.inner.targets.read();
            targets
                .values()
                .filter_map(|t| {
                    let _ = t.shutdown.send(true);
                    t.task.lock().take()
                })
                .collect()
        };
        for t in tasks {
            if let Err(e) = t.await {
                tracing::error!(error = %e, "pool manager task failed");
            }
        }
    }
}

/// Delay before the next start after `failures` failures in a row: none
/// after the first (a one-off crash is replaced at once), then doubling from
/// [`BACKOFF_BASE`] up to [`BACKOFF_CAP`].
pub(crate) fn crash_backoff(failures: u32) -> Duration {
    if failures <= 1 {
        return Duration::ZERO;
    }
    BACKOFF_BASE
        .saturating_mul(1u32 << (failures - 2).min(16))
        .min(BACKOFF_CAP)
}

#[cfg(test)]
mod tests;
