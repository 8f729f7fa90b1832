//! Cold-start-aware decisions: what the windows alone cannot see.
//!
//! A replica started now helps only with work that is still there one
//! cold start from now, and a replica stopped now costs a cold start (its
//! replica-seconds and the waiting it causes) when demand comes back. The
//! windowed policy (Knative's) knows neither. This module measures what it
//! needs: the service time (from completions and busy slot-seconds), the
//! arrival rate, the backlog, and the gaps between bursts, and turns them
//! into three rules:
//!
//! - **Lasting demand** is the stable window's average of requests in
//!   flight, at the target. Unlike Knative's in-flight-plus-queued, it
//!   does not grow while requests wait, so a backlog is not also taken for
//!   demand that will last. (The offered load, the stable window's arrival
//!   rate times the service time, tells a burst from the rate before it.)
//! - **A backlog** starts replicas only for the work still waiting when
//!   they are ready: the queued work, plus what will arrive within a cold
//!   start, minus what the ready replicas drain meanwhile. A burst is taken
//!   to go on at today's rate for [`BURST_PERSISTENCE`] times as long as
//!   it has lasted so far (at most a cold start), then the rate before it
//!   resumes; so a spike that stopped starts nothing, and one that goes on
//!   gets its replicas a few seconds in. If the backlog will be gone
//!   first, nothing starts; otherwise the count that costs least starts
//!   ([`to_start`]): a cold start per replica against the waiting left
//!   once they are ready. Against a long cold start that is fewer replicas
//!   draining the backlog over a few service times, not one slot for every
//!   waiting request. The queue is never also counted as lasting demand,
//!   so a backlog that sits through a cold start does not raise the count
//!   tick after tick.
//! - **Warm capacity through gaps.** Replicas that recent demand needed are
//!   kept for [`HOLD_COLD_STARTS`] cold starts, and after each burst the
//!   fewest replicas that would have absorbed it stay on standby for as
//!   long as renting them is cheaper than starting them again: the hold
//!   minimises the expected cost over the gaps seen between recent bursts
//!   (ski rental with a learned distribution).

use std::collections::VecDeque;
use std::time::Duration;

use crate::replicas_for;

/// Replicas that recent demand needed are kept this many measured cold
/// starts after it: a gap shorter than that is cheaper to ride out than to
/// pay a cold start again. (`scale_to_zero_after` still takes the last
/// replica when the app is idle that long.)
pub const HOLD_COLD_STARTS: f64 = 3.0;

/// The longest standby, in measured cold starts.
pub const MAX_STANDBY_COLD_STARTS: f64 = 20.0;

/// Until a few bursts have been seen, a burst is taken to go on for this
/// many times its age so far.
pub const BURST_PERSISTENCE: f64 = 3.0;

/// A backlog's replicas are sized to drain it within this share of a cold
/// start once they are ready (at least one service time).
pub const BACKLOG_DRAIN: f64 = 0.25;

/// Gaps between bursts remembered for the standby decision.
const GAPS: usize = 32;

/// Fewer gaps than this: hold for [`HOLD_COLD_STARTS`] cold starts.
const MIN_GAPS: usize = 3;

/// How long the service-time measurement remembers, in seconds.
const SERVICE_MEMORY: f64 = 300.0;

/// What the policy knows of the app at one observation.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Inputs {
    pub now: Duration,
    pub ready: u32,
    pub queued: u32,
    pub arrivals: u32,
    pub completions: u32,
    pub busy: f64,
    /// The measured cold start, once there is one.
    pub cold: Option<Duration>,
    /// In-flight requests per replica the policy aims at.
    pub target: f64,
    /// In-flight requests one replica takes at most.
    pub slots: f64,
    pub stable_window: Duration,
    pub panic_window: Duration,
    /// How long the last replica stays once the app is idle (its
    /// `scale_to_zero_after`; `None` when `min` keeps replicas anyway).
    pub linger: Option<Duration>,
    /// The last decision.
    pub desired: u32,
}

