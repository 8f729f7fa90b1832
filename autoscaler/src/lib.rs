//! Pure scaling policy for warmgate serving apps ("KPA v1").
//!
//! This is a deliberately small cousin of Knative's KPA: the async gateway
//! feeds one [`Observation`] per tick (about once a second) into
//! [`Autoscaler::observe`] and gets back a [`Decision`] with the desired
//! replica count. When a request hits an app that sits at zero replicas the
//! gateway calls [`Autoscaler::wake`] right away instead of waiting for the
//! next tick, so a cold start is never delayed by the tick period.
//!
//! The crate is pure: no clocks, no I/O, no async. Time is passed in as a
//! [`Duration`] since an arbitrary epoch chosen by the caller, which makes
//! every decision reproducible in tests on virtual time.
//!
//! # Policy in one paragraph
//!
//! Samples of concurrency (in-flight + queued requests) are averaged over two
//! sliding windows: a long *stable* window that smooths out noise and a short
//! *panic* window that reacts to bursts. Normally the desired count follows
//! the stable average. When the panic-window demand reaches
//! `panic_threshold` times the capacity of the ready replicas, the policy
//! *panics* for one stable window: it follows the panic average but never
//! scales down, so a burst is absorbed quickly and replicas are not torn down
//! while it drains. Independently, an app that has seen no activity for
//! `scale_to_zero_after` goes to zero (if `min == 0`), and an app with recent
//! activity keeps at least one replica.

#![warn(missing_docs)]

use std::collections::VecDeque;
use std::time::Duration;

mod aware;
pub mod engine;
pub mod linger;

pub use engine::{EngineSignals, EngineTargets};
pub mod pool;
pub mod sim;

pub use aware::{BACKLOG_DRAIN, BURST_PERSISTENCE, HOLD_COLD_STARTS, MAX_STANDBY_COLD_STARTS};

// === defaults ===

/// Default minimum replicas: 0, because scale-to-zero is the point of a
/// serving gateway with warm pools (Knative's `min-scale` default is 0 too).
pub const DEFAULT_MIN_REPLICAS: u32 = 0;

/// Default maximum replicas: 4. Knative defaults to unbounded (`max-scale`
/// 0), but warmgate usually runs on a single machine whose resources (GPU
/// memory, cores) are the real cap, so a small explicit bound is safer.
pub const DEFAULT_MAX_REPLICAS: u32 = 4;

/// Default target concurrency per replica: 4. Knative's soft default is 100,
/// which suits cheap HTTP handlers; model-serving replicas saturate at a few
/// concurrent requests, so a small target keeps per-request latency flat.
pub const DEFAULT_TARGET_CONCURRENCY: f64 = 4.0;

/// Default stable window: 60 s, Knative's `stable-window` default. Long enough
/// to ride out the gaps between bursty requests without flapping.
pub const DEFAULT_STABLE_WINDOW: Duration = Duration::from_secs(60);

/// Default panic window: 6 s, i.e. Knative's `panic-window-percentage` of 10%
/// applied to the 60 s stable window. Short enough to react to a burst within
/// a few ticks.
pub const DEFAULT_PANIC_WINDOW: Duration = Duration::from_secs(6);

/// Default idle time before scaling to zero: 60 s. This is one stable window
/// of silence, which is when Knative's averaging would also reach zero;
/// cold starts of model servers are expensive, so we do not go lower.
pub const DEFAULT_SCALE_TO_ZERO_AFTER: Duration = Duration::from_secs(60);

/// Default panic threshold: 2.0 (200%), Knative's
/// `panic-threshold-percentage` default: panic once short-term demand is
/// twice what the ready replicas are meant to carry.
pub const DEFAULT_PANIC_THRESHOLD: f64 = 2.0;

/// Default maximum scale-up rate: 1000, Knative's `max-scale-up-rate`: in
/// practice unbounded, because under-provisioning costs latency at once.
pub const DEFAULT_MAX_SCALE_UP_RATE: f64 = 1000.0;

