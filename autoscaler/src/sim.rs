//! A discrete-event simulator that replays an arrival trace against a
//! scaling policy, with replicas that take a cold start to come up and
//! requests that take a service time derived from their token counts.
//!
//! It runs the same policy code the server runs ([`crate::Autoscaler`]) next
//! to baselines with other mechanics ([`Knative`], [`RayServe`],
//! [`AlwaysPeak`]). All of them see the same per-replica capacity and target;
//! only the mechanics differ. Pure: the caller reads the trace file.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};
use std::time::Duration;

use crate::{Autoscaler, Observation, ScalingConfig};

/// One request of a trace.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TraceRequest {
    /// Arrival time since the trace's first request.
    pub arrival: Duration,
    /// Prompt tokens.
    pub context_tokens: u32,
    /// Tokens generated.
    pub generated_tokens: u32,
}

/// Parses the Azure LLM inference trace format
/// (`TIMESTAMP,ContextTokens,GeneratedTokens`, timestamps like
/// `2023-11-16 18:15:46.6805900`). Arrivals are made relative to the first
/// request and sorted.
pub fn parse_azure_trace(csv: &str) -> Result<Vec<TraceRequest>, String> {
    let mut rows = Vec::new();
    for (i, line) in csv.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || (i == 0 && line.starts_with("TIMESTAMP")) {
            continue;
        }
        let mut f = line.split(',');
        let (Some(ts), Some(ctx), Some(gen_tokens)) = (f.next(), f.next(), f.next()) else {
            return Err(format!("line {}: expected 3 columns", i + 1));
        };
        let at =
            parse_timestamp(ts).ok_or_else(|| format!("line {}: bad timestamp {ts:?}", i + 1))?;
        let context_tokens = ctx
            .trim()
            .parse()
            .map_err(|_| format!("line {}: bad ContextTokens {ctx:?}", i + 1))?;
        let generated_tokens = gen_tokens
            .trim()
            .parse()
            .map_err(|_| format!("line {}: bad GeneratedTokens {gen_tokens:?}", i + 1))?;
        rows.push((at, context_tokens, generated_tokens));
    }
    let Some(&(base, _, _)) = rows
        .iter()
        .min_by(|a, b| a.0.0.cmp(&b.0.0).then(a.0.1.total_cmp(&b.0.1)))
    else {
        return Err("the trace has no requests".into());
    };
    let mut out: Vec<TraceRequest> = rows
        .into_iter()
        .map(|((days, secs), context_tokens, generated_tokens)| {
            // Days and seconds apart, so sub-microsecond digits survive.
            let rel = (days - base.0) as f64 * 86_400.0 + (secs - base.1);
            TraceRequest {
                arrival: Duration::from_secs_f64(rel.max(0.0)),
                context_tokens,
                generated_tokens,
            }
        })
        .collect();
    out.sort_by_key(|r| r.arrival);
    Ok(out)
}

/// `YYYY-MM-DD HH:MM:SS.fraction` as (days since an epoch, seconds into the
/// day).
fn parse_timestamp(ts: &str) -> Option<(i64, f64)> {
    let (date, time) = ts.trim().split_once(' ')?;
    let mut d = date.split('-').map(|x| x.parse::<i64>().ok());
    let (y, m, day) = (d.next()??, d.next()??, d.next()??);
    let mut t = time.split(':');
    let (h, min, s) = (
        t.next()?.parse::<f64>().ok()?,
        t.next()?.parse::<f64>().ok()?,
        t.next()?.parse::<f64>().ok()?,
    );
    if !(1..=12).contains(&m) || !(1..=31).contains(&day) {
        return None;
    }
    // Days from a fixed epoch (civil-from-days, proleptic Gregorian).
    let (y, m) = if m <= 2 { (y - 1, m + 9) } else { (y, m - 3) };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let doy = (153 * m + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    Some((era * 146_097 + doe, h * 3600.0 + min * 60.0 + s))
}

/// How long a request holds its slot: a fixed overhead, prefill per prompt
/// token and decode per generated token.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ServiceModel {
    /// Fixed overhead per request.
    pub base: Duration,
    /// Prefill time per prompt token.
    pub per_context_token: Duration,
    /// Decode time per generated token.
    pub per_generated_token: Duration,
}

