//! Where replicas run: the backend settings, the pods of the kubernetes
//! backend, and their checks.

use std::collections::{BTreeMap, HashSet};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::names::{check_dns_label, check_dns_subdomain, is_env_name};
use super::{Config, bounded, defaults};

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

impl BackendConfig {
    /// No GPU is listed twice.
    pub(super) fn check_gpus(&self) -> Result<(), (String, String)> {
        let mut seen_gpus = HashSet::new();
        for (i, gpu) in self.gpus.iter().enumerate() {
            if !seen_gpus.insert(gpu) {
                return Err((
                    format!("backend.gpus[{i}]"),
                    format!("GPU {gpu} is listed twice"),
                ));
            }
        }
        Ok(())
    }
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

/// Checks the pod settings that Kubernetes would refuse only at creation.
pub(super) fn check_pod(p: &PodSpec) -> std::result::Result<(), (String, String)> {
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

impl Config {
    /// `backend.pass_env` names variables, and none of the gateway's own
    /// secrets; each `kubernetes.service_account` is one the backend
    /// settings allow.
    pub(super) fn validate_backend_access(&self) -> std::result::Result<(), (String, String)> {
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
}