/// The measured state behind the cold-start-aware rules.
#[derive(Debug, Clone, Default)]
pub(crate) struct Aware {
    /// Decayed busy slot-seconds and completions: their ratio is the mean
    /// service time (Little's law on the replicas).
    busy: f64,
    done: f64,
    /// The last service time measured.
    tau: Option<f64>,
    /// Arrivals per observation, newest last.
    arrivals: VecDeque<(Duration, u32)>,
    /// Demand per observation: the slots in flight.
    demand: VecDeque<(Duration, f64)>,

    last_now: Option<Duration>,
    last_tick: Duration,
    /// The lasting demand at the last observation.
    prev_lasting: f64,
    /// The backlog going on now: since when, and the lasting demand just
    /// before it began.
    backlog: Option<(Duration, f64)>,
    /// Consecutive observations whose arrivals ran at least a replica's
    /// worth above the rate before the backlog.
    elevated: u32,
    /// How long recent such runs lasted, in seconds.
    runs: VecDeque<f64>,
    /// Per observation, the replicas the recent rate needed at full slots.
    recent_need: VecDeque<(Duration, u32)>,
    /// The burst going on now.
    burst: Option<Burst>,
    last_burst_end: Option<Duration>,
    /// Seconds between recent bursts.
    gaps: VecDeque<f64>,
    /// Replicas kept after a burst, until when.
    standby: Option<(u32, Duration)>,
    /// Replicas the last burst that found none ready asked for: what
    /// letting the standby go costs when the next burst comes.
    restart: Option<u32>,
}

/// A stretch where recent demand needs more replicas (at full slots) than
/// the lasting demand does (at the target).
#[derive(Debug, Clone, Copy)]
struct Burst {
    start: Duration,
    peak: u32,
    arrived: u64,
    /// Replicas ready when it began.
    ready: u32,
    /// The most replicas asked for during it.
    top: u32,
}

impl Aware {
    /// Records one observation and returns the count the rules ask for,
    /// and whether a backlog is driving it; `None` until a request has
    /// finished (no service time yet).
    pub fn decide(&mut self, i: &Inputs, cap: usize) -> Option<(u32, bool)> {
        let now = i.now;
        let dt = self
            .last_now
            .map_or(Duration::ZERO, |l| now.saturating_sub(l));
        self.last_now = Some(now);
        if !dt.is_zero() {
            self.last_tick = dt;
        }
        self.record(i, dt, cap);
        let tau = self.service_time()?;
        let cold = i.cold.map_or(0.0, |c| c.as_secs_f64());
        let lasting = self.rate(now, i.stable_window) * tau;
        let recent = self.rate(now, i.panic_window) * tau;
        let current = self.rate(now, self.tick().saturating_mul(2)) * tau;

        // Replicas recent demand needed are kept (never started) for a few
        // cold starts.
        let need = replicas_for(recent, i.slots);
        let held = self.held(i, need, cap);

        // A burst: recent demand needs more (at full slots) than the
        // offered load does (at the target).
        self.track_burst(i, need > replicas_for(lasting, i.target), need, tau, cold);

        // The backlog: work still waiting one cold start from now, and
        // demand in flight over the stable window (the queue not in it).
        let left = self.backlog_left(i, lasting, current, tau, cold);
        let queued = f64::from(i.queued);
        let lasts = queued > 0.0 && left > 0.0;
        let lasting_need = self.lasting_need(i, cap);

        if self.standby.is_some_and(|(_, until)| now >= until) {
            self.standby = None;
        }
        let standby = self.standby.map_or(0, |(n, _)| n);
        // Replicas with work in hand or waiting for them are kept (never
        // started): dropping one that is up while requests queue for its
        // slots saves little and makes them wait for the rest.
        let tick = self.tick().as_secs_f64();
        let busy_now = if i.busy.is_finite() && i.busy > 0.0 {
            i.busy / tick
        } else {
            0.0
        };
        let working = replicas_for(busy_now + queued, i.slots).min(i.desired);
        let base = lasting_need.max(held).max(standby).max(working);
        if lasts {
            let burst = i.ready.saturating_add(to_start(left, tau, i.slots, cold));
            Some((base.max(burst), true))
        } else {
            Some((base, false))
        }
    }

