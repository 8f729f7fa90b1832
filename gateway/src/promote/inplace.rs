//! In-place promotion, carried out: a new revision takes over the serving
//! revision's replicas one at a time by having each load its weights
//! through the worker's `POST /weights`, instead of starting replicas of
//! its own. The processes (and their GPUs) stay; only the weights and the
//! routing change. `promote` decides when; this module plans the swap and
//! moves replicas.
//!
//! While the promotion runs, the new revision is a *guest* on the serving
//! revision's pool-manager target (`Promotions::guests`): its dispatcher
//! routes to the replicas it took, and the host's autoscaler keeps sizing
//! the target, held at no fewer replicas than it had. A replica moves in
//! four steps: out of the old revision's routing, its requests in flight
//! finish, its token is regranted and its weights swapped, into the new
//! revision's routing.
//!
//! Rules that keep requests from being lost:
//! - Before the gate has passed (warming), the swapped replicas take only
//!   pinned requests; the traffic moves with them only once the canary
//!   has passed (or, without a canary, the gate), in proportion.
//! - A revision left with no replica sends what it holds, and what
//!   reaches it later, to the revision that took its last one
//!   (`App::redirect_to`): nothing waits for a replica that will not come.
//!   So an app of one replica serves on the new weights from its swap on.
//! - One swap at a time per guest (`App::moves`): a rollback waits for the
//!   promotion's swap to stop, and a swap stops as soon as its guest is
//!   retired.
//!
//! When the canary has passed, the target is changed to start the new
//! revision (so a replica that crashes comes back with the new weights),
//! the rest of the replicas are swapped, and the guest becomes the
//! target's revision. A rollback swaps the guest's replicas back to the
//! old weights. A replica whose swap fails is replaced: the pool manager
//! starts a fresh one from the target's spec.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Instant;

use warmgate_deploy::AppSpec;
use warmgate_deploy::revision::{Event, Plan, Promotion, Revision};
use warmgate_pool::ReplicaHandle;

use super::Promotions;
use crate::error::{Error, ErrorKind};
use crate::serving::dispatch::App;
use crate::serving::served::Served;
use crate::upstream::LoadError;
use crate::weights::Grant;

/// How long a replica's requests in flight may take to finish before it
/// is swapped: an LLM answer streams for minutes, and a swap must not cut
/// one off (nor fail for it). A replica still busy after it is put back,
/// untouched.
const DRAIN_LIMIT: std::time::Duration = std::time::Duration::from_secs(600);

/// How often a draining replica looks whether its swap was called off.
const DRAIN_POLL: std::time::Duration = std::time::Duration::from_millis(200);

/// How a swap of several replicas ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum SwapError {
    /// The first replica's worker has no `POST /weights`; nothing moved,
    /// and it serves the old weights as before.
    Unsupported(String),
    /// A replica could not load the weights; it is being replaced.
    Failed(String),
    /// A replica kept serving requests for the whole drain time: it was
    /// put back as it was, untouched.
    Busy(String),
}

/// Which way replicas move.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Direction {
    /// Promoting: from the serving revision to its guest.
    Forward,
    /// Rolling back: from the guest to the revision it borrowed from.
    Back,
}

/// One swap: from which revision to which, to what weights.
pub(crate) struct Move<'a> {
    /// The app.
    pub app: &'a Served,
    /// The revision giving up replicas.
    pub from: &'a Arc<App>,
    /// The revision taking them.
    pub to: &'a Arc<App>,
    /// The weights version the worker is told (`to`'s revision number).
    pub version: u64,
    /// Which way.
    pub direction: Direction,
    /// The traffic follows the replicas, in proportion (after the canary
    /// or the gate has passed); otherwise the new revision takes only
    /// pinned requests until its last step.
    pub follow: bool,
}

impl Move<'_> {
    /// The guest whose replicas move (and whose lock serializes it).
    fn guest(&self) -> &Arc<App> {
        match self.direction {
            Direction::Forward => self.to,
            Direction::Back => self.from,
        }
    }

    /// Going forward for a guest that was retired meanwhile: stop.
    fn cancelled(&self) -> bool {
        self.direction == Direction::Forward && self.to.is_retired()
    }
}

