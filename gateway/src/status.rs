//! What `/v1/status` shows, as types: the gateway builds them, the HTTP
//! edge renders them and the operator reads them, with no JSON between.

use serde::Serialize;
use warmgate_deploy::revision::Promotion;
use warmgate_pool::TargetStatus;

use crate::tenants::TenantStatus;

/// The whole `/v1/status` document.
#[derive(Debug, Clone, Serialize)]
pub struct GatewayStatus {
    /// Apps, in config order.
    pub apps: Vec<AppStatus>,
    /// Pools, by name.
    pub pools: Vec<PoolStatus>,
    /// Tenants with their quotas and use (empty when the data plane is open).
    pub tenants: Vec<TenantStatus>,
    /// The apps and pools changed through the API (`app NAME`, `pool NAME`,
    /// `(deleted)`): kept over the config file at the next start, until
    /// the file is applied (`warmgate apply`, SIGHUP) or the gateway
    /// starts with `--config-wins`.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub api_changes: Vec<String>,
}

/// One app in `/v1/status`.
#[derive(Debug, Clone, Default, Serialize)]
pub struct AppStatus {
    /// Name.
    pub name: String,
    /// Other `model` names.
    pub aliases: Vec<String>,
    /// Revision served.
    pub revision: String,
    /// Replicas asked for.
    pub desired: u32,
    /// Replicas taking traffic.
    pub ready: usize,
    /// Requests in flight.
    pub inflight: u32,
    /// Requests held.
    pub queued: usize,
    /// Ready replicas × concurrency.
    pub capacity: u32,
    /// Per-replica limit.
    pub concurrency: u32,
    /// Queue bound.
    pub max_pending: u32,
    /// Fewest replicas.
    pub min: u32,
    /// Most replicas.
    pub max: u32,
    /// The gateway's share of the last cold start, in milliseconds.
    pub handoff_ms: Option<f64>,
    /// How long it may stay idle before its last replica goes, in
    /// seconds: the config's duration, or what `"auto"` has learned (a
    /// minute until it knows); absent when `min` keeps replicas.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub scale_to_zero_after_s: Option<f64>,
    /// Replicas and their lifecycle (the serving revision's).
    pub pool: Option<TargetStatus>,
    /// Every live revision, with its share of the traffic.
    pub revisions: Vec<RevisionStatus>,
    /// The last promotion.
    pub promotion: Option<Promotion>,
    /// Times the checkpoint watcher has looked (when it is on).
    pub watch_scans: Option<u64>,
    /// The warm pool whose replicas serve it (`[[apps]] pool`); its
    /// figures above are then the pool's, requests only.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub served_by: Option<String>,
    /// Its LoRA adapters and the replicas holding each loaded.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub adapters: Vec<AdapterStatus>,
}

/// One adapter of an app in `/v1/status`.
#[derive(Debug, Clone, Default, Serialize)]
pub struct AdapterStatus {
    /// The model name requests use.
    pub name: String,
    /// Other names requests may use.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub aliases: Vec<String>,
    /// The revision serving (the engine holds revision n > 1 as `name@n`).
    pub revision: u32,
    /// Its checkpoint.
    pub checkpoint: String,
    /// Replicas (of every live revision) that hold it loaded.
    pub replicas: Vec<String>,
    /// Requests routed to it (any revision) since the gateway started.
    pub requests: u64,
    /// Its promotion: the running one, else the last that ended.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub promotion: Option<AdapterPromotionStatus>,
}

/// An adapter's promotion in `/v1/status`.
#[derive(Debug, Clone, Serialize)]
pub struct AdapterPromotionStatus {
    /// The promotion: revisions, phase, share, the canary's answers.
    #[serde(flatten)]
    pub promotion: warmgate_deploy::adapter_promotion::AdapterPromotion,
    /// Replicas holding the new revision loaded.
    pub replicas: Vec<String>,
}

/// One live revision in `/v1/status`.
#[derive(Debug, Clone, Default, Serialize)]
pub struct RevisionStatus {
    /// Revision id.
    pub id: String,
    /// Percent of the app's traffic.
    pub traffic: u8,
    /// Replicas taking traffic.
    pub ready: usize,
    /// Replicas asked for.
    pub desired: u32,
    /// Requests in flight.
    pub inflight: u32,
    /// Requests held.
    pub queued: usize,
    /// Its replicas.
    pub replicas: Vec<warmgate_pool::ReplicaStatus>,
}

/// One pool in `/v1/status`.
#[derive(Debug, Clone, Default, Serialize)]
pub struct PoolStatus {
    /// Name.
    pub name: String,
    /// Tasks waiting.
    pub pending: usize,
    /// Tasks running.
    pub inflight: u32,
    /// Replicas taking tasks.
    pub ready: usize,
    /// Fewest replicas.
    pub min: u32,
    /// Most replicas.
    pub max: u32,
    /// Tasks per replica.
    pub concurrency: u32,
    /// The newest weights version synced into the pool.
    pub weights_version: u64,
    /// The version a sync in progress rolls out.
    pub syncing_to: Option<u64>,
    /// Versions a task may lag behind the newest.
    pub max_staleness: Option<u64>,
    /// Tasks on their last try waiting for an on-demand replica.
    pub ondemand_waiting: usize,
    /// Stopped entirely after `suspend_after` of idleness; the next task
    /// wakes it.
    pub suspended: bool,
    /// Requests of the app it serves (`[[apps]] pool`) waiting for a slot.
    pub requests_waiting: usize,
    /// Those running on its replicas.
    pub requests_inflight: u32,
    /// Its replicas and their lifecycle.
    pub pool: Option<TargetStatus>,
    /// The on-demand fallback's replicas (interruptible pools only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ondemand: Option<TargetStatus>,
}
