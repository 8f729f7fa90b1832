//! Serving apps: what runs, how it is probed, scaled, queued and promoted,
//! and the checks of each app.

use std::collections::{BTreeMap, HashSet};
use std::path::Path;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::backend::check_pod;
use super::names::{check_dns_label, check_model_name};
use super::{BackendKind, Config, PodSpec, bounded, defaults, resolve_checkpoint, resolve_command};
use crate::ScaleToZeroAfter;

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
    /// Where a local replica listens: `"socket"` (`$WARMGATE_SOCKET`, a
    /// Unix socket no other local user can reach), `"port"` (`$PORT` on
    /// loopback, which every local user can reach), or `"auto"`: the one
    /// the command names, else both offered and the socket preferred.
    pub listen: Listen,
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
    /// The paths of the app's own API that data-plane clients may call
    /// through `/apps/{app}/…` (each path and what lies below it); the
    /// rest needs the admin token. Empty: every path, except for an LLM
    /// engine (an app with `adapters` or `engine.metrics_path`), which
    /// passes its clients' routes only (`/v1/chat/completions`,
    /// `/v1/completions`, `/v1/embeddings`, `/tokenize`, `/health`, …).
    /// The engines' admin routes (`/reset_prefix_cache`, `/sleep`,
    /// `/collective_rpc`, SGLang's `/flush_cache`, …) always need it.
    pub passthrough: Vec<String>,
    /// Served by this warm pool's replicas instead of its own: requests go
    /// to the same processes that run the pool's tasks, under the pool's
    /// per-replica `concurrency`, on the pool's weights. Such an app has no
    /// `command`, `image`, `checkpoint` or `promotion.watch` of its own;
    /// the pool scales on both kinds of demand.
    pub pool: Option<String>,
}

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
            listen: Listen::default(),
            autoscale: AutoscaleSpec::default(),
            queue: QueueSpec::default(),
            promotion: PromotionSpec::default(),
            routing: crate::routing::RoutingSpec::default(),
            engine: crate::routing::EngineSpec::default(),
            adapters: crate::adapters::AdaptersSpec::default(),
            kubernetes: PodSpec::default(),
            pool: None,
            passthrough: Vec::new(),
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

/// Where a local replica listens (the local backend; a pod always listens
/// on its port).
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize, schemars::JsonSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum Listen {
    /// The one the command names (`$WARMGATE_SOCKET` or `$PORT`); a
    /// command that names neither is offered both, and a replica that
    /// binds the socket is reached there.
    #[default]
    Auto,
    /// A Unix socket at `$WARMGATE_SOCKET`, in a folder only the gateway's
    /// user may enter: no other local user can connect to the replica.
    /// vLLM takes it as `--uds $WARMGATE_SOCKET`.
    Socket,
    /// TCP on `127.0.0.1:$PORT`, which any local user can connect to.
    Port,
}

impl Listen {
    /// What a replica running `command` is offered: `Socket`, `Port`, or
    /// `Auto` for both.
    pub fn resolve(self, command: &[String]) -> Listen {
        if self != Listen::Auto {
            return self;
        }
        let names = |var: &str| {
            command
                .iter()
                .any(|w| w.contains(&format!("${var}")) || w.contains(&format!("${{{var}}}")))
        };
        if names("WARMGATE_SOCKET") {
            Listen::Socket
        } else if names("PORT") {
            Listen::Port
        } else {
            Listen::Auto
        }
    }
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

impl Default for QueueSpec {
    fn default() -> Self {
        QueueSpec {
            max_pending: defaults::MAX_PENDING,
            timeout: defaults::QUEUE_TIMEOUT,
        }
    }
}

/// The shortest `promotion.watch_interval`: each look lists the store
/// with the gateway's credentials, so a spec must not turn the watcher into
/// a busy loop; ten looks a second is already more than training needs.
const MIN_WATCH_INTERVAL: Duration = Duration::from_millis(100);

impl Config {
    /// The checks of `apps[i]`, in order; `names` holds the names and
    /// aliases of the apps before it, and gets this app's.
    pub(super) fn validate_app<'a>(
        &'a self,
        i: usize,
        app: &'a AppSpec,
        names: &mut HashSet<&'a str>,
    ) -> Result<(), (String, String)> {
        let at = |key: &str| format!("apps[{i}].{key}");
        check_names(app, &at, names)?;
        if let Some(pool) = &app.pool {
            return self.check_pool_served(i, app, pool);
        }
        self.check_runs_here(app, &at)?;
        app.autoscale
            .validate(&at, app.engine.metrics_path.is_some())?;
        if app.queue.timeout.is_zero() {
            return Err((at("queue.timeout"), "must be more than 0s".into()));
        }
        app.routing.validate(at)?;
        app.engine.validate(at)?;
        app.adapters.validate(at)?;
        app.promotion.validate(at)
    }

    /// What a replica of `app` needs to run on this backend: a command or
    /// an image, adapters it can read, its pod, environment, checkpoint,
    /// limit, GPUs, start-up grace, probes and a command that expands.
    fn check_runs_here(
        &self,
        app: &AppSpec,
        at: &impl Fn(&str) -> String,
    ) -> Result<(), (String, String)> {
        match self.backend.kind {
            BackendKind::Local if app.command.is_empty() => {
                return Err((
                    at("command"),
                    "is required for the local backend (e.g. command = [\"./my-worker\"])".into(),
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
        if self.backend.kind == BackendKind::Local && app.gpus as usize > self.backend.gpus.len() {
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
        Ok(())
    }
}

/// An app's own names (its name, aliases and adapters' names, each a
/// valid name and not already taken by an app before it, `names`) and its
/// passthrough paths.
fn check_names<'a>(
    app: &'a AppSpec,
    at: &impl Fn(&str) -> String,
    names: &mut HashSet<&'a str>,
) -> Result<(), (String, String)> {
    check_dns_label(&app.name).map_err(|m| (at("name"), m))?;
    for (j, p) in app.passthrough.iter().enumerate() {
        if !p.starts_with('/') {
            return Err((
                at(&format!("passthrough[{j}]")),
                format!("{p:?} is not a path: it must start with '/'"),
            ));
        }
    }
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
    Ok(())
}

impl AutoscaleSpec {
    /// Its checks; `at` names a key. Scaling on the engine's signals needs
    /// them read (`engine_metrics`).
    fn validate(
        &self,
        at: &impl Fn(&str) -> String,
        engine_metrics: bool,
    ) -> Result<(), (String, String)> {
        let a = self;
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
        if (a.target_waiting.is_some() || a.target_kv_cache_usage.is_some()) && !engine_metrics {
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
        Ok(())
    }
}

impl PromotionSpec {
    /// Its checks; `at` names a key.
    fn validate(&self, at: impl Fn(&str) -> String) -> Result<(), (String, String)> {
        let pr = self;
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
        Ok(())
    }
}
