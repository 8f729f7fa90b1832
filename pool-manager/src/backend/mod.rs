//! Backends start and stop replica processes. They all implement
//! [`Backend`]: [`LocalBackend`] runs them on this machine (`local.rs`),
//! [`kubernetes::KubeBackend`] as pods (`kubernetes/`).

use std::collections::BTreeMap;
use std::path::PathBuf;

use async_trait::async_trait;

use crate::Result;

pub mod kubernetes;
mod local;

pub use local::{BASE_ENV, LocalBackend, Orphan, exited, inherited, is_replica_process};

/// Everything a backend needs to start one replica.
#[derive(Debug, Clone)]
pub struct Launch {
    /// Replica id (`minilm-3`), also `WARMGATE_REPLICA`.
    pub replica: String,
    /// App or pool name, `WARMGATE_TARGET`.
    pub target: String,
    /// Revision, `WARMGATE_REVISION`.
    pub revision: String,
    /// Program and arguments.
    pub command: Vec<String>,
    /// Extra environment, applied before the `WARMGATE_*` variables.
    pub env: BTreeMap<String, String>,
    /// GPU ids for `CUDA_VISIBLE_DEVICES`.
    pub gpus: Vec<u32>,
    /// Working directory of the process.
    pub workdir: Option<PathBuf>,
    /// Checkpoint URI, `WARMGATE_CHECKPOINT`.
    pub checkpoint: Option<String>,
    /// Container image (kubernetes backend).
    pub image: Option<String>,
    /// Pod placement and resources (kubernetes backend).
    pub pod: warmgate_deploy::PodSpec,
    /// GPUs per replica (`nvidia.com/gpu` on kubernetes).
    pub gpu_count: u32,
    /// A pool's replica, not an app's.
    pub pool: bool,
    /// Its health probes (kubernetes backend: the pod's probes).
    pub health: warmgate_deploy::HealthSpec,
    /// Where it listens (local backend).
    pub listen: warmgate_deploy::Listen,
    /// Time allowed to become ready (kubernetes backend: the startup probe).
    pub startup_timeout: std::time::Duration,
}

/// A running replica process.
#[async_trait]
pub trait Process: Send {
    /// Where it listens.
    fn addr(&self) -> crate::Endpoint;
    /// Its process id, when it has one.
    fn pid(&self) -> Option<u32>;
    /// Where its output goes.
    fn log(&self) -> String;
    /// The last lines of its output, bounded and with its secrets
    /// redacted, when the backend keeps them here (the local backend).
    fn tail(&self) -> Option<String> {
        None
    }
    /// Waits until it exits; says how. Cancel-safe.
    async fn wait(&mut self) -> String;
    /// Asks it to stop (SIGTERM).
    fn terminate(&self);
    /// Stops it now (SIGKILL).
    fn kill(&self);
}

/// Starts replicas somewhere: local processes, or pods.
#[async_trait]
pub trait Backend: Send + Sync + 'static {
    /// Starts one replica. It is not ready yet: the caller probes it.
    async fn spawn(&self, launch: &Launch) -> Result<Box<dyn Process>>;

    /// Why a replica being started is waiting for capacity (an
    /// unschedulable pod), if it is.
    fn pending_reason(&self, _replica: &str) -> Option<String> {
        None
    }

    /// Whether it places GPUs itself (a cluster's scheduler), so this
    /// machine's GPU inventory does not apply.
    fn places_gpus(&self) -> bool {
        false
    }

    /// How many replicas an earlier run of the gateway left running that
    /// `launch` could take over instead of starting one (see
    /// [`interchangeable`]).
    fn adoptable(&self, _launch: &Launch) -> usize {
        0
    }

    /// Takes over one of those replicas for `launch`, if one is left. It
    /// is probed like a new one before it is routed to.
    fn adopt(&self, _launch: &Launch) -> Option<Adopted> {
        None
    }

    /// The replica's weights are about to be swapped in place: it will no
    /// longer run what it was started with, so a later run must not take
    /// it over as such. An error means it could not be marked (the swap
    /// should not go ahead).
    async fn weights_swapped(&self, _replica: &str) -> std::result::Result<(), String> {
        Ok(())
    }
}

/// A replica an earlier run left running, taken over instead of started.
pub struct Adopted {
    /// Its id: the name it was started with.
    pub replica: String,
    /// The environment it was started with (its weights token among it).
    pub env: BTreeMap<String, String>,
    /// The running replica.
    pub process: Box<dyn Process>,
}

/// Variables that belong to one replica or one revision's name, left out
/// of [`interchangeable`]: the replica's own token, and the weights URL,
/// which names the revision.
const NOT_INTERCHANGEABLE_ENV: &[&str] = &[
    "WARMGATE_WEIGHTS_TOKEN",
    "WARMGATE_WEIGHTS_URL",
    "WARMGATE_GATEWAY_URL",
];

/// What makes two replicas interchangeable, as a short digest: everything
/// a replica is started with (image, command, environment, checkpoint,
/// resources, probes) but its own id, its token and the revision's name.
/// A replica an earlier run left with the same digest runs the same model
/// with the same weights, so a new run can take it over.
pub fn interchangeable(launch: &Launch) -> String {
    use sha2::Digest as _;
    let env: BTreeMap<&String, &String> = launch
        .env
        .iter()
        .filter(|(k, _)| !NOT_INTERCHANGEABLE_ENV.contains(&k.as_str()))
        .collect();
    let what = serde_json::json!({
        "target": launch.target,
        "command": launch.command,
        "env": env,
        "checkpoint": launch.checkpoint,
        "image": launch.image,
        "pod": launch.pod,
        "gpus": launch.gpu_count,
        "pool": launch.pool,
        "health": launch.health,
    });
    let digest = sha2::Sha256::digest(what.to_string().as_bytes());
    digest.iter().take(8).map(|b| format!("{b:02x}")).collect()
}

/// The command with `$VAR` and `${VAR}` replaced from the worker's
/// environment, with no shell: a stock server takes `--port $PORT`.
pub fn expand_command(
    command: &[String],
    env: &BTreeMap<String, String>,
) -> std::result::Result<Vec<String>, String> {
    command
        .iter()
        .map(|word| {
            warmgate_deploy::expand::expand(word, |name| env.get(name).map(String::as_str))
                .map_err(|e| format!("cannot expand the command: {e}"))
        })
        .collect()
}

/// `CUDA_VISIBLE_DEVICES` for these GPUs. Empty hides every GPU, so a
/// replica that asked for none cannot grab one by accident.
pub fn gpu_list(gpus: &[u32]) -> String {
    gpus.iter()
        .map(u32::to_string)
        .collect::<Vec<_>>()
        .join(",")
}
