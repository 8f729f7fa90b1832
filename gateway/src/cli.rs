//! The command line: `warmgate serve` and the client commands.

use std::io::Write as _;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use bytes::Bytes;
use clap::{Parser, Subcommand};
use http_body_util::BodyExt;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::Value;
use warmgate_deploy::Config;

/// Exit code for a bad config or bad usage (`EX_USAGE` from sysexits.h).
pub const EXIT_USAGE: i32 = 64;
/// Exit code when the gateway cannot be reached (`EX_UNAVAILABLE`).
pub const EXIT_UNAVAILABLE: i32 = 69;

/// Why a call to the gateway's API failed, and the exit code each class
/// gets (from sysexits.h), so scripts can tell "fix the request" from
/// "try again" from "unreachable".
#[derive(Debug, thiserror::Error)]
pub enum CallError {
    /// No answer: the gateway is down, the address is wrong, or it timed
    /// out. Exit 69 (`EX_UNAVAILABLE`).
    #[error("{0}")]
    Unreachable(String),
    /// The gateway answered with an error status.
    #[error("{url} answered {status}: {message}")]
    Answered {
        /// What was called.
        url: String,
        /// The HTTP status.
        status: u16,
        /// The gateway's `error.message`.
        message: String,
    },
    /// The answer was not what the API returns (not JSON). Exit 76
    /// (`EX_PROTOCOL`).
    #[error("{0}")]
    Protocol(String),
    /// The command line itself is wrong (a `--gateway` that is not a URL,
    /// a token that cannot be sent). Exit 64 (`EX_USAGE`).
    #[error("{0}")]
    Usage(String),
}

impl CallError {
    /// The process exit code:
    /// - 65 (`EX_DATAERR`): the request was refused as it stands (400,
    ///   405, 413, 422);
    /// - 66 (`EX_NOINPUT`): no such app, pool, task or revision (404);
    /// - 69 (`EX_UNAVAILABLE`): no answer;
    /// - 70 (`EX_SOFTWARE`): the gateway or a worker failed (500, 502);
    /// - 75 (`EX_TEMPFAIL`): try again later (409 while a promotion runs,
    ///   429, 503, 504);
    /// - 64 (`EX_USAGE`): the command line is wrong (`--gateway` is not
    ///   an `http://` or `https://` URL);
    /// - 76 (`EX_PROTOCOL`): the answer was not the API's;
    /// - 77 (`EX_NOPERM`): a token is missing or wrong (401, 403).
    pub fn exit_code(&self) -> i32 {
        match self {
            CallError::Unreachable(_) => EXIT_UNAVAILABLE,
            CallError::Usage(_) => EXIT_USAGE,
            CallError::Protocol(_) => 76,
            CallError::Answered { status, .. } => match status {
                401 | 403 => 77,
                404 => 66,
                409 | 429 | 503 | 504 => 75,
                400..=499 => 65,
                _ => 70,
            },
        }
    }
}

/// How the client commands print what they did or found.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Output {
    /// Aligned columns for people.
    Table,
    /// The API's JSON answer, for scripts (`jq`).
    Json,
}
/// Default gateway address for client commands.
const DEFAULT_GATEWAY: &str = "http://127.0.0.1:8080";

/// warmgate: warm pools, scale to zero, one gateway for inference and RL.
#[derive(Debug, Parser)]
#[command(name = "warmgate", version, about)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
    /// A PEM file of CA certificates to trust, besides the system's, when
    /// the gateway's address is `https://` (a private CA, or a
    /// self-signed gateway).
    #[arg(long, global = true, env = "WARMGATE_CACERT", value_name = "FILE")]
    pub cacert: Option<PathBuf>,
}

impl Cli {
    /// Whether it is a client command (not `serve` or `operator`, which
    /// run until stopped and must outlive their clients' closed pipes).
    pub fn is_client(&self) -> bool {
        !matches!(
            self.command,
            Command::Serve { .. } | Command::Operator { .. }
        )
    }
}

