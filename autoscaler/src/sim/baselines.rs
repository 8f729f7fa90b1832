//! The policies warmgate is measured against, and the adapters that put
//! warmgate's own policies (apps and warm pools) into the simulator.

use std::collections::VecDeque;
use std::time::Duration;

use super::{Policy, Tick};
use crate::pool::{PoolLoad, PoolScaling, pool_desired};
use crate::{Autoscaler, Observation};

/// warmgate's own policy.
pub struct Warmgate(pub Autoscaler);

impl Policy for Warmgate {
    fn name(&self) -> String {
        if self.0.config().predictive {
            "warmgate (predictive)".into()
        } else {
            "warmgate".into()
        }
    }
    fn tick(&mut self, t: &Tick<'_>) -> u32 {
        self.0
            .observe(Observation {
                now: t.now,
                concurrency: t.demand,
                ready: t.ready,
                queued: t.queued,
                arrivals: t.arrivals,
                completions: t.completions,
                busy: t.busy,
                engine: t.engine,
            })
            .desired
    }
    fn wake(&mut self, now: Duration) -> u32 {
        self.0.wake(now)
    }
    fn replica_ready(&mut self, startup: Duration) {
        self.0.observe_cold_start(startup);
    }
}

/// A fixed count: enough replicas for the trace's peak, always on.
pub struct AlwaysPeak(pub u32);

impl Policy for AlwaysPeak {
    fn name(&self) -> String {
        format!("always at peak ({})", self.0)
    }
    fn tick(&mut self, _: &Tick<'_>) -> u32 {
        self.0
    }
    fn wake(&mut self, _: Duration) -> u32 {
        self.0
    }
}

/// Knative's KPA as it ships: stable 60 s, panic 6 s at 200%, max scale-down
/// rate 2 per tick, and a 30 s grace before the last replica goes.
pub struct Knative {
    target: f64,
    min: u32,
    max: u32,
    samples: VecDeque<(Duration, f64)>,
    desired: u32,
    panic_until: Option<Duration>,
    zero_since: Option<Duration>,
}

impl Knative {
    const STABLE: Duration = Duration::from_secs(60);
    const PANIC: Duration = Duration::from_secs(6);
    const PANIC_THRESHOLD: f64 = 2.0;
    const MAX_SCALE_DOWN_RATE: f64 = 2.0;
    const SCALE_TO_ZERO_GRACE: Duration = Duration::from_secs(30);

    /// KPA mechanics with warmgate's target and bounds.
    pub fn new(target: f64, min: u32, max: u32) -> Self {
        Knative {
            target: target.max(1e-9),
            min,
            max: max.max(1),
            samples: VecDeque::new(),
            desired: min,
            panic_until: None,
            zero_since: None,
        }
    }
}

impl Policy for Knative {
    fn name(&self) -> String {
        "Knative defaults".into()
    }
    fn tick(&mut self, t: &Tick<'_>) -> u32 {
        let (now, demand, ready) = (t.now, t.demand, t.ready);
        self.samples.push_back((now, demand));
        while self
            .samples
            .front()
            .is_some_and(|(t, _)| now.saturating_sub(*t) >= Self::STABLE)
        {
            self.samples.pop_front();
        }
        let stable = mean(&self.samples, now, Self::STABLE);
        let panic = mean(&self.samples, now, Self::PANIC);
        let want_stable = (stable / self.target).ceil() as u32;
        let want_panic = (panic / self.target).ceil() as u32;
        if ready > 0 && panic / (f64::from(ready) * self.target) >= Self::PANIC_THRESHOLD {
            self.panic_until = Some(now + Self::STABLE);
        }
        let panicking = self.panic_until.is_some_and(|u| now < u);
        let mut desired = if panicking {
            self.desired.max(want_panic)
        } else {
            want_stable
        };
        // As the KPA does: at most `ready / rate` (rounded down) go per
        // tick, so the last replica can go.
        let floor = (f64::from(ready) / Self::MAX_SCALE_DOWN_RATE).floor() as u32;
        desired = desired.max(floor);
        // The grace keeps a replica that runs; with none running there is
        // nothing to keep (no replica starts before the first request).
        if desired == 0 && self.desired > 0 {
            let since = *self.zero_since.get_or_insert(now);
            if now.saturating_sub(since) < Self::SCALE_TO_ZERO_GRACE {
                desired = 1;
            }
        } else {
            self.zero_since = None;
        }
        if demand > 0.0 {
            desired = desired.max(1);
        }
        self.desired = desired.clamp(self.min, self.max);
        self.desired
    }
    fn wake(&mut self, _: Duration) -> u32 {
        self.desired = self.desired.max(1).clamp(self.min, self.max);
        self.desired
    }
}

