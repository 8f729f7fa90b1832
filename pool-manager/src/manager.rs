//! The pool manager: one actor task per target brings its replicas to the
//! desired count.
//!
//! The actor owns every decision (start, stop, which replica, when to retry).
//! Each replica has a task of its own that only drives the process through
//! its life (spawn, probe, watch, stop) and reports back on a bounded channel.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use parking_lot::{Mutex, RwLock};
use serde::Serialize;
use tokio::sync::{Notify, mpsc, oneshot, watch};
use tokio::task::JoinHandle;
use warmgate_deploy::TargetId;

use crate::Error;
use crate::backend::{Backend, Launch, Process};
use crate::gpu::GpuInventory;
use crate::probe::{HealthRule, ProbeResult, Prober, readiness_delay};
use crate::replica::{ReplicaHandle, ReplicaState, ReplicaStatus, Transition};

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

/// How to run the replicas of one app or pool.
#[derive(Debug, Clone)]
pub struct TargetSpec {
    /// Which replicas these are; `id.owner()` is `WARMGATE_TARGET` for
    /// its workers.
    pub id: TargetId,
    /// How readiness and liveness are probed.
    pub health: warmgate_deploy::HealthSpec,
    /// Where the engine's own load is read (apps only).
    pub engine: warmgate_deploy::EngineSpec,
    /// Revision its replicas serve.
    pub revision: String,
    /// Program and arguments.
    pub command: Vec<String>,
    /// Extra environment.
    pub env: BTreeMap<String, String>,
    /// Checkpoint URI, passed to the worker.
    pub checkpoint: Option<String>,
    /// Working directory of the workers.
    pub workdir: Option<PathBuf>,
    /// Requests in flight per replica.
    pub concurrency: u32,
    /// GPUs per replica.
    pub gpus: u32,
    /// Time allowed to become ready.
    pub startup_timeout: Duration,
    /// Time between SIGTERM and SIGKILL (also the drain budget).
    pub stop_grace: Duration,
    /// Container image (kubernetes backend).
    pub image: Option<String>,
    /// Pod placement and resources (kubernetes backend).
    pub pod: warmgate_deploy::PodSpec,
}

/// A target's replicas in brief: what the gateway needs to decide whether a
/// request can wait for capacity.
#[derive(Debug, Clone, Default, Serialize)]
pub struct TargetHealth {
    /// Replicas taking traffic.
    pub ready: usize,
    /// Replicas started and being probed.
    pub starting: usize,
    /// Replicas waiting for resources.
    pub pending: usize,
    /// Set when the target keeps failing to start and waits before the next
    /// try: how long until it (in seconds, as JSON).
    #[serde(serialize_with = "seconds")]
    pub retry_in: Option<Duration>,
    /// The last start or crash error.
    pub last_error: Option<String>,
    /// True when the latest attempts failed before becoming ready.
    pub failing_to_start: bool,
    /// Failed starts and crashes in a row.
    pub failures: u32,
    /// [`CRASH_LOOP_AFTER`] failures in a row and no replica ready since:
    /// Kubernetes' `CrashLoopBackOff`. A request or task is answered at
    /// once with `last_error` while the backoff runs, and the next start
    /// waits for one to ask again.
    pub crash_loop: bool,
}

/// A duration as a number of seconds (`1.5`), not serde's
/// `{"secs", "nanos"}`.
fn seconds<S: serde::Serializer>(d: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
    match d {
        Some(d) => s.serialize_some(&d.as_secs_f64()),
        None => s.serialize_none(),
    }
}

/// The phases of the last cold start of a target.
#[derive(Debug, Clone, Serialize)]
pub struct ColdStart {
    /// The replica that started.
    pub replica: String,
    /// Seconds from asking the backend to start the process until it ran.
    pub spawn_seconds: f64,
    /// Seconds from the process running until `/healthz` answered 200.
    pub ready_seconds: f64,
    /// Of those, the seconds the worker says it spent loading weights
    /// (`weights_seconds` in its `/healthz`), when it says.
    pub weights_seconds: Option<f64>,
    /// Unix time it became ready.
    pub at_unix: f64,
}

