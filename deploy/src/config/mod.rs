//! The TOML config: typed structs, defaults and validation.

mod app;
mod backend;
pub(crate) mod bounded;
pub mod defaults;
mod limits;
mod names;
mod pool;
mod server;
pub(crate) mod size;
mod tenants;

pub use app::{AppSpec, AutoscaleSpec, HealthSpec, Listen, PromotionSpec, QueueSpec, ServingApp};
pub use backend::{
    BackendConfig, BackendKind, KubeBackendConfig, NodeRequirement, PodSpec, SecretKey, Toleration,
    VolumeSpec,
};
pub use limits::{LimitsConfig, WeightsConfig};
pub use names::{check_dns_label, check_model_name};
pub use pool::{Fairness, PoolQueueSpec, PoolSpec, WarmPool, WeightSync};
pub use server::{AccessConfig, OperatorConfig, TlsConfig};
pub use tenants::TenantSpec;

use std::collections::HashSet;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::{Error, Result};

/// The whole config file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    /// Address the gateway listens on.
    pub listen: SocketAddr,
    /// SQLite state, weight cache and replica logs. Relative paths are
    /// resolved against the config file's folder.
    pub state_dir: PathBuf,
    /// Where replicas run.
    pub backend: BackendConfig,
    /// Request limits of the data plane.
    pub limits: LimitsConfig,
    /// How checkpoints are read and cached.
    pub weights: WeightsConfig,
    /// Serving apps.
    pub apps: Vec<AppSpec>,
    /// Warm pools for tasks (RL rollouts).
    pub pools: Vec<PoolSpec>,
    /// Data-plane API keys, one tenant each; none: the data plane is open.
    pub tenants: Vec<TenantSpec>,
    /// What `warmgate operator` accepts from `ServingApp` and `WarmPool`
    /// resources (ignored by `serve`, whose file is trusted as a whole).
    pub operator: OperatorConfig,
    /// HTTPS on `listen`: a certificate chain and its key, reloaded on
    /// SIGHUP. Unset: plain HTTP.
    pub tls: Option<TlsConfig>,
    /// Who may reach what: the `Host` names served, and whether
    /// `/metrics` and `/openapi.json` need the admin token.
    pub access: AccessConfig,
    /// The config file's folder, against which its relative paths were
    /// resolved: the workers' working folder, and where a relative
    /// `file://` given later (a promotion, a weight sync) resolves. Not a
    /// key of the file; `None` for a config not read from a file.
    #[serde(skip)]
    #[schemars(skip)]
    pub folder: Option<PathBuf>,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            listen: defaults::LISTEN
                .parse()
                .expect("the default address parses"),
            state_dir: PathBuf::from(defaults::STATE_DIR),
            backend: BackendConfig::default(),
            limits: LimitsConfig::default(),
            weights: WeightsConfig::default(),
            apps: Vec::new(),
            pools: Vec::new(),
            tenants: Vec::new(),
            operator: OperatorConfig::default(),
            tls: None,
            access: AccessConfig::default(),
            folder: None,
        }
    }
}

impl Config {
    /// Reads, parses and validates a config file, and resolves its relative
    /// paths against the file's folder.
    pub fn load(file: &Path) -> Result<Config> {
        let text = std::fs::read_to_string(file).map_err(|source| Error::Read {
            file: file.to_owned(),
            source,
        })?;
        let base = file
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        // Absolute, so paths stay right whatever the workers' folder is.
        let base = std::path::absolute(base).unwrap_or_else(|_| base.to_path_buf());
        Config::parse(&text, file, &base)
    }