/// The CA file `--cacert` named, for every call this CLI process makes.
static CACERT: std::sync::OnceLock<Option<PathBuf>> = std::sync::OnceLock::new();

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the gateway, pool manager and autoscaler in one process.
    Serve {
        /// The TOML config file.
        #[arg(long, short, env = "WARMGATE_CONFIG")]
        config: PathBuf,
        /// Listen here instead of the config's `listen`.
        #[arg(long)]
        listen: Option<SocketAddr>,
        /// Only validate the config: exit 0 if it is valid, 64 if not.
        #[arg(long)]
        check: bool,
        /// Threads that serve traffic (default: one per CPU). With 1, a
        /// single-threaded runtime is used, which is faster on one core.
        #[arg(long, env = "WARMGATE_THREADS")]
        threads: Option<usize>,
        /// `text` for people, `json` (one object per line) for log
        /// pipelines.
        #[arg(long, env = "WARMGATE_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
        log_format: LogFormat,
        /// Listen beyond loopback without `WARMGATE_ADMIN_TOKEN`: anyone who
        /// can reach the port may then promote, roll back and sync weights.
        #[arg(long)]
        insecure: bool,
        /// Start from the config file alone: drop the changes made through
        /// the API (which are otherwise kept over the file, and listed in
        /// `status` as such).
        #[arg(long)]
        config_wins: bool,
    },
    /// Print the Kubernetes CustomResourceDefinitions (`ServingApp`,
    /// `WarmPool`) as YAML, for `kubectl apply -f -`.
    Crds,
    /// Run in a cluster: serve the ServingApp and WarmPool resources of a
    /// namespace as replica pods (one leader at a time, by Lease).
    Operator {
        /// Settings only (limits, tenants, `[backend.kubernetes]`); apps
        /// and pools come from the resources.
        #[arg(long, short, env = "WARMGATE_CONFIG")]
        config: Option<PathBuf>,
        /// Namespace to serve (default: the pod's own).
        #[arg(long, env = "WARMGATE_NAMESPACE")]
        namespace: Option<String>,
        /// Listen address.
        #[arg(long, default_value = "0.0.0.0:8080")]
        listen: SocketAddr,
        /// `text` or `json` logs.
        #[arg(long, env = "WARMGATE_LOG_FORMAT", value_enum, default_value_t = LogFormat::Json)]
        log_format: LogFormat,
        /// Listen beyond loopback without `WARMGATE_ADMIN_TOKEN` (the Helm
        /// chart always sets one): anyone who can reach the pod may then
        /// promote, roll back and sync weights.
        #[arg(long)]
        insecure: bool,
    },
    /// Work with checkpoints in object storage.
    Weights {
        /// What to do.
        #[command(subcommand)]
        command: WeightsCommand,
    },
    /// Replay arrival traces (Azure LLM format) or generated shapes against
    /// the autoscaling policy, the warm-pool policy, the baselines
    /// (Knative's and Ray Serve's defaults, always at peak) and the
    /// clairvoyant bound; print replica-seconds (the GPU bill), queueing
    /// delay, cold starts and failures.
    Simulate {
        /// A trace (Azure LLM inference format:
        /// TIMESTAMP,ContextTokens,GeneratedTokens); repeat for several.
        #[arg(long)]
        trace: Vec<PathBuf>,
        /// Generated traffic, comma-separated: steady, bursts-short,
        /// bursts-long, daily, spikes; or a family with parameters
        /// (rates per second, lengths in seconds or with a unit):
        /// poisson:rate=R, on-off:low=R:high=R:on=S:off=S,
        /// daily:low=R:high=R, spikes:every=S:min=N:max=N:within=S.
        #[arg(long, value_delimiter = ',')]
        shape: Vec<warmgate_autoscaler::sim::shapes::Shape>,
        /// Also draw N shapes of random parameters (of every family) from
        /// the seed: traffic nobody tuned the policy on.
        #[arg(long, default_value_t = 0, value_name = "N", value_parser = clap::value_parser!(u32).range(0..=1000))]
        random: u32,
        /// Seed for the generated shapes.
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// The config whose app supplies concurrency, target and knobs
        /// (default: the defaults, with concurrency 8 and max 20).
        #[arg(long, short)]
        config: Option<PathBuf>,
        /// Which app of the config (default: the first).
        #[arg(long)]
        app: Option<String>,
        /// Cold start(s) to simulate, comma-separated (default 20s, or
        /// 2s,20s,60s with --sweep).
        #[arg(long, value_delimiter = ',')]
        cold_start: Vec<humantime::Duration>,
        /// Service time: fixed overhead per request.
        #[arg(long, default_value = "20ms")]
        base: humantime::Duration,
        /// Service time: prefill per prompt token.
        #[arg(long, default_value = "100us")]
        prefill: humantime::Duration,
        /// Service time: decode per generated token.
        #[arg(long, default_value = "20ms")]
        decode: humantime::Duration,
        /// Also draw replicas over time against demand, per policy, as SVG
        /// (PLOT-<cold start>.svg, with the workload's name when several).
        #[arg(long)]
        plot: Option<PathBuf>,
        /// Run every shape (and each --trace) at each cold start, and write
        /// DIR/sweep.md (the table) and DIR/sweep.svg (the plot).
        #[arg(long, value_name = "DIR")]
        sweep: Option<PathBuf>,
    },
    /// Make a new revision from a checkpoint and shift traffic to it.
    Promote {
        /// The app.
        app: String,
        /// The checkpoint URI (s3://, gs://, az://, file://).
        checkpoint: String,
        /// Send this percent of traffic to it first, for the bake time.
        #[arg(long)]
        canary: Option<u8>,
        /// How long the canary runs before the rest of the traffic moves.
        #[arg(long)]
        bake: Option<humantime::Duration>,
        /// Wait until it serves 100% (exit 0) or is rolled back (exit 1).
        #[arg(long)]
        wait: bool,
        /// Swap the weights into the serving replicas (their
        /// `POST /weights`) instead of starting new ones: no extra GPU.
        /// The canary is the first replicas swapped.
        #[arg(long)]
        in_place: bool,
        /// Promote this LoRA adapter of the app to the checkpoint (a
        /// `file://` folder, or an `s3://`, `gs://` or `az://` prefix)
        /// instead: the canary is a share of that adapter's requests, no
        /// replica starts.
        #[arg(long, value_name = "NAME", conflicts_with = "in_place")]
        adapter: Option<String>,
        /// The gateway to ask.
        #[arg(long, env = "WARMGATE_GATEWAY", default_value = DEFAULT_GATEWAY)]
        gateway: String,
        /// `table` for people, `json` (the API's answer) for scripts.
        #[arg(long, short, value_enum, default_value_t = Output::Table)]
        output: Output,
    },
    /// Make a running gateway serve the apps and pools of a config file:
    /// puts each (unchanged ones keep their replicas), deletes the others,
    /// and prints what changed.
    Apply {
        /// The TOML config file; its `[[apps]]` and `[[pools]]` are applied.
        #[arg(long, short, env = "WARMGATE_CONFIG")]
        config: PathBuf,
        /// The gateway to ask.
        #[arg(long, env = "WARMGATE_GATEWAY", default_value = DEFAULT_GATEWAY)]
        gateway: String,
        /// `table` for people, `json` (`{"changes": [...]}`, refusals
        /// included) for scripts.
        #[arg(long, short, value_enum, default_value_t = Output::Table)]
        output: Output,
    },
    /// Route traffic back to the previous good revision.
    Rollback {
        /// The app.
        app: String,
        /// The gateway to ask.
        #[arg(long, env = "WARMGATE_GATEWAY", default_value = DEFAULT_GATEWAY)]
        gateway: String,
        /// `table` for people, `json` (the API's answer) for scripts.
        #[arg(long, short, value_enum, default_value_t = Output::Table)]
        output: Output,
    },
    /// Print a replica's output (its log on the gateway's machine) through
    /// the API: the last lines of the replica that wrote last, or of
    /// REPLICA; `-f` keeps printing what it writes. Secrets the replica
    /// was given are redacted. Needs the admin token.
    Logs {
        /// The app or pool.
        name: String,
        /// One of its replicas (`warmgate status` lists them; default:
        /// the one whose log was written last, running or ended).
        replica: Option<String>,
        /// Keep printing new lines as the replica writes them (Ctrl-C
        /// ends it).
        #[arg(long, short)]
        follow: bool,
        /// Lines of the end to print first.
        #[arg(long, default_value_t = 100)]
        tail: usize,
        /// The gateway to ask.
        #[arg(long, env = "WARMGATE_GATEWAY", default_value = DEFAULT_GATEWAY)]
        gateway: String,
    },
    /// List an app's revisions: checkpoint, created, state, traffic.
    Revisions {
        /// The app.
        app: String,
        /// The gateway to ask.
        #[arg(long, env = "WARMGATE_GATEWAY", default_value = DEFAULT_GATEWAY)]
        gateway: String,
        /// `table` for people, `json` for scripts.
        #[arg(long, short, value_enum, default_value_t = Output::Table)]
        output: Output,
    },
    /// Print a shell's completion script, e.g.
    /// `warmgate completions bash > /etc/bash_completion.d/warmgate`.
    Completions {
        /// The shell: bash, zsh, fish, elvish or powershell.
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
    /// Show apps, replicas and queues, like `squeue`.
    Status {
        /// Refresh the table in place.
        #[arg(long, short)]
        watch: bool,
        /// Refresh interval for --watch: `2s`, `500ms` (a bare number is
        /// seconds, as before).
        #[arg(long, default_value = "1s", value_parser = parse_interval)]
        interval: Duration,
        /// The gateway to ask.
        #[arg(long, env = "WARMGATE_GATEWAY", default_value = DEFAULT_GATEWAY)]
        gateway: String,
        /// `table` for people, `json` for scripts.
        #[arg(long, short, value_enum, default_value_t = Output::Table)]
        output: Output,
    },
}

