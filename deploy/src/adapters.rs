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
//! aliases = ["sql"]         # other names requests may use
//! ```
//!
//! An adapter has revisions: the gateway raises `revision` each time its
//! checkpoint changes (a `PUT`, `warmgate apply`, a promotion), and the
//! engine holds revision `n > 1` as `name@n`, so a replica that still
//! holds the old weights is never asked for the new ones under the old
//! name.

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

/// Where an adapter's checkpoint may live: a folder the engine reads, or
/// an object store the gateway pulls it from.
pub const CHECKPOINT_SCHEMES: [&str; 4] = ["file://", "s3://", "gs://", "az://"];

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
    /// config's folder), which the engine reads as `lora_path`, or an
    /// `s3://`, `gs://` or `az://` prefix, which the gateway pulls into a
    /// folder of its `state_dir` first (local backend).
    pub checkpoint: String,
    /// Other names requests may use for it; the engine is sent its own.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub aliases: Vec<String>,
    /// A prefix where training writes this adapter's checkpoints, one
    /// folder each: the newest folder holding the app's
    /// `promotion.marker` is promoted as its next revision (with the
    /// app's gate, canary and bake), as `promotion.watch` does for the
    /// app's own checkpoints.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub watch: Option<String>,
    /// Which revision of the adapter `checkpoint` is: 1 at first, raised by
    /// the gateway whenever the checkpoint changes. Leave it out in a
    /// config file.
    #[serde(default = "first_revision", skip_serializing_if = "is_first")]
    pub revision: u32,
}

fn first_revision() -> u32 {
    1
}

fn is_first(r: &u32) -> bool {
    *r <= 1
}

/// The name the engine holds revision `revision` of adapter `name` under
/// (its `lora_name`): the name itself for the first, `name@n` after.
pub fn engine_name(name: &str, revision: u32) -> String {
    if revision <= 1 {
        name.to_string()
    } else {
        format!("{name}@{revision}")
    }
}

impl AdapterSpec {
    /// A first revision of `name` at `checkpoint`, with no alias.
    pub fn new(name: impl Into<String>, checkpoint: impl Into<String>) -> Self {
        AdapterSpec {
            name: name.into(),
            checkpoint: checkpoint.into(),
            aliases: Vec::new(),
            watch: None,
            revision: 1,
        }
    }

    /// The `lora_name` the engine holds this revision under.
    pub fn engine_name(&self) -> String {
        engine_name(&self.name, self.revision)
    }

    /// Whether a request's `model` names it (its name or an alias).
    pub fn answers_to(&self, model: &str) -> bool {
        self.name == model || self.aliases.iter().any(|a| a == model)
    }
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
    /// Whether an adapter follows a training run (`watch`).
    pub fn watched(&self) -> bool {
        self.models.iter().any(|a| a.watch.is_some())
    }

    /// Whether any adapter is configured.
    pub fn is_empty(&self) -> bool {
        self.models.is_empty()
    }

    /// The adapter named `name`.
    pub fn get(&self, name: &str) -> Option<&AdapterSpec> {
        self.models.iter().find(|a| a.name == name)
    }

