//! What a revision measures: the demand meter its autoscaler reads each
//! tick (with the readings of the other gateways), the autoscaler's knobs,
//! and the answers counted for a canary's health.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use warmgate_autoscaler::{EngineTargets, Observation, ScaleToZero, ScalingConfig};
use warmgate_deploy::{AppSpec, ScaleToZeroAfter};

use super::{App, Slots};
use crate::error::ErrorKind;

/// Latencies kept per revision for the canary's p99.
const LATENCY_WINDOW: usize = 2048;

/// Time-weighted average of in-flight plus queued requests, the busy
/// slot-seconds, and the arrivals and completions between two ticks: what
/// the autoscaler observes.
#[derive(Debug)]
pub(super) struct Meter {
    pub(super) value: u32,
    pub(super) inflight: u32,
    pub(super) last: Instant,
    pub(super) window_start: Instant,
    pub(super) area: f64,
    pub(super) busy: f64,
    pub(super) active: bool,
    pub(super) arrivals: u32,
    pub(super) completions: u32,
}

/// One tick's reading of a [`Meter`].
#[derive(Debug, Clone, Copy)]
pub(super) struct Reading {
    pub(super) concurrency: f64,
    pub(super) busy: f64,
    pub(super) arrivals: u32,
    pub(super) completions: u32,
}

/// The autoscaler's knobs for an app, from its config.
pub fn scaling_config(spec: &AppSpec) -> ScalingConfig {
    let a = &spec.autoscale;
    ScalingConfig {
        min: a.min,
        max: a.max,
        target: spec.target(),
        stable_window: a.stable_window,
        panic_window: a.panic_window,
        scale_to_zero_after: match a.scale_to_zero_after {
            ScaleToZeroAfter::Auto => ScaleToZero::Auto,
            ScaleToZeroAfter::After(d) => ScaleToZero::After(d),
        },
        panic_threshold: a.panic_threshold,
        max_scale_up_rate: a.max_scale_up_rate,
        max_scale_down_rate: a.max_scale_down_rate,
        scale_down_delay: a.scale_down_delay,
        predictive: a.predictive,
        suspend_after: a.suspend_after,
        concurrency: spec.concurrency,
        cold_start_aware: a.cold_start_aware,
        start_timeout: spec.startup_timeout,
        engine: EngineTargets {
            waiting: a.target_waiting,
            kv_cache_usage: a.target_kv_cache_usage,
        },
    }
}

impl App {
    /// Runs the scaling policy for one tick and applies the desired count
    /// with `apply`, under the policy's lock so a concurrent wake cannot be
    /// overwritten by a stale decision. `now` is the time since the gateway
    /// started. Returns whether the autoscaler is scaling for a burst.
    pub fn tick(&self, now: Duration, apply: impl FnOnce(u32)) -> bool {
        let mut scaler = self.scaler.lock();
        let max_age = self.spec.load().engine.max_age;
        let (reading, ready, queued, engine) = {
            let mut s = self.slots.lock();
            let now = Instant::now();
            let r = s.meter.take(now);
            let engine = crate::serving::engine_load::engine_signals(&s.replicas, now, max_age);
            (r, s.replicas.len() as u32, s.live_waiters as u32, engine)
        };
        let remote = self.remote_reading();
        let decision = scaler.observe(Observation {
            now,
            concurrency: reading.concurrency + remote.concurrency,
            ready,
            queued: queued.saturating_add(remote.queued),
            arrivals: reading.arrivals.saturating_add(remote.arrivals),
            completions: reading.completions.saturating_add(remote.completions),
            busy: reading.busy + remote.busy,
            engine,
        });
        apply(decision.desired.max(self.floor.load(Ordering::Relaxed)));
        decision.panicking
    }

    /// What this gateway saw of it since the last call, for the leader's
    /// autoscaler (a gateway replica that does not lead scales nothing).
    pub(crate) fn take_reading(&self) -> crate::peers::PeerReading {
        let mut s = self.slots.lock();
        let r = s.meter.take(Instant::now());
        crate::peers::PeerReading {
            concurrency: r.concurrency,
            busy: r.busy,
            arrivals: r.arrivals,
            completions: r.completions,
            queued: s.live_waiters as u32,
            answered: 0,
            failed: 0,
        }
    }

    /// Adds what gateway `member` saw to the next tick's reading: its
    /// counts add up until that tick, its levels (in flight, held) stand
    /// until its next report, or for [`crate::peers::PEER_TTL`] if none
    /// comes. Demand held there wakes an app at zero here, as local demand
    /// does.
    pub(crate) fn add_remote(
        &self,
        member: &str,
        r: &crate::peers::PeerReading,
        now: Duration,
        wake: impl FnOnce(u32),
    ) {
        let r = r.sane();
        {
            let mut remote = self.remote.lock();
            let e = remote
                .entry(member.to_string())
                .or_insert_with(|| (Instant::now(), crate::peers::PeerReading::default()));
            *e = (Instant::now(), e.1.then(r));
        }
        if r.queued > 0 && self.ready_replicas() == 0 {
            self.wake(now, wake);
        }
    }

