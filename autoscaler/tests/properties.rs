//! Property tests over random observation streams on virtual 1 s ticks.

use std::time::Duration;

use proptest::prelude::*;
use warmgate_autoscaler::{Autoscaler, Decision, Observation, ScaleToZero, ScalingConfig};

/// One tick of a random stream: observed concurrency, ready replicas
/// (reduced modulo `max + 1`) and whether a request woke the app mid-tick.
#[derive(Debug, Clone, Copy)]
struct Step {
    concurrency: f64,
    ready: u32,
    wake: bool,
}

/// Valid configs, as the gateway's config validation would let through.
fn config() -> impl Strategy<Value = ScalingConfig> {
    (
        1_u32..=8,
        0_u32..=8,
        0.5_f64..16.0,
        1_u64..=120,
        1_u64..=30,
        prop::option::of(0_u64..=180),
        1.0_f64..4.0,
        (
            prop_oneof![Just(1000.0), 1.5_f64..10.0],
            prop_oneof![Just(2.0), 1.0_f64..10.0],
            prop_oneof![Just(0_u64), 1_u64..=30],
            any::<bool>(),
        ),
    )
        .prop_map(
            |(
                max,
                min,
                target,
                stable,
                panic,
                to_zero,
                threshold,
                (up, down, delay, predictive),
            )| {
                ScalingConfig {
                    min: min.min(max),
                    max,
                    target,
                    stable_window: Duration::from_secs(stable),
                    panic_window: Duration::from_secs(panic),
                    scale_to_zero_after: to_zero.map_or(ScaleToZero::Auto, |s| {
                        ScaleToZero::After(Duration::from_secs(s))
                    }),
                    panic_threshold: threshold,
                    max_scale_up_rate: up,
                    max_scale_down_rate: down,
                    scale_down_delay: Duration::from_secs(delay),
                    predictive,
                    suspend_after: None,
                    ..ScalingConfig::default()
                }
            },
        )
}

/// A policy as the gateway runs it: with a measured cold start for the
/// predictive option to plan with.
fn autoscaler(config: ScalingConfig) -> Autoscaler {
    let mut a = Autoscaler::new(config);
    a.observe_cold_start(Duration::from_secs(20));
    a
}

/// Concurrency in `0..100`, exactly zero often enough to reach idle periods.
fn concurrency() -> impl Strategy<Value = f64> {
    prop_oneof![3 => Just(0.0), 7 => 0.0_f64..100.0]
}

fn step() -> impl Strategy<Value = Step> {
    (concurrency(), 0_u32..=8, prop::bool::weighted(0.1)).prop_map(|(concurrency, ready, wake)| {
        Step {
            concurrency,
            ready,
            wake,
        }
    })
}

fn observe(a: &mut Autoscaler, s: u64, concurrency: f64, ready: u32) -> Decision {
    let ready = ready % (a.config().max + 1);
    a.observe(Observation {
        now: Duration::from_secs(s),
        concurrency,
        ready,
        ..Observation::default()
    })
}

/// Ticks until the count can have settled under constant load: every
/// sample in both windows comes from the current phase, the scale-down
/// delay has passed, and the rate limits have had the ticks they need to
/// cover `0..=max` (each tick multiplies or divides by the rate).
fn fill_ticks(config: &ScalingConfig) -> u64 {
    let rate = config
        .max_scale_up_rate
        .min(config.max_scale_down_rate)
        .max(1.0 + 1e-9);
    let rate_ticks = if config.max_scale_down_rate <= 1.0 + 1e-9 {
        0
    } else {
        (f64::from(config.max.max(1)).ln() / rate.ln()).ceil() as u64 + 1
    };
    config.stable_window.max(config.panic_window).as_secs()
        + config.scale_down_delay.as_secs()
        + rate_ticks.min(64)
}

fn changes(desired: &[u32]) -> usize {
    desired.windows(2).filter(|w| w[0] != w[1]).count()
}

