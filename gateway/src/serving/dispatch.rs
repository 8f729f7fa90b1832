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
use warmgate_autoscaler::{Autoscaler, EngineTargets, Observation, ScaleToZero, ScalingConfig};
use warmgate_deploy::{AppSpec, RoutingPolicy, ScaleToZeroAfter, TargetId};
use warmgate_pool::ReplicaHandle;

use super::adapters::{AdapterTable, Candidate as AdapterCandidate, LoadState, Ticket};
use super::route::{self, Candidate, PrefixIndex, ReplicaKey, RouteKey};

use crate::error::{ApiError, ErrorKind};

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
    outcomes: Vec<metrics::Counter>,
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

/// Latencies kept per revision for the canary's p99.
const LATENCY_WINDOW: usize = 2048;

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
    waiters: VecDeque<Waiter>,
    /// Waiters still waiting (the deque may also hold cancelled ones).
    live_waiters: usize,
    inflight: u32,
    meter: Meter,
}

type Grant = Result<Granted, ApiError>;

/// What a held request is given.
enum Granted {
    /// A slot on this replica, and what to do for its adapter first.
    Slot(Arc<ReplicaHandle>, Option<Ticket>),
    /// Its revision gave its last replica to another (an in-place
    /// promotion or its rollback): ask that one.
    Moved(Arc<App>),
}

struct Waiter {
    tx: oneshot::Sender<Grant>,
    /// What it is routed on when a slot frees.
    key: Option<Arc<RouteKey>>,
    /// The adapter it asks for.
    adapter: Option<Arc<str>>,
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

/// A slot on a replica. Dropping it frees the slot (and hands it to the
/// oldest held request, if any).
pub struct SlotGuard {
    app: Arc<App>,
    replica: Arc<ReplicaHandle>,
    /// The adapter the request asked for, released with the slot.
    adapter: Option<Arc<str>>,
    /// What to do for it before forwarding.
    ticket: Option<Ticket>,
    /// When the request asked for a slot: its end-to-end clock.
    start: Instant,
}

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
    app: Arc<App>,
    /// The adapter the request asked for.
    adapter: Option<Arc<str>>,
    rx: Option<oneshot::Receiver<Grant>>,
    since: Instant,
}

/// Time-weighted average of in-flight plus queued requests, the busy
/// slot-seconds, and the arrivals and completions between two ticks: what
/// the autoscaler observes.
#[derive(Debug)]
struct Meter {
    value: u32,
    inflight: u32,
    last: Instant,
    window_start: Instant,
    area: f64,
    busy: f64,
    active: bool,
    arrivals: u32,
    completions: u32,
}

/// One tick's reading of a [`Meter`].
#[derive(Debug, Clone, Copy)]
struct Reading {
    concurrency: f64,
    busy: f64,
    arrivals: u32,
    completions: u32,
}

