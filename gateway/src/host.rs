//! The gateway as a process: the config it runs, its clock, where its
//! workers reach it, their working folder, whether it is draining, and
//! its metrics exporter. Shared, read-only but for the drain flag, by
//! every service that needs one of these.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use warmgate_deploy::Config;

/// What every service may know of the process it runs in.
pub struct Host {
    /// The config it runs (the file's, with the changes made through the
    /// API laid over it at start).
    pub(crate) config: Arc<Config>,
    /// When it started: the autoscaler's and the dispatchers' clock.
    pub(crate) started: Instant,
    /// Where workers reach the gateway (`host:port`).
    pub(crate) reach: String,
    /// The workers' working directory.
    pub(crate) workdir: Option<PathBuf>,
    /// Set once it stops taking traffic.
    draining: AtomicBool,
    /// What `/metrics` renders, when metrics are on.
    pub(crate) metrics: Option<metrics_exporter_prometheus::PrometheusHandle>,
}

impl Host {
    /// A process started now.
    pub(crate) fn new(
        config: Config,
        reach: String,
        workdir: Option<PathBuf>,
        metrics: Option<metrics_exporter_prometheus::PrometheusHandle>,
    ) -> Host {
        Host {
            config: Arc::new(config),
            started: Instant::now(),
            reach,
            workdir,
            draining: AtomicBool::new(false),
            metrics,
        }
    }

    /// Time since start.
    pub(crate) fn now(&self) -> Duration {
        self.started.elapsed()
    }

    /// Stops taking traffic: `/readyz` fails and the autoscaler stops.
    pub(crate) fn start_draining(&self) {
        self.draining.store(true, Ordering::Release);
    }

    /// Whether it has stopped taking traffic.
    pub(crate) fn draining(&self) -> bool {
        self.draining.load(Ordering::Acquire)
    }

    /// `http://{reach}/v1/weights/{owner}/{revision}`: where a worker
    /// streams a revision's weights from.
    pub(crate) fn weights_url(&self, owner: &str, revision: &str) -> String {
        format!("http://{}/v1/weights/{owner}/{revision}", self.reach)
    }
}
