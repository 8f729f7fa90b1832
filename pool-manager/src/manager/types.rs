//! The pool manager's public data types: how to run a target's replicas
//! ([`TargetSpec`]) and what it reports of them ([`TargetHealth`],
//! [`TargetStatus`], [`ColdStart`]).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use serde::Serialize;
use warmgate_deploy::TargetId;

use crate::replica::ReplicaStatus;

/// How to run the replicas of one app or pool.
#[derive(Debug, Clone)]
pub struct TargetSpec {
    /// Which replicas these are; `id.owner()` is `WARMGATE_TARGET` for
    /// its workers.
    pub id: TargetId,
    /// How readiness and liveness are probed.
    pub health: warmgate_deploy::HealthSpec,
    /// Where a local replica listens.
    pub listen: warmgate_deploy::Listen,
    /// Where the engine's own load is read (apps only).
    pub engine: warmgate_deploy::EngineSpec,
    /// Revision its replicas serve.
    pub revision: String,
    /// Program and arguments.
    pub command: Vec<String>,
    /// Extra environment.
    pub env: BTreeMap<String, String>,
    /// Checkpoint URI, passed to the worker.
    pub checkpoint: Option<String>,
    /// Working directory of the workers.
    pub workdir: Option<PathBuf>,
    /// Requests in flight per replica.
    pub concurrency: u32,
    /// GPUs per replica.
    pub gpus: u32,
    /// Time allowed to become ready.
    pub startup_timeout: Duration,
    /// Time between SIGTERM and SIGKILL (also the drain budget).
    pub stop_grace: Duration,
    /// Container image (kubernetes backend).
    pub image: Option<String>,
    /// Pod placement and resources (kubernetes backend).
    pub pod: warmgate_deploy::PodSpec,
}

/// A target's replicas in brief: what the gateway needs to decide whether a
/// request can wait for capacity.
#[derive(Debug, Clone, Default, Serialize)]
pub struct TargetHealth {
    /// Replicas taking traffic.
    pub ready: usize,
    /// Replicas started and being probed.
    pub starting: usize,
    /// Replicas waiting for resources.
    pub pending: usize,
    /// Set when the target keeps failing to start and waits before the next
    /// try: how long until it (in seconds, as JSON).
    #[serde(serialize_with = "seconds")]
    pub retry_in: Option<Duration>,
    /// The last start or crash error, with the worker's last output: for
    /// admins (`/v1/status`).
    pub last_error: Option<String>,
    /// The same in brief, without the worker's output, naming the replica:
    /// what the data plane's clients are told.
    pub last_failure: Option<String>,
    /// True when the latest attempts failed before becoming ready.
    pub failing_to_start: bool,
    /// Failed starts and crashes in a row.
    pub failures: u32,
    /// [`CRASH_LOOP_AFTER`](super::CRASH_LOOP_AFTER) failures in a row and
    /// no replica ready since: Kubernetes' `CrashLoopBackOff`. A request or
    /// task is answered at once with `last_error` while the backoff runs,
    /// and the next start waits for one to ask again.
    pub crash_loop: bool,
}

/// A duration as a number of seconds (`1.5`), not serde's
/// `{"secs", "nanos"}`.
fn seconds<S: serde::Serializer>(d: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
    match d {
        Some(d) => s.serialize_some(&d.as_secs_f64()),
        None => s.serialize_none(),
    }
}

/// The phases of the last cold start of a target.
#[derive(Debug, Clone, Serialize)]
pub struct ColdStart {
    /// The replica that started.
    pub replica: String,
    /// Seconds from asking the backend to start the process until it ran.
    pub spawn_seconds: f64,
    /// Seconds from the process running until `/healthz` answered 200.
    pub ready_seconds: f64,
    /// Of those, the seconds the worker says it spent loading weights
    /// (`weights_seconds` in its `/healthz`), when it says.
    pub weights_seconds: Option<f64>,
    /// Unix time it became ready.
    pub at_unix: f64,
}

/// One target in a status report.
#[derive(Debug, Clone, Serialize)]
pub struct TargetStatus {
    /// Which target.
    #[serde(skip)]
    pub id: TargetId,
    /// Target name: a pool's name, or an app revision's id.
    pub name: String,
    /// The app or pool it belongs to.
    pub app: String,
    /// Revision served.
    pub revision: String,
    /// Replica count asked for.
    pub desired: u32,
    /// Replicas, in start order.
    pub replicas: Vec<ReplicaStatus>,
    /// Replicas replaced after a crash or a failed start.
    pub restarts: u64,
    /// Brief health.
    pub health: TargetHealth,
    /// The last cold start.
    pub last_cold_start: Option<ColdStart>,
}

/// How many of a target's replicas are in each state: what the gateway
/// charts every second, without the rest of a [`TargetStatus`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReplicaCounts {
    /// Waiting for resources: GPUs here, or a place in the cluster.
    pub pending: u32,
    /// Started, not yet answering its health check.
    pub starting: u32,
    /// Taking traffic.
    pub ready: u32,
    /// Finishing what it has before it stops.
    pub draining: u32,
    /// Of `pending`, those the backend cannot place (an unschedulable pod).
    pub unschedulable: u32,
}
