//! Replicas with an LLM engine inside: continuous batching, a KV budget in
//! tokens, prefill per prompt token. The plain simulator ([`super::simulate`])
//! gives each request a fixed service time on one of `concurrency` slots;
//! an engine instead takes every request the gateway sends it into its own
//! queue, admits them into one batch while its KV cache has room, and runs
//! the batch a step at a time, each step a little slower the larger the
//! batch. So a count of requests says little of how full it is, and scaling
//! on the engines' queues and caches ([`crate::engine`]) can be compared
//! with scaling on counts on the same trace.
//!
//! The model, stated: a step takes `step + per_sequence × batch` seconds
//! and gives every running request one token; a request's work is its
//! generated tokens plus its prompt's prefill (`prefill_per_token` seconds
//! a token, counted in steps of one sequence); it holds `prompt + output`
//! tokens of KV cache from admission to its end (vLLM allocates as it
//! goes and may preempt; reserving up front is the conservative reading).
//! The wait reported is from arrival to admission into the batch: the
//! gateway's queue and the engine's.

use std::collections::VecDeque;
use std::time::Duration;

use super::{Policy, SimConfig, SimReport, SinceTick, Tally, Tick, TraceRequest};
use crate::EngineSignals;

/// One engine's costs and capacity.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EngineModel {
    /// A decode step with one sequence, seconds.
    pub step: f64,
    /// Added to a step per sequence in the batch, seconds.
    pub per_sequence: f64,
    /// Prefill per prompt token, seconds.
    pub prefill_per_token: f64,
    /// KV cache, tokens.
    pub kv_tokens: u32,
    /// Most sequences in one batch.
    pub max_batch: u32,
}

impl Default for EngineModel {
    /// A 7B-class model on one GPU: 20 ms a step alone, 0.3 ms more per
    /// sequence (a batch of 32 steps in 29.6 ms, over 1,000 tokens/s),
    /// prefill at 10,000 tokens/s, 64k tokens of KV cache (about 35 of
    /// the generated shapes' mean request).
    fn default() -> Self {
        EngineModel {
            step: 0.020,
            per_sequence: 0.0003,
            prefill_per_token: 0.0001,
            kv_tokens: 65_536,
            max_batch: 256,
        }
    }
}

impl EngineModel {
    fn step_time(&self, batch: usize) -> f64 {
        self.step + self.per_sequence * batch as f64
    }

    /// A request's work in steps of one sequence.
    fn work(&self, r: &TraceRequest) -> f64 {
        f64::from(r.generated_tokens.max(1))
            + f64::from(r.context_tokens) * self.prefill_per_token / self.step
    }

    /// The KV cache a request holds, tokens (at most the whole cache).
    fn kv(&self, r: &TraceRequest) -> u64 {
        u64::from(r.context_tokens.saturating_add(r.generated_tokens))
            .min(u64::from(self.kv_tokens))
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Starting(Duration),
    Ready,
    Draining,
}

struct Replica {
    state: State,
    alive: bool,
    idle_since: Duration,
    /// Requests the gateway sent it: waiting in its queue or running.
    waiting: VecDeque<usize>,
    /// Running: the request and its work left, in steps.
    batch: Vec<(usize, f64)>,
    kv_used: u64,
}

impl Replica {
    fn inflight(&self) -> u32 {
        (self.waiting.len() + self.batch.len()) as u32
    }

