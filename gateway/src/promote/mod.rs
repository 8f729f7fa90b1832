//! Revisions and promotions, carried out: the pure state machine of
//! `warmgate_deploy::revision` decides, this module persists each step to
//! SQLite and then acts on it (start replicas, move traffic, retire).
//!
//! A step is saved on a copy of the history and becomes the history in
//! memory only once saved; a failed save changes nothing and is an
//! `internal` error (the driver takes the same step again).

use std::sync::Arc;
use std::time::Duration;

use warmgate_deploy::revision::{Effect, Event, History, Plan, Promotion, Revision};
use warmgate_deploy::{AppSpec, TargetId};

use crate::error::{Error, ErrorKind};
use crate::host::Host;
use crate::replica_sink::Revisions;
use crate::serving::dispatch::App;
use crate::serving::served::Served;

mod drive;
mod gate_step;
pub mod inplace;
mod restore;
mod watch;

pub(crate) use gate_step::Evaluated;
pub(crate) use watch::newest_complete;

use inplace::in_place_plan;
use restore::{fingerprint, new_revision};

/// What `POST /v1/apps/{app}/promote` asks for.
#[derive(Debug, Clone)]
pub struct PromoteRequest {
    /// The checkpoint URI of the new revision.
    pub checkpoint: String,
    /// Canary percent (overrides the app's `promotion.canary`).
    pub canary: Option<u8>,
    /// Bake time (overrides the app's `promotion.bake`).
    pub bake: Option<Duration>,
    /// Swap the weights into the serving replicas (overrides the app's
    /// `promotion.in_place`).
    pub in_place: Option<bool>,
}

/// Promotions, rolls and rollbacks of the apps' revisions, and the
/// revisions restored at start: each step saved in the store, then
/// carried out on the pool manager, the dispatchers and the weights.
pub struct Promotions {
    /// The process (its clock, where workers reach it).
    pub(crate) host: Arc<Host>,
    /// The apps served, to find one by name.
    pub(crate) registry: crate::registry::Live,
    /// Where each step is saved before it is acted on.
    pub(crate) store: Arc<dyn warmgate_deploy::store::StateStore>,
    /// Every app revision ever started, by target (shared with the
    /// replica sink).
    pub(crate) revisions: Revisions,
    /// Revisions promoted in place, by the target whose replicas they
    /// borrow while the promotion runs (`inplace.rs`; shared with the
    /// replica sink).
    pub(crate) guests: Revisions,
    /// The replicas of every target.
    pub(crate) pool: warmgate_pool::PoolManager,
    /// The connections to the replicas (the in-place swaps and the gate
    /// call them).
    pub(crate) upstream: crate::upstream::Upstream,
    /// Checkpoints served to workers.
    pub(crate) weights: Arc<crate::weights::Weights>,
}

