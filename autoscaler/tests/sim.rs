//! The simulator on synthetic traces, and on the real Azure trace when it is
//! there (`.ci/run` points `WARMGATE_TRACE` at it).

use std::time::Duration;

use warmgate_autoscaler::ScalingConfig;
use warmgate_autoscaler::sim::{
    AlwaysPeak, Knative, Policy, RayServe, ServiceModel, SimConfig, TraceRequest,
    parse_azure_trace, peak_replicas, simulate, warmgate,
};

fn cfg(cold: u64) -> SimConfig {
    SimConfig {
        cold_start: Duration::from_secs(cold),
        concurrency: 8,
        tick: Duration::from_secs(1),
        max_pending: 100_000,
        queue_timeout: Duration::from_secs(600),
    }
}

/// Deterministic pseudo-random arrivals: `rate` per second for `secs`.
fn poisson(rate: f64, secs: u64, seed: u64, offset: f64) -> Vec<TraceRequest> {
    let mut x = seed.max(1);
    let mut t = offset;
    let mut out = Vec::new();
    loop {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let u = (x >> 11) as f64 / (1u64 << 53) as f64;
        t += -(1.0 - u).ln() / rate;
        if t > offset + secs as f64 {
            return out;
        }
        out.push(TraceRequest {
            arrival: Duration::from_secs_f64(t),
            context_tokens: 500,
            generated_tokens: 50,
        });
    }
}

fn scaling() -> ScalingConfig {
    ScalingConfig {
        min: 0,
        max: 10,
        target: 5.6,
        ..ScalingConfig::default()
    }
}

#[test]
fn the_azure_trace_format_parses_relative_and_sorted() {
    let csv = "TIMESTAMP,ContextTokens,GeneratedTokens\n\
               2023-11-16 18:15:46.6805900,374,44\n\
               2023-11-16 18:15:50.9951690,396,109\n\
               2023-11-16 18:15:46.2224670,879,55\n";
    let t = parse_azure_trace(csv).expect("parses");
    assert_eq!(t.len(), 3);
    // Relative to the earliest row, and sorted.
    assert_eq!(t[0].arrival, Duration::ZERO);
    assert_eq!(t[0].context_tokens, 879);
    assert!((t[1].arrival.as_secs_f64() - 0.458123).abs() < 1e-6);
    assert!((t[2].arrival.as_secs_f64() - 4.772702).abs() < 1e-6);
    assert!(parse_azure_trace("TIMESTAMP,a,b\n2023-11-16 18:15:46.1,x,3\n").is_err());
    assert!(parse_azure_trace("").is_err());
}

#[test]
fn every_request_is_accounted_for_under_every_policy() {
    let trace = poisson(5.0, 600, 7, 0.0);
    let model = ServiceModel::default();
    let peak = peak_replicas(&trace, &model, 5.6, 10);
    let mut policies: Vec<Box<dyn Policy>> = vec![
        Box::new(warmgate(scaling())),
        Box::new(Knative::new(5.6, 0, 10)),
        Box::new(RayServe::new(5.6, 0, 10)),
        Box::new(AlwaysPeak(peak)),
    ];
    for p in &mut policies {
        let r = simulate(&trace, &model, p.as_mut(), &cfg(20));
        assert_eq!(
            r.served + r.rejected + r.timed_out,
            trace.len() as u64,
            "{}: nothing is lost",
            r.policy
        );
        assert!(r.replica_seconds > 0.0);
        assert!(r.queue_delay[0] <= r.queue_delay[1] && r.queue_delay[1] <= r.queue_delay[2]);
    }
}

#[test]
fn on_off_traffic_scales_to_zero_between_bursts() {
    // Two 2-minute bursts, 20 minutes apart.
    let mut trace = poisson(4.0, 120, 3, 0.0);
    trace.extend(poisson(4.0, 120, 5, 1320.0));
    let model = ServiceModel::default();
    let wg = simulate(&trace, &model, &mut warmgate(scaling()), &cfg(20));
    let peak = simulate(&trace, &model, &mut AlwaysPeak(4), &cfg(20));
    assert!(wg.cold_starts >= 2, "woke from zero for each burst: {wg:?}");
    assert!(
        wg.replica_seconds < 0.5 * peak.replica_seconds,
        "idle time is not billed: {} vs {}",
        wg.replica_seconds,
        peak.replica_seconds
    );
    let zero_in_gap = wg
        .timeline
        .iter()
        .any(|(t, _, n)| *t > 600.0 && *t < 1300.0 && *n == 0);
    assert!(zero_in_gap, "zero replicas during the gap");
}

