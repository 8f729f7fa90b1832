//! Scenario tests for the KPA v1 policy, all on virtual time.

use std::time::Duration;

use warmgate_autoscaler::{Autoscaler, Decision, Observation, ScaleToZero, ScalingConfig};

fn secs(s: u64) -> Duration {
    Duration::from_secs(s)
}

fn tick(a: &mut Autoscaler, s: u64, concurrency: f64, ready: u32) -> Decision {
    a.observe(Observation {
        now: secs(s),
        concurrency,
        ready,
        ..Observation::default()
    })
}

// === steady state and bounds ===

#[test]
fn steady_load_follows_target() {
    let mut a = Autoscaler::new(ScalingConfig::default());
    assert_eq!(a.desired(), 0);
    for s in 0..180 {
        // The gateway's replicas catch up with the last decision.
        let ready = a.desired();
        let d = tick(&mut a, s, 10.0, ready);
        assert_eq!(d.desired, 3, "t={s}: {d:?}");
        assert!(!d.panicking, "t={s}: {d:?}");
        assert_eq!(a.desired(), 3);
    }
}

#[test]
fn clamps_to_max() {
    let mut a = Autoscaler::new(ScalingConfig::default());
    for s in 0..120 {
        let d = tick(&mut a, s, 100.0, 4);
        assert_eq!(d.desired, 4, "t={s}: {d:?}");
    }
}

#[test]
fn min_is_respected() {
    let config = ScalingConfig {
        min: 2,
        ..ScalingConfig::default()
    };
    let mut a = Autoscaler::new(config);
    assert_eq!(a.desired(), 2);
    for s in 0..30 {
        assert_eq!(tick(&mut a, s, 1.0, 2).desired, 2);
    }
    // Long idle: min > 0 disables scale-to-zero.
    for s in 30..400 {
        assert_eq!(tick(&mut a, s, 0.0, 2).desired, 2);
    }
}

#[test]
fn odd_config_uses_max_as_bound() {
    let config = ScalingConfig {
        min: 5,
        max: 2,
        target: 0.0,
        ..ScalingConfig::default()
    };
    let mut a = Autoscaler::new(config);
    assert_eq!(a.desired(), 2);
    assert_eq!(tick(&mut a, 0, 0.0, 0).desired, 2);
    assert_eq!(tick(&mut a, 1, 50.0, 0).desired, 2);
    assert_eq!(a.wake(secs(2)), 2);
}

// === scale to zero ===

#[test]
fn never_active_stays_at_zero() {
    let mut a = Autoscaler::new(ScalingConfig::default());
    for s in 0..100 {
        assert_eq!(tick(&mut a, s, 0.0, 0).desired, 0);
    }
}

#[test]
fn scales_to_zero_exactly_after_idle_period() {
    let mut a = Autoscaler::new(ScalingConfig::default());
    for s in 0..10 {
        assert_eq!(tick(&mut a, s, 10.0, 3).desired, 3);
    }
    // Last activity at t=9; scale_to_zero_after = 60 s.
    for s in 10..69 {
        let d = tick(&mut a, s, 0.0, 3);
        assert!(d.desired >= 1, "scaled to zero early at t={s}: {d:?}");
    }
    assert_eq!(tick(&mut a, 69, 0.0, 1).desired, 0);
    assert_eq!(tick(&mut a, 70, 0.0, 0).desired, 0);
}

#[test]
fn scale_to_zero_overrides_longer_stable_window() {
    let config = ScalingConfig {
        scale_to_zero_after: ScaleToZero::After(secs(30)),
        ..ScalingConfig::default()
    };
    assert_eq!(config.stable_window, secs(60));
    let mut a = Autoscaler::new(config);
    for s in 0..10 {
        tick(&mut a, s, 10.0, 3);
    }
    let d = tick(&mut a, 38, 0.0, 3);
    assert!(d.desired >= 1, "{d:?}");
    let d = tick(&mut a, 39, 0.0, 3);
    assert!(d.stable_concurrency > 0.0, "window still sees load: {d:?}");
    assert_eq!(d.desired, 0, "{d:?}");
}

#[test]
fn keeps_last_replica_while_window_reads_zero() {
    let config = ScalingConfig {
        stable_window: secs(10),
        panic_window: secs(2),
        scale_to_zero_after: ScaleToZero::After(secs(120)),
        ..ScalingConfig::default()
    };
    let mut a = Autoscaler::new(config);
    tick(&mut a, 0, 1.0, 0);
    for s in 1..120 {
        let d = tick(&mut a, s, 0.0, 1);
        assert_eq!(d.desired, 1, "t={s}: {d:?}");
    }
    assert_eq!(tick(&mut a, 120, 0.0, 1).desired, 0);
}