impl Default for ServiceModel {
    /// A 7B-class model on one GPU with continuous batching: 20 ms overhead,
    /// prefill at 10,000 tokens/s, decode at 50 tokens/s per sequence.
    fn default() -> Self {
        ServiceModel {
            base: Duration::from_millis(20),
            per_context_token: Duration::from_micros(100),
            per_generated_token: Duration::from_millis(20),
        }
    }
}

impl ServiceModel {
    /// The service time of `r`.
    pub fn service(&self, r: &TraceRequest) -> Duration {
        self.base
            + self.per_context_token * r.context_tokens
            + self.per_generated_token * r.generated_tokens
    }
}

/// A scaling policy under simulation.
pub trait Policy {
    /// A short name for the report.
    fn name(&self) -> String;
    /// One tick: the time-averaged demand (in flight + queued) since the last
    /// tick and the ready replicas; returns the desired count.
    fn tick(&mut self, now: Duration, demand: f64, ready: u32) -> u32;
    /// A request arrived with no replica at all; returns the count to start.
    fn wake(&mut self, now: Duration) -> u32;
    /// A replica became ready `startup` after it was started (the pool
    /// manager's measurement). Policies that plan ahead use it.
    fn replica_ready(&mut self, _startup: Duration) {}
}

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
    fn tick(&mut self, now: Duration, demand: f64, ready: u32) -> u32 {
        self.0
            .observe(Observation {
                now,
                concurrency: demand,
                ready,
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
    fn tick(&mut self, _: Duration, _: f64, _: u32) -> u32 {
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
    fn tick(&mut self, now: Duration, demand: f64, ready: u32) -> u32 {
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
        if desired < self.desired {
            let floor = (f64::from(self.desired) / Self::MAX_SCALE_DOWN_RATE).ceil() as u32;
            desired = desired.max(floor);
        }
        if desired == 0 {
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
    fn tick(&mut self, now: Duration, demand: f64, _ready: u32) -> u32 {
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

/// The simulated platform.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SimConfig {
    /// Time from starting a replica to it taking traffic.
    pub cold_start: Duration,
    /// Requests in flight per replica (the hard limit).
    pub concurrency: u32,
    /// Policy tick.
    pub tick: Duration,
    /// Requests held while no slot is free; past it, rejected.
    pub max_pending: usize,
    /// How long a held request may wait before it fails.
    pub queue_timeout: Duration,
}

/// What a policy did with a trace.
#[derive(Debug, Clone, PartialEq)]
pub struct SimReport {
    /// Policy name.
    pub policy: String,
    /// Replica-seconds used, starting replicas included: the GPU bill.
    pub replica_seconds: f64,
    /// Requests served.
    pub served: u64,
    /// Requests refused because the queue was full.
    pub rejected: u64,
    /// Requests that waited past the queue timeout.
    pub timed_out: u64,
    /// Replicas started.
    pub cold_starts: u64,
    /// Queueing delay percentiles in seconds: p50, p95, p99.
    pub queue_delay: [f64; 3],
    /// Per tick: (seconds, demand, replicas).
    pub timeline: Vec<(f64, f64, u32)>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RState {
    Starting,
    Ready,
    Draining,
}

struct Replica {
    state: RState,
    inflight: u32,
    alive: bool,
}

/// Replays `trace` against `policy`.
pub fn simulate(
    trace: &[TraceRequest],
    model: &ServiceModel,
    policy: &mut dyn Policy,
    cfg: &SimConfig,
) -> SimReport {
    let mut sim = Sim {
        cfg: *cfg,
        replicas: Vec::new(),
        queue: VecDeque::new(),
        completions: BinaryHeap::new(),
        ready_at: BinaryHeap::new(),
        now: Duration::ZERO,
        area_replicas: 0.0,
        area_demand: 0.0,
        delays: Vec::with_capacity(trace.len()),
        served: 0,
        rejected: 0,
        timed_out: 0,
        cold_starts: 0,
        inflight: 0,
    };
    let mut timeline = Vec::new();
    let mut next = 0usize;
    let mut next_tick = cfg.tick;
    let mut tick_demand_start = 0.0;
    let end = trace.last().map_or(Duration::ZERO, |r| r.arrival);
    loop {
        let t_arrival = trace.get(next).map(|r| r.arrival);
        let t_done = sim.completions.peek().map(|Reverse((t, _))| *t);
        let t_ready = sim.ready_at.peek().map(|Reverse((t, _))| *t);
        let pending_work = next < trace.len() || !sim.queue.is_empty() || sim.inflight > 0;
        if !pending_work {
            break;
        }
        let candidates = [t_arrival, t_done, t_ready, Some(next_tick)];
        let t = candidates
            .into_iter()
            .flatten()
            .min()
            .expect("the tick is always there");
        sim.advance(t);
        if t_done == Some(t) {
            let Reverse((_, i)) = sim.completions.pop().expect("peeked");
            sim.complete(i);
        } else if t_ready == Some(t) {
            let Reverse((_, i)) = sim.ready_at.pop().expect("peeked");
            if sim.replicas[i].alive && sim.replicas[i].state == RState::Starting {
                sim.replicas[i].state = RState::Ready;
                policy.replica_ready(cfg.cold_start);
            }
            sim.dispatch(trace, model);
        } else if t_arrival == Some(t) {
            let idx = next;
            next += 1;
            if sim.queue.len() >= cfg.max_pending {
                sim.rejected += 1;
            } else {
                sim.queue.push_back(idx);
                if sim.live() == 0 {
                    let n = policy.wake(t);
                    sim.scale_to(n);
                }
                sim.dispatch(trace, model);
            }
        } else {
            // Tick.
            let span = cfg.tick.as_secs_f64();
            let demand = (sim.area_demand - tick_demand_start) / span;
            tick_demand_start = sim.area_demand;
            let ready = sim.count(RState::Ready);
            sim.expire(trace);
            let n = policy.tick(t, demand, ready);
            sim.scale_to(n);
            sim.dispatch(trace, model);
            timeline.push((t.as_secs_f64(), demand, sim.live()));
            next_tick += cfg.tick;
            if t > end + Duration::from_secs(3600) {
                break;
            }
        }
    }
    let mut d = std::mem::take(&mut sim.delays);
    d.sort_by(f64::total_cmp);
    let q = |p: f64| -> f64 {
        if d.is_empty() {
            0.0
        } else {
            d[((d.len() as f64 * p).ceil() as usize).clamp(1, d.len()) - 1]
        }
    };
    SimReport {
        policy: policy.name(),
        replica_seconds: sim.area_replicas,
        served: sim.served,
        rejected: sim.rejected,
        timed_out: sim.timed_out,
        cold_starts: sim.cold_starts,
        queue_delay: [q(0.50), q(0.95), q(0.99)],
        timeline,
    }
}

struct Sim {
    cfg: SimConfig,
    replicas: Vec<Replica>,
    queue: VecDeque<usize>,
    completions: BinaryHeap<Reverse<(Duration, usize)>>,
    ready_at: BinaryHeap<Reverse<(Duration, usize)>>,
    now: Duration,
    area_replicas: f64,
    area_demand: f64,
    delays: Vec<f64>,
    served: u64,
    rejected: u64,
    timed_out: u64,
    cold_starts: u64,
    inflight: u32,
}

impl Sim {
    fn advance(&mut self, t: Duration) {
        let dt = t.saturating_sub(self.now).as_secs_f64();
        let alive = self.replicas.iter().filter(|r| r.alive).count() as f64;
        self.area_replicas += alive * dt;
        self.area_demand += f64::from(self.inflight + self.queue.len() as u32) * dt;
        self.now = t;
    }

    fn count(&self, s: RState) -> u32 {
        self.replicas
            .iter()
            .filter(|r| r.alive && r.state == s)
            .count() as u32
    }

    /// Replicas that count toward the desired number (not draining).
    fn live(&self) -> u32 {
        self.replicas
            .iter()
            .filter(|r| r.alive && r.state != RState::Draining)
            .count() as u32
    }

    fn scale_to(&mut self, n: u32) {
        let live = self.live();
        if n > live {
            for _ in live..n {
                self.replicas.push(Replica {
                    state: RState::Starting,
                    inflight: 0,
                    alive: true,
                });
                let i = self.replicas.len() - 1;
                self.ready_at
                    .push(Reverse((self.now + self.cfg.cold_start, i)));
                self.cold_starts += 1;
            }
        } else if n < live {
            let mut excess = live - n;
            // Starting replicas first, then idle ready ones, then drain busy.
            for pass in 0..3 {
                for r in self.replicas.iter_mut().rev() {
                    if excess == 0 {
                        return;
                    }
                    if !r.alive || r.state == RState::Draining {
                        continue;
                    }
                    let pick = match pass {
                        0 => r.state == RState::Starting,
                        1 => r.state == RState::Ready && r.inflight == 0,
                        _ => r.state == RState::Ready,
                    };
                    if pick {
                        if r.inflight == 0 {
                            r.alive = false;
                        } else {
                            r.state = RState::Draining;
                        }
                        excess -= 1;
                    }
                }
            }
        }
    }

    fn expire(&mut self, trace: &[TraceRequest]) {
        let now = self.now;
        let timeout = self.cfg.queue_timeout;
        let before = self.queue.len();
        self.queue
            .retain(|&i| now.saturating_sub(trace[i].arrival) <= timeout);
        self.timed_out += (before - self.queue.len()) as u64;
    }

    fn dispatch(&mut self, trace: &[TraceRequest], model: &ServiceModel) {
        while let Some(&idx) = self.queue.front() {
            let best = self
                .replicas
                .iter()
                .enumerate()
                .filter(|(_, r)| {
                    r.alive && r.state == RState::Ready && r.inflight < self.cfg.concurrency
                })
                .min_by_key(|(_, r)| r.inflight)
                .map(|(i, _)| i);
            let Some(i) = best else { return };
            self.queue.pop_front();
            let req = &trace[idx];
            let waited = self.now.saturating_sub(req.arrival);
            if waited > self.cfg.queue_timeout {
                self.timed_out += 1;
                continue;
            }
            self.delays.push(waited.as_secs_f64());
            self.replicas[i].inflight += 1;
            self.inflight += 1;
            self.completions
                .push(Reverse((self.now + model.service(req), i)));
        }
    }

    fn complete(&mut self, i: usize) {
        let r = &mut self.replicas[i];
        r.inflight -= 1;
        self.inflight -= 1;
        self.served += 1;
        if r.state == RState::Draining && r.inflight == 0 {
            r.alive = false;
        }
    }
}

/// The replicas the trace needs at its peak: the highest 60-second average
/// demand (Little's law: arrivals × service time) over `target`.
pub fn peak_replicas(trace: &[TraceRequest], model: &ServiceModel, target: f64, max: u32) -> u32 {
    let window = 60.0;
    let mut best: f64 = 0.0;
    let mut start = 0usize;
    let mut work = 0.0;
    for (i, r) in trace.iter().enumerate() {
        work += model.service(r).as_secs_f64();
        while r.arrival.as_secs_f64() - trace[start].arrival.as_secs_f64() > window {
            work -= model.service(&trace[start]).as_secs_f64();
            start += 1;
        }
        let _ = i;
        best = best.max(work / window);
    }
    ((best / target.max(1e-9)).ceil() as u32).clamp(1, max.max(1))
}

/// warmgate's policy for a simulation, from a scaling config.
pub fn warmgate(config: ScalingConfig) -> Warmgate {
    Warmgate(Autoscaler::new(config))
}
