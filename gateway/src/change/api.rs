//! Changes as the control plane's API asks for them: refused while the
//! operator runs the gateway (its resources are the truth then), relative
//! paths read from the config's folder as the file's are, an adapter put
//! or deleted as a change of its app's spec, and a promotion (of an app's
//! revisions, or of one of its adapters) started and, when asked, waited
//! for.

use std::sync::Arc;
use std::time::Duration;

use warmgate_deploy::adapter_promotion::AdapterPromotion;
use warmgate_deploy::revision::Promotion;
use warmgate_deploy::{AdapterSpec, AppSpec, PoolSpec};

use super::{AdapterPromoteRequest, Changed, Changes};
use crate::error::{Error, ErrorKind};
use crate::promote::PromoteRequest;
use crate::serving::served::Served;

/// How often a promotion asked to be waited for is looked at.
const WAIT_STEP: Duration = Duration::from_millis(100);

/// The API's way to change apps and pools, once it may: see
/// [`Changes::through_api`].
pub(crate) struct ApiChanges<'a> {
    changes: &'a Arc<Changes>,
}

/// What a put of an adapter did, as the API reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum AdapterChanged {
    /// The adapter is new to its app.
    Created,
    /// The same adapter as before: nothing was done.
    Unchanged,
    /// The adapter changed (or its app's change was made again).
    InPlace,
}

impl AdapterChanged {
    /// As the answer's `change` names it.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            AdapterChanged::Created => "created",
            AdapterChanged::Unchanged => "unchanged",
            AdapterChanged::InPlace => "in_place",
        }
    }
}

impl Changes {
    /// The API's changes, or 409 when the API may change nothing (under
    /// the operator). Asked before the request's body is read: a gateway
    /// that refuses every change says so whatever the body holds.
    pub(crate) fn through_api(self: &Arc<Self>) -> Result<ApiChanges<'_>, Error> {
        self.lock.check_api_allowed()?;
        Ok(ApiChanges { changes: self })
    }

    /// Promotes `app` as `POST /v1/apps/{app}/promote` asks: a new
    /// revision of the app, or with `adapter` of one of its LoRA adapters;
    /// a relative `file://` checkpoint is the config folder's. Returns once
    /// it started, or with `wait` once it ended.
    pub(crate) async fn promote_as_asked(
        self: &Arc<Self>,
        app: &Arc<Served>,
        mut asked: PromoteAsked,
    ) -> Result<Promoted, Error> {
        // Relative to the config's folder, as in the file.
        if let Some(dir) = &self.host.workdir {
            warmgate_deploy::resolve_checkpoint(&mut asked.checkpoint, dir);
        }
        if let Some(adapter) = asked.adapter {
            if asked.in_place.is_some() {
                return Err(Error::new(
                    ErrorKind::BadRequest,
                    "in_place is for the app's revisions: an adapter is always loaded into the running replicas",
                ));
            }
            let c = self
                .promote_adapter(
                    app,
                    AdapterPromoteRequest {
                        adapter,
                        checkpoint: asked.checkpoint,
                        canary: asked.canary,
                        bake: asked.bake,
                    },
                )
                .await?;
            if asked.wait {
                while c.running() {
                    tokio::time::sleep(WAIT_STEP).await;
                }
            }
            let promotion = c.promotion.lock().clone();
            return Ok(Promoted::Adapter {
                revision: c.engine.to_string(),
                promotion,
            });
        }
        let id = self
            .promotions
            .promote(
                app,
                PromoteRequest {
                    checkpoint: asked.checkpoint,
                    canary: asked.canary,
                    bake: asked.bake,
                    in_place: asked.in_place,
                },
            )
            .await?;
        if !asked.wait {
            return Ok(Promoted::Revision {
                revision: id,
                promotion: None,
            });
        }
        loop {
            let p = app.history.lock().promotion.clone();
            if let Some(p) = p.filter(|p| p.to == id && p.phase.is_terminal()) {
                return Ok(Promoted::Revision {
                    revision: id,
                    promotion: Some(p),
                });
            }
            tokio::time::sleep(WAIT_STEP).await;
        }
    }
}

