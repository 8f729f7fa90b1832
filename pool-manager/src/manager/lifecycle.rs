//! One replica's life: how the backend is asked to start it, and the task
//! that spawns (or takes over) its process, probes it until ready, watches
//! its liveness and its engine's load, and drains and stops it.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, oneshot};
use warmgate_deploy::TargetId;

use super::actor::Event;
use super::{Inner, TargetSpec};
use crate::Error;
use crate::backend::{Launch, Process};
use crate::probe::{HealthRule, ProbeResult, readiness_delay};
use crate::replica::ReplicaHandle;

/// How the backend is asked to start one replica of `spec` (its own
/// environment, the weights token, is added by the caller).
pub(super) fn launch_for(spec: &TargetSpec, replica: String, gpus: Vec<u32>) -> Launch {
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
        listen: spec.listen,
        startup_timeout: spec.startup_timeout,
    }
}

// === impl ReplicaTask ===

/// Drives one replica's process through its life and reports to the actor.
pub(super) struct ReplicaTask {
    pub(super) seq: u64,
    pub(super) inner: Arc<Inner>,
    pub(super) spec: Arc<TargetSpec>,
    pub(super) events: mpsc::Sender<Event>,
}

impl ReplicaTask {
    /// Starts the replica (or takes over `adopted`, already running),
    /// probes it until ready, then watches it. Each phase that ends the
    /// replica has told the actor why.
    pub(super) async fn run(
        self,
        launch: Launch,
        adopted: Option<Box<dyn Process>>,
        mut stop: oneshot::Receiver<()>,
    ) {
        let t0 = Instant::now();
        let was_running = adopted.is_some();
        let Some(mut proc) = self.spawn(&launch, adopted, &mut stop).await else {
            return;
        };
        let spawn = t0.elapsed();
        let t_spawned = Instant::now();
        self.send(Event::Launched {
            seq: self.seq,
            addr: proc.addr(),
            pid: proc.pid(),
            log: proc.log(),
        })
        .await;
        let Some((addr, weights_version, weights_ms)) = self
            .until_ready(&launch, proc.as_mut(), t0, &mut stop)
            .await
        else {
            return;
        };
        let ready_at = Instant::now();
        let startup = if was_running {
            // A replica taken over did not cold-start: it teaches the
            // autoscaler nothing about cold starts.
            Duration::ZERO
        } else {
            ready_at.saturating_duration_since(t0)
        };
        let handle = self.handle_for(&launch, addr.clone(), ready_at, startup);
        handle.weights_version.store(
            weights_version.unwrap_or(0),
            std::sync::atomic::Ordering::Relaxed,
        );
        self.send(Event::Ready {
            seq: self.seq,
            handle: handle.clone(),
            spawn,
            ready: ready_at - t_spawned,
            weights: weights_ms.map(Duration::from_millis),
            adopted: was_running,
        })
        .await;
        self.watch(proc, &handle, &addr, &mut stop).await;
    }

    /// The replica's process: the one taken over, or one the backend
    /// starts. `None` when it was stopped first or failed to start (told).
    async fn spawn(
        &self,
        launch: &Launch,
        adopted: Option<Box<dyn Process>>,
        stop: &mut oneshot::Receiver<()>,
    ) -> Option<Box<dyn Process>> {
        let seq = self.seq;
        let spawned = match adopted {
            Some(p) => Ok(p),
            None => tokio::select! {
                biased;
                _ = stop => {
                    self.send(Event::Exited { seq, how: "was stopped before it started".into(), asked: true, output: None }).await;
                    return None;
                }
                r = self.inner.backend.spawn(launch) => r,
            },
        };
        match spawned {
            Ok(p) => Some(p),
            Err(error) => {
                self.send(Event::StartFailed { seq, error }).await;
                None
            }
        }
    }

