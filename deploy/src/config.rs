//! The TOML config: typed structs, defaults and validation.

use std::collections::{BTreeMap, HashSet};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::{Error, Result, ScaleToZeroAfter};

/// Default values, each with the reason for it.
pub mod defaults {
    use std::time::Duration;

    /// Loopback only: a gateway that can start processes must not be reachable
    /// from the network unless the operator says so.
    pub const LISTEN: &str = "127.0.0.1:8080";
    /// A dot-folder beside the config, like `.git`: easy to find, easy to ignore.
    pub const STATE_DIR: &str = ".warmgate";
    /// Kubernetes' default `terminationGracePeriodSeconds`: long enough for a
    /// model server to finish a streamed completion.
    pub const STOP_GRACE: Duration = Duration::from_secs(30);
    /// Large enough for a batch of embeddings inputs or a long chat history,
    /// small enough that a client cannot make the gateway buffer gigabytes.
    pub const MAX_BODY_BYTES: u64 = 16 * 1024 * 1024;
    /// A task body is held in the gateway until a replica takes it (unlike
    /// an inference body, which goes straight on), so its bound is tighter:
    /// 8 MiB is thousands of rollout inputs in one batch; larger batches
    /// can be split.
    pub const MAX_TASK_BODY_BYTES: u64 = 8 * 1024 * 1024;
    /// Inputs of the tasks accepted and not ended, over every pool: 100,000
    /// queued rollouts of a few KiB each, while a burst of large inputs
    /// cannot push the gateway past a few hundred MB.
    pub const MAX_PENDING_TASK_BYTES: u64 = 256 * 1024 * 1024;
    /// Inference bodies read into memory and not yet handed to a replica
    /// (held in an app's queue, or starting to be sent), over every app:
    /// the hold queue bounds their count, this their bytes, so a thousand
    /// held 16 MiB bodies cannot take 16 GiB.
    pub const MAX_BUFFERED_BODY_BYTES: u64 = 512 * 1024 * 1024;
    /// Outputs of finished async tasks kept in memory for `GET /v1/tasks`;
    /// the oldest go first (the journal still has them, up to 1 MiB each).
    /// 64 MiB holds thousands of typical results and keeps the gateway small.
    pub const MAX_TASK_RESULTS_BYTES: u64 = 64 * 1024 * 1024;
    /// Disk kept by the async-task journal; the oldest rows go first. 1 GiB
    /// holds 100,000 results of 10 KiB without filling a small state disk.
    pub const MAX_JOURNAL_BYTES: u64 = 1024 * 1024 * 1024;
    /// A GPU model server batches well up to a handful of concurrent requests;
    /// 8 keeps latency predictable without leaving the GPU idle.
    pub const CONCURRENCY: u32 = 8;
    /// Loading multi-GB weights onto a GPU can take minutes.
    pub const STARTUP_TIMEOUT: Duration = Duration::from_secs(300);
    /// The worker contract's health path.
    pub const HEALTH_PATH: &str = "/healthz";
    /// Kubernetes' default liveness period is 10 s; 2 s finds a hung
    /// worker within seconds, and one probe costs the worker microseconds.
    pub const HEALTH_PERIOD: Duration = Duration::from_secs(2);
    /// A healthy worker answers its health path in milliseconds.
    pub const HEALTH_TIMEOUT: Duration = Duration::from_secs(2);
    /// Kubernetes' default: three failures in a row, so one slow answer
    /// does not replace a replica.
    pub const HEALTH_FAILURES: u32 = 3;
    /// Scale to zero by default: idle GPUs are the bill.
    pub const MIN: u32 = 0;
    /// A small cap, so a traffic spike cannot take every GPU on the box.
    pub const MAX: u32 = 4;
    /// Knative's `container-concurrency-target-percentage`: aim at 70% of the
    /// hard limit so bursts find a free slot.
    pub const TARGET_UTILIZATION: f64 = 0.7;
    /// Knative's `scale-to-zero-grace-period` plus its stable window: a minute
    /// without traffic before the last replica goes, under `"auto"` until
    /// the app's cold start and idle spells are known.
    pub const SCALE_TO_ZERO_AFTER: Duration = Duration::from_secs(60);
    /// Knative's stable window.
    pub const STABLE_WINDOW: Duration = Duration::from_secs(60);
    /// Knative's panic window (10% of the stable window).
    pub const PANIC_WINDOW: Duration = Duration::from_secs(6);
    /// 16 ranged GETs of 8 MiB: past the per-connection cap of S3-like
    /// stores (about 100 MB/s each) without a flood of small requests.
    pub const WEIGHTS_CONCURRENCY: usize = 16;
    /// See [`WEIGHTS_CONCURRENCY`].
    pub const WEIGHTS_PART_SIZE: u64 = 8 * 1024 * 1024;
    /// Four times the default in-flight bytes.
    pub const WEIGHTS_MEMORY_LIMIT: u64 = 512 * 1024 * 1024;
    /// Room for a handful of 7B-parameter checkpoints in bf16.
    pub const WEIGHTS_CACHE_MAX: u64 = 100 * 1024 * 1024 * 1024;
    /// A warm pool keeps one replica warm: the point is that rollouts never
    /// wait for a cold start.
    pub const POOL_MIN: u32 = 1;
    /// As for apps.
    pub const POOL_MAX: u32 = 4;
    /// Rollout workers step an environment and run a policy: a few tasks
    /// at once keep them busy.
    pub const POOL_CONCURRENCY: u32 = 4;
    /// Union's ReusePolicy default idle TTL: five minutes between bursts of
    /// an RL loop keeps the pool warm across a training step.
    pub const IDLE_TTL: Duration = Duration::from_secs(300);
    /// Two retries: enough for a flaky environment, few enough that a bug
    /// fails quickly.
    pub const TASK_RETRIES: u32 = 2;
    /// Rollouts are seconds to minutes long.
    pub const TASK_TIMEOUT: Duration = Duration::from_secs(300);
    /// Long enough to stream a large checkpoint over a slow link; short
    /// enough that a stuck replica is replaced within a training step.
    pub const WEIGHT_SYNC_TIMEOUT: Duration = Duration::from_secs(600);
    /// Share of a pool's slots its app's requests are sure of.
    pub const INFERENCE_SHARE: f64 = 0.5;
    /// Large enough for a whole batch of rollouts.
    pub const POOL_MAX_PENDING: u32 = 100_000;
    /// A canary bakes for a minute: long enough to see errors at modest
    /// traffic, short enough to keep promotions quick.
    pub const BAKE: Duration = Duration::from_secs(60);
    /// 5% failed answers on the canary sends traffic back.
    pub const MAX_ERROR_RATE: f64 = 0.05;
    /// The marker PyTorch Lightning-style checkpointers and our examples
    /// write last.
    pub const MARKER: &str = "_COMPLETE";
    /// Listing a prefix every 10 s costs nothing and catches an epoch's
    /// checkpoint long before anyone looks.
    pub const WATCH_INTERVAL: Duration = Duration::from_secs(10);
    /// An evaluation of a few minutes fits; longer ones belong in training.
    pub const GATE_TIMEOUT: Duration = Duration::from_secs(600);
    /// Twenty answers before judging: one early error is not 100%.
    pub const MIN_REQUESTS: u64 = 20;
    /// Knative's `max-scale-up-rate`: in practice unbounded, because too few
    /// replicas cost latency at once.
    pub const MAX_SCALE_UP_RATE: f64 = 1000.0;
    /// Knative's `max-scale-down-rate`: at most half the replicas go per
    /// tick, so one dip in a noisy signal cannot empty the app.
    pub const MAX_SCALE_DOWN_RATE: f64 = 2.0;
    /// Knative's panic threshold: 200% of current capacity.
    pub const PANIC_THRESHOLD: f64 = 2.0;
    /// Enough to absorb a burst while an app wakes from zero.
    pub const MAX_PENDING: u32 = 1000;
    /// Long enough to cover a cold start that loads weights.
    pub const QUEUE_TIMEOUT: Duration = Duration::from_secs(120);
    /// Far above what one gateway serves at once, far below the file
    /// descriptors a default `ulimit -n` of 65536 allows.
    pub const MAX_CONNECTIONS: u32 = 10_000;
    /// nginx's `client_header_timeout` is 60 s; half of it is ample for any
    /// real client and frees a slowloris socket sooner.
    pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(30);
    /// nginx's `send_timeout` and `client_body_timeout`: a minute without a
    /// byte moving on a request body or a response.
    pub const IDLE_TIMEOUT: Duration = Duration::from_secs(60);
    /// A queue wait of `apps.queue.timeout` (120 s) plus a slow first token;
    /// a streamed answer may then run on, bounded by `idle_timeout`.
    pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(300);
}

/// The whole config file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    /// Address the gateway listens on.
    pub listen: SocketAddr,
    /// SQLite state, weight cache and replica logs. Relative paths are
    /// resolved against the config file's folder.
    pub state_dir: PathBuf,
    /// Where replicas run.
    pub backend: BackendConfig,
    /// Request limits of the data plane.
    pub limits: LimitsConfig,
    /// How checkpoints are read and cached.
    pub weights: WeightsConfig,
    /// Serving apps.
    pub apps: Vec<AppSpec>,
    /// Warm pools for tasks (RL rollouts).
    pub pools: Vec<PoolSpec>,
    /// Data-plane API keys, one tenant each; none: the data plane is open.
    pub tenants: Vec<TenantSpec>,
    /// What `warmgate operator` accepts from `ServingApp` and `WarmPool`
    /// resources (ignored by `serve`, whose file is trusted as a whole).
    pub operator: OperatorConfig,
    /// HTTPS on `listen`: a certificate chain and its key, reloaded on
    /// SIGHUP. Unset: plain HTTP.
    pub tls: Option<TlsConfig>,
    /// Who may reach what: the `Host` names served, and whether
    /// `/metrics` and `/openapi.json` need the admin token.
    pub access: AccessConfig,
}

/// The listener's certificate. Relative paths are resolved against the
/// config file's folder.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct TlsConfig {
    /// PEM file with the certificate chain, the gateway's own first.
    pub cert: PathBuf,
    /// PEM file with its private key (PKCS#8, PKCS#1 or SEC1).
    pub key: PathBuf,
    /// Where the gateway also serves plain HTTP for its own workers (their
    /// weights URL), which hold no CA to trust. Default with the local
    /// backend: a free port on 127.0.0.1. Needed with the Kubernetes
    /// backend, whose `advertise` must then name this port.
    pub worker_listen: Option<SocketAddr>,
}

/// Who may reach what on the listener.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct AccessConfig {
    /// The names (or IP literals) clients may address the gateway by in
    /// `Host`, matched without the port and case-insensitively; a request
    /// naming any other host is refused (`421`). A defence against DNS
    /// rebinding. Empty (the default): any `Host`.
    pub allowed_hosts: Vec<String>,
    /// Serve `/metrics` and `/openapi.json` without the admin token (for a
    /// scraper that holds none). Off by default: they need it.
    pub public_metrics: bool,
}

/// What the operator accepts from cluster resources. Anyone who may edit a
/// `ServingApp` is not thereby trusted to run code in the operator's pod or
/// to make it send requests inside the cluster, so the spec fields that do
/// either are refused unless the operator's own config allows them.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct OperatorConfig {
    /// Accept `promotion.gate_command` from resources: it runs in the
    /// operator's container, beside its credentials. Off by default.
    pub allow_gate_command: bool,
    /// Accept `promotion.gate_url` from resources: the operator POSTs to
    /// it from inside the cluster. Off by default.
    pub allow_gate_url: bool,
}

/// A tenant of the data plane: who holds an API key, and its quotas.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct TenantSpec {
    /// The tenant's name (a DNS label), used for fairness, status and
    /// metrics in place of `X-Warmgate-Tenant`.
    pub name: String,
    /// SHA-256 of the API key, as 64 hex digits (`printf %s KEY | sha256sum`),
    /// so the config holds no secret.
    pub api_key_sha256: Option<String>,
    /// Or the environment variable that holds the key.
    pub api_key_env: Option<String>,
    /// Requests and task submissions in flight at once (429 past it).
    pub max_inflight: Option<u32>,
    /// Tasks accepted and not finished, over every pool (429 past it).
    pub max_pending: Option<u32>,
    /// Requests per second, sustained (429 with `Retry-After` past it).
    pub rps: Option<f64>,
    /// Requests allowed in a burst above `rps`; default: one second's worth.
    pub burst: Option<u32>,
    /// The highest task `priority` this tenant may ask for; a higher one is
    /// lowered to it. Default `0`, the default priority (see
    /// [`TenantSpec::max_priority()`]).
    pub max_priority: Option<i32>,
}

/// A tenant's default `max_priority`: the default priority itself, so no
/// tenant can jump ahead of the others unless the operator allows it (a
/// tenant may still lower its own tasks' priority).
const DEFAULT_TENANT_MAX_PRIORITY: i32 = 0;
/// The slowest tenant rate limit: one request in 1,000 s.
const MIN_TENANT_RPS: f64 = 0.001;
/// The fastest: 10^9 requests a second, a one-nanosecond period.
const MAX_TENANT_RPS: f64 = 1e9;

