//! A discrete-event simulator that replays an arrival trace against a
//! scaling policy, with replicas that take a cold start to come up and
//! requests that take a service time derived from their token counts.
//!
//! It runs the same policy code the server runs ([`crate::Autoscaler`],
//! [`crate::pool::pool_desired`]) next to baselines with other mechanics
//! ([`Knative`], [`RayServe`], [`AlwaysPeak`]) and a clairvoyant schedule
//! that knows the future ([`clairvoyant`]). All of them see the same
//! per-replica capacity and target; only the mechanics differ. Pure: the
//! caller reads the trace file, and generated traffic comes from a seed
//! ([`shapes`]).

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};
use std::time::Duration;

mod baselines;
pub mod clairvoyant;
pub mod engine;
pub mod shapes;
pub mod sweep;
mod trace;

pub use baselines::{AlwaysPeak, Knative, PoolTasks, RayServe, Warmgate};
pub use trace::{ServiceModel, TraceRequest, is_bursty, parse_azure_trace, peak_replicas};

use crate::ScalingConfig;

/// What a policy sees at each tick: the same things the gateway measures.
#[derive(Debug, Clone, Copy)]
pub struct Tick<'a> {
    /// Time since the trace's first request.
    pub now: Duration,
    /// Time-averaged demand (in flight + queued) since the last tick.
    pub demand: f64,
    /// Requests waiting for a slot now.
    pub queued: u32,
    /// Requests in flight now.
    pub inflight: u32,
    /// Replicas taking traffic.
    pub ready: u32,
    /// Replicas started and not ready yet.
    pub starting: u32,
    /// Requests that arrived since the last tick.
    pub arrivals: u32,
    /// Requests that finished since the last tick.
    pub completions: u32,
    /// Slot-seconds spent serving since the last tick (the area under the
    /// in-flight count).
    pub busy: f64,
    /// How long each ready replica has had nothing in flight.
    pub idle: &'a [Duration],
    /// What the replicas' engines say, on engine replicas
    /// ([`engine::simulate_engines`]); `None` on plain ones.
    pub engine: Option<crate::EngineSignals>,
}

/// A scaling policy under simulation.
pub trait Policy {
    /// A short name for the report.
    fn name(&self) -> String;
    /// One tick; returns the desired count.
    fn tick(&mut self, tick: &Tick<'_>) -> u32;
    /// A request arrived with no replica at all; returns the count to start.
    fn wake(&mut self, now: Duration) -> u32;
    /// A replica became ready `startup` after it was started (the pool
    /// manager's measurement). Policies that plan ahead use it.
    fn replica_ready(&mut self, _startup: Duration) {}
}

/// What a simulated run counts, the same on both platforms (fixed slots
/// here, engines in [`engine`]): the areas under the replicas, the demand
/// and the busy slots over time, each served request's wait, and how the
/// requests ended.
#[derive(Debug, Default)]
struct Tally {
    area_replicas: f64,
    area_demand: f64,
    area_busy: f64,
    delays: Vec<f64>,
    served: u64,
    rejected: u64,
    timed_out: u64,
    cold_starts: u64,
    completed: u64,
}

impl Tally {
    /// Nothing counted yet, with room for `requests` waits.
    fn new(requests: usize) -> Self {
        Tally {
            delays: Vec::with_capacity(requests),
            ..Tally::default()
        }
    }

    /// `dt` seconds pass with `alive` replicas, `inflight` requests
    /// running and `queued` waiting.
    fn advance(&mut self, dt: f64, alive: f64, inflight: u32, queued: u32) {
        self.area_replicas += alive * dt;
        self.area_demand += f64::from(inflight + queued) * dt;
        self.area_busy += f64::from(inflight) * dt;
    }

    /// The totals at a tick, with `arrivals` requests arrived so far.
    fn totals(&self, arrivals: usize) -> Totals {
        Totals {
            demand: self.area_demand,
            busy: self.area_busy,
            arrivals,
            completed: self.completed,
        }
    }

