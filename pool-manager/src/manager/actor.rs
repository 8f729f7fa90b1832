//! One actor per target: it owns every decision (start, stop, which
//! replica, when to retry) and brings the target's replicas to the desired
//! count, driven by [`Event`]s from the replicas' tasks.

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use parking_lot::Mutex;
use tokio::sync::{mpsc, oneshot, watch};
use warmgate_deploy::TargetId;

use super::lifecycle::{ReplicaTask, launch_for};
use super::state::{Shared, Slot};
use super::{ColdStart, Inner};
use crate::Error;
use crate::replica::{ReplicaHandle, ReplicaState, Transition};

pub(super) enum Event {
    Launched {
        seq: u64,
        addr: crate::Endpoint,
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

// === impl Actor ===

pub(super) struct Actor {
    pub(super) inner: Arc<Inner>,
    pub(super) shared: Arc<Mutex<Shared>>,
    pub(super) desired_rx: watch::Receiver<u32>,
    pub(super) shutdown_rx: watch::Receiver<bool>,
    pub(super) ev_tx: mpsc::Sender<Event>,
    pub(super) ev_rx: mpsc::Receiver<Event>,
    /// The next replica number; a taken-over replica's number is skipped.
    pub(super) next_seq: std::cell::Cell<u64>,
    pub(super) shutting_down: bool,
}

impl Actor {
    pub(super) async fn run(mut self) {
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
            } => self.on_ready(
                &mut shared,
                &name,
                seq,
                handle,
                (spawn, ready, weights),
                adopted,
            ),
            Event::StartFailed { seq, error } => {
                let Some(slot) = shared.replicas.remove(&seq) else {
                    return;
                };
                self.release_gpus(&slot.gpus);
                self.inner.sink.replica_ended(&slot.id);
                if slot.state == ReplicaState::Draining {
                    return;
                }
                tracing::warn!(target_name = %name, replica = %slot.id, %error, "replica failed to start");
                let summary = format!("replica {}: {}", slot.id, error.summary());
                shared.record_failure(error.to_string(), summary, true, Duration::ZERO);
                let health = shared.health(Instant::now());
                drop(shared);
                self.inner.sink.start_failed(&name, &error, &health);
            }
            Event::Exited {
                seq,
                how,
                asked,
                output,
            } => self.on_exited(&mut shared, &name, seq, &how, asked, &output),
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
                shared.last_failure = shared.last_error.clone();
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
                    let error = format!("replica {id} is unhealthy: {reason}");
                    shared.record_failure(error.clone(), error, false, ready_for);
                }
            }
        }
    }

    /// A replica passed its readiness probe: routed to (unless it was asked
    /// to stop meanwhile), the crash-loop state cleared, and its cold start
    /// (spawn, ready, weights) measured unless it was taken over.
    fn on_ready(
        &self,
        shared: &mut Shared,
        name: &TargetId,
        seq: u64,
        handle: Arc<ReplicaHandle>,
        (spawn, ready, weights): (Duration, Duration, Option<Duration>),
        adopted: bool,
    ) {
        let Some(slot) = shared.replicas.get_mut(&seq) else {
            return;
        };
        let Some(next) = slot.state.next(&Transition::BecameReady) else {
            // Asked to stop while it was starting: never route to it.
            return;
        };
        slot.state = next;
        // Where it was found ready (a replica offered both a port
        // and a socket is reached where it listened).
        slot.addr = Some(handle.addr.clone());
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

    /// A replica's process ended: out of routing, its GPUs freed; a crash
    /// (not asked, not draining) is recorded as a failure.
    fn on_exited(
        &self,
        shared: &mut Shared,
        name: &TargetId,
        seq: u64,
        how: &str,
        asked: bool,
        output: &Option<String>,
    ) {
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
                crate::last_output(output, &log)
            ),
            format!("replica {} {how}", slot.id),
            false,
            ready_for,
        );
    }
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

async fn sleep_until_opt(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}