impl TenantSpec {
    /// The highest task priority the tenant may ask for.
    pub fn max_priority(&self) -> i32 {
        self.max_priority.unwrap_or(DEFAULT_TENANT_MAX_PRIORITY)
    }
}

/// Which backend runs replicas, and its resources.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct BackendConfig {
    /// `local` (child processes) or `kubernetes`.
    pub kind: BackendKind,
    /// Local GPU ids handed out through `CUDA_VISIBLE_DEVICES`.
    pub gpus: Vec<u32>,
    /// Time between SIGTERM and SIGKILL when a replica is stopped.
    #[serde(with = "bounded")]
    #[schemars(with = "String")]
    pub stop_grace: Duration,
    /// Settings of the kubernetes backend.
    pub kubernetes: KubeBackendConfig,
    /// Variables of the gateway's own environment that local workers
    /// inherit, by exact name, on top of the few every process needs
    /// (`PATH`, `HOME`, the locale, ...). Nothing else is passed on, so
    /// the admin token, tenant keys and cloud credentials stay with the
    /// gateway unless listed here.
    pub pass_env: Vec<String>,
}

/// Settings of the kubernetes backend.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct KubeBackendConfig {
    /// Namespace of the replica pods (default: the operator's own, from
    /// the service account, else `default`).
    pub namespace: Option<String>,
    /// Node labels that select spot (interruptible) capacity. Karpenter's
    /// label by default; GKE uses `cloud.google.com/gke-spot = "true"`.
    pub spot_node_selector: BTreeMap<String, String>,
    /// Tolerations that let a pod onto spot nodes (GKE taints them with
    /// `cloud.google.com/gke-spot`).
    pub spot_tolerations: Vec<Toleration>,
    /// `imagePullPolicy` of the replica pods (default: Kubernetes' own).
    pub image_pull_policy: Option<String>,
    /// `host:port` where pods reach the gateway (its Service), for the
    /// workers' `WARMGATE_WEIGHTS_URL`. The Helm chart sets it.
    pub advertise: Option<String>,
    /// Service accounts an app or pool may name in
    /// `kubernetes.service_account`; none by default, so a resource cannot
    /// run its pods as an account with more rights (the operator's own).
    pub allowed_service_accounts: Vec<String>,
    /// Secrets an app or pool may read into its pods (`secret_env`,
    /// `env_from_secrets`, `image_pull_secrets`); none by default, so a
    /// resource cannot read every secret of the namespace through the
    /// operator's right to create pods.
    pub allowed_secrets: Vec<String>,
    /// Persistent volume claims an app or pool may mount
    /// (`kubernetes.volumes.*.claim`); none by default, so a resource
    /// cannot mount another team's data.
    pub allowed_claims: Vec<String>,
    /// Config maps an app or pool may mount
    /// (`kubernetes.volumes.*.config_map`); none by default.
    pub allowed_config_maps: Vec<String>,
    /// Replica pods must run as a non-root user (`runAsNonRoot`). Off by
    /// default: common model-server images (vLLM, TGI, Triton) run as
    /// root, and the kubelet refuses to start them with it set.
    pub run_as_non_root: bool,
}

/// Where and how one replica pod runs (kubernetes backend).
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct PodSpec {
    /// GPU model, as the NVIDIA GPU feature discovery labels nodes
    /// (`nvidia.com/gpu.product`, e.g. `NVIDIA-A100-SXM4-80GB`).
    pub gpu_type: Option<String>,
    /// CPU request and limit (`"4"`, `"500m"`).
    pub cpu: Option<String>,
    /// Memory request and limit (`"16Gi"`).
    pub memory: Option<String>,
    /// More node labels the pod must match.
    pub node_selector: BTreeMap<String, String>,
    /// Taints the pod tolerates.
    pub tolerations: Vec<Toleration>,
    /// Run on spot capacity (`backend.kubernetes.spot_node_selector`).
    pub interruptible: bool,
    /// The port the worker listens on inside the pod (`PORT`); 8080 when 0.
    pub port: u16,
    /// The pod's service account (for object-store credentials through
    /// workload identity).
    pub service_account: Option<String>,
    /// Environment variables read from secrets (`valueFrom.secretKeyRef`):
    /// `HF_TOKEN = { secret = "hf", key = "token" }`.
    pub secret_env: BTreeMap<String, SecretKey>,
    /// Secrets whose every key becomes a variable (`envFrom`).
    pub env_from_secrets: Vec<String>,
    /// Secrets to pull the image with (`imagePullSecrets`).
    pub image_pull_secrets: Vec<String>,
    /// Size of the memory-backed `/dev/shm` (NCCL and PyTorch's data
    /// loaders need more than the runtime's 64 MiB). Unset: a GPU worker
    /// gets one with no size limit beyond its memory, others none; `"0"`
    /// turns it off.
    pub shm_size: Option<String>,
    /// Volumes mounted into the worker, by name: a persistent volume
    /// claim (`claim`, one of `backend.kubernetes.allowed_claims`: a
    /// shared model cache, say), a config map (`config_map`, one of
    /// `allowed_config_maps`) or a scratch `empty_dir` with a size limit.
    /// No host path: a resource author must not reach the node.
    pub volumes: BTreeMap<String, VolumeSpec>,
    /// Node labels the pod must run on, as required node-affinity terms
    /// (all of them hold): `[{ key = "topology.kubernetes.io/zone",
    /// operator = "In", values = ["us-east-1a"] }]`.
    pub node_affinity: Vec<NodeRequirement>,
}

/// A volume of a replica pod: exactly one of `claim`, `config_map` or
/// `empty_dir`.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct VolumeSpec {
    /// Where it is mounted in the worker (an absolute path).
    pub mount: String,
    /// A persistent volume claim's name.
    pub claim: Option<String>,
    /// A config map's name.
    pub config_map: Option<String>,
    /// A scratch volume's size limit (`"20Gi"`).
    pub empty_dir: Option<String>,
    /// Mounted read-only.
    pub read_only: bool,
}

/// One node-affinity requirement.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct NodeRequirement {
    /// The node label.
    pub key: String,
    /// `In`, `NotIn`, `Exists`, `DoesNotExist`, `Gt` or `Lt`.
    pub operator: String,
    /// The values (none for `Exists` and `DoesNotExist`).
    pub values: Vec<String>,
}

/// One key of a secret.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SecretKey {
    /// The secret's name (in `backend.kubernetes.allowed_secrets`).
    pub secret: String,
    /// The key in it.
    pub key: String,
}

/// A Kubernetes toleration.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct Toleration {
    /// Taint key (empty with `Exists`: every taint).
    pub key: Option<String>,
    /// `Equal` (default) or `Exists`.
    pub operator: Option<String>,
    /// Taint value, for `Equal`.
    pub value: Option<String>,
    /// `NoSchedule`, `PreferNoSchedule` or `NoExecute` (empty: all).
    pub effect: Option<String>,
}

/// A pod's volumes and node affinity, as `validate` checks them: one
/// source each, from the allow-lists, at an absolute path of its own.
fn check_volumes(at: &str, pod: &PodSpec, k: &KubeBackendConfig) -> Result<(), (String, String)> {
    let mut mounts = std::collections::HashSet::new();
    for (name, v) in &pod.volumes {
        let key = format!("{at}.kubernetes.volumes.{name}");
        if check_dns_label(name).is_err() || name == "dshm" {
            return Err((
                key,
                "a volume's name must be a DNS label other than `dshm` (the /dev/shm volume)"
                    .into(),
            ));
        }
        let sources = [
            v.claim.is_some(),
            v.config_map.is_some(),
            v.empty_dir.is_some(),
        ];
        if sources.iter().filter(|s| **s).count() != 1 {
            return Err((
                key,
                "needs exactly one of `claim`, `config_map` or `empty_dir`".into(),
            ));
        }
        if !v.mount.starts_with('/') || v.mount == "/" || v.mount.split('/').any(|c| c == "..") {
            return Err((
                format!("{key}.mount"),
                format!(
                    "{:?} must be an absolute path below /, without `..`",
                    v.mount
                ),
            ));
        }
        if v.mount.trim_end_matches('/') == "/dev/shm"
            || !mounts.insert(v.mount.trim_end_matches('/').to_string())
        {
            return Err((
                format!("{key}.mount"),
                format!("{:?} is mounted twice", v.mount),
            ));
        }
        if let Some(c) = &v.claim
            && !k.allowed_claims.contains(c)
        {
            return Err((
                format!("{key}.claim"),
                format!("{c:?} is not in backend.kubernetes.allowed_claims"),
            ));
        }
        if let Some(c) = &v.config_map
            && !k.allowed_config_maps.contains(c)
        {
            return Err((
                format!("{key}.config_map"),
                format!("{c:?} is not in backend.kubernetes.allowed_config_maps"),
            ));
        }
    }
    for (i, n) in pod.node_affinity.iter().enumerate() {
        let key = format!("{at}.kubernetes.node_affinity[{i}]");
        let needs_values = match n.operator.as_str() {
            "In" | "NotIn" | "Gt" | "Lt" => true,
            "Exists" | "DoesNotExist" => false,
            other => {
                return Err((
                    format!("{key}.operator"),
                    format!("{other:?} is not In, NotIn, Exists, DoesNotExist, Gt or Lt"),
                ));
            }
        };
        if n.key.is_empty() || needs_values == n.values.is_empty() {
            return Err((
                key,
                format!(
                    "needs a key and {} values for {}",
                    if needs_values { "some" } else { "no" },
                    n.operator
                ),
            ));
        }
    }
    Ok(())
}

/// The kind of backend.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, schemars::JsonSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum BackendKind {
    /// Child processes on this machine.
    #[default]
    Local,
    /// Pods on a Kubernetes cluster.
    Kubernetes,
}

/// Limits applied to every data-plane request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct LimitsConfig {
    /// Largest request body accepted, in bytes (413 past it).
    #[serde(with = "size")]
    #[schemars(with = "size::Size")]
    pub max_body_bytes: u64,
    /// Largest body of a task submission or a batch, in bytes (413 past it).
    #[serde(with = "size")]
    #[schemars(with = "size::Size")]
    pub max_task_body_bytes: u64,
    /// Input bytes of all tasks accepted and not ended, over every pool
    /// (`429 queue_full` past it).
    #[serde(with = "size")]
    #[schemars(with = "size::Size")]
    pub max_pending_task_bytes: u64,
    /// Bytes of inference bodies read into memory and not yet sent to a
    /// replica, over every app (`429 queue_full` past it).
    #[serde(with = "size")]
    #[schemars(with = "size::Size")]
    pub max_buffered_body_bytes: u64,
    /// Bytes of finished async task results kept in memory; the oldest are
    /// dropped first and then read back from the journal.
    #[serde(with = "size")]
    #[schemars(with = "size::Size")]
    pub max_task_results_bytes: u64,
    /// Bytes of the async-task journal on disk; the oldest rows are pruned.
    #[serde(with = "size")]
    #[schemars(with = "size::Size")]
    pub max_journal_bytes: u64,
    /// Client connections open at once; past it a new connection gets
    /// `503 no_capacity` and is closed.
    pub max_connections: u32,
    /// Time a client has to send a request's headers, counted from the
    /// connection opening or the previous response ending (so it also
    /// closes idle keep-alive connections).
    #[serde(with = "bounded")]
    #[schemars(with = "String")]
    pub header_read_timeout: Duration,
    /// A request body or a response that moves no byte for this long ends
    /// the connection.
    #[serde(with = "bounded")]
    #[schemars(with = "String")]
    pub idle_timeout: Duration,
    /// Deadline of an inference request, from arrival to the response's
    /// headers (504 past it). Tasks keep their own `timeout`.
    #[serde(with = "bounded")]
    #[schemars(with = "String")]
    pub request_timeout: Duration,
}

/// How checkpoints are streamed from object storage and cached.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct WeightsConfig {
    /// Ranged GETs in flight per object.
    pub concurrency: usize,
    /// Bytes per ranged GET.
    #[serde(with = "size")]
    #[schemars(with = "size::Size")]
    pub part_size_bytes: u64,
    /// Bytes of parts held in memory per object.
    #[serde(with = "size")]
    #[schemars(with = "size::Size")]
    pub memory_limit_bytes: u64,
    /// Size of the node-local cache under `state_dir/cache`; least recently
    /// used entries are evicted past it.
    #[serde(with = "size")]
    #[schemars(with = "size::Size")]
    pub cache_max_bytes: u64,
    /// Checkpoint URI prefixes the gateway may open (weight sync, promote,
    /// the checkpoint watcher, the operator's resources); anything else is
    /// refused before it is opened. Matched on path segments after `.` and
    /// `..` are resolved; `http(s)` stores only when listed. When set, the
    /// config's own checkpoints must be under it too. Unset (the default):
    /// the checkpoints named in this file (each app's and pool's
    /// `checkpoint`) and the apps' `promotion.watch` prefixes.
    pub allowed_prefixes: Option<Vec<String>>,
}

