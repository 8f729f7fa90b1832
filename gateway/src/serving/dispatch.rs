//! Per-app slot accounting: the balancer and the bounded hold queue.
//!
//! Every app has one small mutex over its ready replicas, its hold queue and
//! its demand meter. Holding it only for counter updates keeps the hot path
//! short, and one lock makes the rules exact: a replica never runs more than
//! `concurrency` requests, and a freed slot goes to the oldest held request
//! before any newcomer can take it.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tokio::sync::oneshot;
use warmgate_autoscaler::Autoscaler;
use warmgate_deploy::{AppSpec, TargetId};
use warmgate_pool::ReplicaHandle;

use super::adapters::{AdapterTable, LoadState};
use super::route::{Learned, PrefixIndex, ReplicaKey, RouteKey};

use crate::error::{Error, ErrorKind};

mod hold;
mod meter;
mod pick;
mod slot;
#[cfg(test)]
mod tests;

pub use hold::{PendingSlot, Slotted};
pub use meter::scaling_config;
pub use slot::SlotGuard;

use hold::Waiter;
use meter::Meter;
use pick::{Routed, pick_avoiding};

/// Retry-After for a full queue: a second lets a few slots turn over.
const QUEUE_FULL_RETRY_SECS: u64 = 1;

/// One app as the data plane sees it.
pub struct App {
    /// The app's name.
    pub name: String,
    /// The revision's target in the pool manager.
    pub target: TargetId,
    /// The revision traffic goes to, as users see it (`target` shown).
    pub revision: String,
    /// `revision` as a header value, built once for every answer.
    pub(crate) revision_header: Option<http::HeaderValue>,
    /// Its spec; [`App::retune`] swaps in new autoscaling and queue
    /// settings.
    spec: arc_swap::ArcSwap<AppSpec>,
    slots: Mutex<Slots>,
    scaler: Mutex<Autoscaler>,
    /// What the other gateway replicas saw of it since the last tick
    /// (the leader's autoscaler counts every gateway's demand).
    remote: Mutex<std::collections::BTreeMap<String, (Instant, crate::peers::PeerReading)>>,
    handoff: Mutex<Option<Duration>>,
    /// `warmgate_requests_total` by outcome: `ok`, then [`ErrorKind::ALL`].
    outcomes: crate::outcomes::Outcomes,
    /// `warmgate_request_duration_seconds`: slot asked for to response done.
    duration: metrics::Histogram,
    /// Arrival to the first byte of the answer's body.
    ttfb: metrics::Histogram,
    /// `warmgate_request_queued_seconds`: time waiting for a slot.
    queued: metrics::Histogram,
    /// Replicas the autoscaler may not go below (held during a promotion).
    floor: AtomicU32,
    /// It borrows another revision's replicas (an in-place promotion):
    /// the pool-manager target is that revision's, and this one's
    /// autoscaler does not size it.
    guest: AtomicBool,
    /// Its in-place promotion was rolled back or failed: what it borrowed
    /// goes back, and it takes nothing more.
    retired: AtomicBool,
    /// While it has no replica, the revision that took its last one: its
    /// requests go there instead of waiting for a replica that will not
    /// come.
    moved_to: Mutex<Option<Arc<App>>>,
    /// Held by whoever moves replicas to or from it in place: one swap at
    /// a time (a rollback's waits for the promotion's to stop).
    pub moves: tokio::sync::Mutex<()>,
    /// Requests answered, and of those failed (the gateway's errors and the
    /// worker's 5xx answers): the canary's health.
    answered: AtomicU64,
    failed: AtomicU64,
    /// The latest answers' latencies (to the response head), for the
    /// canary's p99: (answer number, seconds).
    latencies: Mutex<VecDeque<(u64, f64)>>,
}

struct Slots {
    replicas: Vec<Arc<ReplicaHandle>>,
    /// Which LoRA adapters each replica holds (`[apps.adapters]`).
    adapters: AdapterTable,
    /// One adapter call at a time to each replica's engine, so an unload
    /// made for room cannot overtake a load of the same adapter sent
    /// after it (by replica id).
    engine_calls: HashMap<String, Arc<tokio::sync::Mutex<()>>>,
    /// Where prompts went recently (`[apps.routing]`).
    index: PrefixIndex,
    /// Reused by each routing decision.
    scratch: Vec<u32>,
    /// What its requests taught of waiting against recomputing.
    learned: Learned,
    /// Requests held waiting for each full replica, while the queue is
    /// dispatched (empty otherwise: nobody waits then).
    held_for: HashMap<ReplicaKey, u32>,
    waiters: VecDeque<Waiter>,
    /// Waiters still waiting (the deque may also hold cancelled ones).
    live_waiters: usize,
    inflight: u32,
    meter: Meter,
}

