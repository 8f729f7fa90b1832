//! Promotions of LoRA adapters, carried out: the pure steps of
//! `warmgate_deploy::adapter_promotion` decide, this module runs the gate,
//! watches the canary's answers, and makes the new revision the adapter's
//! checkpoint (saved as the app's spec, as a `PUT` of the adapter is).
//!
//! Nothing is persisted until the commit: a gateway that restarts during
//! an adapter's promotion comes back serving the old revision, the
//! promotion ended (as a rollback would).

use std::sync::Arc;
use std::time::{Duration, Instant};

use warmgate_deploy::adapter_promotion::{AdapterPlan, AdapterPromotion, AdapterStep};
use warmgate_deploy::revision::Event;

use crate::error::{Error, ErrorKind};
use crate::promote::Evaluated;
use crate::serving::adapter_split::AdapterCanary;
use crate::serving::served::Served;

use super::Changes;

/// How often a running promotion looks at its canary.
const STEP: Duration = Duration::from_millis(100);
/// How long a commit waits for another change of the app to finish
/// before the promotion gives up and rolls back.
const COMMIT_PATIENCE: Duration = Duration::from_secs(60);
/// The canary percent when neither the request nor the app names one:
/// the new revision takes every request of the adapter during the bake,
/// judged as a canary is.
const WHOLE: u8 = 100;

/// What `POST /v1/apps/{app}/promote` with `adapter` asks for.
#[derive(Debug, Clone)]
pub struct AdapterPromoteRequest {
    /// The adapter.
    pub adapter: String,
    /// The new revision's checkpoint (a `file://` folder).
    pub checkpoint: String,
    /// Canary percent (overrides the app's `promotion.canary`).
    pub canary: Option<u8>,
    /// Bake time (overrides the app's `promotion.bake`).
    pub bake: Option<Duration>,
}

impl Changes {
    /// Starts a promotion of one of `app`'s adapters; it runs on its own.
    /// Refused when the adapter is unknown, its promotion runs already,
    /// or the checkpoint is not one the engine may read.
    pub(crate) async fn promote_adapter(
        self: &Arc<Self>,
        app: &Arc<Served>,
        req: AdapterPromoteRequest,
    ) -> Result<Arc<AdapterCanary>, Error> {
        // Revisions are handed out one change at a time: a `PUT` of the
        // adapter and this never take the same number.
        let _one = self.lock.one_at_a_time().await;
        let spec = app.spec();
        let Some(adapter) = spec.adapters.get(&req.adapter) else {
            return Err(Error::new(
                ErrorKind::NotFound,
                format!("app '{}' has no adapter {:?}", app.name, req.adapter),
            ));
        };
        // Read as a `PUT` of the adapter reads it: relative to the
        // gateway's folder, a `file://` folder, under the allow-list.
        let mut probe = (*spec).clone();
        probe.adapters.models = vec![warmgate_deploy::AdapterSpec::new(
            adapter.name.clone(),
            req.checkpoint.clone(),
        )];
        if let Some(dir) = &self.host.workdir {
            probe.resolve_paths(dir);
        }
        let checkpoint = probe.adapters.models[0].checkpoint.clone();
        probe
            .adapters
            .validate(|k| k.to_string())
            .map_err(|(_, why)| Error::new(ErrorKind::BadRequest, why).param("checkpoint"))?;
        if self.host.config.backend.kind == warmgate_deploy::BackendKind::Kubernetes
            && !checkpoint.starts_with("file://")
        {
            return Err(Error::new(
                ErrorKind::BadRequest,
                "on the kubernetes backend the engine reads an adapter from a path in its own pod: \
                 give a file:// path on a volume the pods mount",
            )
            .param("checkpoint"));
        }
        self.weights.open(&checkpoint)?;
        if checkpoint == adapter.checkpoint {
            return Err(Error::new(
                ErrorKind::Conflict,
                format!(
                    "adapter {:?} serves {checkpoint} already (revision {})",
                    adapter.name, adapter.revision
                ),
            ));
        }
        let plan = AdapterPlan {
            canary: req.canary.or(spec.promotion.canary).unwrap_or(WHOLE),
            bake: req.bake.unwrap_or(spec.promotion.bake),
            min_requests: spec.promotion.min_requests,
            max_error_rate: spec.promotion.max_error_rate,
        };
        let canary = app
            .begin_adapter_promotion(&adapter.name, adapter.revision, |to| {
                AdapterCanary::new(AdapterPromotion::begin(
                    &adapter.name,
                    adapter.revision,
                    to,
                    &checkpoint,
                    plan,
                ))
            })
            .map_err(|running| {
                Error::new(
                    ErrorKind::Conflict,
                    format!(
                        "adapter {:?} is being promoted to revision {} already",
                        adapter.name,
                        running.to_revision()
                    ),
                )
            })?;
        tracing::info!(app = %app.name, adapter = %adapter.name, to = %canary.engine, checkpoint = %checkpoint, "adapter promotion started");
        tokio::spawn(self.clone().drive_adapter(app.clone(), canary.clone()));
        Ok(canary)
    }