impl ApiChanges<'_> {
    /// Puts an app ([`Changes::put_app`]), its relative paths the config
    /// folder's.
    pub(crate) async fn put_app(&self, mut spec: AppSpec) -> Result<Changed, Error> {
        if let Some(dir) = &self.changes.host.workdir {
            spec.resolve_paths(dir);
        }
        self.changes.put_app(spec).await
    }

    /// Deletes an app ([`Changes::delete_app`]).
    pub(crate) async fn delete_app(&self, name: &str) -> Result<(), Error> {
        self.changes.delete_app(name).await
    }

    /// Puts a pool ([`Changes::put_pool`]), its relative paths the config
    /// folder's.
    pub(crate) async fn put_pool(&self, mut spec: PoolSpec) -> Result<Changed, Error> {
        if let Some(dir) = &self.changes.host.workdir {
            spec.resolve_paths(dir);
        }
        self.changes.put_pool(spec).await
    }

    /// Deletes a pool ([`Changes::delete_pool`]).
    pub(crate) async fn delete_pool(&self, name: &str) -> Result<(), Error> {
        self.changes.delete_pool(name).await
    }

    /// Adds `adapter` to app `app` (its name, not an alias), or replaces
    /// the one of its name: a put of the app's spec with it, made in place.
    pub(crate) async fn put_adapter(
        &self,
        app: &str,
        adapter: AdapterSpec,
    ) -> Result<AdapterChanged, Error> {
        let mut spec = self.current_spec(app)?;
        let existed = spec.adapters.get(&adapter.name).is_some();
        spec.adapters.models.retain(|a| a.name != adapter.name);
        spec.adapters.models.push(adapter);
        let changed = self.put_app(spec).await?;
        Ok(match changed {
            Changed::Unchanged => AdapterChanged::Unchanged,
            _ if !existed => AdapterChanged::Created,
            _ => AdapterChanged::InPlace,
        })
    }

    /// Takes adapter `name` out of app `app` (its name, not an alias);
    /// 404 when the app has no such adapter.
    pub(crate) async fn delete_adapter(&self, app: &str, name: &str) -> Result<(), Error> {
        let mut spec = self.current_spec(app)?;
        if spec.adapters.get(name).is_none() {
            return Err(Error::new(
                ErrorKind::NotFound,
                format!("app '{app}' has no adapter {name:?}"),
            ));
        }
        spec.adapters.models.retain(|a| a.name != name);
        self.changes.put_app(spec).await?;
        Ok(())
    }

    /// The spec app `name` was put with (its name, not an alias), or 404.
    fn current_spec(&self, name: &str) -> Result<AppSpec, Error> {
        self.changes
            .registry
            .load()
            .apps()
            .iter()
            .find(|a| a.name == name)
            .map(|a| (*a.spec()).clone())
            .ok_or_else(|| Error::new(ErrorKind::NotFound, format!("app '{name}' not found")))
    }
}

/// What `POST /v1/apps/{app}/promote` asks for.
#[derive(Debug, Clone)]
pub(crate) struct PromoteAsked {
    /// The new revision's checkpoint; a relative `file://` is the config
    /// folder's.
    pub(crate) checkpoint: String,
    /// Canary percent (overrides the app's `promotion.canary`).
    pub(crate) canary: Option<u8>,
    /// Bake time (overrides the app's `promotion.bake`).
    pub(crate) bake: Option<Duration>,
    /// Swap the weights into the serving replicas (the app's revisions
    /// only; overrides the app's `promotion.in_place`).
    pub(crate) in_place: Option<bool>,
    /// Promote this adapter of the app instead.
    pub(crate) adapter: Option<String>,
    /// Return once the promotion ended, not once it started.
    pub(crate) wait: bool,
}

/// A promotion started (or, when waited for, ended).
#[derive(Debug)]
pub(crate) enum Promoted {
    /// A new revision of the app.
    Revision {
        /// Its id.
        revision: String,
        /// The promotion as it ended, when waited for.
        promotion: Option<Promotion>,
    },
    /// A new revision of one of the app's adapters.
    Adapter {
        /// Its `lora_name`.
        revision: String,
        /// The promotion as it stands (as it ended, when waited for).
        promotion: AdapterPromotion,
    },
}