/// One serving app.
// kube's `printcolumn(...)` repeats `type_ = ...`, which clippy takes for a
// duplicated attribute.
#[allow(clippy::duplicated_attributes)]
#[derive(
    Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema, kube::CustomResource,
)]
#[kube(
    group = "warmgate.dev",
    version = "v1alpha1",
    kind = "ServingApp",
    namespaced,
    status = "crate::crd::ServingAppStatus",
    shortname = "wgapp",
    category = "warmgate",
    doc = "An app warmgate serves: its workers' image and settings, the checkpoint they load, how it scales (to zero) and how new checkpoints are promoted. Its OpenAI `model` name is its metadata.name.",
    printcolumn(
        name = "Ready",
        type_ = "integer",
        json_path = ".status.replicas.ready"
    ),
    printcolumn(
        name = "Desired",
        type_ = "integer",
        json_path = ".status.replicas.desired"
    ),
    printcolumn(name = "Revision", type_ = "string", json_path = ".status.revision"),
    printcolumn(
        name = "Reason",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Ready\")].reason"
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(default, deny_unknown_fields)]
pub struct AppSpec {
    /// The app's name: a DNS label, also its OpenAI `model` name.
    pub name: String,
    /// More OpenAI `model` names routed to this app.
    pub aliases: Vec<String>,
    /// The worker's command line (local backend).
    pub command: Vec<String>,
    /// The worker's container image (kubernetes backend).
    pub image: Option<String>,
    /// Extra environment variables for the worker.
    pub env: BTreeMap<String, String>,
    /// Checkpoint URI (`file://`, `s3://`, `gs://`, `az://`).
    pub checkpoint: Option<String>,
    /// Hard limit of requests in flight per replica.
    pub concurrency: u32,
    /// GPUs per replica.
    pub gpus: u32,
    /// How long a replica may take to answer `/healthz` with 200.
    #[serde(with = "bounded")]
    #[schemars(with = "String")]
    pub startup_timeout: Duration,
    /// How its readiness and liveness are probed.
    pub health: HealthSpec,
    /// Scaling policy.
    pub autoscale: AutoscaleSpec,
    /// The hold queue for requests that find no free slot.
    pub queue: QueueSpec,
    /// How new checkpoints are promoted.
    pub promotion: PromotionSpec,
    /// How requests are spread over the replicas (`[apps.routing]`).
    pub routing: crate::routing::RoutingSpec,
    /// The engine's own load signals (`[apps.engine]`).
    pub engine: crate::routing::EngineSpec,
    /// LoRA adapters served on the replicas (`[apps.adapters]`).
    pub adapters: crate::adapters::AdaptersSpec,
    /// Pod settings (kubernetes backend).
    pub kubernetes: PodSpec,
    /// Served by this warm pool's replicas instead of its own: requests go
    /// to the same processes that run the pool's tasks, under the pool's
    /// per-replica `concurrency`, on the pool's weights. Such an app has no
    /// `command`, `image`, `checkpoint` or `promotion.watch` of its own;
    /// the pool scales on both kinds of demand.
    pub pool: Option<String>,
}

/// How the gateway asks a worker whether it is ready and alive: the
/// worker contract's `GET /healthz`, adjustable for stock servers (vLLM
/// and TGI answer `/health`, Triton `/v2/health/ready`).
///
/// Readiness is probed from the start until `startup_timeout` (the startup
/// grace; a startup probe on Kubernetes); once ready, the path is probed
/// every `period`, and `failure_threshold` failures in a row (an answer
/// not in `ready_statuses`, or none within `timeout`) replace the replica.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct HealthSpec {
    /// The path probed, with its query if any.
    pub path: String,
    /// Statuses that count as ready and alive.
    pub ready_statuses: Vec<u16>,
    /// Time between liveness probes of a ready replica.
    #[serde(with = "bounded")]
    #[schemars(with = "String")]
    pub period: Duration,
    /// How long one probe may take.
    #[serde(with = "bounded")]
    #[schemars(with = "String")]
    pub timeout: Duration,
    /// Liveness failures in a row that replace a replica.
    pub failure_threshold: u32,
}

impl Default for HealthSpec {
    fn default() -> Self {
        HealthSpec {
            path: defaults::HEALTH_PATH.to_string(),
            ready_statuses: vec![200],
            period: defaults::HEALTH_PERIOD,
            timeout: defaults::HEALTH_TIMEOUT,
            failure_threshold: defaults::HEALTH_FAILURES,
        }
    }
}

impl HealthSpec {
    /// Whether `status` counts as ready.
    pub fn is_ready(&self, status: u16) -> bool {
        self.ready_statuses.contains(&status)
    }

    /// The key (under `health.`) and the reason, when it is not usable.
    pub fn check(&self) -> Result<(), (&'static str, String)> {
        let p = &self.path;
        if !p.starts_with('/')
            || p.len() > 1024
            || !p.chars().all(|c| c.is_ascii_graphic() && c != '#')
        {
            return Err((
                "path",
                format!(
                    "{p:?} must start with / and hold visible ASCII only, up to 1024 bytes, no #"
                ),
            ));
        }
        if self.ready_statuses.is_empty()
            || self.ready_statuses.iter().any(|s| !(100..=599).contains(s))
        {
            return Err((
                "ready_statuses",
                "must list HTTP statuses (100 to 599)".into(),
            ));
        }
        for (key, d) in [("period", self.period), ("timeout", self.timeout)] {
            if d.is_zero() || d > Duration::from_secs(3600) {
                return Err((key, "must be more than 0s and at most 1h".into()));
            }
        }
        if !(1..=1000).contains(&self.failure_threshold) {
            return Err(("failure_threshold", "must be from 1 to 1000".into()));
        }
        Ok(())
    }
}

/// How an app's new revisions take over.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct PromotionSpec {
    /// Percent of traffic a new revision gets first (unset: all at once).
    pub canary: Option<u8>,
    /// How long the canary runs before the rest of the traffic moves.
    #[serde(with = "bounded")]
    #[schemars(with = "String")]
    pub bake: Duration,
    /// During the canary, roll back when more than this share of the new
    /// revision's answers fail (5xx or `replica_failed`).
    pub max_error_rate: f64,
    /// Answers needed before the error rate counts.
    pub min_requests: u64,
    /// During the canary, roll back when the new revision's p99 latency
    /// (to the response head) passes this (unset: latency is not judged).
    #[serde(with = "bounded::option")]
    #[schemars(with = "Option<String>")]
    pub max_p99: Option<Duration>,
    /// An evaluation run before traffic shifts: this command gets the new
    /// revision's pinned endpoint in `WARMGATE_EVAL_URL` and
    /// `WARMGATE_EVAL_REVISION` (send `X-Warmgate-Revision`), and passes
    /// by exiting 0.
    pub gate_command: Vec<String>,
    /// The same as an HTTP hook: it gets a `POST` with the endpoint, and
    /// passes by answering 2xx.
    pub gate_url: Option<String>,
    /// How long the gate may take before it counts as failed.
    #[serde(with = "bounded")]
    #[schemars(with = "String")]
    pub gate_timeout: Duration,
    /// A prefix where training writes checkpoints, one folder each: the
    /// newest folder holding `marker` is promoted.
    pub watch: Option<String>,
    /// The file training writes last, when a checkpoint is whole.
    pub marker: String,
    /// How often `watch` is listed.
    #[serde(with = "bounded")]
    #[schemars(with = "String")]
    pub watch_interval: Duration,
    /// Promote by swapping the new weights into the serving replicas
    /// (their `POST /weights`), a few at a time, instead of starting
    /// replicas beside them: the canary is the first replicas swapped, a
    /// rollback swaps the old weights back, and the app never needs more
    /// GPUs than it holds. A worker that cannot swap makes the promotion
    /// start new replicas instead, said so in its record. `warmgate
    /// promote --in-place` asks for it once.
    pub in_place: bool,
}

impl Default for PromotionSpec {
    fn default() -> Self {
        PromotionSpec {
            canary: None,
            bake: defaults::BAKE,
            max_error_rate: defaults::MAX_ERROR_RATE,
            min_requests: defaults::MIN_REQUESTS,
            max_p99: None,
            gate_command: Vec::new(),
            gate_url: None,
            gate_timeout: defaults::GATE_TIMEOUT,
            watch: None,
            marker: defaults::MARKER.into(),
            watch_interval: defaults::WATCH_INTERVAL,
            in_place: false,
        }
    }
}

/// A warm pool of workers that run tasks (`POST /invoke`).
// kube's `printcolumn(...)` repeats `type_ = ...`, which clippy takes for a
// duplicated attribute.
#[allow(clippy::duplicated_attributes)]
#[derive(
    Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema, kube::CustomResource,
)]
#[kube(
    group = "warmgate.dev",
    version = "v1alpha1",
    kind = "WarmPool",
    namespaced,
    status = "crate::crd::WarmPoolStatus",
    shortname = "wgpool",
    category = "warmgate",
    doc = "A warm pool of workers that run tasks (rollouts) through POST /invoke, kept between min and max replicas with an idle TTL, and whose weights are synced in place.",
    printcolumn(
        name = "Ready",
        type_ = "integer",
        json_path = ".status.replicas.ready"
    ),
    printcolumn(
        name = "Desired",
        type_ = "integer",
        json_path = ".status.replicas.desired"
    ),
    printcolumn(
        name = "Weights",
        type_ = "integer",
        json_path = ".status.weightsVersion"
    ),
    printcolumn(
        name = "Reason",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Ready\")].reason"
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(default, deny_unknown_fields)]
pub struct PoolSpec {
    /// The pool's name: a DNS label.
    pub name: String,
    /// The worker's command line (local backend).
    pub command: Vec<String>,
    /// The worker's container image (kubernetes backend).
    pub image: Option<String>,
    /// Extra environment for the worker.
    pub env: BTreeMap<String, String>,
    /// Checkpoint URI.
    pub checkpoint: Option<String>,
    /// `[min, max]` replicas.
    pub replicas: [u32; 2],
    /// Tasks in flight per replica.
    pub concurrency: u32,
    /// GPUs per replica.
    pub gpus: u32,
    /// A replica idle this long is stopped (never below min).
    #[serde(with = "bounded")]
    #[schemars(with = "String")]
    pub idle_ttl: Duration,
    /// After the whole pool has been idle this long (no task waiting or
    /// running), even `min` replicas stop; the next task wakes it (Union's
    /// environment `idle_ttl`). Unset: `min` replicas run for ever.
    #[serde(with = "bounded::option")]
    #[schemars(with = "Option<String>")]
    pub suspend_after: Option<Duration>,
    /// Spare replicas kept warm beyond what the tasks need, so a burst
    /// finds capacity (Modal's `buffer_containers`).
    pub buffer: u32,
    /// How long a replica may take to answer `/healthz` with 200.
    #[serde(with = "bounded")]
    #[schemars(with = "String")]
    pub startup_timeout: Duration,
    /// How its readiness and liveness are probed.
    pub health: HealthSpec,
    /// Retries of a task that fails in user code (a task may override it).
    pub retries: u32,
    /// How long a task may take, queueing included (a task may override it).
    #[serde(with = "bounded")]
    #[schemars(with = "String")]
    pub task_timeout: Duration,
    /// The task queue.
    pub queue: PoolQueueSpec,
    /// Versions a replica may lag behind the latest weights and still take
    /// tasks (`None`: any). `0` dispatches only to replicas on the latest.
    pub max_staleness: Option<u64>,
    /// How long an in-place weight sync may take across the pool before the
    /// replicas still loading are replaced (a request may override it).
    #[serde(with = "bounded")]
    #[schemars(with = "String")]
    pub weight_sync_timeout: Duration,
    /// Pod settings (kubernetes backend).
    pub kubernetes: PodSpec,
    /// When an app is served by this pool (`[[apps]] pool = ...`) and both
    /// its requests and tasks wait: the share of each replica's slots its
    /// requests are sure of (rounded up), the rest being the tasks'. A slot
    /// the other kind does not want goes to whichever waits, so `1.0` gives
    /// requests priority and `0.0` gives tasks priority.
    pub inference_share: f64,
}

/// How a pool's tasks wait.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct PoolQueueSpec {
    /// Tasks waiting, all tenants together; past it, 429.
    pub max_pending: u32,
    /// `tenant`: round-robin across `X-Warmgate-Tenant`; `none`: FIFO.
    pub fairness: Fairness,
    /// Tasks pending plus in flight for one tenant; past it, 429 at once.
    pub tenant_quota: Option<u32>,
    /// Weighted fairness: a tenant listed here gets this many turns per
    /// round; every other tenant gets one.
    pub tenant_weights: BTreeMap<String, u32>,
}

/// Queue discipline across tenants.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, schemars::JsonSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum Fairness {
    /// Round-robin across tenants.
    #[default]
    Tenant,
    /// One FIFO for everyone.
    None,
}

