//! A promotion's steps, each saved and then acted on, and the driver that
//! takes it from warming through the canary to its end.

use std::sync::Arc;
use std::time::{Duration, Instant};

use warmgate_deploy::revision::{Effect, Event, History, Phase, Promotion, Revision};

use super::Promotions;
use crate::error::{Error, ErrorKind};
use crate::serving::dispatch::App;
use crate::serving::served::Served;

use super::Evaluated;

/// How often a running promotion looks at its new revision.
const STEP: Duration = Duration::from_millis(100);

impl Promotions {
    /// Takes the step from `from` to `next`: saved first, then applied in
    /// memory, then acted on. `Conflict` when the promotion is no longer
    /// at `from` (another step got there first: nothing is done);
    /// `Internal` when the save failed (nothing changed, in memory or
    /// outside).
    pub(super) fn step(
        self: &Arc<Self>,
        app: &Arc<Served>,
        from: &Promotion,
        next: &Promotion,
        fx: Vec<Effect>,
        note: &str,
    ) -> Result<(), Error> {
        {
            let mut h = app.history.lock();
            if h.promotion.as_ref() != Some(from) {
                return Err(Error::new(
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
    pub(super) fn commit(
        &self,
        app: &Served,
        h: &mut History,
        new: Option<Revision>,
        p: &Promotion,
        fx: &[Effect],
        note: &str,
    ) -> Result<(), Error> {
        self.commit_spec(app, h, new, None, p, fx, note)
    }

    /// [`Self::commit`], recording `config` as the spec the app's
    /// revisions are now made from when given.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn commit_spec(
        &self,
        app: &Served,
        h: &mut History,
        new: Option<Revision>,
        config: Option<String>,
        p: &Promotion,
        fx: &[Effect],
        note: &str,
    ) -> Result<(), Error> {
        let mut next = h.clone();
        next.revisions.extend(new);
        if config.is_some() {
            next.config = config;
        }
        next.apply(p, fx);
        if let Err(e) = self.store.save(&app.name, &next, note) {
            tracing::error!(app = %app.name, error = %e, "a promotion step could not be saved: {note}");
            return Err(Error::new(
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

    pub(super) fn act(self: &Arc<Self>, app: &Arc<Served>, fx: &[Effect]) {
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
    pub(super) async fn drive(self: Arc<Self>, app: Arc<Served>) {
        let mut since = Instant::now();
        // The phase, and whether it is in place (a fallback to new replicas
        // stays warming, and its start has its whole time).
        let mut phase_seen: Option<(Phase, bool)> = None;
        let mut baseline = (0u64, 0u64);
        // A step whose save failed: taken again, as it was decided, until
        // it is saved or the promotion moves on (an operator's rollback).
        let mut unsaved: Option<Unsaved> = None;
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
                        Event::Ready => Some(self.gate_in_place(&app, &p).await),
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
                unsaved = self.take_event(&app, p, event).await;
                continue;
            }
            tokio::time::sleep(STEP).await;
        }
    }

    /// The gate's verdict on a revision warmed in place; when it passes
    /// and there is no canary to bake, every replica moves to it.
    async fn gate_in_place(self: &Arc<Self>, app: &Arc<Served>, p: &Promotion) -> Event {
        let mut gate = self.gate(app, Evaluated::Revision(&p.to)).await;
        // Judged on replicas it no longer has (one crashed): the verdict
        // was not about them.
        if gate == Event::Ready && app.revision(&p.to).is_some_and(|a| a.ready_replicas() == 0) {
            gate = Event::Unhealthy("the gate's replicas were lost".into());
        }
        let moved_on = app.history.lock().promotion.as_ref() != Some(p);
        if gate == Event::Ready && p.plan.canary.is_none() && !moved_on {
            // Nothing to bake: every replica moves now.
            self.commit_in_place(app, p).await;
        }
        gate
    }

    /// Takes the step `event` leads `p` to; the step, when its save
    /// failed, to be taken again.
    async fn take_event(
        self: &Arc<Self>,
        app: &Arc<Served>,
        p: Promotion,
        event: Event,
    ) -> Option<Unsaved> {
        let note = note_of(&p, &event);
        match p.on(event) {
            Ok((next, fx)) => match self.step(app, &p, &next, fx.clone(), &note) {
                Err(e) if e.kind == ErrorKind::Internal => {
                    tokio::time::sleep(STEP).await;
                    return Some((p, next, fx, note));
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
        None
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

/// A step whose save failed, as it was decided: the promotion it was
/// taken from, the one it leads to, its effects and its note.
type Unsaved = (Promotion, Promotion, Vec<Effect>, String);

/// The history's note of the step `event` leads `p` to.
fn note_of(p: &Promotion, event: &Event) -> String {
    match event {
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
    }
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