/// Default maximum scale-down rate: 2, Knative's `max-scale-down-rate`: at
/// most half the ready replicas go in one tick, so a dip in a noisy signal
/// cannot empty the app.
pub const DEFAULT_MAX_SCALE_DOWN_RATE: f64 = 2.0;

/// Default scale-down delay: none, as in Knative. A lower count takes effect
/// as soon as the stable average asks for it; set it to hold replicas
/// through short lulls when cold starts are very expensive.
pub const DEFAULT_SCALE_DOWN_DELAY: Duration = Duration::ZERO;

/// Default time a start is kept before any cold start is measured, where
/// no `start_timeout` is given (the simulator); the gateway gives each app
/// its own `startup_timeout`.
pub const DEFAULT_START_TIMEOUT: Duration = Duration::from_secs(120);

/// Weight of the newest measurement in the cold-start moving average: a
/// few starts move the estimate, one outlier does not.
pub const COLD_START_EWMA_ALPHA: f64 = 0.3;

/// Upper bound on retained samples, so memory stays bounded even if a caller
/// observes far more often than once per tick. With 1 s ticks a 60 s window
/// holds only ~60 samples; when the cap is hit the oldest samples go first,
/// which merely shortens the effective window.
const MAX_SAMPLES: usize = 10_000;

/// Slack subtracted before rounding up, so that float noise such as
/// `8.000000000000002 / 4.0` does not ask for a spurious extra replica.
const CEIL_EPSILON: f64 = 1e-9;

/// Largest concurrency accepted from an observation. Anything above is
/// clamped so that sums over the window stay finite (no `inf`/`NaN` in
/// [`Decision`]); it is far beyond any realistic replica count anyway.
const MAX_CONCURRENCY: f64 = 1e12;

// === ScalingConfig ===

/// Knobs of the serving-app policy.
///
/// Validation (e.g. `max >= 1`, `target > 0`) happens where the config is
/// parsed; the [`Autoscaler`] still tolerates odd values without panicking
/// (see [`Autoscaler::new`]).
#[derive(Debug, Clone, PartialEq)]
pub struct ScalingConfig {
    /// Replicas never go below this. `0` enables scale-to-zero.
    pub min: u32,
    /// Replicas never go above this; the hard bound (wins over `min`).
    pub max: u32,
    /// desired in-flight requests per replica (> 0)
    pub target: f64,
    /// Averaging window for normal (non-panic) decisions, and the duration
    /// of panic mode after its last trigger.
    pub stable_window: Duration,
    /// Short averaging window used to detect and follow bursts.
    pub panic_window: Duration,
    /// When the last replica goes once the app is idle (no concurrency,
    /// no wake), if `min == 0`.
    pub scale_to_zero_after: ScaleToZero,
    /// panic when panic-window demand / current capacity >= this (2.0 = 200%)
    pub panic_threshold: f64,
    /// Per tick, the count grows to at most `rate × ready` (when any is
    /// ready).
    pub max_scale_up_rate: f64,
    /// Per tick, the count shrinks to at least `ready / rate`.
    pub max_scale_down_rate: f64,
    /// A lower count takes effect only once it has been the answer for this
    /// long: the count is the highest asked for within the delay.
    pub scale_down_delay: Duration,
    /// Scale for the demand one cold start ahead, from its trend over the
    /// panic window, so replicas are ready when a ramp arrives (opt-in).
    pub predictive: bool,
    /// After the whole app has been idle this long, even `min` replicas
    /// stop, until the next request wakes it (Union's environment
    /// `idle_ttl`). `None`: `min` replicas run for ever.
    pub suspend_after: Option<Duration>,
    /// Requests one replica serves at once (the hard limit); the
    /// cold-start-aware decisions measure drain rates with it. `0`: unknown,
    /// `target` stands in.
    pub concurrency: u32,
    /// Decide with the measured cold start and the work waiting (see
    /// [`Autoscaler::observe`]); off, the windowed policy alone decides.
    pub cold_start_aware: bool,
    /// How long a replica may take to become ready (the app's
    /// `startup_timeout`): until a cold start has been measured, a start is
    /// kept this long, so a stock server loading its weights for minutes is
    /// not stopped halfway when the request that woke it gives up.
    pub start_timeout: Duration,
    /// Scale on the engines' own queues and KV caches too ([`engine`]);
    /// without a target, their signals are not used.
    pub engine: EngineTargets,
}

