//! The cold-start-aware rules on virtual time, through the simulator: a
//! backlog the ready replicas drain first starts nothing, a burst that
//! lasts gets its replicas within seconds, and gaps shorter than a cold
//! start are ridden out.

use std::time::Duration;

use warmgate_autoscaler::sim::{
    Knative, ServiceModel, SimConfig, TraceRequest, simulate, warmgate,
};
use warmgate_autoscaler::{ScaleToZero, ScalingConfig};

/// Every request holds its slot for `secs`.
fn model(secs: u64) -> ServiceModel {
    ServiceModel {
        base: Duration::from_secs(secs),
        per_context_token: Duration::ZERO,
        per_generated_token: Duration::ZERO,
    }
}

fn sim(cold: u64) -> SimConfig {
    SimConfig {
        cold_start: Duration::from_secs(cold),
        concurrency: 8,
        tick: Duration::from_secs(1),
        max_pending: 100_000,
        queue_timeout: Duration::from_secs(600),
    }
}

fn scaling() -> ScalingConfig {
    ScalingConfig {
        min: 0,
        max: 20,
        target: 5.6,
        concurrency: 8,
        ..ScalingConfig::default()
    }
}

/// `n` requests evenly over `[from, from + secs)`.
fn even(from: f64, secs: f64, n: u32) -> Vec<TraceRequest> {
    (0..n)
        .map(|i| TraceRequest {
            arrival: Duration::from_secs_f64(from + secs * f64::from(i) / f64::from(n)),
            context_tokens: 0,
            generated_tokens: 0,
        })
        .collect()
}

fn sorted(mut t: Vec<TraceRequest>) -> Vec<TraceRequest> {
    t.sort_by_key(|r| r.arrival);
    t
}

#[test]
fn a_spike_the_ready_replica_drains_before_a_cold_start_starts_nothing() {
    // One request a second (one replica), then 100 at once: one replica
    // serves them in about 13 s, long before a 60 s cold start ends.
    let mut trace = even(0.0, 300.0, 300);
    trace.extend(even(300.0, 0.5, 100));
    trace.extend(even(301.0, 100.0, 100));
    let trace = sorted(trace);
    let wg = simulate(&trace, &model(1), &mut warmgate(scaling()), &sim(60));
    let kn = simulate(&trace, &model(1), &mut Knative::new(5.6, 0, 20), &sim(60));
    // Replicas before the spike, and the most during the next minutes.
    let around = |r: &warmgate_autoscaler::sim::SimReport| {
        let before = r.timeline.iter().find(|p| p.0 >= 299.0).map_or(0, |p| p.2);
        let during = r
            .timeline
            .iter()
            .filter(|p| p.0 >= 300.0 && p.0 < 420.0)
            .map(|p| p.2)
            .max()
            .unwrap_or(0);
        (before, during)
    };
    let (before, during) = around(&wg);
    assert_eq!(before, 1);
    assert_eq!(during, 1, "warmgate started replicas for the spike");
    let (before, during) = around(&kn);
    assert!(
        during > before,
        "Knative's panic starts replicas: {before} -> {during}"
    );
    assert!(wg.replica_seconds < kn.replica_seconds);
}

#[test]
fn a_burst_that_lasts_gets_its_replicas_within_seconds() {
    // One request a second, then 30 a second for ten minutes: 30 slots
    // busy, six replicas at the target.
    let mut trace = even(0.0, 300.0, 300);
    trace.extend(even(300.0, 600.0, 18_000));
    let trace = sorted(trace);
    let wg = simulate(&trace, &model(1), &mut warmgate(scaling()), &sim(20));
    let by = |t: f64| {
        wg.timeline
            .iter()
            .filter(|p| p.0 <= t)
            .map(|p| p.2)
            .next_back()
            .unwrap_or(0)
    };
    assert!(by(299.0) <= 2, "{}", by(299.0));
    assert!(by(310.0) >= 5, "asked for {} replicas 10 s in", by(310.0));
    assert!(by(600.0) >= 5 && by(600.0) <= 8, "{}", by(600.0));
}