impl Promotions {
    /// Promotes a new checkpoint: checks it, makes a revision, and starts
    /// the promotion. Returns the revision id.
    pub(crate) async fn promote(
        self: &Arc<Self>,
        app: &Arc<Served>,
        req: PromoteRequest,
    ) -> Result<String, Error> {
        Self::refuse_if_pool_served(app)?;
        self.refuse_if_promoting(app)?;
        self.refuse_if_swapping_back(app)?;
        let source = self.weights.open(&req.checkpoint)?;
        // Listed under a scratch name first: the checkpoint must exist
        // before a revision is made for it. The scratch name is not kept.
        let probe = format!("promote-{}", fastrand::u64(..));
        self.weights.register(&app.name, &probe, source);
        let listing = self.weights.files(&app.name, &probe).await;
        self.weights.unregister(&app.name, &probe);
        let listing = listing?;
        if listing.items.is_empty() {
            return Err(Error::new(
                ErrorKind::BadRequest,
                format!("checkpoint {} has no files", req.checkpoint),
            ));
        }
        let fingerprint = fingerprint(&listing.items);
        {
            // One lock from the check to the save: the new revision and
            // its first step are saved before anything starts, and a
            // failed save leaves the history (and the replicas) as they
            // were.
            let mut h = app.history.lock();
            if h.promoting() {
                return Err(promoting_error(&app.name, &h));
            }
            // Deleted meanwhile (its deletion holds this lock to mark it):
            // nothing new may start for it.
            if app.is_removed() {
                return Err(removed_error(&app.name));
            }
            self.refuse_if_swapping_back(app)?;
            let rev = new_revision(
                &h,
                &app.spec(),
                Some(req.checkpoint.clone()),
                Some(fingerprint),
            );
            let id = rev.id.clone();
            let from = h.serving().map(|r| r.id.clone());
            let mut plan = Plan {
                canary: req.canary.or(app.spec().promotion.canary),
                bake: req.bake.unwrap_or(app.spec().promotion.bake),
                at_zero: self.at_zero(self.serving_target(app, &h)),
                in_place: false,
                canary_asked: None,
            };
            let mut how = plan
                .canary
                .map_or("all at once".to_string(), |c| format!("canary {c}%"));
            if req.in_place.unwrap_or(app.spec().promotion.in_place) {
                how = in_place_plan(&mut plan, app, from.as_deref(), &rev.spec, how);
            }
            let note = format!(
                "promote {id} from {} ({how}{})",
                req.checkpoint,
                if plan.at_zero { ", at zero" } else { "" }
            );
            let (p, fx) = Promotion::begin(&app.name, from.as_deref(), &id, plan);
            self.commit(app, &mut h, Some(rev.clone()), &p, &fx, &note)?;
            self.launch(app, h, &rev, &p, fx)
        }
    }

    /// Starts a revision just saved with its promotion's first step, then
    /// the driver that takes the promotion on. `h`, the history's lock
    /// held since the checks, is let go before acting. Returns the
    /// revision's id.
    fn launch(
        self: &Arc<Self>,
        app: &Arc<Served>,
        h: parking_lot::MutexGuard<'_, History>,
        rev: &Revision,
        p: &Promotion,
        fx: Vec<Effect>,
    ) -> Result<String, Error> {
        let started = match p.plan.in_place {
            true => p
                .from
                .as_deref()
                .and_then(|f| app.revision(f))
                .ok_or_else(|| {
                    Error::new(
                        ErrorKind::Conflict,
                        format!(
                            "app '{}' has no serving revision to swap in place",
                            app.name
                        ),
                    )
                })
                .and_then(|host| self.materialize_guest(app, rev, &host)),
            false => self.materialize(app, rev),
        };
        drop(h);
        if let Err(e) = started {
            // Saved, but it cannot run: the promotion fails for good,
            // which is saved too (or, failing that, retried by the
            // driver).
            let why = e.message.clone();
            if let Ok((next, fx)) = p.on(Event::StartFailed(why.clone())) {
                let note = format!("{} failed to start: {why}", rev.id);
                let _ = self.step(app, p, &next, fx, &note);
            }
            tokio::spawn(self.clone().drive(app.clone()));
            return Err(e);
        }
        self.act(app, &fx);
        tokio::spawn(self.clone().drive(app.clone()));
        Ok(rev.id.clone())
    }