impl Default for ScalingConfig {
    fn default() -> Self {
        Self {
            min: DEFAULT_MIN_REPLICAS,
            max: DEFAULT_MAX_REPLICAS,
            target: DEFAULT_TARGET_CONCURRENCY,
            stable_window: DEFAULT_STABLE_WINDOW,
            panic_window: DEFAULT_PANIC_WINDOW,
            scale_to_zero_after: ScaleToZero::Auto,
            panic_threshold: DEFAULT_PANIC_THRESHOLD,
            max_scale_up_rate: DEFAULT_MAX_SCALE_UP_RATE,
            max_scale_down_rate: DEFAULT_MAX_SCALE_DOWN_RATE,
            scale_down_delay: DEFAULT_SCALE_DOWN_DELAY,
            predictive: false,
            suspend_after: None,
            concurrency: 0,
            cold_start_aware: true,
            start_timeout: DEFAULT_START_TIMEOUT,
            engine: EngineTargets::default(),
        }
    }
}

/// When an idle app's last replica goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ScaleToZero {
    /// After a linger weighed against what a cold start costs, learned from the idle
    /// spells seen ([`linger`]); [`DEFAULT_SCALE_TO_ZERO_AFTER`] until a
    /// cold start and a few spells are known.
    #[default]
    Auto,
    /// After this long idle, whatever the cold start.
    After(Duration),
}

// === Observation / Decision ===

/// One tick's worth of input from the gateway.
///
/// The fields after `ready` feed the cold-start-aware decisions; a caller
/// that leaves them at zero gets the windowed policy alone.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Observation {
    /// Current time since the caller's epoch. Expected to be non-decreasing;
    /// if it goes backwards, samples "from the future" are discarded.
    pub now: Duration,
    /// Time-averaged concurrency (in-flight + queued requests) over the last
    /// tick. Negative or `NaN` values are treated as 0.
    pub concurrency: f64,
    /// Replicas currently ready to serve; used to measure capacity for the
    /// panic decision.
    pub ready: u32,
    /// Requests waiting for a slot now.
    pub queued: u32,
    /// Requests that arrived since the last observation.
    pub arrivals: u32,
    /// Requests that finished since the last observation.
    pub completions: u32,
    /// Slot-seconds spent serving since the last observation (the area
    /// under the in-flight count); with `completions` it measures the
    /// service time.
    pub busy: f64,
    /// What the ready replicas' engines said, when any reading is fresh
    /// (`None`: none is, and the counts above decide alone).
    pub engine: Option<EngineSignals>,
}

/// The policy's answer to one [`Observation`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Decision {
    /// Replica count the gateway should converge to.
    pub desired: u32,
    /// Whether panic mode (scale up fast, never down) is in effect.
    pub panicking: bool,
    /// Mean concurrency over the stable window (0 when empty).
    pub stable_concurrency: f64,
    /// Mean concurrency over the panic window (0 when empty).
    pub panic_concurrency: f64,
    /// Demand expected one cold start ahead, when the predictive option
    /// is on and demand is rising.
    pub predicted_concurrency: Option<f64>,
}

// === Autoscaler ===