    /// Parses and validates config text. `file` names the source in errors;
    /// relative paths are resolved against `base`.
    pub fn parse(text: &str, file: &Path, base: &Path) -> Result<Config> {
        let parse_err = |key: String, message: String| Error::Parse {
            file: file.to_owned(),
            key,
            message,
        };
        let de = toml::Deserializer::parse(text)
            .map_err(|e| parse_err("(syntax)".into(), one_line(&e.to_string())))?;
        let mut config: Config = serde_path_to_error::deserialize(de).map_err(|e| {
            let key = match e.path().to_string() {
                p if p == "." || p.is_empty() => "(top level)".to_string(),
                p => p,
            };
            parse_err(key, one_line(&e.into_inner().to_string()))
        })?;
        config.validate().map_err(|(key, message)| Error::Invalid {
            file: file.to_owned(),
            key,
            message,
        })?;
        config.resolve_paths(base);
        config.folder = Some(base.to_path_buf());
        Ok(config)
    }

    /// Checks values that parse but make no sense. Returns the key and why.
    pub fn validate(&self) -> std::result::Result<(), (String, String)> {
        self.backend.check_gpus()?;
        // Checked here, apart from the rest of `weights`, so the checks run
        // in the order they always have (the first failure is the one told).
        if self.weights.concurrency == 0 {
            return Err(("weights.concurrency".into(), "must be at least 1".into()));
        }
        if let Some(tls) = &self.tls {
            tls.validate(self.backend.kind)?;
        }
        self.access.validate()?;
        self.weights.validate()?;
        self.limits.validate()?;
        self.validate_tenants()?;
        self.validate_backend_access()?;
        let mut names: HashSet<&str> = HashSet::new();
        for (i, app) in self.apps.iter().enumerate() {
            self.validate_app(i, app, &mut names)?;
        }
        for (i, pool) in self.pools.iter().enumerate() {
            self.validate_pool(i, pool, &mut names)?;
        }
        Ok(())
    }

    fn resolve_paths(&mut self, base: &Path) {
        if self.state_dir.is_relative() {
            self.state_dir = base.join(&self.state_dir);
        }
        if let Some(tls) = &mut self.tls {
            for p in [&mut tls.cert, &mut tls.key] {
                if p.is_relative() {
                    *p = base.join(&*p);
                }
            }
        }
        for pool in &mut self.pools {
            pool.resolve_paths(base);
        }
        for app in &mut self.apps {
            app.resolve_paths(base);
        }
        for p in self.weights.allowed_prefixes.iter_mut().flatten() {
            resolve_checkpoint(p, base);
        }
    }

    /// The config's folder: where workers run, and where a relative
    /// `file://` given later (through the API, or in a resource the
    /// operator serves) resolves, as one in the file does. For a config
    /// not read from a file, the state folder's parent.
    pub fn workers_folder(&self) -> Option<PathBuf> {
        self.folder
            .clone()
            .or_else(|| self.state_dir.parent().map(Path::to_path_buf))
    }

    /// The app with this name or alias.
    pub fn app(&self, name: &str) -> Option<&AppSpec> {
        self.apps
            .iter()
            .find(|a| a.name == name || a.aliases.iter().any(|x| x == name))
    }
}

fn resolve_command(command: &mut [String], base: &Path) {
    if let Some(program) = command.first_mut() {
        let p = Path::new(program.as_str());
        if p.is_relative() && program.contains('/') {
            *program = base.join(p).to_string_lossy().into_owned();
        }
    }
}

/// Makes a relative `file://` URI absolute against `base` (the config
/// file's folder); other URIs are left as they are.
pub fn resolve_checkpoint(c: &mut String, base: &Path) {
    if let Some(rest) = c.strip_prefix("file://")
        && !rest.starts_with('/')
    {
        let abs = base.join(rest.trim_start_matches("./"));
        *c = format!("file://{}", abs.display());
    }
}

/// Durations in the config, as humantime strings (`"30s"`, `"5m"`), at
/// most [`bounded::MAX`]: a larger one is a typo, and would overflow the
/// clock arithmetic of deadlines.
/// Bytes from a size as people write it (`"64MiB"`, `"16Gi"`, `"500MB"`)
/// or a whole number of bytes.
pub fn parse_size(text: &str) -> std::result::Result<u64, String> {
    size::parse(text)
}

fn one_line(s: &str) -> String {
    s.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join(" ")
}

#[cfg(test)]
mod tests;