/// An app's scaling policy.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct AutoscaleSpec {
    /// Fewest replicas (0 allows scale to zero).
    pub min: u32,
    /// Most replicas.
    pub max: u32,
    /// Desired in-flight requests per replica. Defaults to 70% of
    /// `concurrency`.
    pub target: Option<f64>,
    /// Time without traffic before the last replica is stopped: a
    /// duration, or `"auto"`, learned from the app's idle spells against
    /// what a cold start costs (its replica-seconds and the waiting of the
    /// requests that meet it): the cheapest over the spells seen, and no
    /// shorter than that cost unless stopping at once is cheapest; a
    /// minute until the cold start and three spells are known.
    pub scale_to_zero_after: ScaleToZeroAfter,
    /// Window over which demand is averaged for normal scaling.
    #[serde(with = "bounded")]
    #[schemars(with = "String")]
    pub stable_window: Duration,
    /// Short window that detects bursts.
    #[serde(with = "bounded")]
    #[schemars(with = "String")]
    pub panic_window: Duration,
    /// Panic when short-window demand reaches this multiple of capacity.
    pub panic_threshold: f64,
    /// The share of `concurrency` each replica is meant to carry when
    /// `target` is not set.
    pub target_utilization: f64,
    /// Per tick, grow to at most this multiple of the ready replicas.
    pub max_scale_up_rate: f64,
    /// Per tick, shrink to at least the ready replicas divided by this.
    pub max_scale_down_rate: f64,
    /// A lower count takes effect only after it has been wanted this long.
    #[serde(with = "bounded")]
    #[schemars(with = "String")]
    pub scale_down_delay: Duration,
    /// Scale for the demand one measured cold start ahead when it rises.
    pub predictive: bool,
    /// After the whole app has been idle this long, even `min` replicas
    /// stop; the next request wakes it (Union's environment `idle_ttl`).
    /// Unset: `min` replicas run for ever.
    #[serde(with = "bounded::option")]
    #[schemars(with = "Option<String>")]
    pub suspend_after: Option<Duration>,
    /// Decide with the measured cold start and the work waiting: start
    /// replicas only for work still waiting when they are ready, and keep
    /// warm capacity through gaps shorter than a few cold starts
    /// (`docs/autoscaling.md`). Off: Knative's windows alone.
    pub cold_start_aware: bool,
    /// Requests waiting in each engine's own queue to aim at
    /// (`vllm:num_requests_waiting` and its kin): more replicas start when
    /// the engines' mean queue is above it. Needs `[apps.engine]
    /// metrics_path`; unset, the engines' queues do not scale the app.
    pub target_waiting: Option<f64>,
    /// KV-cache fill (above 0, at most 1) each engine is meant to run at
    /// (`vllm:kv_cache_usage_perc`): more replicas start when the mean
    /// fill is above it. Needs `[apps.engine] metrics_path`.
    pub target_kv_cache_usage: Option<f64>,
}

/// An app's hold queue.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct QueueSpec {
    /// Requests held while no slot is free; past it, 429.
    pub max_pending: u32,
    /// How long a held request may wait; past it, 504.
    #[serde(with = "bounded")]
    #[schemars(with = "String")]
    pub timeout: Duration,
}

// === impl Config ===

impl Default for Config {
    fn default() -> Self {
        Config {
            listen: defaults::LISTEN
                .parse()
                .expect("the default address parses"),
            state_dir: PathBuf::from(defaults::STATE_DIR),
            backend: BackendConfig::default(),
            limits: LimitsConfig::default(),
            weights: WeightsConfig::default(),
            apps: Vec::new(),
            pools: Vec::new(),
            tenants: Vec::new(),
            operator: OperatorConfig::default(),
            tls: None,
            access: AccessConfig::default(),
        }
    }
}

impl AppSpec {
    /// Makes its relative paths (command, checkpoint, watch prefix, gate
    /// command) absolute against `base`.
    pub fn resolve_paths(&mut self, base: &Path) {
        resolve_command(&mut self.command, base);
        if let Some(c) = &mut self.checkpoint {
            resolve_checkpoint(c, base);
        }
        if let Some(w) = &mut self.promotion.watch {
            resolve_checkpoint(w, base);
        }
        resolve_command(&mut self.promotion.gate_command, base);
        for a in &mut self.adapters.models {
            resolve_checkpoint(&mut a.checkpoint, base);
            if let Some(w) = &mut a.watch {
                resolve_checkpoint(w, base);
            }
        }
    }
}

impl PoolSpec {
    /// Makes its relative paths (command, checkpoint) absolute against
    /// `base`.
    pub fn resolve_paths(&mut self, base: &Path) {
        resolve_command(&mut self.command, base);
        if let Some(c) = &mut self.checkpoint {
            resolve_checkpoint(c, base);
        }
    }
}

impl Config {
    /// Reads, parses and validates a config file, and resolves its relative
    /// paths against the file's folder.
    pub fn load(file: &Path) -> Result<Config> {
        let text = std::fs::read_to_string(file).map_err(|source| Error::Read {
            file: file.to_owned(),
            source,
        })?;
        let base = file
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        // Absolute, so paths stay right whatever the workers' folder is.
        let base = std::path::absolute(base).unwrap_or_else(|_| base.to_path_buf());
        Config::parse(&text, file, &base)
    }

    /// Parses and validates config text. `file` names the source in errors;
    /// relative paths are resolved against `base`.
    pub fn parse(text: &str, file: &Path, base: &Path) -> Result<Config> {
        let parse_err = |key: String, message: String| Error::Parse {
            file: file.to_owned(),
            key,
            message,
        };
        let de = toml::Deserializer::parse(text)
            .map_err(|e| parse_err("(syntax)".into(), one_line(&e.to_string())))?;
        let mut config: Config = serde_path_to_error::deserialize(de).map_err(|e| {
            let key = match e.path().to_string() {
                p if p == "." || p.is_empty() => "(top level)".to_string(),
                p => p,
            };
            parse_err(key, one_line(&e.into_inner().to_string()))
        })?;
        config.validate().map_err(|(key, message)| Error::Invalid {
            file: file.to_owned(),
            key,
            message,
        })?;
        config.resolve_paths(base);
        Ok(config)
    }