/// Per-app scaling state: a sliding window of concurrency samples plus the
/// panic and activity bookkeeping. Feed it with [`Autoscaler::observe`].
#[derive(Debug, Clone)]
pub struct Autoscaler {
    config: ScalingConfig,
    /// `(time, concurrency)` samples, oldest first, times non-decreasing.
    samples: VecDeque<(Duration, f64)>,
    /// Last decision (or wake result); panic mode never goes below it.
    desired: u32,
    /// Panic mode lasts while `now < panic_until` (or on the triggering tick).
    panic_until: Option<Duration>,
    /// Latest time with concurrency > 0 or a wake; `None` = never active.
    last_active: Option<Duration>,
    /// The first observation: idle time counts from here until the first
    /// activity.
    first_seen: Option<Duration>,
    /// Bound on `samples.len()`: [`MAX_SAMPLES`], lowered only by unit tests.
    sample_cap: usize,
    /// Recent recommendations, for the scale-down delay.
    recommendations: VecDeque<(Duration, u32)>,
    /// Moving average of measured cold starts.
    cold_start: Option<Duration>,
    /// What the cold-start-aware rules measure.
    aware: aware::Aware,
    /// The idle spells behind `scale_to_zero_after = "auto"`.
    idle: linger::IdleSpells,
    /// Replicas asked for that are not all ready yet, and since when: the
    /// count never drops below it until they are (a start is never taken
    /// back before it is ready).
    committed: Option<(u32, Duration)>,
    /// Replicas taken over from an earlier run (a failover), and when: the
    /// policy has no history of the demand that started them, so it keeps
    /// them for one stable window, as long as a window needs to see it.
    adopted: Option<(u32, Duration)>,
}

// === impl Autoscaler ===

impl Autoscaler {
    /// Creates a policy with no history; [`Autoscaler::desired`] starts at
    /// `min` (bounded by `max`).
    ///
    /// Odd configs never cause a panic: `min > max` makes `max` the bound, a
    /// non-positive or non-finite `target` is treated as `1.0`, and a `NaN`
    /// `panic_threshold` simply never triggers panic mode.
    pub fn new(config: ScalingConfig) -> Self {
        let desired = config.min.min(config.max);
        Self {
            config,
            samples: VecDeque::new(),
            desired,
            panic_until: None,
            last_active: None,
            first_seen: None,
            sample_cap: MAX_SAMPLES,
            recommendations: VecDeque::new(),
            adopted: None,
            cold_start: None,
            aware: aware::Aware::default(),
            idle: linger::IdleSpells::default(),
            committed: None,
        }
    }

    /// Feeds one measured cold start (process start to ready) into the
    /// moving average the predictive option plans with.
    pub fn observe_cold_start(&mut self, startup: Duration) {
        let est = match self.cold_start {
            None => startup.as_secs_f64(),
            Some(prev) => {
                prev.as_secs_f64() * (1.0 - COLD_START_EWMA_ALPHA)
                    + startup.as_secs_f64() * COLD_START_EWMA_ALPHA
            }
        };
        self.cold_start = Some(Duration::from_secs_f64(est.clamp(0.0, 86_400.0)));
    }

    /// The moving average of measured cold starts, once there is one.
    pub fn cold_start(&self) -> Option<Duration> {
        self.cold_start
    }

    /// How long the app stays idle before its last replica goes: the
    /// config's duration, or under `Auto` what the idle spells seen say
    /// ([`linger`]), [`DEFAULT_SCALE_TO_ZERO_AFTER`] until they can.
    pub fn scale_to_zero_after(&self) -> Duration {
        match self.config.scale_to_zero_after {
            ScaleToZero::After(d) => d,
            ScaleToZero::Auto => self
                .idle
                .linger(self.cold_start, self.slots())
                .unwrap_or(DEFAULT_SCALE_TO_ZERO_AFTER),
        }
    }

    /// The configuration this policy follows.
    pub fn config(&self) -> &ScalingConfig {
        &self.config
    }

    /// Follows `config` from now on, keeping what it has observed: a
    /// change of bounds or target applies on the next tick without
    /// forgetting the load. The last decision is brought within the new
    /// bounds at once.
    pub fn set_config(&mut self, config: ScalingConfig) {
        self.desired = self.desired.clamp(config.min.min(config.max), config.max);
        self.config = config;
    }

    /// Last desired replica count (from [`Autoscaler::observe`] or
    /// [`Autoscaler::wake`]); starts at `min`.
    pub fn desired(&self) -> u32 {
        self.desired
    }

