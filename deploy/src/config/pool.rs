//! Warm pools of task workers: their spec, task queue and fairness, and
//! the checks of each pool and of the apps they serve.

use std::collections::{BTreeMap, HashSet};
use std::path::Path;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::backend::check_pod;
use super::names::{check_dns_label, is_revision_of};
use super::{
    AppSpec, BackendKind, Config, HealthSpec, PodSpec, bounded, defaults, resolve_checkpoint,
    resolve_command,
};

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
    /// Where a local replica listens (see `[[apps]] listen`).
    pub listen: super::app::Listen,
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
    /// How a replica takes new weights in place: `"worker"` (the worker
    /// contract's `POST /weights`, which the kits serve) or `"vllm"`
    /// (stock vLLM started with `VLLM_SERVER_DEV_MODE=1`: its
    /// `reload_weights` RPC reads the checkpoint from a folder on this
    /// machine, then its prefix cache is reset and its weight version set).
    pub weight_sync: WeightSync,
    /// Pod settings (kubernetes backend).
    pub kubernetes: PodSpec,
    /// When an app is served by this pool (`[[apps]] pool = ...`) and both
    /// its requests and tasks wait: the share of each replica's slots its
    /// requests are sure of (rounded up), the rest being the tasks'. A slot
    /// the other kind does not want goes to whichever waits, so `1.0` gives
    /// requests priority and `0.0` gives tasks priority.
    pub inference_share: f64,
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
            listen: super::app::Listen::default(),
            retries: defaults::TASK_RETRIES,
            task_timeout: defaults::TASK_TIMEOUT,
            queue: PoolQueueSpec::default(),
            max_staleness: None,
            weight_sync_timeout: defaults::WEIGHT_SYNC_TIMEOUT,
            weight_sync: WeightSync::default(),
            kubernetes: PodSpec::default(),
            inference_share: defaults::INFERENCE_SHARE,
        }
    }
}

/// How a pool's replicas take new weights in place.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize, schemars::JsonSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum WeightSync {
    /// `POST /weights {"url", "version"}`: the worker fetches the files
    /// from the gateway (the Python kit, the Rust examples).
    #[default]
    Worker,
    /// Stock vLLM with `VLLM_SERVER_DEV_MODE=1`: `POST /collective_rpc`
    /// `reload_weights` with the checkpoint's folder (a `file://` one as it
    /// is, an object-store one pulled into `state_dir` first), then
    /// `POST /reset_prefix_cache` and `POST /update_weight_version`. The
    /// local backend only: the folder is on this machine.
    Vllm,
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

impl Config {
    /// The checks of `pools[i]`, in order; `names` holds the names of the
    /// apps and of the pools before it, and gets this pool's.
    pub(super) fn validate_pool<'a>(
        &'a self,
        i: usize,
        pool: &'a PoolSpec,
        names: &mut HashSet<&'a str>,
    ) -> Result<(), (String, String)> {
        let at = |key: &str| format!("pools[{i}].{key}");
        self.check_pool_name(pool, &at, names)?;
        self.check_pool_runs_here(pool, &at)?;
        self.check_pool_settings(pool, &at)
    }

    /// A pool's name: a DNS label no app or pool before it has, that no
    /// app's revision runs as, and whose on-demand fallback's name (when it
    /// is interruptible) is free.
    fn check_pool_name<'a>(
        &'a self,
        pool: &'a PoolSpec,
        at: &impl Fn(&str) -> String,
        names: &mut HashSet<&'a str>,
    ) -> Result<(), (String, String)> {
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
        Ok(())
    }

    /// What a pool's replicas need to run on this backend, and the name an
    /// interruptible pool's on-demand replicas run as (room for it, free).
    fn check_pool_runs_here(
        &self,
        pool: &PoolSpec,
        at: &impl Fn(&str) -> String,
    ) -> Result<(), (String, String)> {
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
        if pool.weight_sync == WeightSync::Vllm && self.backend.kind == BackendKind::Kubernetes {
            return Err((
                at("weight_sync"),
                "\"vllm\" reads the checkpoint from a folder on the gateway's machine, which a pod \
                 does not see: the local backend only"
                    .into(),
            ));
        }
        if pool.kubernetes.interruptible {
            // Its on-demand replicas run as `<name>-ondemand`.
            let od = format!("{}-ondemand", pool.name);
            if od.len() > 63 {
                return Err((
                    at("name"),
                    "an interruptible pool's name must leave room for \"-ondemand\" (54 characters at most)".into(),
                ));
            }
            if self.apps.iter().any(|a| a.name == od) || self.pools.iter().any(|p| p.name == od) {
                return Err((
                    at("name"),
                    format!(
                        "{od:?} is taken, and this interruptible pool needs it for its on-demand replicas"
                    ),
                ));
            }
        }
        Ok(())
    }

    /// A pool's own settings: its replica bounds, limit, spares, GPUs,
    /// timeouts, probes, command, queue and inference share.
    fn check_pool_settings(
        &self,
        pool: &PoolSpec,
        at: &impl Fn(&str) -> String,
    ) -> Result<(), (String, String)> {
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
        if self.backend.kind == BackendKind::Local && pool.gpus as usize > self.backend.gpus.len() {
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
        Ok(())
    }
}

impl Config {
    /// An app served by a pool's replicas (`apps[i].pool`): the pool
    /// exists, serves no other app, and the app sets nothing that only its
    /// own replicas would use.
    pub(super) fn check_pool_served(
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
}