    /// Probes the process fast, backing off to a small cap, until it is
    /// healthy: where it answered and the weights it reports. `None` when
    /// it was stopped, exited, or its startup timeout passed (told).
    async fn until_ready(
        &self,
        launch: &Launch,
        proc: &mut dyn Process,
        t0: Instant,
        stop: &mut oneshot::Receiver<()>,
    ) -> Option<(crate::Endpoint, Option<u64>, Option<u64>)> {
        let seq = self.seq;
        let deadline = tokio::time::Instant::from_std(t0 + self.spec.startup_timeout);
        let mut attempt = 0u32;
        let mut last = String::from("no probe answered yet");
        let health = &self.spec.health;
        loop {
            // Asked each time: a replica offered both a port and a socket
            // is reached on the socket once it has made it.
            let addr = proc.addr();
            let probe = async {
                tokio::time::sleep(readiness_delay(attempt)).await;
                self.inner.prober.probe(&addr, health).await
            };
            tokio::select! {
                biased;
                _ = &mut *stop => {
                    let how = stop_process(proc, None, self.spec.stop_grace).await;
                    self.send(Event::Exited { seq, how, asked: true, output: None }).await;
                    return None;
                }
                how = proc.wait() => {
                    let error = Error::ExitedBeforeReady { exit: how, log: proc.log(), output: proc.tail() };
                    self.send(Event::StartFailed { seq, error }).await;
                    return None;
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
                    return None;
                }
                r = probe => match r {
                    ProbeResult::Healthy { weights_version, weights_ms } => return Some((addr, weights_version, weights_ms)),
                    ProbeResult::Unhealthy(why) => {
                        last = why;
                        attempt = attempt.saturating_add(1);
                    }
                }
            }
        }
    }

    /// The handle the gateway routes to once the replica is ready.
    fn handle_for(
        &self,
        launch: &Launch,
        addr: crate::Endpoint,
        ready_at: Instant,
        startup: Duration,
    ) -> Arc<ReplicaHandle> {
        let app = matches!(self.spec.id, TargetId::Revision { .. });
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
            .with_share(if app {
                self.inner.share.clone()
            } else {
                Arc::new(crate::replica::Share::default())
            })
            .with_startup(startup),
        );
        if app {
            let mut v = self.inner.shared_handles.lock();
            v.retain(|w| w.strong_count() > 0);
            v.push(Arc::downgrade(&handle));
        }
        handle
    }

    /// Liveness, until the process exits or is asked to stop; and the
    /// engine's load, when the app says where to read it.
    async fn watch(
        &self,
        mut proc: Box<dyn Process>,
        handle: &Arc<ReplicaHandle>,
        addr: &crate::Endpoint,
        stop: &mut oneshot::Receiver<()>,
    ) {
        let seq = self.seq;
        let health = &self.spec.health;
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
                _ = &mut *stop => {
                    let how = stop_process(proc.as_mut(), Some(handle), self.spec.stop_grace).await;
                    self.send(Event::Exited { seq, how, asked: true, output: None }).await;
                    return;
                }
                how = proc.wait() => {
                    let output = proc.tail();
                    self.send(Event::Exited { seq, how, asked: false, output }).await;
                    return;
                }
                _ = engine_tick.tick(), if engine.metrics_path.is_some() => {
                    self.read_engine_aside(handle, addr);
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

    /// Reads the engine's load in a task of its own, within one period, so
    /// a slow engine delays neither the probe nor a stop.
    fn read_engine_aside(&self, handle: &Arc<ReplicaHandle>, addr: &crate::Endpoint) {
        let engine = &self.spec.engine;
        let prober = self.inner.prober.clone();
        let handle = handle.clone();
        let path = engine.metrics_path.clone().unwrap_or_default();
        let names = engine.names.clone();
        let period = engine.period;
        let addr = addr.clone();
        tokio::spawn(async move {
            // Stamped when asked: a slow answer is as old as the
            // question, and never replaces a newer reading.
            let at = Instant::now();
            let asked_with = handle.inflight();
            match prober.read_engine(&addr, &path, &names, period).await {
                Ok(load) if !load.is_empty() => {
                    handle.set_engine(crate::engine::EngineReading {
                        load,
                        at,
                        local: asked_with.max(handle.inflight()),
                    });
                }
                Ok(_) => {
                    tracing::debug!(replica = %handle.id, "the engine's metrics name no load signal")
                }
                Err(e) => {
                    tracing::debug!(replica = %handle.id, error = %e, "cannot read the engine's metrics")
                }
            }
        });
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