#[test]
fn a_longer_cold_start_means_longer_queueing_at_zero() {
    let trace = poisson(2.0, 300, 11, 0.0);
    let model = ServiceModel::default();
    let fast = simulate(&trace, &model, &mut warmgate(scaling()), &cfg(2));
    let slow = simulate(&trace, &model, &mut warmgate(scaling()), &cfg(60));
    assert!(slow.queue_delay[2] > fast.queue_delay[2]);
    assert!(
        slow.queue_delay[2] >= 45.0,
        "the first requests wait out most of the cold start: {slow:?}"
    );
}

#[test]
fn the_real_azure_trace_replays_under_all_policies() {
    let path = std::env::var("WARMGATE_TRACE").unwrap_or_else(|_| {
        concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../data/azure-llm-inference-2023-conv.csv"
        )
        .into()
    });
    let Ok(csv) = std::fs::read_to_string(&path) else {
        assert!(
            std::env::var_os("CI").is_none(),
            "{path} is required under CI"
        );
        eprintln!("SKIPPED: no trace at {path}");
        return;
    };
    let trace = parse_azure_trace(&csv).expect("parses");
    assert!(trace.len() > 19_000, "{}", trace.len());
    let span = trace.last().expect("rows").arrival.as_secs_f64();
    assert!((3000.0..4000.0).contains(&span), "about an hour: {span}");
    let model = ServiceModel::default();
    let r = simulate(&trace, &model, &mut warmgate(scaling()), &cfg(20));
    assert_eq!(r.served + r.rejected + r.timed_out, trace.len() as u64);
    assert!(r.served > 19_000);
}

#[test]
fn a_burst_is_absorbed_and_released() {
    // 2/s for 10 minutes, with 60 s at 20/s from t = 300 s.
    let mut trace = poisson(2.0, 300, 13, 0.0);
    trace.extend(poisson(20.0, 60, 17, 300.0));
    trace.extend(poisson(2.0, 300, 19, 360.0));
    let model = ServiceModel::default();
    let r = simulate(&trace, &model, &mut warmgate(scaling()), &cfg(2));
    let at = |t: f64| r.timeline.iter().find(|p| p.0 >= t).map_or(0, |p| p.2);
    let before = at(290.0);
    let during = at(340.0);
    assert!(during >= 2 * before.max(1), "{before} -> {during}");
    // Gone again within a stable window and a panic period of the end.
    assert!(at(600.0) < during, "{during} -> {}", at(600.0));
    assert_eq!(r.served, trace.len() as u64);
}

#[test]
fn on_a_ramp_the_predictive_option_waits_less() {
    // The rate climbs from 1/s to 20/s over 10 minutes, in 30 s steps.
    let mut trace = Vec::new();
    for step in 0..20u64 {
        trace.extend(poisson(
            1.0 + step as f64,
            30,
            100 + step,
            step as f64 * 30.0,
        ));
    }
    trace.sort_by_key(|r| r.arrival);
    let model = ServiceModel::default();
    let plain = simulate(&trace, &model, &mut warmgate(scaling()), &cfg(60));
    let predictive = simulate(
        &trace,
        &model,
        &mut warmgate(ScalingConfig {
            predictive: true,
            ..scaling()
        }),
        &cfg(60),
    );
    eprintln!(
        "ramp, 60 s cold start: plain {:.0} replica-s, waits {:?}; predictive {:.0} replica-s, waits {:?}",
        plain.replica_seconds,
        plain.queue_delay,
        predictive.replica_seconds,
        predictive.queue_delay
    );
    assert!(
        predictive.queue_delay[1] < plain.queue_delay[1],
        "p95 {:?} vs {:?}",
        predictive.queue_delay,
        plain.queue_delay
    );
}

#[test]
fn the_clairvoyant_bound_is_below_every_policy_at_its_own_p99() {
    use warmgate_autoscaler::pool::PoolScaling;
    use warmgate_autoscaler::sim::shapes::Shape;
    use warmgate_autoscaler::sim::sweep::{KNATIVE, SweepConfig, WARMGATE, Workload, run};
    let w = Workload {
        name: "bursts-short".into(),
        bursty: true,
        requests: Shape::BURSTS_SHORT.generate(1),
    };
    let cfg = SweepConfig {
        scaling: ScalingConfig {
            concurrency: 8,
            max: 20,
            ..scaling()
        },
        pool: PoolScaling {
            min: 0,
            max: 20,
            concurrency: 8,
            idle_ttl: Duration::from_secs(300),
            buffer: 0,
        },
        baseline_target: 5.6,
        sim: SimConfig {
            max_pending: 1000,
            queue_timeout: Duration::from_secs(120),
            ..cfg(20)
        },
        model: ServiceModel::default(),
    };
    let cell = run(&w, &cfg, Duration::from_secs(20), false);
    assert_eq!(cell.rows.len(), 5);
    for row in &cell.rows {
        // Knowing the future never costs more at the same p99.
        if let Some(b) = row.vs_bound {
            assert!(b >= 1.0 - 1e-9, "{}: {b}", row.report.policy);
        }
        assert_eq!(
            row.report.served + row.report.rejected + row.report.timed_out,
            w.requests.len() as u64
        );
    }
    // The frontier trades capacity for waiting: more replicas, less wait.
    let f = &cell.frontier.points;
    assert!(f.first().unwrap().0 > f.last().unwrap().0);
    assert!(f.first().unwrap().1 <= f.last().unwrap().1);
    // On short bursts, warmgate's default costs less than Knative's at no
    // worse a p99: it does not start replicas that would come after the
    // burst, nor hold a panic's replicas for a whole stable window.
    let (wg, kn) = (&cell.rows[WARMGATE], &cell.rows[KNATIVE]);
    assert!(wg.vs_knative < 0.9, "{}", wg.vs_knative);
    assert!(
        wg.report.p99() <= kn.report.p99(),
        "{} vs {}",
        wg.report.p99(),
        kn.report.p99()
    );
    assert!(cell.dominated_by().is_empty(), "{:?}", cell.dominated_by());
}