/// Whether the count ever turns around (up then down, or down then up).
fn reverses(desired: &[u32]) -> bool {
    let steps: Vec<i64> = desired
        .windows(2)
        .map(|w| i64::from(w[1]) - i64::from(w[0]))
        .filter(|d| *d != 0)
        .collect();
    steps.windows(2).any(|w| w[0].signum() != w[1].signum())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn invariants_hold_on_random_streams(
        config in config(),
        steps in prop::collection::vec(step(), 1..300),
    ) {
        let (min, max) = (config.min, config.max);
        let mut a = autoscaler(config);
        prop_assert!((min..=max).contains(&a.desired()));
        let mut prev: Option<Decision> = None;
        for (s, step) in (0_u64..).zip(&steps) {
            let d = observe(&mut a, s, step.concurrency, step.ready);
            prop_assert!((min..=max).contains(&d.desired), "t={}: {:?}", s, d);
            prop_assert_eq!(d.desired, a.desired());
            if step.concurrency > 0.0 {
                prop_assert!(d.desired >= 1, "zero with load at t={}: {:?}", s, d);
            }
            prop_assert!(d.stable_concurrency.is_finite() && d.stable_concurrency >= 0.0);
            prop_assert!(d.panic_concurrency.is_finite() && d.panic_concurrency >= 0.0);
            // (No let-chain: the workspace MSRV is 1.85.)
            if let Some(p) = prev.filter(|p| p.panicking && d.panicking) {
                prop_assert!(
                    d.desired >= p.desired,
                    "panic lowered {} -> {} at t={}", p.desired, d.desired, s
                );
            }
            prev = Some(d);

            if step.wake {
                let before = a.desired();
                let woke = a.wake(Duration::from_secs(s) + Duration::from_millis(500));
                prop_assert!(woke >= 1 && woke >= before && woke <= max);
                prop_assert_eq!(woke, a.desired());
                // The wake counts as panic's "previous desired" too.
                prev = prev.map(|p| Decision { desired: woke, ..p });
            }
        }
    }

    #[test]
    fn constant_load_from_start_does_not_flap(
        config in config(),
        load in concurrency(),
        lags in prop::collection::vec(prop::bool::weighted(0.2), 400),
    ) {
        // Ready replicas follow the count (rate limits are relative to
        // them), one tick behind, or lag further when `lag` says so.
        let fill = fill_ticks(&config);
        let mut a = autoscaler(config);
        let mut ready = 0;
        let desired: Vec<u32> = (0_u64..)
            .zip(&lags)
            .map(|(s, &lag)| {
                let d = observe(&mut a, s, load, ready).desired;
                if !lag {
                    ready = d;
                }
                d
            })
            .collect();
        let settled = &desired[(fill as usize).min(desired.len())..];
        prop_assert!(!reverses(settled), "flapping: {:?}", settled);
        // Once replicas keep up, the count moves at most once.
        if !lags.iter().any(|l| *l) {
            prop_assert!(changes(settled) <= 1, "flapping: {:?}", settled);
        }
    }

    #[test]
    fn constant_load_after_history_does_not_flap(
        config in config(),
        history in prop::collection::vec(step(), 0..200),
        load in concurrency(),
        readies in prop::collection::vec(any::<bool>(), 400),
    ) {
        let fill = fill_ticks(&config);
        let mut a = autoscaler(config);
        let mut s = 0_u64;
        for step in &history {
            observe(&mut a, s, step.concurrency, step.ready);
            if step.wake {
                a.wake(Duration::from_secs(s) + Duration::from_millis(500));
            }
            s += 1;
        }
        let mut ready = a.desired();
        let desired: Vec<u32> = readies
            .iter()
            .map(|&lag| {
                let d = observe(&mut a, s, load, ready).desired;
                if !lag {
                    ready = d;
                }
                s += 1;
                d
            })
            .collect();
        let settled = &desired[(fill as usize).min(desired.len())..];
        if load > 0.0 {
            // Converges without turning around: rate limits may take a
            // few steps, each in the same direction.
            prop_assert!(!reverses(settled), "flapping: {:?}", settled);
        } else {
            // Winding down: panic ends, then scale-to-zero; never back up.
            prop_assert!(
                settled.windows(2).all(|w| w[1] <= w[0]),
                "went up without load: {:?}", settled
            );
        }
    }

    #[test]
    fn odd_configs_never_panic(
        min in 0_u32..=10,
        max in 0_u32..=10,
        target in prop_oneof![
            Just(0.0), Just(-1.0), Just(f64::NAN), Just(f64::INFINITY), Just(1e-300), 0.1_f64..10.0
        ],
        threshold in prop_oneof![Just(0.0), Just(-1.0), Just(f64::NAN), 0.5_f64..4.0],
        windows in (0_u64..=5, 0_u64..=5, 0_u64..=5),
        rates in (
            prop_oneof![Just(0.0), Just(f64::NAN), Just(0.5), 1.0_f64..1e6],
            prop_oneof![Just(0.0), Just(f64::INFINITY), Just(0.5), 1.0_f64..1e6],
        ),
        steps in prop::collection::vec(
            (prop_oneof![
                Just(0.0), Just(-5.0), Just(f64::NAN), Just(f64::INFINITY), 0.0_f64..100.0
            ], 0_u32..=10, any::<bool>()),
            1..100,
        ),
    ) {
        let config = ScalingConfig {
            min,
            max,
            target,
            stable_window: Duration::from_secs(windows.0),
            panic_window: Duration::from_secs(windows.1),
            scale_to_zero_after: ScaleToZero::After(Duration::from_secs(windows.2)),
            panic_threshold: threshold,
            max_scale_up_rate: rates.0,
            max_scale_down_rate: rates.1,
            scale_down_delay: Duration::from_secs(windows.0),
            predictive: true,
            suspend_after: None,
            ..ScalingConfig::default()
        };
        let mut a = Autoscaler::new(config);
        a.observe_cold_start(Duration::from_secs(windows.1));
        for (s, &(concurrency, ready, wake)) in (0_u64..).zip(&steps) {
            let d = a.observe(Observation { now: Duration::from_secs(s), concurrency, ready,
    ..Observation::default()
});
            prop_assert!(d.desired <= max);
            prop_assert!(d.desired >= min.min(max));
            if concurrency > 0.0 && max >= 1 {
                prop_assert!(d.desired >= 1);
            }
            prop_assert!(d.stable_concurrency.is_finite() && d.panic_concurrency.is_finite());
            if wake {
                prop_assert!(a.wake(Duration::from_secs(s)) <= max);
            }
        }
    }
}