impl Promotions {
    /// The dispatcher of `rev` as a guest on `host`'s target: routable by
    /// pinning, with its checkpoint served, and no replica yet.
    pub(crate) fn materialize_guest(
        &self,
        app: &Served,
        rev: &Revision,
        host: &Arc<App>,
    ) -> Result<Arc<App>, Error> {
        if let Some(g) = self.guests.read().get(&host.target) {
            return Err(Error::new(
                ErrorKind::Conflict,
                format!(
                    "{} still holds {}'s replicas; try again once they are swapped back",
                    g.revision, host.revision
                ),
            ));
        }
        let mut spec: AppSpec =
            serde_json::from_str(&rev.spec).unwrap_or_else(|_| (*app.spec()).clone());
        spec.checkpoint = rev.checkpoint.clone();
        if let Some(uri) = &spec.checkpoint {
            self.serve_weights(&app.name, &rev.id, uri)?;
        }
        let guest = Arc::new(App::guest(spec, host.target.clone(), rev.id.clone()));
        self.guests
            .write()
            .insert(host.target.clone(), guest.clone());
        app.add_live(guest.clone());
        Ok(guest)
    }

    /// Refuses a new promotion, rollback or roll of `app` while replicas an
    /// in-place promotion took are being handed over (swapped back after a
    /// rollback, or settling after it is done). Called under the app's
    /// history lock, so nothing can start between the check and the save.
    pub(crate) fn refuse_if_swapping_back(&self, app: &Served) -> Result<(), Error> {
        let guests = self.guests.read();
        match guests.values().find(|g| g.name == app.name) {
            Some(g) => Err(Error::new(
                ErrorKind::Conflict,
                format!(
                    "app '{}': the replicas {} took in place are still being handed over; try again in a moment",
                    app.name, g.revision
                ),
            )
            .retry_after(1)),
            None => Ok(()),
        }
    }

    /// Moves up to `count` replicas (one at a time, so the app's capacity
    /// drops by one at most) and returns how many moved. A replica that
    /// fails to load is replaced; going forward during the canary that
    /// ends the swap (`stop_on_failure`), otherwise the rest still move.
    pub(crate) async fn swap(
        &self,
        m: &Move<'_>,
        count: usize,
        stop_on_failure: bool,
    ) -> Result<usize, SwapError> {
        let _one_at_a_time = m.guest().moves.lock().await;
        let mut moved = 0;
        let mut tried: HashSet<String> = HashSet::new();
        let mut failure = None;
        while moved < count && !m.cancelled() {
            // The least busy replica first: its requests finish soonest.
            let Some(r) = m
                .from
                .replicas()
                .into_iter()
                .filter(|r| !tried.contains(&r.id))
                .min_by_key(|r| r.inflight())
            else {
                break;
            };
            tried.insert(r.id.clone());
            match self.move_replica(m, &r).await {
                Ok(true) => moved += 1,
                Ok(false) => {}
                Err(SwapError::Unsupported(why))
                    if moved == 0 && m.direction == Direction::Forward =>
                {
                    return Err(SwapError::Unsupported(why));
                }
                // Busy: untouched, and another replica may be idler.
                Err(SwapError::Busy(why)) => failure = Some(why),
                Err(SwapError::Unsupported(why) | SwapError::Failed(why)) => {
                    if stop_on_failure {
                        return Err(SwapError::Failed(why));
                    }
                    failure = Some(why);
                }
            }
            if m.follow && !m.cancelled() {
                follow(m);
            }
        }
        if let Some(why) = failure {
            tracing::warn!(app = %m.app.name, error = %why, "a replica could not be swapped in place and is being replaced");
        }
        Ok(moved)
    }