    /// Keeps each adapter's revision true against `current`, the adapters
    /// as they were, and `used`, the highest revision each name was ever
    /// given (a promotion rolled back, an adapter deleted and put again):
    /// one whose checkpoint changed, or that comes back, gets a revision
    /// past both, so an engine still holding an old one under its name is
    /// never asked for the new one; one whose checkpoint did not change
    /// keeps its revision (a file or a resource that says nothing of
    /// revisions does not undo one).
    pub fn carry_revisions(&mut self, current: &AdaptersSpec, used: impl Fn(&str) -> u32) {
        for a in &mut self.models {
            let used = used(&a.name);
            match current.get(&a.name) {
                Some(old) if old.checkpoint == a.checkpoint => {
                    a.revision = a.revision.max(old.revision);
                }
                Some(old) => {
                    let past = old.revision.max(used);
                    if a.revision <= past {
                        a.revision = past + 1;
                    }
                }
                None if used > 0 && a.revision <= used => a.revision = used + 1,
                None => {}
            }
        }
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
            if a.name.contains('@') {
                return Err((
                    key("name"),
                    format!(
                        "{:?}: an adapter's name has no '@' (the engine holds its later revisions as name@n)",
                        a.name
                    ),
                ));
            }
            if self.models[..i]
                .iter()
                .any(|b| b.answers_to(&a.name) || a.aliases.iter().any(|x| b.answers_to(x)))
            {
                return Err((
                    key("name"),
                    format!(
                        "the adapter {:?} (or an alias of it) is listed twice",
                        a.name
                    ),
                ));
            }
            for (j, alias) in a.aliases.iter().enumerate() {
                let key = || key(&format!("aliases[{j}]"));
                crate::config::check_model_name(alias).map_err(|m| (key(), m))?;
                if alias.contains('@') || *alias == a.name || a.aliases[..j].contains(alias) {
                    return Err((
                        key(),
                        format!(
                            "{alias:?}: an alias has no '@' and is listed once, apart from the name"
                        ),
                    ));
                }
            }
            if let Some(w) = &a.watch
                && !CHECKPOINT_SCHEMES.iter().any(|s| w.starts_with(s))
            {
                return Err((
                    key("watch"),
                    "must be a file://, s3://, gs:// or az:// prefix".into(),
                ));
            }
            if a.revision == 0 {
                return Err((key("revision"), "must be at least 1".into()));
            }
            if !CHECKPOINT_SCHEMES
                .iter()
                .any(|s| a.checkpoint.starts_with(s))
            {
                return Err((
                    key("checkpoint"),
                    "must be a file:// folder, or an s3://, gs:// or az:// prefix the gateway pulls into a folder".into(),
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
            models: vec![AdapterSpec::new(name, checkpoint)],
            ..AdaptersSpec::default()
        }
    }

    #[test]
    fn adapters_are_model_names_in_local_folders_listed_once() {
        let at = |k: &str| k.to_string();
        assert!(one("org/sql-lora", "file:///a/sql").validate(at).is_ok());
        assert!(one("../x", "file:///a").validate(at).is_err());
        assert!(one("sql", "s3://b/sql").validate(at).is_ok());
        assert!(one("sql", "http://b/sql").validate(at).is_err());
        let mut two = one("sql", "file:///a");
        two.models.push(two.models[0].clone());
        assert_eq!(
            two.validate(at).expect_err("twice").0,
            "adapters.models[1].name"
        );
        let mut zero = one("sql", "file:///a");
        zero.max_loaded = 0;
        assert!(zero.validate(at).is_err());
        assert!(one("sql@2", "file:///a").validate(at).is_err());
        let mut aliased = one("sql", "file:///a");
        aliased.models[0].aliases = vec!["q".into()];
        assert!(aliased.validate(at).is_ok());
        aliased.models.push(AdapterSpec::new("q", "file:///b"));
        assert_eq!(
            aliased.validate(at).expect_err("alias taken").0,
            "adapters.models[1].name"
        );
        aliased.models[1].name = "r".into();
        aliased.models[1].aliases = vec!["r@1".into()];
        assert_eq!(
            aliased.validate(at).expect_err("@ in alias").0,
            "adapters.models[1].aliases[0]"
        );
    }

    #[test]
    fn a_changed_checkpoint_is_a_new_revision_and_an_unchanged_one_keeps_its_own() {
        let mut now = one("sql", "file:///v1");
        now.models[0].revision = 3;
        let none = |_: &str| 0;
        let mut put = one("sql", "file:///v1");
        put.carry_revisions(&now, none);
        assert_eq!(put.models[0].revision, 3, "a file that says nothing");
        assert_eq!(put.models[0].engine_name(), "sql@3");
        let mut moved = one("sql", "file:///v2");
        moved.carry_revisions(&now, none);
        assert_eq!(moved.models[0].revision, 4);
        let mut promoted = one("sql", "file:///v2");
        promoted.models[0].revision = 7;
        promoted.carry_revisions(&now, none);
        assert_eq!(promoted.models[0].revision, 7, "a promotion names its own");
        // Revision 4 went to a promotion that rolled back: never reused.
        let mut after = one("sql", "file:///v5");
        after.carry_revisions(&now, |_| 4);
        assert_eq!(after.models[0].revision, 5);
        // Deleted at revision 3, put again: not `sql` again.
        let mut back = one("sql", "file:///v1");
        back.carry_revisions(&AdaptersSpec::default(), |_| 3);
        assert_eq!(back.models[0].revision, 4);
        let mut fresh = one("sql", "file:///v1");
        fresh.carry_revisions(&AdaptersSpec::default(), none);
        assert_eq!(fresh.models[0].engine_name(), "sql");
        assert_eq!(engine_name("sql", 1), "sql");
    }
}