    /// Checks values that parse but make no sense. Returns the key and why.
    pub fn validate(&self) -> std::result::Result<(), (String, String)> {
        let mut seen_gpus = HashSet::new();
        for (i, gpu) in self.backend.gpus.iter().enumerate() {
            if !seen_gpus.insert(gpu) {
                return Err((
                    format!("backend.gpus[{i}]"),
                    format!("GPU {gpu} is listed twice"),
                ));
            }
        }
        if self.weights.concurrency == 0 {
            return Err(("weights.concurrency".into(), "must be at least 1".into()));
        }
        if self.tls.as_ref().is_some_and(|t| t.worker_listen.is_none())
            && self.backend.kind == BackendKind::Kubernetes
        {
            return Err((
                "tls.worker_listen".into(),
                "is needed with the Kubernetes backend: the address (e.g. \"0.0.0.0:8081\") where pods read their weights over plain HTTP, which backend.kubernetes.advertise then names".into(),
            ));
        }
        for (i, h) in self.access.allowed_hosts.iter().enumerate() {
            let ip6 = h.parse::<std::net::Ipv6Addr>().is_ok();
            let name = h
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'-');
            let ok = !h.is_empty() && h.len() <= 253 && (ip6 || name);
            if !ok {
                return Err((
                    format!("access.allowed_hosts[{i}]"),
                    format!("{h:?} is not a host name or IP address (no port, no scheme)"),
                ));
            }
        }
        for (i, p) in self.weights.allowed_prefixes.iter().flatten().enumerate() {
            let scheme_ok = p.split_once("://").is_some_and(|(scheme, rest)| {
                !scheme.is_empty()
                    && scheme
                        .bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b == b'+' || b == b'-')
                    && !rest.is_empty()
            });
            if !scheme_ok {
                return Err((
                    format!("weights.allowed_prefixes[{i}]"),
                    format!(
                        "{p:?} is not a checkpoint URI prefix like \"s3://bucket/checkpoints\" \
                         or \"file:///data/checkpoints\""
                    ),
                ));
            }
        }
        if self.weights.part_size_bytes == 0 {
            return Err((
                "weights.part_size_bytes".into(),
                "must be at least 1".into(),
            ));
        }
        for (key, n) in [
            ("max_body_bytes", self.limits.max_body_bytes),
            ("max_task_body_bytes", self.limits.max_task_body_bytes),
            ("max_pending_task_bytes", self.limits.max_pending_task_bytes),
            (
                "max_buffered_body_bytes",
                self.limits.max_buffered_body_bytes,
            ),
            ("max_task_results_bytes", self.limits.max_task_results_bytes),
            ("max_journal_bytes", self.limits.max_journal_bytes),
        ] {
            if n == 0 {
                return Err((format!("limits.{key}"), "must be at least 1".into()));
            }
        }
        // One body at the largest size must fit, and the count of bytes is
        // kept in a semaphore, whose permits a u32 counts per request.
        // Bodies being read hold their bytes in the same budget.
        if self.limits.max_buffered_body_bytes
            < self
                .limits
                .max_body_bytes
                .max(self.limits.max_task_body_bytes)
        {
            return Err((
                "limits.max_buffered_body_bytes".into(),
                "must be at least limits.max_body_bytes and limits.max_task_body_bytes".into(),
            ));
        }
        for (key, n) in [
            ("max_body_bytes", self.limits.max_body_bytes),
            ("max_task_body_bytes", self.limits.max_task_body_bytes),
        ] {
            if n > u64::from(u32::MAX) {
                return Err((format!("limits.{key}"), "must be at most 4 GiB".into()));
            }
        }
        if self.limits.max_connections == 0 {
            return Err(("limits.max_connections".into(), "must be at least 1".into()));
        }
        for (key, d) in [
            ("header_read_timeout", self.limits.header_read_timeout),
            ("idle_timeout", self.limits.idle_timeout),
            ("request_timeout", self.limits.request_timeout),
        ] {
            if d.is_zero() {
                return Err((format!("limits.{key}"), "must be longer than 0s".into()));
            }
        }
        self.validate_tenants()?;
        self.validate_backend_access()?;
        let mut names: HashSet<&str> = HashSet::new();
        for (i, app) in self.apps.iter().enumerate() {
            let at = |key: &str| format!("apps[{i}].{key}");
            check_dns_label(&app.name).map_err(|m| (at("name"), m))?;
            for (j, alias) in app.aliases.iter().enumerate() {
                check_model_name(alias).map_err(|m| (at(&format!("aliases[{j}]")), m))?;
            }
            let adapters = app.adapters.models.iter().enumerate().flat_map(|(j, a)| {
                std::iter::once((format!("adapters.models[{j}].name"), &a.name)).chain(
                    a.aliases
                        .iter()
                        .enumerate()
                        .map(move |(k, x)| (format!("adapters.models[{j}].aliases[{k}]"), x)),
                )
            });
            for (key, name) in std::iter::once(("name".to_string(), &app.name))
                .chain(
                    app.aliases
                        .iter()
                        .enumerate()
                        .map(|(j, a)| (format!("aliases[{j}]"), a)),
                )
                .chain(adapters)
            {
                if !names.insert(name) {
                    return Err((
                        at(&key),
                        format!("the name {name:?} is already used by another app"),
                    ));
                }
            }
            if let Some(pool) = &app.pool {
                self.check_pool_served(i, app, pool)?;
                continue;
            }
            match self.backend.kind {
                BackendKind::Local if app.command.is_empty() => {
                    return Err((
                        at("command"),
                        "is required for the local backend (e.g. command = [\"./my-worker\"])"
                            .into(),
                    ));
                }
                BackendKind::Local if app.command[0].is_empty() => {
                    return Err((at("command[0]"), "the program must not be empty".into()));
                }
                BackendKind::Kubernetes if app.image.as_deref().is_none_or(str::is_empty) => {
                    return Err((
                        at("image"),
                        "is required for the kubernetes backend (e.g. image = \"registry/worker:1.0\")"
                            .into(),
                    ));
                }
                _ => {}
            }
            if self.backend.kind == BackendKind::Kubernetes
                && let Some((j, _)) = app.adapters.models.iter().enumerate().find(|(_, a)| {
                    !a.checkpoint.starts_with("file://")
                        || a.watch.as_ref().is_some_and(|w| !w.starts_with("file://"))
                })
            {
                return Err((
                    at(&format!("adapters.models[{j}].checkpoint")),
                    "on the kubernetes backend the engine reads an adapter from a path in its own pod: \
                     use file:// on a volume the pods mount (object-store adapters are pulled by \
                     the gateway, for engines on its machine)"
                        .into(),
                ));
            }
            check_pod(&app.kubernetes).map_err(|(k, m)| (at(&k), m))?;
            for key in app.env.keys() {
                if key.is_empty() || key.contains('=') || key.contains('\0') {
                    return Err((at("env"), format!("{key:?} is not a valid variable name")));
                }
            }
            if let Some(c) = &app.checkpoint {
                let known = [
                    "file://",
                    "s3://",
                    "gs://",
                    "az://",
                    "abfs://",
                    "memory://",
                    "http://",
                    "https://",
                ];
                if !known.iter().any(|p| c.starts_with(p)) {
                    return Err((
                        at("checkpoint"),
                        format!("{c:?} is not a checkpoint URI (file://, s3://, gs://, az://)"),
                    ));
                }
            }
            if app.concurrency == 0 {
                return Err((at("concurrency"), "must be at least 1".into()));
            }
            if self.backend.kind == BackendKind::Local
                && app.gpus as usize > self.backend.gpus.len()
            {
                return Err((
                    at("gpus"),
                    format!(
                        "a replica needs {} GPUs but backend.gpus lists {}",
                        app.gpus,
                        self.backend.gpus.len()
                    ),
                ));
            }
            if app.startup_timeout.is_zero() {
                return Err((at("startup_timeout"), "must be more than 0s".into()));
            }
            if let Err((key, why)) = app.health.check() {
                return Err((at(&format!("health.{key}")), why));
            }
            for (n, word) in app.command.iter().enumerate() {
                if let Err(e) = crate::expand::check(word) {
                    return Err((at(&format!("command[{n}]")), e.to_string()));
                }
            }
            let a = &app.autoscale;
            if a.max == 0 {
                return Err((at("autoscale.max"), "must be at least 1".into()));
            }
            if a.min > a.max {
                return Err((
                    at("autoscale.min"),
                    format!("min ({}) is above max ({})", a.min, a.max),
                ));
            }
            if let Some(t) = a.target
                && !(t.is_finite() && t > 0.0)
            {
                return Err((at("autoscale.target"), "must be a number above 0".into()));
            }
            if !(a.target_utilization.is_finite()
                && a.target_utilization > 0.0
                && a.target_utilization <= 1.0)
            {
                return Err((
                    at("autoscale.target_utilization"),
                    "must be above 0 and at most 1.0 (0.7 means 70% of concurrency)".into(),
                ));
            }
            if let Some(w) = a.target_waiting
                && !(w.is_finite() && w > 0.0 && w <= 1e6)
            {
                return Err((
                    at("autoscale.target_waiting"),
                    "must be a number of requests above 0, at most 1000000".into(),
                ));
            }
            if let Some(k) = a.target_kv_cache_usage
                && !(k.is_finite() && k > 0.0 && k <= 1.0)
            {
                return Err((
                    at("autoscale.target_kv_cache_usage"),
                    "must be above 0 and at most 1.0 (0.8 means 80% of the KV cache)".into(),
                ));
            }
            if (a.target_waiting.is_some() || a.target_kv_cache_usage.is_some())
                && app.engine.metrics_path.is_none()
            {
                let key = if a.target_waiting.is_some() {
                    "autoscale.target_waiting"
                } else {
                    "autoscale.target_kv_cache_usage"
                };
                return Err((
                    at(key),
                    "scaling on the engine's signals needs [apps.engine] metrics_path (\"/metrics\" for vLLM, TGI and SGLang)".into(),
                ));
            }
            for (key, rate) in [
                ("max_scale_up_rate", a.max_scale_up_rate),
                ("max_scale_down_rate", a.max_scale_down_rate),
            ] {
                if !(rate.is_finite() && rate >= 1.0) {
                    return Err((
                        at(&format!("autoscale.{key}")),
                        "must be at least 1.0 (a multiple of the ready replicas)".into(),
                    ));
                }
            }
            if !(a.panic_threshold.is_finite() && a.panic_threshold > 1.0) {
                return Err((
                    at("autoscale.panic_threshold"),
                    "must be above 1.0 (2.0 means 200% of capacity)".into(),
                ));
            }
            if a.stable_window.is_zero() {
                return Err((at("autoscale.stable_window"), "must be more than 0s".into()));
            }
            if a.panic_window.is_zero() || a.panic_window > a.stable_window {
                return Err((
                    at("autoscale.panic_window"),
                    "must be more than 0s and at most stable_window".into(),
                ));
            }
            if app.queue.timeout.is_zero() {
                return Err((at("queue.timeout"), "must be more than 0s".into()));
            }
            app.routing.validate(at)?;
            app.engine.validate(at)?;
            app.adapters.validate(at)?;
            let pr = &app.promotion;
            if pr.marker.is_empty() || pr.marker.contains('/') {
                return Err((
                    at("promotion.marker"),
                    "must be a file name (e.g. \"_COMPLETE\")".into(),
                ));
            }
            if pr.watch_interval < MIN_WATCH_INTERVAL {
                return Err((
                    at("promotion.watch_interval"),
                    "must be at least 100ms (each look lists the store)".into(),
                ));
            }
            if pr.canary.is_some_and(|c| c == 0 || c > 100) {
                return Err((at("promotion.canary"), "must be 1 to 100 (percent)".into()));
            }
            if !(pr.max_error_rate.is_finite() && (0.0..=1.0).contains(&pr.max_error_rate)) {
                return Err((
                    at("promotion.max_error_rate"),
                    "must be between 0 and 1 (0.05 means 5%)".into(),
                ));
            }
        }
        for (i, pool) in self.pools.iter().enumerate() {
            let at = |key: &str| format!("pools[{i}].{key}");
            check_dns_label(&pool.name).map_err(|m| (at("name"), m))?;
            if !names.insert(&pool.name) {
                return Err((
                    at("name"),
                    format!("the name {:?} is already used by an app or pool", pool.name),
                ));
            }
            // An app's revisions run as targets named `<app>-00001`, … and
            // an interruptible pool's fallback as `<pool>-ondemand`: a pool
            // under such a name would take over the other's replicas.
            if let Some(app) = self
                .apps
                .iter()
                .find(|a| is_revision_of(&pool.name, &a.name))
            {
                return Err((
                    at("name"),
                    format!(
                        "{:?} is the name of a revision of app {:?} ({}-00001, …); pick another",
                        pool.name, app.name, app.name
                    ),
                ));
            }
            let ondemand = crate::TargetId::OnDemand(pool.name.clone()).to_string();
            if pool.kubernetes.interruptible
                && (self
                    .apps
                    .iter()
                    .any(|a| a.name == ondemand || a.aliases.contains(&ondemand))
                    || self.pools.iter().any(|p| p.name == ondemand))
            {
                return Err((
                    at("name"),
                    format!(
                        "an interruptible pool's on-demand fallback runs as {ondemand:?}, which is already the name of an app or pool"
                    ),
                ));
            }
            if self.backend.kind == BackendKind::Local
                && pool.command.first().is_none_or(|c| c.is_empty())
            {
                return Err((at("command"), "is required for the local backend".into()));
            }
            if self.backend.kind == BackendKind::Kubernetes
                && pool.image.as_deref().is_none_or(str::is_empty)
            {
                return Err((at("image"), "is required for the kubernetes backend".into()));
            }
            check_pod(&pool.kubernetes).map_err(|(k, m)| (at(&k), m))?;
            if pool.kubernetes.interruptible {
                // Its on-demand replicas run as `<name>-ondemand`.
                let od = format!("{}-ondemand", pool.name);
                if od.len() > 63 {
                    return Err((
                        at("name"),
                        "an interruptible pool's name must leave room for \"-ondemand\" (54 characters at most)".into(),
                    ));
                }
                if self.apps.iter().any(|a| a.name == od) || self.pools.iter().any(|p| p.name == od)
                {
                    return Err((
                        at("name"),
                        format!(
                            "{od:?} is taken, and this interruptible pool needs it for its on-demand replicas"
                        ),
                    ));
                }
            }
            let [min, max] = pool.replicas;
            if max == 0 {
                return Err((
                    at("replicas"),
                    "max (the second number) must be at least 1".into(),
                ));
            }
            if min > max {
                return Err((at("replicas"), format!("min ({min}) is above max ({max})")));
            }
            if pool.concurrency == 0 {
                return Err((at("concurrency"), "must be at least 1".into()));
            }
            if pool.buffer > max {
                return Err((
                    at("buffer"),
                    format!(
                        "{} spare replicas cannot fit under max ({max})",
                        pool.buffer
                    ),
                ));
            }
            if self.backend.kind == BackendKind::Local
                && pool.gpus as usize > self.backend.gpus.len()
            {
                return Err((
                    at("gpus"),
                    format!(
                        "a replica needs {} GPUs but backend.gpus lists {}",
                        pool.gpus,
                        self.backend.gpus.len()
                    ),
                ));
            }
            if pool.task_timeout.is_zero() || pool.startup_timeout.is_zero() {
                return Err((at("task_timeout"), "timeouts must be more than 0s".into()));
            }
            if let Err((key, why)) = pool.health.check() {
                return Err((at(&format!("health.{key}")), why));
            }
            for (n, word) in pool.command.iter().enumerate() {
                if let Err(e) = crate::expand::check(word) {
                    return Err((at(&format!("command[{n}]")), e.to_string()));
                }
            }
            if pool.queue.tenant_quota == Some(0) {
                return Err((at("queue.tenant_quota"), "must be at least 1".into()));
            }
            for (tenant, w) in &pool.queue.tenant_weights {
                if *w == 0 || tenant.is_empty() {
                    return Err((
                        at(&format!("queue.tenant_weights.{tenant}")),
                        "a tenant weight must be at least 1 (it is turns per round)".into(),
                    ));
                }
            }
            if pool.weight_sync_timeout.is_zero() {
                return Err((at("weight_sync_timeout"), "must be more than 0s".into()));
            }
            if !(pool.inference_share.is_finite() && (0.0..=1.0).contains(&pool.inference_share)) {
                return Err((
                    at("inference_share"),
                    "must be between 0 and 1 (0.5 means half of each replica's slots)".into(),
                ));
            }
        }
        Ok(())
    }

    /// An app served by a pool's replicas (`apps[i].pool`): the pool
    /// exists, serves no other app, and the app sets nothing that only its
    /// own replicas would use.
    fn check_pool_served(
        &self,
        i: usize,
        app: &AppSpec,
        pool: &str,
    ) -> std::result::Result<(), (String, String)> {
        let at = |key: &str| format!("apps[{i}].{key}");
        if !self.pools.iter().any(|p| p.name == pool) {
            let known: Vec<&str> = self.pools.iter().map(|p| p.name.as_str()).collect();
            return Err((
                at("pool"),
                if known.is_empty() {
                    format!("names pool {pool:?}, but no pool is defined")
                } else {
                    format!(
                        "names pool {pool:?}, which is not defined (pools: {})",
                        known.join(", ")
                    )
                },
            ));
        }
        if let Some(other) = self.apps[..i]
            .iter()
            .find(|a| a.pool.as_deref() == Some(pool))
        {
            return Err((
                at("pool"),
                format!(
                    "pool {pool:?} already serves app {:?}; give that app an alias instead",
                    other.name
                ),
            ));
        }
        let d = AppSpec::default();
        let own: [(&str, bool); 11] = [
            ("command", !app.command.is_empty()),
            ("image", app.image.is_some()),
            ("env", !app.env.is_empty()),
            ("checkpoint", app.checkpoint.is_some()),
            ("concurrency", app.concurrency != d.concurrency),
            ("gpus", app.gpus != d.gpus),
            ("startup_timeout", app.startup_timeout != d.startup_timeout),
            ("health", app.health != d.health),
            ("autoscale", app.autoscale != d.autoscale),
            ("promotion", app.promotion != d.promotion),
            ("kubernetes", app.kubernetes != d.kubernetes),
        ];
        if let Some((key, _)) = own.iter().find(|(_, set)| *set) {
            return Err((
                at(key),
                format!(
                    "an app served by pool {pool:?} runs on the pool's replicas, with the pool's \
                     weights, limit and scaling: set {key} on the pool, or drop `pool` to give \
                     the app replicas of its own"
                ),
            ));
        }
        if app.queue.timeout.is_zero() {
            return Err((at("queue.timeout"), "must be more than 0s".into()));
        }
        Ok(())
    }

    fn resolve_paths(&mut self, base: &Path) {
        if self.state_dir.is_relative() {
            self.state_dir = base.join(&self.state_dir);
        }
        if let Some(tls) = &mut self.tls {
            for p in [&mut tls.cert, &mut tls.key] {
                if p.is_relative() {
                    *p = base.join(&*p);
                }
            }
        }
        for pool in &mut self.pools {
            pool.resolve_paths(base);
        }
        for app in &mut self.apps {
            app.resolve_paths(base);
        }
        for p in self.weights.allowed_prefixes.iter_mut().flatten() {
            resolve_checkpoint(p, base);
        }
    }

    /// `backend.pass_env` names variables, and none of the gateway's own
    /// secrets; each `kubernetes.service_account` is one the backend
    /// settings allow.
    fn validate_backend_access(&self) -> std::result::Result<(), (String, String)> {
        let secrets: Vec<&str> = std::iter::once(ADMIN_TOKEN_VAR)
            .chain(self.tenants.iter().filter_map(|t| t.api_key_env.as_deref()))
            .collect();
        for (i, name) in self.backend.pass_env.iter().enumerate() {
            let key = format!("backend.pass_env[{i}]");
            if !is_env_name(name) {
                return Err((
                    key,
                    format!(
                        "{name:?} is not a variable name (letters, digits and _, not starting with a digit)"
                    ),
                ));
            }
            if secrets.contains(&name.as_str()) {
                return Err((
                    key,
                    format!("{name} holds a secret of the gateway and is never passed to workers"),
                ));
            }
        }
        let allowed = &self.backend.kubernetes.allowed_service_accounts;
        for (i, sa) in allowed.iter().enumerate() {
            check_dns_subdomain(sa).map_err(|m| {
                (
                    format!("backend.kubernetes.allowed_service_accounts[{i}]"),
                    m,
                )
            })?;
        }
        let specs = self
            .apps
            .iter()
            .enumerate()
            .map(|(i, a)| (format!("apps[{i}]"), &a.kubernetes))
            .chain(
                self.pools
                    .iter()
                    .enumerate()
                    .map(|(i, p)| (format!("pools[{i}]"), &p.kubernetes)),
            );
        let allowed_secrets = &self.backend.kubernetes.allowed_secrets;
        for (at, pod) in specs {
            let named = pod
                .secret_env
                .iter()
                .map(|(var, k)| (format!("secret_env.{var}"), &k.secret))
                .chain(
                    pod.env_from_secrets
                        .iter()
                        .enumerate()
                        .map(|(i, s)| (format!("env_from_secrets[{i}]"), s)),
                )
                .chain(
                    pod.image_pull_secrets
                        .iter()
                        .enumerate()
                        .map(|(i, s)| (format!("image_pull_secrets[{i}]"), s)),
                );
            for (key, secret) in named {
                if !allowed_secrets.contains(secret) {
                    return Err((
                        format!("{at}.kubernetes.{key}"),
                        format!(
                            "{secret:?} is not in backend.kubernetes.allowed_secrets; \
                             only the secrets the operator allows may reach replica pods"
                        ),
                    ));
                }
            }
            check_volumes(&at, pod, &self.backend.kubernetes)?;
            for var in pod.secret_env.keys() {
                if var.is_empty() || var.contains('=') {
                    return Err((
                        format!("{at}.kubernetes.secret_env"),
                        format!("{var:?} is not a valid variable name"),
                    ));
                }
            }
            if let Some(sa) = &pod.service_account
                && !allowed.contains(sa)
            {
                return Err((
                    format!("{at}.kubernetes.service_account"),
                    format!(
                        "{sa:?} is not in backend.kubernetes.allowed_service_accounts; \
                         only the accounts the operator allows may run replica pods"
                    ),
                ));
            }
        }
        Ok(())
    }

    fn validate_tenants(&self) -> std::result::Result<(), (String, String)> {
        let mut names = HashSet::new();
        let mut keys = HashSet::new();
        for (i, t) in self.tenants.iter().enumerate() {
            let at = |key: &str| format!("tenants[{i}].{key}");
            check_dns_label(&t.name).map_err(|m| (at("name"), m))?;
            if !names.insert(t.name.as_str()) {
                return Err((at("name"), format!("tenant {:?} is listed twice", t.name)));
            }
            match (&t.api_key_sha256, &t.api_key_env) {
                (Some(h), None) => {
                    check_sha256_hex(h).map_err(|m| (at("api_key_sha256"), m))?;
                    if !keys.insert(h.to_ascii_lowercase()) {
                        return Err((
                            at("api_key_sha256"),
                            "another tenant has the same key".into(),
                        ));
                    }
                }
                (None, Some(v)) if !v.is_empty() => {}
                (None, Some(_)) => {
                    return Err((at("api_key_env"), "names no variable".into()));
                }
                _ => {
                    return Err((
                        at("api_key_sha256"),
                        "give exactly one of api_key_sha256 and api_key_env".into(),
                    ));
                }
            }
            // Outside these the limiter's period does not exist (over 10^9
            // a second it is under a nanosecond, and the limit would be off)
            // or is a thousand seconds long.
            if let Some(r) = t.rps
                && !(MIN_TENANT_RPS..=MAX_TENANT_RPS).contains(&r)
            {
                return Err((
                    at("rps"),
                    format!("must be a number from {MIN_TENANT_RPS} to {MAX_TENANT_RPS:e}"),
                ));
            }
            for (key, v) in [
                ("max_inflight", t.max_inflight),
                ("max_pending", t.max_pending),
                ("burst", t.burst),
            ] {
                if v == Some(0) {
                    return Err((at(key), "must be at least 1".into()));
                }
            }
        }
        Ok(())
    }

    /// The app with this name or alias.
    pub fn app(&self, name: &str) -> Option<&AppSpec> {
        self.apps
            .iter()
            .find(|a| a.name == name || a.aliases.iter().any(|x| x == name))
    }
}

