//! Revisions and promotions, carried out: the pure state machine of
//! `warmgate_deploy::revision` decides, this module persists each step to
//! SQLite and then acts on it (start replicas, move traffic, retire).
//!
//! A step is saved on a copy of the history and becomes the history in
//! memory only once saved; a failed save changes nothing and is an
//! `internal` error (the driver takes the same step again).

use std::sync::Arc;
use std::time::{Duration, Instant};

use warmgate_deploy::revision::{
    Effect, Event, History, Phase, Plan, Promotion, Revision, RevisionState, revision_id,
};
use warmgate_deploy::store::unix_now;
use warmgate_deploy::{AppSpec, TargetId};
use warmgate_pool::TargetSpec;

use crate::error::{ApiError, ErrorKind};
use crate::server::Gateway;
use crate::serving::dispatch::App;
use crate::serving::served::Served;

/// How often a running promotion looks at its new revision.
const STEP: Duration = Duration::from_millis(100);

/// What an evaluation gate is run against.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Evaluated<'a> {
    /// A revision of the app, pinned by `X-Warmgate-Revision`.
    Revision(&'a str),
    /// A revision of an adapter, by the model name that pins it
    /// (`name@n`), on the app's serving revision.
    Adapter {
        /// That name.
        model: &'a str,
        /// The app's serving revision (`WARMGATE_EVAL_REVISION`).
        revision: &'a str,
    },
}

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

impl Gateway {
    /// Starts serving an app's history after a (re)start. On the first run
    /// it makes revision 1 from the config, and a new revision whenever the
    /// config changed since; both switch at once, since nothing runs yet.
    /// Then it routes the split the app had and resumes a promotion that
    /// was running.
    pub(crate) fn restore(self: &Arc<Self>, app: &Arc<Served>) -> anyhow::Result<()> {
        let config = serde_json::to_string(&*app.spec())?;
        let resume = {
            let mut history = app.history.lock();
            // The replicas an in-place promotion was swapping went with
            // the gateway: it ends rolled back, and each revision starts
            // replicas of its own from here.
            if let Some(p) = history
                .promotion
                .clone()
                .filter(|p| p.plan.in_place && !p.phase.is_terminal())
                && let Ok((next, fx)) = p.on(Event::Rollback(
                    "the gateway restarted during the in-place promotion".into(),
                ))
            {
                let mut h = history.clone();
                h.apply(&next, &fx);
                let note = format!(
                    "{} rolled back: the gateway restarted during the in-place promotion",
                    p.to
                );
                self.store.save(&app.name, &h, &note)?;
                *history = h;
            }
            if history.revisions.is_empty() || history.config.as_deref() != Some(config.as_str()) {
                let mut h = history.clone();
                let first = h.revisions.is_empty();
                let from = h.serving().map(|r| r.id.clone());
                // A promotion cut short by the config change ends here.
                if let Some(p) = h.promotion.clone().filter(|p| !p.phase.is_terminal())
                    && let Ok((p, fx)) = p.on(Event::Rollback("the config changed".into()))
                {
                    h.apply(&p, &fx);
                }
                let rev = new_revision(&h, &app.spec(), app.spec().checkpoint.clone(), None);
                let id = rev.id.clone();
                h.revisions.push(rev);
                h.config = Some(config);
                let (p, fx) = Promotion::switch(
                    &app.name,
                    from.as_deref(),
                    &id,
                    Plan {
                        canary: None,
                        bake: Duration::ZERO,
                        at_zero: true,
                        in_place: false,
                        canary_asked: None,
                    },
                );
                h.apply(&p, &fx);
                let note = if first {
                    format!("created {id} from the config")
                } else {
                    format!(
                        "the config changed: {id} replaces {}",
                        from.unwrap_or_default()
                    )
                };
                // Saved as a whole before it counts: a failed save leaves
                // the history as it was loaded, and the start fails.
                self.store.save(&app.name, &h, &note)?;
                *history = h;
            }
            let h = history;
            let promoting = h.promotion.clone().filter(|p| !p.phase.is_terminal());
            let live: Vec<Revision> = h
                .revisions
                .iter()
                .filter(|r| r.traffic > 0 || promoting.as_ref().is_some_and(|p| p.to == r.id))
                .cloned()
                .collect();
            for r in &live {
                self.materialize(app, r)
                    .map_err(|e| anyhow::anyhow!("{}", e.message))?;
            }
            app.set_split(&h.split());
            promoting
        };
        if let Some(p) = resume {
            tracing::info!(app = %app.name, to = %p.to, phase = ?p.phase, "resuming a promotion cut short by a restart");
            if p.phase == Phase::Warming {
                self.act(app, &[Effect::Start(p.to.clone())]);
            }
            tokio::spawn(self.clone().drive(app.clone()));
        }
        Ok(())
    }