    fn ready(&self) -> bool {
        self.alive && self.state == State::Ready
    }
}

/// Replays `trace` against `policy` on engine replicas. `cfg.concurrency`
/// is the gateway's limit of requests sent to one replica at once.
pub fn simulate_engines(
    trace: &[TraceRequest],
    engine: &EngineModel,
    policy: &mut dyn Policy,
    cfg: &SimConfig,
) -> SimReport {
    let mut s = Engines::new(*cfg, *engine, trace.len());
    let mut timeline = Vec::new();
    let mut next = 0usize;
    let mut next_tick = cfg.tick;
    let mut since = SinceTick::default();
    let mut idle = Vec::new();
    let end = trace.last().map_or(Duration::ZERO, |r| r.arrival);
    loop {
        let busy = s.replicas.iter().any(|r| r.alive && r.inflight() > 0);
        if next >= trace.len() && s.queue.is_empty() && !busy {
            break;
        }
        let t_arrival = trace.get(next).map(|r| r.arrival);
        let (t_ready, t_done) = (s.next_ready(), s.next_completion());
        let t = [t_arrival, t_ready, t_done, Some(next_tick)]
            .into_iter()
            .flatten()
            .min()
            .expect("the tick is always there");
        s.advance(t);
        s.finish(trace);
        s.replicas_up(policy);
        while next < trace.len() && trace[next].arrival <= t {
            s.arrive(next, policy);
            next += 1;
        }
        if t >= next_tick {
            let totals = s.tally.totals(next);
            let demand = s.tick(policy, trace, since.take(totals, cfg.tick), &mut idle);
            timeline.push((t.as_secs_f64(), demand, s.live()));
            next_tick += cfg.tick;
            if t > end + Duration::from_secs(3600) {
                break;
            }
        }
        s.dispatch(trace);
    }
    s.report(policy.name(), timeline)
}

struct Engines {
    tally: Tally,
    cfg: SimConfig,
    engine: EngineModel,
    replicas: Vec<Replica>,
    queue: VecDeque<usize>,
    now: Duration,
}

/// Work below this is done (float noise of the batch's progress).
const DONE: f64 = 1e-6;

impl Engines {
    /// A platform of `engine` replicas, none yet, for a trace of
    /// `requests`.
    fn new(cfg: SimConfig, engine: EngineModel, requests: usize) -> Self {
        Engines {
            cfg,
            tally: Tally::new(requests),
            engine,
            replicas: Vec::new(),
            queue: VecDeque::new(),
            now: Duration::ZERO,
        }
    }

    /// When the next starting replica is ready, if any starts.
    fn next_ready(&self) -> Option<Duration> {
        self.replicas
            .iter()
            .filter(|r| r.alive)
            .filter_map(|r| match r.state {
                State::Starting(at) => Some(at),
                _ => None,
            })
            .min()
    }

    /// The replicas whose cold start is over take traffic, and the policy
    /// hears each one's cold start.
    fn replicas_up(&mut self, policy: &mut dyn Policy) {
        let t = self.now;
        for r in &mut self.replicas {
            if r.alive && matches!(r.state, State::Starting(at) if at <= t) {
                r.state = State::Ready;
                r.idle_since = t;
                policy.replica_ready(self.cfg.cold_start);
            }
        }
    }

    /// Request `req` arrives: refused when the gateway's queue is full,
    /// else queued, waking the policy when no replica is live.
    fn arrive(&mut self, req: usize, policy: &mut dyn Policy) {
        if self.queue.len() >= self.cfg.max_pending {
            self.tally.rejected += 1;
        } else {
            self.queue.push_back(req);
            if self.live() == 0 {
                let n = policy.wake(self.now);
                self.scale_to(n);
            }
        }
    }