    /// Remembers the replicas recent demand needs (`need`) for
    /// [`HOLD_COLD_STARTS`] cold starts; returns the most of them within
    /// the hold, at most the last decision (they are kept, never started).
    fn held(&mut self, i: &Inputs, need: u32, cap: usize) -> u32 {
        let now = i.now;
        let hold = i
            .cold
            .map_or(Duration::ZERO, |c| c.mul_f64(HOLD_COLD_STARTS));
        push_bounded(&mut self.recent_need, (now, need), cap);
        while self
            .recent_need
            .front()
            .is_some_and(|&(t, _)| now.saturating_sub(t) >= hold || t > now)
        {
            self.recent_need.pop_front();
        }
        self.recent_need
            .iter()
            .map(|&(_, n)| n)
            .max()
            .unwrap_or(0)
            .min(i.desired)
    }

    /// The backlog: the slot-seconds of work still waiting one cold start
    /// from now, once the ready replicas have drained what they can (zero
    /// or less: they will have drained it all).
    fn backlog_left(&mut self, i: &Inputs, lasting: f64, current: f64, tau: f64, cold: f64) -> f64 {
        let now = i.now;
        let before = if i.queued > 0 {
            self.backlog.get_or_insert((now, self.prev_lasting)).1
        } else {
            self.backlog = None;
            lasting
        };
        self.prev_lasting = lasting;
        // A burst's age is how long arrivals have run at least a replica
        // above the rate before it, counted from the second tick that saw
        // them: one tick of arrivals alone (a spike) is not yet taken to go
        // on, and a burst that stopped is not extrapolated, however long
        // its queue waits. How much longer it goes on is learned from the
        // runs seen before.
        let run = self.follow_run(i.queued > 0 && current - before >= i.slots);
        let age = run.saturating_sub(1) as f64 * self.tick().as_secs_f64();
        let goes_on = self.expected_rest(age).min(cold);
        let arriving = current * goes_on + before * (cold - goes_on);
        let queued = f64::from(i.queued);
        queued * tau + arriving - f64::from(i.ready) * i.slots * cold
    }

    /// Replicas for the demand in flight, averaged over the stable window
    /// as Knative does.
    ///
    /// The queue is not in it: a backlog is the backlog rule's, which
    /// sizes its replicas once; counted here too, a queue that sits
    /// through a cold start would raise the count every tick for work
    /// the replicas already starting will take.
    fn lasting_need(&mut self, i: &Inputs, cap: usize) -> u32 {
        let now = i.now;
        let tick = self.tick().as_secs_f64();
        let inflight = if i.busy.is_finite() && i.busy > 0.0 {
            i.busy / tick
        } else {
            0.0
        };
        push_bounded(&mut self.demand, (now, inflight.min(1e12)), cap);
        while self
            .demand
            .front()
            .is_some_and(|&(t, _)| now.saturating_sub(t) >= i.stable_window || t > now)
        {
            self.demand.pop_front();
        }
        let mean_demand =
            self.demand.iter().map(|&(_, d)| d).sum::<f64>() / self.demand.len().max(1) as f64;
        // Not also the offered load: on smooth traffic the two differ by
        // noise, and asking for the higher of them cost 2-5% more than
        // Knative at no lower p99 (the daily ramp, the conversation trace);
        // demand beyond the ready replicas queues, and the queue is the
        // backlog rule's.
        replicas_for(mean_demand, i.target)
    }

    /// Counts one more observation in the run of raised arrivals, or ends
    /// the run and remembers its length; returns the run's length in
    /// observations.
    fn follow_run(&mut self, raised: bool) -> u32 {
        if raised {
            self.elevated = self.elevated.saturating_add(1);
        } else {
            if self.elevated > 0 {
                if self.runs.len() == GAPS {
                    self.runs.pop_front();
                }
                let secs = f64::from(self.elevated) * self.tick().as_secs_f64();
                self.runs.push_back(secs);
            }
            self.elevated = 0;
        }
        self.elevated
    }