/// The `weights` subcommands.
#[derive(Debug, Subcommand)]
pub enum WeightsCommand {
    /// Stream a checkpoint (a prefix, or one object) to a local folder with
    /// parallel ranged reads, showing progress and the final throughput.
    Pull {
        /// `s3://bucket/prefix`, `gs://…`, `az://…`, `file:///…` or a
        /// relative `file://./…`. Credentials come from the usual
        /// environment variables (AWS_*, GOOGLE_*, AZURE_*).
        uri: String,
        /// The folder to write into (created if missing).
        dir: PathBuf,
        /// Ranged GETs in flight.
        #[arg(long, default_value_t = 16)]
        concurrency: usize,
        /// Bytes per ranged GET: `8MiB`, `16Mi`, or bytes.
        #[arg(long, default_value = "8MiB", value_parser = parse_size_arg)]
        part_size: u64,
        /// Bytes of parts held in memory at once: `512MiB`, `1Gi`, or bytes.
        #[arg(long, default_value = "512MiB", value_parser = parse_size_arg)]
        memory_limit: u64,
        /// The old spelling of --part-size, in MiB.
        #[arg(long, hide = true)]
        part_size_mib: Option<u64>,
        /// The old spelling of --memory-limit, in MiB.
        #[arg(long, hide = true)]
        memory_limit_mib: Option<u64>,
        /// Keep a content-addressed copy here; a later pull of the same
        /// objects reads it instead of the store.
        #[arg(long)]
        cache: Option<PathBuf>,
    },
}

/// Runs a command; returns the process exit code.
pub fn run(cli: Cli) -> i32 {
    let _ = CACERT.set(cli.cacert.clone());
    match cli.command {
        Command::Serve {
            config,
            listen,
            check,
            threads,
            log_format,
            insecure,
            config_wins,
        } => serve(
            config,
            listen,
            check,
            threads,
            log_format,
            Start {
                insecure,
                config_wins,
            },
        ),
        Command::Status {
            watch,
            interval,
            gateway,
            output,
        } => status(&gateway, watch, interval, output),
        Command::Completions { shell } => {
            use clap::CommandFactory as _;
            clap_complete::generate(
                shell,
                &mut Cli::command(),
                "warmgate",
                &mut std::io::stdout(),
            );
            0
        }
        Command::Simulate {
            trace,
            shape,
            random,
            seed,
            config,
            app,
            cold_start,
            base,
            prefill,
            decode,
            plot,
            sweep,
        } => match crate::simulate::run(crate::simulate::Args {
            traces: trace,
            shapes: shape,
            random,
            seed,
            config,
            app,
            colds: cold_start.into_iter().map(Into::into).collect(),
            model: warmgate_autoscaler::sim::ServiceModel {
                base: base.into(),
                per_context_token: prefill.into(),
                per_generated_token: decode.into(),
            },
            plot,
            sweep,
        }) {
            Ok(()) => 0,
            Err(e) => {
                eprintln!("error: {e:#}");
                EXIT_USAGE
            }
        },
        Command::Promote {
            app,
            checkpoint,
            canary,
            bake,
            wait,
            in_place,
            adapter,
            gateway,
            output,
        } => promote(
            &gateway,
            &app,
            &checkpoint,
            Promotion {
                canary,
                bake,
                wait,
                in_place,
                adapter,
            },
            output,
        ),
        Command::Apply {
            config,
            gateway,
            output,
        } => apply(&gateway, &config, output),
        Command::Rollback {
            app,
            gateway,
            output,
        } => rollback(&gateway, &app, output),
        Command::Revisions {
            app,
            gateway,
            output,
        } => revisions(&gateway, &app, output),
        Command::Logs {
            name,
            replica,
            follow,
            tail,
            gateway,
        } => logs(&gateway, &name, replica.as_deref(), follow, tail),
        Command::Operator {
            config,
            namespace,
            listen,
            log_format,
            insecure,
        } => {
            if let Err(e) = refuse_open_listen(listen, insecure) {
                eprintln!("error: {e}");
                return EXIT_USAGE;
            }
            let _telemetry = crate::telemetry::init(log_format);
            raise_open_file_limit();
            keep_environment_private();
            let rt = match runtime(None) {
                Ok(rt) => rt,
                Err(e) => {
                    eprintln!("error: could not start the runtime: {e}");
                    return 1;
                }
            };
            let args = crate::operator::OperatorArgs {
                config,
                namespace,
                listen,
            };
            match rt.block_on(crate::operator::run(args)) {
                Ok(()) => 0,
                Err(e) => {
                    eprintln!("error: {e:#}");
                    1
                }
            }
        }
        Command::Crds => match warmgate_deploy::crd::crds_yaml() {
            Ok(yaml) => {
                print!("{yaml}");
                0
            }
            Err(e) => {
                eprintln!("warmgate crds: {e}");
                1
            }
        },
        Command::Weights {
            command:
                WeightsCommand::Pull {
                    uri,
                    dir,
                    concurrency,
                    part_size,
                    memory_limit,
                    part_size_mib,
                    memory_limit_mib,
                    cache,
                },
        } => {
            let cfg = warmgate_pool::weights::StreamConfig {
                concurrency: concurrency.max(1),
                part_size: part_size_mib.map_or(part_size, |m| m << 20).max(1),
                memory_limit: memory_limit_mib.map_or(memory_limit, |m| m << 20).max(1),
            };
            weights_pull(&uri, &dir, cfg, cache)
        }
    }
}