    /// Records one tick's observation and returns the new decision.
    ///
    /// Steps, in order: update the windows and the service-time estimate;
    /// pick the count, with the cold-start-aware rules when they can be
    /// measured ([`Autoscaler::aware`]) and the windowed KPA rules
    /// otherwise; apply the rate limits and the scale-down delay; keep
    /// every start that is not ready yet; apply scale-to-zero /
    /// keep-one-alive (never 0 while requests are in flight); clamp to
    /// `[min, max]`.
    pub fn observe(&mut self, obs: Observation) -> Decision {
        let now = obs.now;
        let concurrency = sanitize_concurrency(obs.concurrency);
        let linger = self.record_activity(&obs, concurrency);
        let stable_concurrency = self.window_mean(now, self.config.stable_window);
        let panic_concurrency = self.window_mean(now, self.config.panic_window);
        let (mut desired, mut panicking) =
            self.base_count(&obs, linger, stable_concurrency, panic_concurrency);

        // The engines' queues and caches: only ever more replicas.
        if let Some(need) = obs
            .engine
            .and_then(|e| engine::replicas_needed(&e, &self.config.engine, obs.ready))
        {
            desired = desired.max(need);
        }

        // Predictive: a replica started now is ready one cold start from
        // now, so plan for the demand then, when it is rising.
        let predicted_concurrency = self.predict(now);
        if let Some(p) = predicted_concurrency {
            desired = desired.max(replicas_for(p, self.target()));
        }

        desired = self.rate_limited(obs.ready, desired, panicking);
        desired = self.delayed_scale_down(now, desired);
        desired = self.keep_adopted(now, desired);
        let idle_now = concurrency == 0.0 && obs.queued == 0;
        (desired, panicking) = self.scale_to_zero(now, idle_now, linger, desired, panicking);
        (desired, panicking) = self.suspend_or_clamp(now, idle_now, desired, panicking);
        self.desired = self.keep_commitments(now, obs.ready, desired);
        Decision {
            desired: self.desired,
            panicking,
            stable_concurrency,
            panic_concurrency,
            predicted_concurrency,
        }
    }

    /// Records the tick's sample and activity (the idle spells, the last
    /// activity, commitments whose replicas are all ready now); returns
    /// how long the app may stay idle before its last replica goes.
    fn record_activity(&mut self, obs: &Observation, concurrency: f64) -> Duration {
        let now = obs.now;
        self.record(now, concurrency);
        // Engines that hold requests (another gateway's, or sent to them
        // directly) keep the app awake when it scales on their signals.
        let engine_busy = (self.config.engine.waiting.is_some()
            || self.config.engine.kv_cache_usage.is_some())
            && obs.engine.is_some_and(|e| e.busy());
        let active = concurrency > 0.0 || obs.arrivals > 0 || obs.queued > 0 || engine_busy;
        if active {
            self.mark_active(now);
        }
        self.idle
            .observe(now, active, obs.arrivals, self.cold_start);
        let linger = self.scale_to_zero_after();
        // All asked-for replicas are ready: nothing is committed any more.
        if self.committed.is_some_and(|(n, _)| obs.ready >= n) {
            self.committed = None;
        }
        linger
    }

    /// The count before limits, and whether it panics: the
    /// cold-start-aware rules when they can be measured
    /// ([`aware::Aware::decide`]), the windowed KPA rules otherwise.
    fn base_count(
        &mut self,
        obs: &Observation,
        linger: Duration,
        stable_concurrency: f64,
        panic_concurrency: f64,
    ) -> (u32, bool) {
        let aware = self.config.cold_start_aware.then(|| aware::Inputs {
            now: obs.now,
            ready: obs.ready,
            queued: obs.queued,
            arrivals: obs.arrivals,
            completions: obs.completions,
            busy: obs.busy,
            cold: self.cold_start,
            target: self.target(),
            slots: self.slots(),
            stable_window: self.config.stable_window,
            panic_window: self.config.panic_window,
            linger: (self.config.min == 0).then_some(linger),
            desired: self.desired,
        });
        let decided = aware.and_then(|inputs| self.aware.decide(&inputs, self.sample_cap));
        match decided {
            Some(d) => {
                self.panic_until = None;
                d
            }
            None => self.windowed(obs, stable_concurrency, panic_concurrency),
        }
    }