    /// How much longer a run of raised arrivals `age` seconds old (less
    /// its first tick) goes on: the mean of what the runs seen that lasted
    /// longer had left at that age. Before [`MIN_GAPS`] runs are known,
    /// [`BURST_PERSISTENCE`] times its age; when fewer than that many lasted
    /// as long, it is taken to end now (a backlog still waiting starts its
    /// replicas anyway).
    fn expected_rest(&self, age: f64) -> f64 {
        if self.runs.len() < MIN_GAPS {
            return BURST_PERSISTENCE * age;
        }
        let seen = age + self.tick().as_secs_f64();
        let (sum, n) = self
            .runs
            .iter()
            .filter(|&&l| l > seen)
            .fold((0.0, 0usize), |(s, n), &l| (s + l - seen, n + 1));
        if n >= MIN_GAPS { sum / n as f64 } else { 0.0 }
    }

    /// The service time in seconds, once a request has finished.
    ///
    /// After a quiet spell longer than the measurement's memory, the last
    /// measured value stands: forgetting it would hand a spike after a
    /// long gap to the windowed rules, which know no cold start.
    fn service_time(&mut self) -> Option<f64> {
        if self.done >= 1.0 && self.busy > 0.0 {
            self.tau = Some(self.busy / self.done);
        }
        self.tau
    }

    fn tick(&self) -> Duration {
        if self.last_tick.is_zero() {
            Duration::from_secs(1)
        } else {
            self.last_tick
        }
    }

    fn record(&mut self, i: &Inputs, dt: Duration, cap: usize) {
        let keep = (-dt.as_secs_f64() / SERVICE_MEMORY).exp();
        let busy = if i.busy.is_finite() && i.busy > 0.0 {
            i.busy.min(1e12)
        } else {
            0.0
        };
        self.busy = self.busy * keep + busy;
        self.done = self.done * keep + f64::from(i.completions);
        while self.arrivals.back().is_some_and(|&(t, _)| t > i.now) {
            self.arrivals.pop_back();
        }
        let retention = i.stable_window.max(i.panic_window);
        while self
            .arrivals
            .front()
            .is_some_and(|&(t, _)| i.now.saturating_sub(t) >= retention)
        {
            self.arrivals.pop_front();
        }
        push_bounded(&mut self.arrivals, (i.now, i.arrivals), cap);
    }

    /// Arrivals per second over `window`, or over the time observed so far
    /// if shorter.
    fn rate(&self, now: Duration, window: Duration) -> f64 {
        let tick = self.tick();
        let mut count = 0u64;
        let mut oldest = now;
        for &(t, n) in self.arrivals.iter().rev() {
            if now.saturating_sub(t) >= window {
                break;
            }
            count += u64::from(n);
            oldest = t;
        }
        // Each observation covers the tick before it.
        let span = (now.saturating_sub(oldest) + tick)
            .min(window.max(tick))
            .as_secs_f64();
        count as f64 / span
    }

    /// Follows bursts; when one ends, decides how long the fewest replicas
    /// that would have absorbed it stay on standby.
    fn track_burst(&mut self, i: &Inputs, active: bool, need: u32, tau: f64, cold: f64) {
        let now = i.now;
        match (&mut self.burst, active) {
            (Some(b), true) => {
                b.peak = b.peak.max(need);
                b.arrived += u64::from(i.arrivals);
                b.top = b.top.max(i.desired);
            }
            (None, true) => {
                if let Some(end) = self.last_burst_end {
                    if self.gaps.len() == GAPS {
                        self.gaps.pop_front();
                    }
                    self.gaps.push_back(now.saturating_sub(end).as_secs_f64());
                }
                self.burst = Some(Burst {
                    start: now,
                    peak: need,
                    arrived: u64::from(i.arrivals),
                    ready: i.ready,
                    top: i.desired,
                });
            }
            (Some(_), false) => {
                let b = self.burst.take().expect("matched");
                self.last_burst_end = Some(now);
                if b.ready == 0 {
                    self.restart = Some(b.top.max(i.desired));
                }
                if cold > 0.0 {
                    self.standby = self.standby_after(&b, now, i, tau, cold);
                    if self.gaps.len() >= MIN_GAPS {
                        // The gaps are known: the standby decides what
                        // stays, not the fixed hold.
                        self.recent_need.clear();
                    }
                }
            }
            (None, false) => {}
        }
    }