    /// Rolls back: ends a running promotion in favour of the old revision,
    /// or, with none running, promotes the previous good revision again
    /// (its weights are in the cache, so it starts without a download).
    /// Returns the revision that will serve.
    ///
    /// The rollback is saved and carried out before the answer: an error
    /// means nothing changed.
    pub(crate) fn rollback(self: &Arc<Self>, app: &Arc<Served>) -> Result<String, Error> {
        Self::refuse_if_pool_served(app)?;
        let running = app
            .history
            .lock()
            .promotion
            .clone()
            .filter(|p| !p.phase.is_terminal());
        if let Some(p) = running {
            let back = p.from.clone().ok_or_else(|| {
                Error::new(
                    ErrorKind::Conflict,
                    format!("app '{}' has no earlier revision", app.name),
                )
            })?;
            let reason = "requested by an operator".to_string();
            let (next, fx) = p
                .on(Event::Rollback(reason.clone()))
                .map_err(|e| Error::new(ErrorKind::Conflict, e.to_string()))?;
            self.step(
                app,
                &p,
                &next,
                fx,
                &format!("{} rolled back: {reason}", p.to),
            )?;
            return Ok(back);
        }
        self.refuse_if_swapping_back(app)?;
        {
            let mut h = app.history.lock();
            if h.promoting() {
                return Err(promoting_error(&app.name, &h));
            }
            // Deleted meanwhile (its deletion holds this lock to mark it):
            // nothing new may start for it.
            if app.is_removed() {
                return Err(removed_error(&app.name));
            }
            self.refuse_if_swapping_back(app)?;
            let prev = h.previous_good().cloned().ok_or_else(|| {
                Error::new(
                    ErrorKind::Conflict,
                    format!("app '{}' has no earlier revision to roll back to", app.name),
                )
            })?;
            let from = h.serving().map(|r| r.id.clone());
            let serving_target = self.serving_target(app, &h);
            let mut plan = Plan {
                canary: None,
                bake: Duration::ZERO,
                at_zero: self.at_zero(serving_target.clone()),
                in_place: false,
                canary_asked: None,
            };
            // Back in place when the app promotes in place, and always when
            // the serving revision runs on replicas it took over in place
            // (its target is not its own): those replicas swap back.
            let own = h.serving().map(Revision::target);
            let hosted = serving_target.is_some_and(|t| Some(t) != own);
            let mut how = String::from("all at once");
            if app.spec().promotion.in_place || hosted {
                how = in_place_plan(&mut plan, app, from.as_deref(), &prev.spec, how);
            }
            if hosted && !plan.in_place && !plan.at_zero {
                // Its replicas run another revision's settings, or are
                // starting again (none ready to swap), and no other
                // replicas may be had for it.
                return Err(Error::new(
                    ErrorKind::Conflict,
                    format!(
                        "app '{}' cannot roll back to {} in place now ({how}); try again once its replicas are ready, or promote {}'s checkpoint",
                        app.name, prev.id, prev.id
                    ),
                )
                .retry_after(2));
            }
            // At zero, back to a revision that served, with nothing to
            // start: the next request wakes it.
            let (p, fx) = if plan.at_zero {
                Promotion::switch(&app.name, from.as_deref(), &prev.id, plan)
            } else {
                Promotion::begin(&app.name, from.as_deref(), &prev.id, plan)
            };
            self.commit(
                app,
                &mut h,
                None,
                &p,
                &fx,
                &format!("roll back to {} ({how})", prev.id),
            )?;
            // It served before, so its checkpoint opened before. One that
            // cannot start now fails the rollback for good, saved.
            self.launch(app, h, &prev, &p, fx)
        }
    }

    /// Promotes `checkpoint` on app `name` with the app's own promotion
    /// settings (what `warmgate promote` does without flags). Returns the
    /// new revision's id.
    pub async fn promote_checkpoint(
        self: &Arc<Self>,
        name: &str,
        checkpoint: &str,
    ) -> Result<String, Error> {
        let app = self.registry.load().find_app(name)?;
        self.promote(
            &app,
            PromoteRequest {
                checkpoint: checkpoint.to_string(),
                canary: None,
                bake: None,
                in_place: None,
            },
        )
        .await
    }