// === impl BackendConfig ===

impl Default for BackendConfig {
    fn default() -> Self {
        BackendConfig {
            kind: BackendKind::Local,
            gpus: Vec::new(),
            stop_grace: defaults::STOP_GRACE,
            kubernetes: KubeBackendConfig::default(),
            pass_env: Vec::new(),
        }
    }
}

// === impl KubeBackendConfig ===

impl Default for KubeBackendConfig {
    fn default() -> Self {
        KubeBackendConfig {
            namespace: None,
            spot_node_selector: BTreeMap::from([(
                "karpenter.sh/capacity-type".to_string(),
                "spot".to_string(),
            )]),
            spot_tolerations: Vec::new(),
            image_pull_policy: None,
            advertise: None,
            allowed_service_accounts: Vec::new(),
            allowed_secrets: Vec::new(),
            allowed_claims: Vec::new(),
            allowed_config_maps: Vec::new(),
            run_as_non_root: false,
        }
    }
}

// === impl LimitsConfig ===

impl Default for LimitsConfig {
    fn default() -> Self {
        LimitsConfig {
            max_body_bytes: defaults::MAX_BODY_BYTES,
            max_task_body_bytes: defaults::MAX_TASK_BODY_BYTES,
            max_pending_task_bytes: defaults::MAX_PENDING_TASK_BYTES,
            max_buffered_body_bytes: defaults::MAX_BUFFERED_BODY_BYTES,
            max_task_results_bytes: defaults::MAX_TASK_RESULTS_BYTES,
            max_journal_bytes: defaults::MAX_JOURNAL_BYTES,
            max_connections: defaults::MAX_CONNECTIONS,
            header_read_timeout: defaults::HEADER_READ_TIMEOUT,
            idle_timeout: defaults::IDLE_TIMEOUT,
            request_timeout: defaults::REQUEST_TIMEOUT,
        }
    }
}

// === impl WeightsConfig ===

impl Default for WeightsConfig {
    fn default() -> Self {
        WeightsConfig {
            concurrency: defaults::WEIGHTS_CONCURRENCY,
            part_size_bytes: defaults::WEIGHTS_PART_SIZE,
            memory_limit_bytes: defaults::WEIGHTS_MEMORY_LIMIT,
            cache_max_bytes: defaults::WEIGHTS_CACHE_MAX,
            // Nothing beyond what the config itself names: a checkpoint
            // URI from an API call must not reach arbitrary files, hosts
            // or buckets with the gateway's own credentials.
            allowed_prefixes: None,
        }
    }
}

// === impl AppSpec ===

impl Default for AppSpec {
    fn default() -> Self {
        AppSpec {
            name: String::new(),
            aliases: Vec::new(),
            command: Vec::new(),
            image: None,
            env: BTreeMap::new(),
            checkpoint: None,
            concurrency: defaults::CONCURRENCY,
            gpus: 0,
            startup_timeout: defaults::STARTUP_TIMEOUT,
            health: HealthSpec::default(),
            autoscale: AutoscaleSpec::default(),
            queue: QueueSpec::default(),
            promotion: PromotionSpec::default(),
            routing: crate::routing::RoutingSpec::default(),
            engine: crate::routing::EngineSpec::default(),
            adapters: crate::adapters::AdaptersSpec::default(),
            kubernetes: PodSpec::default(),
            pool: None,
        }
    }
}

impl AppSpec {
    /// The scaling target in requests per replica, with its default applied.
    pub fn target(&self) -> f64 {
        self.autoscale
            .target
            .unwrap_or((f64::from(self.concurrency) * self.autoscale.target_utilization).max(1.0))
    }
}

// === impl PoolSpec ===

impl PoolSpec {
    /// This spec with `other`'s settings that need no new replica: replica
    /// bounds, idle TTL, suspension, buffer, retries, timeouts, staleness,
    /// queue bounds and weights. A running pool takes such a change in
    /// place; `spec.retuned(&other) == other` says whether that is all
    /// that changed.
    pub fn retuned(&self, other: &PoolSpec) -> PoolSpec {
        let mut next = self.clone();
        next.replicas = other.replicas;
        next.idle_ttl = other.idle_ttl;
        next.suspend_after = other.suspend_after;
        next.buffer = other.buffer;
        next.retries = other.retries;
        next.task_timeout = other.task_timeout;
        next.max_staleness = other.max_staleness;
        next.weight_sync_timeout = other.weight_sync_timeout;
        next.startup_timeout = other.startup_timeout;
        next.queue.max_pending = other.queue.max_pending;
        next.queue.tenant_quota = other.queue.tenant_quota;
        next.queue.tenant_weights = other.queue.tenant_weights.clone();
        next.inference_share = other.inference_share;
        next
    }
}

impl Default for PoolSpec {
    fn default() -> Self {
        PoolSpec {
            name: String::new(),
            command: Vec::new(),
            image: None,
            env: BTreeMap::new(),
            checkpoint: None,
            replicas: [defaults::POOL_MIN, defaults::POOL_MAX],
            concurrency: defaults::POOL_CONCURRENCY,
            gpus: 0,
            idle_ttl: defaults::IDLE_TTL,
            suspend_after: None,
            buffer: 0,
            startup_timeout: defaults::STARTUP_TIMEOUT,
            health: HealthSpec::default(),
            retries: defaults::TASK_RETRIES,
            task_timeout: defaults::TASK_TIMEOUT,
            queue: PoolQueueSpec::default(),
            max_staleness: None,
            weight_sync_timeout: defaults::WEIGHT_SYNC_TIMEOUT,
            kubernetes: PodSpec::default(),
            inference_share: defaults::INFERENCE_SHARE,
        }
    }
}

impl Default for PoolQueueSpec {
    fn default() -> Self {
        PoolQueueSpec {
            max_pending: defaults::POOL_MAX_PENDING,
            fairness: Fairness::Tenant,
            tenant_quota: None,
            tenant_weights: BTreeMap::new(),
        }
    }
}

// === impl AutoscaleSpec ===

impl Default for AutoscaleSpec {
    fn default() -> Self {
        AutoscaleSpec {
            min: defaults::MIN,
            max: defaults::MAX,
            target: None,
            scale_to_zero_after: ScaleToZeroAfter::Auto,
            stable_window: defaults::STABLE_WINDOW,
            panic_window: defaults::PANIC_WINDOW,
            panic_threshold: defaults::PANIC_THRESHOLD,
            target_utilization: defaults::TARGET_UTILIZATION,
            max_scale_up_rate: defaults::MAX_SCALE_UP_RATE,
            max_scale_down_rate: defaults::MAX_SCALE_DOWN_RATE,
            scale_down_delay: Duration::ZERO,
            predictive: false,
            cold_start_aware: true,
            suspend_after: None,
            target_waiting: None,
            target_kv_cache_usage: None,
        }
    }
}

// === impl QueueSpec ===

impl Default for QueueSpec {
    fn default() -> Self {
        QueueSpec {
            max_pending: defaults::MAX_PENDING,
            timeout: defaults::QUEUE_TIMEOUT,
        }
    }
}

fn resolve_command(command: &mut [String], base: &Path) {
    if let Some(program) = command.first_mut() {
        let p = Path::new(program.as_str());
        if p.is_relative() && program.contains('/') {
            *program = base.join(p).to_string_lossy().into_owned();
        }
    }
}

/// Makes a relative `file://` URI absolute against `base` (the config
/// file's folder); other URIs are left as they are.
pub fn resolve_checkpoint(c: &mut String, base: &Path) {
    if let Some(rest) = c.strip_prefix("file://")
        && !rest.starts_with('/')
    {
        let abs = base.join(rest.trim_start_matches("./"));
        *c = format!("file://{}", abs.display());
    }
}

/// Checks the pod settings that Kubernetes would refuse only at creation.
fn check_pod(p: &PodSpec) -> std::result::Result<(), (String, String)> {
    for (key, v) in [("cpu", &p.cpu), ("memory", &p.memory)] {
        if let Some(q) = v
            && (q.is_empty() || !q.starts_with(|c: char| c.is_ascii_digit() || c == '.'))
        {
            return Err((
                format!("kubernetes.{key}"),
                format!("{q:?} is not a quantity (e.g. \"4\", \"500m\", \"16Gi\")"),
            ));
        }
    }
    for (i, t) in p.tolerations.iter().enumerate() {
        if let Some(op) = &t.operator
            && op != "Equal"
            && op != "Exists"
        {
            return Err((
                format!("kubernetes.tolerations[{i}].operator"),
                "must be \"Equal\" or \"Exists\"".into(),
            ));
        }
    }
    Ok(())
}

/// The variable holding the control plane's bearer token, which no worker
/// may inherit.
const ADMIN_TOKEN_VAR: &str = "WARMGATE_ADMIN_TOKEN";