    /// Ski rental over the gaps seen. Keeping `level` replicas through a
    /// gap of `g` costs `level × g`; letting them go costs what the rules
    /// keep anyway (the hold of [`HOLD_COLD_STARTS`] cold starts, and for
    /// the last replica the app's linger before zero) and, when the gap
    /// outlasts that, a restart when the next burst comes: the replicas
    /// the last burst from zero started, each a cold start, plus its first
    /// cold start of arrivals waiting half a cold start on average, a
    /// waiting request costing a slot. The standby that minimises the
    /// total over the gaps seen wins.
    fn standby_after(
        &self,
        b: &Burst,
        now: Duration,
        i: &Inputs,
        tau: f64,
        cold: f64,
    ) -> Option<(u32, Duration)> {
        let slots = i.slots;
        let arrived = b.arrived as f64;
        // Replicas that drain the burst within a cold start, at most its
        // peak need.
        let level = replicas_for(arrived * tau / cold, slots).min(b.peak).max(1);
        let lasted = now.saturating_sub(b.start).as_secs_f64().max(1.0);
        let waiting = arrived.min(arrived * cold / lasted) * (cold / 2.0) / slots;
        let restarted = self.restart.unwrap_or(level).max(level);
        let restart = f64::from(restarted) * cold + waiting;
        let longest = cold * MAX_STANDBY_COLD_STARTS;
        // The last replica stays at least this long anyway; with `min`
        // keeping it, it never goes and a gap never restarts from zero.
        let last = i.linger.map_or(f64::INFINITY, |l| l.as_secs_f64());
        let hold = if self.gaps.len() < MIN_GAPS {
            cold * HOLD_COLD_STARTS
        } else {
            let cost = |h: f64| -> f64 {
                let (rest, first) = (h, h.max(last));
                self.gaps
                    .iter()
                    .map(|&g| {
                        f64::from(level - 1) * g.min(rest)
                            + g.min(first)
                            + if g > first { restart } else { 0.0 }
                    })
                    .sum()
            };
            std::iter::once(0.0)
                .chain(self.gaps.iter().copied())
                .filter(|&h| h <= longest)
                .map(|h| (cost(h), h))
                .min_by(|a, b| a.0.total_cmp(&b.0).then(a.1.total_cmp(&b.1)))
                .map_or(0.0, |(_, h)| h)
        };
        (hold > 0.0).then(|| (level, now.saturating_add(Duration::from_secs_f64(hold))))
    }
}

fn push_bounded<T>(q: &mut VecDeque<T>, item: T, cap: usize) {
    q.push_back(item);
    while q.len() > cap.max(1) {
        q.pop_front();
    }
}