// === wake ===

#[test]
fn wake_from_zero_is_immediate_and_sticks() {
    let mut a = Autoscaler::new(ScalingConfig::default());
    for s in 0..100 {
        assert_eq!(tick(&mut a, s, 0.0, 0).desired, 0);
    }
    let woke_at = secs(100) + Duration::from_millis(500);
    assert_eq!(a.wake(woke_at), 1);
    assert_eq!(a.desired(), 1);
    // Cold start: nothing ready yet, and the tick saw no load.
    for s in 101..=160 {
        let d = tick(&mut a, s, 0.0, 0);
        assert_eq!(d.desired, 1, "t={s}: {d:?}");
    }
    // 60.5 s after the wake.
    assert_eq!(tick(&mut a, 161, 0.0, 1).desired, 0);
}

/// A stock server loading its weights for minutes: the request that woke
/// it gave up long ago and the app reads idle, but the start is kept until
/// the app's `startup_timeout`, not stopped halfway.
#[test]
fn a_slow_first_start_is_kept_until_the_start_timeout() {
    let mut a = Autoscaler::new(ScalingConfig {
        scale_to_zero_after: ScaleToZero::After(secs(10)),
        start_timeout: secs(900),
        ..ScalingConfig::default()
    });
    assert_eq!(a.wake(secs(0)), 1);
    for s in 1..900 {
        let d = tick(&mut a, s, 0.0, 0);
        assert_eq!(d.desired, 1, "t={s}: {d:?}");
    }
    // Never ready within it: the start is given up.
    assert_eq!(tick(&mut a, 900, 0.0, 0).desired, 0);
}

#[test]
fn wake_keeps_a_higher_count_and_respects_max() {
    let mut a = Autoscaler::new(ScalingConfig::default());
    tick(&mut a, 0, 12.0, 0);
    assert_eq!(a.desired(), 3);
    assert_eq!(a.wake(secs(1)), 3);

    let config = ScalingConfig {
        min: 2,
        max: 3,
        ..ScalingConfig::default()
    };
    let mut a = Autoscaler::new(config);
    assert_eq!(a.wake(secs(0)), 2);
}

#[test]
fn demand_at_zero_ready_is_a_wake_not_a_panic() {
    let mut a = Autoscaler::new(ScalingConfig::default());
    let d = tick(&mut a, 0, 40.0, 0);
    assert!(!d.panicking, "{d:?}");
    assert_eq!(d.desired, 4);
}

// === panic ===

fn panic_config() -> ScalingConfig {
    ScalingConfig {
        max: 10,
        target: 1.0,
        scale_to_zero_after: ScaleToZero::After(secs(600)),
        ..ScalingConfig::default()
    }
}

#[test]
fn spike_panics_raises_at_once_never_lowers_and_ends_after_stable_window() {
    let mut a = Autoscaler::new(panic_config());
    // Ready stays at 2 here: the panic's starts are never ready, and their
    // commitment lapses after three cold starts, long before panic ends.
    a.observe_cold_start(secs(5));
    for s in 0..60 {
        let d = tick(&mut a, s, 2.0, 2);
        assert_eq!(d.desired, 2);
        assert!(!d.panicking);
    }

    // Spike: panic mean (5*2 + 20)/6 = 5 is 250% of the 2 ready replicas.
    let d = tick(&mut a, 60, 20.0, 2);
    assert!(d.panicking, "{d:?}");
    assert_eq!(d.desired, 5, "{d:?}");

    // Load falls to 1; the panic window keeps re-triggering until the
    // spike leaves it (last trigger at t=65), then panic holds 60 s more.
    let mut prev = d.desired;
    for s in 61..125 {
        let d = tick(&mut a, s, 1.0, 2);
        assert!(d.panicking, "t={s}: {d:?}");
        assert!(d.desired >= prev, "panic lowered the count at t={s}: {d:?}");
        prev = d.desired;
    }
    assert_eq!(prev, 5);

    let d = tick(&mut a, 125, 1.0, 2);
    assert!(!d.panicking, "{d:?}");
    assert_eq!(d.desired, 1, "{d:?}");
}

#[test]
fn panic_follows_a_growing_burst() {
    let mut a = Autoscaler::new(panic_config());
    tick(&mut a, 0, 1.0, 1);
    let mut prev = 0;
    for (s, load) in (1..6).zip([4.0, 8.0, 16.0, 32.0, 64.0]) {
        let d = tick(&mut a, s, load, 1);
        assert!(d.panicking, "t={s}: {d:?}");
        assert!(d.desired >= prev);
        prev = d.desired;
    }
    assert_eq!(prev, 10, "clamped to max");
}