    /// The dispatcher of a revision, with its pool-manager target and its
    /// weights, made routable by pinning. Reused when it exists already
    /// (a rollback to a revision that served before).
    pub(crate) fn materialize(&self, app: &Served, rev: &Revision) -> Result<Arc<App>, ApiError> {
        let target = rev.target();
        let existing = self.revisions.read().get(&target).cloned();
        if let Some(a) = existing.as_ref().filter(|a| a.revision != rev.id) {
            // The target's replicas run a later revision, promoted in
            // place onto them. With none running it is taken back below;
            // otherwise only an in-place promotion may use them.
            let idle = a.ready_replicas() == 0 && self.pool.desired(&target).unwrap_or(0) == 0;
            if !idle {
                return Err(ApiError::new(
                    ErrorKind::Conflict,
                    format!(
                        "{}'s replicas serve {} now (promoted in place); promote or roll back in place",
                        rev.id, a.revision
                    ),
                ));
            }
            return self.rebind(app, rev, &target);
        }
        if let Some(a) = existing {
            // Its weights went when it was retired, with its replicas'
            // tokens: served again, new replicas get new tokens.
            if let Some(uri) = &rev.checkpoint
                && self.weights.uri(&app.name, &rev.id).is_none()
            {
                let vars = self.serve_weights(&app.name, &rev.id, uri)?;
                self.pool.update_target(&target, |t| t.env.extend(vars));
            }
            app.add_live(a.clone());
            return Ok(a);
        }
        let mut spec: AppSpec =
            serde_json::from_str(&rev.spec).unwrap_or_else(|_| (*app.spec()).clone());
        spec.checkpoint = rev.checkpoint.clone();
        let mut env = spec.env.clone();
        if let Some(uri) = &spec.checkpoint {
            env.extend(self.serve_weights(&app.name, &rev.id, uri)?);
        }
        self.pool.add_target(TargetSpec {
            id: target.clone(),
            health: spec.health.clone(),
            engine: spec.engine.clone(),
            revision: rev.id.clone(),
            command: spec.command.clone(),
            env,
            checkpoint: spec.checkpoint.clone(),
            workdir: self.workdir.clone(),
            concurrency: spec.concurrency,
            gpus: spec.gpus,
            startup_timeout: spec.startup_timeout,
            stop_grace: self.config.backend.stop_grace,
            image: spec.image.clone(),
            pod: spec.kubernetes.clone(),
        });
        let min = spec.autoscale.min;
        let a = Arc::new(App::new(spec, target.clone()));
        self.revisions.write().insert(target.clone(), a.clone());
        app.add_live(a.clone());
        // Replicas an earlier leader left for it are taken over, and kept
        // as long as the autoscaler would have kept replicas it started.
        let adoptable = self.pool.adoptable(&target);
        if adoptable > 0 {
            a.adopt(adoptable, self.now());
        }
        self.pool.scale(&target, min.max(adoptable));
        Ok(a)
    }

    /// Takes back a target that an in-place promotion gave to a later
    /// revision, now that it runs nothing: `rev` starts on it from now on.
    fn rebind(
        &self,
        app: &Served,
        rev: &Revision,
        target: &TargetId,
    ) -> Result<Arc<App>, ApiError> {
        let mut spec: AppSpec =
            serde_json::from_str(&rev.spec).unwrap_or_else(|_| (*app.spec()).clone());
        spec.checkpoint = rev.checkpoint.clone();
        let mut env = spec.env.clone();
        if let Some(uri) = &spec.checkpoint {
            env.extend(self.serve_weights(&app.name, &rev.id, uri)?);
        }
        self.pool.update_target(target, |t| {
            t.revision = rev.id.clone();
            t.checkpoint = spec.checkpoint.clone();
            t.env = env;
        });
        let a = Arc::new(App::new(spec, target.clone()));
        self.revisions.write().insert(target.clone(), a.clone());
        app.add_live(a.clone());
        Ok(a)
    }

    /// The pool-manager target the serving revision's replicas run on:
    /// its own, or the one it took over in place.
    fn serving_target(&self, app: &Served, h: &History) -> Option<TargetId> {
        let serving = h.serving()?;
        self.target_of(app, &serving.id)
            .or_else(|| Some(serving.target()))
    }