    /// Starts the watcher of `app`'s adapters' training runs (`watch`),
    /// unless it runs already or no adapter has one.
    pub(crate) fn watch_adapters(self: &Arc<Self>, app: &Arc<Served>) {
        use std::sync::atomic::Ordering;
        if !app.spec().adapters.watched() || app.adapter_watcher.swap(true, Ordering::AcqRel) {
            return;
        }
        tokio::spawn(self.clone().follow_adapters(app.clone()));
    }

    /// Lists each watched adapter's prefix every `promotion.watch_interval`
    /// and promotes the newest complete checkpoint it has not seen; ends
    /// when the app is deleted or no adapter is watched any more.
    async fn follow_adapters(self: Arc<Self>, app: Arc<Served>) {
        loop {
            use std::sync::atomic::Ordering;
            let spec = app.spec();
            if app.is_removed() || !spec.adapters.watched() {
                app.adapter_watcher.store(false, Ordering::Release);
                // A change that added a watch just now found this one
                // still running, and left it the work.
                if !app.is_removed()
                    && app.spec().adapters.watched()
                    && !app.adapter_watcher.swap(true, Ordering::AcqRel)
                {
                    continue;
                }
                return;
            }
            for a in spec.adapters.models.iter() {
                let Some(uri) = &a.watch else { continue };
                let source = match self.weights.open(uri) {
                    Ok(s) => s,
                    Err(e) => {
                        tracing::warn!(app = %app.name, adapter = %a.name, %uri, error = %e.message, "cannot watch the adapter's checkpoints");
                        continue;
                    }
                };
                let folder = match crate::promote::newest_complete(&source, &spec.promotion.marker)
                    .await
                {
                    Ok(Some(f)) => f,
                    Ok(None) => continue,
                    Err(e) => {
                        tracing::debug!(app = %app.name, adapter = %a.name, error = %e, "nothing to watch yet");
                        continue;
                    }
                };
                let checkpoint = format!("{}/{folder}", uri.trim_end_matches('/'));
                let seen = a.checkpoint == checkpoint
                    || app.adapter_promotion(&a.name).is_some_and(|c| {
                        let p = c.promotion.lock();
                        p.checkpoint == checkpoint || !p.phase.is_terminal()
                    });
                if seen {
                    continue;
                }
                tracing::info!(app = %app.name, adapter = %a.name, %checkpoint, "a new adapter checkpoint is complete; promoting it");
                let req = AdapterPromoteRequest {
                    adapter: a.name.clone(),
                    checkpoint,
                    canary: None,
                    bake: None,
                };
                if let Err(e) = self.promote_adapter(&app, req).await {
                    tracing::warn!(app = %app.name, adapter = %a.name, error = %e.message, "the watcher could not promote the adapter");
                }
            }
            tokio::time::sleep(spec.promotion.watch_interval).await;
        }
    }