fn runtime(threads: Option<usize>) -> std::io::Result<tokio::runtime::Runtime> {
    match threads {
        // One thread: the current-thread scheduler skips the work-stealing
        // machinery, about 20% more requests per second on one core.
        Some(1) => tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build(),
        n => {
            let mut b = tokio::runtime::Builder::new_multi_thread();
            if let Some(n) = n {
                b.worker_threads(n.max(1));
            }
            b.enable_all().thread_name("warmgate").build()
        }
    }
}

pub use crate::telemetry::LogFormat;

/// A listen address beyond loopback needs `WARMGATE_ADMIN_TOKEN`, unless
/// the user says `--insecure`: the control plane would be open to anyone
/// who can reach the port.
fn refuse_open_listen(listen: SocketAddr, insecure: bool) -> Result<(), String> {
    if listen.ip().is_loopback() || crate::server::admin_token().is_some() || insecure {
        return Ok(());
    }
    Err(format!(
        "refusing to listen on {listen} without WARMGATE_ADMIN_TOKEN: anyone who can reach it \
         could change deployments. Set a token, listen on loopback, or pass --insecure."
    ))
}

/// How `serve` starts, beyond its config.
struct Start {
    /// `--insecure`.
    insecure: bool,
    /// `--config-wins`.
    config_wins: bool,
}

fn serve(
    path: PathBuf,
    listen: Option<SocketAddr>,
    check: bool,
    threads: Option<usize>,
    log_format: LogFormat,
    start: Start,
) -> i32 {
    let Start {
        insecure,
        config_wins,
    } = start;
    let mut config = match Config::load(&path) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("error: {e}");
            return EXIT_USAGE;
        }
    };
    if let Some(l) = listen {
        config.listen = l;
    }
    if check {
        // Beyond the schema: what `serve` would trip on on this machine.
        let search = std::env::var("PATH").ok();
        let mut found = crate::preflight::check(
            &config,
            search.as_deref(),
            crate::preflight::nvidia_gpu_present,
        );
        found.extend(crate::preflight::check_listen(config.listen));
        let errors = found
            .iter()
            .filter(|f| f.level == crate::preflight::Level::Error)
            .count();
        for f in &found {
            let level = match f.level {
                crate::preflight::Level::Error => "error",
                crate::preflight::Level::Warning => "warning",
            };
            eprintln!("{level}: {}: {}: {}", path.display(), f.key, f.message);
        }
        if errors > 0 {
            eprintln!(
                "{}: {errors} error{} ({} warning{})",
                path.display(),
                if errors == 1 { "" } else { "s" },
                found.len() - errors,
                if found.len() - errors == 1 { "" } else { "s" }
            );
            return EXIT_USAGE;
        }
        println!(
            "{}: ok ({} app{}{})",
            path.display(),
            config.apps.len(),
            if config.apps.len() == 1 { "" } else { "s" },
            match found.len() {
                0 => String::new(),
                1 => ", 1 warning".into(),
                n => format!(", {n} warnings"),
            }
        );
        return 0;
    }
    if let Err(e) = refuse_open_listen(config.listen, insecure) {
        eprintln!("error: {e}");
        return EXIT_USAGE;
    }
    let _telemetry = crate::telemetry::init(log_format);
    raise_open_file_limit();
    keep_environment_private();
    let rt = match runtime(threads) {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: could not start the runtime: {e}");
            return 1;
        }
    };
    match rt.block_on(crate::runtime::serve_async(config, path, config_wins)) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("error: {e:#}");
            1
        }
    }
}

/// Makes the gateway's process non-dumpable, so a worker running as the
/// same (non-root) user cannot read its environment (the admin token,
/// tenant keys, cloud credentials) from `/proc/<gateway>/environ`, nor
/// attach to it. Workers are dumpable again after their `exec`. A worker
/// running as root can still read it: run workers as another user for that.
pub fn keep_environment_private() {
    if let Err(e) = nix::sys::prctl::set_dumpable(false) {
        tracing::warn!(error = %e, "cannot make the gateway non-dumpable");
    }
}

/// Raises the soft limit on open files to the hard limit. Every client
/// connection, replica connection and checkpoint file takes a descriptor;
/// the usual soft default of 1024 lets about a thousand idle sockets lock
/// out clients and the workers' weight fetches, while the hard limit is
/// what the administrator actually allows.
fn raise_open_file_limit() {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    match getrlimit(Resource::RLIMIT_NOFILE) {
        Ok((soft, hard)) if soft < hard => match setrlimit(Resource::RLIMIT_NOFILE, hard, hard) {
            Ok(()) => tracing::debug!(from = soft, to = hard, "raised the open-file limit"),
            Err(e) => {
                tracing::warn!(soft, hard, error = %e, "cannot raise the open-file limit")
            }
        },
        Ok(_) => {}
        Err(e) => tracing::warn!(error = %e, "cannot read the open-file limit"),
    }
}
// === client commands ===

