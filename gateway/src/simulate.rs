//! `warmgate simulate`: replays traces (Azure-format CSVs, or generated
//! shapes) against the autoscaling policy, the baselines and the
//! clairvoyant bound, and prints (and with `--sweep`, writes) the table.

use std::path::{Path, PathBuf};
use std::time::Duration;

use warmgate_autoscaler::pool::PoolScaling;
use warmgate_autoscaler::sim::engine::EngineModel;
use warmgate_autoscaler::sim::shapes::Shape;
use warmgate_autoscaler::sim::sweep::{self, Cell, SweepConfig, Workload};
use warmgate_autoscaler::sim::{ServiceModel, SimConfig, is_bursty, parse_azure_trace};
use warmgate_deploy::{AppSpec, Config};

/// The app the simulator uses without `--config`: the defaults, with
/// continuous batching of 8 and room for 20 replicas.
const DEFAULT_APP: &str = r#"
[[apps]]
name = "llm"
command = ["./my-llm-server"]
concurrency = 8

[apps.autoscale]
max = 20
"#;

/// Cold starts a sweep runs at unless told otherwise.
const SWEEP_COLD_STARTS: [Duration; 3] = [
    Duration::from_secs(2),
    Duration::from_secs(20),
    Duration::from_secs(60),
];

/// What the command line asked for.
pub struct Args {
    /// Azure-format traces to replay.
    pub traces: Vec<PathBuf>,
    /// Shapes to generate.
    pub shapes: Vec<Shape>,
    /// Shapes of random parameters to draw from the seed, besides.
    pub random: u32,
    /// Seed for the generated shapes.
    pub seed: u64,
    /// The config whose app supplies the policy (default: [`DEFAULT_APP`]).
    pub config: Option<PathBuf>,
    /// Which app of the config.
    pub app: Option<String>,
    /// Cold starts (default: 20 s, or 2/20/60 s for a sweep).
    pub colds: Vec<Duration>,
    /// Service-time model.
    pub model: ServiceModel,
    /// Replicas-over-time plot, one file per workload and cold start.
    pub plot: Option<PathBuf>,
    /// Sweep every shape (and each trace) and write `sweep.md` and
    /// `sweep.svg` into this folder.
    pub sweep: Option<PathBuf>,
}

/// Runs the command. Every error is the caller's (a bad file, trace or
/// argument): the CLI exits with its usage code.
pub fn run(args: Args) -> anyhow::Result<()> {
    let spec = app_spec(args.config.as_deref(), args.app.as_deref())?;
    let workloads = workloads(&args)?;
    let colds = if !args.colds.is_empty() {
        args.colds.clone()
    } else if args.sweep.is_some() {
        SWEEP_COLD_STARTS.to_vec()
    } else {
        vec![Duration::from_secs(20)]
    };
    let cfg = sweep_config(&spec, args.model);
    describe(&spec, &cfg, &workloads);
    let mut cells: Vec<Cell> = Vec::new();
    for w in &workloads {
        for cold in &colds {
            let cell = sweep::run(w, &cfg, *cold, args.plot.is_some());
            if let Some(base) = &args.plot {
                let file = plot_file(base, &w.name, *cold, workloads.len() > 1);
                if let Some(dir) = file.parent().filter(|d| !d.as_os_str().is_empty()) {
                    std::fs::create_dir_all(dir)
                        .map_err(|e| anyhow::anyhow!("{}: {e}", dir.display()))?;
                }
                let reports: Vec<_> = cell.rows.iter().map(|r| r.report.clone()).collect();
                crate::simplot::replicas_svg(&file, &reports, cfg.scaling.target, *cold)?;
                println!("plot: {}", file.display());
            }
            cells.push(cell);
        }
    }
    let table = sweep::markdown(&cells);
    let mut verdicts = sweep::verdicts(&cells);
    if args.sweep.is_some() {
        let engine = EngineModel::default();
        let engines: Vec<_> = workloads
            .iter()
            .flat_map(|w| colds.iter().map(move |c| (w, *c)))
            .map(|(w, cold)| sweep::run_engines(w, &cfg, cold, &engine))
            .collect();
        verdicts.push_str(&format!(
            "\nOn engine replicas (continuous batching, {} KV tokens, a step of {:.0} ms + {:.1} ms a sequence):\n\n{}",
            engine.kv_tokens,
            engine.step * 1000.0,
            engine.per_sequence * 1000.0,
            sweep::engine_markdown(&engines, spec.concurrency)
        ));
    }
    println!();
    println!("{table}");
    println!("{verdicts}");
    if let Some(dir) = &args.sweep {
        std::fs::create_dir_all(dir).map_err(|e| anyhow::anyhow!("{}: {e}", dir.display()))?;
        let md = dir.join("sweep.md");
        std::fs::write(&md, format!("{table}\n{verdicts}"))
            .map_err(|e| anyhow::anyhow!("{}: {e}", md.display()))?;
        let svg = dir.join("sweep.svg");
        crate::simplot::sweep_svg(&svg, &cells)?;
        println!("table: {}\nplot: {}", md.display(), svg.display());
    }
    Ok(())
}