#[test]
fn scale_to_zero_ends_panic() {
    let config = ScalingConfig {
        scale_to_zero_after: ScaleToZero::After(secs(30)),
        ..panic_config()
    };
    let mut a = Autoscaler::new(config);
    // The replicas asked for in panic never come up here: their
    // commitment lapses after three cold starts.
    a.observe_cold_start(secs(5));
    let d = tick(&mut a, 0, 20.0, 1);
    assert!(d.panicking);
    for s in 1..30 {
        assert!(tick(&mut a, s, 0.0, 1).desired >= 1);
    }
    let d = tick(&mut a, 30, 0.0, 1);
    assert_eq!(d.desired, 0, "{d:?}");
    assert!(!d.panicking, "{d:?}");
}

// === KPA knobs: rates, scale-down delay, predictive ===

/// Runs `load(t)` for `n` ticks from `start`, with ready replicas
/// following the count one tick behind; returns the counts.
fn run(a: &mut Autoscaler, start: u64, n: u64, load: impl Fn(u64) -> f64) -> Vec<u32> {
    (start..start + n)
        .map(|s| {
            let ready = a.desired();
            tick(a, s, load(s), ready).desired
        })
        .collect()
}

#[test]
fn scale_down_is_limited_to_halving_per_tick() {
    let config = ScalingConfig {
        min: 1,
        max: 16,
        target: 1.0,
        stable_window: secs(1),
        panic_window: secs(1),
        ..ScalingConfig::default()
    };
    let mut a = Autoscaler::new(config);
    assert_eq!(run(&mut a, 0, 2, |_| 16.0), [16, 16]);
    // Demand drops to 1: 16 -> 8 -> 4 -> 2 -> 1, never straight to 1.
    assert_eq!(run(&mut a, 2, 5, |_| 1.0), [8, 4, 2, 1, 1]);
}

#[test]
fn scale_up_is_limited_by_its_rate_but_never_takes_back() {
    let config = ScalingConfig {
        min: 1,
        max: 64,
        target: 1.0,
        stable_window: secs(1),
        panic_window: secs(1),
        max_scale_up_rate: 2.0,
        ..ScalingConfig::default()
    };
    let mut a = Autoscaler::new(config);
    assert_eq!(run(&mut a, 0, 1, |_| 1.0), [1]);
    assert_eq!(run(&mut a, 1, 6, |_| 40.0), [2, 4, 8, 16, 32, 40]);
}

#[test]
fn the_scale_down_delay_holds_the_highest_recent_count() {
    let config = ScalingConfig {
        min: 1,
        max: 16,
        target: 1.0,
        stable_window: secs(1),
        panic_window: secs(1),
        max_scale_down_rate: 1000.0,
        scale_down_delay: secs(10),
        ..ScalingConfig::default()
    };
    let mut a = Autoscaler::new(config);
    run(&mut a, 0, 3, |_| 6.0);
    let after = run(&mut a, 3, 12, |_| 2.0);
    // Held at 6 while 6 is within the last 10 s, then down at once.
    assert!(after[..8].iter().all(|&d| d == 6), "{after:?}");
    assert_eq!(*after.last().expect("ticks"), 2, "{after:?}");
    // Going up is never delayed.
    assert_eq!(run(&mut a, 15, 1, |_| 9.0), [9]);
}

#[test]
fn predictive_scaling_starts_replicas_one_cold_start_ahead_of_a_ramp() {
    let config = ScalingConfig {
        min: 0,
        max: 100,
        target: 1.0,
        ..ScalingConfig::default()
    };
    // Demand rises by 0.5 per second.
    let ramp = |s: u64| 0.5 * s as f64;
    let mut plain = Autoscaler::new(config.clone());
    plain.observe_cold_start(secs(20));
    let mut predictive = Autoscaler::new(ScalingConfig {
        predictive: true,
        ..config
    });
    // Not measured yet: nothing to plan with, same as plain.
    assert_eq!(
        run(&mut predictive, 0, 2, ramp),
        run(&mut plain, 0, 2, ramp)
    );
    predictive.observe_cold_start(secs(20));
    let p = run(&mut predictive, 2, 30, ramp);
    let q = run(&mut plain, 2, 30, ramp);
    assert!(p.iter().zip(&q).all(|(p, q)| p >= q), "{p:?} vs {q:?}");
    // At t=31 demand is 15.5; one cold start later it will be 25.5.
    let last = *p.last().expect("ticks");
    assert!(last >= 24, "{p:?}");
    assert!(*q.last().expect("ticks") < 20, "{q:?}");
    // Flat demand: no trend, no extra replicas.
    let mut flat = Autoscaler::new(ScalingConfig {
        predictive: true,
        target: 1.0,
        max: 100,
        ..ScalingConfig::default()
    });
    flat.observe_cold_start(secs(20));
    assert!(run(&mut flat, 0, 30, |_| 5.0).iter().all(|&d| d == 5));
}