fn weights_pull(
    uri: &str,
    dir: &std::path::Path,
    cfg: warmgate_pool::weights::StreamConfig,
    cache_dir: Option<PathBuf>,
) -> i32 {
    use warmgate_pool::weights::{Cache, Source, checksums, plan, pull};
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: {e}");
            return 1;
        }
    };
    let result = rt.block_on(async {
        let cwd = std::env::current_dir().unwrap_or_else(|_| PathBuf::from("."));
        let src = Source::open(uri, &cwd)?;
        let items = plan(&src).await?;
        let sums = checksums(&items, &cfg).await?;
        let total: u64 = items.iter().map(|i| i.meta.size).sum();
        let cache = cache_dir
            .map(|d| Cache::open(d, u64::MAX))
            .transpose()?;
        let bar = indicatif::ProgressBar::new(total);
        bar.set_style(
            indicatif::ProgressStyle::with_template(
                "{spinner} [{elapsed_precise}] {wide_bar} {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
            )
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        let start = std::time::Instant::now();
        let report = pull(&items, dir, &cfg, cache.as_ref(), &sums, &|n| bar.inc(n)).await;
        bar.finish_and_clear();
        report.map(|r| (r, start.elapsed()))
    });
    match result {
        Ok((r, took)) => {
            let secs = took.as_secs_f64().max(1e-9);
            println!(
                "pulled {} file{} ({}) from {uri} to {} in {:.2}s: {}/s ({} from the cache)",
                r.files,
                if r.files == 1 { "" } else { "s" },
                human_bytes(r.bytes),
                dir.display(),
                secs,
                human_bytes((r.bytes as f64 / secs) as u64),
                human_bytes(r.from_cache),
            );
            0
        }
        Err(e) => {
            eprintln!("error: {e}");
            1
        }
    }
}

fn human_bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut i = 0;
    while v >= 1024.0 && i + 1 < UNITS.len() {
        v /= 1024.0;
        i += 1;
    }
    if i == 0 {
        format!("{n} B")
    } else {
        format!("{v:.2} {}", UNITS[i])
    }
}

/// A duration as people write it (`2s`, `500ms`), or a bare number of
/// seconds (the old spelling).
fn parse_interval(text: &str) -> Result<Duration, String> {
    let d = match text.trim().parse::<f64>() {
        Ok(secs) if secs.is_finite() && secs >= 0.0 => Duration::from_secs_f64(secs),
        Ok(_) => return Err(format!("{text:?} is not a duration")),
        Err(_) => humantime::parse_duration(text.trim())
            .map_err(|e| format!("{text:?} is not a duration (e.g. 2s, 500ms): {e}"))?,
    };
    Ok(d.clamp(Duration::from_millis(100), Duration::from_secs(3600)))
}

/// A size as people write it (`8MiB`, `16Gi`) or a number of bytes.
fn parse_size_arg(text: &str) -> Result<u64, String> {
    warmgate_deploy::parse_size(text)
}

/// How often `logs -f` asks for more.
const FOLLOW_EVERY: Duration = Duration::from_secs(1);

/// The single-threaded runtime a client command runs on; exit 70 when
/// it cannot be had.
fn client_runtime() -> Result<tokio::runtime::Runtime, i32> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| {
            eprintln!("error: could not start a runtime: {e}");
            70
        })
}

fn logs(gateway: &str, name: &str, replica: Option<&str>, follow: bool, tail: usize) -> i32 {
    let rt = match client_runtime() {
        Ok(rt) => rt,
        Err(code) => return code,
    };
    let enc = |s: &str| {
        percent_encoding::utf8_percent_encode(s, percent_encoding::NON_ALPHANUMERIC).to_string()
    };
    rt.block_on(async {
        // An app's, else a pool's.
        let mut query = format!("lines={tail}");
        if let Some(r) = replica {
            query.push_str(&format!("&replica={}", enc(r)));
        }
        let mut base = format!("/v1/apps/{}/logs", enc(name));
        let mut chunk = get_json(gateway, &format!("{base}?{query}")).await;
        if let Err(CallError::Answered {
            status: 404,
            message,
            ..
        }) = &chunk
            && message.contains("not found")
        {
            base = format!("/v1/pools/{}/logs", enc(name));
            chunk = get_json(gateway, &format!("{base}?{query}")).await;
        }
        let mut chunk = match chunk {
            Ok(v) => v,
            Err(e) => {
                eprintln!("error: {e}");
                return e.exit_code();
            }
        };
        let replica = chunk["replica"].as_str().unwrap_or_default().to_string();
        if follow {
            eprintln!("==> {replica} <==");
        }
        loop {
            print!("{}", chunk["text"].as_str().unwrap_or_default());
            let _ = std::io::stdout().flush();
            if !follow {
                return 0;
            }
            let next = chunk["next_offset"].as_u64().unwrap_or(0);
            let size = chunk["size"].as_u64().unwrap_or(0);
            if next >= size {
                tokio::select! {
                    _ = tokio::time::sleep(FOLLOW_EVERY) => {}
                    _ = tokio::signal::ctrl_c() => return 0,
                }
            }
            let path = format!("{base}?replica={}&offset={next}", enc(&replica));
            chunk = match get_json(gateway, &path).await {
                Ok(v) => v,
                Err(e) => {
                    eprintln!("error: {e}");
                    return e.exit_code();
                }
            };
        }
    })
}

fn status(gateway: &str, watch: bool, interval: Duration, output: Output) -> i32 {
    let rt = match client_runtime() {
        Ok(rt) => rt,
        Err(code) => return code,
    };
    rt.block_on(async {
        loop {
            let table = match get_json(gateway, "/v1/status").await {
                Ok(v) if output == Output::Json => format!("{v:#}\n"),
                Ok(v) => render_status(&v),
                Err(e) => {
                    eprintln!("error: {e}");
                    return e.exit_code();
                }
            };
            if watch {
                // Home the cursor and clear the screen: a table refreshed in place.
                print!("\x1b[H\x1b[2J{table}");
            } else {
                print!("{table}");
            }
            let _ = std::io::stdout().flush();
            if !watch {
                return 0;
            }
            tokio::select! {
                _ = tokio::time::sleep(interval) => {}
                _ = tokio::signal::ctrl_c() => return 0,
            }
        }
    })
}

async fn get_json(gateway: &str, path: &str) -> Result<Value, CallError> {
    call(
        gateway,
        http::Method::GET,
        path,
        None,
        Duration::from_secs(10),
    )
    .await
}