/// What [`App::acquire`] found.
pub enum Acquire {
    /// A slot, at once.
    Ready(SlotGuard),
    /// The revision has no replica and gave its last to this one: ask it.
    Moved(Arc<App>),
    /// No free slot: wait for one. `cold` is set when the app had no
    /// replica at all.
    Held {
        /// The place in the queue.
        pending: PendingSlot,
        /// True when no replica was ready: this request waits for a start.
        cold: bool,
    },
}

// === impl App ===

impl App {
    /// The data-plane state of an app at zero replicas.
    pub fn new(spec: AppSpec, target: TargetId) -> Self {
        let revision = target.to_string();
        Self::with_revision(spec, target, revision, false)
    }

    /// A revision promoted in place: it serves on replicas it takes from
    /// the revision whose target is `host`, swapping their weights, and
    /// sizes nothing until it [settles](App::settle) as the host's
    /// successor.
    pub fn guest(spec: AppSpec, host: TargetId, revision: String) -> Self {
        Self::with_revision(spec, host, revision, true)
    }

    fn with_revision(spec: AppSpec, target: TargetId, revision: String, guest: bool) -> Self {
        let scaling = scaling_config(&spec);
        let now = Instant::now();
        App {
            name: spec.name.clone(),
            target,
            revision_header: http::HeaderValue::from_str(&revision).ok(),
            revision,
            slots: Mutex::new(Slots {
                replicas: Vec::new(),
                index: PrefixIndex::new(spec.routing.index_bytes),
                adapters: AdapterTable::default(),
                engine_calls: HashMap::new(),
                scratch: Vec::new(),
                learned: Learned::default(),
                held_for: HashMap::new(),
                waiters: VecDeque::new(),
                live_waiters: 0,
                inflight: 0,
                meter: Meter {
                    value: 0,
                    inflight: 0,
                    last: now,
                    window_start: now,
                    area: 0.0,
                    busy: 0.0,
                    active: false,
                    arrivals: 0,
                    completions: 0,
                },
            }),
            scaler: Mutex::new(Autoscaler::new(scaling)),
            remote: Mutex::new(std::collections::BTreeMap::new()),
            handoff: Mutex::new(None),
            outcomes: crate::outcomes::Outcomes::new("warmgate_requests_total", "app", &spec.name),
            duration: metrics::histogram!("warmgate_request_duration_seconds", "app" => spec.name.clone()),
            ttfb: metrics::histogram!("warmgate_time_to_first_byte_seconds", "app" => spec.name.clone()),
            queued: metrics::histogram!("warmgate_request_queued_seconds", "app" => spec.name.clone()),
            floor: AtomicU32::new(0),
            guest: AtomicBool::new(guest),
            retired: AtomicBool::new(false),
            moved_to: Mutex::new(None),
            moves: tokio::sync::Mutex::new(()),
            answered: AtomicU64::new(0),
            failed: AtomicU64::new(0),
            latencies: Mutex::new(VecDeque::new()),
            spec: arc_swap::ArcSwap::from_pointee(spec),
        }
    }

    /// Its spec.
    pub fn spec(&self) -> Arc<AppSpec> {
        self.spec.load_full()
    }

    /// Takes `spec`'s autoscaling, queue and routing settings, keeping its replicas,
    /// its queue and the autoscaler's history: a change that needs no new
    /// replica applies in place.
    pub fn retune(&self, spec: &AppSpec) {
        let mut next = (*self.spec()).clone();
        next.autoscale = spec.autoscale.clone();
        next.queue = spec.queue.clone();
        next.routing = spec.routing.clone();
        next.adapters = spec.adapters.clone();
        self.scaler.lock().set_config(scaling_config(&next));
        self.spec.store(Arc::new(next));
    }

    /// Takes a free slot, or a place in the hold queue, or says why neither
    /// can be had.
    pub fn acquire(self: &Arc<Self>) -> Result<Acquire, Error> {
        self.acquire_avoiding(&[], None, None)
    }

    /// [`App::acquire`] for a request routed on `key` (see
    /// [`super::route`]), preferring any free replica to those in `avoid`
    /// (they refused this request's connection a moment ago); one of them
    /// is taken only when no other has a free slot.
    pub fn acquire_avoiding(
        self: &Arc<Self>,
        avoid: &[Arc<ReplicaHandle>],
        key: Option<&Arc<RouteKey>>,
        adapter: Option<&Arc<str>>,
    ) -> Result<Acquire, Error> {
        self.acquire_avoiding_for(avoid, key, adapter, None)
    }

