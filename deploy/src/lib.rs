//! warmgate's declarative model: the config schema and the app specs.
//!
//! The config is TOML (see `INTERFACE.md`). Every struct here denies unknown
//! keys, has an explicit `Default` whose values are named constants with the
//! reason for each, and is checked by [`Config::validate`] before anything
//! starts, so a typo fails fast with the key and the file named.

#![warn(missing_docs)]

pub mod adapter_promotion;
pub mod adapters;
pub mod admin_token;
mod config;
pub mod crd;
pub mod expand;
pub mod private_dir;
pub mod reference;
pub mod revision;
pub mod routing;
mod scale_to_zero;
pub mod store;
mod target;

pub use adapters::{AdapterSpec, AdaptersSpec};
pub use config::{
    AccessConfig, AppSpec, AutoscaleSpec, BackendConfig, BackendKind, Config, Fairness, HealthSpec,
    KubeBackendConfig, LimitsConfig, Listen, NodeRequirement, OperatorConfig, PodSpec,
    PoolQueueSpec, PoolSpec, PromotionSpec, QueueSpec, SecretKey, TenantSpec, TlsConfig,
    Toleration, VolumeSpec, WeightSync, WeightsConfig, check_dns_label, defaults, parse_size,
    resolve_checkpoint,
};
pub use routing::{EngineMetricNames, EngineSpec, RoutingPolicy, RoutingSpec};
pub use scale_to_zero::ScaleToZeroAfter;
pub use target::{ONDEMAND_SUFFIX, TargetId};

use std::path::PathBuf;

/// A config that could not be read, parsed or validated.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The file could not be read.
    #[error("{file}: cannot read the config: {source}")]
    Read {
        /// The config file.
        file: PathBuf,
        /// Why reading failed.
        source: std::io::Error,
    },
    /// The file is not valid TOML, or a key has the wrong type or is unknown.
    #[error("{file}: {key}: {message}")]
    Parse {
        /// The config file.
        file: PathBuf,
        /// The dotted path of the offending key (`apps[0].autoscale.min`).
        key: String,
        /// What is wrong with it.
        message: String,
    },
    /// The file parsed, but a value is out of range or inconsistent.
    #[error("{file}: {key}: {message}")]
    Invalid {
        /// The config file.
        file: PathBuf,
        /// The dotted path of the offending key.
        key: String,
        /// What is wrong with it.
        message: String,
    },
}

impl Error {
    /// The dotted path of the offending key, when there is one.
    pub fn key(&self) -> Option<&str> {
        match self {
            Error::Read { .. } => None,
            Error::Parse { key, .. } | Error::Invalid { key, .. } => Some(key),
        }
    }
}

/// The result type of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;