#[test]
fn the_pool_policy_serves_every_task_and_keeps_replicas_warm_for_the_ttl() {
    use warmgate_autoscaler::pool::PoolScaling;
    use warmgate_autoscaler::sim::PoolTasks;
    // Two 2-minute bursts of tasks, 4 minutes apart: inside the 5-minute
    // TTL, so the second burst finds the replicas warm.
    let mut trace = poisson(4.0, 120, 3, 0.0);
    trace.extend(poisson(4.0, 120, 5, 360.0));
    let mut pool = PoolTasks {
        scaling: PoolScaling {
            min: 0,
            max: 10,
            concurrency: 8,
            idle_ttl: Duration::from_secs(300),
            buffer: 0,
        },
    };
    let r = simulate(&trace, &ServiceModel::default(), &mut pool, &cfg(20));
    assert_eq!(r.served, trace.len() as u64);
    let at = |t: f64| r.timeline.iter().find(|p| p.0 >= t).map_or(0, |p| p.2);
    assert!(at(300.0) >= 1, "warm through the gap");
    let before = at(359.0);
    assert!(
        r.timeline
            .iter()
            .filter(|p| p.0 >= 360.0 && p.0 < 380.0)
            .all(|p| p.2 >= before)
    );
}

#[test]
fn a_trace_is_bursty_when_a_burst_stands_out_from_the_minutes_before_it() {
    use warmgate_autoscaler::sim::is_bursty;
    use warmgate_autoscaler::sim::shapes::Shape;
    // Flat traffic at any rate, and a slow ramp, are not bursty.
    for flat in [
        "poisson:rate=0.05",
        "poisson:rate=3",
        "poisson:rate=40",
        "daily",
    ] {
        let shape: Shape = flat.parse().unwrap();
        for seed in 1..=3 {
            assert!(!is_bursty(&shape.generate(seed)), "{flat}, seed {seed}");
        }
    }
    // Every bursty preset is, whatever the seed.
    for (name, shape) in Shape::PRESETS {
        if shape.bursty() {
            for seed in 1..=3 {
                assert!(is_bursty(&shape.generate(seed)), "{name}, seed {seed}");
            }
        }
    }
    // A trace like the one issue 17 measured: a trickle, with a few
    // seconds at 60 requests/s now and then.
    let mut t = poisson(1.0, 1800, 5, 0.0);
    t.extend(poisson(60.0, 4, 6, 900.0));
    t.sort_by_key(|r| r.arrival);
    assert!(is_bursty(&t));
    assert!(!is_bursty(&poisson(1.0, 1800, 5, 0.0)));
    assert!(!is_bursty(&[]));
    // The real conversation trace is nearly flat.
    if let Ok(path) = std::env::var("WARMGATE_TRACE") {
        let text = std::fs::read_to_string(&path).expect("WARMGATE_TRACE is readable");
        assert!(!is_bursty(&parse_azure_trace(&text).unwrap()));
    }
}

#[test]
fn knative_starts_nothing_before_the_first_request() {
    // Its scale-to-zero grace keeps a replica that runs; before the first
    // request none runs, so there is nothing to keep or bill.
    let trace = poisson(1.0, 60, 7, 600.0);
    let model = ServiceModel::default();
    let kn = simulate(&trace, &model, &mut Knative::new(5.6, 0, 10), &cfg(20));
    let early = kn
        .timeline
        .iter()
        .filter(|(t, _, _)| *t < 599.0)
        .map(|(_, _, n)| *n)
        .max();
    assert_eq!(early, Some(0), "replicas before the first request");
    assert!(kn.cold_starts >= 1);
}