    /// [`App::acquire_avoiding`] for a request of `tenant`, which gets a
    /// fair share of the adapter slots (see [`super::adapters`]).
    pub fn acquire_avoiding_for(
        self: &Arc<Self>,
        avoid: &[Arc<ReplicaHandle>],
        key: Option<&Arc<RouteKey>>,
        adapter: Option<&Arc<str>>,
        tenant: Option<&Arc<str>>,
    ) -> Result<Acquire, Error> {
        let mut s = self.slots.lock();
        if s.replicas.is_empty()
            && let Some(to) = self.moved_to.lock().clone()
        {
            return Ok(Acquire::Moved(to));
        }
        let now = Instant::now();
        s.meter.arrivals = s.meter.arrivals.saturating_add(1);
        let spec = self.spec.load();
        // With requests held, a newcomer queues behind them and the queue
        // is dispatched: a freed slot goes to the oldest first, and those
        // waiting for a full replica that holds their prompt let the
        // others by.
        let queued = s.live_waiters > 0;
        let routed = match adapter {
            _ if queued => Routed::Hold,
            Some(a) => s
                .route_adapter(a, tenant, &spec, avoid)
                .map_or(Routed::Hold, |(r, ticket)| Routed::Go(r, ticket, None)),
            None => match pick_avoiding(&s.replicas, avoid) {
                Some(r) => Routed::Go(r, None, None),
                None => s.route(key.map(|k| &**k), &spec),
            },
        };
        let target = match routed {
            Routed::Go(r, ticket, uncached) => {
                r.acquire();
                s.inflight += 1;
                s.update_meter(now);
                self.queued.record(0.0);
                return Ok(Acquire::Ready(SlotGuard {
                    app: self.clone(),
                    replica: r,
                    adapter: adapter.cloned(),
                    ticket,
                    start: now,
                    granted: now,
                    uncached,
                }));
            }
            Routed::Wait(t) => {
                metrics::counter!("warmgate_route_decisions_total", "reason" => "wait")
                    .increment(1);
                Some(t)
            }
            Routed::Hold => None,
        };
        let cold = s.replicas.is_empty();
        let max = self.spec.load().queue.max_pending;
        if s.live_waiters >= max as usize {
            let err = if cold {
                Error::new(
                    ErrorKind::Starting,
                    format!(
                        "app '{}' is starting and already holds {max} requests; try again shortly",
                        self.name
                    ),
                )
                .retry_after(QUEUE_FULL_RETRY_SECS)
            } else {
                Error::new(
                    ErrorKind::QueueFull,
                    format!(
                        "app '{}' is at capacity and its queue is full ({max} requests held)",
                        self.name
                    ),
                )
                .retry_after(QUEUE_FULL_RETRY_SECS)
            };
            return Err(err);
        }
        // Cancelled waiters are skipped lazily; purge them before the deque
        // can grow past twice the bound.
        if s.waiters.len() >= 2 * (self.spec.load().queue.max_pending as usize).max(1) {
            s.waiters.retain(|w| !w.tx.is_closed());
        }
        let (tx, rx) = oneshot::channel();
        s.waiters.push_back(Waiter {
            tx,
            key: key.cloned(),
            adapter: adapter.cloned(),
            tenant: tenant.cloned(),
            target,
        });
        s.live_waiters += 1;
        s.update_meter(now);
        let mut pending = PendingSlot {
            app: self.clone(),
            adapter: adapter.cloned(),
            rx: Some(rx),
            since: now,
        };
        if queued {
            s.dispatch(&spec);
            drop(s);
            match pending.try_take() {
                Some(Ok(Slotted::Slot(guard, _))) => return Ok(Acquire::Ready(guard)),
                Some(Ok(Slotted::Moved(to))) => return Ok(Acquire::Moved(to)),
                Some(Err(e)) => return Err(e),
                None => {}
            }
        }
        Ok(Acquire::Held { pending, cold })
    }

    /// A replica became ready: route to it and serve held requests.
    pub fn add_replica(&self, replica: Arc<ReplicaHandle>) {
        if !replica.startup.is_zero() {
            self.scaler.lock().observe_cold_start(replica.startup);
        }
        let mut s = self.slots.lock();
        if s.replicas.iter().any(|r| Arc::ptr_eq(r, &replica)) {
            return;
        }
        *self.moved_to.lock() = None;
        s.replicas.push(replica);
        let spec = self.spec.load_full();
        s.dispatch(&spec);
    }

    /// Marks its in-place promotion over without it (rolled back or
    /// failed): a swap under way stops giving it replicas.
    pub fn retire(&self) {
        self.retired.store(true, Ordering::Release);
    }

    /// See [`App::retire`].
    pub fn is_retired(&self) -> bool {
        self.retired.load(Ordering::Acquire)
    }