/// One call to the gateway's API; a non-2xx answer is an error with the
/// gateway's message.
async fn call(
    gateway: &str,
    method: http::Method,
    path: &str,
    body: Option<Value>,
    timeout: Duration,
) -> Result<Value, CallError> {
    check_gateway_url(gateway)?;
    let url = format!("{}{path}", gateway.trim_end_matches('/'));
    let client = http_client(gateway)?;
    let bytes = body.map_or_else(Bytes::new, |b| Bytes::from(b.to_string()));
    let mut req = http::Request::builder()
        .method(method)
        .uri(&url)
        .header(http::header::CONTENT_TYPE, "application/json")
        .body(http_body_util::Full::new(bytes))
        .map_err(|e| CallError::Unreachable(format!("bad gateway URL {url:?}: {e}")))?;
    // The token given, else the one a gateway of this user made for
    // itself and published for its address.
    let token = std::env::var("WARMGATE_ADMIN_TOKEN")
        .ok()
        .filter(|t| !t.is_empty())
        .or_else(|| crate::runtime::admin_token::find_for(gateway));
    if let Some(token) = token {
        let v = http::HeaderValue::from_str(&format!("Bearer {token}")).map_err(|_| {
            CallError::Usage("WARMGATE_ADMIN_TOKEN is not a valid header value".into())
        })?;
        req.headers_mut().insert(http::header::AUTHORIZATION, v);
    }
    let resp = tokio::time::timeout(timeout, client.request(req))
        .await
        .map_err(|_| {
            CallError::Unreachable(format!(
                "{url} did not answer within {}",
                humantime::format_duration(timeout)
            ))
        })?
        .map_err(|e| {
            CallError::Unreachable(format!(
                "cannot reach the gateway at {gateway} (is `warmgate serve` running? set WARMGATE_GATEWAY): {}",
                with_causes(&e)
            ))
        })?;
    let status = resp.status();
    let body = resp
        .into_body()
        .collect()
        .await
        .map_err(|e| CallError::Unreachable(format!("{url}: the answer broke off: {e}")))?
        .to_bytes();
    let v: Option<Value> = serde_json::from_slice(&body).ok();
    if !status.is_success() {
        let message = v
            .as_ref()
            .and_then(|v| v["error"]["message"].as_str())
            .map_or_else(
                || String::from_utf8_lossy(&body[..body.len().min(200)]).into_owned(),
                str::to_string,
            );
        return Err(CallError::Answered {
            url,
            status: status.as_u16(),
            message,
        });
    }
    v.ok_or_else(|| CallError::Protocol(format!("{url}: the answer is not JSON")))
}

/// An error and what caused it, `: `-separated (hyper's client error says
/// only "client error (Connect)"; the cause says which certificate).
fn with_causes(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        let more = c.to_string();
        if !text.contains(&more) {
            text.push_str(": ");
            text.push_str(&more);
        }
        cause = c.source();
    }
    text
}

/// A client for `gateway`: plain HTTP, or HTTPS trusting the system's
/// roots and `--cacert`.
fn http_client(
    gateway: &str,
) -> Result<
    Client<
        hyper_rustls::HttpsConnector<hyper_util::client::legacy::connect::HttpConnector>,
        http_body_util::Full<Bytes>,
    >,
    CallError,
> {
    let https = gateway.starts_with("https://");
    let cacert = CACERT.get().and_then(Option::as_deref).filter(|_| https);
    let tls = crate::tls::client_config(cacert, https)
        .map_err(|e| CallError::Unreachable(format!("--cacert: {e}")))?;
    let builder = hyper_rustls::HttpsConnectorBuilder::new().with_tls_config(tls);
    let connector = if https {
        builder.https_only()
    } else {
        builder.https_or_http()
    }
    .enable_http1()
    .build();
    Ok(Client::builder(TokioExecutor::new()).build(connector))
}

/// Runs one API call on a small runtime; prints errors; returns the exit
/// code and the answer.
fn api(
    gateway: &str,
    method: http::Method,
    path: &str,
    body: Option<Value>,
    timeout: Duration,
) -> Result<Value, i32> {
    block_on_call(gateway, method, path, body, timeout).map_err(|e| {
        eprintln!("error: {e}");
        e.exit_code()
    })
}

/// `--gateway` (or `$WARMGATE_GATEWAY`) must be an `http://` or
/// `https://` URL with a host: `localhost:8000` alone is a usage error,
/// not an unreachable gateway.
fn check_gateway_url(gateway: &str) -> Result<(), CallError> {
    let uri: Result<http::Uri, _> = gateway.parse();
    let ok = uri
        .is_ok_and(|u| matches!(u.scheme_str(), Some("http" | "https")) && u.authority().is_some());
    if ok {
        Ok(())
    } else {
        Err(CallError::Usage(format!(
            "--gateway {gateway:?} is not a URL: give http://HOST:PORT (or https://)"
        )))
    }
}

/// One API call on a small runtime of its own.
fn block_on_call(
    gateway: &str,
    method: http::Method,
    path: &str,
    body: Option<Value>,
    timeout: Duration,
) -> Result<Value, CallError> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| CallError::Unreachable(format!("could not start a runtime: {e}")))?;
    rt.block_on(call(gateway, method, path, body, timeout))
}

/// What `warmgate promote` asks for.
struct Promotion {
    canary: Option<u8>,
    bake: Option<humantime::Duration>,
    wait: bool,
    in_place: bool,
    adapter: Option<String>,
}

/// `warmgate promote`.
fn promote(gateway: &str, app: &str, checkpoint: &str, p: Promotion, output: Output) -> i32 {
    let Promotion {
        canary,
        bake,
        wait,
        in_place,
        adapter,
    } = p;
    let mut body = serde_json::json!({"checkpoint": checkpoint, "wait": wait});
    if in_place {
        body["in_place"] = true.into();
    }
    let what = match &adapter {
        Some(a) => {
            body["adapter"] = a.clone().into();
            format!("{app}: adapter {a}")
        }
        None => app.to_string(),
    };
    if let Some(c) = canary {
        body["canary"] = c.into();
    }
    if let Some(b) = bake {
        body["bake"] = b.to_string().into();
    }
    let timeout = if wait {
        Duration::from_secs(24 * 3600)
    } else {
        Duration::from_secs(600)
    };
    let v = match api(
        gateway,
        http::Method::POST,
        &format!("/v1/apps/{app}/promote"),
        Some(body),
        timeout,
    ) {
        Ok(v) => v,
        Err(code) => return code,
    };
    let rev = v["revision"].as_str().unwrap_or("?");
    if output == Output::Json {
        println!("{v:#}");
    }
    if !wait {
        if output == Output::Table {
            let follow = match &adapter {
                Some(_) => "`warmgate status`".to_string(),
                None => format!("`warmgate revisions {app}`"),
            };
            println!("{what}: promoting {rev} (follow it with {follow})");
        }
        return 0;
    }
    let p = &v["promotion"];
    match p["phase"].as_str() {
        Some("done") => {
            if output == Output::Table {
                println!("{what}: {rev} serves 100%");
            }
            0
        }
        Some(phase) => {
            eprintln!(
                "{what}: {rev} did not take over ({phase}): {}",
                p["reason"].as_str().unwrap_or("no reason given")
            );
            1
        }
        None => {
            eprintln!("{app}: unexpected answer {v}");
            1
        }
    }
}