/// Replicas to start for `left` slot-seconds of work, in requests of `tau`
/// seconds, that will still wait one cold start from now.
///
/// Enough that the backlog drains within [`BACKLOG_DRAIN`] of a cold
/// start once they are ready, and never less than one service time: a
/// short cold start gives every waiting request its slot at once, as
/// before; a long one starts fewer replicas, each serving a few requests
/// in turn, since every replica costs a cold start of replica-seconds and
/// the waiting through the cold start is the same whatever the count.
pub(crate) fn to_start(left: f64, tau: f64, slots: f64, cold: f64) -> u32 {
    if !(left > 0.0 && tau > 0.0 && slots > 0.0) {
        return 0;
    }
    let drain = tau.max(BACKLOG_DRAIN * cold);
    replicas_for(left / drain, slots)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::{Aware, Burst, Inputs, MIN_GAPS, to_start};

    fn inputs(linger: Option<u64>) -> Inputs {
        Inputs {
            now: Duration::from_secs(1000),
            ready: 1,
            queued: 0,
            arrivals: 0,
            completions: 0,
            busy: 0.0,
            cold: Some(Duration::from_secs(20)),
            target: 5.6,
            slots: 8.0,
            stable_window: Duration::from_secs(60),
            panic_window: Duration::from_secs(6),
            linger: linger.map(Duration::from_secs),
            desired: 1,
        }
    }

    /// A burst of 8 requests that began 30 s before `inputs().now`.
    fn small_burst() -> Burst {
        Burst {
            start: Duration::from_secs(970),
            peak: 1,
            arrived: 8,
            ready: 0,
            top: 1,
        }
    }

    #[test]
    fn a_short_cold_start_gives_every_waiting_request_a_slot() {
        // 80 requests of 2 s waiting, 2 s cold start: 10 replicas of 8.
        assert_eq!(to_start(160.0, 2.0, 8.0, 2.0), 10);
        // Unknown cold start: the same.
        assert_eq!(to_start(160.0, 2.0, 8.0, 0.0), 10);
    }

    #[test]
    fn a_long_cold_start_starts_fewer() {
        // 60 s: drained within 15 s, 160 / 15 slots.
        assert_eq!(to_start(160.0, 2.0, 8.0, 60.0), 2);
        assert_eq!(to_start(0.0, 2.0, 8.0, 60.0), 0);
        assert_eq!(to_start(-5.0, 2.0, 8.0, 60.0), 0);
        assert_eq!(to_start(f64::NAN, 2.0, 8.0, 60.0), 0);
        assert_eq!(to_start(160.0, 0.0, 8.0, 60.0), 0);
        assert!(to_start(1e15, 2.0, 8.0, 60.0) > 1000);
        assert_eq!(to_start(16.0, 2.0, 8.0, 1e9), 1);
    }

    #[test]
    fn a_run_goes_on_as_long_as_the_runs_before_it_did() {
        let mut a = Aware::default();
        // Unknown: three times its age.
        assert_eq!(a.expected_rest(2.0), 6.0);
        // Runs of 3 ticks (1 s each), then of 10.
        for len in [3, 3, 3, 10, 10, 10] {
            for _ in 0..len {
                a.follow_run(true);
            }
            a.follow_run(false);
        }
        assert!(a.runs.len() >= MIN_GAPS);
        // At age 0 (one tick seen) all six lasted longer: (2×3 + 9×3) / 6.
        assert!((a.expected_rest(0.0) - 5.5).abs() < 1e-9);
        // Past the short ones only the long ones count.
        assert!((a.expected_rest(4.0) - 5.0).abs() < 1e-9);
        // Longer than all: taken to end now.
        assert_eq!(a.expected_rest(20.0), 0.0);
    }

    #[test]
    fn a_standby_weighs_restarting_every_replica_the_last_burst_from_zero_started() {
        // Gaps of 100 s, a 20 s cold start, the last replica lingering
        // 60 s anyway. Letting it go after the linger costs 60 s a gap
        // and a restart; keeping it costs 100 s.
        let mut a = Aware::default();
        a.gaps.extend([100.0; MIN_GAPS]);
        let (i, b, cold) = (inputs(Some(60)), small_burst(), 20.0);
        // One replica to restart (20 s) and the burst's first cold start
        // of waiting (8 requests × 10 s / 8 slots = 10 s): 60 + 30 < 100,
        // so nothing stands by.
        assert_eq!(a.standby_after(&b, i.now, &i, 2.0, cold), None);
        // The last burst from zero asked for three replicas: a restart is
        // 3 × 20 + 10 = 70 s, 60 + 70 > 100, so the replica stays through
        // the gap.
        a.restart = Some(3);
        assert_eq!(
            a.standby_after(&b, i.now, &i, 2.0, cold),
            Some((1, i.now + Duration::from_secs(100)))
        );
    }

    #[test]
    fn a_standby_counts_the_linger_the_app_keeps_anyway() {
        // Gaps of 50 s, shorter than the 60 s the last replica lingers
        // anyway: it never restarts, so no standby is worth its cost.
        let mut a = Aware::default();
        a.gaps.extend([50.0; MIN_GAPS]);
        a.restart = Some(10);
        let (i, b) = (inputs(Some(60)), small_burst());
        assert_eq!(a.standby_after(&b, i.now, &i, 2.0, 20.0), None);
        // With `min` keeping a replica (no linger to zero), the same.
        let i = inputs(None);
        assert_eq!(a.standby_after(&b, i.now, &i, 2.0, 20.0), None);
    }

    #[test]
    fn before_the_gaps_are_known_a_burst_holds_its_level_for_a_few_cold_starts() {
        let a = Aware::default();
        let (i, b) = (inputs(Some(60)), small_burst());
        assert_eq!(
            a.standby_after(&b, i.now, &i, 2.0, 20.0),
            Some((1, i.now + Duration::from_secs(60)))
        );
    }
}
