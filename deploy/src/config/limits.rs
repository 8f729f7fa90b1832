//! Limits of the data plane's requests, and how checkpoints are streamed
//! and cached: their settings and checks.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::{bounded, defaults, size};

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
    /// Bytes of the usage ledger (tokens per tenant, app, model and hour)
    /// on disk; the oldest hours are dropped past it.
    #[serde(with = "size")]
    #[schemars(with = "size::Size")]
    pub max_usage_bytes: u64,
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

impl Default for LimitsConfig {
    fn default() -> Self {
        LimitsConfig {
            max_body_bytes: defaults::MAX_BODY_BYTES,
            max_task_body_bytes: defaults::MAX_TASK_BODY_BYTES,
            max_pending_task_bytes: defaults::MAX_PENDING_TASK_BYTES,
            max_buffered_body_bytes: defaults::MAX_BUFFERED_BODY_BYTES,
            max_task_results_bytes: defaults::MAX_TASK_RESULTS_BYTES,
            max_journal_bytes: defaults::MAX_JOURNAL_BYTES,
            max_usage_bytes: defaults::MAX_USAGE_BYTES,
            max_connections: defaults::MAX_CONNECTIONS,
            header_read_timeout: defaults::HEADER_READ_TIMEOUT,
            idle_timeout: defaults::IDLE_TIMEOUT,
            request_timeout: defaults::REQUEST_TIMEOUT,
        }
    }
}

impl LimitsConfig {
    /// Every bound is above zero, and one body of the largest size fits
    /// the buffered-bytes budget.
    pub(super) fn validate(&self) -> Result<(), (String, String)> {
        for (key, n) in [
            ("max_body_bytes", self.max_body_bytes),
            ("max_task_body_bytes", self.max_task_body_bytes),
            ("max_pending_task_bytes", self.max_pending_task_bytes),
            ("max_buffered_body_bytes", self.max_buffered_body_bytes),
            ("max_task_results_bytes", self.max_task_results_bytes),
            ("max_journal_bytes", self.max_journal_bytes),
            ("max_usage_bytes", self.max_usage_bytes),
        ] {
            if n == 0 {
                return Err((format!("limits.{key}"), "must be at least 1".into()));
            }
        }
        // One body at the largest size must fit, and the count of bytes is
        // kept in a semaphore, whose permits a u32 counts per request.
        // Bodies being read hold their bytes in the same budget.
        if self.max_buffered_body_bytes < self.max_body_bytes.max(self.max_task_body_bytes) {
            return Err((
                "limits.max_buffered_body_bytes".into(),
                "must be at least limits.max_body_bytes and limits.max_task_body_bytes".into(),
            ));
        }
        for (key, n) in [
            ("max_body_bytes", self.max_body_bytes),
            ("max_task_body_bytes", self.max_task_body_bytes),
        ] {
            if n > u64::from(u32::MAX) {
                return Err((format!("limits.{key}"), "must be at most 4 GiB".into()));
            }
        }
        if self.max_connections == 0 {
            return Err(("limits.max_connections".into(), "must be at least 1".into()));
        }
        for (key, d) in [
            ("header_read_timeout", self.header_read_timeout),
            ("idle_timeout", self.idle_timeout),
            ("request_timeout", self.request_timeout),
        ] {
            if d.is_zero() {
                return Err((format!("limits.{key}"), "must be longer than 0s".into()));
            }
        }
        Ok(())
    }
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
    /// the checkpoints named in this file (each app's, adapter's and
    /// pool's `checkpoint`) and the prefixes it watches (the apps'
    /// `promotion.watch`, the adapters' `watch`). A pool's weight syncs
    /// name checkpoints the file does not: list their prefix here.
    pub allowed_prefixes: Option<Vec<String>>,
}

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

impl WeightsConfig {
    /// The allowed prefixes are URI prefixes and parts are not empty.
    /// (`concurrency` is checked first, by `Config::validate`.)
    pub(super) fn validate(&self) -> Result<(), (String, String)> {
        for (i, p) in self.allowed_prefixes.iter().flatten().enumerate() {
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
        if self.part_size_bytes == 0 {
            return Err((
                "weights.part_size_bytes".into(),
                "must be at least 1".into(),
            ));
        }
        Ok(())
    }
}