    /// Moves one replica; `Ok(false)` when it went away meanwhile.
    async fn move_replica(&self, m: &Move<'_>, r: &Arc<ReplicaHandle>) -> Result<bool, SwapError> {
        let limit = m.app.spec().startup_timeout;
        if !m.from.remove_replica(r) {
            return Ok(false);
        }
        // Its last replica: what it holds goes where replicas are.
        if m.from.ready_replicas() == 0 && m.to.ready_replicas() > 0 {
            m.from.redirect_to(m.to);
        }
        // Its requests finish first (a drain of its own time: one long
        // request does not fail the swap, it only waits; a swap called off
        // meanwhile puts the replica back as it was).
        let drained_by = Instant::now() + DRAIN_LIMIT;
        while r.inflight() > 0 && Instant::now() < drained_by && !m.cancelled() {
            r.wait_idle((Instant::now() + DRAIN_POLL).min(drained_by).into())
                .await;
        }
        if m.cancelled() && r.inflight() > 0 {
            m.from.add_replica(r.clone());
            return Ok(false);
        }
        if r.inflight() > 0 {
            m.from.add_replica(r.clone());
            return Err(SwapError::Busy(format!(
                "replica {} still served {} requests after {}",
                r.id,
                r.inflight(),
                humantime::format_duration(DRAIN_LIMIT)
            )));
        }
        let grant = |revision: &str| Grant::Revision {
            target: m.app.name.clone(),
            revision: revision.to_string(),
        };
        // It is about to stop running what it was started with: a later
        // leader must not take it over as such (done before the load, so a
        // crash between the two cannot leave it marked as it was).
        if let Err(why) = self.pool.weights_swapped(&r.id).await {
            m.from.add_replica(r.clone());
            return Err(SwapError::Failed(format!(
                "replica {}: could not mark it swapped: {why}",
                r.id
            )));
        }
        self.weights.regrant(&r.id, grant(&m.to.revision));
        let url = self.host.weights_url(&m.app.name, &m.to.revision);
        let loaded =
            tokio::time::timeout(limit, self.upstream.load_weights(&r.addr, &url, m.version))
                .await
                .unwrap_or_else(|_| {
                    Err(LoadError::Failed(format!(
                        "did not load the weights within {}",
                        humantime::format_duration(limit)
                    )))
                });
        match loaded {
            Ok(()) => {
                r.weights_version
                    .store(m.version, std::sync::atomic::Ordering::Relaxed);
                tracing::info!(app = %m.app.name, replica = %r.id, from = %m.from.revision, to = %m.to.revision, "replica swapped in place");
                // Even for a guest retired meanwhile: it runs the guest's
                // weights, and the guest's swap back moves it on.
                m.to.add_replica(r.clone());
                if m.from.ready_replicas() == 0 {
                    m.from.redirect_to(m.to);
                }
                Ok(true)
            }
            Err(LoadError::Unsupported(status)) => {
                // It still runs what it ran: it goes back as it was.
                self.weights.regrant(&r.id, grant(&m.from.revision));
                m.from.add_replica(r.clone());
                Err(SwapError::Unsupported(
                    LoadError::Unsupported(status).to_string(),
                ))
            }
            Err(LoadError::Failed(why)) => {
                let reason = format!(
                    "swapping {} for {} in place failed: {why}",
                    m.from.revision, m.to.revision
                );
                r.set_unroutable();
                if !self.pool.replace(&m.from.target, &r.id, &reason) {
                    tracing::error!(app = %m.app.name, replica = %r.id, "could not ask for the replica to be replaced; it takes no traffic");
                }
                Err(SwapError::Failed(format!("replica {}: {why}", r.id)))
            }
        }
    }