/// The cold-start-aware decisions, fed full observations (arrivals,
/// completions, busy slot-seconds, the queue) from a random stream in
/// which started replicas come up at random times.
mod cold_start_aware {
    use std::time::Duration;

    use proptest::prelude::*;
    use warmgate_autoscaler::engine::replicas_needed;
    use warmgate_autoscaler::{
        Autoscaler, EngineSignals, EngineTargets, Observation, ScalingConfig,
    };

    #[derive(Debug, Clone, Copy)]
    struct Tick {
        arrivals: u32,
        queued: u32,
        inflight: u32,
        completions: u32,
        /// Of the replicas asked for and not ready, how many come up.
        come_up: u32,
        wake: bool,
        /// The engines' reading; `None`: stale or never read.
        engine: Option<EngineSignals>,
    }

    fn engine() -> impl Strategy<Value = Option<EngineSignals>> {
        prop::option::weighted(
            0.5,
            (0_u32..4, 0.0_f64..40.0, 0.0_f64..40.0, 0.0_f64..1.0).prop_map(
                |(read, waiting, running, kv)| EngineSignals {
                    read,
                    waiting,
                    running,
                    kv_read: read,
                    kv_cache_usage: kv * f64::from(read),
                },
            ),
        )
    }

    fn tick() -> impl Strategy<Value = Tick> {
        (
            prop_oneof![3 => Just(0_u32), 5 => 0_u32..10, 1 => 0_u32..200],
            prop_oneof![3 => Just(0_u32), 2 => 0_u32..300],
            0_u32..64,
            0_u32..20,
            0_u32..4,
            prop::bool::weighted(0.05),
            engine(),
        )
            .prop_map(
                |(arrivals, queued, inflight, completions, come_up, wake, engine)| Tick {
                    arrivals,
                    queued,
                    inflight,
                    completions,
                    come_up,
                    wake,
                    engine,
                },
            )
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        #[test]
        fn starts_are_kept_until_ready_the_count_stays_in_bounds_and_work_wakes_the_app(
            max in 1_u32..=20,
            min in 0_u32..=2,
            slots in 1_u32..=16,
            cold in 1_u64..=90,
            ticks in prop::collection::vec(tick(), 1..300),
            waiting in prop::option::of(0.5_f64..8.0),
            kv in prop::option::of(0.3_f64..1.0),
        ) {
            let targets = EngineTargets { waiting, kv_cache_usage: kv };
            let config = ScalingConfig {
                min: min.min(max),
                max,
                target: f64::from(slots) * 0.7,
                concurrency: slots,
                engine: targets,
                ..ScalingConfig::default()
            };
            let mut a = Autoscaler::new(config);
            a.observe_cold_start(Duration::from_secs(cold));
            let lapse = Duration::from_secs(3 * cold);
            let mut ready = 0_u32;
            let mut prev = a.desired();
            // The latest start: the count asked for and when.
            let mut started: Option<(u32, Duration)> = None;
            let mut last_active = Duration::ZERO;
            for (s, t) in (1_u64..).zip(&ticks) {
                let now = Duration::from_secs(s);
                // Some of the replicas asked for come up; replicas beyond
                // the count stop.
                ready = (ready + t.come_up).min(prev);
                let inflight = t.inflight.min(ready * slots);
                let d = a.observe(Observation {
                    now,
                    concurrency: f64::from(inflight + t.queued),
                    ready,
                    queued: t.queued,
                    arrivals: t.arrivals,
                    completions: t.completions,
                    busy: f64::from(inflight),
                    engine: t.engine,
                }).desired;
                prop_assert!(d <= max, "{} above max {}", d, max);
                prop_assert!(d >= min.min(max));
                if t.queued > 0 || inflight > 0 {
                    prop_assert!(d >= 1, "work waits at zero");
                }
                // `auto` (the default here) lets the last replica go only
                // after an idle spell as long as the linger it learned,
                // which is at most twenty cold starts, or the minute it
                // starts with.
                let scales_on_engines = waiting.is_some() || kv.is_some();
                if t.queued > 0
                    || inflight > 0
                    || t.arrivals > 0
                    || (scales_on_engines && t.engine.is_some_and(|e| e.busy()))
                {
                    last_active = now;
                }
                let linger = a.scale_to_zero_after();
                // Engines that read as needing more get at least that many
                // (within max), unless the app is idle past its linger (an
                // idle engine's cache asks for nothing); a stale reading
                // asks for nothing.
                let idle = now.saturating_sub(last_active) >= linger;
                if let Some(need) = t.engine.and_then(|e| replicas_needed(&e, &targets, ready))
                    && !idle
                {
                    prop_assert!(d >= need.min(max), "engines need {}, count {}", need, d);
                }
                prop_assert!(
                    linger <= Duration::from_secs(20 * cold).max(Duration::from_secs(60)),
                    "linger {:?} past twenty cold starts of {} s", linger, cold
                );
                if d == 0 && prev > 0 {
                    prop_assert!(
                        now.saturating_sub(last_active) >= linger,
                        "t={}: to zero {:?} after the last activity, linger {:?}",
                        s, now.saturating_sub(last_active), linger
                    );
                }
                if let Some((n, at)) = started {
                    if ready >= n || now.saturating_sub(at) >= lapse {
                        started = None;
                    } else {
                        prop_assert!(
                            d >= n,
                            "t={}: took back a start: {} asked at {:?}, {} ready, now {}",
                            s, n, at, ready, d
                        );
                    }
                }
                if d > prev && d > ready {
                    started = Some((d, now));
                }
                prev = d;
                if t.wake {
                    let w = a.wake(now);
                    last_active = now;
                    prop_assert!(w >= 1 && w <= max, "a request at zero wakes the app: {}", w);
                    if w > prev && w > ready && started.is_none() {
                        started = Some((w, now));
                    }
                    prev = w;
                }
            }
        }
    }
}