/// Ray Serve's autoscaler as it ships: demand averaged over a 30 s look-back,
/// scale up only after 30 s of wanting more, down only after 600 s of
/// wanting less; a request at zero starts a replica at once.
pub struct RayServe {
    target: f64,
    min: u32,
    max: u32,
    samples: VecDeque<(Duration, f64)>,
    desired: u32,
    up_since: Option<Duration>,
    down_since: Option<Duration>,
}

impl RayServe {
    const LOOK_BACK: Duration = Duration::from_secs(30);
    const UPSCALE_DELAY: Duration = Duration::from_secs(30);
    const DOWNSCALE_DELAY: Duration = Duration::from_secs(600);

    /// Ray Serve mechanics with warmgate's target and bounds.
    pub fn new(target: f64, min: u32, max: u32) -> Self {
        RayServe {
            target: target.max(1e-9),
            min,
            max: max.max(1),
            samples: VecDeque::new(),
            desired: min,
            up_since: None,
            down_since: None,
        }
    }
}

impl Policy for RayServe {
    fn name(&self) -> String {
        "Ray Serve defaults".into()
    }
    fn tick(&mut self, t: &Tick<'_>) -> u32 {
        let (now, demand) = (t.now, t.demand);
        self.samples.push_back((now, demand));
        while self
            .samples
            .front()
            .is_some_and(|(t, _)| now.saturating_sub(*t) >= Self::LOOK_BACK)
        {
            self.samples.pop_front();
        }
        let avg = mean(&self.samples, now, Self::LOOK_BACK);
        let want = ((avg / self.target).ceil() as u32).clamp(self.min, self.max);
        if self.desired == 0 && demand > 0.0 {
            self.desired = want.max(1);
            self.up_since = None;
        } else if want > self.desired {
            self.down_since = None;
            let since = *self.up_since.get_or_insert(now);
            if now.saturating_sub(since) >= Self::UPSCALE_DELAY {
                self.desired = want;
                self.up_since = None;
            }
        } else if want < self.desired {
            self.up_since = None;
            let since = *self.down_since.get_or_insert(now);
            if now.saturating_sub(since) >= Self::DOWNSCALE_DELAY {
                self.desired = want;
                self.down_since = None;
            }
        } else {
            self.up_since = None;
            self.down_since = None;
        }
        self.desired
    }
    fn wake(&mut self, _: Duration) -> u32 {
        self.desired = self.desired.max(1).clamp(self.min, self.max);
        self.desired
    }
}

fn mean(samples: &VecDeque<(Duration, f64)>, now: Duration, window: Duration) -> f64 {
    let (sum, n) = samples
        .iter()
        .filter(|(t, _)| now.saturating_sub(*t) < window)
        .fold((0.0, 0u32), |(s, n), (_, c)| (s + c, n + 1));
    if n == 0 { 0.0 } else { sum / f64::from(n) }
}

/// warmgate's warm-pool policy ([`crate::pool::pool_desired`]) serving the
/// same requests as tasks: replicas start for queued work and go once idle
/// past `idle_ttl`.
pub struct PoolTasks {
    /// The pool's knobs.
    pub scaling: PoolScaling,
}

impl Policy for PoolTasks {
    fn name(&self) -> String {
        "warmgate pool (tasks)".into()
    }
    fn tick(&mut self, t: &Tick<'_>) -> u32 {
        pool_desired(
            &self.scaling,
            &PoolLoad {
                pending: t.queued as usize,
                inflight: t.inflight,
                starting: t.starting,
                idle: t.idle,
            },
        )
    }
    fn wake(&mut self, _: Duration) -> u32 {
        self.scaling.min.max(1).min(self.scaling.max.max(1))
    }
}