/// One target in a status report.
#[derive(Debug, Clone, Serialize)]
pub struct TargetStatus {
    /// Which target.
    #[serde(skip)]
    pub id: TargetId,
    /// Target name: a pool's name, or an app revision's id.
    pub name: String,
    /// The app or pool it belongs to.
    pub app: String,
    /// Revision served.
    pub revision: String,
    /// Replica count asked for.
    pub desired: u32,
    /// Replicas, in start order.
    pub replicas: Vec<ReplicaStatus>,
    /// Replicas replaced after a crash or a failed start.
    pub restarts: u64,
    /// Brief health.
    pub health: TargetHealth,
    /// The last cold start.
    pub last_cold_start: Option<ColdStart>,
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
}

/// What the actor knows, readable by status calls.
struct Shared {
    spec: Arc<TargetSpec>,
    desired: u32,
    replicas: BTreeMap<u64, Slot>,
    consecutive_failures: u32,
    backoff_until: Option<Instant>,
    last_error: Option<String>,
    last_failure_at_start: bool,
    /// See [`TargetHealth::crash_loop`].
    crash_loop: bool,
    restarts: u64,
    last_cold_start: Option<ColdStart>,
}

struct Slot {
    id: String,
    state: ReplicaState,
    gpus: Vec<u32>,
    created: Instant,
    addr: Option<SocketAddr>,
    pid: Option<u32>,
    log: Option<String>,
    handle: Option<Arc<ReplicaHandle>>,
    stop: Option<oneshot::Sender<()>>,
}

enum Event {
    Launched {
        seq: u64,
        addr: SocketAddr,
        pid: Option<u32>,
        log: String,
    },
    Ready {
        seq: u64,
        handle: Arc<ReplicaHandle>,
        spawn: Duration,
        ready: Duration,
        /// The worker's own report of its weight load, when it gives one.
        weights: Option<Duration>,
        /// Taken over from an earlier run: not a cold start.
        adopted: bool,
    },
    StartFailed {
        seq: u64,
        error: Error,
    },
    Exited {
        seq: u64,
        how: String,
        asked: bool,
        /// The last lines of its output, when it ended by itself.
        output: Option<String>,
    },
    Unhealthy {
        seq: u64,
        reason: String,
    },
    /// Stop this replica and start a fresh one in its place.
    Replace {
        id: String,
        reason: String,
    },
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