#[test]
fn gaps_shorter_than_a_cold_start_are_ridden_out() {
    // 60 requests every 40 s for an hour, with a 60 s cold start.
    let mut trace = Vec::new();
    for k in 0..90 {
        trace.extend(even(f64::from(k) * 40.0, 2.0, 60));
    }
    let trace = sorted(trace);
    let wg = simulate(&trace, &model(2), &mut warmgate(scaling()), &sim(60));
    // Once the first bursts have been seen (and the service time
    // measured), the count never drops to zero and nothing starts again.
    let settled: Vec<u32> = wg
        .timeline
        .iter()
        .filter(|p| p.0 > 300.0 && p.0 < 3500.0)
        .map(|p| p.2)
        .collect();
    assert!(
        settled.iter().all(|&n| n >= 1),
        "back to zero between bursts"
    );
    assert!(
        settled.windows(2).all(|w| w[1] <= w[0]),
        "a replica started again after the first minutes"
    );
    // Only the first bursts wait for a cold start; the rest are served by
    // the replicas standing by (one drains a burst in 15 s).
    assert!(wg.queue_delay[1] < 20.0, "p95 {:?}", wg.queue_delay);
}

#[test]
fn a_spike_at_zero_starts_a_few_replicas_and_no_more_while_it_waits() {
    // Spikes of 100 requests of 4 s, all within half a second, every
    // 400 s, against a 60 s cold start: the app is at zero before each.
    // One slot for each would be 13 replicas (780 replica-seconds of cold
    // start to save each request a few seconds); once the first spikes
    // have shown how short they are, a few replicas drain each one over
    // some service times instead.
    let mut trace = even(0.0, 1.0, 1);
    for k in 1..=5 {
        trace.extend(even(f64::from(k) * 400.0, 0.5, 100));
    }
    let trace = sorted(trace);
    // A fixed minute, so the app is at zero before each spike: under
    // `auto` a 400 s gap is cheaper to keep a replica through than a
    // restart that 100 requests wait for (see `linger.rs`).
    let at_zero = ScalingConfig {
        scale_to_zero_after: ScaleToZero::After(Duration::from_secs(60)),
        ..scaling()
    };
    let wg = simulate(&trace, &model(4), &mut warmgate(at_zero), &sim(60));
    let counts = |from: f64| -> Vec<u32> {
        wg.timeline
            .iter()
            .filter(|p| p.0 >= from && p.0 < from + 60.0)
            .map(|p| p.2)
            .collect()
    };
    let before = wg
        .timeline
        .iter()
        .find(|p| p.0 >= 1999.0)
        .map_or(99, |p| p.2);
    assert_eq!(before, 0, "not at zero before the last spike");
    let last = counts(2000.0);
    let most = last.iter().copied().max().unwrap_or(0);
    assert!(
        (2..=6).contains(&most),
        "started {most} replicas for the last spike: {last:?}"
    );
    // The queue sits through the whole cold start; the count it asked for
    // early does not creep up tick after tick.
    let settled = last[5..].to_vec();
    assert!(
        settled.windows(2).all(|w| w[1] <= w[0]),
        "the count grew while the spike waited: {last:?}"
    );
    // Once they are ready they are kept while the spike still waits for
    // their slots, not dropped back to what the rate alone would need.
    let ready_at = 2000.0 + 61.0;
    let draining: Vec<u32> = wg
        .timeline
        .iter()
        .filter(|p| p.0 >= ready_at && p.0 < ready_at + 6.0 && p.1 > 0.0)
        .map(|p| p.2)
        .collect();
    assert!(
        !draining.is_empty() && draining.iter().all(|&n| n == most),
        "replicas dropped while the spike waited: {draining:?} of {most}"
    );
    assert_eq!(wg.served, 501);
    // Each spike waited its cold start and then a few service times.
    assert!(wg.queue_delay[2] < 60.0 + 6.0 * 4.0, "{:?}", wg.queue_delay);
}