    /// The canary (or, without one, the gate) passed: the target starts
    /// `to` from now on (a replica that is replaced comes back with the new
    /// weights and joins `to`), and the rest of `from`'s replicas move,
    /// the traffic with them.
    pub(crate) async fn swap_rest(&self, m: &Move<'_>, rev: &Revision) {
        if m.cancelled() {
            return;
        }
        if let Some(uri) = &rev.checkpoint
            && self.weights.uri(&m.app.name, &rev.id).is_none()
            && let Err(e) = self.serve_weights(&m.app.name, &rev.id, uri)
        {
            tracing::error!(app = %m.app.name, error = %e.message, "cannot serve the promoted checkpoint to new replicas");
        }
        self.point_target_at(m.app, &m.from.target, &rev.id, rev.checkpoint.clone());
        // Until the old revision has none left and nothing is starting that
        // could land in it (a replica started under the old spec while the
        // swap ran), within a start's time; what is left then is replaced
        // when the guest settles.
        let until = Instant::now() + m.app.spec().startup_timeout;
        loop {
            let left = m.from.replicas().len();
            if left > 0
                && let Err(e) = self.swap(m, left, false).await
            {
                tracing::warn!(app = %m.app.name, error = ?e, "the rest of the replicas did not all swap in place");
            }
            let starting = self
                .pool
                .health(&m.from.target)
                .is_some_and(|h| h.starting > 0);
            if m.cancelled()
                || Instant::now() >= until
                || (m.from.replicas().is_empty() && !starting)
            {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
        if !m.cancelled() {
            follow(m);
        }
    }

    /// Makes the target start `revision` (its checkpoint and weights URL).
    fn point_target_at(
        &self,
        app: &Served,
        target: &warmgate_deploy::TargetId,
        revision: &str,
        checkpoint: Option<String>,
    ) {
        let url = self.host.weights_url(&app.name, revision);
        self.pool.update_target(target, |t| {
            t.revision = revision.to_string();
            t.checkpoint = checkpoint;
            t.env.insert("WARMGATE_WEIGHTS_URL".into(), url);
        });
    }

    /// The guest of a promotion that is over takes the target as its own
    /// (`from` leaves routing; the target is not scaled down).
    pub(crate) fn settle_guest(&self, app: &Served, from: &Arc<App>) {
        let guest = {
            let mut guests = self.guests.write();
            match guests.get(&from.target) {
                Some(g) if !g.is_retired() => guests.remove(&from.target),
                _ => None,
            }
        };
        let Some(guest) = guest else {
            return;
        };
        guest.settle();
        self.revisions
            .write()
            .insert(from.target.clone(), guest.clone());
        // A replica still on the old weights (it became ready as the last
        // ones swapped) starts again, on the new.
        for r in from.replicas() {
            from.remove_replica(&r);
            r.set_unroutable();
            if !self.pool.replace(
                &from.target,
                &r.id,
                "left on the old weights by an in-place promotion",
            ) {
                tracing::error!(app = %app.name, replica = %r.id, "could not ask for the replica to be replaced");
            }
        }
        from.hold(0);
        self.weights.unregister(&app.name, &from.revision);
        app.remove_live(&from.revision);
    }

    /// Whether `host` is getting back replicas a rolled-back guest took.
    pub(crate) fn hands_over(&self, host: &App) -> bool {
        self.guests
            .read()
            .get(&host.target)
            .is_some_and(|g| g.is_retired() && g.name == host.name && g.revision != host.revision)
    }

    /// Whether `from` is the host of a guest that is still promoting (not
    /// retired): its promotion's end settles the guest.
    pub(crate) fn hosts_live_guest(&self, from: &App) -> bool {
        self.guests
            .read()
            .get(&from.target)
            .is_some_and(|g| !g.is_retired() && g.name == from.name)
    }

    /// A guest rolled back or failed: it takes nothing more, its replicas
    /// go back to `host` with the old weights, then it leaves routing.
    /// Runs in the background once the promotion's own swap has stopped;
    /// the traffic is on `host` already.
    pub(crate) fn send_back(self: &Arc<Self>, app: Arc<Served>, guest: Arc<App>, host: Arc<App>) {
        guest.retire();
        let gw = self.clone();
        tokio::spawn(async move {
            let version = app
                .history
                .lock()
                .get(&host.revision)
                .map_or(0, |r| u64::from(r.seq));
            // Everything goes to the old weights now, and so does what the
            // target starts next; the target keeps every replica until they
            // are all back (the host's autoscaler saw only its share).
            app.set_split(&[(host.revision.clone(), 100)]);
            host.hold((host.ready_replicas() + guest.ready_replicas()) as u32);
            let checkpoint = host.spec().checkpoint.clone();
            let m = Move {
                app: &app,
                from: &guest,
                to: &host,
                version,
                direction: Direction::Back,
                follow: false,
            };
            let mut moved = 0;
            // The promotion's own swap first stops (it sees the guest
            // retired before its next replica); a replica it was loading
            // meanwhile lands in the guest and moves back below.
            drop(guest.moves.lock().await);
            for _ in 0..3 {
                gw.point_target_at(&app, &host.target, &host.revision, checkpoint.clone());
                let all = guest.replicas().len();
                if all == 0 {
                    break;
                }
                moved += gw.swap(&m, all, false).await.unwrap_or(0);
            }
            tracing::info!(app = %app.name, from = %guest.revision, to = %host.revision, moved, "replicas swapped back in place");
            if guest.ready_replicas() == 0 {
                guest.redirect_to(&host);
            }
            // The host holds its own requests from now on.
            host.clear_redirect_to(&guest);
            host.hold(0);
            {
                let mut guests = gw.guests.write();
                if guests
                    .get(&host.target)
                    .is_some_and(|g| Arc::ptr_eq(g, &guest))
                {
                    guests.remove(&host.target);
                }
            }
            gw.weights.unregister(&app.name, &guest.revision);
            app.remove_live(&guest.revision);
        });
    }

    /// Warming in place: the canary's replicas (every replica, without a
    /// canary) swap to the new weights. `Ready` once they have.
    pub(crate) async fn warm_in_place(&self, app: &Served, p: &Promotion) -> Event {
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
        let m = Move {
            app,
            from: &host,
            to: &guest,
            version: seq_of(app, &p.to),
            direction: Direction::Forward,
            follow: false,
        };
        match self
            .swap(&m, want.saturating_sub(guest.ready_replicas()), true)
            .await
        {
            Ok(_) if guest.ready_replicas() > 0 => Event::Ready,
            Ok(_) => Event::StartFailed("no replica could be swapped in place".into()),
            Err(SwapError::Unsupported(why)) => Event::InPlaceUnsupported(why),
            Err(SwapError::Failed(why) | SwapError::Busy(why)) => {
                Event::StartFailed(format!("swapping in place failed: {why}"))
            }
        }
    }

    /// The in-place canary passed: the target starts the new revision from
    /// now on, and every other replica swaps.
    pub(crate) async fn commit_in_place(&self, app: &Served, p: &Promotion) {
        let host = p.from.as_deref().and_then(|f| app.revision(f));
        let rev = app.history.lock().get(&p.to).cloned();
        let (Some(host), Some(guest), Some(rev)) = (host, app.revision(&p.to), rev) else {
            return;
        };
        let m = Move {
            app,
            from: &host,
            to: &guest,
            version: u64::from(rev.seq),
            direction: Direction::Forward,
            follow: true,
        };
        self.swap_rest(&m, &rev).await;
    }

    /// A worker cannot swap in place: the guest leaves, and the new
    /// revision gets a target of its own (the promotion's next step
    /// starts it). `StartFailed` when even that cannot be had.
    pub(crate) fn fall_back(&self, app: &Served, p: &Promotion, why: String) -> Event {
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
}

/// Routes the traffic between the two revisions in proportion to the
/// replicas each has, so neither is sent more than it can serve.
fn follow(m: &Move<'_>) {
    let to = m.to.ready_replicas() as u32;
    let from = m.from.ready_replicas() as u32;
    let split = match (to, from) {
        (0, _) => vec![(m.from.revision.clone(), 100)],
        (_, 0) => vec![(m.to.revision.clone(), 100)],
        (t, f) => {
            let pct = ((100 * t + (t + f) / 2) / (t + f)).clamp(1, 99) as u8;
            vec![
                (m.to.revision.clone(), pct),
                (m.from.revision.clone(), 100 - pct),
            ]
        }
    };
    m.app.set_split(&split);
}

/// The canary of an in-place promotion: how many of `replicas` swap
/// first for a `canary` percent, and the share of traffic they take.
/// Without a canary one replica swaps first, for the gate, and takes only
/// pinned requests.
pub(crate) fn canary_replicas(replicas: usize, canary: Option<u8>) -> (usize, Option<u8>) {
    let n = replicas.max(1);
    match canary {
        None => (1, None),
        Some(pct) => {
            let k = (n * usize::from(pct)).div_ceil(100).clamp(1, n);
            let share = ((100 * k + n / 2) / n).clamp(1, 100) as u8;
            (k, Some(share))
        }
    }
}

/// Makes `plan` an in-place one when the serving revision has ready
/// replicas to swap (the canary becomes whole replicas, and its share
/// theirs); returns how the promotion goes, for its note.
pub(crate) fn in_place_plan(
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
    let (k, share) = canary_replicas(n, plan.canary);
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

#[cfg(test)]
mod tests {
    use super::canary_replicas;

    #[test]
    fn the_canary_is_whole_replicas_and_its_share_is_theirs() {
        assert_eq!(canary_replicas(4, Some(25)), (1, Some(25)));
        assert_eq!(canary_replicas(4, Some(10)), (1, Some(25)), "at least one");
        assert_eq!(canary_replicas(3, Some(50)), (2, Some(67)));
        assert_eq!(canary_replicas(2, Some(10)), (1, Some(50)));
        assert_eq!(
            canary_replicas(1, Some(10)),
            (1, Some(100)),
            "an app of one"
        );
        assert_eq!(canary_replicas(5, Some(100)), (5, Some(100)));
        assert_eq!(canary_replicas(4, None), (1, None), "one, for the gate");
    }
}