#[test]
fn the_cold_start_estimate_is_a_moving_average() {
    let mut a = Autoscaler::new(ScalingConfig::default());
    assert_eq!(a.cold_start(), None);
    a.observe_cold_start(secs(10));
    assert_eq!(a.cold_start(), Some(secs(10)));
    a.observe_cold_start(secs(20));
    // 0.7 * 10 + 0.3 * 20
    let est = a.cold_start().expect("measured").as_secs_f64();
    assert!((est - 13.0).abs() < 1e-6, "{est}");
}

#[test]
fn a_queue_building_during_a_cold_start_gets_its_replicas_together() {
    let config = ScalingConfig {
        min: 0,
        max: 50,
        target: 1.0,
        ..ScalingConfig::default()
    };
    let mut a = Autoscaler::new(config);
    assert_eq!(a.wake(secs(0)), 1);
    // Nothing ready yet; the queue grows by 3 a second.
    let counts: Vec<u32> = (0..10)
        .map(|s| tick(&mut a, s, 3.0 * s as f64, 0).desired)
        .collect();
    // It follows the 6 s window (~the last 6 ticks' mean), not the 60 s
    // one, and never lowers what is already starting.
    assert!(counts.windows(2).all(|w| w[1] >= w[0]), "{counts:?}");
    assert!(counts[9] >= 19, "{counts:?}");
    // Once replicas are ready, the usual rules apply again: the stable
    // average (15 here) rules, within the scale-down rate.
    let d = tick(&mut a, 10, 30.0, 20);
    assert_eq!(d.desired, 15, "{d:?}");
}

// === failover ===

#[test]
fn replicas_taken_over_after_a_failover_are_kept_for_a_stable_window() {
    let mut a = Autoscaler::new(ScalingConfig::default());
    // A new leader finds 3 warm replicas an earlier one left, at t=100.
    a.adopt(3, secs(100));
    assert_eq!(a.desired(), 3);
    // No demand yet: they are kept while the stable window (60 s) fills.
    for s in 100..160 {
        let d = tick(&mut a, s, 0.0, 3);
        assert_eq!(d.desired, 3, "let go early at t={s}: {d:?}");
    }
    // Then the policy decides as usual: idle since the takeover, so to zero.
    let after: Vec<u32> = (160..200)
        .map(|s| tick(&mut a, s, 0.0, 3).desired)
        .collect();
    assert_eq!(after.last(), Some(&0), "{after:?}");
}

#[test]
fn demand_after_a_takeover_raises_the_count_as_usual() {
    let cfg = ScalingConfig {
        max: 10,
        ..ScalingConfig::default()
    };
    let mut a = Autoscaler::new(cfg.clone());
    a.adopt(2, secs(0));
    let mut last = 0;
    for s in 0..30 {
        let ready = a.desired();
        last = tick(&mut a, s, 40.0, ready).desired;
    }
    assert!(last > 2, "{last}");
    // More than max is never asked for, and zero takes over nothing.
    let mut b = Autoscaler::new(cfg.clone());
    b.adopt(50, secs(0));
    assert_eq!(b.desired(), 10);
    let mut c = Autoscaler::new(cfg);
    c.adopt(0, secs(0));
    assert_eq!(c.desired(), 0);
}

#[test]
fn a_queue_at_zero_is_sized_by_the_slots_it_will_enter() {
    // A minute with nothing waiting, then seven requests wait for a
    // replica of eight slots: they all enter the first one when it is
    // ready, so the short window asks for one, not the two the target of
    // 5.6 would.
    let config = ScalingConfig {
        min: 0,
        max: 10,
        target: 5.6,
        concurrency: 8,
        ..ScalingConfig::default()
    };
    let mut a = Autoscaler::new(config);
    assert_eq!(a.wake(secs(0)), 1);
    for s in 0..60 {
        tick(&mut a, s, 0.0, 0);
    }
    let counts: Vec<u32> = (60..70).map(|s| tick(&mut a, s, 7.0, 0).desired).collect();
    assert!(counts.iter().all(|&n| n == 1), "{counts:?}");
    // Nine do not fit one replica: a second starts.
    let counts: Vec<u32> = (70..80).map(|s| tick(&mut a, s, 9.0, 0).desired).collect();
    assert_eq!(counts.last(), Some(&2), "{counts:?}");
}
