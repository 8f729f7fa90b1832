//! Unit tests of the serving-app policy (`lib.rs`).

use super::*;

#[test]
fn replicas_for_rounds_up_and_ignores_noise() {
    assert_eq!(replicas_for(0.0, 4.0), 0);
    assert_eq!(replicas_for(1e-12, 4.0), 1);
    assert_eq!(replicas_for(4.0, 4.0), 1);
    assert_eq!(replicas_for(4.000_000_000_01, 4.0), 1);
    assert_eq!(replicas_for(4.1, 4.0), 2);
    assert_eq!(replicas_for(10.0, 4.0), 3);
    assert_eq!(replicas_for(0.1 + 0.2, 0.3), 1);
    assert_eq!(replicas_for(MAX_CONCURRENCY, 1e-300), u32::MAX);
}

#[test]
fn sanitize_concurrency_handles_garbage() {
    assert_eq!(sanitize_concurrency(f64::NAN), 0.0);
    assert_eq!(sanitize_concurrency(-3.0), 0.0);
    assert_eq!(sanitize_concurrency(f64::INFINITY), MAX_CONCURRENCY);
    assert_eq!(sanitize_concurrency(2.5), 2.5);
}

#[test]
fn an_app_with_suspend_after_stops_its_min_replicas_when_idle_and_a_request_wakes_it() {
    let mut a = Autoscaler::new(ScalingConfig {
        min: 2,
        max: 4,
        target: 1.0,
        suspend_after: Some(Duration::from_secs(600)),
        ..ScalingConfig::default()
    });
    let at = |a: &mut Autoscaler, s: u64, c: f64| {
        a.observe(Observation {
            now: Duration::from_secs(s),
            concurrency: c,
            ready: 2,
            ..Observation::default()
        })
        .desired
    };
    // Warm at start, and through idleness shorter than suspend_after.
    assert_eq!(at(&mut a, 0, 0.0), 2);
    assert_eq!(at(&mut a, 599, 0.0), 2);
    // A request in flight restarts the count.
    assert_eq!(at(&mut a, 300 + 299, 1.0), 2);
    assert_eq!(at(&mut a, 1198, 0.0), 2);
    // Idle for the whole period: below min, to zero.
    assert_eq!(at(&mut a, 1199, 0.0), 0);
    assert_eq!(at(&mut a, 5000, 0.0), 0);
    // A request wakes it to min at once, and min holds again after.
    assert_eq!(a.wake(Duration::from_secs(5001)), 2);
    assert_eq!(at(&mut a, 5002, 0.0), 2);
    assert_eq!(at(&mut a, 5600, 0.0), 2);
    // Without suspend_after, min runs for ever.
    let mut b = Autoscaler::new(ScalingConfig {
        min: 2,
        max: 4,
        target: 1.0,
        ..ScalingConfig::default()
    });
    assert_eq!(at(&mut b, 0, 0.0), 2);
    assert_eq!(at(&mut b, 100_000, 0.0), 2);
}

#[test]
fn a_target_that_fails_to_start_is_not_kept_for_its_cold_start() {
    let config = ScalingConfig {
        min: 0,
        max: 4,
        target: 1.0,
        scale_to_zero_after: ScaleToZero::After(Duration::from_secs(60)),
        ..ScalingConfig::default()
    };
    let idle = |a: &mut Autoscaler, s: u64| {
        a.observe(Observation {
            now: Duration::from_secs(s),
            concurrency: 0.0,
            ready: 0,
            ..Observation::default()
        })
        .desired
    };
    // Woken, never ready, nothing asks any more: kept for the start.
    let mut a = Autoscaler::new(config.clone());
    assert_eq!(a.wake(Duration::ZERO), 1);
    assert_eq!(idle(&mut a, 90), 1);
    // Its start failed: to zero once the idle time has passed.
    let mut b = Autoscaler::new(config);
    assert_eq!(b.wake(Duration::ZERO), 1);
    b.start_failed();
    assert_eq!(idle(&mut b, 30), 1);
    assert_eq!(idle(&mut b, 90), 0);
}

#[test]
fn a_new_config_keeps_the_observed_load() {
    let mut a = Autoscaler::new(ScalingConfig {
        min: 0,
        max: 10,
        target: 1.0,
        ..ScalingConfig::default()
    });
    let load = |a: &mut Autoscaler, s: u64| {
        a.observe(Observation {
            now: Duration::from_secs(s),
            concurrency: 6.0,
            ready: 6,
            ..Observation::default()
        })
        .desired
    };
    for s in 0..10 {
        load(&mut a, s);
    }
    assert_eq!(a.desired(), 6);
    // A lower max applies at once and on every tick after it.
    a.set_config(ScalingConfig {
        min: 0,
        max: 3,
        target: 1.0,
        ..ScalingConfig::default()
    });
    assert_eq!(a.desired(), 3);
    assert_eq!(load(&mut a, 10), 3);
    // A larger target halves the need at once: the load was kept.
    a.set_config(ScalingConfig {
        min: 0,
        max: 10,
        target: 2.0,
        ..ScalingConfig::default()
    });
    assert_eq!(load(&mut a, 11), 3);
    // A min above the last decision lifts it.
    a.set_config(ScalingConfig {
        min: 5,
        max: 10,
        target: 2.0,
        ..ScalingConfig::default()
    });
    assert_eq!(a.desired(), 5);
}

#[test]
fn samples_stay_bounded() {
    let mut a = Autoscaler::new(ScalingConfig::default());
    assert_eq!(a.sample_cap, MAX_SAMPLES);
    // A smaller cap keeps the debug-build test fast; same code path.
    a.sample_cap = 100;
    for i in 0..1_000 {
        let d = a.observe(Observation {
            now: Duration::from_micros(i),
            concurrency: if i < 900 { 0.0 } else { 8.0 },
            ready: 2,
            ..Observation::default()
        });
        assert!(a.samples.len() <= 100);
        if i == 999 {
            // Only the newest 100 samples (all loaded) are averaged.
            assert_eq!(d.stable_concurrency, 8.0);
            assert_eq!(d.desired, 2);
        }
    }
    assert_eq!(a.samples.len(), 100);
    assert_eq!(
        a.samples.front().map(|&(t, _)| t),
        Some(Duration::from_micros(900))
    );
}

#[test]
fn old_samples_are_dropped() {
    let mut a = Autoscaler::new(ScalingConfig::default());
    for s in 0..200 {
        a.observe(Observation {
            now: Duration::from_secs(s),
            concurrency: 1.0,
            ready: 1,
            ..Observation::default()
        });
    }
    assert_eq!(a.samples.len(), 60);
}

#[test]
fn time_going_backwards_does_not_panic() {
    let mut a = Autoscaler::new(ScalingConfig::default());
    let at = |s, c| Observation {
        now: Duration::from_secs(s),
        concurrency: c,
        ready: 1,
        ..Observation::default()
    };
    a.observe(at(100, 4.0));
    let d = a.observe(at(10, 0.0));
    assert_eq!(a.samples.len(), 1);
    assert_eq!(d.stable_concurrency, 0.0);
    // Activity at t=100 is still remembered, so no scale-to-zero yet.
    assert_eq!(d.desired, 1);
}
