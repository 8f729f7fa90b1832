//! warmgate's pool manager: the lifecycle of replicas.
//!
//! A *target* is an app (or, later, a pool) with a replica spec. The pool
//! manager keeps each target at the replica count it is told to have:
//! it starts replicas through a [`Backend`], probes them until they are
//! ready, tells the gateway through a [`ReplicaSink`] when a replica can take
//! traffic and when it must stop taking it, restarts replicas that crash
//! (with backoff), hands out GPUs so that no two replicas share one, and
//! drains replicas before stopping them.
//!
//! It does not decide how many replicas a target needs (that is the
//! autoscaler's job) and it never routes user traffic.

#![warn(missing_docs)]

pub mod backend;
pub mod endpoint;
pub mod engine;
pub mod gpu;
pub mod logs;
mod manager;
pub mod peer;
pub mod probe;
pub mod replica;
pub mod weights;

pub use backend::{
    Adopted, Backend, Launch, LocalBackend, Orphan, Process, interchangeable, kubernetes,
};
pub use endpoint::Endpoint;
pub use gpu::GpuInventory;
pub use manager::{
    CRASH_LOOP_AFTER, PoolManager, ReplicaCounts, ReplicaSink, TargetHealth, TargetSpec,
    TargetStatus,
};
pub use replica::{ReplicaHandle, ReplicaState, ReplicaStatus};

use std::path::PathBuf;
use std::time::Duration;

/// Errors of the pool manager. Variants are named after the step that failed.
#[derive(Debug, Clone, thiserror::Error)]
pub enum Error {
    /// The worker process could not be started.
    #[error("could not start {program:?}: {reason}")]
    SpawnFailed {
        /// The program that was run.
        program: String,
        /// Why it failed (from the operating system).
        reason: String,
    },
    /// The replica's log file could not be opened.
    #[error("could not open the log file {path:?}: {reason}")]
    LogFile {
        /// The log file.
        path: PathBuf,
        /// Why it failed.
        reason: String,
    },
    /// No free local port could be found for the worker.
    #[error("could not find a free port: {0}")]
    NoFreePort(String),
    /// The worker exited before it answered `/healthz` with 200.
    #[error("the worker {exit} before it became ready{}", last_output(.output, .log))]
    ExitedBeforeReady {
        /// How it exited (`exited with status 1`).
        exit: String,
        /// Where its output is.
        log: String,
        /// The last lines of its output, when the backend has them.
        output: Option<String>,
    },
    /// A checkpoint could not be read, or is not what it claims to be.
    #[error("{uri}: {reason}")]
    Weights {
        /// The object or prefix.
        uri: String,
        /// What is wrong.
        reason: String,
    },
    /// The local weight cache could not be read or written.
    #[error("weight cache {path:?}: {reason}")]
    Cache {
        /// The file or folder.
        path: PathBuf,
        /// What failed.
        reason: String,
    },
    /// The worker did not answer its health path with a ready status
    /// within `startup_timeout`.
    #[error("the worker did not become ready within {after:?}; last probe: {last}{}", last_output(.output, .log))]
    StartupTimeout {
        /// The startup timeout.
        after: Duration,
        /// What the last probe of the health path saw.
        last: String,
        /// Where its output is.
        log: String,
        /// The last lines of its output, when the backend has them.
        output: Option<String>,
    },
}

impl Error {
    /// The error in brief, without the worker's output or where it is:
    /// what a client of the data plane is told. Another tenant's request
    /// text, a port or a secret the worker printed stays with the admins
    /// (status, `warmgate logs`).
    pub fn summary(&self) -> String {
        match self {
            Error::SpawnFailed { .. } => "the worker's program could not be started".into(),
            Error::LogFile { .. } | Error::Cache { .. } | Error::NoFreePort(_) => {
                "the gateway could not prepare the replica".into()
            }
            Error::ExitedBeforeReady { exit, .. } => {
                format!("the worker {exit} before it became ready")
            }
            Error::Weights { .. } => "its checkpoint could not be read".into(),
            Error::StartupTimeout { after, .. } => {
                format!("the worker did not become ready within {after:?}")
            }
        }
    }
}

/// What an error says of a replica's output: its last lines when the
/// backend has them (so the cause reaches whoever reads the error), or
/// where to read it (`kubectl logs ...`).
pub fn last_output(output: &Option<String>, log: &str) -> String {
    match output {
        Some(text) => format!("; its last output:\n{}", indent(text)),
        None if log.is_empty() => String::new(),
        None => format!(" (log: {log})"),
    }
}

fn indent(text: &str) -> String {
    text.lines()
        .map(|l| format!("  {l}"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// The result type of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;