    /// Rate limits, as Knative applies them: relative to what is ready;
    /// at zero ready replicas a wake-up is not limited.
    fn rate_limited(&self, ready: u32, mut desired: u32, panicking: bool) -> u32 {
        if ready > 0 {
            let ready = f64::from(ready);
            let up = self.config.max_scale_up_rate;
            if up.is_finite() && up >= 1.0 {
                // It limits growth; it never takes back what was granted.
                let cap = ((ready * up).ceil() as u32).max(self.desired);
                desired = desired.min(cap);
            }
            let down = self.config.max_scale_down_rate;
            if down.is_finite() && down >= 1.0 && !panicking {
                desired = desired.max((ready / down).floor() as u32);
            }
        }
        desired
    }

    /// Scale-down delay: the highest recommendation within the delay.
    fn delayed_scale_down(&mut self, now: Duration, desired: u32) -> u32 {
        if self.config.scale_down_delay.is_zero() {
            return desired;
        }
        let delay = self.config.scale_down_delay;
        while self
            .recommendations
            .front()
            .is_some_and(|&(t, _)| now.saturating_sub(t) >= delay || t > now)
        {
            self.recommendations.pop_front();
        }
        self.recommendations.push_back((now, desired));
        while self.recommendations.len() > self.sample_cap {
            self.recommendations.pop_front();
        }
        self.recommendations
            .iter()
            .map(|&(_, d)| d)
            .max()
            .unwrap_or(desired)
    }

    /// Taken over: kept until a whole stable window has seen the demand.
    fn keep_adopted(&mut self, now: Duration, desired: u32) -> u32 {
        match self.adopted {
            Some((n, at)) if now.saturating_sub(at) < self.config.stable_window => desired.max(n),
            Some(_) => {
                self.adopted = None;
                desired
            }
            None => desired,
        }
    }

    /// Scale-to-zero and keep-one-alive; `idle_now`: nothing in flight or
    /// queued this tick.
    ///
    /// Idle is measured from the last activity rather than from the
    /// window averages, so a long stable window cannot keep a replica
    /// alive past `scale_to_zero_after`. In-flight requests are never idle.
    fn scale_to_zero(
        &mut self,
        now: Duration,
        idle_now: bool,
        linger: Duration,
        desired: u32,
        panicking: bool,
    ) -> (u32, bool) {
        let idle = idle_now
            && self
                .last_active
                .is_none_or(|last| now.saturating_sub(last) >= linger);
        if idle && self.config.min == 0 {
            // A whole idle period ends any panic that was still running.
            self.panic_until = None;
            (0, false)
        } else if !idle {
            // Recent activity (which includes requests in flight right now):
            // keep the last replica until the idle period has passed, even
            // if the averages already read ~0. Never 0 while requests wait.
            (desired.max(1), panicking)
        } else {
            (desired, panicking)
        }
    }

    /// Suspends the app below `min` once it has been quiet for
    /// `suspend_after` (until a request wakes it); otherwise clamps the
    /// count into `[min, max]`.
    fn suspend_or_clamp(
        &mut self,
        now: Duration,
        idle_now: bool,
        desired: u32,
        panicking: bool,
    ) -> (u32, bool) {
        let since = *self.first_seen.get_or_insert(now);
        let quiet = now.saturating_sub(self.last_active.unwrap_or(since).max(since));
        if idle_now
            && self
                .config
                .suspend_after
                .is_some_and(|after| quiet >= after)
        {
            // Suspended: below `min`, until a request wakes it.
            self.panic_until = None;
            (0, false)
        } else {
            (self.clamp(desired), panicking)
        }
    }

