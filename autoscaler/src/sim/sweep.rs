//! Every workload × cold start × policy, with the clairvoyant bound: the
//! table `warmgate simulate --sweep` prints and `docs/autoscaling.md`
//! reports.

use std::time::Duration;

use super::clairvoyant::{Frontier, frontier};
use super::engine::{EngineModel, simulate_engines};
use super::{
    AlwaysPeak, Knative, Policy, PoolTasks, RayServe, ServiceModel, SimConfig, SimReport,
    TraceRequest, peak_replicas, simulate, warmgate,
};
use crate::pool::PoolScaling;
use crate::{EngineTargets, ScalingConfig};

/// One trace to sweep.
#[derive(Debug, Clone)]
pub struct Workload {
    /// Its name in the table.
    pub name: String,
    /// Whether the goals for bursty traffic apply to it.
    pub bursty: bool,
    /// The requests.
    pub requests: Vec<TraceRequest>,
}

/// What every cell shares.
#[derive(Debug, Clone)]
pub struct SweepConfig {
    /// warmgate's serving policy, as the config sets it.
    pub scaling: ScalingConfig,
    /// warmgate's warm-pool policy for the same replicas.
    pub pool: PoolScaling,
    /// The baselines' target per replica.
    pub baseline_target: f64,
    /// The platform (its cold start is set per cell).
    pub sim: SimConfig,
    /// The service-time model.
    pub model: ServiceModel,
}

/// One policy's result in a cell.
#[derive(Debug, Clone)]
pub struct Row {
    /// The report (its timeline dropped).
    pub report: SimReport,
    /// Replica-seconds against Knative's.
    pub vs_knative: f64,
    /// Replica-seconds against the clairvoyant bound at the same p99.
    pub vs_bound: Option<f64>,
}

/// One workload at one cold start.
#[derive(Debug, Clone)]
pub struct Cell {
    /// The workload's name.
    pub workload: String,
    /// Whether it is bursty.
    pub bursty: bool,
    /// The cold start.
    pub cold_start: Duration,
    /// warmgate first, then the pool policy, Knative, Ray Serve and always
    /// at peak.
    pub rows: Vec<Row>,
    /// The clairvoyant schedule's cost at each fraction.
    pub frontier: Frontier,
}

/// Index of warmgate's serving policy in [`Cell::rows`].
pub const WARMGATE: usize = 0;
/// Index of Knative's in [`Cell::rows`].
pub const KNATIVE: usize = 2;
/// The baselines warmgate must not be dominated by.
pub const BASELINES: [usize; 3] = [2, 3, 4];

/// Runs one cell; `timelines` keeps each report's per-tick timeline (for
/// a plot of replicas over time).
pub fn run(w: &Workload, cfg: &SweepConfig, cold_start: Duration, timelines: bool) -> Cell {
    let sim = SimConfig {
        cold_start,
        ..cfg.sim
    };
    let (min, max) = (cfg.scaling.min, cfg.scaling.max);
    let peak = peak_replicas(&w.requests, &cfg.model, cfg.baseline_target, max);
    let mut policies: Vec<Box<dyn Policy>> = vec![
        Box::new(warmgate(cfg.scaling.clone())),
        Box::new(PoolTasks {
            scaling: cfg.pool.clone(),
        }),
        Box::new(Knative::new(cfg.baseline_target, min, max)),
        Box::new(RayServe::new(cfg.baseline_target, min, max)),
        Box::new(AlwaysPeak(peak)),
    ];
    let frontier = frontier(&w.requests, &cfg.model, &sim, max);
    let reports: Vec<SimReport> = policies
        .iter_mut()
        .map(|p| {
            let mut r = simulate(&w.requests, &cfg.model, p.as_mut(), &sim);
            if !timelines {
                r.timeline = Vec::new();
            }
            r
        })
        .collect();
    let knative = reports[KNATIVE].replica_seconds.max(1e-9);
    let rows = reports
        .into_iter()
        .map(|report| Row {
            vs_knative: report.replica_seconds / knative,
            vs_bound: frontier
                .bound(report.p99())
                .map(|b| report.replica_seconds / b.max(1e-9)),
            report,
        })
        .collect();
    Cell {
        workload: w.name.clone(),
        bursty: w.bursty,
        cold_start,
        rows,
        frontier,
    }
}

