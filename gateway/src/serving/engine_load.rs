//! What the ready replicas' engines say, summed for the autoscaler: the
//! readings of `[apps.engine]` that are fresh, and only those. The cache
//! of an engine that holds no request counts as empty.

use std::sync::Arc;
use std::time::{Duration, Instant};

use warmgate_autoscaler::EngineSignals;
use warmgate_pool::ReplicaHandle;

/// The sum of the fresh readings (no older than `max_age` at `now`) of
/// `replicas`; `None` when none is fresh, so a stale reading never reads
/// as an idle engine.
pub fn engine_signals(
    replicas: &[Arc<ReplicaHandle>],
    now: Instant,
    max_age: Duration,
) -> Option<EngineSignals> {
    let mut s = EngineSignals::default();
    for load in replicas
        .iter()
        .filter_map(|r| r.engine())
        .filter_map(|e| e.fresh(now, max_age))
    {
        if load.running.is_some() || load.waiting.is_some() {
            s.read += 1;
            s.running += f64::from(load.running.unwrap_or(0));
            s.waiting += f64::from(load.waiting.unwrap_or(0));
        }
        if let Some(kv) = load.kv_cache_usage {
            s.kv_read += 1;
            // An engine that holds no request may keep finished prompts
            // in its cache (llama.cpp's server does); that fill is free
            // to evict and asks for no replica.
            if load.holding() != Some(0) {
                s.kv_cache_usage += kv;
            }
        }
    }
    (s.read > 0 || s.kv_read > 0).then_some(s)
}