/// Whether `name` can be an environment variable's name (POSIX: letters,
/// digits and `_`, not starting with a digit).
fn is_env_name(name: &str) -> bool {
    name.starts_with(|c: char| c.is_ascii_alphabetic() || c == '_')
        && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// Why `name` is not a Kubernetes object name (an RFC 1123 subdomain), if
/// it is not.
fn check_dns_subdomain(name: &str) -> std::result::Result<(), String> {
    let ok = !name.is_empty()
        && name.len() <= 253
        && name.split('.').all(|l| {
            !l.is_empty()
                && l.starts_with(|c: char| c.is_ascii_lowercase() || c.is_ascii_digit())
                && l.ends_with(|c: char| c.is_ascii_lowercase() || c.is_ascii_digit())
                && l.chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
        });
    if ok {
        Ok(())
    } else {
        Err(format!(
            "{name:?} is not a Kubernetes name (lowercase letters, digits, '-' and '.')"
        ))
    }
}

/// Why `text` is not a SHA-256 digest in hex, if it is not.
fn check_sha256_hex(text: &str) -> std::result::Result<(), String> {
    if text.len() == 64 && text.bytes().all(|b| b.is_ascii_hexdigit()) {
        Ok(())
    } else {
        Err("must be 64 hex digits, the SHA-256 of the key (printf %s KEY | sha256sum)".into())
    }
}

/// Durations in the config, as humantime strings (`"30s"`, `"5m"`), at
/// most [`bounded::MAX`]: a larger one is a typo, and would overflow the
/// clock arithmetic of deadlines.
/// Bytes from a size as people write it (`"64MiB"`, `"16Gi"`, `"500MB"`)
/// or a whole number of bytes.
pub fn parse_size(text: &str) -> std::result::Result<u64, String> {
    size::parse(text)
}

/// A size in bytes, written as a whole number of bytes or with a unit, as
/// people write sizes elsewhere in the file (`memory = "16Gi"`):
/// `"64MiB"`, `"64 MiB"`, `"1.5GiB"`, `"500MB"`, `"16Gi"`, `"16Ki"`
/// (`Ki`/`Mi`/`Gi`/`Ti` are the binary units, as in Kubernetes).
pub(crate) mod size {
    use serde::{Deserialize, Deserializer, Serializer};

    /// The schema of a size: a whole number of bytes or a text with a unit.
    pub struct Size;

    impl schemars::JsonSchema for Size {
        fn schema_name() -> std::borrow::Cow<'static, str> {
            "Size".into()
        }

        fn inline_schema() -> bool {
            true
        }

        fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
            schemars::json_schema!({
                "type": ["integer", "string"],
                "format": "size",
            })
        }
    }

    pub fn serialize<S: Serializer>(n: &u64, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(*n)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Bytes(u64),
            Text(String),
        }
        match Raw::deserialize(d)? {
            Raw::Bytes(n) => Ok(n),
            Raw::Text(t) => parse(&t).map_err(serde::de::Error::custom),
        }
    }

    /// Bytes from a size with a unit.
    pub fn parse(text: &str) -> Result<u64, String> {
        let t = text.trim();
        // Kubernetes' binary suffixes (`16Gi`) are bytesize's `GiB`.
        let kube = ["Ki", "Mi", "Gi", "Ti", "Pi", "Ei"]
            .iter()
            .find(|s| t.ends_with(*s))
            .map(|_| format!("{t}B"));
        kube.as_deref()
            .unwrap_or(t)
            .parse::<bytesize::ByteSize>()
            .map(|b| b.as_u64())
            .map_err(|_| {
                format!(
                    "{text:?} is not a size: write bytes (1048576) or a number and a unit (\"64MiB\", \"16Gi\", \"500MB\")"
                )
            })
    }
}

pub(crate) mod bounded {
    use std::time::Duration;

    use serde::{Deserializer, Serializer};

    /// Ten years.
    pub const MAX: Duration = Duration::from_secs(10 * 365 * 24 * 3600);

    fn check<E: serde::de::Error>(d: Duration) -> Result<Duration, E> {
        if d > MAX {
            Err(E::custom(format!(
                "{}s is too long (at most 10 years)",
                d.as_secs()
            )))
        } else {
            Ok(d)
        }
    }

    pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        humantime_serde::serialize(d, s)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        let v: Duration = humantime_serde::deserialize(d)?;
        check(v)
    }

    pub mod option {
        use super::*;

        pub fn serialize<S: Serializer>(d: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
            humantime_serde::serialize(d, s)
        }

        pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
            let v: Option<Duration> = humantime_serde::deserialize(d)?;
            v.map(check).transpose()
        }
    }
}

/// The shortest `promotion.watch_interval`: each look lists the store
/// with the gateway's credentials, so a spec must not turn the watcher into
/// a busy loop; ten looks a second is already more than training needs.
const MIN_WATCH_INTERVAL: Duration = Duration::from_millis(100);

/// Whether `name` is the id of a revision of `app` (`<app>-` and at least
/// five digits, as revisions are numbered).
fn is_revision_of(name: &str, app: &str) -> bool {
    name.strip_prefix(app)
        .and_then(|r| r.strip_prefix('-'))
        .is_some_and(|d| d.len() >= 5 && d.bytes().all(|b| b.is_ascii_digit()))
}

/// App names end up in URLs, file names, metric labels and (on Kubernetes)
/// object names, so they follow RFC 1123 labels.
pub fn check_dns_label(name: &str) -> std::result::Result<(), String> {
    let ok = !name.is_empty()
        && name.len() <= 63
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && name.as_bytes()[0].is_ascii_lowercase()
        && !name.ends_with('-');
    if ok {
        Ok(())
    } else {
        Err(format!(
            "{name:?} is not a valid name: use 1-63 lowercase letters, digits and '-', \
             starting with a letter"
        ))
    }
}

/// The most bytes of an alias (an OpenAI `model` name): Hugging Face
/// repository ids are at most 96 characters; 128 leaves room for a tag.
pub const MAX_MODEL_NAME_LEN: usize = 128;

/// Checks an alias: the characters model names use (ASCII letters and
/// digits, `-`, `_`, `.`, `/`, `:`, `@`), at most [`MAX_MODEL_NAME_LEN`]
/// bytes, starting with a letter or digit, with no `..` segment. Control
/// characters, zero-width and look-alike letters, and paths (`../x`) are
/// refused: an alias is echoed in errors and logs and names a route.
pub fn check_model_name(name: &str) -> std::result::Result<(), String> {
    let ok = !name.is_empty()
        && name.len() <= MAX_MODEL_NAME_LEN
        && name.as_bytes()[0].is_ascii_alphanumeric()
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_./:@".contains(&b))
        && !name
            .split('/')
            .any(|seg| seg == ".." || seg == "." || seg.is_empty());
    if ok {
        Ok(())
    } else {
        let shown: String = name.chars().take(64).collect();
        Err(format!(
            "{shown:?} is not a valid model name: use 1-{MAX_MODEL_NAME_LEN} ASCII letters, \
             digits and '-', '_', '.', '/', ':', '@', starting with a letter or digit, with \
             no empty, '.' or '..' segment"
        ))
    }
}

fn one_line(s: &str) -> String {
    s.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join(" ")
}

#[cfg(test)]
mod tests {
    #[test]
    fn aliases_are_model_names_and_nothing_else() {
        for good in [
            "gpt-4o",
            "meta-llama/Llama-3.1-8B-Instruct",
            "org/model-x",
            "m:v2",
            "a@b",
            "x_y.z",
        ] {
            super::check_model_name(good).unwrap_or_else(|e| panic!("{good}: {e}"));
        }
        let long = "a".repeat(super::MAX_MODEL_NAME_LEN + 1);
        for bad in [
            "",
            "a\0b",
            "a\u{1b}[31m",
            "a\u{200b}b",
            "gpt\u{0430}",
            "../../etc/passwd",
            "a/../b",
            "a//b",
            "-a",
            "a b",
            long.as_str(),
        ] {
            assert!(super::check_model_name(bad).is_err(), "{bad:?}");
        }
    }

    use super::*;

    fn parse(text: &str) -> Result<Config> {
        Config::parse(text, Path::new("test.toml"), Path::new("/base"))
    }

    #[test]
    fn object_store_adapters_are_pulled_by_the_gateway_so_not_on_kubernetes() {
        let app = |backend: &str, uri: &str| {
            parse(&format!(
                "{backend}[[apps]]\nname = \"m\"\ncommand = [\"./w\"]\nimage = \"w:1\"\n\
                 [[apps.adapters.models]]\nname = \"sql\"\ncheckpoint = \"{uri}\"\n"
            ))
        };
        assert!(app("", "s3://b/sql").is_ok());
        assert!(app("[backend]\nkind = \"kubernetes\"\n", "file:///mnt/sql").is_ok());
        let err = app("[backend]\nkind = \"kubernetes\"\n", "s3://b/sql")
            .expect_err("refused")
            .to_string();
        assert!(
            err.contains("apps[0].adapters.models[0].checkpoint"),
            "{err}"
        );
        assert!(err.contains("volume"), "{err}");
    }

    #[test]
    fn the_checkpoint_watcher_cannot_be_a_busy_loop() {
        let with = |interval: &str| {
            parse(&format!(
                "[[apps]]\nname = \"m\"\ncommand = [\"./w\"]\n[apps.promotion]\nwatch = \"file:///ckpt\"\nwatch_interval = \"{interval}\"\n"
            ))
        };
        let err = with("1ns").expect_err("a busy loop");
        assert!(
            err.to_string().contains("promotion.watch_interval"),
            "{err}"
        );
        with("100ms").expect("ten looks a second");
    }

    #[test]
    fn a_pool_cannot_take_the_name_of_an_app_revision_or_an_on_demand_fallback() {
        let err = parse(
            r#"
            [[apps]]
            name = "minilm"
            command = ["./w"]
            [[pools]]
            name = "minilm-00001"
            command = ["./p"]
            "#,
        )
        .expect_err("a pool named like the app's first revision");
        let text = err.to_string();
        assert!(text.contains("pools[0].name"), "{text}");
        assert!(text.contains("revision of app"), "{text}");
        // Not a revision id: fewer than five digits, or not digits.
        for ok in ["minilm-0001", "minilm-x0001", "minilm2-00001"] {
            parse(&format!(
                "[[apps]]\nname = \"minilm\"\ncommand = [\"./w\"]\n[[pools]]\nname = \"{ok}\"\ncommand = [\"./p\"]\n"
            ))
            .unwrap_or_else(|e| panic!("{ok}: {e}"));
        }
        let err = parse(
            r#"
            [[apps]]
            name = "spot-ondemand"
            command = ["./w"]
            [[pools]]
            name = "spot"
            command = ["./p"]
            [pools.kubernetes]
            interruptible = true
            "#,
        )
        .expect_err("an app named like the pool's on-demand fallback");
        assert!(err.to_string().contains("on-demand"), "{err}");
    }

    #[test]
    fn an_app_served_by_a_pool_names_one_and_sets_nothing_of_its_own() {
        let pool = "[[pools]]\nname = \"policy\"\ncommand = [\"./p\"]\ninference_share = 0.25\n";
        let c = parse(&format!(
            "{pool}[[apps]]\nname = \"chat\"\npool = \"policy\"\naliases = [\"tiny\"]\n[apps.queue]\ntimeout = \"5s\"\n"
        ))
        .expect("an app on a pool needs no command");
        assert_eq!(c.apps[0].pool.as_deref(), Some("policy"));
        assert_eq!(c.pools[0].inference_share, 0.25);
        let refused = |app: &str, key: &str| {
            let err = parse(&format!("{pool}[[apps]]\nname = \"chat\"\n{app}"))
                .expect_err(app)
                .to_string();
            assert!(err.contains(key), "{app}: {err}");
        };
        refused("pool = \"nope\"\n", "apps[0].pool");
        refused(
            "pool = \"policy\"\ncommand = [\"./w\"]\n",
            "apps[0].command",
        );
        refused(
            "pool = \"policy\"\ncheckpoint = \"file:///c\"\n",
            "apps[0].checkpoint",
        );
        refused(
            "pool = \"policy\"\n[apps.autoscale]\nmax = 3\n",
            "apps[0].autoscale",
        );
        refused(
            "pool = \"policy\"\nconcurrency = 9\n",
            "apps[0].concurrency",
        );
        let err = parse(&format!(
            "{pool}[[apps]]\nname = \"a\"\npool = \"policy\"\n[[apps]]\nname = \"b\"\npool = \"policy\"\n"
        ))
        .expect_err("two apps on one pool");
        assert!(err.to_string().contains("apps[1].pool"), "{err}");
        for share in ["1.5", "-0.1", "nan"] {
            let err = parse(&format!(
                "[[pools]]\nname = \"p\"\ncommand = [\"./p\"]\ninference_share = {share}\n"
            ))
            .expect_err(share);
            assert!(
                err.to_string().contains("inference_share"),
                "{share}: {err}"
            );
        }
    }

    #[test]
    fn sizes_take_units_as_people_write_them() {
        for (text, bytes) in [
            ("64MiB", 64 << 20),
            ("64 MiB", 64 << 20),
            ("16Gi", 16u64 << 30),
            ("16Ki", 16 << 10),
            ("1.5GiB", 3 << 29),
            ("500MB", 500_000_000),
            ("1048576", 1 << 20),
        ] {
            assert_eq!(size::parse(text), Ok(bytes), "{text}");
        }
        for bad in ["", "lots", "12 parsecs", "-1MiB"] {
            assert!(size::parse(bad).is_err(), "{bad}");
        }
        let c = parse("[limits]\nmax_body_bytes = \"16MiB\"\n[weights]\ncache_max_bytes = \"20Gi\"\npart_size_bytes = 8388608\n")
            .expect("sizes with units");
        assert_eq!(c.limits.max_body_bytes, 16 << 20);
        assert_eq!(c.weights.cache_max_bytes, 20u64 << 30);
        assert_eq!(c.weights.part_size_bytes, 8 << 20);
        let err = parse("[limits]\nmax_body_bytes = \"huge\"\n").expect_err("not a size");
        let text = err.to_string();
        assert!(
            text.contains("limits.max_body_bytes") || text.contains("max_body_bytes"),
            "{text}"
        );
        assert!(text.contains("not a size"), "{text}");
    }