    /// Serves a revision's checkpoint to its workers: the variables that
    /// tell them where it is and the token that lets them read it.
    pub(crate) fn serve_weights(
        &self,
        app: &str,
        revision: &str,
        uri: &str,
    ) -> Result<[(String, String); 1], ApiError> {
        let src = self
            .weights
            .open(uri)
            .map_err(|e| ApiError::new(e.kind, format!("revision {revision}: {}", e.message)))?;
        self.weights.register(app, revision, src);
        // Each replica gets its own weights token as it launches (the
        // replica sink mints it).
        Ok([(
            "WARMGATE_WEIGHTS_URL".into(),
            format!("http://{}/v1/weights/{app}/{revision}", self.reach),
        )])
    }

    /// Promotes a new checkpoint: checks it, makes a revision, and starts
    /// the promotion. Returns the revision id.
    pub(crate) async fn promote(
        self: &Arc<Self>,
        app: &Arc<Served>,
        req: PromoteRequest,
    ) -> Result<String, ApiError> {
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
            return Err(ApiError::new(
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
    ) -> Result<String, ApiError> {
        let started = match p.plan.in_place {
            true => p
                .from
                .as_deref()
                .and_then(|f| app.revision(f))
                .ok_or_else(|| {
                    ApiError::new(
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
    pub(crate) fn rollback(self: &Arc<Self>, app: &Arc<Served>) -> Result<String, ApiError> {
        Self::refuse_if_pool_served(app)?;
        let running = app
            .history
            .lock()
            .promotion
            .clone()
            .filter(|p| !p.phase.is_terminal());
        if let Some(p) = running {
            let back = p.from.clone().ok_or_else(|| {
                ApiError::new(
                    ErrorKind::Conflict,
                    format!("app '{}' has no earlier revision", app.name),
                )
            })?;
            let reason = "requested by an operator".to_string();
            let (next, fx) = p
                .on(Event::Rollback(reason.clone()))
                .map_err(|e| ApiError::new(ErrorKind::Conflict, e.to_string()))?;
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
                ApiError::new(
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
                return Err(ApiError::new(
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
    ) -> Result<String, ApiError> {
        let app = self.app(name)?;
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
    ) -> Result<String, ApiError> {
        let config = serde_json::to_string(&spec).map_err(|e| {
            ApiError::new(ErrorKind::Internal, format!("cannot encode the spec: {e}"))
        })?;
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
    pub(crate) fn forget_spec(&self, app: &Served, note: &str) -> Result<(), ApiError> {
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
            return Err(ApiError::new(
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
    fn refuse_if_pool_served(app: &Served) -> Result<(), ApiError> {
        match &app.spec().pool {
            Some(pool) => Err(ApiError::new(
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

    pub(crate) fn refuse_if_promoting(&self, app: &Served) -> Result<(), ApiError> {
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

    /// Takes the step from `from` to `next`: saved first, then applied in
    /// memory, then acted on. `Conflict` when the promotion is no longer
    /// at `from` (another step got there first: nothing is done);
    /// `Internal` when the save failed (nothing changed, in memory or
    /// outside).
    fn step(
        self: &Arc<Self>,
        app: &Arc<Served>,
        from: &Promotion,
        next: &Promotion,
        fx: Vec<Effect>,
        note: &str,
    ) -> Result<(), ApiError> {
        {
            let mut h = app.history.lock();
            if h.promotion.as_ref() != Some(from) {
                return Err(ApiError::new(
                    ErrorKind::Conflict,
                    format!(
                        "the promotion of {} moved on before this step: {note}",
                        from.to
                    ),
                ));
            }
            self.commit(app, &mut h, None, next, &fx, note)?;
        }
        self.act(app, &fx);
        Ok(())
    }

    /// Saves `h` with `new` added and the step applied, and only then
    /// makes it the history in memory. On a failed save `h` is untouched.
    fn commit(
        &self,
        app: &Served,
        h: &mut History,
        new: Option<Revision>,
        p: &Promotion,
        fx: &[Effect],
        note: &str,
    ) -> Result<(), ApiError> {
        self.commit_spec(app, h, new, None, p, fx, note)
    }

    /// [`Self::commit`], recording `config` as the spec the app's
    /// revisions are now made from when given.
    #[allow(clippy::too_many_arguments)]
    fn commit_spec(
        &self,
        app: &Served,
        h: &mut History,
        new: Option<Revision>,
        config: Option<String>,
        p: &Promotion,
        fx: &[Effect],
        note: &str,
    ) -> Result<(), ApiError> {
        let mut next = h.clone();
        next.revisions.extend(new);
        if config.is_some() {
            next.config = config;
        }
        next.apply(p, fx);
        if let Err(e) = self.store.save(&app.name, &next, note) {
            tracing::error!(app = %app.name, error = %e, "a promotion step could not be saved: {note}");
            return Err(ApiError::new(
                ErrorKind::Internal,
                format!(
                    "the gateway could not save this step, so it did not take it ({note}): {e}"
                ),
            ));
        }
        *h = next;
        tracing::info!(app = %app.name, to = %p.to, phase = ?p.phase, "{note}");
        Ok(())
    }

    fn act(self: &Arc<Self>, app: &Arc<Served>, fx: &[Effect]) {
        for e in fx {
            match e {
                Effect::Start(id) if app.revision(id).is_some_and(|a| a.is_guest()) => {
                    // In place: nothing starts; the serving revision keeps
                    // every replica it has while they are swapped.
                    if let Some(guest) = app.revision(id)
                        && let Some(host) = self.revisions.read().get(&guest.target)
                    {
                        host.hold(host.ready_replicas() as u32);
                    }
                }
                Effect::Retire(id) if app.revision(id).is_some_and(|a| a.is_guest()) => {
                    // Rolled back or failed in place: the replicas it took
                    // load the old weights again.
                    let guest = app.revision(id).expect("checked above");
                    guest.hold(0);
                    let host = self.revisions.read().get(&guest.target).cloned();
                    match host {
                        Some(host) => self.send_back(app.clone(), guest, host),
                        None => {
                            guest.retire();
                            self.guests.write().remove(&guest.target);
                            self.weights.unregister(&app.name, id);
                            app.remove_live(id);
                        }
                    }
                }
                Effect::Retire(id)
                    if app.revision(id).is_some_and(|a| self.hosts_live_guest(&a)) =>
                {
                    // Promoted in place: the new revision keeps the
                    // replicas, and the target is its own now.
                    let from = app.revision(id).expect("checked above");
                    self.settle_guest(app, &from);
                }
                Effect::Start(id) => {
                    // As many replicas as the serving revision has, so the
                    // switch does not shrink capacity; at least one.
                    let n = app
                        .serving()
                        .map_or(1, |s| s.ready_replicas().max(1) as u32);
                    if let Some(a) = app.revision(id) {
                        a.hold(n);
                    }
                    if let Some(target) = self.target_of(app, id) {
                        self.pool.scale(&target, n);
                    }
                }
                Effect::Traffic(split) => app.set_split(split),
                Effect::State(..) => {}
                Effect::Retire(id) => {
                    if let Some(a) = app.revision(id) {
                        a.hold(0);
                    }
                    // Its checkpoint is no longer served, nor its token
                    // honoured; a rollback to it serves them again.
                    self.weights.unregister(&app.name, id);
                    app.remove_live(id);
                    if let Some(target) = self.target_of(app, id) {
                        self.pool.scale(&target, 0);
                    }
                }
            }
        }
    }

    /// Runs a promotion to its end: waits for the new revision's replicas,
    /// bakes the canary while watching its error rate, honours an
    /// operator's rollback.
    async fn drive(self: Arc<Self>, app: Arc<Served>) {
        let mut since = Instant::now();
        // The phase, and whether it is in place (a fallback to new replicas
        // stays warming, and its start has its whole time).
        let mut phase_seen: Option<(Phase, bool)> = None;
        let mut baseline = (0u64, 0u64);
        // A step whose save failed: taken again, as it was decided, until
        // it is saved or the promotion moves on (an operator's rollback).
        let mut unsaved: Option<(Promotion, Promotion, Vec<Effect>, String)> = None;
        loop {
            let Some(p) = app.history.lock().promotion.clone() else {
                return;
            };
            if p.phase.is_terminal() {
                for a in app.live() {
                    // A swap back holds its host's floor until it is done.
                    if !self.hands_over(&a) {
                        a.hold(0);
                    }
                }
                return;
            }
            if let Some((from, next, fx, note)) = unsaved.take()
                && from == p
            {
                match self.step(&app, &from, &next, fx.clone(), &note) {
                    Err(e) if e.kind == ErrorKind::Internal => {
                        unsaved = Some((from, next, fx, note));
                        tokio::time::sleep(STEP).await;
                    }
                    _ => {}
                }
                continue;
            }
            let to = app.revision(&p.to);
            let seen = (p.phase.clone(), p.plan.in_place);
            if phase_seen.as_ref() != Some(&seen) {
                since = Instant::now();
                phase_seen = Some(seen);
                baseline = to.as_ref().map_or((0, 0), |a| a.health());
            }
            // A step taken meanwhile by someone else (an operator's
            // rollback during a swap) ends this one's turn.
            let moved_on = |app: &Served| app.history.lock().promotion.as_ref() != Some(&p);
            let event = if let Some(reason) = app.rollback.lock().take() {
                Some(Event::Rollback(reason))
            } else {
                match p.phase {
                    Phase::Warming if p.plan.in_place => match self.warm_in_place(&app, &p).await {
                        _ if moved_on(&app) => continue,
                        Event::Ready => {
                            let mut gate = self.gate(&app, Evaluated::Revision(&p.to)).await;
                            // Judged on replicas it no longer has (one
                            // crashed): the verdict was not about them.
                            if gate == Event::Ready
                                && app.revision(&p.to).is_some_and(|a| a.ready_replicas() == 0)
                            {
                                gate = Event::Unhealthy("the gate's replicas were lost".into());
                            }
                            if gate == Event::Ready && p.plan.canary.is_none() && !moved_on(&app) {
                                // Nothing to bake: every replica moves now.
                                self.commit_in_place(&app, &p).await;
                            }
                            Some(gate)
                        }
                        other => Some(other),
                    },
                    Phase::Warming => match self.warming(&app, &p, since) {
                        Some(Event::Ready) => {
                            Some(self.gate(&app, Evaluated::Revision(&p.to)).await)
                        }
                        other => other,
                    },
                    Phase::Canary => match canary(&app, &p, to.as_deref(), baseline, since) {
                        // Its replicas were all lost (crashed, stopped):
                        // nothing is left to judge, and its share of the
                        // traffic is sent back to where replicas are.
                        _ if p.plan.in_place
                            && to.as_ref().is_some_and(|a| a.ready_replicas() == 0) =>
                        {
                            Some(Event::Unhealthy("the canary's replicas were lost".into()))
                        }
                        Some(Event::BakeElapsed) if p.plan.in_place => {
                            // The canary passed: the rest of the replicas
                            // swap before the last step retires the old.
                            self.commit_in_place(&app, &p).await;
                            Some(Event::BakeElapsed)
                        }
                        other => other,
                    },
                    _ => None,
                }
            };
            let event = match event {
                Some(Event::InPlaceUnsupported(why)) => Some(self.fall_back(&app, &p, why)),
                other => other,
            };
            if let Some(event) = event {
                let note = match &event {
                    Event::Ready => format!("{} is ready", p.to),
                    Event::StartFailed(r) => format!("{} failed to start: {r}", p.to),
                    Event::BakeElapsed => format!("{} baked; it takes all traffic", p.to),
                    Event::Unhealthy(r) if p.phase == Phase::Warming => {
                        format!("{} not promoted: {r}", p.to)
                    }
                    Event::Unhealthy(r) => format!("{} rolled back: {r}", p.to),
                    Event::Rollback(r) => format!("{} rolled back: {r}", p.to),
                    Event::InPlaceUnsupported(r) => {
                        format!(
                            "{} starts new replicas instead of swapping in place: {r}",
                            p.to
                        )
                    }
                };
                match p.on(event) {
                    Ok((next, fx)) => match self.step(&app, &p, &next, fx.clone(), &note) {
                        Err(e) if e.kind == ErrorKind::Internal => {
                            unsaved = Some((p, next, fx, note));
                            tokio::time::sleep(STEP).await;
                        }
                        Err(e) => {
                            tracing::debug!(app = %app.name, error = %e.message, "promotion step overtaken")
                        }
                        Ok(()) => {}
                    },
                    Err(e) => {
                        tracing::warn!(app = %app.name, error = %e, "promotion event ignored")
                    }
                }
                continue;
            }
            tokio::time::sleep(STEP).await;
        }
    }

    /// Watches an app's `promotion.watch` prefix until the gateway stops:
    /// the newest checkpoint folder whose marker file exists, and that no
    /// revision has used yet, is promoted. A folder without its marker (a
    /// checkpoint still being written) is never looked at.
    pub(crate) async fn watch(self: Arc<Self>, app: Arc<Served>) {
        let Some(uri) = app.spec().promotion.watch.clone() else {
            return;
        };
        let marker = app.spec().promotion.marker.clone();
        let every = app.spec().promotion.watch_interval;
        let source = match self.weights.open(&uri) {
            Ok(s) => s,
            Err(e) => {
                tracing::error!(app = %app.name, %uri, error = %e.message, "cannot watch for checkpoints");
                return;
            }
        };
        let generation = app.watcher();
        loop {
            if app.is_removed() || app.watcher() != generation {
                // Deleted, or its watch settings changed (a new watcher
                // took over, if it still watches).
                return;
            }
            match newest_complete(&source, &marker).await {
                Ok(Some(folder)) => {
                    let checkpoint = format!("{}/{folder}", uri.trim_end_matches('/'));
                    let known = {
                        let h = app.history.lock();
                        h.promoting()
                            || h.revisions
                                .iter()
                                .any(|r| r.checkpoint.as_deref() == Some(checkpoint.as_str()))
                    };
                    if !known {
                        tracing::info!(app = %app.name, %checkpoint, "a new checkpoint is complete; promoting it");
                        let req = PromoteRequest {
                            checkpoint,
                            canary: None,
                            bake: None,
                            in_place: None,
                        };
                        if let Err(e) = self.promote(&app, req).await {
                            tracing::warn!(app = %app.name, error = %e.message, "the watcher could not promote");
                        }
                    }
                }
                Ok(None) => {}
                Err(e) => tracing::debug!(app = %app.name, error = %e, "nothing to watch yet"),
            }
            app.watch_scans
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            tokio::time::sleep(every).await;
        }
    }

    /// The evaluation gate, when the app has one: `Ready` when it passes,
    /// `Unhealthy` with its output when it fails or runs out of time.
    pub(crate) async fn gate(&self, app: &Served, what: Evaluated<'_>) -> Event {
        let whole = app.spec();
        let spec = &whole.promotion;
        if spec.gate_command.is_empty() && spec.gate_url.is_none() {
            return Event::Ready;
        }
        let (rev, model) = match what {
            Evaluated::Revision(rev) => (rev, None),
            Evaluated::Adapter { model, revision } => (revision, Some(model)),
        };
        let endpoint = format!("http://{}/apps/{}", self.reach, app.name);
        let run = async {
            if let Some((program, args)) = spec.gate_command.split_first() {
                // As a worker, not as the gateway: see `crate::gate`. It
                // gets what the app's workers are given (`env`), and where
                // to evaluate.
                let mut vars: Vec<(&str, String)> = whole
                    .env
                    .iter()
                    .map(|(k, v)| (k.as_str(), v.clone()))
                    .collect();
                vars.extend([
                    ("WARMGATE_EVAL_URL", endpoint.clone()),
                    (
                        "WARMGATE_EVAL_OPENAI_BASE",
                        format!("http://{}/v1", self.reach),
                    ),
                    ("WARMGATE_EVAL_REVISION", rev.to_string()),
                    ("WARMGATE_EVAL_APP", app.name.clone()),
                ]);
                if let Some(model) = model {
                    vars.push(("WARMGATE_EVAL_MODEL", model.to_string()));
                }
                crate::gate::run(program, args, &vars, self.workdir.as_deref()).await?;
            }
            if let Some(url) = &spec.gate_url {
                let body = match model {
                    None => serde_json::json!({
                        "app": app.name,
                        "revision": rev,
                        "endpoint": endpoint,
                        "openai_base": format!("http://{}/v1", self.reach),
                        "headers": {"X-Warmgate-Revision": rev},
                    }),
                    Some(model) => serde_json::json!({
                        "app": app.name,
                        "revision": rev,
                        "model": model,
                        "endpoint": endpoint,
                        "openai_base": format!("http://{}/v1", self.reach),
                        "headers": {"X-Warmgate-Revision": rev},
                    }),
                };
                let status = self.upstream.post_json(url, &body).await?;
                if !(200..300).contains(&status) {
                    return Err(format!("{url} answered {status}"));
                }
            }
            Ok(())
        };
        match tokio::time::timeout(spec.gate_timeout, run).await {
            Ok(Ok(())) => Event::Ready,
            Ok(Err(why)) => Event::Unhealthy(format!("the evaluation gate failed: {why}")),
            Err(_) => Event::Unhealthy(format!(
                "the evaluation gate did not finish within {}",
                humantime::format_duration(spec.gate_timeout)
            )),
        }
    }

    /// Warming in place: the canary's replicas (every replica, without a
    /// canary) swap to the new weights. `Ready` once they have.
    async fn warm_in_place(&self, app: &Served, p: &Promotion) -> Event {
        let host = p.from.as_deref().and_then(|f| app.revision(f));
        let (Some(host), Some(guest)) = (host, app.revision(&p.to)) else {
            return Event::StartFailed("the serving revision is gone".into());
        };
        let n = host.ready_replicas() + guest.ready_replicas();
        let want = match p.plan.canary {
            // The share was made from whole replicas (`canary_replicas`).
            Some(share) => ((n * usize::from(share) + 50) / 100).clamp(1, n.max(1)),
            // One, for the gate; the rest once it has passed.
            None => 1,
        };
        // Pinned requests only until the gate has passed (an app of one
        // replica sends its traffic on to it: it has no other).
        let m = crate::inplace::Move {
            app,
            from: &host,
            to: &guest,
            version: seq_of(app, &p.to),
            direction: crate::inplace::Direction::Forward,
            follow: false,
        };
        match self
            .swap(&m, want.saturating_sub(guest.ready_replicas()), true)
            .await
        {
            Ok(_) if guest.ready_replicas() > 0 => Event::Ready,
            Ok(_) => Event::StartFailed("no replica could be swapped in place".into()),
            Err(crate::inplace::SwapError::Unsupported(why)) => Event::InPlaceUnsupported(why),
            Err(crate::inplace::SwapError::Failed(why) | crate::inplace::SwapError::Busy(why)) => {
                Event::StartFailed(format!("swapping in place failed: {why}"))
            }
        }
    }

    /// The in-place canary passed: the target starts the new revision from
    /// now on, and every other replica swaps.
    async fn commit_in_place(&self, app: &Served, p: &Promotion) {
        let host = p.from.as_deref().and_then(|f| app.revision(f));
        let rev = app.history.lock().get(&p.to).cloned();
        let (Some(host), Some(guest), Some(rev)) = (host, app.revision(&p.to), rev) else {
            return;
        };
        let m = crate::inplace::Move {
            app,
            from: &host,
            to: &guest,
            version: u64::from(rev.seq),
            direction: crate::inplace::Direction::Forward,
            follow: true,
        };
        self.swap_rest(&m, &rev).await;
    }

    /// A worker cannot swap in place: the guest leaves, and the new
    /// revision gets a target of its own (the promotion's next step
    /// starts it). `StartFailed` when even that cannot be had.
    fn fall_back(&self, app: &Served, p: &Promotion, why: String) -> Event {
        if let Some(guest) = app.revision(&p.to) {
            self.guests.write().remove(&guest.target);
            app.remove_live(&p.to);
        }
        // Traffic as it was before the swap was tried.
        if let Some(from) = &p.from {
            app.set_split(&[(from.clone(), 100)]);
        }
        let rev = app.history.lock().get(&p.to).cloned();
        match rev.map(|rev| self.materialize(app, &rev)) {
            Some(Ok(_)) => Event::InPlaceUnsupported(why),
            Some(Err(e)) => Event::StartFailed(format!(
                "{why}; and new replicas cannot start: {}",
                e.message
            )),
            None => Event::StartFailed(why),
        }
    }

    /// During warming: ready, failed, or not yet.
    fn warming(&self, app: &Served, p: &Promotion, since: Instant) -> Option<Event> {
        let h = self.pool.health(&self.target_of(app, &p.to)?)?;
        if h.ready > 0 {
            return Some(Event::Ready);
        }
        if h.failing_to_start && h.starting == 0 {
            return Some(Event::StartFailed(
                h.last_error.unwrap_or_else(|| "it exited".into()),
            ));
        }
        let limit = app.spec().startup_timeout + Duration::from_secs(5);
        (since.elapsed() > limit).then(|| {
            Event::StartFailed(format!(
                "not ready within {}",
                humantime::format_duration(app.spec().startup_timeout)
            ))
        })
    }
}

/// The newest direct sub-folder of `source` holding `marker`, by the
/// marker's modification time.
pub(crate) async fn newest_complete(
    source: &warmgate_pool::weights::Source,
    marker: &str,
) -> Result<Option<String>, warmgate_pool::Error> {
    let objects = source.list().await?;
    let base = source.path_str().trim_end_matches('/');
    let newest = objects
        .iter()
        .filter_map(|o| {
            let path = o.location.as_ref();
            let rel = path.strip_prefix(base)?.trim_start_matches('/');
            let (folder, file) = rel.split_once('/')?;
            (file == marker && !folder.is_empty()).then(|| (o.last_modified, folder.to_string()))
        })
        .max();
    Ok(newest.map(|(_, f)| f))
}

/// During the canary: too many errors, baked, or not yet.
fn canary(
    app: &Served,
    p: &Promotion,
    to: Option<&App>,
    baseline: (u64, u64),
    since: Instant,
) -> Option<Event> {
    let baked = since.elapsed() >= p.plan.bake;
    if let Some(a) = to {
        let (answered, failed) = a.health();
        let answered = answered.saturating_sub(baseline.0);
        let failed = failed.saturating_sub(baseline.1);
        let rate = failed as f64 / answered.max(1) as f64;
        let whole = app.spec();
        let spec = &whole.promotion;
        // Fewer answers than `min_requests` by the end of the bake (a quiet
        // app): judged on those it has, rather than promoted unseen.
        if baked && answered < spec.min_requests && rate > spec.max_error_rate {
            return Some(Event::Unhealthy(format!(
                "error rate {:.0}% over the {answered} answers of its bake (fewer than \
                 min_requests = {}) is above {:.0}%",
                rate * 100.0,
                spec.min_requests,
                spec.max_error_rate * 100.0
            )));
        }
        if answered >= spec.min_requests && rate > spec.max_error_rate {
            return Some(Event::Unhealthy(format!(
                "error rate {:.0}% over {answered} answers is above {:.0}%",
                rate * 100.0,
                spec.max_error_rate * 100.0
            )));
        }
        if let Some(limit) = spec.max_p99
            && answered >= spec.min_requests
            && let Some(p99) = a.p99_since(baseline.0)
            && p99 > limit
        {
            return Some(Event::Unhealthy(format!(
                "p99 latency {:.0} ms over {answered} answers is above {:.0} ms",
                p99.as_secs_f64() * 1e3,
                limit.as_secs_f64() * 1e3
            )));
        }
    }
    baked.then_some(Event::BakeElapsed)
}

/// Makes `plan` an in-place one when the serving revision has ready
/// replicas to swap (the canary becomes whole replicas, and its share
/// theirs); returns how the promotion goes, for its note.
fn in_place_plan(
    plan: &mut Plan,
    app: &Served,
    from: Option<&str>,
    spec: &str,
    how: String,
) -> String {
    if plan.at_zero {
        return format!("{how}; at zero, nothing to swap in place");
    }
    let Some(host) = from.and_then(|f| app.revision(f)) else {
        return format!("{how}; no serving revision to swap in place");
    };
    // Only the weights change in place: the replicas must run the
    // revision's settings already (command, environment, resources).
    let wanted: Option<AppSpec> = serde_json::from_str(spec).ok();
    let same = wanted.is_some_and(|mut w| {
        let mut running = (*host.spec()).clone();
        w.checkpoint = None;
        running.checkpoint = None;
        w.autoscale = running.autoscale.clone();
        w.queue = running.queue.clone();
        w.promotion = running.promotion.clone();
        w == running
    });
    if !same {
        return format!("{how}; its settings differ from the serving replicas', so new replicas");
    }
    let n = host.ready_replicas();
    if n == 0 {
        return format!("{how}; no ready replica to swap in place, so new replicas");
    }
    let (k, share) = crate::inplace::canary_replicas(n, plan.canary);
    plan.in_place = true;
    plan.canary_asked = plan.canary;
    plan.canary = share;
    match share {
        Some(pct) => format!("in place: canary of {k} of {n} replicas, {pct}% of the traffic"),
        None => format!("in place: {n} replicas, one at a time, the first for the gate"),
    }
}

/// A revision's number, which its weights are versioned by when swapped
/// in place.
fn seq_of(app: &Served, id: &str) -> u64 {
    app.history.lock().get(id).map_or(0, |r| u64::from(r.seq))
}

fn removed_error(app: &str) -> ApiError {
    ApiError::new(ErrorKind::NotFound, format!("app '{app}' was deleted"))
}

fn promoting_error(app: &str, h: &History) -> ApiError {
    let to = h.promotion.as_ref().map_or("?", |p| p.to.as_str());
    ApiError::new(
        ErrorKind::Conflict,
        format!("app '{app}' is already promoting {to}; wait for it or roll back"),
    )
}

/// A new revision of `spec` on `checkpoint`.
fn new_revision(
    h: &History,
    spec: &AppSpec,
    checkpoint: Option<String>,
    checkpoint_version: Option<String>,
) -> Revision {
    let seq = h.next_seq();
    let mut spec = spec.clone();
    spec.checkpoint = checkpoint.clone();
    Revision {
        id: revision_id(&spec.name, seq),
        app: spec.name.clone(),
        seq,
        checkpoint,
        checkpoint_version,
        spec: serde_json::to_string(&spec).unwrap_or_default(),
        created_unix: unix_now(),
        state: RevisionState::Pending,
        traffic: 0,
        served: false,
    }
}

/// The checkpoint's identity at promotion time: each file's name, size and
/// ETag (or version), hashed.
fn fingerprint(items: &[warmgate_pool::weights::PullItem]) -> String {
    use sha2::Digest as _;
    let mut h = sha2::Sha256::new();
    for i in items {
        h.update(i.relative.to_string_lossy().as_bytes());
        h.update(i.meta.size.to_le_bytes());
        h.update(i.meta.e_tag.as_deref().unwrap_or("").as_bytes());
        h.update(i.meta.version.as_deref().unwrap_or("").as_bytes());
    }
    let hex = format!("{:x}", h.finalize());
    format!("sha256:{}", &hex[..16])
}
