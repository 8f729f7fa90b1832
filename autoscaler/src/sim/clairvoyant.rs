//! A clairvoyant schedule: replicas planned with knowledge of every future
//! arrival, to show how far a policy is from the best possible.
//!
//! It knows, for every second, how many requests would be in flight if
//! none ever waited, and so how many replicas that takes. It starts each
//! one exactly one cold start before it is needed and keeps a replica
//! through any gap shorter than a cold start (stopping and starting it
//! again would cost more). Running fewer replicas than that saves capacity
//! at the price of waiting, so [`frontier`] runs the schedule at a range
//! of fractions of the no-wait need and [`Frontier::bound`] answers: the
//! fewest replica-seconds with which it met a given p99.
//!
//! This is the best of a family of schedules, not a proof of optimality:
//! a bound in the sense that a policy that does no better than it knows
//! as much as the future tells.

use std::time::Duration;

use super::{Policy, ServiceModel, SimConfig, Tick, TraceRequest, simulate};

/// Fractions of the no-wait need the frontier is drawn at.
pub const FRACTIONS: [f64; 14] = [
    1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.65, 0.6, 0.55, 0.5, 0.45, 0.4, 0.35,
];

/// A precomputed schedule: the count for each second.
pub struct Clairvoyant {
    desired: Vec<u32>,
    fraction: f64,
}

impl Clairvoyant {
    /// The schedule for `trace` at `fraction` of the no-wait need, with
    /// replicas of `concurrency` slots that take `cold_start` to start,
    /// never more than `max`.
    pub fn plan(
        trace: &[TraceRequest],
        model: &ServiceModel,
        concurrency: u32,
        cold_start: Duration,
        max: u32,
        fraction: f64,
    ) -> Self {
        let need: Vec<u32> = no_wait_inflight(trace, model)
            .into_iter()
            .map(|d| {
                let n = (fraction * f64::from(d) / f64::from(concurrency.max(1)) - 1e-9).ceil();
                (n.max(0.0) as u32).max(u32::from(d > 0)).min(max.max(1))
            })
            .collect();
        // Each second's count covers what is needed from now until one cold
        // start (and a tick) ahead: that starts replicas in time and holds
        // them through gaps shorter than a cold start.
        let lead = cold_start.as_secs_f64().ceil() as usize + 1;
        let desired = (0..need.len())
            .map(|i| {
                need[i..need.len().min(i + lead + 1)]
                    .iter()
                    .copied()
                    .max()
                    .unwrap_or(0)
            })
            .collect();
        Clairvoyant { desired, fraction }
    }

    fn at(&self, now: Duration) -> u32 {
        let i = now.as_secs() as usize;
        self.desired.get(i).copied().unwrap_or(0)
    }
}

impl Policy for Clairvoyant {
    fn name(&self) -> String {
        format!("clairvoyant ({:.0}%)", self.fraction * 100.0)
    }
    fn tick(&mut self, t: &Tick<'_>) -> u32 {
        let n = self.at(t.now);
        // It knows the future, not the present's stragglers: never stop
        // with work still waiting.
        if t.queued > 0 { n.max(1) } else { n }
    }
    fn wake(&mut self, now: Duration) -> u32 {
        self.at(now).max(1)
    }
}

/// For each second of the trace, the most requests in flight at once if
/// every request started the moment it arrived.
pub fn no_wait_inflight(trace: &[TraceRequest], model: &ServiceModel) -> Vec<u32> {
    let mut events: Vec<(Duration, i32)> = Vec::with_capacity(trace.len() * 2);
    for r in trace {
        events.push((r.arrival, 1));
        events.push((r.arrival + model.service(r), -1));
    }
    // Ends before starts at the same instant.
    events.sort_unstable();
    let last = events.last().map_or(0, |(t, _)| t.as_secs() as usize);
    let mut out = vec![0u32; last + 1];
    let (mut level, mut prev) = (0i64, Duration::ZERO);
    for (t, delta) in events {
        if t > prev && level > 0 {
            // The level held over [prev, t): every second it touches.
            let from = prev.as_secs() as usize;
            let to = if t.subsec_nanos() == 0 {
                t.as_secs() as usize - 1
            } else {
                t.as_secs() as usize
            };
            for slot in &mut out[from..=to] {
                *slot = (*slot).max(level as u32);
            }
        }
        level += i64::from(delta);
        prev = t;
    }
    out
}

/// The clairvoyant schedule's cost and p99 at each of [`FRACTIONS`].
#[derive(Debug, Clone)]
pub struct Frontier {
    /// (replica-seconds, p99 wait in seconds), one per fraction.
    pub points: Vec<(f64, f64)>,
}

impl Frontier {
    /// The fewest replica-seconds with which the clairvoyant schedule kept
    /// the p99 wait at or under `p99`; `None` when it never did.
    pub fn bound(&self, p99: f64) -> Option<f64> {
        self.points
            .iter()
            .filter(|(_, p)| *p <= p99 + 1e-9)
            .map(|(rs, _)| *rs)
            .min_by(f64::total_cmp)
    }
}

/// Runs the clairvoyant schedule at every fraction.
pub fn frontier(
    trace: &[TraceRequest],
    model: &ServiceModel,
    cfg: &SimConfig,
    max: u32,
) -> Frontier {
    let points = FRACTIONS
        .iter()
        .map(|&f| {
            let mut p = Clairvoyant::plan(trace, model, cfg.concurrency, cfg.cold_start, max, f);
            let r = simulate(trace, model, &mut p, cfg);
            (r.replica_seconds, r.p99())
        })
        .collect();
    Frontier { points }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(at: f64) -> TraceRequest {
        TraceRequest {
            arrival: Duration::from_secs_f64(at),
            context_tokens: 0,
            generated_tokens: 0,
        }
    }

    #[test]
    fn no_wait_inflight_counts_overlaps_per_second() {
        // Each request holds its slot 2 s (base only).
        let model = ServiceModel {
            base: Duration::from_secs(2),
            per_context_token: Duration::ZERO,
            per_generated_token: Duration::ZERO,
        };
        let d = no_wait_inflight(&[req(0.5), req(1.0), req(1.5), req(6.0)], &model);
        // [0.5, 2.5), [1, 3), [1.5, 3.5), [6, 8): two end at 2.5 and 3.
        assert_eq!(d, vec![1, 3, 3, 1, 0, 0, 1, 1, 0]);
    }

    #[test]
    fn the_schedule_starts_a_cold_start_ahead_and_rides_out_short_gaps() {
        let model = ServiceModel {
            base: Duration::from_secs(1),
            per_context_token: Duration::ZERO,
            per_generated_token: Duration::ZERO,
        };
        // Requests at 20 s and 25 s (a gap shorter than a 10 s start), then
        // at 60 s (a longer one).
        let trace = [req(20.0), req(25.0), req(60.0)];
        let c = Clairvoyant::plan(&trace, &model, 1, Duration::from_secs(10), 4, 1.0);
        let at = |s| c.at(Duration::from_secs(s));
        assert_eq!(at(8), 0);
        assert_eq!(at(9), 1, "started 11 s ahead");
        assert_eq!(at(23), 1, "held through the 4 s gap");
        assert_eq!(at(27), 0, "stopped for the 35 s gap");
        assert_eq!(at(49), 1);
    }
}
