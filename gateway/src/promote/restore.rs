//! Revisions made routable: an app's history restored at a start, a
//! revision's dispatcher, pool-manager target and weights materialized,
//! and new revisions made.

use std::sync::Arc;
use std::time::Duration;

use warmgate_deploy::revision::{
    Effect, Event, History, Phase, Plan, Promotion, Revision, RevisionState, revision_id,
};
use warmgate_deploy::store::unix_now;
use warmgate_deploy::{AppSpec, TargetId};
use warmgate_pool::TargetSpec;

use super::Promotions;
use crate::error::{Error, ErrorKind};
use crate::serving::dispatch::App;
use crate::serving::served::Served;

impl Promotions {
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
                // The spec as it is: the JSON just compared is the revision's.
                let rev = revision_of(
                    &h,
                    &app.name,
                    app.spec().checkpoint.clone(),
                    None,
                    config.clone(),
                );
                let id = rev.id.clone();
                h.revisions.push(rev);
                h.config = Some(config.clone());
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
                self.materialize_from(app, r, Some(&config))
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
    pub(crate) fn materialize(&self, app: &Served, rev: &Revision) -> Result<Arc<App>, Error> {
        self.materialize_from(app, rev, None)
    }

    /// [`Promotions::materialize`], given the JSON of the app's spec: a
    /// revision made from that very spec (every app's at a start) takes
    /// it as it is rather than parsing its copy.
    fn materialize_from(
        &self,
        app: &Served,
        rev: &Revision,
        spec_json: Option<&str>,
    ) -> Result<Arc<App>, Error> {
        let target = rev.target();
        let existing = self.revisions.read().get(&target).cloned();
        if let Some(a) = existing.as_ref().filter(|a| a.revision != rev.id) {
            // The target's replicas run a later revision, promoted in
            // place onto them. With none running it is taken back below;
            // otherwise only an in-place promotion may use them.
            let idle = a.ready_replicas() == 0 && self.pool.desired(&target).unwrap_or(0) == 0;
            if !idle {
                return Err(Error::new(
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
        let mut spec: AppSpec = if spec_json == Some(rev.spec.as_str()) {
            (*app.spec()).clone()
        } else {
            serde_json::from_str(&rev.spec).unwrap_or_else(|_| (*app.spec()).clone())
        };
        spec.checkpoint = rev.checkpoint.clone();
        let mut env = spec.env.clone();
        if let Some(uri) = &spec.checkpoint {
            env.extend(self.serve_weights(&app.name, &rev.id, uri)?);
        }
        self.pool.add_target(TargetSpec {
            id: target.clone(),
            health: spec.health.clone(),
            listen: spec.listen,
            engine: spec.engine.clone(),
            revision: rev.id.clone(),
            command: spec.command.clone(),
            env,
            checkpoint: spec.checkpoint.clone(),
            workdir: self.host.workdir.clone(),
            concurrency: spec.concurrency,
            gpus: spec.gpus,
            startup_timeout: spec.startup_timeout,
            stop_grace: self.host.config.backend.stop_grace,
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
            a.adopt(adoptable, self.host.now());
        }
        self.pool.scale(&target, min.max(adoptable));
        Ok(a)
    }

    /// Takes back a target that an in-place promotion gave to a later
    /// revision, now that it runs nothing: `rev` starts on it from now on.
    fn rebind(&self, app: &Served, rev: &Revision, target: &TargetId) -> Result<Arc<App>, Error> {
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
    pub(super) fn serving_target(&self, app: &Served, h: &History) -> Option<TargetId> {
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
    ) -> Result<[(String, String); 1], Error> {
        let src = self
            .weights
            .open(uri)
            .map_err(|e| Error::new(e.kind, format!("revision {revision}: {}", e.message)))?;
        self.weights.register(app, revision, src);
        // Each replica gets its own weights token as it launches (the
        // replica sink mints it).
        Ok([(
            "WARMGATE_WEIGHTS_URL".into(),
            self.host.weights_url(app, revision),
        )])
    }
}

/// A new revision of `spec` on `checkpoint`.
pub(super) fn new_revision(
    h: &History,
    spec: &AppSpec,
    checkpoint: Option<String>,
    checkpoint_version: Option<String>,
) -> Revision {
    let mut spec = spec.clone();
    spec.checkpoint = checkpoint.clone();
    let json = serde_json::to_string(&spec).unwrap_or_default();
    revision_of(h, &spec.name, checkpoint, checkpoint_version, json)
}

/// The next revision of `app`, of the spec whose JSON is `spec`.
fn revision_of(
    h: &History,
    app: &str,
    checkpoint: Option<String>,
    checkpoint_version: Option<String>,
    spec: String,
) -> Revision {
    let seq = h.next_seq();
    Revision {
        id: revision_id(app, seq),
        app: app.to_string(),
        seq,
        checkpoint,
        checkpoint_version,
        spec,
        created_unix: unix_now(),
        state: RevisionState::Pending,
        traffic: 0,
        served: false,
    }
}

/// The checkpoint's identity at promotion time: each file's name, size and
/// ETag (or version), hashed.
pub(super) fn fingerprint(items: &[warmgate_pool::weights::PullItem]) -> String {
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
