//! A whole config file applied (`warmgate apply`, SIGHUP): the apps and
//! pools it no longer has deleted, each of its own put; and what else in
//! it differs from the running config.

use std::sync::Arc;

use warmgate_deploy::Config;

use crate::error::{Error, ErrorKind};

use super::{Changed, Changes};

/// One change an apply made, or the reason it was refused.
#[derive(Debug)]
pub struct Applied {
    /// `app` or `pool`.
    pub kind: &'static str,
    /// Its name.
    pub name: String,
    /// What was done (`created`, `unchanged`, `in place`, `rolled (to
    /// e-00002)`, `deleted`), or why not.
    pub outcome: Result<String, Error>,
}

impl std::fmt::Display for Applied {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.outcome {
            Ok(what) => write!(f, "{} {}: {what}", self.kind, self.name),
            Err(e) => write!(f, "{} {}: refused: {}", self.kind, self.name, e.message),
        }
    }
}

impl Changed {
    /// In words, as `warmgate apply` prints it.
    pub fn describe(&self) -> String {
        match self {
            Changed::Created => "created".into(),
            Changed::Unchanged => "unchanged".into(),
            Changed::InPlace => "in place".into(),
            Changed::Rolled { revision } => format!("rolled (to {revision})"),
        }
    }
}

impl Changes {
    /// Makes the gateway serve the apps and pools of `file`: the others are
    /// deleted (first, so a name may move from a pool to an app), then
    /// every one of the file's is put. Each change stands alone: a refused
    /// one leaves the others applied.
    pub async fn apply_file(self: &Arc<Self>, file: Config) -> Vec<Applied> {
        let mut out = Vec::new();
        let current = self.desired_config();
        // Apps first: a deleted pool may serve a deleted app. An app that
        // moves between its own replicas and a pool (or between pools)
        // cannot change in place: it is deleted here and put again below.
        for a in &current.apps {
            let moves = file
                .apps
                .iter()
                .find(|f| f.name == a.name)
                .is_some_and(|f| f.pool != a.pool);
            if moves {
                tracing::info!(app = %a.name, from = ?a.pool, "the app changes where it runs: deleting it to put it again");
            }
            if moves || !file.apps.iter().any(|f| f.name == a.name) {
                let outcome = self
                    .delete_app(&a.name)
                    .await
                    .map(|()| "deleted".to_string());
                out.push(Applied {
                    kind: "app",
                    name: a.name.clone(),
                    outcome,
                });
            }
        }
        for p in &current.pools {
            if !file.pools.iter().any(|f| f.name == p.name) {
                let outcome = self
                    .delete_pool(&p.name)
                    .await
                    .map(|()| "deleted".to_string());
                out.push(Applied {
                    kind: "pool",
                    name: p.name.clone(),
                    outcome,
                });
            }
        }
        for p in file.pools {
            let name = p.name.clone();
            let outcome = self.put_pool(p).await.map(|c| c.describe());
            out.push(Applied {
                kind: "pool",
                name,
                outcome,
            });
        }
        for a in file.apps {
            let name = a.name.clone();
            let outcome = self.put_app(a).await.map(|c| c.describe());
            out.push(Applied {
                kind: "app",
                name,
                outcome,
            });
        }
        out
    }

    /// Drops the changes made through the API from the state store: the
    /// config file is the whole truth again at the next start.
    pub fn forget_api_changes(&self) -> Result<(), Error> {
        self.store.clear_overlay().map_err(|e| {
            Error::new(
                ErrorKind::Internal,
                format!("could not drop the changes made through the API: {e}"),
            )
        })
    }

    /// Whether `file` differs from the running config in anything but its
    /// apps and pools (which an apply does not change).
    pub fn other_settings_differ(&self, file: &Config) -> bool {
        let strip = |c: &Config| {
            let mut c = c.clone();
            c.apps.clear();
            c.pools.clear();
            // `serve --listen` may have overridden it.
            c.listen = self.host.config.listen;
            c
        };
        strip(file) != strip(&self.host.config)
    }
}