    /// Runs one adapter promotion to its end.
    async fn drive_adapter(self: Arc<Self>, app: Arc<Served>, c: Arc<AdapterCanary>) {
        let started = Instant::now();
        // A gate written for revisions pins the app's serving revision
        // with `X-Warmgate-Revision`; the adapter's new revision is the
        // model it names.
        let serving = app
            .history
            .lock()
            .serving()
            .map(|r| r.id.clone())
            .unwrap_or_default();
        let outcome = match self
            .promotions
            .gate(
                &app,
                Evaluated::Adapter {
                    model: c.engine.as_ref(),
                    revision: &serving,
                },
            )
            .await
        {
            Event::Ready => Ok(()),
            Event::Unhealthy(why) => Err(why),
            other => Err(format!("the gate ended as {other:?}")),
        };
        let mut step = c.promotion.lock().gated(started.elapsed(), outcome);
        while step == AdapterStep::Wait && c.running() {
            tokio::time::sleep(STEP).await;
            if app.is_removed() {
                step = c.promotion.lock().roll_back("the app was deleted".into());
                break;
            }
            let (answered, failed) = c.counts();
            step = c
                .promotion
                .lock()
                .observe(started.elapsed(), answered, failed);
        }
        if step == AdapterStep::Commit {
            let (name, checkpoint, to) = {
                let p = c.promotion.lock();
                (p.adapter.clone(), p.checkpoint.clone(), p.to_revision)
            };
            match self.commit_adapter(&app, &c, &name, &checkpoint, to).await {
                Ok(()) => c.promotion.lock().committed(),
                Err(e) => {
                    c.promotion.lock().roll_back(format!(
                        "could not make it the adapter's checkpoint: {}",
                        e.message
                    ));
                }
            }
        }
        let p = c.promotion.lock().clone();
        let labels = [
            ("app", app.name.clone()),
            ("outcome", format!("{:?}", p.phase).to_lowercase()),
        ];
        metrics::counter!("warmgate_adapter_promotions_total", &labels).increment(1);
        match &p.reason {
            Some(why) => {
                tracing::warn!(app = %app.name, adapter = %p.adapter, to = %c.engine, reason = %why, "adapter promotion rolled back");
            }
            None => {
                tracing::info!(app = %app.name, adapter = %p.adapter, to = %c.engine, "adapter promoted");
            }
        }
    }

    /// Makes revision `to` at `checkpoint` adapter `name`'s, as a change
    /// of the app's spec; waits (bounded) for another change to finish.
    async fn commit_adapter(
        self: &Arc<Self>,
        app: &Arc<Served>,
        c: &AdapterCanary,
        name: &str,
        checkpoint: &str,
        to: u32,
    ) -> Result<(), Error> {
        let until = Instant::now() + COMMIT_PATIENCE;
        loop {
            // Rolled back meanwhile (the adapter was changed or deleted, the
            // app deleted): nothing is committed over that change.
            if !c.running() || app.is_removed() {
                return Err(Error::new(
                    ErrorKind::Conflict,
                    "the adapter or its app changed during its promotion",
                ));
            }
            let from = c.promotion.lock().from_revision;
            let mut spec = (*app.spec()).clone();
            let Some(a) = spec.adapters.models.iter_mut().find(|a| a.name == name) else {
                return Err(Error::new(
                    ErrorKind::NotFound,
                    "the adapter was deleted during its promotion",
                ));
            };
            if a.revision != from {
                return Err(Error::new(
                    ErrorKind::Conflict,
                    format!(
                        "the adapter moved to revision {} during its promotion",
                        a.revision
                    ),
                ));
            }
            a.checkpoint = checkpoint.to_string();
            a.revision = to;
            match self.put_app_adapters(spec).await {
                Err(e) if e.kind == ErrorKind::Conflict && Instant::now() < until => {
                    tokio::time::sleep(STEP * 5).await;
                }
                other => return other.map(|_| ()),
            }
        }
    }
}