    /// Knative's KPA: the stable window's demand, or the panic window's
    /// while a burst lasts (panic only raises the count).
    fn windowed(&mut self, obs: &Observation, stable: f64, panic: f64) -> (u32, bool) {
        let now = obs.now;
        let target = self.target();
        let stable_desired = replicas_for(stable, target);
        let panic_desired = replicas_for(panic, target);
        // Panic needs ready capacity to compare against: demand at zero ready
        // replicas is a cold start (wake), not a burst.
        let triggered =
            obs.ready > 0 && panic / (f64::from(obs.ready) * target) >= self.config.panic_threshold;
        if triggered {
            self.panic_until = Some(now.saturating_add(self.config.stable_window));
        }
        let panicking = triggered || self.panic_until.is_some_and(|until| now < until);
        if !panicking {
            self.panic_until = None;
        }
        let desired = if panicking {
            // Panic only ever raises the count: replicas added for a burst
            // stay until the burst has been quiet for a whole stable
            // window.
            self.desired.max(panic_desired).max(stable_desired)
        } else if obs.ready == 0 && obs.concurrency > 0.0 {
            // At zero ready with work waiting, follow the short window
            // too, never lowering what is already starting, so a queue
            // that builds during a cold start gets its replicas together,
            // not one at a time. The queue enters the replicas at once
            // when they are ready, so the short window is sized by their
            // slots, not by the target: seven requests waiting for a
            // replica of eight slots start one replica, not two.
            let waiting = replicas_for(panic, self.slots());
            self.desired.max(waiting).max(stable_desired)
        } else {
            stable_desired
        };
        (desired, panicking)
    }

    /// Keeps the replicas asked for until they are ready: returns
    /// `desired`, raised to any count still starting, and remembers a new
    /// commitment when `desired` asks for more than is ready. A commitment
    /// lapses after three cold starts (or `start_timeout` when none has
    /// been measured), so a replica that never comes up cannot pin the
    /// count.
    fn keep_commitments(&mut self, now: Duration, ready: u32, desired: u32) -> u32 {
        let lapse = self
            .cold_start
            .map_or(self.config.start_timeout, |c| c.saturating_mul(3));
        let floor = match self.committed {
            Some((n, since)) if now.saturating_sub(since) < lapse => n,
            _ => {
                self.committed = None;
                0
            }
        };
        let desired = desired.max(floor.min(self.config.max));
        if desired > ready && desired > self.desired {
            // New starts: they are kept until ready (a lapsed commitment
            // is not renewed by asking for the same count again).
            self.committed = Some((desired, now));
        }
        desired
    }

    /// Demand one cold start ahead, when it is rising: a least-squares
    /// line through the stable window's samples, read at `now` plus the
    /// measured cold start. `None` when off, unmeasured, or not rising.
    /// The whole stable window smooths the per-second noise that a short
    /// window would mistake for a trend.
    fn predict(&self, now: Duration) -> Option<f64> {
        if !self.config.predictive {
            return None;
        }
        let cold = self.cold_start?.as_secs_f64();
        let window = self.config.stable_window;
        let (mut n, mut st, mut sc, mut stt, mut stc) = (0.0, 0.0, 0.0, 0.0, 0.0);
        for &(t, c) in self.samples.iter().rev() {
            let age = now.saturating_sub(t);
            if age >= window {
                break;
            }
            let x = -age.as_secs_f64();
            n += 1.0;
            st += x;
            sc += c;
            stt += x * x;
            stc += x * c;
        }
        let denom = n * stt - st * st;
        if n < 3.0 || denom <= f64::EPSILON {
            return None;
        }
        let slope = (n * stc - st * sc) / denom;
        let intercept = (sc - slope * st) / n;
        (slope > 0.0).then(|| sanitize_concurrency(intercept + slope * cold))
    }

    /// Starts from `n` running replicas taken over from an earlier run (a
    /// failover) instead of from `min`: they count as asked for at `now`,
    /// and none is let go before one stable window has seen the demand.
    pub fn adopt(&mut self, n: u32, now: Duration) {
        if n == 0 {
            return;
        }
        let n = self.clamp(n);
        self.mark_active(now);
        self.desired = self.desired.max(n);
        self.adopted = Some((n, now));
    }

