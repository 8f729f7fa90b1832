//! The clap definitions of the command line (`Cli`, its subcommands and
//! `Output`) and the parsers of their values.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Parser, Subcommand};

use crate::telemetry::LogFormat;

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
        /// bursts-long, daily, spikes, busy-idle; or a family with parameters
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
    /// Cancel a task (a queued one never runs; a running one's call to its
    /// worker is dropped), or with `--batch` what is left of a batch.
    /// With tenant keys, `WARMGATE_API_KEY` names whose.
    Cancel {
        /// The task's id (or the batch's, from `X-Warmgate-Batch-Id`).
        id: String,
        /// ID is a batch's.
        #[arg(long)]
        batch: bool,
        /// The gateway to ask.
        #[arg(long, env = "WARMGATE_GATEWAY", default_value = DEFAULT_GATEWAY)]
        gateway: String,
    },
    /// Show the tokens used, as the engines counted them, by tenant, app,
    /// model and time (`GET /v1/usage`). With the admin token every
    /// tenant's; with a tenant's key (`WARMGATE_API_KEY`) its own.
    Usage {
        /// From: a duration ago (`24h`, `7d`) or an RFC 3339 time.
        #[arg(long, default_value = "24h")]
        since: String,
        /// To (exclusive): a duration ago or an RFC 3339 time; default now.
        #[arg(long)]
        until: Option<String>,
        /// Rows by `hour`, `day`, or one `total`.
        #[arg(long, default_value = "total")]
        bucket: String,
        /// Rows by these, comma-separated: `tenant`, `app`, `model`.
        #[arg(long, default_value = "tenant,app,model")]
        by: String,
        /// Only this tenant's (`-`: requests without one).
        #[arg(long)]
        tenant: Option<String>,
        /// Only this app's.
        #[arg(long)]
        app: Option<String>,
        /// Only this model's (an app or an adapter).
        #[arg(long)]
        model: Option<String>,
        /// The gateway to ask.
        #[arg(long, env = "WARMGATE_GATEWAY", default_value = DEFAULT_GATEWAY)]
        gateway: String,
        /// `table` for people, `json` for scripts.
        #[arg(long, short, value_enum, default_value_t = Output::Table)]
        output: Output,
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