impl Cell {
    /// The baselines that beat warmgate on both replica-seconds and p99.
    pub fn dominated_by(&self) -> Vec<&str> {
        let w = &self.rows[WARMGATE].report;
        BASELINES
            .iter()
            .map(|&i| &self.rows[i].report)
            .filter(|b| b.replica_seconds < w.replica_seconds && b.p99() < w.p99() - 1e-9)
            .map(|b| b.policy.as_str())
            .collect()
    }

    /// On bursty traffic: at most Knative's replica-seconds at an equal or
    /// better p99, and at most 1.5× the clairvoyant bound. `None` when the
    /// goal does not apply.
    pub fn bursty_goal(&self) -> Option<bool> {
        if !self.bursty {
            return None;
        }
        let w = &self.rows[WARMGATE];
        let k = &self.rows[KNATIVE].report;
        Some(
            w.vs_knative <= 1.0 + 1e-9
                && w.report.p99() <= k.p99() + 1e-9
                && w.vs_bound.is_some_and(|b| b <= 1.5),
        )
    }
}

/// The sweep as one Markdown table: per workload and cold start, each
/// policy's replica-seconds (against Knative's and against the
/// clairvoyant bound at the same p99), p99 wait and cold starts; then a
/// verdict line per cell for warmgate's goals.
pub fn markdown(cells: &[Cell]) -> String {
    use std::fmt::Write as _;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "| workload | cold start | policy | replica-s | vs Knative | vs bound | p99 wait | p95 wait | cold starts | failed |"
    );
    let _ = writeln!(out, "|---|---|---|---:|---:|---:|---:|---:|---:|---:|");
    for c in cells {
        for (i, row) in c.rows.iter().enumerate() {
            let r = &row.report;
            let bound = row
                .vs_bound
                .map_or_else(|| "—".to_string(), |b| format!("{b:.2}×"));
            let name = if i == WARMGATE {
                format!("**{}**", r.policy)
            } else {
                r.policy.clone()
            };
            let _ = writeln!(
                out,
                "| {} | {} | {} | {:.0} | {:.2}× | {} | {:.1} s | {:.1} s | {} | {} |",
                c.workload,
                fmt_secs(c.cold_start),
                name,
                r.replica_seconds,
                row.vs_knative,
                bound,
                r.p99(),
                r.queue_delay[1],
                r.cold_starts,
                r.rejected + r.timed_out,
            );
        }
    }
    out
}

/// One line per cell: whether warmgate's default meets the goals.
pub fn verdicts(cells: &[Cell]) -> String {
    use std::fmt::Write as _;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "| workload | cold start | dominated by | bursty goal (≤ 1.0× Knative at ≤ its p99, ≤ 1.5× bound) |"
    );
    let _ = writeln!(out, "|---|---|---|---|");
    for c in cells {
        let dom = c.dominated_by();
        let dom = if dom.is_empty() {
            "none".to_string()
        } else {
            dom.join(", ")
        };
        let w = &c.rows[WARMGATE];
        let goal = match c.bursty_goal() {
            None => "n/a".to_string(),
            Some(ok) => format!(
                "{} ({:.2}× Knative, p99 {:.1} s vs {:.1} s, {} bound)",
                if ok { "met" } else { "**missed**" },
                w.vs_knative,
                w.report.p99(),
                c.rows[KNATIVE].report.p99(),
                w.vs_bound
                    .map_or_else(|| "no".to_string(), |b| format!("{b:.2}×"))
            ),
        };
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} |",
            c.workload,
            fmt_secs(c.cold_start),
            dom,
            goal
        );
    }
    out
}

fn fmt_secs(d: Duration) -> String {
    format!("{} s", d.as_secs_f64())
}

/// The gateway's limit per replica on engine replicas in
/// [`run_engines`], for counts and signals alike: about 70% of the
/// requests [`EngineModel::default`]'s KV cache holds of the generated
/// shapes' mean request (65,536 / about 1,800 tokens, 35 requests). Tried
/// and not kept: 64 and 32, with which a burst queues inside the engines
/// where the replicas started for it cannot take it (`docs/autoscaling.md`).
pub const ENGINE_CONCURRENCY: u32 = 24;