    /// Starts managing a target, at zero replicas. Must be called from
    /// within a tokio runtime.
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
        let task = tokio::spawn(actor.run());
        self.inner.targets.write().insert(
            name,
            Target {
                desired: desired_tx,
                events: ev_tx_for_target,
                shutdown: shutdown_tx,
                shared,
                task: Mutex::new(Some(task)),
            },
        );
    }

    /// Asks for `n` replicas of `target`. Returns false for an unknown target.
    pub fn scale(&self, target: &TargetId, n: u32) -> bool {
        match self.inner.targets.read().get(target) {
            Some(t) => {
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
            metrics::gauge!("warmgate_replicas_unschedulable", t.id.owner_label() => t.app.clone())
                .set(pending as f64);
        }
        out
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

// === impl Shared ===

impl Shared {
    fn health(&self, now: Instant) -> TargetHealth {
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
        h.failing_to_start = self.last_failure_at_start && self.consecutive_failures > 0;
        h.failures = self.consecutive_failures;
        h.crash_loop = self.crash_loop;
        h.retry_in = self
            .backoff_until
            .filter(|until| *until > now)
            .map(|until| until - now);
        h
    }

    fn status(&self) -> TargetStatus {
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
                    addr: s.addr,
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

// === impl Actor ===

struct Actor {
    inner: Arc<Inner>,
    shared: Arc<Mutex<Shared>>,
    desired_rx: watch::Receiver<u32>,
    shutdown_rx: watch::Receiver<bool>,
    ev_tx: mpsc::Sender<Event>,
    ev_rx: mpsc::Receiver<Event>,
    /// The next replica number; a taken-over replica's number is skipped.
    next_seq: std::cell::Cell<u64>,
    shutting_down: bool,
}

impl Actor {
    async fn run(mut self) {
        let inner = self.inner.clone();
        loop {
            // Made before reconcile looks at the GPUs, so a release between
            // the two still wakes this loop.
            let gpu_freed = inner.gpu_freed.notified();
            let wake_at = self.reconcile();
            if self.shutting_down && self.shared.lock().replicas.is_empty() {
                break;
            }
            let has_pending = self
                .shared
                .lock()
                .replicas
                .values()
                .any(|s| matches!(s.state, ReplicaState::Pending { .. }));
            tokio::select! {
                changed = self.desired_rx.changed(), if !self.shutting_down => {
                    if changed.is_err() {
                        self.shutting_down = true;
                    }
                }
                changed = self.shutdown_rx.changed(), if !self.shutting_down => {
                    if changed.is_err() || *self.shutdown_rx.borrow() {
                        self.shutting_down = true;
                    }
                }
                Some(ev) = self.ev_rx.recv() => self.on_event(ev),
                _ = gpu_freed, if has_pending => {}
                _ = sleep_until_opt(wake_at), if wake_at.is_some() => {}
            }
        }
        tracing::debug!(target_name = %self.shared.lock().spec.id, "all replicas stopped");
    }

    /// Brings the replica set toward the desired count. Returns when to look
    /// again if a backoff is holding starts back.
    fn reconcile(&mut self) -> Option<tokio::time::Instant> {
        let now = Instant::now();
        let desired = if self.shutting_down {
            0
        } else {
            *self.desired_rx.borrow()
        };
        let mut shared = self.shared.lock();
        shared.desired = desired;
        let active = |s: &Shared| {
            s.replicas
                .values()
                .filter(|r| {
                    matches!(
                        r.state,
                        ReplicaState::Pending { .. } | ReplicaState::Starting | ReplicaState::Ready
                    )
                })
                .count() as u32
        };

        // Too many: stop the least useful first.
        let current = active(&shared);
        if current > desired {
            for seq in pick_victims(&shared, (current - desired) as usize) {
                self.stop_replica(&mut shared, seq);
            }
        }

        // Pending replicas whose GPUs are now free can start.
        let pending: Vec<u64> = shared
            .replicas
            .iter()
            .filter(|(_, s)| matches!(s.state, ReplicaState::Pending { .. }))
            .map(|(k, _)| *k)
            .collect();
        for seq in pending {
            self.try_launch(&mut shared, seq);
        }

        // Too few: start more, unless a crash loop says to wait.
        let current = active(&shared);
        if current < desired {
            if let Some(until) = shared.backoff_until
                && until > now
            {
                return Some(tokio::time::Instant::from_std(until));
            }
            for _ in current..desired {
                let seq = self.next_seq.get();
                self.next_seq.set(seq + 1);
                let id = format!("{}-{seq}", shared.spec.id);
                shared.replicas.insert(
                    seq,
                    Slot {
                        id,
                        state: ReplicaState::Pending {
                            reason: "waiting to start".into(),
                        },
                        gpus: Vec::new(),
                        created: now,
                        addr: None,
                        pid: None,
                        log: None,
                        handle: None,
                        stop: None,
                    },
                );
                self.try_launch(&mut shared, seq);
            }
        }
        None
    }

    /// Starts a pending replica if its GPUs can be had.
    fn try_launch(&self, shared: &mut Shared, seq: u64) {
        let spec = shared.spec.clone();
        let Some(slot) = shared.replicas.get_mut(&seq) else {
            return;
        };
        // On a cluster the scheduler places GPUs (the pod asks for
        // `nvidia.com/gpu`); the inventory is this machine's.
        let gpus = if self.inner.backend.places_gpus() {
            Vec::new()
        } else {
            let mut inv = self.inner.gpus.lock();
            match inv.allocate(spec.gpus) {
                Some(g) => g,
                None => {
                    slot.state = ReplicaState::Pending {
                        reason: format!(
                            "needs {} GPU(s), {} of {} free",
                            spec.gpus,
                            inv.free(),
                            inv.total()
                        ),
                    };
                    return;
                }
            }
        };
        let Some(next) = slot.state.next(&Transition::Launched) else {
            self.inner.gpus.lock().release(&gpus);
            return;
        };
        slot.state = next;
        slot.gpus = gpus.clone();
        let (stop_tx, stop_rx) = oneshot::channel();
        slot.stop = Some(stop_tx);
        let mut launch = launch_for(&spec, slot.id.clone(), gpus);
        // A replica an earlier run left, with the same model and weights,
        // is taken over instead of started (a failover keeps it warm).
        let adopted = self.inner.backend.adopt(&launch);
        match &adopted {
            Some(a) => {
                tracing::info!(target_name = %spec.id, replica = %a.replica, "taking over a replica an earlier run left");
                slot.id = a.replica.clone();
                launch.replica = a.replica.clone();
                launch.env = a.env.clone();
                self.inner.sink.replica_adopted(&spec, &a.replica, &a.env);
                // Its number is not given to a new replica of this target.
                if let Some(n) = a
                    .replica
                    .strip_prefix(&format!("{}-", spec.id))
                    .and_then(|n| n.parse::<u64>().ok())
                {
                    self.next_seq.set(self.next_seq.get().max(n + 1));
                }
            }
            None => launch
                .env
                .extend(self.inner.sink.replica_env(&spec, &slot.id)),
        }
        let ctx = ReplicaTask {
            seq,
            inner: self.inner.clone(),
            spec,
            events: self.ev_tx.clone(),
        };
        tokio::spawn(ctx.run(launch, adopted.map(|a| a.process), stop_rx));
    }

    /// Takes a replica out of rotation and tells its task to drain and stop.
    fn stop_replica(&self, shared: &mut Shared, seq: u64) {
        let Some(slot) = shared.replicas.get_mut(&seq) else {
            return;
        };
        if matches!(slot.state, ReplicaState::Pending { .. }) {
            let slot = shared.replicas.remove(&seq).expect("present");
            self.release_gpus(&slot.gpus);
            return;
        }
        let Some(next) = slot.state.next(&Transition::Drain) else {
            return;
        };
        slot.state = next;
        if let Some(h) = &slot.handle {
            h.set_unroutable();
            self.inner.sink.replica_removed(h);
        }
        if let Some(stop) = slot.stop.take() {
            let _ = stop.send(());
        }
    }

    fn release_gpus(&self, gpus: &[u32]) {
        if !gpus.is_empty() {
            self.inner.gpus.lock().release(gpus);
            self.inner.gpu_freed.notify_waiters();
        }
    }

    fn on_event(&mut self, ev: Event) {
        let mut shared = self.shared.lock();
        let name = shared.spec.id.clone();
        match ev {
            Event::Launched {
                seq,
                addr,
                pid,
                log,
            } => {
                if let Some(slot) = shared.replicas.get_mut(&seq) {
                    slot.addr = Some(addr);
                    slot.pid = pid;
                    slot.log = Some(log);
                }
            }
            Event::Ready {
                seq,
                handle,
                spawn,
                ready,
                weights,
                adopted,
            } => {
                let Some(slot) = shared.replicas.get_mut(&seq) else {
                    return;
                };
                let Some(next) = slot.state.next(&Transition::BecameReady) else {
                    // Asked to stop while it was starting: never route to it.
                    return;
                };
                slot.state = next;
                slot.handle = Some(handle.clone());
                self.inner.sink.replica_ready(handle.clone());
                tracing::info!(
                    target_name = %name,
                    replica = %handle.id,
                    spawn_ms = spawn.as_millis() as u64,
                    ready_ms = ready.as_millis() as u64,
                    weights_ms = weights.map(|w| w.as_millis() as u64),
                    adopted,
                    "replica ready"
                );
                shared.last_failure_at_start = false;
                shared.backoff_until = None;
                shared.crash_loop = false;
                if adopted {
                    // Not a cold start: nothing to measure.
                    return;
                }
                if let Some(w) = weights {
                    metrics::histogram!("warmgate_cold_start_seconds", shared.spec.id.owner_label() => shared.spec.id.owner().to_string(), "phase" => "weights")
                        .record(w.as_secs_f64());
                }
                metrics::histogram!("warmgate_cold_start_seconds", shared.spec.id.owner_label() => shared.spec.id.owner().to_string(), "phase" => "spawn")
                    .record(spawn.as_secs_f64());
                metrics::histogram!("warmgate_cold_start_seconds", shared.spec.id.owner_label() => shared.spec.id.owner().to_string(), "phase" => "ready")
                    .record(ready.as_secs_f64());
                shared.last_cold_start = Some(ColdStart {
                    replica: handle.id.clone(),
                    spawn_seconds: spawn.as_secs_f64(),
                    ready_seconds: ready.as_secs_f64(),
                    weights_seconds: weights.map(|w| w.as_secs_f64()),
                    at_unix: SystemTime::now()
                        .duration_since(UNIX_EPOCH)
                        .map(|d| d.as_secs_f64())
                        .unwrap_or(0.0),
                });
            }
            Event::StartFailed { seq, error } => {
                let Some(slot) = shared.replicas.remove(&seq) else {
                    return;
                };
                self.release_gpus(&slot.gpus);
                self.inner.sink.replica_ended(&slot.id);
                let asked = slot.state == ReplicaState::Draining;
                if asked {
                    return;
                }
                tracing::warn!(target_name = %name, replica = %slot.id, %error, "replica failed to start");
                shared.record_failure(error.to_string(), true, Duration::ZERO);
                let health = shared.health(Instant::now());
                drop(shared);
                self.inner.sink.start_failed(&name, &error, &health);
            }
            Event::Exited {
                seq,
                how,
                asked,
                output,
            } => {
                let Some(slot) = shared.replicas.remove(&seq) else {
                    return;
                };
                self.release_gpus(&slot.gpus);
                self.inner.sink.replica_ended(&slot.id);
                if let Some(h) = &slot.handle {
                    h.set_unroutable();
                    self.inner.sink.replica_removed(h);
                }
                if asked || slot.state == ReplicaState::Draining {
                    tracing::info!(target_name = %name, replica = %slot.id, %how, "replica stopped");
                    return;
                }
                let ready_for = slot
                    .handle
                    .as_ref()
                    .map_or(Duration::ZERO, |h| h.ready_at.elapsed());
                let log = slot.log.clone().unwrap_or_default();
                tracing::warn!(target_name = %name, replica = %slot.id, %how, log = %log, "replica crashed; replacing it");
                shared.record_failure(
                    format!(
                        "replica {} {how}{}",
                        slot.id,
                        crate::last_output(&output, &log)
                    ),
                    false,
                    ready_for,
                );
            }
            Event::Replace { id, reason } => {
                let Some(seq) = shared
                    .replicas
                    .iter()
                    .find(|(_, s)| s.id == id)
                    .map(|(k, _)| *k)
                else {
                    return;
                };
                tracing::warn!(target_name = %name, replica = %id, %reason, "replacing replica");
                self.stop_replica(&mut shared, seq);
                shared.restarts += 1;
                shared.last_error = Some(format!("replica {id} was replaced: {reason}"));
            }
            Event::Unhealthy { seq, reason } => {
                if shared
                    .replicas
                    .get(&seq)
                    .is_some_and(|s| s.state == ReplicaState::Ready)
                {
                    let id = shared.replicas[&seq].id.clone();
                    tracing::warn!(target_name = %name, replica = %id, %reason, "replica failed its liveness probes; replacing it");
                    let ready_for = shared.replicas[&seq]
                        .handle
                        .as_ref()
                        .map_or(Duration::ZERO, |h| h.ready_at.elapsed());
                    self.stop_replica(&mut shared, seq);
                    shared.restarts += 1;
                    shared.record_failure(
                        format!("replica {id} is unhealthy: {reason}"),
                        false,
                        ready_for,
                    );
                }
            }
        }
    }
}

impl Shared {
    fn record_failure(&mut self, error: String, at_start: bool, ready_for: Duration) {
        if ready_for >= STABLE_RESET {
            self.consecutive_failures = 0;
        }
        self.consecutive_failures = self.consecutive_failures.saturating_add(1);
        self.restarts += 1;
        self.last_error = Some(error);
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

/// Which replicas to stop first: ones that have not started, then ones
/// still starting (newest first), then ready ones idle longest, then the
/// least busy.
fn pick_victims(shared: &Shared, n: usize) -> Vec<u64> {
    // Sort key: (class, requests in flight, longest idle first, newest first).
    let mut candidates: Vec<((u8, u32, Duration, u64), u64)> = shared
        .replicas
        .iter()
        .filter_map(|(seq, s)| {
            let newest_first = u64::MAX - seq;
            let key = match s.state {
                ReplicaState::Pending { .. } => (0, 0, Duration::ZERO, newest_first),
                ReplicaState::Starting => (1, 0, Duration::ZERO, newest_first),
                ReplicaState::Ready => {
                    let h = s.handle.as_ref();
                    let inflight = h.map_or(0, |h| h.inflight());
                    let idle = h.map_or(Duration::ZERO, |h| h.idle_for());
                    (2, inflight, Duration::MAX - idle, newest_first)
                }
                _ => return None,
            };
            Some((key, *seq))
        })
        .collect();
    candidates.sort();
    candidates.into_iter().take(n).map(|(_, seq)| seq).collect()
}

/// How the backend is asked to start one replica of `spec` (its own
/// environment, the weights token, is added by the caller).
fn launch_for(spec: &TargetSpec, replica: String, gpus: Vec<u32>) -> Launch {
    Launch {
        replica,
        target: spec.id.owner().to_string(),
        revision: spec.revision.clone(),
        command: spec.command.clone(),
        env: spec.env.clone(),
        gpus,
        workdir: spec.workdir.clone(),
        checkpoint: spec.checkpoint.clone(),
        image: spec.image.clone(),
        pod: spec.pod.clone(),
        gpu_count: spec.gpus,
        pool: spec.id.is_pool(),
        health: spec.health.clone(),
        startup_timeout: spec.startup_timeout,
    }
}

async fn sleep_until_opt(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

// === impl ReplicaTask ===

/// Drives one replica's process through its life and reports to the actor.
struct ReplicaTask {
    seq: u64,
    inner: Arc<Inner>,
    spec: Arc<TargetSpec>,
    events: mpsc::Sender<Event>,
}

impl ReplicaTask {
    /// Starts the replica (or takes over `adopted`, already running),
    /// probes it until ready, then watches it.
    async fn run(
        self,
        launch: Launch,
        adopted: Option<Box<dyn Process>>,
        mut stop: oneshot::Receiver<()>,
    ) {
        let seq = self.seq;
        let t0 = Instant::now();
        let was_running = adopted.is_some();
        let spawned = match adopted {
            Some(p) => Ok(p),
            None => tokio::select! {
                biased;
                _ = &mut stop => {
                    self.send(Event::Exited { seq, how: "was stopped before it started".into(), asked: true, output: None }).await;
                    return;
                }
                r = self.inner.backend.spawn(&launch) => r,
            },
        };
        let mut proc = match spawned {
            Ok(p) => p,
            Err(error) => {
                self.send(Event::StartFailed { seq, error }).await;
                return;
            }
        };
        let spawn = t0.elapsed();
        let t_spawned = Instant::now();
        let addr = proc.addr();
        self.send(Event::Launched {
            seq,
            addr,
            pid: proc.pid(),
            log: proc.log(),
        })
        .await;

        // Readiness: probe fast, back off to a small cap.
        let deadline = tokio::time::Instant::from_std(t0 + self.spec.startup_timeout);
        let mut attempt = 0u32;
        let mut last = String::from("no probe answered yet");
        let health = &self.spec.health;
        let (weights_version, weights_ms) = loop {
            let probe = async {
                tokio::time::sleep(readiness_delay(attempt)).await;
                self.inner.prober.probe(addr, health).await
            };
            tokio::select! {
                biased;
                _ = &mut stop => {
                    let how = stop_process(proc.as_mut(), None, self.spec.stop_grace).await;
                    self.send(Event::Exited { seq, how, asked: true, output: None }).await;
                    return;
                }
                how = proc.wait() => {
                    let error = Error::ExitedBeforeReady { exit: how, log: proc.log(), output: proc.tail() };
                    self.send(Event::StartFailed { seq, error }).await;
                    return;
                }
                _ = tokio::time::sleep_until(deadline) => {
                    // What held it back, when the backend knows (an image
                    // that cannot be pulled): more use than "refused".
                    if let Some(why) = self.inner.backend.pending_reason(&launch.replica) {
                        last = format!("{last}; {why}");
                    }
                    proc.kill();
                    proc.wait().await;
                    let error = Error::StartupTimeout { after: self.spec.startup_timeout, last, log: proc.log(), output: proc.tail() };
                    self.send(Event::StartFailed { seq, error }).await;
                    return;
                }
                r = probe => match r {
                    ProbeResult::Healthy { weights_version, weights_ms } => break (weights_version, weights_ms),
                    ProbeResult::Unhealthy(why) => {
                        last = why;
                        attempt = attempt.saturating_add(1);
                    }
                }
            }
        };
        let ready_at = Instant::now();
        let handle = Arc::new(
            ReplicaHandle::new(
                launch.replica.clone(),
                self.spec.id.clone(),
                self.spec.revision.clone(),
                addr,
                self.spec.concurrency,
                ready_at,
            )
            // Apps' replicas are served by every gateway replica; a
            // pool's tasks only by the one that leads.
            .with_share(if matches!(self.spec.id, TargetId::Revision { .. }) {
                self.inner.share.clone()
            } else {
                Arc::new(crate::replica::Share::default())
            })
            // A replica taken over did not cold-start: it teaches the
            // autoscaler nothing about cold starts.
            .with_startup(if was_running {
                Duration::ZERO
            } else {
                ready_at.saturating_duration_since(t0)
            }),
        );
        if matches!(self.spec.id, TargetId::Revision { .. }) {
            let mut v = self.inner.shared_handles.lock();
            v.retain(|w| w.strong_count() > 0);
            v.push(Arc::downgrade(&handle));
        }
        handle.weights_version.store(
            weights_version.unwrap_or(0),
            std::sync::atomic::Ordering::Relaxed,
        );
        self.send(Event::Ready {
            seq,
            handle: handle.clone(),
            spawn,
            ready: ready_at - t_spawned,
            weights: weights_ms.map(Duration::from_millis),
            adopted: was_running,
        })
        .await;

        // Liveness, until it exits or is asked to stop; and the engine's
        // load, when the app says where to read it.
        let mut rule = HealthRule::new(health.failure_threshold);
        let mut reported = false;
        let engine = &self.spec.engine;
        let mut engine_tick = tokio::time::interval(engine.period);
        engine_tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // Kept across turns of the loop: the engine's tick must not restart
        // the probe's wait.
        let next_probe = || {
            Box::pin(async {
                tokio::time::sleep(health.period).await;
                self.inner.prober.probe(addr, health).await
            })
        };
        let mut probe = next_probe();
        loop {
            tokio::select! {
                biased;
                _ = &mut stop => {
                    let how = stop_process(proc.as_mut(), Some(&handle), self.spec.stop_grace).await;
                    self.send(Event::Exited { seq, how, asked: true, output: None }).await;
                    return;
                }
                how = proc.wait() => {
                    let output = proc.tail();
                    self.send(Event::Exited { seq, how, asked: false, output }).await;
                    return;
                }
                _ = engine_tick.tick(), if engine.metrics_path.is_some() => {
                    // Read aside, within one period, so a slow engine
                    // delays neither the probe nor a stop.
                    let prober = self.inner.prober.clone();
                    let handle = handle.clone();
                    let path = engine.metrics_path.clone().unwrap_or_default();
                    let names = engine.names.clone();
                    let period = engine.period;
                    tokio::spawn(async move {
                        // Stamped when asked: a slow answer is as old as the
                        // question, and never replaces a newer reading.
                        let at = Instant::now();
                        let asked_with = handle.inflight();
                        match prober.read_engine(addr, &path, &names, period).await {
                            Ok(load) if !load.is_empty() => {
                                handle.set_engine(crate::engine::EngineReading {
                                    load,
                                    at,
                                    local: asked_with.max(handle.inflight()),
                                });
                            }
                            Ok(_) => tracing::debug!(replica = %handle.id, "the engine's metrics name no load signal"),
                            Err(e) => tracing::debug!(replica = %handle.id, error = %e, "cannot read the engine's metrics"),
                        }
                    });
                }
                r = &mut probe, if !reported => {
                    probe = next_probe();
                    let healthy = match &r {
                        ProbeResult::Healthy { weights_version, .. } => {
                            if let Some(v) = weights_version {
                                handle.weights_version.fetch_max(*v, std::sync::atomic::Ordering::Relaxed);
                            }
                            true
                        }
                        ProbeResult::Unhealthy(_) => false,
                    };
                    if rule.observe(healthy) {
                        reported = true;
                        let reason = match r {
                            ProbeResult::Unhealthy(e) => e,
                            ProbeResult::Healthy { .. } => String::new(),
                        };
                        self.send(Event::Unhealthy { seq, reason }).await;
                    }
                }
            }
        }
    }

    async fn send(&self, ev: Event) {
        // The actor only goes away once every replica has reported Exited,
        // so a failed send means the runtime is shutting down.
        let _ = self.events.send(ev).await;
    }
}

/// Drains and stops a process: waits for in-flight requests (if it took
/// traffic) within the grace period, sends SIGTERM, and SIGKILL when the
/// grace period is over. Returns how it exited.
async fn stop_process(
    proc: &mut dyn Process,
    handle: Option<&Arc<ReplicaHandle>>,
    grace: Duration,
) -> String {
    let deadline = tokio::time::Instant::now() + grace;
    if let Some(h) = handle {
        h.set_unroutable();
        tokio::select! {
            _ = h.wait_idle(deadline) => {}
            how = proc.wait() => return how,
        }
    }
    proc.terminate();
    match tokio::time::timeout_at(deadline, proc.wait()).await {
        Ok(how) => how,
        Err(_) => {
            proc.kill();
            let how = proc.wait().await;
            format!("{how} after the {grace:?} grace period")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crash_backoff_grows_and_caps() {
        assert_eq!(crash_backoff(0), Duration::ZERO);
        assert_eq!(crash_backoff(1), Duration::ZERO);
        assert_eq!(crash_backoff(2), Duration::from_millis(500));
        assert_eq!(crash_backoff(3), Duration::from_secs(1));
        assert_eq!(crash_backoff(8), Duration::from_secs(32));
        assert_eq!(crash_backoff(12), BACKOFF_CAP);
        assert_eq!(crash_backoff(u32::MAX), BACKOFF_CAP);
    }
}