/// The workloads replayed: the shapes asked for (every preset for a
/// sweep that names none), the random ones, then the traces.
fn workloads(args: &Args) -> anyhow::Result<Vec<Workload>> {
    let mut shapes = args.shapes.clone();
    if args.sweep.is_some() && shapes.is_empty() {
        shapes = Shape::presets().collect();
    }
    shapes.extend(Shape::random_many(args.seed, args.random as usize));
    if shapes.is_empty() && args.traces.is_empty() {
        anyhow::bail!(
            "nothing to replay: give --trace CSV, --shape NAME, --random N or --sweep DIR"
        );
    }
    let mut workloads = Vec::new();
    for shape in &shapes {
        workloads.push(Workload {
            name: shape.name(),
            bursty: shape.bursty(),
            requests: shape.generate(args.seed),
        });
    }
    for trace in &args.traces {
        let text = std::fs::read_to_string(trace)
            .map_err(|e| anyhow::anyhow!("{}: {e}", trace.display()))?;
        let requests =
            parse_azure_trace(&text).map_err(|e| anyhow::anyhow!("{}: {e}", trace.display()))?;
        let name = trace
            .file_stem()
            .map_or_else(|| "trace".into(), |s| s.to_string_lossy().into_owned());
        // A replayed trace is judged bursty by its arrivals.
        workloads.push(Workload {
            name,
            bursty: is_bursty(&requests),
            requests,
        });
    }
    Ok(workloads)
}

/// Prints the app's policy and service time, and each workload.
fn describe(spec: &AppSpec, cfg: &SweepConfig, workloads: &[Workload]) {
    println!(
        "app '{}': concurrency {}, target {:.1} (baselines {:.1}), replicas {}..{}; service time = {:?} + {:?}/prompt token + {:?}/generated token",
        spec.name,
        spec.concurrency,
        cfg.scaling.target,
        cfg.baseline_target,
        cfg.scaling.min,
        cfg.scaling.max,
        cfg.model.base,
        cfg.model.per_context_token,
        cfg.model.per_generated_token
    );
    for w in workloads {
        let span = w.requests.last().map_or(0.0, |r| r.arrival.as_secs_f64());
        println!(
            "workload {}: {} requests over {:.0} s{}",
            w.name,
            w.requests.len(),
            span,
            if w.bursty { ", bursty" } else { "" }
        );
    }
}

/// The app whose policy is simulated.
fn app_spec(config: Option<&Path>, app: Option<&str>) -> anyhow::Result<AppSpec> {
    let config = match config {
        Some(path) => Config::load(path).map_err(|e| anyhow::anyhow!("{e}"))?,
        None => Config::parse(DEFAULT_APP, Path::new("(built-in app)"), Path::new("."))
            .map_err(|e| anyhow::anyhow!("{e}"))?,
    };
    let spec = match app {
        Some(name) => config.app(name),
        None => config.apps.first(),
    };
    spec.cloned()
        .ok_or_else(|| anyhow::anyhow!("no such app in the config (use --app NAME)"))
}

/// The policies' settings from the app's spec: warmgate's own as the
/// gateway builds it, the warm-pool policy on the same replicas with the
/// pool defaults, and the baselines' target (without an explicit one,
/// Knative's own 70% utilisation).
fn sweep_config(spec: &AppSpec, model: ServiceModel) -> SweepConfig {
    let a = &spec.autoscale;
    let scaling = crate::serving::dispatch::scaling_config(spec);
    let baseline_target = a.target.unwrap_or(
        (f64::from(spec.concurrency) * warmgate_deploy::defaults::TARGET_UTILIZATION).max(1.0),
    );
    SweepConfig {
        pool: PoolScaling {
            min: a.min,
            max: a.max,
            concurrency: spec.concurrency,
            idle_ttl: warmgate_deploy::defaults::IDLE_TTL,
            buffer: 0,
        },
        scaling,
        baseline_target,
        sim: SimConfig {
            cold_start: Duration::from_secs(20),
            concurrency: spec.concurrency,
            tick: crate::runtime::autoscale::AUTOSCALE_TICK,
            max_pending: spec.queue.max_pending as usize,
            queue_timeout: spec.queue.timeout,
        },
        model,
    }
}

/// `base` with `-<workload>-<cold start>.svg` (the workload only when
/// there are several).
fn plot_file(base: &Path, workload: &str, cold: Duration, several: bool) -> PathBuf {
    let stem = base
        .file_stem()
        .map_or_else(|| "simulate".into(), |s| s.to_string_lossy().into_owned());
    let cold = humantime::format_duration(cold);
    let name = if several {
        format!("{stem}-{workload}-{cold}.svg")
    } else {
        format!("{stem}-{cold}.svg")
    };
    base.with_file_name(name)
}
