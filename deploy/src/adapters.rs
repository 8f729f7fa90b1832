//! `[apps.adapters]`: LoRA adapters served as models on an app's replicas,
//! loaded into the engine at runtime (vLLM's `POST /v1/load_lora_adapter`)
//! where the gateway routes a request for one, and unloaded to make room.
//!
//! ```toml
//! [apps.adapters]
//! max_loaded = 2            # adapters one replica holds at once (vLLM --max-loras)
//! [[apps.adapters.models]]
//! name = "sql-lora"         # the `model` a request names
//! checkpoint = "file://./adapters/sql"
//! ```

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// Defaults, each with the reason for it.
pub mod defaults {
    use std::time::Duration;

    /// vLLM's `--max-loras` defaults to 1; two adapters per replica let a
    /// replica serve a second one while the first is busy, and is what
    /// the issue's benchmark gives each stand-in.
    pub const MAX_LOADED: u32 = 2;
    /// Loading an adapter of a few hundred MB from a local disk takes
    /// seconds; a load that takes a minute is stuck.
    pub const LOAD_TIMEOUT: Duration = Duration::from_secs(60);
}

/// `[apps.adapters]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct AdaptersSpec {
    /// Adapters one replica holds loaded at once: set it to the engine's
    /// `--max-loras` (vLLM). The gateway unloads the least recently used
    /// idle adapter of a replica to load another past it.
    pub max_loaded: u32,
    /// How long a load may take before the request waiting for it fails.
    #[serde(with = "humantime_serde")]
    #[schemars(with = "String")]
    pub load_timeout: Duration,
    /// The adapters: each served as a model of its own name.
    pub models: Vec<AdapterSpec>,
}

/// One adapter.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct AdapterSpec {
    /// The model name requests use, and the `lora_name` the engine gets.
    pub name: String,
    /// Where the adapter's files are: a `file://` folder (relative to the
    /// config's folder), which the engine reads as `lora_path`.
    pub checkpoint: String,
}

impl Default for AdaptersSpec {
    fn default() -> Self {
        AdaptersSpec {
            max_loaded: defaults::MAX_LOADED,
            load_timeout: defaults::LOAD_TIMEOUT,
            models: Vec::new(),
        }
    }
}

impl AdaptersSpec {
    /// Whether any adapter is configured.
    pub fn is_empty(&self) -> bool {
        self.models.is_empty()
    }

    /// The adapter named `name`.
    pub fn get(&self, name: &str) -> Option<&AdapterSpec> {
        self.models.iter().find(|a| a.name == name)
    }

    /// Checks the section; `at` names a key in errors.
    pub fn validate(&self, at: impl Fn(&str) -> String) -> Result<(), (String, String)> {
        if self.is_empty() {
            return Ok(());
        }
        if self.max_loaded == 0 {
            return Err((at("adapters.max_loaded"), "must be at least 1".into()));
        }
        if self.load_timeout.is_zero() {
            return Err((at("adapters.load_timeout"), "must be more than 0s".into()));
        }
        for (i, a) in self.models.iter().enumerate() {
            let key = |k: &str| at(&format!("adapters.models[{i}].{k}"));
            crate::config::check_model_name(&a.name).map_err(|m| (key("name"), m))?;
            if self.models[..i].iter().any(|b| b.name == a.name) {
                return Err((
                    key("name"),
                    format!("the adapter {:?} is listed twice", a.name),
                ));
            }
            if !a.checkpoint.starts_with("file://") {
                return Err((
                    key("checkpoint"),
                    "must be a file:// folder the engine can read as its lora_path (object-store adapters are not served yet)".into(),
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn one(name: &str, checkpoint: &str) -> AdaptersSpec {
        AdaptersSpec {
            models: vec![AdapterSpec {
                name: name.into(),
                checkpoint: checkpoint.into(),
            }],
            ..AdaptersSpec::default()
        }
    }

    #[test]
    fn adapters_are_model_names_in_local_folders_listed_once() {
        let at = |k: &str| k.to_string();
        assert!(one("org/sql-lora", "file:///a/sql").validate(at).is_ok());
        assert!(one("../x", "file:///a").validate(at).is_err());
        assert!(one("sql", "s3://b/sql").validate(at).is_err());
        let mut two = one("sql", "file:///a");
        two.models.push(two.models[0].clone());
        assert_eq!(
            two.validate(at).expect_err("twice").0,
            "adapters.models[1].name"
        );
        let mut zero = one("sql", "file:///a");
        zero.max_loaded = 0;
        assert!(zero.validate(at).is_err());
    }
}