/// The autoscaler's knobs for an app, from its config.
pub fn scaling_config(spec: &AppSpec) -> ScalingConfig {
    let a = &spec.autoscale;
    ScalingConfig {
        min: a.min,
        max: a.max,
        target: spec.target(),
        stable_window: a.stable_window,
        panic_window: a.panic_window,
        scale_to_zero_after: match a.scale_to_zero_after {
            ScaleToZeroAfter::Auto => ScaleToZero::Auto,
            ScaleToZeroAfter::After(d) => ScaleToZero::After(d),
        },
        panic_threshold: a.panic_threshold,
        max_scale_up_rate: a.max_scale_up_rate,
        max_scale_down_rate: a.max_scale_down_rate,
        scale_down_delay: a.scale_down_delay,
        predictive: a.predictive,
        suspend_after: a.suspend_after,
        concurrency: spec.concurrency,
        cold_start_aware: a.cold_start_aware,
        start_timeout: spec.startup_timeout,
        engine: EngineTargets {
            waiting: a.target_waiting,
            kv_cache_usage: a.target_kv_cache_usage,
        },
    }
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
            outcomes: std::iter::once("ok")
                .chain(ErrorKind::ALL.iter().map(|k| k.as_str()))
                .map(|outcome| {
                    metrics::counter!(
                        "warmgate_requests_total",
                        "app" => spec.name.clone(),
                        "outcome" => outcome
                    )
                })
                .collect(),
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
    pub fn acquire(self: &Arc<Self>) -> Result<Acquire, ApiError> {
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
    ) -> Result<Acquire, ApiError> {
        let mut s = self.slots.lock();
        if s.replicas.is_empty()
            && let Some(to) = self.moved_to.lock().clone()
        {
            return Ok(Acquire::Moved(to));
        }
        let now = Instant::now();
        s.meter.arrivals = s.meter.arrivals.saturating_add(1);
        let spec = self.spec.load();
        let found = match adapter {
            Some(a) if s.live_waiters == 0 => s.route_adapter(a, &spec, avoid),
            None if s.live_waiters == 0 => pick_avoiding(&s.replicas, avoid)
                .or_else(|| s.route(key.map(|k| &**k), &spec))
                .map(|r| (r, None)),
            _ => None,
        };
        if let Some((r, ticket)) = found {
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
            }));
        }
        let cold = s.replicas.is_empty();
        let max = self.spec.load().queue.max_pending;
        if s.live_waiters >= max as usize {
            let err = if cold {
                ApiError::new(
                    ErrorKind::Starting,
                    format!(
                        "app '{}' is starting and already holds {max} requests; try again shortly",
                        self.name
                    ),
                )
                .retry_after(QUEUE_FULL_RETRY_SECS)
            } else {
                ApiError::new(
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
        });
        s.live_waiters += 1;
        s.update_meter(now);
        Ok(Acquire::Held {
            pending: PendingSlot {
                app: self.clone(),
                adapter: adapter.cloned(),
                rx: Some(rx),
                since: now,
            },
            cold,
        })
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

    /// Ends a redirect to `to` (it was retired, or has no replica
    /// either): requests are held here for a replica of its own.
    pub fn clear_redirect_to(&self, to: &App) {
        let mut m = self.moved_to.lock();
        if m.as_ref().is_some_and(|t| std::ptr::eq(Arc::as_ptr(t), to)) {
            *m = None;
        }
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

    /// Fails every held request, when the app cannot start and has nothing
    /// ready to serve them.
    pub fn fail_waiters(&self, err: &ApiError) {
        let mut s = self.slots.lock();
        if !s.replicas.is_empty() {
            return;
        }
        s.answer_all(|| Err(err.clone()));
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

    /// Runs the scaling policy for one tick and applies the desired count
    /// with `apply`, under the policy's lock so a concurrent wake cannot be
    /// overwritten by a stale decision. `now` is the time since the gateway
    /// started. Returns whether the autoscaler is scaling for a burst.
    pub fn tick(&self, now: Duration, apply: impl FnOnce(u32)) -> bool {
        let mut scaler = self.scaler.lock();
        let max_age = self.spec.load().engine.max_age;
        let (reading, ready, queued, engine) = {
            let mut s = self.slots.lock();
            let now = Instant::now();
            let r = s.meter.take(now);
            let engine = super::engine_load::engine_signals(&s.replicas, now, max_age);
            (r, s.replicas.len() as u32, s.live_waiters as u32, engine)
        };
        let remote = self.remote_reading();
        let decision = scaler.observe(Observation {
            now,
            concurrency: reading.concurrency + remote.concurrency,
            ready,
            queued: queued.saturating_add(remote.queued),
            arrivals: reading.arrivals.saturating_add(remote.arrivals),
            completions: reading.completions.saturating_add(remote.completions),
            busy: reading.busy + remote.busy,
            engine,
        });
        apply(decision.desired.max(self.floor.load(Ordering::Relaxed)));
        decision.panicking
    }

    /// What this gateway saw of it since the last call, for the leader's
    /// autoscaler (a gateway replica that does not lead scales nothing).
    pub(crate) fn take_reading(&self) -> crate::peers::PeerReading {
        let mut s = self.slots.lock();
        let r = s.meter.take(Instant::now());
        crate::peers::PeerReading {
            concurrency: r.concurrency,
            busy: r.busy,
            arrivals: r.arrivals,
            completions: r.completions,
            queued: s.live_waiters as u32,
            answered: 0,
            failed: 0,
        }
    }

    /// Adds what gateway `member` saw to the next tick's reading: its
    /// counts add up until that tick, its levels (in flight, held) stand
    /// until its next report, or for [`crate::peers::PEER_TTL`] if none
    /// comes. Demand held there wakes an app at zero here, as local demand
    /// does.
    pub(crate) fn add_remote(
        &self,
        member: &str,
        r: &crate::peers::PeerReading,
        now: Duration,
        wake: impl FnOnce(u32),
    ) {
        let r = r.sane();
        {
            let mut remote = self.remote.lock();
            let e = remote
                .entry(member.to_string())
                .or_insert_with(|| (Instant::now(), crate::peers::PeerReading::default()));
            *e = (Instant::now(), e.1.then(r));
        }
        if r.queued > 0 && self.ready_replicas() == 0 {
            self.wake(now, wake);
        }
    }

    /// Every fresh member's reading, summed; their counts are taken.
    fn remote_reading(&self) -> crate::peers::PeerReading {
        let mut remote = self.remote.lock();
        remote.retain(|_, (at, _)| at.elapsed() < crate::peers::PEER_TTL);
        let mut sum = crate::peers::PeerReading::default();
        for (_, r) in remote.values_mut() {
            sum.concurrency += r.concurrency;
            sum.busy += r.busy;
            sum.arrivals = sum.arrivals.saturating_add(r.arrivals);
            sum.completions = sum.completions.saturating_add(r.completions);
            sum.queued = sum.queued.saturating_add(r.queued);
            r.busy = 0.0;
            r.arrivals = 0;
            r.completions = 0;
        }
        sum
    }

    /// Demand arrived with no replica ready: applies the count to scale to
    /// at once, without waiting for the next tick.
    pub fn wake(&self, now: Duration, apply: impl FnOnce(u32)) {
        let mut scaler = self.scaler.lock();
        let desired = scaler.wake(now);
        apply(desired);
    }

    /// A start failed: its autoscaler keeps no replica for it beyond what
    /// the demand asks for.
    pub fn start_failed(&self) {
        self.scaler.lock().start_failed();
    }

    /// Starts its autoscaler from `n` replicas taken over from an earlier
    /// run (a failover), `now` being the time since the gateway started.
    pub fn adopt(&self, n: u32, now: Duration) {
        self.scaler.lock().adopt(n, now);
    }

    /// Keeps at least `n` replicas whatever the autoscaler says.
    pub fn hold(&self, n: u32) {
        self.floor.store(n, Ordering::Relaxed);
    }

    /// (requests answered, of which failed) since the revision started.
    pub fn health(&self) -> (u64, u64) {
        (
            self.answered.load(Ordering::Relaxed),
            self.failed.load(Ordering::Relaxed),
        )
    }

    /// Counts another gateway's answers for the canary's health (their
    /// latencies are not known here).
    pub(crate) fn add_answers(&self, answered: u32, failed: u32) {
        self.answered
            .fetch_add(u64::from(answered), Ordering::Relaxed);
        self.failed
            .fetch_add(u64::from(failed.min(answered)), Ordering::Relaxed);
    }

    /// Counts an answer for the canary's health: `failed` for a gateway
    /// error or a 5xx from the worker, and how long it took.
    pub fn answered(&self, failed: bool, took: Duration) {
        let n = self.answered.fetch_add(1, Ordering::Relaxed) + 1;
        if failed {
            self.failed.fetch_add(1, Ordering::Relaxed);
        }
        let mut l = self.latencies.lock();
        if l.len() >= LATENCY_WINDOW {
            l.pop_front();
        }
        l.push_back((n, took.as_secs_f64()));
    }

    /// The p99 latency of the answers after answer number `since`, if any.
    pub fn p99_since(&self, since: u64) -> Option<Duration> {
        let mut v: Vec<f64> = self
            .latencies
            .lock()
            .iter()
            .filter(|(n, _)| *n > since)
            .map(|(_, s)| *s)
            .collect();
        if v.is_empty() {
            return None;
        }
        v.sort_by(f64::total_cmp);
        let i = ((v.len() as f64 * 0.99).ceil() as usize).clamp(1, v.len()) - 1;
        Some(Duration::from_secs_f64(v[i]))
    }

    /// Counts a finished request: `None` for success, or its error kind.
    pub fn count(&self, outcome: Option<ErrorKind>) {
        let i = outcome.map_or(0, |k| k as usize + 1);
        if let Some(c) = self.outcomes.get(i) {
            c.increment(1);
        }
    }

    /// How long the app may stay idle before its last replica goes (see
    /// [`Autoscaler::scale_to_zero_after`]).
    pub fn scale_to_zero_after(&self) -> Duration {
        self.scaler.lock().scale_to_zero_after()
    }

    /// The gateway's share of the last cold start: from the replica
    /// answering `/healthz` to the first request being forwarded to it.
    pub fn last_handoff(&self) -> Option<Duration> {
        *self.handoff.lock()
    }

    fn release(&self, replica: &Arc<ReplicaHandle>, adapter: Option<&Arc<str>>) {
        let mut s = self.slots.lock();
        replica.release();
        if let Some(a) = adapter {
            s.adapters.release(&replica.id, a);
        }
        s.inflight -= 1;
        s.meter.completions = s.meter.completions.saturating_add(1);
        if replica.is_routable() && s.live_waiters > 0 {
            let spec = self.spec.load();
            s.dispatch(&spec);
        }
        s.update_meter(Instant::now());
    }
}

// === impl Slots ===

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
    /// its key.
    fn dispatch(&mut self, spec: &AppSpec) {
        while self.live_waiters > 0 {
            // Cancelled waiters first: their owners already took them off
            // `live_waiters`.
            while self.waiters.front().is_some_and(|w| w.tx.is_closed()) {
                self.waiters.pop_front();
            }
            let Some((key, adapter)) = self
                .waiters
                .front()
                .map(|w| (w.key.clone(), w.adapter.clone()))
            else {
                break;
            };
            let found = match &adapter {
                Some(a) => self.route_adapter(a, spec, &[]),
                None => self.route(key.as_deref(), spec).map(|r| (r, None)),
            };
            let Some((replica, ticket)) = found else {
                break;
            };
            let Some(w) = self.waiters.pop_front() else {
                break;
            };
            replica.acquire();
            self.inflight += 1;
            self.live_waiters -= 1;
            if w.tx
                .send(Ok(Granted::Slot(replica.clone(), ticket)))
                .is_err()
            {
                // The receiver is closed only under this lock, so this does
                // not happen; undo the slot all the same.
                replica.release();
                self.inflight -= 1;
                if let Some(a) = &adapter {
                    self.adapters.release(&replica.id, a);
                }
            }
        }
        self.update_meter(Instant::now());
    }

    /// The replica a request with `key` goes to (see [`super::route`]), or
    /// `None` when no replica has a free slot. Without a key, or under
    /// `least_loaded`, the less loaded of two random replicas.
    fn route(&mut self, key: Option<&RouteKey>, spec: &AppSpec) -> Option<Arc<ReplicaHandle>> {
        let (routing, max_age) = (&spec.routing, spec.engine.max_age);
        let key = match (key, routing.policy) {
            (Some(k), RoutingPolicy::Prefix | RoutingPolicy::Session) => k,
            _ => return pick(&self.replicas),
        };
        let free: Vec<&Arc<ReplicaHandle>> = self
            .replicas
            .iter()
            .filter(|r| r.has_free_slot() && r.is_routable())
            .collect();
        let now = Instant::now();
        let candidates: Vec<Candidate> = free
            .iter()
            .map(|r| {
                let engine = r.engine().filter(|e| e.fresh(now, max_age).is_some());
                Candidate {
                    replica: ReplicaKey::of(&r.id),
                    // What this gateway has in flight, plus what the
                    // engine held for others when it was last read.
                    load: r
                        .inflight()
                        .saturating_add(engine.map_or(0, |e| e.others())),
                    cache_permille: engine
                        .and_then(|e| e.load.kv_cache_usage)
                        .map_or(0, |k| (k * 1000.0) as u16),
                }
            })
            .collect();
        let choice = route::choose(
            &candidates,
            key,
            &self.index,
            route::Bound {
                factor: routing.load_bound,
                slack: routing.load_slack,
            },
            &mut self.scratch,
        )?;
        self.index.set_bound(routing.index_bytes);
        self.index
            .record(&key.chunks, candidates[choice.index].replica);
        metrics::counter!("warmgate_route_decisions_total", "reason" => choice.reason.as_str())
            .increment(1);
        Some(free[choice.index].clone())
    }

    /// The replica a request for `adapter` goes to, and what it must do
    /// there first (see [`super::adapters`]); `None` when it must wait.
    fn route_adapter(
        &mut self,
        adapter: &Arc<str>,
        spec: &AppSpec,
        avoid: &[Arc<ReplicaHandle>],
    ) -> Option<(Arc<ReplicaHandle>, Option<Ticket>)> {
        let free: Vec<&Arc<ReplicaHandle>> = self
            .replicas
            .iter()
            .filter(|r| r.has_free_slot() && r.is_routable())
            .filter(|r| !avoid.iter().any(|a| Arc::ptr_eq(a, r)))
            .collect();
        let candidates: Vec<AdapterCandidate<'_>> = free
            .iter()
            .map(|r| AdapterCandidate {
                replica: &r.id,
                load: r.inflight(),
            })
            .collect();
        let (i, reason) = self.adapters.choose(
            adapter,
            &candidates,
            spec.adapters.max_loaded,
            super::adapters::Bound {
                factor: spec.routing.load_bound,
                slack: spec.routing.load_slack,
            },
        )?;
        let replica = free[i].clone();
        let ticket = self.adapters.reserve(&replica.id, adapter, reason);
        metrics::counter!("warmgate_adapter_route_decisions_total", "reason" => reason.as_str())
            .increment(1);
        Some((replica, Some(ticket)))
    }

    fn update_meter(&mut self, now: Instant) {
        self.meter
            .set(now, self.inflight, self.inflight + self.live_waiters as u32);
    }
}

/// The least loaded ready replica with a free slot that is not in
/// `avoid`; `None` when `avoid` is empty (then [`pick`] chooses).
fn pick_avoiding(
    replicas: &[Arc<ReplicaHandle>],
    avoid: &[Arc<ReplicaHandle>],
) -> Option<Arc<ReplicaHandle>> {
    if avoid.is_empty() {
        return None;
    }
    replicas
        .iter()
        .filter(|r| r.has_free_slot() && r.is_routable())
        .filter(|r| !avoid.iter().any(|a| Arc::ptr_eq(a, r)))
        .min_by_key(|r| r.inflight())
        .cloned()
}

/// Least loaded of two random ready replicas with a free slot; falls back to
/// a scan so a free slot is never missed.
fn pick(replicas: &[Arc<ReplicaHandle>]) -> Option<Arc<ReplicaHandle>> {
    match replicas.len() {
        0 => None,
        1 => replicas
            .first()
            .filter(|r| r.has_free_slot() && r.is_routable())
            .cloned(),
        n => {
            let a = fastrand::usize(..n);
            let mut b = fastrand::usize(..n - 1);
            if b >= a {
                b += 1;
            }
            let (ra, rb) = (&replicas[a], &replicas[b]);
            let free = |r: &Arc<ReplicaHandle>| r.has_free_slot() && r.is_routable();
            let best = match (free(ra), free(rb)) {
                (true, true) => Some(if rb.inflight() < ra.inflight() {
                    rb
                } else {
                    ra
                }),
                (true, false) => Some(ra),
                (false, true) => Some(rb),
                (false, false) => None,
            };
            best.or_else(|| {
                replicas
                    .iter()
                    .filter(|r| free(r))
                    .min_by_key(|r| r.inflight())
            })
            .cloned()
        }
    }
}

// === impl Meter ===

impl Meter {
    fn set(&mut self, now: Instant, inflight: u32, value: u32) {
        let dt = now.saturating_duration_since(self.last).as_secs_f64();
        self.area += f64::from(self.value) * dt;
        self.busy += f64::from(self.inflight) * dt;
        self.last = now;
        if value > 0 {
            self.active = true;
        }
        self.value = value;
        self.inflight = inflight;
    }

    /// The reading since the last call. Any activity in the interval
    /// counts, however short, so a request between two ticks still keeps
    /// the app up.
    fn take(&mut self, now: Instant) -> Reading {
        let (v, i) = (self.value, self.inflight);
        self.set(now, i, v);
        let span = now
            .saturating_duration_since(self.window_start)
            .as_secs_f64();
        let mut concurrency = if span > 0.0 { self.area / span } else { 0.0 };
        if self.active && concurrency <= 0.0 {
            concurrency = f64::EPSILON;
        }
        let reading = Reading {
            concurrency,
            busy: self.busy,
            arrivals: self.arrivals,
            completions: self.completions,
        };
        self.area = 0.0;
        self.busy = 0.0;
        self.arrivals = 0;
        self.completions = 0;
        self.window_start = now;
        self.active = self.value > 0;
        reading
    }
}

// === impl SlotGuard ===

impl super::proxy::Slot for SlotGuard {
    /// Notes the first byte of the answer's body (or its end, when it has
    /// none): the time to first byte, from the request's arrival.
    fn first_byte(&self) {
        self.app.ttfb.record(self.start.elapsed().as_secs_f64());
    }

    fn replica(&self) -> &Arc<ReplicaHandle> {
        &self.replica
    }

    /// Notes that the request is being forwarded now; the first forward to a
    /// fresh replica measures the gateway's share of the cold start.
    fn note_forward(&self) {
        if self.replica.take_first_forward() {
            let handoff = self.replica.ready_at.elapsed();
            *self.app.handoff.lock() = Some(handoff);
            metrics::histogram!("warmgate_cold_start_handoff_seconds", "app" => self.app.name.clone())
                .record(handoff.as_secs_f64());
        }
    }
}

impl SlotGuard {
    /// What the request must do for its adapter before it is forwarded
    /// (taken once).
    pub fn take_ticket(&mut self) -> Option<Ticket> {
        self.ticket.take()
    }

    /// The replica the slot is on.
    pub fn replica_handle(&self) -> &Arc<ReplicaHandle> {
        &self.replica
    }

    /// The adapter the request asked for.
    pub fn adapter(&self) -> Option<&Arc<str>> {
        self.adapter.as_ref()
    }

    /// The revision whose slot this is.
    pub fn app(&self) -> &Arc<App> {
        &self.app
    }
}

impl Drop for SlotGuard {
    fn drop(&mut self) {
        // A load this request was to start and never did: forget it.
        if let (Some(Ticket::Load { evict, .. }), Some(a)) = (&self.ticket, &self.adapter) {
            let mut s = self.app.slots.lock();
            s.adapters.loaded(&self.replica.id, a, false);
            if let Some(e) = evict {
                s.adapters.keep(&self.replica.id, e);
            }
        }
        self.app.duration.record(self.start.elapsed().as_secs_f64());
        self.app.release(&self.replica, self.adapter.as_ref());
    }
}

// === impl PendingSlot ===

impl PendingSlot {
    fn slotted(&self, g: Granted) -> Slotted {
        match g {
            Granted::Slot(replica, ticket) => {
                let (guard, waited) = self.granted(replica, ticket);
                Slotted::Slot(guard, waited)
            }
            Granted::Moved(to) => Slotted::Moved(to),
        }
    }

    fn granted(
        &self,
        replica: Arc<ReplicaHandle>,
        ticket: Option<Ticket>,
    ) -> (SlotGuard, Duration) {
        let waited = self.since.elapsed();
        self.app.queued.record(waited.as_secs_f64());
        let guard = SlotGuard {
            app: self.app.clone(),
            replica,
            adapter: self.adapter.clone(),
            ticket,
            start: self.since,
        };
        (guard, waited)
    }

    /// What it was given, if anything yet; `None` while still waiting.
    pub fn try_take(&mut self) -> Option<Result<Slotted, ApiError>> {
        let rx = self.rx.as_mut()?;
        match rx.try_recv() {
            Ok(grant) => {
                self.rx = None;
                Some(grant.map(|g| self.slotted(g)))
            }
            Err(oneshot::error::TryRecvError::Empty) => None,
            Err(oneshot::error::TryRecvError::Closed) => {
                self.rx = None;
                Some(Err(ApiError::new(
                    ErrorKind::NoCapacity,
                    format!("app '{}' is shutting down", self.app.name),
                )))
            }
        }
    }

    /// Waits for a slot until `timeout`.
    pub async fn wait(mut self, timeout: Duration) -> Result<Slotted, ApiError> {
        let rx = self
            .rx
            .as_mut()
            .expect("the receiver is only taken on drop");
        match tokio::time::timeout(timeout, rx).await {
            Ok(Ok(grant)) => {
                self.rx = None;
                Ok(self.slotted(grant?))
            }
            Ok(Err(_)) => Err(ApiError::new(
                ErrorKind::NoCapacity,
                format!("app '{}' is shutting down", self.app.name),
            )
            .retry_after(1)),
            // Nothing ready to wait for yet: the replicas are starting (a
            // stock server loading its weights takes minutes), and the
            // client should come back rather than give up.
            Err(_) if self.app.ready_replicas() == 0 => Err(ApiError::new(
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
            Err(_) => Err(ApiError::new(
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
            Ok(Ok(Granted::Slot(replica, ticket))) => {
                // A load it was to start never starts: forget the place.
                if let (Some(Ticket::Load { evict, .. }), Some(a)) = (&ticket, &self.adapter) {
                    s.adapters.loaded(&replica.id, a, false);
                    if let Some(e) = evict {
                        s.adapters.keep(&replica.id, e);
                    }
                }
                drop(s);
                self.app.release(&replica, self.adapter.as_ref());
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::serving::proxy::Slot as _;

    #[test]
    fn the_meter_reads_arrivals_completions_and_busy_slot_seconds_per_tick() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let mut m = Meter {
            value: 0,
            inflight: 0,
            last: t0,
            window_start: t0,
            area: 0.0,
            busy: 0.0,
            active: false,
            arrivals: 0,
            completions: 0,
        };
        // Two requests arrive; one runs at once, one waits 500 ms; each
        // runs a second.
        m.arrivals += 2;
        m.set(at(0), 1, 2);
        m.set(at(500), 2, 2);
        m.set(at(1000), 1, 1);
        m.completions += 1;
        let r = m.take(at(1000));
        assert_eq!((r.arrivals, r.completions), (2, 1));
        assert!((r.busy - 1.5).abs() < 1e-6, "{r:?}");
        assert!((r.concurrency - 2.0).abs() < 1e-6, "{r:?}");
        m.set(at(1500), 0, 0);
        m.completions += 1;
        let r = m.take(at(2000));
        assert_eq!((r.arrivals, r.completions), (0, 1));
        assert!((r.busy - 0.5).abs() < 1e-6, "{r:?}");
    }

    fn app(concurrency: u32, max_pending: u32) -> Arc<App> {
        let mut spec = AppSpec {
            name: "a".into(),
            command: vec!["x".into()],
            concurrency,
            ..AppSpec::default()
        };
        spec.queue.max_pending = max_pending;
        Arc::new(App::new(spec, TargetId::revision("a", 1)))
    }

    fn replica(id: &str, concurrency: u32) -> Arc<ReplicaHandle> {
        Arc::new(ReplicaHandle::new(
            id.into(),
            TargetId::revision("a", 1),
            "a-00001".into(),
            "127.0.0.1:1".parse().expect("addr"),
            concurrency,
            Instant::now(),
        ))
    }

    fn ready(a: Acquire) -> SlotGuard {
        match a {
            Acquire::Ready(g) => g,
            _ => panic!("expected a free slot"),
        }
    }

    fn held(a: Acquire) -> PendingSlot {
        match a {
            Acquire::Held { pending, .. } => pending,
            _ => panic!("expected to be held"),
        }
    }

    fn slot(s: Slotted) -> SlotGuard {
        match s {
            Slotted::Slot(g, _) => g,
            Slotted::Moved(_) => panic!("expected a slot"),
        }
    }

    /// A revision whose last replica went to another (in place) sends what
    /// it holds there, and what reaches it later, until it has a replica
    /// again; no request waits for a replica that will not come.
    #[tokio::test]
    async fn a_revision_without_replicas_sends_its_requests_where_its_last_one_went() {
        let old = app(1, 10);
        let new = app(1, 10);
        let r = replica("a-1", 1);
        old.add_replica(r.clone());
        let g = ready(old.acquire().expect("slot"));
        let waiting = held(old.acquire().expect("held"));
        // The replica moves: out of the old revision, into the new one.
        assert!(old.remove_replica(&r));
        drop(g);
        new.add_replica(r.clone());
        old.redirect_to(&new);
        match waiting.wait(Duration::from_secs(1)).await.expect("sent on") {
            Slotted::Moved(to) => assert!(Arc::ptr_eq(&to, &new)),
            Slotted::Slot(..) => panic!("no slot on a replica it gave away"),
        }
        assert_eq!(old.load(), (0, 0), "nothing left held");
        match old.acquire().expect("sent on") {
            Acquire::Moved(to) => assert!(Arc::ptr_eq(&to, &new)),
            _ => panic!("a newcomer goes where the replica went"),
        }
        // With a replica of its own again, it serves.
        old.add_replica(replica("a-2", 1));
        let _g = ready(old.acquire().expect("slot"));
        // A redirect while it still has a replica does nothing.
        let other = app(1, 10);
        other.add_replica(replica("a-3", 1));
        other.redirect_to(&new);
        let _g = ready(other.acquire().expect("slot"));
    }

    #[tokio::test]
    async fn limit_holds_and_freed_slots_go_to_the_oldest_waiter() {
        let app = app(2, 10);
        let r = replica("a-1", 2);
        app.add_replica(r.clone());
        let g1 = ready(app.acquire().expect("slot"));
        let _g2 = ready(app.acquire().expect("slot"));
        assert_eq!(r.inflight(), 2);
        let p1 = held(app.acquire().expect("held"));
        let p2 = held(app.acquire().expect("held"));
        assert_eq!(app.load(), (2, 2));
        drop(g1);
        assert_eq!(r.inflight(), 2, "the slot went straight to a waiter");
        let g3 = slot(p1.wait(Duration::from_secs(1)).await.expect("granted"));
        assert_eq!(g3.replica().id, "a-1");
        assert_eq!(app.load(), (2, 1));
        drop(p2);
        assert_eq!(app.load(), (2, 0), "a cancelled waiter leaves the queue");
    }

    #[tokio::test]
    async fn queue_full_is_429_with_retry_after_and_cold_is_503() {
        let cold = app(1, 1);
        let _p = held(cold.acquire().expect("held"));
        let err = cold.acquire().err().expect("full");
        assert_eq!(err.kind, ErrorKind::Starting);
        assert_eq!(err.retry_after, Some(1));

        let warm = app(1, 1);
        warm.add_replica(replica("a-1", 1));
        let _g = ready(warm.acquire().expect("slot"));
        let _p = held(warm.acquire().expect("held"));
        let err = warm.acquire().err().expect("full");
        assert_eq!(err.kind, ErrorKind::QueueFull);
        assert_eq!(err.retry_after, Some(1));
    }

    #[tokio::test(start_paused = true)]
    async fn held_request_times_out_and_its_slot_is_not_lost() {
        let app = app(1, 10);
        let r = replica("a-1", 1);
        app.add_replica(r.clone());
        let g = ready(app.acquire().expect("slot"));
        let p = held(app.acquire().expect("held"));
        let err = p.wait(Duration::from_secs(5)).await.err().expect("timeout");
        assert_eq!(err.kind, ErrorKind::Timeout);
        drop(g);
        assert_eq!(r.inflight(), 0);
        assert_eq!(app.load(), (0, 0));
    }

    #[tokio::test]
    async fn new_replica_serves_held_requests_and_failure_reaches_them() {
        let app = app(4, 10);
        let p = held(app.acquire().expect("held"));
        app.add_replica(replica("a-1", 4));
        let g = slot(p.wait(Duration::from_secs(1)).await.expect("granted"));
        drop(g);

        let app2 = self::app(4, 10);
        let p = held(app2.acquire().expect("held"));
        app2.fail_waiters(&ApiError::new(ErrorKind::ReplicaFailed, "boom"));
        let err = p.wait(Duration::from_secs(1)).await.err().expect("failed");
        assert_eq!(err.kind, ErrorKind::ReplicaFailed);
        assert_eq!(app2.load(), (0, 0));
    }

    #[test]
    fn p2c_spreads_load_and_respects_limits() {
        let app = app(3, 0);
        let rs: Vec<_> = (0..3).map(|i| replica(&format!("a-{i}"), 3)).collect();
        for r in &rs {
            app.add_replica(r.clone());
        }
        let guards: Vec<_> = (0..9)
            .map(|_| ready(app.acquire().expect("slot")))
            .collect();
        for r in &rs {
            assert_eq!(r.inflight(), 3);
        }
        assert!(app.acquire().is_err(), "no queue: full");
        drop(guards);
        for r in &rs {
            assert_eq!(r.inflight(), 0);
        }
    }
}