    /// The report of the run: the `queued` requests still waiting at the
    /// end count as timed out.
    fn report(
        &mut self,
        policy: String,
        queued: usize,
        queue_timeout: Duration,
        timeline: Vec<(f64, f64, u32)>,
    ) -> SimReport {
        SimReport::of(
            policy,
            Counts {
                replica_seconds: self.area_replicas,
                served: self.served,
                rejected: self.rejected,
                timed_out: self.timed_out + queued as u64,
                cold_starts: self.cold_starts,
            },
            std::mem::take(&mut self.delays),
            queue_timeout,
            timeline,
        )
    }
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
    /// Queueing delay percentiles in seconds: p50, p95, p99. A request
    /// that was rejected or timed out counts as having waited the queue
    /// timeout, so a policy cannot look fast by failing requests.
    pub queue_delay: [f64; 3],
    /// Per tick: (seconds, demand, replicas).
    pub timeline: Vec<(f64, f64, u32)>,
}

impl SimReport {
    /// The p99 queueing delay in seconds.
    pub fn p99(&self) -> f64 {
        self.queue_delay[2]
    }
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
    /// When it last had nothing in flight (meaningful while idle).
    idle_since: Duration,
}

/// Replays `trace` against `policy`.
pub fn simulate(
    trace: &[TraceRequest],
    model: &ServiceModel,
    policy: &mut dyn Policy,
    cfg: &SimConfig,
) -> SimReport {
    let mut sim = Sim::new(*cfg, trace.len());
    let mut timeline = Vec::new();
    let mut next = 0usize;
    let mut next_tick = cfg.tick;
    let mut since = SinceTick::default();
    let mut idle = Vec::new();
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
            sim.dispatch(trace, model);
        } else if t_ready == Some(t) {
            sim.replica_up(policy);
            sim.dispatch(trace, model);
        } else if t_arrival == Some(t) {
            sim.arrive(next, policy, trace, model);
            next += 1;
        } else {
            let totals = sim.tally.totals(next);
            let demand = sim.tick(policy, trace, since.take(totals, cfg.tick), &mut idle);
            sim.dispatch(trace, model);
            timeline.push((t.as_secs_f64(), demand, sim.live()));
            next_tick += cfg.tick;
            if t > end + Duration::from_secs(3600) {
                break;
            }
        }
    }
    sim.report(policy.name(), timeline)
}

/// What a run has counted so far: the areas under the demand and the
/// in-flight count, the arrivals and the completions.
#[derive(Debug, Clone, Copy, Default)]
struct Totals {
    demand: f64,
    busy: f64,
    arrivals: usize,
    completed: u64,
}

/// The totals at the last tick, for what changed since.
#[derive(Debug, Default)]
struct SinceTick(Totals);

impl SinceTick {
    /// Since the last tick, `span` ago: the time-averaged demand, the
    /// busy slot-seconds, the arrivals and the completions.
    fn take(&mut self, now: Totals, span: Duration) -> (f64, f64, u32, u32) {
        let last = std::mem::replace(&mut self.0, now);
        (
            (now.demand - last.demand) / span.as_secs_f64(),
            now.busy - last.busy,
            (now.arrivals - last.arrivals) as u32,
            (now.completed - last.completed) as u32,
        )
    }
}

/// What a run counted, for [`SimReport::of`].
struct Counts {
    replica_seconds: f64,
    served: u64,
    rejected: u64,
    /// Timed out, or still queued at the end.
    timed_out: u64,
    cold_starts: u64,
}

impl SimReport {
    /// The report of a run whose served requests waited `delays`
    /// (seconds). Whatever never got a slot waited at least the queue
    /// timeout, and counts so.
    fn of(
        policy: String,
        c: Counts,
        mut delays: Vec<f64>,
        timeout: Duration,
        timeline: Vec<(f64, f64, u32)>,
    ) -> SimReport {
        let failed = c.rejected + c.timed_out;
        delays.extend((0..failed).map(|_| timeout.as_secs_f64()));
        delays.sort_by(f64::total_cmp);
        let q = |p: f64| -> f64 {
            if delays.is_empty() {
                0.0
            } else {
                delays[((delays.len() as f64 * p).ceil() as usize).clamp(1, delays.len()) - 1]
            }
        };
        SimReport {
            policy,
            replica_seconds: c.replica_seconds,
            served: c.served,
            rejected: c.rejected,
            timed_out: c.timed_out,
            cold_starts: c.cold_starts,
            queue_delay: [q(0.50), q(0.95), q(0.99)],
            timeline,
        }
    }
}

struct Sim {
    tally: Tally,
    cfg: SimConfig,
    replicas: Vec<Replica>,
    queue: VecDeque<usize>,
    completions: BinaryHeap<Reverse<(Duration, usize)>>,
    ready_at: BinaryHeap<Reverse<(Duration, usize)>>,
    now: Duration,
    inflight: u32,
}

impl Sim {
    /// A platform with no replicas yet, for a trace of `requests`.
    fn new(cfg: SimConfig, requests: usize) -> Self {
        Sim {
            cfg,
            tally: Tally::new(requests),
            replicas: Vec::new(),
            queue: VecDeque::new(),
            completions: BinaryHeap::new(),
            ready_at: BinaryHeap::new(),
            now: Duration::ZERO,
            inflight: 0,
        }
    }

    /// The next replica due up takes traffic (unless it was let go while
    /// starting), and the policy hears its cold start.
    fn replica_up(&mut self, policy: &mut dyn Policy) {
        let Reverse((_, i)) = self.ready_at.pop().expect("peeked");
        if self.replicas[i].alive && self.replicas[i].state == RState::Starting {
            self.replicas[i].state = RState::Ready;
            self.replicas[i].idle_since = self.now;
            policy.replica_ready(self.cfg.cold_start);
        }
    }

