//! Scaling on the engines' own signals: the requests waiting in their
//! queues and the fill of their KV caches, as the Gateway API Inference
//! Extension and KEDA setups scale vLLM (`vllm:num_requests_waiting`,
//! `vllm:kv_cache_usage_perc`).
//!
//! An engine with continuous batching takes far more requests at once than
//! a fixed slot count says, and is full when its KV cache is, not when a
//! count is reached. With targets set, the replicas the engines need are
//! the Kubernetes HPA's average-value rule over the replicas that were
//! read: `ceil(ready × mean / target)` for each signal, the larger of the
//! two. That count only ever raises what the in-flight rules ask for: a
//! missing or stale reading, or engines reading zero, never lowers the
//! count nor takes an app to zero (the counts of the gateway's own
//! requests stand, as without engine signals).

use crate::{CEIL_EPSILON, MAX_CONCURRENCY};

/// What the engines of the ready replicas said, over those whose reading
/// is fresh.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct EngineSignals {
    /// Replicas with a fresh reading that named a queue or a batch.
    pub read: u32,
    /// Requests waiting in their queues, summed.
    pub waiting: f64,
    /// Requests running in their batches, summed.
    pub running: f64,
    /// Replicas with a fresh reading of their KV cache.
    pub kv_read: u32,
    /// Their KV caches' fill (0 to 1 each), summed.
    pub kv_cache_usage: f64,
}

impl EngineSignals {
    /// Whether the engines hold any request (a request from another
    /// gateway, or one sent to the engine directly, keeps the app awake).
    pub fn busy(&self) -> bool {
        clean(self.waiting) + clean(self.running) > 0.0
    }
}

/// The engines' targets (`[apps.autoscale] target_waiting` and
/// `target_kv_cache_usage`); either may be left out.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct EngineTargets {
    /// Requests waiting in each engine's queue the policy aims at.
    pub waiting: Option<f64>,
    /// KV-cache fill (0 to 1) each engine is meant to run at.
    pub kv_cache_usage: Option<f64>,
}

/// The replicas the engines' signals ask for, with `ready` replicas up;
/// `None` when no target is set or no replica was read.
pub fn replicas_needed(s: &EngineSignals, t: &EngineTargets, ready: u32) -> Option<u32> {
    let ready = f64::from(ready.max(1));
    let need = |mean: f64, target: Option<f64>| -> Option<u32> {
        let target = target.filter(|t| t.is_finite() && *t > 0.0)?;
        let want = (ready * mean / target - CEIL_EPSILON).ceil();
        Some(want.clamp(0.0, f64::from(u32::MAX)) as u32)
    };
    let waiting = (s.read > 0)
        .then(|| need(clean(s.waiting) / f64::from(s.read), t.waiting))
        .flatten();
    let kv = (s.kv_read > 0)
        .then(|| {
            need(
                clean(s.kv_cache_usage).min(f64::from(s.kv_read)) / f64::from(s.kv_read),
                t.kv_cache_usage,
            )
        })
        .flatten();
    match (waiting, kv) {
        (None, None) => None,
        (a, b) => Some(a.unwrap_or(0).max(b.unwrap_or(0))),
    }
}

/// A reading as a count: not negative, not `NaN`, finite.
fn clean(v: f64) -> f64 {
    if v.is_finite() && v > 0.0 {
        v.min(MAX_CONCURRENCY)
    } else {
        0.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BOTH: EngineTargets = EngineTargets {
        waiting: Some(2.0),
        kv_cache_usage: Some(0.8),
    };

    fn read(n: u32, waiting: f64, kv: f64) -> EngineSignals {
        EngineSignals {
            read: n,
            waiting,
            running: 0.0,
            kv_read: n,
            kv_cache_usage: kv,
        }
    }

    #[test]
    fn a_queue_above_its_target_asks_for_replicas_in_proportion() {
        // Two replicas, 10 waiting: 5 each against a target of 2.
        assert_eq!(replicas_needed(&read(2, 10.0, 0.2), &BOTH, 2), Some(5));
        // Nobody waiting and caches a quarter full: one replica does.
        assert_eq!(replicas_needed(&read(2, 0.0, 0.5), &BOTH, 2), Some(1));
    }

    #[test]
    fn full_caches_ask_for_more_even_with_no_queue() {
        // Two caches at 96%: 2 × 0.96 / 0.8 = 2.4, so 3.
        assert_eq!(replicas_needed(&read(2, 0.0, 1.92), &BOTH, 2), Some(3));
    }

    #[test]
    fn nothing_read_or_no_target_says_nothing() {
        assert_eq!(replicas_needed(&read(0, 0.0, 0.0), &BOTH, 2), None);
        assert_eq!(
            replicas_needed(&read(2, 50.0, 2.0), &EngineTargets::default(), 2),
            None
        );
    }

    #[test]
    fn garbage_readings_neither_panic_nor_overflow() {
        for v in [f64::NAN, f64::INFINITY, -5.0, 1e300] {
            let n = replicas_needed(&read(1, v, v), &BOTH, 3);
            assert!(n.is_some());
        }
        assert!(!read(1, f64::NAN, 0.0).busy());
    }
}