mod pools {
    use std::time::Duration;

    use proptest::prelude::*;
    use warmgate_autoscaler::pool::{PoolLoad, PoolScaling, pool_desired};

    fn scaling() -> impl Strategy<Value = PoolScaling> {
        (1_u32..=10, 0_u32..=10, 1_u32..=8, 0_u64..=600, 0_u32..=4).prop_map(
            |(max, min, concurrency, ttl, buffer)| PoolScaling {
                min: min.min(max),
                max,
                concurrency,
                idle_ttl: Duration::from_secs(ttl),
                buffer,
            },
        )
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2048))]

        #[test]
        fn the_pool_policy_keeps_its_promises(
            cfg in scaling(),
            pending in prop_oneof![Just(0_usize), 0_usize..200],
            starting in 0_u32..4,
            idle in prop::collection::vec(
                prop_oneof![Just(0_u64), 0_u64..1200], 0..10),
            busy_share in 0.0_f64..=1.0,
        ) {
            let idle: Vec<Duration> = idle.into_iter().map(Duration::from_secs).collect();
            let busy = idle.iter().filter(|d| d.is_zero()).count() as u32;
            // Busy replicas hold between 1 and `concurrency` tasks each.
            let inflight = busy + ((f64::from(busy * (cfg.concurrency - 1))) * busy_share) as u32;
            let load = PoolLoad { pending, inflight, starting, idle: &idle };
            let d = pool_desired(&cfg, &load);
            let total = idle.len() as u32 + starting;
            let expired = idle.iter().filter(|x| **x >= cfg.idle_ttl).count() as u32;
            let slots = |n: u32| u64::from(n) * u64::from(cfg.concurrency);
            let work = pending as u64 + u64::from(inflight);

            prop_assert!(d >= cfg.min && d <= cfg.max, "{} outside [{}, {}]", d, cfg.min, cfg.max);
            // Never stops a replica that has not been idle for the TTL.
            prop_assert!(d >= (total - expired).min(cfg.max));
            // Never stops anything while tasks wait.
            if pending > 0 {
                prop_assert!(d >= total.min(cfg.max));
            }
            // Queued tasks beyond the free and coming slots get replicas
            // for all the work, up to max.
            if pending as u64 > slots(idle.len() as u32).saturating_sub(u64::from(inflight)) + slots(starting) {
                prop_assert!(d == cfg.max || slots(d) >= work, "{} for {} tasks", d, work);
            }
            // The buffer: spare replicas beyond the work, up to max.
            let need = work.div_ceil(u64::from(cfg.concurrency));
            prop_assert!(u64::from(d) >= (need + u64::from(cfg.buffer)).min(u64::from(cfg.max)));
        }
    }
}