    #[test]
    fn interface_example_parses_with_defaults() {
        let c = parse(
            r#"
            listen = "127.0.0.1:9000"
            [backend]
            gpus = [0, 1]
            [[apps]]
            name = "minilm"
            command = ["./bin/embedder", "--flag"]
            gpus = 1
            [apps.autoscale]
            max = 2
            scale_to_zero_after = "90s"
            "#,
        )
        .expect("valid config");
        let app = &c.apps[0];
        assert_eq!(app.command[0], "/base/./bin/embedder");
        assert_eq!(app.command[1], "--flag");
        assert_eq!(app.concurrency, defaults::CONCURRENCY);
        assert_eq!(
            app.autoscale.scale_to_zero_after,
            crate::ScaleToZeroAfter::After(Duration::from_secs(90))
        );
        assert_eq!(app.autoscale.max, 2);
        assert_eq!(app.queue.max_pending, defaults::MAX_PENDING);
        assert!((app.target() - 5.6).abs() < 1e-9);
        assert_eq!(c.state_dir, PathBuf::from("/base/.warmgate"));
    }

    #[test]
    fn unknown_key_names_its_path() {
        let err = parse(
            r#"
            [[apps]]
            name = "a"
            command = ["x"]
            [apps.autoscale]
            mni = 1
            "#,
        )
        .unwrap_err();
        assert_eq!(err.key(), Some("apps[0].autoscale.mni"));
        assert!(err.to_string().contains("unknown field `mni`"), "{err}");
        assert!(err.to_string().starts_with("test.toml: "), "{err}");
    }

    #[test]
    fn bad_duration_names_its_key() {
        let err = parse("[[apps]]\nname = \"a\"\ncommand = [\"x\"]\nstartup_timeout = \"soon\"\n")
            .unwrap_err();
        assert_eq!(err.key(), Some("apps[0].startup_timeout"));
    }

    #[test]
    fn invalid_values_are_refused() {
        let cases = [
            ("[[apps]]\nname = \"A\"\ncommand = [\"x\"]", "apps[0].name"),
            ("[[apps]]\nname = \"a\"", "apps[0].command"),
            (
                "[[apps]]\nname = \"a\"\ncommand = [\"x\"]\nconcurrency = 0",
                "apps[0].concurrency",
            ),
            (
                "[[apps]]\nname = \"a\"\ncommand = [\"x\"]\ngpus = 1",
                "apps[0].gpus",
            ),
            (
                "[[apps]]\nname = \"a\"\ncommand = [\"x\"]\n[apps.autoscale]\nmin = 3\nmax = 2",
                "apps[0].autoscale.min",
            ),
            (
                "[[apps]]\nname = \"a\"\ncommand = [\"x\"]\n[[apps]]\nname = \"b\"\ncommand = [\"x\"]\naliases = [\"a\"]",
                "apps[1].aliases[0]",
            ),
            (
                "[backend]\nkind = \"kubernetes\"\n[[apps]]\nname = \"a\"",
                "apps[0].image",
            ),
            ("[backend]\ngpus = [0, 0]", "backend.gpus[1]"),
            (
                "[[apps]]\nname = \"a\"\ncommand = [\"x\", \"--port\", \"${PORT\"]",
                "apps[0].command[2]",
            ),
            (
                "[[apps]]\nname = \"a\"\ncommand = [\"x\"]\n[apps.health]\npath = \"health\"",
                "apps[0].health.path",
            ),
            (
                "[[apps]]\nname = \"a\"\ncommand = [\"x\"]\n[apps.health]\npath = \"/a b\"",
                "apps[0].health.path",
            ),
            (
                "[[apps]]\nname = \"a\"\ncommand = [\"x\"]\n[apps.health]\nready_statuses = []",
                "apps[0].health.ready_statuses",
            ),
            (
                "[[apps]]\nname = \"a\"\ncommand = [\"x\"]\n[apps.health]\nready_statuses = [200, 700]",
                "apps[0].health.ready_statuses",
            ),
            (
                "[[apps]]\nname = \"a\"\ncommand = [\"x\"]\n[apps.health]\nfailure_threshold = 0",
                "apps[0].health.failure_threshold",
            ),
            (
                "[[pools]]\nname = \"p\"\ncommand = [\"x\"]\n[pools.health]\ntimeout = \"0s\"",
                "pools[0].health.timeout",
            ),
            (
                "[[apps]]\nname = \"a\"\ncommand = [\"x\"]\n[apps.health]\npaht = \"/h\"",
                "apps[0].health.paht",
            ),
        ];
        for (text, key) in cases {
            let err = parse(text).unwrap_err();
            assert_eq!(err.key(), Some(key), "{text}: {err}");
        }
    }

    #[test]
    fn pools_parse_and_share_the_name_space_with_apps() {
        let c = parse(
            "[[pools]]\nname = \"rollouts\"\ncommand = [\"./w\"]\nreplicas = [2, 10]\n[pools.queue]\nfairness = \"none\"\n",
        )
        .expect("valid");
        assert_eq!(c.pools[0].replicas, [2, 10]);
        assert_eq!(c.pools[0].queue.fairness, Fairness::None);
        assert_eq!(c.pools[0].command[0], "/base/./w");
        assert_eq!(c.pools[0].idle_ttl, defaults::IDLE_TTL);
        let err = parse("[[apps]]\nname = \"x\"\ncommand = [\"w\"]\n[[pools]]\nname = \"x\"\ncommand = [\"w\"]\n")
            .unwrap_err();
        assert_eq!(err.key(), Some("pools[0].name"));
        let err =
            parse("[[pools]]\nname = \"p\"\ncommand = [\"w\"]\nreplicas = [3, 1]\n").unwrap_err();
        assert_eq!(err.key(), Some("pools[0].replicas"));
    }

    #[test]
    fn syntax_error_is_reported() {
        let err = parse("[[apps]\nname = ").unwrap_err();
        assert!(matches!(err, Error::Parse { .. }), "{err}");
    }

    #[test]
    fn pass_env_names_variables_and_no_secret_of_the_gateway() {
        let c = parse("[backend]\npass_env = [\"HF_TOKEN\", \"AWS_PROFILE\"]").expect("valid");
        assert_eq!(c.backend.pass_env, ["HF_TOKEN", "AWS_PROFILE"]);
        let tenant = "[[tenants]]\nname = \"team\"\napi_key_env = \"TEAM_KEY\"\n";
        for (text, key) in [
            ("[backend]\npass_env = [\"A=B\"]", "backend.pass_env[0]"),
            ("[backend]\npass_env = [\"\"]", "backend.pass_env[0]"),
            ("[backend]\npass_env = [\"1X\"]", "backend.pass_env[0]"),
            (
                "[backend]\npass_env = [\"PATH\", \"WARMGATE_ADMIN_TOKEN\"]",
                "backend.pass_env[1]",
            ),
            (
                &format!("[backend]\npass_env = [\"TEAM_KEY\"]\n{tenant}"),
                "backend.pass_env[0]",
            ),
        ] {
            let err = parse(text).unwrap_err();
            assert_eq!(err.key(), Some(key), "{text}: {err}");
        }
    }

    #[test]
    fn a_tenant_rate_must_have_a_period_the_limiter_can_keep() {
        let tenant = "[[tenants]]\nname = \"team\"\napi_key_env = \"TEAM_KEY\"\n";
        for rps in ["1e-20", "0.0001", "1e10", "0", "-1", "nan", "inf"] {
            let err = parse(&format!("{tenant}rps = {rps}\n")).unwrap_err();
            assert_eq!(err.key(), Some("tenants[0].rps"), "{rps}: {err}");
            assert!(err.to_string().contains("from 0.001"), "{err}");
        }
        for rps in ["0.001", "5.5", "1e9"] {
            parse(&format!("{tenant}rps = {rps}\n")).expect(rps);
        }
    }

    #[test]
    fn a_service_account_must_be_allowed_by_the_backend_settings() {
        let app = "[[apps]]\nname = \"a\"\nimage = \"r/w:1\"\n[apps.kubernetes]\nservice_account = \"warmgate\"\n";
        let err = parse(&format!("[backend]\nkind = \"kubernetes\"\n{app}")).unwrap_err();
        assert_eq!(err.key(), Some("apps[0].kubernetes.service_account"));
        assert!(
            err.to_string().contains("allowed_service_accounts"),
            "{err}"
        );
        let allowed = "[backend]\nkind = \"kubernetes\"\n[backend.kubernetes]\nallowed_service_accounts = [\"warmgate\"]\n";
        let c = parse(&format!("{allowed}{app}")).expect("allowed");
        assert_eq!(
            c.apps[0].kubernetes.service_account.as_deref(),
            Some("warmgate")
        );
        let pool = "[[pools]]\nname = \"p\"\nimage = \"r/w:1\"\n[pools.kubernetes]\nservice_account = \"other\"\n";
        let err = parse(&format!("{allowed}{pool}")).unwrap_err();
        assert_eq!(err.key(), Some("pools[0].kubernetes.service_account"));
        let err =
            parse("[backend.kubernetes]\nallowed_service_accounts = [\"Not A Name\"]").unwrap_err();
        assert_eq!(
            err.key(),
            Some("backend.kubernetes.allowed_service_accounts[0]")
        );
    }

    #[test]
    fn a_volume_must_be_allowed_have_one_source_and_its_own_path() {
        let backend = "[backend]\nkind = \"kubernetes\"\n[backend.kubernetes]\nallowed_claims = [\"hf-cache\"]\n";
        let app = |vol: &str| {
            format!(
                "{backend}[[apps]]\nname = \"a\"\nimage = \"r/w:1\"\n[apps.kubernetes.volumes]\n{vol}\n"
            )
        };
        let c = parse(&app(
            "models = { mount = \"/models\", claim = \"hf-cache\", read_only = true }\nscratch = { mount = \"/scratch\", empty_dir = \"20Gi\" }",
        ))
        .expect("allowed");
        assert_eq!(c.apps[0].kubernetes.volumes.len(), 2);
        for (vol, key, says) in [
            (
                "m = { mount = \"/m\", claim = \"other-team\" }",
                "apps[0].kubernetes.volumes.m.claim",
                "allowed_claims",
            ),
            (
                "m = { mount = \"/m\", config_map = \"cm\" }",
                "apps[0].kubernetes.volumes.m.config_map",
                "allowed_config_maps",
            ),
            (
                "m = { mount = \"/m\" }",
                "apps[0].kubernetes.volumes.m",
                "exactly one",
            ),
            (
                "m = { mount = \"/m\", claim = \"hf-cache\", empty_dir = \"1Gi\" }",
                "apps[0].kubernetes.volumes.m",
                "exactly one",
            ),
            (
                "m = { mount = \"models\", empty_dir = \"1Gi\" }",
                "apps[0].kubernetes.volumes.m.mount",
                "absolute",
            ),
            (
                "m = { mount = \"/a/../etc\", empty_dir = \"1Gi\" }",
                "apps[0].kubernetes.volumes.m.mount",
                "absolute",
            ),
            (
                "m = { mount = \"/dev/shm\", empty_dir = \"1Gi\" }",
                "apps[0].kubernetes.volumes.m.mount",
                "twice",
            ),
            (
                "a = { mount = \"/x\", empty_dir = \"1Gi\" }\nb = { mount = \"/x/\", empty_dir = \"1Gi\" }",
                "apps[0].kubernetes.volumes.b.mount",
                "twice",
            ),
            (
                "Bad_Name = { mount = \"/x\", empty_dir = \"1Gi\" }",
                "apps[0].kubernetes.volumes.Bad_Name",
                "DNS label",
            ),
            (
                "m = { mount = \"/m\", host_path = \"/\" }",
                "apps[0].kubernetes.volumes.m",
                "host_path",
            ),
        ] {
            let err = parse(&app(vol)).unwrap_err();
            assert!(
                err.key().is_some_and(|k| k.starts_with(key)),
                "{vol}: {err} (key {:?})",
                err.key()
            );
            assert!(err.to_string().contains(says), "{vol}: {err}");
        }
    }

    #[test]
    fn node_affinity_needs_an_operator_kubernetes_knows_and_values_that_fit_it() {
        let app = |req: &str| {
            format!(
                "[backend]\nkind = \"kubernetes\"\n[[apps]]\nname = \"a\"\nimage = \"r/w:1\"\n[apps.kubernetes]\nnode_affinity = [{req}]\n"
            )
        };
        parse(&app(
            "{ key = \"zone\", operator = \"In\", values = [\"a\"] }",
        ))
        .expect("valid");
        parse(&app("{ key = \"gpu\", operator = \"Exists\" }")).expect("valid");
        for (req, key) in [
            (
                "{ key = \"zone\", operator = \"Near\", values = [\"a\"] }",
                "apps[0].kubernetes.node_affinity[0].operator",
            ),
            (
                "{ key = \"zone\", operator = \"In\" }",
                "apps[0].kubernetes.node_affinity[0]",
            ),
            (
                "{ key = \"gpu\", operator = \"Exists\", values = [\"x\"] }",
                "apps[0].kubernetes.node_affinity[0]",
            ),
            (
                "{ key = \"\", operator = \"Exists\" }",
                "apps[0].kubernetes.node_affinity[0]",
            ),
        ] {
            let err = parse(&app(req)).unwrap_err();
            assert_eq!(err.key(), Some(key), "{req}: {err}");
        }
    }
}
