//! A revision's hold queue: the requests waiting for a slot, what each is
//! given (a slot, or the revision its replicas went to), freed slots handed
//! to the oldest first, and a held request's side (`PendingSlot`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::oneshot;
use warmgate_deploy::AppSpec;
use warmgate_pool::ReplicaHandle;

use super::{App, SlotGuard, Slots};
use crate::error::{Error, ErrorKind};
use crate::serving::adapters::Ticket;
use crate::serving::route::{ReplicaKey, RouteKey};

use super::pick::Routed;

pub(super) type Grant = Result<Granted, Error>;

/// What a held request is given.
pub(super) enum Granted {
    /// A slot on this replica, what to do for its adapter first, and the
    /// chunks of its prompt the replica is expected to miss.
    Slot(Arc<ReplicaHandle>, Option<Ticket>, Option<u32>),
    /// Its revision gave its last replica to another (an in-place
    /// promotion or its rollback): ask that one.
    Moved(Arc<App>),
}

pub(super) struct Waiter {
    pub(super) tx: oneshot::Sender<Grant>,
    /// What it is routed on when a slot frees.
    pub(super) key: Option<Arc<RouteKey>>,
    /// The adapter it asks for.
    pub(super) adapter: Option<Arc<str>>,
    /// The tenant asking (a fair share of the adapter slots).
    pub(super) tenant: Option<Arc<str>>,
    /// The full replica it waits for (it holds its prompt), if any.
    pub(super) target: Option<ReplicaKey>,
}

/// The most held requests one dispatch routes again: those waiting for a
/// full replica are passed over for the ones behind them, and this bounds
/// the work a freed slot costs under the app's lock.
const DISPATCH_SCAN: usize = 128;

/// What a held request got.
pub enum Slotted {
    /// A slot, after waiting this long.
    Slot(SlotGuard, Duration),
    /// Its revision gave its last replica to this one: ask it.
    Moved(Arc<App>),
}

/// `Retry-After` on a request that waited out its queue timeout while the
/// app's replicas were still starting.
const STARTING_RETRY_AFTER_SECS: u64 = 5;

/// A place in an app's hold queue.
pub struct PendingSlot {
    pub(super) app: Arc<App>,
    /// The adapter the request asked for.
    pub(super) adapter: Option<Arc<str>>,
    pub(super) rx: Option<oneshot::Receiver<Grant>>,
    pub(super) since: Instant,
}

impl App {
    /// It has no replica left and `to` took the last one: the requests it
    /// holds, and those that reach it from now on while it has none, are
    /// sent to `to`. A replica added to it again ends this.
    pub fn redirect_to(self: &Arc<Self>, to: &Arc<App>) {
        if Arc::ptr_eq(self, to) {
            return;
        }
        // Never two revisions sending to each other: the other holds its
        // requests for a replica of its own instead.
        to.clear_redirect_to(self);
        let mut s = self.slots.lock();
        if !s.replicas.is_empty() {
            return;
        }
        *self.moved_to.lock() = Some(to.clone());
        s.answer_all(|| Ok(Granted::Moved(to.clone())));
    }

    /// Whether its requests go to another revision while it has no
    /// replica (see [`App::redirect_to`]).
    pub fn is_redirected(&self) -> bool {
        self.moved_to.lock().is_some()
    }

    /// Ends a redirect to `to` (it was retired, or has no replica
    /// either): requests are held here for a replica of its own.
    pub fn clear_redirect_to(&self, to: &App) {
        let mut m = self.moved_to.lock();
        if m.as_ref().is_some_and(|t| std::ptr::eq(Arc::as_ptr(t), to)) {
            *m = None;
        }
    }

    /// Fails every held request, when the app cannot start and has nothing
    /// ready to serve them.
    pub fn fail_waiters(&self, err: &Error) {
        let mut s = self.slots.lock();
        if !s.replicas.is_empty() {
            return;
        }
        s.answer_all(|| Err(err.clone()));
    }
}

impl Slots {
    /// Answers every held request with `grant` (the queue empties).
    fn answer_all(&mut self, grant: impl Fn() -> Grant) {
        while let Some(w) = self.waiters.pop_front() {
            if w.tx.is_closed() {
                continue;
            }
            self.live_waiters -= 1;
            let _ = w.tx.send(grant());
        }
        self.update_meter(Instant::now());
    }

    /// Hands free slots to held requests, oldest first, each routed on
    /// its key. A request that chooses to wait for a full replica holding
    /// its prompt lets those behind it by; any other that finds no slot
    /// stops the round (the oldest is served first).
    pub(super) fn dispatch(&mut self, spec: &AppSpec) {
        if self.live_waiters > 0 {
            self.held_for.clear();
            for t in self
                .waiters
                .iter()
                .filter(|w| !w.tx.is_closed())
                .filter_map(|w| w.target)
            {
                *self.held_for.entry(t).or_default() += 1;
            }
            self.dispatch_round(spec);
            self.held_for.clear();
        }
        self.update_meter(Instant::now());
    }

