//! The custom resources: `ServingApp` and `WarmPool`. Their spec is the
//! config file's `[[apps]]` and `[[pools]]` entry, the very same types, so
//! a TOML app definition moves to a cluster unchanged (`metadata.name`
//! takes the place of `name`). The status subresource carries replicas by
//! state, revisions with their traffic, and conditions.

use kube::CustomResourceExt as _;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

pub use crate::config::{PoolSpec, ServingApp, WarmPool};

/// Replicas by state.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ReplicaCounts {
    /// Taking traffic.
    pub ready: u32,
    /// Started, not ready yet.
    pub starting: u32,
    /// Waiting for capacity (unschedulable pods).
    pub pending: u32,
    /// What the autoscaler wants.
    pub desired: u32,
}

/// One revision's share of an app's traffic.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RevisionTraffic {
    /// Revision id (`app-00002`).
    pub id: String,
    /// Checkpoint URI.
    pub checkpoint: Option<String>,
    /// Percent of traffic.
    pub traffic: u8,
    /// Ready replicas.
    pub ready: u32,
}

/// A condition, as Kubernetes objects report them.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Condition {
    /// `Ready`, `Progressing`, `Unschedulable`, …
    #[serde(rename = "type")]
    pub type_: String,
    /// `True`, `False` or `Unknown`.
    pub status: String,
    /// One CamelCase word.
    pub reason: String,
    /// For people.
    pub message: String,
    /// RFC 3339.
    pub last_transition_time: String,
}

/// What the operator reports of a `ServingApp`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ServingAppStatus {
    /// Replicas by state, over every revision.
    pub replicas: ReplicaCounts,
    /// The revision serving (most of) the traffic.
    pub revision: Option<String>,
    /// Every live revision with its traffic.
    pub revisions: Vec<RevisionTraffic>,
    /// The last promotion: the revision it promoted, where it is, and why
    /// it ended so when it failed or rolled back.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub promotion: Option<PromotionState>,
    /// Conditions.
    pub conditions: Vec<Condition>,
    /// The spec generation this status describes.
    pub observed_generation: Option<i64>,
}

/// Where an app's last promotion is.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PromotionState {
    /// The revision it promotes.
    pub revision: String,
    /// `warming`, `canary`, `done`, `rolled_back` or `failed`.
    pub phase: String,
    /// Why it rolled back or failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// Whether it swaps the weights into the serving replicas.
    #[serde(default)]
    pub in_place: bool,
}

/// What the operator reports of a `WarmPool`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct WarmPoolStatus {
    /// Replicas by state.
    pub replicas: ReplicaCounts,
    /// The latest weights version synced.
    pub weights_version: u64,
    /// Tasks waiting.
    pub pending_tasks: u64,
    /// Conditions.
    pub conditions: Vec<Condition>,
    /// The spec generation this status describes.
    pub observed_generation: Option<i64>,
}

/// Both CustomResourceDefinitions, as the YAML `warmgate crds` prints and
/// `deploy/kubernetes/chart/warmgate/crds/crds.yaml` holds.
pub fn crds_yaml() -> Result<String, String> {
    let mut out = String::new();
    for crd in [ServingApp::crd(), WarmPool::crd()] {
        out.push_str("---\n");
        let yaml = serde_saphyr::to_string(&crd)
            .map_err(|e| format!("the {} CRD does not serialise: {e}", crd.spec.names.kind))?;
        out.push_str(&yaml);
    }
    Ok(out)
}