    /// A replica must take no new requests. Requests in flight on it
    /// finish. Returns whether it was routed here.
    pub fn remove_replica(&self, replica: &Arc<ReplicaHandle>) -> bool {
        let mut s = self.slots.lock();
        let before = s.replicas.len();
        s.replicas.retain(|r| !Arc::ptr_eq(r, replica));
        let removed = s.replicas.len() < before;
        if removed {
            s.adapters.forget(&replica.id);
            s.engine_calls.remove(&replica.id);
        }
        if removed && !s.index.is_empty() {
            // Its cache goes with it: nothing is routed to it by affinity.
            s.index.forget(ReplicaKey::of(&replica.id));
        }
        if removed && s.live_waiters > 0 {
            // Those waiting for it choose again.
            let spec = self.spec.load_full();
            s.dispatch(&spec);
        }
        removed
    }

    /// A load of `adapter` on `replica` ended (after unloading `evict`
    /// for room, if `evicted`): tells the requests waiting for it, and
    /// forgets it when it failed.
    pub fn adapter_loaded(
        &self,
        replica: &str,
        adapter: &str,
        evict: Option<&str>,
        evicted: bool,
        done: &tokio::sync::watch::Sender<LoadState>,
        outcome: LoadState,
    ) {
        let mut s = self.slots.lock();
        s.adapters
            .loaded(replica, adapter, outcome == LoadState::Ready);
        // The adapter chosen to make room is gone when its unload
        // answered; else the engine still holds it, and so does the record.
        match evict {
            Some(e) if evicted => s.adapters.unloaded(replica, e),
            Some(e) => s.adapters.keep(replica, e),
            None => {}
        }
        let _ = done.send(outcome);
    }

    /// Adapters found loaded in `replica`'s engine (name, `lora_path`):
    /// those this revision serves at that path are recorded as loaded
    /// there (within `max_loaded`); returns the others, for the engine to
    /// unload.
    pub fn adopt_adapters(&self, replica: &str, found: Vec<(String, String)>) -> Vec<String> {
        let spec = self.spec();
        let mut s = self.slots.lock();
        let max = spec.adapters.max_loaded as usize;
        found
            .into_iter()
            .filter(|(name, path)| {
                let Some(a) = spec
                    .adapters
                    .models
                    .iter()
                    .find(|a| a.engine_name() == *name)
                else {
                    // Not served here (deleted, an old revision): unload.
                    return true;
                };
                match a.checkpoint.strip_prefix("file://") {
                    Some(folder) if folder == path.as_str() => {
                        !s.adapters.adopt(replica, Arc::from(name.as_str()), max)
                    }
                    // From another folder: unload.
                    Some(_) => true,
                    // Pulled from an object store: its folder is known
                    // only once pulled, so it is not adopted; its first
                    // load finds it held and checks the folder then.
                    None => false,
                }
            })
            .map(|(name, _)| name)
            .collect()
    }

    /// The lock that orders adapter calls (loads and unloads) to
    /// `replica`'s engine.
    pub fn engine_calls(&self, replica: &str) -> Arc<tokio::sync::Mutex<()>> {
        self.slots
            .lock()
            .engine_calls
            .entry(replica.to_string())
            .or_default()
            .clone()
    }

    /// The replicas holding `adapter` loaded, by id.
    pub fn adapter_holders(&self, adapter: &str) -> Vec<String> {
        self.slots.lock().adapters.holders(adapter)
    }

    /// The replicas taking its traffic now.
    pub fn replicas(&self) -> Vec<Arc<ReplicaHandle>> {
        self.slots.lock().replicas.clone()
    }

    /// Whether it borrows another revision's replicas (see [`App::guest`]).
    pub fn is_guest(&self) -> bool {
        self.guest.load(Ordering::Acquire)
    }

    /// Its in-place promotion is done: the target is its own now, and its
    /// autoscaler sizes it.
    pub fn settle(&self) {
        self.guest.store(false, Ordering::Release);
    }

    /// Whether `replica` is one of its replicas.
    pub fn holds(&self, replica: &Arc<ReplicaHandle>) -> bool {
        self.slots
            .lock()
            .replicas
            .iter()
            .any(|r| Arc::ptr_eq(r, replica))
    }

    /// Hands free slots to the requests held, after a replica came back
    /// into rotation (see `serving::refusing`).
    pub fn redispatch(&self) {
        let spec = self.spec.load_full();
        self.slots.lock().dispatch(&spec);
    }

    /// Replicas taking traffic.
    pub fn ready_replicas(&self) -> usize {
        self.slots.lock().replicas.len()
    }

    /// (requests in flight, requests held).
    pub fn load(&self) -> (u32, usize) {
        let s = self.slots.lock();
        (s.inflight, s.live_waiters)
    }

    /// The gateway's share of the last cold start: from the replica
    /// answering `/healthz` to the first request being forwarded to it.
    pub fn last_handoff(&self) -> Option<Duration> {
        *self.handoff.lock()
    }
}