/// The engine targets [`run_engines`] scales on.
pub const ENGINE_TARGETS: EngineTargets = EngineTargets {
    waiting: Some(2.0),
    kv_cache_usage: Some(0.8),
};

/// One workload at one cold start on engine replicas
/// ([`super::engine`]): warmgate scaling on counts against the app's
/// `concurrency`, on counts against [`ENGINE_CONCURRENCY`], and on the
/// engines' signals with that limit.
#[derive(Debug, Clone)]
pub struct EngineCell {
    /// The workload's name.
    pub workload: String,
    /// The cold start.
    pub cold_start: Duration,
    /// On counts: the app's policy as configured.
    pub counted: SimReport,
    /// On counts, [`ENGINE_CONCURRENCY`] a replica.
    pub counted_wide: SimReport,
    /// On signals: [`ENGINE_CONCURRENCY`] a replica and
    /// [`ENGINE_TARGETS`].
    pub signals: SimReport,
}

/// Runs one [`EngineCell`].
pub fn run_engines(
    w: &Workload,
    cfg: &SweepConfig,
    cold_start: Duration,
    engine: &EngineModel,
) -> EngineCell {
    let sim = SimConfig {
        cold_start,
        ..cfg.sim
    };
    let run = |scaling: ScalingConfig, concurrency: u32| {
        let mut r = simulate_engines(
            &w.requests,
            engine,
            &mut warmgate(scaling),
            &SimConfig { concurrency, ..sim },
        );
        r.timeline = Vec::new();
        r
    };
    let utilization = cfg.scaling.target / f64::from(cfg.sim.concurrency.max(1));
    let wide = ScalingConfig {
        concurrency: ENGINE_CONCURRENCY,
        target: f64::from(ENGINE_CONCURRENCY) * utilization,
        ..cfg.scaling.clone()
    };
    EngineCell {
        workload: w.name.clone(),
        cold_start,
        counted: run(cfg.scaling.clone(), cfg.sim.concurrency),
        counted_wide: run(wide.clone(), ENGINE_CONCURRENCY),
        signals: run(
            ScalingConfig {
                engine: ENGINE_TARGETS,
                ..wide
            },
            ENGINE_CONCURRENCY,
        ),
    }
}

/// The engine cells as one Markdown table.
pub fn engine_markdown(cells: &[EngineCell], concurrency: u32) -> String {
    use std::fmt::Write as _;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "| workload | cold start | counts, concurrency {concurrency} | counts, {ENGINE_CONCURRENCY} | signals, {ENGINE_CONCURRENCY} | signals against counts ({concurrency}) | signals against counts ({ENGINE_CONCURRENCY}) |"
    );
    let _ = writeln!(out, "|---|---|---|---|---|---|---|");
    let cell = |r: &SimReport| format!("{:.0}, {:.1} s", r.replica_seconds, r.p99());
    let against = |s: &SimReport, c: &SimReport| {
        // p99s within 0.05 s (the table's precision) are the same.
        let (cheaper, dearer) = (
            s.replica_seconds <= c.replica_seconds,
            s.replica_seconds > c.replica_seconds,
        );
        let (faster, same) = (s.p99() < c.p99() - 0.05, (s.p99() - c.p99()).abs() <= 0.05);
        let verdict = match (cheaper, dearer, faster, same) {
            (true, _, true, _) | (true, _, _, true) => "not worse",
            (_, true, true, _) => "dearer, faster",
            (_, true, _, true) => "dearer, same p99",
            (true, _, _, _) => "cheaper, slower",
            _ => "**worse**",
        };
        format!(
            "{:.2}×, {verdict}",
            s.replica_seconds / c.replica_seconds.max(1e-9)
        )
    };
    for c in cells {
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {} | {} |",
            c.workload,
            fmt_secs(c.cold_start),
            cell(&c.counted),
            cell(&c.counted_wide),
            cell(&c.signals),
            against(&c.signals, &c.counted),
            against(&c.signals, &c.counted_wide),
        );
    }
    out
}
