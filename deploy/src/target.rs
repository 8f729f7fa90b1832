//! The identity of a target: a set of interchangeable replicas the pool
//! manager keeps (an app's revision, a pool, a pool's on-demand fallback).
//!
//! Routing goes by the variant, never by parsing a name, so a pool named
//! like an app's revision cannot take its replicas. `Display` gives the
//! name replicas, pods, logs and metrics carry.

use std::fmt;

use serde::{Serialize, Serializer};

/// Which replicas a target holds.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum TargetId {
    /// An app's `seq`-th revision, named `{app}-{seq:05}`.
    Revision {
        /// The app.
        app: String,
        /// Order within the app, from 1.
        seq: u32,
    },
    /// A pool's replicas, named as the pool.
    Pool(String),
    /// An interruptible pool's on-demand fallback, named `{pool}-ondemand`.
    OnDemand(String),
}

/// What the on-demand target of a pool appends to its name.
pub const ONDEMAND_SUFFIX: &str = "-ondemand";

impl TargetId {
    /// An app's revision.
    pub fn revision(app: &str, seq: u32) -> Self {
        TargetId::Revision {
            app: app.to_string(),
            seq,
        }
    }

    /// The app or pool the target belongs to (`WARMGATE_TARGET`).
    pub fn owner(&self) -> &str {
        match self {
            TargetId::Revision { app, .. } => app,
            TargetId::Pool(p) | TargetId::OnDemand(p) => p,
        }
    }

    /// Whether its replicas run a pool's tasks rather than an app's requests.
    pub fn is_pool(&self) -> bool {
        !matches!(self, TargetId::Revision { .. })
    }

    /// The metric label that names its owner: `app` for an app's revision,
    /// `pool` for a pool and its on-demand fallback. One label name per
    /// concept, so a dashboard never mistakes a pool for an app.
    pub fn owner_label(&self) -> &'static str {
        if self.is_pool() { "pool" } else { "app" }
    }
}

impl fmt::Display for TargetId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TargetId::Revision { app, seq } => write!(f, "{app}-{seq:05}"),
            TargetId::Pool(p) => f.write_str(p),
            TargetId::OnDemand(p) => write!(f, "{p}{ONDEMAND_SUFFIX}"),
        }
    }
}

impl Serialize for TargetId {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_those_replicas_and_pods_carry() {
        assert_eq!(TargetId::revision("minilm", 2).to_string(), "minilm-00002");
        assert_eq!(TargetId::Pool("rl".into()).to_string(), "rl");
        assert_eq!(TargetId::OnDemand("rl".into()).to_string(), "rl-ondemand");
        assert_eq!(TargetId::revision("a", 123_456).to_string(), "a-123456");
    }

    #[test]
    fn a_pool_named_like_a_revision_is_another_target() {
        let rev = TargetId::revision("minilm", 1);
        let pool = TargetId::Pool("minilm-00001".into());
        assert_eq!(rev.to_string(), pool.to_string());
        assert_ne!(rev, pool);
        assert_eq!(rev.owner(), "minilm");
        assert_eq!(pool.owner(), "minilm-00001");
        assert!(pool.is_pool() && !rev.is_pool());
        assert!(TargetId::OnDemand("p".into()).is_pool());
        assert_eq!(rev.owner_label(), "app");
        assert_eq!(pool.owner_label(), "pool");
        assert_eq!(TargetId::OnDemand("p".into()).owner_label(), "pool");
    }
}