/// `warmgate rollback`.
fn rollback(gateway: &str, app: &str, output: Output) -> i32 {
    match api(
        gateway,
        http::Method::POST,
        &format!("/v1/apps/{app}/rollback"),
        None,
        Duration::from_secs(30),
    ) {
        Ok(v) => {
            match output {
                Output::Json => println!("{v:#}"),
                Output::Table => println!(
                    "{app}: rolling back to {}",
                    v["revision"].as_str().unwrap_or("?")
                ),
            }
            0
        }
        Err(code) => code,
    }
}

/// `warmgate apply`: the file's apps and pools put, the gateway's others
/// deleted (deletions first, so a name may move from a pool to an app),
/// one line per change (or, with `-o json`, one object listing them, the
/// refused ones with the gateway's status and message). Exit 0 when every
/// change was taken, 1 when one was refused (the others still apply), 64
/// for a bad file.
fn apply(gateway: &str, file: &std::path::Path, output: Output) -> i32 {
    let config = match Config::load(file) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("error: {e}");
            return EXIT_USAGE;
        }
    };
    let status = match api(
        gateway,
        http::Method::GET,
        "/v1/status",
        None,
        Duration::from_secs(10),
    ) {
        Ok(v) => v,
        Err(code) => return code,
    };
    let running = |kind: &str| -> Vec<String> {
        status[kind]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|x| x["name"].as_str().map(str::to_string))
            .collect()
    };
    let mut refused = false;
    let mut changes = Vec::new();
    let mut change = |method: http::Method, kind: &str, name: &str, body: Option<Value>| {
        let path = format!("/v1/{kind}s/{name}");
        let mut row = serde_json::json!({"kind": kind, "name": name});
        match block_on_call(gateway, method, &path, body, Duration::from_secs(60)) {
            Ok(v) => {
                row["change"] = v["change"].clone();
                if let Some(rev) = v["revision"].as_str() {
                    row["revision"] = rev.into();
                }
                if output == Output::Table {
                    let what = v["change"].as_str().unwrap_or("?").replace('_', " ");
                    match v["revision"].as_str() {
                        Some(rev) => println!("{kind} {name}: {what} (to {rev})"),
                        None => println!("{kind} {name}: {what}"),
                    }
                }
            }
            Err(e) => {
                refused = true;
                eprintln!("error: {e}");
                row["error"] = match &e {
                    CallError::Answered {
                        status, message, ..
                    } => serde_json::json!({"status": status, "message": message}),
                    other => serde_json::json!({"message": other.to_string()}),
                };
            }
        }
        changes.push(row);
    };
    for name in running("pools") {
        if !config.pools.iter().any(|p| p.name == name) {
            change(http::Method::DELETE, "pool", &name, None);
        }
    }
    for name in running("apps") {
        if !config.apps.iter().any(|a| a.name == name) {
            change(http::Method::DELETE, "app", &name, None);
        }
    }
    for pool in &config.pools {
        change(
            http::Method::PUT,
            "pool",
            &pool.name,
            serde_json::to_value(pool).ok(),
        );
    }
    for app in &config.apps {
        change(
            http::Method::PUT,
            "app",
            &app.name,
            serde_json::to_value(app).ok(),
        );
    }
    if output == Output::Json {
        println!("{:#}", serde_json::json!({ "changes": changes }));
    }
    if refused { 1 } else { 0 }
}

/// `warmgate revisions`: the history as a table, then the recent notes.
fn revisions(gateway: &str, app: &str, output: Output) -> i32 {
    match api(
        gateway,
        http::Method::GET,
        &format!("/v1/apps/{app}/revisions"),
        None,
        Duration::from_secs(10),
    ) {
        Ok(v) => {
            match output {
                Output::Json => println!("{v:#}"),
                Output::Table => print!("{}", render_revisions(&v)),
            }
            0
        }
        Err(code) => code,
    }
}

/// Unix seconds as an RFC 3339 time, to the second.
fn rfc3339(t: f64) -> String {
    humantime::format_rfc3339_seconds(std::time::UNIX_EPOCH + Duration::from_secs_f64(t.max(0.0)))
        .to_string()
}

/// The `revisions` table.
pub fn render_revisions(v: &Value) -> String {
    use std::fmt::Write as _;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<16} {:<9} {:>7} {:<20} {:<22} CHECKPOINT",
        "REVISION", "STATE", "TRAFFIC", "CREATED", "VERSION"
    );
    for r in v["revisions"].as_array().cloned().unwrap_or_default() {
        let created = r["created_unix"].as_f64().map(rfc3339).unwrap_or_default();
        let _ = writeln!(
            out,
            "{:<16} {:<9} {:>6}% {:<20} {:<22} {}",
            r["id"].as_str().unwrap_or("?"),
            r["state"].as_str().unwrap_or("?"),
            r["traffic"],
            created,
            r["checkpoint_version"].as_str().unwrap_or("-"),
            r["checkpoint"].as_str().unwrap_or("-"),
        );
        if let Some(reason) = r["reason"].as_str() {
            let _ = writeln!(out, "  ! {reason}");
        }
    }
    let notes = v["notes"].as_array().cloned().unwrap_or_default();
    if !notes.is_empty() {
        out.push_str("\nhistory:\n");
        for n in notes.iter().rev().take(10).rev() {
            let at = n["at_unix"].as_f64().map(rfc3339).unwrap_or_default();
            let _ = writeln!(out, "  {at}  {}", n["what"].as_str().unwrap_or(""));
        }
    }
    out
}