    fn dispatch_round(&mut self, spec: &AppSpec) {
        let mut i = 0;
        let mut scanned = 0;
        while i < self.waiters.len() && scanned < DISPATCH_SCAN {
            // Cancelled waiters: their owners already took them off
            // `live_waiters`.
            if self.waiters[i].tx.is_closed() {
                self.waiters.remove(i);
                continue;
            }
            if !self
                .replicas
                .iter()
                .any(|r| r.has_free_slot() && r.is_routable())
            {
                break;
            }
            scanned += 1;
            let w = &self.waiters[i];
            let (key, adapter, tenant, target) =
                (w.key.clone(), w.adapter.clone(), w.tenant.clone(), w.target);
            if let Some(t) = target
                && let Some(n) = self.held_for.get_mut(&t)
            {
                *n = n.saturating_sub(1);
            }
            let routed = match &adapter {
                Some(a) => self
                    .route_adapter(a, tenant.as_ref(), spec, &[])
                    .map_or(Routed::Hold, |(r, ticket)| Routed::Go(r, ticket, None)),
                None => self.route(key.as_deref(), spec),
            };
            match routed {
                Routed::Go(replica, ticket, uncached) => {
                    let Some(w) = self.waiters.remove(i) else {
                        break;
                    };
                    replica.acquire();
                    self.inflight += 1;
                    self.live_waiters -= 1;
                    if w.tx
                        .send(Ok(Granted::Slot(replica.clone(), ticket, uncached)))
                        .is_err()
                    {
                        // The receiver is closed only under this lock, so
                        // this does not happen; undo the slot all the same.
                        replica.release();
                        self.inflight -= 1;
                        if let Some(a) = &adapter {
                            self.adapters.release(&replica.id, a);
                        }
                    }
                }
                Routed::Wait(t) => {
                    if target != Some(t) {
                        metrics::counter!("warmgate_route_decisions_total", "reason" => "wait")
                            .increment(1);
                    }
                    self.waiters[i].target = Some(t);
                    *self.held_for.entry(t).or_default() += 1;
                    i += 1;
                }
                Routed::Hold => {
                    self.waiters[i].target = None;
                    break;
                }
            }
        }
    }
}

// === impl PendingSlot ===

impl PendingSlot {
    fn slotted(&self, g: Granted) -> Slotted {
        match g {
            Granted::Slot(replica, ticket, uncached) => {
                let (guard, waited) = self.granted(replica, ticket, uncached);
                Slotted::Slot(guard, waited)
            }
            Granted::Moved(to) => Slotted::Moved(to),
        }
    }

    fn granted(
        &self,
        replica: Arc<ReplicaHandle>,
        ticket: Option<Ticket>,
        uncached: Option<u32>,
    ) -> (SlotGuard, Duration) {
        let waited = self.since.elapsed();
        self.app.queued.record(waited.as_secs_f64());
        let guard = SlotGuard {
            app: self.app.clone(),
            replica,
            adapter: self.adapter.clone(),
            ticket,
            start: self.since,
            granted: Instant::now(),
            uncached,
        };
        (guard, waited)
    }

    /// What it was given, if anything yet; `None` while still waiting.
    pub fn try_take(&mut self) -> Option<Result<Slotted, Error>> {
        let rx = self.rx.as_mut()?;
        match rx.try_recv() {
            Ok(grant) => {
                self.rx = None;
                Some(grant.map(|g| self.slotted(g)))
            }
            Err(oneshot::error::TryRecvError::Empty) => None,
            Err(oneshot::error::TryRecvError::Closed) => {
                self.rx = None;
                Some(Err(Error::new(
                    ErrorKind::NoCapacity,
                    format!("app '{}' is shutting down", self.app.name),
                )))
            }
        }
    }

    /// Waits for a slot until `timeout`.
    pub async fn wait(mut self, timeout: Duration) -> Result<Slotted, Error> {
        let rx = self
            .rx
            .as_mut()
            .expect("the receiver is only taken on drop");
        match tokio::time::timeout(timeout, rx).await {
            Ok(Ok(grant)) => {
                self.rx = None;
                Ok(self.slotted(grant?))
            }
            Ok(Err(_)) => Err(Error::new(
                ErrorKind::NoCapacity,
                format!("app '{}' is shutting down", self.app.name),
            )
            .retry_after(1)),
            // Nothing ready to wait for yet: the replicas are starting (a
            // stock server loading its weights takes minutes), and the
            // client should come back rather than give up.
            Err(_) if self.app.ready_replicas() == 0 => Err(Error::new(
                ErrorKind::Starting,
                format!(
                    "app '{}' has no ready replica yet: its replicas are still starting (up to \
                     its startup_timeout) and this request waited the queue timeout ({}); retry, \
                     or raise [apps.queue] timeout to wait longer",
                    self.app.name,
                    humantime::format_duration(timeout)
                ),
            )
            .retry_after(STARTING_RETRY_AFTER_SECS)),
            Err(_) => Err(Error::new(
                ErrorKind::Timeout,
                format!(
                    "no replica of app '{}' became free within the queue timeout ({:?})",
                    self.app.name, timeout
                ),
            )),
        }
    }
}

impl Drop for PendingSlot {
    fn drop(&mut self) {
        let Some(mut rx) = self.rx.take() else {
            return;
        };
        let mut s = self.app.slots.lock();
        rx.close();
        match rx.try_recv() {
            // A slot was granted just as we gave up: give it back.
            Ok(Ok(Granted::Slot(replica, ticket, _))) => {
                // A load it was to start never starts: forget the place.
                if let (Some(Ticket::Load { evict, .. }), Some(a)) = (&ticket, &self.adapter) {
                    s.adapters.loaded(&replica.id, a, false);
                    if let Some(e) = evict {
                        s.adapters.keep(&replica.id, e);
                    }
                }
                drop(s);
                self.app.release(&replica, self.adapter.as_ref(), None);
            }
            // Sent on: already off the queue.
            Ok(Ok(Granted::Moved(_))) => {}
            // Failed by the gateway: already off the queue.
            Ok(Err(_)) => {}
            Err(_) => {
                s.live_waiters -= 1;
                s.update_meter(Instant::now());
            }
        }
    }
}