    /// Every fresh member's reading, summed; their counts are taken.
    fn remote_reading(&self) -> crate::peers::PeerReading {
        let mut remote = self.remote.lock();
        remote.retain(|_, (at, _)| at.elapsed() < crate::peers::PEER_TTL);
        let mut sum = crate::peers::PeerReading::default();
        for (_, r) in remote.values_mut() {
            sum.concurrency += r.concurrency;
            sum.busy += r.busy;
            sum.arrivals = sum.arrivals.saturating_add(r.arrivals);
            sum.completions = sum.completions.saturating_add(r.completions);
            sum.queued = sum.queued.saturating_add(r.queued);
            r.busy = 0.0;
            r.arrivals = 0;
            r.completions = 0;
        }
        sum
    }

    /// Demand arrived with no replica ready: applies the count to scale to
    /// at once, without waiting for the next tick.
    pub fn wake(&self, now: Duration, apply: impl FnOnce(u32)) {
        let mut scaler = self.scaler.lock();
        let desired = scaler.wake(now);
        apply(desired);
    }

    /// A start failed: its autoscaler keeps no replica for it beyond what
    /// the demand asks for.
    pub fn start_failed(&self) {
        self.scaler.lock().start_failed();
    }

    /// Starts its autoscaler from `n` replicas taken over from an earlier
    /// run (a failover), `now` being the time since the gateway started.
    pub fn adopt(&self, n: u32, now: Duration) {
        self.scaler.lock().adopt(n, now);
    }

    /// Keeps at least `n` replicas whatever the autoscaler says.
    pub fn hold(&self, n: u32) {
        self.floor.store(n, Ordering::Relaxed);
    }

    /// (requests answered, of which failed) since the revision started.
    pub fn health(&self) -> (u64, u64) {
        (
            self.answered.load(Ordering::Relaxed),
            self.failed.load(Ordering::Relaxed),
        )
    }

    /// Counts another gateway's answers for the canary's health (their
    /// latencies are not known here).
    pub(crate) fn add_answers(&self, answered: u32, failed: u32) {
        self.answered
            .fetch_add(u64::from(answered), Ordering::Relaxed);
        self.failed
            .fetch_add(u64::from(failed.min(answered)), Ordering::Relaxed);
    }

    /// Counts an answer for the canary's health: `failed` for a gateway
    /// error or a 5xx from the worker, and how long it took.
    pub fn answered(&self, failed: bool, took: Duration) {
        let n = self.answered.fetch_add(1, Ordering::Relaxed) + 1;
        if failed {
            self.failed.fetch_add(1, Ordering::Relaxed);
        }
        let mut l = self.latencies.lock();
        if l.len() >= LATENCY_WINDOW {
            l.pop_front();
        }
        l.push_back((n, took.as_secs_f64()));
    }

    /// The p99 latency of the answers after answer number `since`, if any.
    pub fn p99_since(&self, since: u64) -> Option<Duration> {
        let mut v: Vec<f64> = self
            .latencies
            .lock()
            .iter()
            .filter(|(n, _)| *n > since)
            .map(|(_, s)| *s)
            .collect();
        if v.is_empty() {
            return None;
        }
        v.sort_by(f64::total_cmp);
        let i = ((v.len() as f64 * 0.99).ceil() as usize).clamp(1, v.len()) - 1;
        Some(Duration::from_secs_f64(v[i]))
    }

    /// Counts a finished request: `None` for success, or its error kind.
    pub fn count(&self, outcome: Option<ErrorKind>) {
        self.outcomes.count(outcome);
    }

    /// How long the app may stay idle before its last replica goes (see
    /// [`Autoscaler::scale_to_zero_after`](warmgate_autoscaler::Autoscaler::scale_to_zero_after)).
    pub fn scale_to_zero_after(&self) -> Duration {
        self.scaler.lock().scale_to_zero_after()
    }
}

impl Slots {
    pub(super) fn update_meter(&mut self, now: Instant) {
        self.meter
            .set(now, self.inflight, self.inflight + self.live_waiters as u32);
    }
}

// === impl Meter ===

impl Meter {
    pub(super) fn set(&mut self, now: Instant, inflight: u32, value: u32) {
        let dt = now.saturating_duration_since(self.last).as_secs_f64();
        self.area += f64::from(self.value) * dt;
        self.busy += f64::from(self.inflight) * dt;
        self.last = now;
        if value > 0 {
            self.active = true;
        }
        self.value = value;
        self.inflight = inflight;
    }

    /// The reading since the last call. Any activity in the interval
    /// counts, however short, so a request between two ticks still keeps
    /// the app up.
    pub(super) fn take(&mut self, now: Instant) -> Reading {
        let (v, i) = (self.value, self.inflight);
        self.set(now, i, v);
        let span = now
            .saturating_duration_since(self.window_start)
            .as_secs_f64();
        let mut concurrency = if span > 0.0 { self.area / span } else { 0.0 };
        if self.active && concurrency <= 0.0 {
            concurrency = f64::EPSILON;
        }
        let reading = Reading {
            concurrency,
            busy: self.busy,
            arrivals: self.arrivals,
            completions: self.completions,
        };
        self.area = 0.0;
        self.busy = 0.0;
        self.arrivals = 0;
        self.completions = 0;
        self.window_start = now;
        self.active = self.value > 0;
        reading
    }
}