    /// Rolls the app onto a changed spec: a new revision made from it is
    /// started with as many replicas as the serving one has, takes all the
    /// traffic once they are ready, and the old revision is retired (at
    /// once when nothing runs). The spec is saved as the app's before
    /// anything starts. Returns the new revision's id.
    pub(crate) fn roll(
        self: &Arc<Self>,
        app: &Arc<Served>,
        spec: AppSpec,
        why: &str,
    ) -> Result<String, Error> {
        let config = serde_json::to_string(&spec)
            .map_err(|e| Error::new(ErrorKind::Internal, format!("cannot encode the spec: {e}")))?;
        self.refuse_if_swapping_back(app)?;
        {
            let mut h = app.history.lock();
            if h.promoting() {
                return Err(promoting_error(&app.name, &h));
            }
            // Deleted meanwhile (its deletion holds this lock to mark it):
            // nothing new may start for it.
            if app.is_removed() {
                return Err(removed_error(&app.name));
            }
            self.refuse_if_swapping_back(app)?;
            let rev = new_revision(&h, &spec, spec.checkpoint.clone(), None);
            let id = rev.id.clone();
            let from = h.serving().map(|r| r.id.clone());
            let plan = Plan {
                canary: None,
                bake: Duration::ZERO,
                at_zero: self.at_zero(self.serving_target(app, &h)),
                in_place: false,
                canary_asked: None,
            };
            let note = match &from {
                Some(from) => format!("{why}: {id} replaces {from}"),
                None => format!("{why}: {id}"),
            };
            let (p, fx) = Promotion::begin(&app.name, from.as_deref(), &id, plan);
            self.commit_spec(app, &mut h, Some(rev.clone()), Some(config), &p, &fx, &note)?;
            app.set_spec(spec);
            self.launch(app, h, &rev, &p, fx)
        }
    }

    /// Forgets which spec the app's revisions were made from and takes
    /// every revision out of traffic, saved: the app was deleted, and if
    /// it is put again it starts from a new revision.
    pub(crate) fn forget_spec(&self, app: &Served, note: &str) -> Result<(), Error> {
        let mut h = app.history.lock();
        if h.promoting() {
            return Err(promoting_error(&app.name, &h));
        }
        let mut next = h.clone();
        next.config = None;
        for r in &mut next.revisions {
            r.traffic = 0;
        }
        if let Err(e) = self.store.save(&app.name, &next, note) {
            return Err(Error::new(
                ErrorKind::Internal,
                format!("the gateway could not save the deletion, so it did not delete: {e}"),
            ));
        }
        *h = next;
        // Under the history lock: a promotion or roll that takes it after
        // this sees the app deleted and starts nothing.
        app.mark_removed();
        Ok(())
    }

    /// An app served by a pool has no revisions of its own: its weights
    /// move with the pool's syncs.
    fn refuse_if_pool_served(app: &Served) -> Result<(), Error> {
        match &app.spec().pool {
            Some(pool) => Err(Error::new(
                ErrorKind::Conflict,
                format!(
                    "app '{}' runs on pool '{pool}' and takes its weights from the pool's syncs \
                     (POST /v1/pools/{pool}/weights); it has no revisions to promote or roll back",
                    app.name
                ),
            )),
            None => Ok(()),
        }
    }

    pub(crate) fn refuse_if_promoting(&self, app: &Served) -> Result<(), Error> {
        let h = app.history.lock();
        if h.promoting() {
            return Err(promoting_error(&app.name, &h));
        }
        Ok(())
    }

    /// The pool-manager target of an app's revision, by its id, once it
    /// has been materialized.
    fn target_of(&self, app: &Served, id: &str) -> Option<TargetId> {
        let is = |a: &&Arc<App>| a.name == app.name && a.revision == id;
        let own = self
            .revisions
            .read()
            .values()
            .find(is)
            .map(|a| a.target.clone());
        own.or_else(|| {
            self.guests
                .read()
                .values()
                .find(is)
                .map(|a| a.target.clone())
        })
    }

    /// Whether the serving revision has no replicas at all.
    fn at_zero(&self, serving: Option<TargetId>) -> bool {
        serving.is_none_or(|id| {
            self.pool.desired(&id).unwrap_or(0) == 0
                && self
                    .pool
                    .health(&id)
                    .is_none_or(|h| h.ready == 0 && h.starting == 0)
        })
    }
}

fn removed_error(app: &str) -> Error {
    Error::new(ErrorKind::NotFound, format!("app '{app}' was deleted"))
}

fn promoting_error(app: &str, h: &History) -> Error {
    let to = h.promotion.as_ref().map_or("?", |p| p.to.as_str());
    Error::new(
        ErrorKind::Conflict,
        format!("app '{app}' is already promoting {to}; wait for it or roll back"),
    )
}