    /// One policy tick with what changed since the last (demand, busy
    /// slot-seconds, arrivals, completions): expires what waited too long,
    /// shows the policy the platform and the engines' signals, and scales
    /// to its answer. Returns the tick's demand; `idle` is scratch space
    /// for the replicas' idle times.
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
        idle.extend(self.replicas.iter().filter(|r| r.ready()).map(|r| {
            if r.inflight() == 0 {
                t.saturating_sub(r.idle_since)
            } else {
                Duration::ZERO
            }
        }));
        let view = Tick {
            now: t,
            demand,
            queued: self.queue.len() as u32,
            inflight: self.replicas.iter().map(Replica::inflight).sum(),
            ready: self.replicas.iter().filter(|r| r.ready()).count() as u32,
            starting: self
                .replicas
                .iter()
                .filter(|r| r.alive && matches!(r.state, State::Starting(_)))
                .count() as u32,
            arrivals,
            completions,
            busy,
            idle,
            engine: self.signals(),
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

    /// When the next running request finishes, if any runs.
    fn next_completion(&self) -> Option<Duration> {
        self.replicas
            .iter()
            .filter(|r| r.alive && !r.batch.is_empty())
            .map(|r| {
                let least = r.batch.iter().map(|b| b.1).fold(f64::INFINITY, f64::min);
                let secs = least.max(0.0) * self.engine.step_time(r.batch.len());
                // Rounded up to the nanosecond, so the request is done
                // when the clock gets there.
                self.now + Duration::from_secs_f64(secs) + Duration::from_nanos(1)
            })
            .min()
    }

    fn advance(&mut self, t: Duration) {
        let dt = t.saturating_sub(self.now).as_secs_f64();
        let alive = self.replicas.iter().filter(|r| r.alive).count() as f64;
        let inflight: u32 = self.replicas.iter().map(Replica::inflight).sum();
        self.tally
            .advance(dt, alive, inflight, self.queue.len() as u32);
        for r in self.replicas.iter_mut().filter(|r| r.alive) {
            if r.batch.is_empty() {
                continue;
            }
            let steps = dt / self.engine.step_time(r.batch.len());
            for b in &mut r.batch {
                b.1 -= steps;
            }
        }
        self.now = t;
    }

    /// Ends the requests whose work is done and admits what now fits.
    fn finish(&mut self, trace: &[TraceRequest]) {
        let now = self.now;
        for i in 0..self.replicas.len() {
            let r = &mut self.replicas[i];
            if !r.alive {
                continue;
            }
            let before = r.batch.len();
            let engine = self.engine;
            r.batch.retain(|&(req, left)| {
                if left <= DONE {
                    r.kv_used -= engine.kv(&trace[req]);
                    false
                } else {
                    true
                }
            });
            let done = (before - r.batch.len()) as u64;
            self.tally.served += done;
            self.tally.completed += done;
            if done > 0 && r.inflight() == 0 {
                r.idle_since = now;
                if r.state == State::Draining {
                    r.alive = false;
                }
            }
            self.admit(i, trace);
        }
    }

    /// Takes what fits of replica `i`'s queue into its batch.
    fn admit(&mut self, i: usize, trace: &[TraceRequest]) {
        let (engine, now) = (self.engine, self.now);
        let r = &mut self.replicas[i];
        while let Some(&req) = r.waiting.front() {
            let need = engine.kv(&trace[req]);
            let fits = r.batch.is_empty()
                || (r.batch.len() < engine.max_batch as usize
                    && r.kv_used + need <= u64::from(engine.kv_tokens));
            if !fits {
                break;
            }
            r.waiting.pop_front();
            r.kv_used += need;
            r.batch.push((req, engine.work(&trace[req])));
            self.tally
                .delays
                .push(now.saturating_sub(trace[req].arrival).as_secs_f64());
        }
    }

    /// Sends the gateway's queue to the least loaded ready replicas under
    /// the gateway's limit.
    fn dispatch(&mut self, trace: &[TraceRequest]) {
        while let Some(&req) = self.queue.front() {
            let limit = self.cfg.concurrency;
            let best = self
                .replicas
                .iter()
                .enumerate()
                .filter(|(_, r)| r.ready() && r.inflight() < limit)
                .min_by_key(|(_, r)| r.inflight())
                .map(|(i, _)| i);
            let Some(i) = best else { return };
            self.queue.pop_front();
            if self.now.saturating_sub(trace[req].arrival) > self.cfg.queue_timeout {
                self.tally.timed_out += 1;
                continue;
            }
            self.replicas[i].waiting.push_back(req);
            self.admit(i, trace);
        }
    }

    fn expire(&mut self, trace: &[TraceRequest]) {
        let (now, timeout) = (self.now, self.cfg.queue_timeout);
        let before = self.queue.len();
        self.queue
            .retain(|&i| now.saturating_sub(trace[i].arrival) <= timeout);
        self.tally.timed_out += (before - self.queue.len()) as u64;
    }

    /// What the ready replicas' engines say, as the gateway reads them.
    fn signals(&self) -> Option<EngineSignals> {
        let mut s = EngineSignals::default();
        for r in self.replicas.iter().filter(|r| r.ready()) {
            s.read += 1;
            s.kv_read += 1;
            s.waiting += r.waiting.len() as f64;
            s.running += r.batch.len() as f64;
            s.kv_cache_usage += r.kv_used as f64 / f64::from(self.engine.kv_tokens.max(1));
        }
        (s.read > 0).then_some(s)
    }

    fn live(&self) -> u32 {
        self.replicas
            .iter()
            .filter(|r| r.alive && r.state != State::Draining)
            .count() as u32
    }

    fn scale_to(&mut self, n: u32) {
        let live = self.live();
        if n > live {
            for _ in live..n {
                self.replicas.push(Replica {
                    state: State::Starting(self.now + self.cfg.cold_start),
                    alive: true,
                    idle_since: self.now,
                    waiting: VecDeque::new(),
                    batch: Vec::new(),
                    kv_used: 0,
                });
                self.tally.cold_starts += 1;
            }
            return;
        }
        // Starting replicas first, then the longest idle, then drain busy
        // ones (they finish what they hold).
        let mut order: Vec<usize> = (0..self.replicas.len())
            .rev()
            .filter(|&i| {
                self.replicas[i].alive && matches!(self.replicas[i].state, State::Starting(_))
            })
            .collect();
        let mut idle: Vec<usize> = (0..self.replicas.len())
            .filter(|&i| self.replicas[i].ready() && self.replicas[i].inflight() == 0)
            .collect();
        idle.sort_by_key(|&i| self.replicas[i].idle_since);
        order.extend(idle);
        order.extend(
            (0..self.replicas.len())
                .rev()
                .filter(|&i| self.replicas[i].ready() && self.replicas[i].inflight() > 0),
        );
        for i in order.into_iter().take((live - n) as usize) {
            let r = &mut self.replicas[i];
            if r.inflight() == 0 {
                r.alive = false;
            } else {
                r.state = State::Draining;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::AlwaysPeak;

    fn request(at: f64, context: u32, generated: u32) -> TraceRequest {
        TraceRequest {
            arrival: Duration::from_secs_f64(at),
            context_tokens: context,
            generated_tokens: generated,
        }
    }

    fn cfg(concurrency: u32) -> SimConfig {
        SimConfig {
            cold_start: Duration::ZERO,
            concurrency,
            tick: Duration::from_secs(1),
            max_pending: 10_000,
            queue_timeout: Duration::from_secs(600),
        }
    }

    #[test]
    fn a_lone_request_takes_its_prefill_and_its_tokens_at_the_single_step() {
        let engine = EngineModel::default();
        let trace = [request(0.0, 1000, 100)];
        let r = simulate_engines(&trace, &engine, &mut AlwaysPeak(1), &cfg(64));
        assert_eq!(r.served, 1);
        // No wait: the replica was up from the start.
        assert!(r.p99() < 1e-6, "{r:?}");
    }

    #[test]
    fn a_full_kv_cache_queues_in_the_engine_and_the_wait_counts() {
        // Each request holds 40k of the 64k tokens: one at a time.
        let engine = EngineModel::default();
        let trace: Vec<_> = (0..4).map(|_| request(0.0, 39_000, 1000)).collect();
        let r = simulate_engines(&trace, &engine, &mut AlwaysPeak(1), &cfg(64));
        assert_eq!(r.served, 4);
        // The last waits for the three before it: each 1,000 steps plus
        // 195 of prefill, at 20.3 ms a step.
        let one = (1000.0 + 39_000.0 * 0.0001 / 0.02) * 0.0203;
        assert!(
            (r.p99() / (3.0 * one) - 1.0).abs() < 0.02,
            "p99 {} against {}",
            r.p99(),
            3.0 * one
        );
    }

    #[test]
    fn a_larger_batch_is_slower_a_step_but_faster_in_all() {
        let engine = EngineModel::default();
        let trace: Vec<_> = (0..32).map(|_| request(0.0, 100, 200)).collect();
        let wide = simulate_engines(&trace, &engine, &mut AlwaysPeak(1), &cfg(64));
        let narrow = simulate_engines(&trace, &engine, &mut AlwaysPeak(1), &cfg(1));
        assert_eq!((wide.served, narrow.served), (32, 32));
        // One at a time, the last waits for 31 requests; batched, none waits.
        assert!(wide.p99() < 1e-6, "{wide:?}");
        assert!(narrow.p99() > 31.0 * 200.0 * 0.02 * 0.99, "{narrow:?}");
    }
}