    /// Demand arrived while the app may be at zero: returns the count to scale to right now
    /// (at least 1, at least the last desired, at most max) and records `now` as activity so the
    /// next observe() does not scale back to zero.
    pub fn wake(&mut self, now: Duration) -> u32 {
        self.mark_active(now);
        self.desired = self.clamp(self.desired.max(1));
        if self.committed.is_none_or(|(n, _)| n < self.desired) {
            self.committed = Some((self.desired, now));
        }
        self.desired
    }

    /// A start failed: the replicas asked for are no longer kept for
    /// their cold start, so a target nothing asks for scales to zero
    /// after `scale_to_zero_after` instead of being started again and
    /// again until the commitment lapses.
    pub fn start_failed(&mut self) {
        self.committed = None;
    }

    // --- private helpers ---

    /// Appends a sample and drops what no window can see any more.
    fn record(&mut self, now: Duration, concurrency: f64) {
        // A clock that went backwards would leave "future" samples that
        // never age out; drop them so the window stays sorted.
        while self.samples.back().is_some_and(|&(t, _)| t > now) {
            self.samples.pop_back();
        }
        let retention = self.config.stable_window.max(self.config.panic_window);
        while self
            .samples
            .front()
            .is_some_and(|&(t, _)| now.saturating_sub(t) >= retention)
        {
            self.samples.pop_front();
        }
        self.samples.push_back((now, concurrency));
        while self.samples.len() > self.sample_cap {
            self.samples.pop_front();
        }
    }

    /// Mean of the samples with `now - t < window`; the current sample
    /// always counts, even for a zero window. Empty -> 0.
    fn window_mean(&self, now: Duration, window: Duration) -> f64 {
        let (sum, count) = self
            .samples
            .iter()
            .rev()
            .take_while(|&&(t, _)| {
                let age = now.saturating_sub(t);
                age < window || age.is_zero()
            })
            .fold((0.0, 0_u32), |(sum, count), &(_, c)| (sum + c, count + 1));
        if count == 0 {
            0.0
        } else {
            sum / f64::from(count)
        }
    }

    /// Remembers `now` as the latest activity (never moves backwards).
    fn mark_active(&mut self, now: Duration) {
        self.last_active = Some(self.last_active.map_or(now, |last| last.max(now)));
    }

    /// Target per replica, with non-positive or non-finite values as 1.0.
    fn target(&self) -> f64 {
        let target = self.config.target;
        if target.is_finite() && target > 0.0 {
            target
        } else {
            1.0
        }
    }

    /// Requests one replica takes at once: the concurrency limit, or the
    /// target when it is unknown.
    fn slots(&self) -> f64 {
        if self.config.concurrency > 0 {
            f64::from(self.config.concurrency)
        } else {
            self.target()
        }
    }

    /// Clamps into `[min, max]`; `max` wins when `min > max`.
    fn clamp(&self, desired: u32) -> u32 {
        let max = self.config.max;
        desired.clamp(self.config.min.min(max), max)
    }
}

// === free helpers ===

/// Maps raw input to a finite, non-negative concurrency (`NaN` -> 0).
fn sanitize_concurrency(concurrency: f64) -> f64 {
    if concurrency > 0.0 {
        concurrency.min(MAX_CONCURRENCY)
    } else {
        0.0
    }
}

/// Replicas needed for `concurrency` at `target` per replica: rounds up,
/// ignoring float noise, and asks for at least one for any demand > 0.
pub(crate) fn replicas_for(concurrency: f64, target: f64) -> u32 {
    if concurrency <= 0.0 {
        return 0;
    }
    // `as` saturates (huge -> u32::MAX, negative -> 0); the caller clamps.
    let replicas = (concurrency / target - CEIL_EPSILON).ceil() as u32;
    replicas.max(1)
}

#[cfg(test)]
mod tests;