    /// Request `idx` arrives: refused when the queue is full, else queued
    /// (waking the policy when no replica is live) and dispatched.
    fn arrive(
        &mut self,
        idx: usize,
        policy: &mut dyn Policy,
        trace: &[TraceRequest],
        model: &ServiceModel,
    ) {
        if self.queue.len() >= self.cfg.max_pending {
            self.tally.rejected += 1;
        } else {
            self.queue.push_back(idx);
            if self.live() == 0 {
                let n = policy.wake(self.now);
                self.scale_to(n);
            }
            self.dispatch(trace, model);
        }
    }

    /// One policy tick with what changed since the last (demand, busy
    /// slot-seconds, arrivals, completions): expires what waited too long,
    /// shows the policy the platform and scales to its answer. Returns the
    /// tick's demand; `idle` is scratch space for the replicas' idle times.
    fn tick(
        &mut self,
        policy: &mut dyn Policy,
        trace: &[TraceRequest],
        (demand, busy, arrivals, completions): (f64, f64, u32, u32),
        idle: &mut Vec<Duration>,
    ) -> f64 {
        let t = self.now;
        self.expire(trace);
        idle.clear();
        idle.extend(
            self.replicas
                .iter()
                .filter(|r| r.alive && r.state == RState::Ready)
                .map(|r| {
                    if r.inflight == 0 {
                        t.saturating_sub(r.idle_since)
                    } else {
                        Duration::ZERO
                    }
                }),
        );
        let view = Tick {
            now: t,
            demand,
            queued: self.queue.len() as u32,
            inflight: self.inflight,
            ready: self.count(RState::Ready),
            starting: self.count(RState::Starting),
            arrivals,
            completions,
            busy,
            idle,
            engine: None,
        };
        let n = policy.tick(&view);
        self.scale_to(n);
        demand
    }

    /// The report of the run (see [`Tally::report`]).
    fn report(&mut self, policy: String, timeline: Vec<(f64, f64, u32)>) -> SimReport {
        let queued = self.queue.len();
        self.tally
            .report(policy, queued, self.cfg.queue_timeout, timeline)
    }

    fn advance(&mut self, t: Duration) {
        let dt = t.saturating_sub(self.now).as_secs_f64();
        let alive = self.replicas.iter().filter(|r| r.alive).count() as f64;
        self.tally
            .advance(dt, alive, self.inflight, self.queue.len() as u32);
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
                    idle_since: self.now,
                });
                let i = self.replicas.len() - 1;
                self.ready_at
                    .push(Reverse((self.now + self.cfg.cold_start, i)));
                self.tally.cold_starts += 1;
            }
        } else if n < live {
            let mut excess = live - n;
            // Starting replicas first, then the longest idle ready ones,
            // then drain busy ones.
            let mut idle: Vec<usize> = (0..self.replicas.len())
                .filter(|&i| {
                    let r = &self.replicas[i];
                    r.alive && r.state == RState::Ready && r.inflight == 0
                })
                .collect();
            idle.sort_by_key(|&i| self.replicas[i].idle_since);
            let starting = (0..self.replicas.len()).rev().filter(|&i| {
                let r = &self.replicas[i];
                r.alive && r.state == RState::Starting
            });
            let busy = (0..self.replicas.len()).rev().filter(|&i| {
                let r = &self.replicas[i];
                r.alive && r.state == RState::Ready && r.inflight > 0
            });
            let order: Vec<usize> = starting.chain(idle).chain(busy).collect();
            for i in order {
                if excess == 0 {
                    return;
                }
                let r = &mut self.replicas[i];
                if r.inflight == 0 {
                    r.alive = false;
                } else {
                    r.state = RState::Draining;
                }
                excess -= 1;
            }
        }
    }

    fn expire(&mut self, trace: &[TraceRequest]) {
        let now = self.now;
        let timeout = self.cfg.queue_timeout;
        let before = self.queue.len();
        self.queue
            .retain(|&i| now.saturating_sub(trace[i].arrival) <= timeout);
        self.tally.timed_out += (before - self.queue.len()) as u64;
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
                self.tally.timed_out += 1;
                continue;
            }
            self.tally.delays.push(waited.as_secs_f64());
            self.replicas[i].inflight += 1;
            self.inflight += 1;
            self.completions
                .push(Reverse((self.now + model.service(req), i)));
        }
    }

    fn complete(&mut self, i: usize) {
        let now = self.now;
        let r = &mut self.replicas[i];
        r.inflight -= 1;
        self.inflight -= 1;
        self.tally.served += 1;
        self.tally.completed += 1;
        if r.inflight == 0 {
            r.idle_since = now;
            if r.state == RState::Draining {
                r.alive = false;
            }
        }
    }
}

/// warmgate's policy for a simulation, from a scaling config.
pub fn warmgate(config: ScalingConfig) -> Warmgate {
    Warmgate(crate::Autoscaler::new(config))
}