/// The `! ...` lines under an app or pool that keeps failing: its state
/// (`CrashLoopBackOff` past the bound) and its last error, output included.
fn health_line(out: &mut String, health: &Value) {
    use std::fmt::Write as _;
    let failing = health["failing_to_start"].as_bool() == Some(true);
    let looping = health["crash_loop"].as_bool() == Some(true);
    let Some(err) = health["last_error"].as_str().filter(|_| failing || looping) else {
        return;
    };
    if looping {
        let retry = health["retry_in"]
            .as_f64()
            .map_or(String::new(), |s| format!(", next try in {}s", s.ceil()));
        let _ = writeln!(
            out,
            "  ! CrashLoopBackOff: {} failures in a row{retry}",
            health["failures"]
        );
    }
    let mut lines = err.lines();
    if let Some(first) = lines.next() {
        let _ = writeln!(out, "  ! {first}");
    }
    for l in lines {
        let _ = writeln!(out, "  ! {l}");
    }
}

/// The `status` table: one line per app, then its replicas.
pub fn render_status(v: &Value) -> String {
    use std::fmt::Write as _;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<20} {:<22} {:>9} {:>11} {:>7} {:>10}",
        "APP", "REVISION", "READY/DES", "INFLIGHT", "QUEUED", "COLD START"
    );
    let apps = v["apps"].as_array().cloned().unwrap_or_default();
    for app in &apps {
        let pool = &app["pool"];
        let cold = pool["last_cold_start"]["ready_seconds"]
            .as_f64()
            .map(|s| format!("{s:.2}s"))
            .unwrap_or_else(|| "-".into());
        let _ = writeln!(
            out,
            "{:<20} {:<22} {:>9} {:>11} {:>7} {:>10}",
            app["name"].as_str().unwrap_or("?"),
            app["revision"].as_str().unwrap_or("?"),
            format!("{}/{}", app["ready"], app["desired"]),
            format!("{}/{}", app["inflight"], app["capacity"]),
            app["queued"],
            cold,
        );
        health_line(&mut out, &pool["health"]);
        replica_lines(&mut out, pool);
    }
    let pools = v["pools"].as_array().cloned().unwrap_or_default();
    if !pools.is_empty() {
        let _ = writeln!(
            out,
            "\n{:<20} {:>9} {:>11} {:>9} {:>9}",
            "POOL", "READY/DES", "INFLIGHT", "PENDING", "WEIGHTS"
        );
        for p in &pools {
            let weights = match p["syncing_to"].as_u64() {
                Some(to) => format!("v{}>v{to}", p["weights_version"]),
                None => format!("v{}", p["weights_version"]),
            };
            let _ = writeln!(
                out,
                "{:<20} {:>9} {:>11} {:>9} {:>9}",
                p["name"].as_str().unwrap_or("?"),
                format!("{}/{}", p["ready"], p["pool"]["desired"]),
                format!(
                    "{}/{}",
                    p["inflight"],
                    p["ready"].as_u64().unwrap_or(0) * p["concurrency"].as_u64().unwrap_or(0)
                ),
                p["pending"],
                weights,
            );
            health_line(&mut out, &p["pool"]["health"]);
            replica_lines(&mut out, &p["pool"]);
        }
    }
    if apps.is_empty() && pools.is_empty() {
        out.push_str("(no apps or pools configured)\n");
    }
    let changed: Vec<&str> = v["api_changes"]
        .as_array()
        .map(|a| a.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    if !changed.is_empty() {
        let _ = writeln!(
            out,
            "\nchanged through the API, kept over the config file: {} \
             (`warmgate apply FILE`, SIGHUP or `serve --config-wins` makes the file win)",
            changed.join(", ")
        );
    }
    out
}

/// One line per replica of a pool-manager target: id, state, slots in
/// use, idle time, weights version, GPUs, pid and any pending reason.
fn replica_lines(out: &mut String, target: &Value) {
    use std::fmt::Write as _;
    for r in target["replicas"].as_array().cloned().unwrap_or_default() {
        let state = r["state"].as_str().unwrap_or("?");
        let detail = r["reason"].as_str().unwrap_or("");
        let idle = r["idle_seconds"]
            .as_f64()
            .map(|s| format!("idle {}", human_secs(s)))
            .unwrap_or_default();
        let weights = r["weights_version"]
            .as_u64()
            .map(|v| format!("v{v}"))
            .unwrap_or_default();
        let gpus = r["gpus"]
            .as_array()
            .filter(|g| !g.is_empty())
            .map(|g| {
                format!(
                    "gpu {}",
                    g.iter()
                        .map(|x| x.to_string())
                        .collect::<Vec<_>>()
                        .join(",")
                )
            })
            .unwrap_or_default();
        let _ = writeln!(
            out,
            "  {:<18} {:<9} {:>5} {:<10} {:<5} {:<10} {} {}",
            r["id"].as_str().unwrap_or("?"),
            state,
            format!("{}/{}", r["inflight"], r["concurrency"]),
            idle,
            weights,
            gpus,
            r["pid"]
                .as_u64()
                .map(|p| format!("pid {p}"))
                .unwrap_or_default(),
            detail,
        );
    }
}

fn human_secs(s: f64) -> String {
    if s < 60.0 {
        format!("{s:.0}s")
    } else if s < 3600.0 {
        format!("{:.0}m", s / 60.0)
    } else {
        format!("{:.1}h", s / 3600.0)
    }
}

#[cfg(test)]
mod tests {

    #[test]
    fn each_class_of_failure_has_its_exit_code() {
        let answered = |status| CallError::Answered {
            url: "u".into(),
            status,
            message: "m".into(),
        };
        let codes: Vec<i32> = [400, 401, 403, 404, 405, 409, 413, 429, 500, 502, 503, 504]
            .into_iter()
            .map(|s| answered(s).exit_code())
            .collect();
        assert_eq!(codes, [65, 77, 77, 66, 65, 75, 65, 75, 70, 70, 75, 75]);
        assert_eq!(CallError::Unreachable("x".into()).exit_code(), 69);
        assert_eq!(CallError::Protocol("x".into()).exit_code(), 76);
    }

    use super::*;

    #[test]
    fn the_gateway_is_not_dumpable() {
        keep_environment_private();
        assert!(
            !nix::sys::prctl::get_dumpable().expect("prctl"),
            "a worker of the same user could read /proc/<gateway>/environ"
        );
    }
}
