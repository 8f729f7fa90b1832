//! Warm pools: tasks queued with priority and fairness, dispatched to the
//! workers' `POST /invoke`, retried when a replica is lost, and kept until
//! their result is read.
//!
//! Failure accounting follows Union's and Ray's split:
//! - a task whose worker answers with an error failed in *user code*: it
//!   spends its retry budget (with exponential backoff);
//! - a task whose replica went away under it (crash, kill, refused
//!   connection) hit a *system* failure: it goes back to the head of the
//!   queue without spending its budget, up to [`MAX_SYSTEM_RETRIES`] times
//!   so a task that kills every worker cannot loop forever.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Limited};
use parking_lot::Mutex;
use tokio::sync::{Notify, oneshot};
use warmgate_deploy::{Fairness, PoolSpec, TargetId};
use warmgate_pool::ReplicaHandle;

use super::queue::{Limits, Refused, TaskQueue};
use super::split::Split;
use super::store::{InputCharge, TaskStore};
use crate::error::{ApiError, ErrorKind};

mod sync;
pub use sync::{ReplicaSync, SyncOutcome};

/// Replicas lost under one task before it fails for good.
pub const MAX_SYSTEM_RETRIES: u32 = 5;
/// The most `retries` a client may ask for on a pool whose own `retries`
/// is lower: each retry of a task that keeps failing is another call on a
/// worker, for as long as the task's timeout.
pub const MAX_CLIENT_RETRIES: u32 = 20;
/// Pause before retrying a task whose replica was lost, times the number of
/// losses: the pool manager sees a process exit within milliseconds.
const SYSTEM_RETRY_PAUSE: Duration = Duration::from_millis(100);
/// The largest worker answer read.
const MAX_OUTPUT_BYTES: usize = 64 * 1024 * 1024;
/// First delay before retrying a task that failed in user code.
const RETRY_BASE: Duration = Duration::from_millis(100);
/// Tenant of tasks without `X-Warmgate-Tenant`.
pub const DEFAULT_TENANT: &str = "default";

pub use super::record::{Output, TaskRecord, TaskState};

/// A finished task, as the synchronous API answers it.
pub type Outcome = Result<TaskRecord, ApiError>;

/// One accepted task.
struct Task {
    id: String,
    tenant: String,
    priority: i32,
    /// Dispatched only to replicas with at least this weights version.
    min_version: u64,
    traceparent: String,
    input: Bytes,
    /// When it was accepted.
    accepted: Instant,
    /// When its first attempt was dispatched.
    dispatched: Option<Instant>,
    deadline: Instant,
    retries_left: u32,
    system_failures: u32,
    attempts: u32,
    waiter: Option<oneshot::Sender<Outcome>>,
    /// Dropped with the task, freeing the tenant's pending slot.
    _hold: Option<crate::tenants::PendingPermit>,
    /// Dropped with the task, freeing its input's bytes.
    _charge: InputCharge,
}

/// What a submitter asks for.
#[derive(Debug)]
pub struct Submit {
    /// The task's JSON input, sent as the body of `POST /invoke`.
    pub input: Bytes,
    /// Higher goes first.
    pub priority: i32,
    /// Fairness key.
    pub tenant: String,
    /// Overrides the pool's task timeout.
    pub timeout: Option<Duration>,
    /// Overrides the pool's retries.
    pub retries: Option<u32>,
    /// Only replicas with at least this weights version may run it.
    pub min_weights_version: Option<u64>,
    /// The W3C `traceparent` passed on to the worker.
    pub traceparent: Option<String>,
    /// The submitting tenant's pending-task slot, freed when the task ends.
    pub hold: Option<crate::tenants::PendingPermit>,
    /// Journal the task's end (an async submission).
    pub durable: bool,
    /// The id made beforehand with [`Pool::new_id`] (an async submission
    /// is journaled under it before it is queued); a fresh one if `None`.
    pub id: Option<String>,
}

/// Replaces a replica through the pool manager: `(replica, reason)`.
pub type Replacer = Box<dyn Fn(&ReplicaHandle, &str) + Send + Sync>;

/// One warm pool.
pub struct Pool {
    /// Name.
    pub name: String,
    /// Spec.
    spec: arc_swap::ArcSwap<PoolSpec>,
    state: Mutex<PoolState>,
    wake: Notify,
    store: Arc<TaskStore>,
    /// The gateway's one upstream client.
    client: crate::upstream::Upstream,
    ids: AtomicU64,
    replacer: OnceLock<Replacer>,
    /// Asks for an on-demand replica (an interruptible pool's fallback).
    wants_ondemand: OnceLock<Box<dyn Fn() + Send + Sync>>,
    /// Deleted: it takes no new task, finishes those it holds, then its
    /// dispatcher ends.
    closed: std::sync::atomic::AtomicBool,
    /// Told when it has closed and holds nothing.
    emptied: Notify,
    /// Told whenever a request of the pool's app might now find a slot: a
    /// slot freed, a replica added, a sync over.
    freed: Notify,
    metrics: TaskMetrics,
}

/// The task's id, on its `POST /invoke`.
const X_TASK_ID: http::HeaderName = http::HeaderName::from_static("x-warmgate-task-id");
/// Which try of the task this is, from 1.
const X_ATTEMPT: http::HeaderName = http::HeaderName::from_static("x-warmgate-attempt");

/// The metrics every task updates, resolved once for the pool: looking
/// them up by name and labels cost more than updating them.
struct TaskMetrics {
    /// `warmgate_tasks_total` by outcome: `ok`, then [`ErrorKind::ALL`].
    outcomes: Vec<metrics::Counter>,
    /// `warmgate_task_queued_seconds`.
    queued: metrics::Histogram,
    /// `warmgate_task_duration_seconds`.
    duration: metrics::Histogram,
}

impl TaskMetrics {
    fn new(pool: &str) -> Self {
        TaskMetrics {
            outcomes: std::iter::once("ok")
                .chain(ErrorKind::ALL.iter().map(|k| k.as_str()))
                .map(|outcome| {
                    metrics::counter!("warmgate_tasks_total", "pool" => pool.to_string(), "outcome" => outcome)
                })
                .collect(),
            queued: metrics::histogram!("warmgate_task_queued_seconds", "pool" => pool.to_string()),
            duration: metrics::histogram!("warmgate_task_duration_seconds", "pool" => pool.to_string()),
        }
    }

    fn finished(&self, outcome: Option<ErrorKind>) {
        let i = outcome.map_or(0, |k| k as usize + 1);
        if let Some(c) = self.outcomes.get(i) {
            c.increment(1);
        }
    }
}

struct PoolState {
    queue: TaskQueue<Task>,
    replicas: Vec<Arc<ReplicaHandle>>,
    inflight: u32,
    /// The newest weights version synced into the pool.
    latest_version: u64,
    /// Where workers fetch it (`None` until the first sync).
    latest_url: Option<String>,
    /// The checkpoint it was synced from (the spec's until the first sync).
    latest_checkpoint: Option<String>,
    /// The version a sync in progress is rolling out, and where from; the
    /// pool's latest only once a replica has loaded it.
    syncing_to: Option<u64>,
    syncing_url: Option<String>,
    /// Replicas taken out of dispatch while they swap weights.
    syncing: HashSet<String>,
    /// Stopped entirely after `suspend_after` of idleness, until a task
    /// comes.
    suspended: bool,
    /// Tasks on their last try after losing replicas to preemption, for
    /// the on-demand replicas of an interruptible pool (FIFO). They already
    /// count as running in `queue`.
    fallback: VecDeque<Task>,
    /// Requests of the app the pool serves, waiting for a slot: in all,
    /// and by the weights version each asks for at least.
    requests_waiting: usize,
    requests_waiting_need: std::collections::BTreeMap<u64, usize>,
    /// Times the pool failed to start a replica, and the last error:
    /// waiting requests fail with it rather than wait out their timeout.
    start_failures: u64,
    last_start_error: Option<ApiError>,
    /// Those in flight, in all and by replica id.
    requests_inflight: u32,
    requests_on: HashMap<String, u32>,
}

// === impl Pool ===

impl Pool {
    /// A pool at zero replicas.
    pub fn new(
        spec: PoolSpec,
        store: Arc<TaskStore>,
        client: crate::upstream::Upstream,
    ) -> Arc<Self> {
        Arc::new(Pool {
            metrics: TaskMetrics::new(&spec.name),
            name: spec.name.clone(),
            state: Mutex::new(PoolState {
                queue: TaskQueue::new(Limits {
                    max_pending: spec.queue.max_pending as usize,
                    tenant_quota: spec.queue.tenant_quota.map(|q| q as usize),
                })
                .with_weights(spec.queue.tenant_weights.clone()),
                replicas: Vec::new(),
                inflight: 0,
                latest_version: 0,
                latest_url: None,
                latest_checkpoint: spec.checkpoint.clone(),
                syncing_to: None,
                syncing_url: None,
                syncing: HashSet::new(),
                fallback: VecDeque::new(),
                suspended: false,
                requests_waiting: 0,
                requests_waiting_need: std::collections::BTreeMap::new(),
                start_failures: 0,
                last_start_error: None,
                requests_inflight: 0,
                requests_on: HashMap::new(),
            }),
            spec: arc_swap::ArcSwap::from_pointee(spec),
            wake: Notify::new(),
            store,
            client,
            ids: AtomicU64::new(0),
            replacer: OnceLock::new(),
            wants_ondemand: OnceLock::new(),
            closed: std::sync::atomic::AtomicBool::new(false),
            emptied: Notify::new(),
            freed: Notify::new(),
        })
    }

    /// Wakes the dispatcher and every waiting request: a slot or a
    /// replica may be free.
    fn notify(&self) {
        self.wake.notify_one();
        self.freed.notify_waiters();
    }

    /// The split of each replica's slots between requests and tasks.
    fn split(&self) -> Split {
        let spec = self.spec();
        Split::new(spec.concurrency, spec.inference_share)
    }

    /// The newest weights version in the pool: the latest synced, or a
    /// replica's own when it started on newer weights than any sync.
    fn newest_version(st: &PoolState) -> u64 {
        st.replicas
            .iter()
            .map(|r| r.weights_version.load(Ordering::Relaxed))
            .fold(st.latest_version, u64::max)
    }

    /// Refuses a request for weights newer than any the pool has: nothing
    /// would ever serve it, so it is not held.
    pub fn check_min_version(&self, min_version: u64) -> Result<(), ApiError> {
        let newest = Self::newest_version(&self.state.lock());
        if min_version > newest {
            return Err(ApiError::new(
                ErrorKind::Conflict,
                format!(
                    "pool '{}' has weights up to version {newest}; version {min_version} has not been synced",
                    self.name
                ),
            ));
        }
        Ok(())
    }

    /// A slot for a request of the app this pool serves, on a replica whose
    /// weights are at least `min_version` and within `max_staleness` of the
    /// latest, under the per-replica limit and the split with tasks, and
    /// not one of `avoid` (replicas that refused it): at
    /// once, or after a wait of at most `timeout` (as one of at most
    /// `max_pending` waiting requests). `on_wait` runs once if it must wait,
    /// to wake the pool. Gives the slot and the time waited.
    #[allow(clippy::too_many_arguments)]
    pub async fn acquire_request(
        self: &Arc<Self>,
        app: &str,
        min_version: u64,
        avoid: &[String],
        timeout: Duration,
        max_pending: u32,
        on_wait: impl FnOnce(),
    ) -> Result<(RequestSlot, Duration), ApiError> {
        self.check_min_version(min_version)?;
        let since = Instant::now();
        let failures_seen = {
            let mut st = self.state.lock();
            if self.is_closed() {
                return Err(ApiError::new(
                    ErrorKind::NotFound,
                    format!("pool '{}' was deleted", self.name),
                ));
            }
            if let Some(slot) = self.take_request_slot(&mut st, app, min_version, avoid, since) {
                return Ok((slot, Duration::ZERO));
            }
            if st.requests_waiting >= max_pending as usize {
                return Err(ApiError::new(
                    ErrorKind::QueueFull,
                    format!(
                        "pool '{}' is at capacity and already holds {max_pending} requests",
                        self.name
                    ),
                )
                .retry_after(1));
            }
            st.requests_waiting += 1;
            *st.requests_waiting_need.entry(min_version).or_default() += 1;
            st.start_failures
        };
        let _waiting = Waiting(self, min_version);
        on_wait();
        let deadline = since + timeout;
        loop {
            let freed = self.freed.notified();
            tokio::pin!(freed);
            freed.as_mut().enable();
            {
                let mut st = self.state.lock();
                if let Some(slot) = self.take_request_slot(&mut st, app, min_version, avoid, since)
                {
                    return Ok((slot, since.elapsed()));
                }
                // The pool cannot start a replica: waiting would only
                // run out the timeout.
                if st.start_failures != failures_seen
                    && st.ready_pool_replicas() == 0
                    && let Some(e) = st.last_start_error.clone()
                {
                    return Err(e);
                }
            }
            if self.is_closed() {
                return Err(ApiError::new(
                    ErrorKind::NotFound,
                    format!("pool '{}' was deleted", self.name),
                ));
            }
            if tokio::time::timeout_at(deadline.into(), freed)
                .await
                .is_err()
            {
                return Err(ApiError::new(
                    ErrorKind::Timeout,
                    format!(
                        "no replica of pool '{}' with weights version {min_version} or newer had a free slot within {:.1}s",
                        self.name,
                        timeout.as_secs_f64()
                    ),
                ));
            }
        }
    }

    /// Takes a slot for a request, if a replica has one it may use.
    fn take_request_slot(
        self: &Arc<Self>,
        st: &mut PoolState,
        app: &str,
        min_version: u64,
        avoid: &[String],
        since: Instant,
    ) -> Option<RequestSlot> {
        let floor = self.staleness_floor(st);
        let need = min_version.max(floor);
        let split = self.split();
        // Only a task that could run on the replica holds a request back
        // from it.
        let task_need = st.queue.peek().map(|t| t.min_version.max(floor));
        let replica = st.least_loaded(need, |r| {
            if avoid.contains(&r.id) {
                return false;
            }
            let tasks_waiting =
                task_need.is_some_and(|n| r.weights_version.load(Ordering::Relaxed) >= n);
            split.request_may_take(st.requests_on_replica(&r.id), tasks_waiting)
        })?;
        replica.acquire();
        st.requests_inflight += 1;
        *st.requests_on.entry(replica.id.clone()).or_default() += 1;
        Some(RequestSlot {
            pool: self.clone(),
            app: app.to_string(),
            replica,
            since,
        })
    }

    /// The oldest weights version `max_staleness` lets work run on.
    fn staleness_floor(&self, st: &PoolState) -> u64 {
        self.spec()
            .max_staleness
            .map_or(0, |s| st.latest_version.saturating_sub(s))
    }

    /// A request's slot is free again.
    fn release_request(&self, replica: &ReplicaHandle) {
        {
            let mut st = self.state.lock();
            st.requests_inflight = st.requests_inflight.saturating_sub(1);
            if let Some(n) = st.requests_on.get_mut(&replica.id) {
                *n -= 1;
                if *n == 0 {
                    st.requests_on.remove(&replica.id);
                }
            }
        }
        replica.release();
        self.notify();
    }

    /// Takes no new task from now on; the tasks it holds still run.
    pub fn close(&self) {
        self.closed
            .store(true, std::sync::atomic::Ordering::Release);
        self.notify();
    }

    fn is_closed(&self) -> bool {
        self.closed.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Whether it holds no task and no request, waiting or running.
    pub fn is_empty(&self) -> bool {
        let st = self.state.lock();
        st.queue.pending() == 0
            && st.inflight == 0
            && st.fallback.is_empty()
            && st.requests_waiting == 0
            && st.requests_inflight == 0
    }

    /// Waits until it is closed and every task it held has ended.
    pub async fn drained(&self) {
        loop {
            let emptied = self.emptied.notified();
            tokio::pin!(emptied);
            emptied.as_mut().enable();
            if self.is_closed() && self.is_empty() {
                return;
            }
            emptied.await;
        }
    }

    /// The pool-manager target of an interruptible pool's on-demand
    /// replicas: a task's last try, after it lost replicas to preemption,
    /// runs there, so it cannot be preempted forever.
    pub fn ondemand_target(&self) -> Option<TargetId> {
        self.spec()
            .kubernetes
            .interruptible
            .then(|| TargetId::OnDemand(self.name.clone()))
    }

    /// Its spec now ([`Pool::retune`] swaps in new settings).
    pub fn spec(&self) -> Arc<PoolSpec> {
        self.spec.load_full()
    }

    /// Takes the settings of `spec` that need no new replica
    /// ([`PoolSpec::retuned`]), keeping its replicas, queue and weights.
    pub fn retune(&self, spec: &PoolSpec) {
        let next = self.spec().retuned(spec);
        {
            let mut st = self.state.lock();
            st.queue.set_limits(Limits {
                max_pending: next.queue.max_pending as usize,
                tenant_quota: next.queue.tenant_quota.map(|q| q as usize),
            });
            st.queue.set_weights(next.queue.tenant_weights.clone());
        }
        self.spec.store(Arc::new(next));
        self.notify();
    }

    /// The target of its own replicas.
    pub fn target(&self) -> TargetId {
        TargetId::Pool(self.name.clone())
    }

    /// How the pool asks for an on-demand replica (set once, at start).
    pub fn set_ondemand_starter(&self, f: Box<dyn Fn() + Send + Sync>) {
        let _ = self.wants_ondemand.set(f);
    }

    /// How many on-demand replicas the pool wants: enough for the tasks on
    /// their last try, and idle ones kept for `idle_ttl`.
    pub fn ondemand_desired(&self, starting: u32) -> u32 {
        if self.ondemand_target().is_none() {
            return 0;
        }
        let st = self.state.lock();
        let ours: Vec<&Arc<ReplicaHandle>> = st
            .replicas
            .iter()
            .filter(|r| matches!(r.target, TargetId::OnDemand(_)))
            .collect();
        let idle: Vec<Duration> = ours
            .iter()
            .filter(|r| r.is_routable())
            .map(|r| r.idle_for())
            .collect();
        let inflight: u32 = ours.iter().map(|r| r.inflight()).sum();
        warmgate_autoscaler::pool::pool_desired(
            &warmgate_autoscaler::pool::PoolScaling {
                min: 0,
                max: self.spec().replicas[1].max(1),
                concurrency: self.spec().concurrency,
                idle_ttl: self.spec().idle_ttl,
                buffer: 0,
            },
            &warmgate_autoscaler::pool::PoolLoad {
                pending: st.fallback.len(),
                inflight,
                starting,
                idle: &idle,
            },
        )
    }

    /// Fails the tasks waiting for an on-demand replica: none can start.
    pub fn fail_fallback(&self, error: &ApiError) {
        let failed: Vec<Task> = {
            let mut st = self.state.lock();
            let tasks: Vec<Task> = st.fallback.drain(..).collect();
            for t in &tasks {
                st.queue.done(&t.tenant);
            }
            tasks
        };
        for task in failed {
            self.finish(task, Err(error.clone()), None);
        }
    }

    /// How the pool gets a failed replica replaced (set once, at start).
    pub fn set_replacer(&self, f: Replacer) {
        let _ = self.replacer.set(f);
    }

    /// A fresh task id.
    pub fn new_id(&self) -> String {
        let n = self.ids.fetch_add(1, Ordering::Relaxed);
        format!("{}-{:x}-{:x}", self.name, fastrand::u32(..), n)
    }

    /// Refuses `retries` a client asked for above the larger of the pool's
    /// own and [`MAX_CLIENT_RETRIES`].
    pub fn check_retries(&self, retries: Option<u32>) -> Result<(), ApiError> {
        let most = self.spec().retries.max(MAX_CLIENT_RETRIES);
        match retries {
            Some(asked) if asked > most => Err(ApiError::new(
                ErrorKind::BadRequest,
                format!(
                    "retries is {asked}; pool '{}' allows at most {most} (the larger of its own `retries` and {MAX_CLIENT_RETRIES})",
                    self.name
                ),
            )),
            _ => Ok(()),
        }
    }

    /// Queues a task. The receiver gets its outcome.
    pub fn submit(&self, s: Submit) -> Result<(String, oneshot::Receiver<Outcome>), ApiError> {
        if self.is_closed() {
            return Err(ApiError::new(
                ErrorKind::NotFound,
                format!("pool '{}' was deleted", self.name),
            ));
        }
        self.check_retries(s.retries)?;
        let id = s.id.unwrap_or_else(|| self.new_id());
        let charge = self.store.charge(s.input.len() as u64).ok_or_else(|| {
            ApiError::new(
                ErrorKind::QueueFull,
                format!(
                    "the tasks waiting already hold {} bytes of input (limits.max_pending_task_bytes)",
                    self.store.pending_bytes()
                ),
            )
            .retry_after(1)
        })?;
        let (tx, rx) = oneshot::channel();
        let tenant = match self.spec().queue.fairness {
            Fairness::Tenant => s.tenant.clone(),
            Fairness::None => DEFAULT_TENANT.to_string(),
        };
        let owner = s.hold.as_ref().map(|h| h.tenant().to_string());
        let task = Task {
            id: id.clone(),
            tenant: tenant.clone(),
            priority: s.priority,
            min_version: s.min_weights_version.unwrap_or(0),
            traceparent: s
                .traceparent
                .filter(|t| crate::trace::is_valid(t))
                .unwrap_or_else(crate::trace::new_traceparent),
            input: s.input,
            accepted: Instant::now(),
            dispatched: None,
            deadline: Instant::now() + s.timeout.unwrap_or(self.spec().task_timeout),
            retries_left: s.retries.unwrap_or(self.spec().retries),
            system_failures: 0,
            attempts: 0,
            waiter: Some(tx),
            _hold: s.hold,
            _charge: charge,
        };
        // The record is in the store before the task is in the queue: a
        // dispatcher woken by another task's end may take it the moment
        // the queue lock is let go, and its attempt and its end update
        // this record (inserted after, it would have missed the replica
        // and the outcome, and stayed pending for good).
        self.store.insert(TaskRecord {
            id: id.clone(),
            pool: self.name.clone(),
            state: TaskState::Pending,
            output: None,
            error: None,
            attempts: 0,
            replica: None,
            weights_version: None,
            owner,
            durable: s.durable,
        });
        let queued = self.queue_task(task, &tenant, s.priority, s.min_weights_version);
        if let Err(e) = queued {
            self.store.remove(&id);
            return Err(e);
        }
        self.notify();
        Ok((id, rx))
    }

    /// Puts an accepted task in the queue, or refuses it: weights no
    /// replica can have, a full queue, a tenant's quota.
    fn queue_task(
        &self,
        task: Task,
        tenant: &str,
        priority: i32,
        min_weights_version: Option<u64>,
    ) -> Result<(), ApiError> {
        let mut st = self.state.lock();
        if let Some(v) = min_weights_version
            && v > st.latest_version
        {
            return Err(ApiError::new(
                ErrorKind::Conflict,
                format!(
                    "no replica of pool '{}' can have weights version {v}: the latest synced is {} \
                     (POST /v1/pools/{}/weights first)",
                    self.name, st.latest_version, self.name
                ),
            ));
        }
        // Tasks on their last try, waiting for on-demand capacity, count
        // as pending too.
        let max_pending = self.spec().queue.max_pending;
        if !st.fallback.is_empty() && st.queue.pending() + st.fallback.len() >= max_pending as usize
        {
            return Err(ApiError::new(
                ErrorKind::QueueFull,
                format!("pool '{}' already holds {max_pending} tasks", self.name),
            )
            .retry_after(1));
        }
        st.queue
            .push(tenant, priority, task)
            .map_err(|r| match r {
                Refused::QueueFull { max_pending } => ApiError::new(
                    ErrorKind::QueueFull,
                    format!("pool '{}' already holds {max_pending} tasks", self.name),
                )
                .retry_after(1),
                Refused::TenantQuota { tenant, quota } => ApiError::new(
                    ErrorKind::QueueFull,
                    format!(
                        "tenant '{tenant}' already has {quota} tasks pending or running in pool '{}' (its quota)",
                        self.name
                    ),
                )
                .retry_after(1),
            })?;
        // A task ends a suspension: `min` holds again.
        st.suspended = false;
        Ok(())
    }

    /// A replica is ready. One that comes up behind the latest synced
    /// weights (it was started before the sync) is caught up in place.
    pub fn add_replica(self: &Arc<Self>, r: Arc<ReplicaHandle>) {
        self.state.lock().replicas.push(r.clone());
        self.catch_up(&r);
        self.notify();
    }

    /// Syncs `r` to the latest weights in place when it is behind them and
    /// no sync runs (a sync in progress picks it up in its next round).
    pub(crate) fn catch_up(self: &Arc<Self>, r: &Arc<ReplicaHandle>) {
        let catch_up = {
            let mut st = self.state.lock();
            let behind = r.weights_version.load(Ordering::Relaxed) < st.latest_version;
            match (st.latest_url.clone(), st.syncing_to) {
                (Some(url), None) if behind && r.is_routable() && !st.syncing.contains(&r.id) => {
                    st.syncing.insert(r.id.clone());
                    Some((url, st.latest_version))
                }
                _ => None,
            }
        };
        if let Some((url, version)) = catch_up {
            let (pool, r) = (self.clone(), r.clone());
            tokio::spawn(async move {
                let deadline = Instant::now() + pool.spec().weight_sync_timeout;
                let result = pool.sync_replica(&r, &url, version, deadline).await;
                tracing::info!(pool = %pool.name, replica = %r.id, version, ok = result.ok, "caught up a replica that started behind");
                pool.state.lock().syncing.remove(&r.id);
                pool.notify();
            });
        }
    }

    /// A replica must take no more tasks.
    pub fn remove_replica(&self, r: &Arc<ReplicaHandle>) {
        self.state.lock().replicas.retain(|x| !Arc::ptr_eq(x, r));
    }

    /// (pending, in flight, ready replicas).
    pub fn load(&self) -> (usize, u32, usize) {
        let st = self.state.lock();
        (st.queue.pending(), st.inflight, st.replicas.len())
    }

    /// Status for `/v1/status`.
    pub fn status(&self) -> crate::status::PoolStatus {
        let st = self.state.lock();
        crate::status::PoolStatus {
            name: self.name.clone(),
            pending: st.queue.pending(),
            inflight: st.inflight,
            ready: st.replicas.len(),
            min: self.spec().replicas[0],
            max: self.spec().replicas[1],
            concurrency: self.spec().concurrency,
            weights_version: st.latest_version,
            syncing_to: st.syncing_to,
            max_staleness: self.spec().max_staleness,
            ondemand_waiting: st.fallback.len(),
            suspended: st.suspended,
            requests_waiting: st.requests_waiting,
            requests_inflight: st.requests_inflight,
            pool: None,
            ondemand: None,
        }
    }

    /// Fails the waiting tasks whose timeout has passed, so a task never
    /// waits past it even while no replica can take it.
    pub fn expire(&self, now: Instant) {
        let (expired, late, cause) = {
            let mut st = self.state.lock();
            if st.queue.pending() == 0 && st.fallback.is_empty() {
                return;
            }
            let expired = st.queue.take_where(|t| now >= t.deadline);
            let (late, keep): (Vec<Task>, Vec<Task>) =
                st.fallback.drain(..).partition(|t| now >= t.deadline);
            st.fallback = keep.into();
            for t in &late {
                st.queue.done(&t.tenant);
            }
            let cause = st
                .last_start_error
                .clone()
                .filter(|_| st.ready_pool_replicas() == 0);
            (expired, late, cause)
        };
        let any = !expired.is_empty() || !late.is_empty();
        for (_, task) in expired {
            self.finish(task, Err(timeout_error(&self.name, cause.as_ref())), None);
        }
        for task in late {
            self.finish(task, Err(timeout_error(&self.name, cause.as_ref())), None);
        }
        if any {
            // Requests held back by those tasks may go now.
            self.freed.notify_waiters();
        }
    }

    /// Fails every waiting task at once: the pool cannot start a replica.
    pub fn fail_pending(&self, error: &ApiError) {
        let failed = {
            let mut st = self.state.lock();
            st.start_failures += 1;
            st.last_start_error = Some(error.clone());
            st.queue.take_where(|_| true)
        };
        for (_, task) in failed {
            self.finish(task, Err(error.clone()), None);
        }
        // Waiting requests fail too, and ones held back by the tasks may go.
        self.notify();
    }

    /// Whether more tasks wait than the ready replicas have free slots.
    pub fn queued_beyond_free_slots(&self) -> bool {
        let st = self.state.lock();
        let spot = st
            .replicas
            .iter()
            .filter(|r| matches!(r.target, TargetId::Pool(_)))
            .count();
        let slots = spot as u64 * u64::from(self.spec().concurrency);
        let waiting = (st.queue.pending() + st.requests_waiting) as u64;
        waiting > slots.saturating_sub(u64::from(st.inflight + st.requests_inflight))
    }

    /// The replica count the pool wants now, by the warm-pool policy:
    /// enough slots for its queued tasks, `buffer` spare, and idle replicas
    /// stopped after `idle_ttl`, never below `min`. `starting` counts the
    /// replicas started and not ready yet.
    pub fn desired(&self, starting: u32) -> u32 {
        let mut st = self.state.lock();
        let idle: Vec<Duration> = st
            .replicas
            .iter()
            .filter(|r| r.is_routable() && matches!(r.target, TargetId::Pool(_)))
            .map(|r| r.idle_for())
            .collect();
        let spec = self.spec();
        let cfg = warmgate_autoscaler::pool::PoolScaling {
            min: spec.replicas[0],
            max: spec.replicas[1],
            concurrency: spec.concurrency,
            idle_ttl: spec.idle_ttl,
            buffer: spec.buffer,
        };
        // Scaling sees both kinds of work: the tasks and the requests of
        // the app the pool serves.
        let load = warmgate_autoscaler::pool::PoolLoad {
            pending: st.queue.pending() + st.requests_waiting,
            inflight: st.inflight + st.requests_inflight,
            starting,
            idle: &idle,
        };
        let suspended =
            warmgate_autoscaler::pool::suspended(spec.suspend_after, st.suspended, &load);
        if suspended && !st.suspended {
            tracing::info!(pool = %self.name, after = ?spec.suspend_after, "pool idle: stopping every replica until a task comes");
        }
        st.suspended = suspended;
        if suspended {
            return 0;
        }
        warmgate_autoscaler::pool::pool_desired(&cfg, &load)
    }

    /// Runs the dispatcher until the runtime stops, or until the pool is
    /// closed and holds no task.
    pub async fn run(self: Arc<Self>) {
        loop {
            let notified = self.wake.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            while let Some((task, replica)) = self.next() {
                let pool = self.clone();
                tokio::spawn(async move { pool.attempt(task, replica).await });
            }
            if self.is_closed() && self.is_empty() {
                self.emptied.notify_waiters();
                return;
            }
            notified.await;
        }
    }

    /// The next task and a replica with room for it whose weights are new
    /// enough (the task's `min_weights_version`, and the pool's
    /// `max_staleness`); expired tasks fail.
    ///
    /// The queue's head waits for such a replica rather than letting later
    /// tasks pass it: a version it asks for is one already synced, so a
    /// replica reaches it within the sync's deadline, or is replaced.
    fn next(&self) -> Option<(Task, Arc<ReplicaHandle>)> {
        if let Some(next) = self.next_fallback() {
            return Some(next);
        }
        loop {
            let mut st = self.state.lock();
            let floor = self.staleness_floor(&st);
            let (deadline, min_version) = {
                let head = st.queue.peek()?;
                (head.deadline, head.min_version)
            };
            if Instant::now() >= deadline {
                let (_, task) = st.queue.pop()?;
                st.queue.done(&task.tenant);
                drop(st);
                self.finish(task, Err(timeout_error(&self.name, None)), None);
                self.freed.notify_waiters();
                continue;
            }
            let need = min_version.max(floor);
            let split = self.split();
            // Only a request that could run on the replica holds a task
            // back from it.
            let request_need = st
                .requests_waiting_need
                .keys()
                .next()
                .map(|n| (*n).max(floor));
            let replica = st.least_loaded(need, |r| {
                let requests_waiting =
                    request_need.is_some_and(|n| r.weights_version.load(Ordering::Relaxed) >= n);
                split.task_may_take(
                    r.inflight().saturating_sub(st.requests_on_replica(&r.id)),
                    requests_waiting,
                )
            })?;
            let (_, task) = st.queue.pop()?;
            replica.acquire();
            st.inflight += 1;
            return Some((task, replica));
        }
    }

    /// A task on its last try and an on-demand replica with room for it.
    fn next_fallback(&self) -> Option<(Task, Arc<ReplicaHandle>)> {
        self.ondemand_target()?;
        let mut st = self.state.lock();
        let head = st.fallback.front()?;
        let need = head.min_version;
        let replica = st
            .replicas
            .iter()
            .filter(|r| {
                matches!(r.target, TargetId::OnDemand(_))
                    && r.is_routable()
                    && r.has_free_slot()
                    && !st.syncing.contains(&r.id)
                    && r.weights_version.load(Ordering::Relaxed) >= need
            })
            .min_by_key(|r| r.inflight())
            .cloned()?;
        let task = st.fallback.pop_front()?;
        replica.acquire();
        st.inflight += 1;
        Some((task, replica))
    }

    async fn attempt(self: Arc<Self>, mut task: Task, replica: Arc<ReplicaHandle>) {
        task.attempts += 1;
        if task.dispatched.is_none() {
            let now = Instant::now();
            task.dispatched = Some(now);
            self.metrics
                .queued
                .record(now.saturating_duration_since(task.accepted).as_secs_f64());
        }
        let id = task.id.clone();
        self.store.update(&id, |r| {
            r.state = TaskState::Running;
            r.attempts = task.attempts;
            r.replica = Some(replica.id.clone());
        });
        let left = task.deadline.saturating_duration_since(Instant::now());
        let result = tokio::time::timeout(left, self.invoke(&task, &replica)).await;
        // A task to be tried again counts as waiting from the moment it
        // stops running, under the same lock: `max_pending` never sees it
        // in neither place.
        let retried = match &result {
            Ok(Err(Failure::System(_))) => task.system_failures < MAX_SYSTEM_RETRIES,
            Ok(Err(Failure::User(_))) => task.retries_left > 0,
            _ => false,
        };
        {
            let mut st = self.state.lock();
            st.inflight -= 1;
            if retried {
                st.queue.retry_later();
            }
        }
        replica.release();
        self.notify();
        match result {
            Err(_) => {
                self.state.lock().queue.done(&task.tenant);
                self.finish(task, Err(timeout_error(&self.name, None)), Some(&replica));
            }
            Ok(Ok(output)) => {
                self.state.lock().queue.done(&task.tenant);
                self.finish(task, Ok(output), Some(&replica));
            }
            Ok(Err(Failure::System(why))) => {
                task.system_failures += 1;
                metrics::counter!("warmgate_task_retries_total", "pool" => self.name.clone(), "cause" => "system").increment(1);
                if task.system_failures > MAX_SYSTEM_RETRIES {
                    self.state.lock().queue.done(&task.tenant);
                    let msg = format!(
                        "the task lost {} replicas in a row (last: {why})",
                        task.system_failures
                    );
                    self.finish(
                        task,
                        Err(ApiError::new(ErrorKind::ReplicaFailed, msg)),
                        Some(&replica),
                    );
                } else {
                    tracing::warn!(task = %id, replica = %replica.id, %why, "replica lost under a task; requeued");
                    // Give the pool manager a moment to take the lost
                    // replica out of rotation before the task is retried.
                    self.store.update(&id, |r| r.state = TaskState::Pending);
                    tokio::time::sleep(SYSTEM_RETRY_PAUSE * task.system_failures).await;
                    if task.system_failures == MAX_SYSTEM_RETRIES
                        && self.ondemand_target().is_some()
                    {
                        // The last try of an interruptible pool's task runs
                        // on on-demand capacity, out of the preemptions' reach.
                        tracing::warn!(task = %id, "last try: on an on-demand replica");
                        metrics::counter!("warmgate_task_ondemand_fallbacks_total", "pool" => self.name.clone()).increment(1);
                        let mut st = self.state.lock();
                        st.queue.retry_elsewhere();
                        st.fallback.push_back(task);
                        drop(st);
                        if let Some(start) = self.wants_ondemand.get() {
                            start();
                        }
                    } else {
                        let (tenant, priority) = (task.tenant.clone(), task.priority);
                        self.state.lock().queue.requeue(&tenant, priority, task);
                    }
                    self.notify();
                }
            }
            Ok(Err(Failure::User(why))) => {
                if task.retries_left == 0 {
                    self.state.lock().queue.done(&task.tenant);
                    let msg = format!(
                        "the task failed in the worker after {} attempt(s): {why}",
                        task.attempts
                    );
                    self.finish(
                        task,
                        Err(ApiError::new(ErrorKind::ReplicaFailed, msg)),
                        Some(&replica),
                    );
                    return;
                }
                task.retries_left -= 1;
                metrics::counter!("warmgate_task_retries_total", "pool" => self.name.clone(), "cause" => "user").increment(1);
                let backoff =
                    RETRY_BASE.saturating_mul(1 << task.attempts.saturating_sub(1).min(10));
                self.store.update(&id, |r| r.state = TaskState::Pending);
                tokio::time::sleep(
                    backoff.min(task.deadline.saturating_duration_since(Instant::now())),
                )
                .await;
                let (tenant, priority) = (task.tenant.clone(), task.priority);
                self.state.lock().queue.requeue(&tenant, priority, task);
                self.notify();
            }
        }
    }

    async fn invoke(&self, task: &Task, replica: &ReplicaHandle) -> Result<Output, Failure> {
        let req = http::Request::post("/invoke")
            .header(http::header::CONTENT_TYPE, "application/json")
            .header(X_TASK_ID, task.id.as_str())
            .header(X_ATTEMPT, task.attempts)
            .header(crate::trace::TRACEPARENT, task.traceparent.as_str())
            .body(axum::body::Body::from(task.input.clone()))
            .map_err(|e| Failure::User(format!("bad request: {e}")))?;
        let resp = self
            .client
            .send_to(replica.addr, req)
            .await
            .map_err(|e| Failure::System(format!("replica {}: {}", replica.id, e.error)))?;
        let status = resp.status();
        let body = Limited::new(resp.into_body(), MAX_OUTPUT_BYTES)
            .collect()
            .await
            .map_err(|e| {
                Failure::System(format!("replica {} broke off its answer: {e}", replica.id))
            })?
            .to_bytes();
        if !status.is_success() {
            let text = String::from_utf8_lossy(&body[..body.len().min(512)]).into_owned();
            return Err(Failure::User(format!(
                "the worker answered {status}: {text}"
            )));
        }
        Output::parse(&body)
            .map_err(|e| Failure::User(format!("the worker's answer is not JSON: {e}")))
    }

    fn finish(
        &self,
        mut task: Task,
        result: Result<Output, ApiError>,
        replica: Option<&ReplicaHandle>,
    ) {
        let weights_version = replica.map(|r| r.weights_version.load(Ordering::Relaxed));
        self.metrics.finished(result.as_ref().err().map(|e| e.kind));
        self.metrics
            .duration
            .record(task.accepted.elapsed().as_secs_f64());
        let record = self.store.update(&task.id, |r| {
            r.attempts = task.attempts;
            r.weights_version = weights_version;
            match &result {
                Ok(v) => {
                    r.state = TaskState::Succeeded;
                    r.output = Some(v.clone());
                }
                Err(e) => {
                    r.state = TaskState::Failed;
                    r.error =
                        Some(serde_json::json!({"kind": e.kind.as_str(), "message": e.message}));
                }
            }
        });
        if let Some(tx) = task.waiter.take() {
            let _ = tx.send(match result {
                Ok(_) => record.ok_or_else(|| {
                    ApiError::new(ErrorKind::NotFound, "the task record was evicted")
                }),
                Err(e) => Err(e),
            });
        }
    }
}

impl PoolState {
    /// Ready replicas of the pool's own target.
    fn ready_pool_replicas(&self) -> usize {
        self.replicas
            .iter()
            .filter(|r| r.is_routable() && matches!(r.target, TargetId::Pool(_)))
            .count()
    }

    /// Requests of the pool's app running on replica `id`.
    fn requests_on_replica(&self, id: &str) -> u32 {
        self.requests_on.get(id).copied().unwrap_or(0)
    }

    /// The pool replica with the least in flight that can take work now:
    /// routable, a free slot, not swapping weights, weights at least
    /// `need`, and a slot `may_take` allows (the split).
    fn least_loaded(
        &self,
        need: u64,
        may_take: impl Fn(&ReplicaHandle) -> bool,
    ) -> Option<Arc<ReplicaHandle>> {
        self.replicas
            .iter()
            .filter(|r| {
                r.is_routable()
                    && matches!(r.target, TargetId::Pool(_))
                    && r.has_free_slot()
                    && !self.syncing.contains(&r.id)
                    && r.weights_version.load(Ordering::Relaxed) >= need
                    && may_take(r)
            })
            .min_by_key(|r| r.inflight())
            .cloned()
    }
}

/// A request of the app a pool serves, counted as waiting (for weights
/// at least this version) while it lives.
struct Waiting<'a>(&'a Pool, u64);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        {
            let mut st = self.0.state.lock();
            st.requests_waiting -= 1;
            if let Some(n) = st.requests_waiting_need.get_mut(&self.1) {
                *n -= 1;
                if *n == 0 {
                    st.requests_waiting_need.remove(&self.1);
                }
            }
        }
        // Tasks held back for it may go now.
        self.0.wake.notify_one();
    }
}

/// A slot on a pool's replica held by a request of the app the pool
/// serves; dropping it frees the slot.
pub struct RequestSlot {
    pool: Arc<Pool>,
    app: String,
    replica: Arc<ReplicaHandle>,
    since: Instant,
}

impl crate::serving::proxy::Slot for RequestSlot {
    fn replica(&self) -> &Arc<ReplicaHandle> {
        &self.replica
    }

    fn first_byte(&self) {
        metrics::histogram!("warmgate_time_to_first_byte_seconds", "app" => self.app.clone())
            .record(self.since.elapsed().as_secs_f64());
    }
}

impl Drop for RequestSlot {
    fn drop(&mut self) {
        metrics::histogram!("warmgate_request_duration_seconds", "app" => std::mem::take(&mut self.app))
            .record(self.since.elapsed().as_secs_f64());
        self.pool.release_request(&self.replica);
    }
}

enum Failure {
    /// The replica went away: requeue without spending the budget.
    System(String),
    /// The worker answered with an error: spends the budget.
    User(String),
}

/// A task's timeout passed; `cause` is the pool's last failure to start
/// a replica when none is ready, so the answer says why it never ran.
fn timeout_error(pool: &str, cause: Option<&ApiError>) -> ApiError {
    let because = cause.map_or(String::new(), |e| {
        format!(" (no replica is ready: {})", e.message)
    });
    ApiError::new(
        ErrorKind::Timeout,
        format!("the task did not finish within its timeout in pool '{pool}'{because}"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn replica(id: &str, version: u64) -> Arc<ReplicaHandle> {
        let r = ReplicaHandle::new(
            id.into(),
            TargetId::Pool("p".into()),
            "p-00001".into(),
            "127.0.0.1:9".parse().expect("addr"),
            1,
            Instant::now(),
        );
        r.weights_version.store(version, Ordering::Relaxed);
        Arc::new(r)
    }

    fn submit(pool: &Pool, min: Option<u64>) {
        pool.submit(Submit {
            input: Bytes::from_static(b"1"),
            priority: 0,
            tenant: DEFAULT_TENANT.into(),
            timeout: None,
            retries: None,
            min_weights_version: min,
            traceparent: None,
            hold: None,
            durable: false,
            id: None,
        })
        .expect("accepted");
    }

    /// A dispatcher on another thread may take a task the moment it is
    /// queued: its record must already be there for the attempt and the
    /// end to land on. And a refused task leaves no record behind.
    #[test]
    fn a_task_taken_at_once_by_another_thread_has_its_record() {
        const N: usize = 100_000;
        let pool = Arc::new(Pool::new(
            PoolSpec {
                name: "p".into(),
                ..PoolSpec::default()
            },
            Arc::new(TaskStore::default()),
            crate::upstream::Upstream::new(),
        ));
        pool.add_replica(replica("r", 0));
        let taker = {
            let pool = pool.clone();
            std::thread::spawn(move || {
                let (mut taken, mut missing) = (0, 0);
                while taken < N {
                    if let Some((task, r)) = pool.next() {
                        if pool.store.get(&task.id).is_none() {
                            missing += 1;
                        }
                        r.release();
                        pool.state.lock().inflight -= 1;
                        pool.state.lock().queue.done(&task.tenant);
                        taken += 1;
                    } else {
                        std::thread::yield_now();
                    }
                }
                missing
            })
        };
        let mut sent = 0;
        while sent < N {
            let accepted = pool.submit(Submit {
                input: Bytes::from_static(b"1"),
                priority: 0,
                tenant: DEFAULT_TENANT.into(),
                timeout: None,
                retries: None,
                min_weights_version: None,
                traceparent: None,
                hold: None,
                durable: false,
                id: None,
            });
            match accepted {
                Ok(_) => sent += 1,
                // The queue is full: the taker catches up.
                Err(e) if e.kind == ErrorKind::QueueFull => std::thread::yield_now(),
                Err(e) => panic!("refused: {e:?}"),
            }
        }
        assert_eq!(
            taker.join().expect("taker"),
            0,
            "tasks taken before their record was stored"
        );

        let before = pool.store.len();
        let refused = pool.submit(Submit {
            input: Bytes::from_static(b"1"),
            priority: 0,
            tenant: DEFAULT_TENANT.into(),
            timeout: None,
            retries: None,
            min_weights_version: Some(9),
            traceparent: None,
            hold: None,
            durable: false,
            id: None,
        });
        assert!(refused.is_err());
        assert_eq!(pool.store.len(), before, "a refused task left its record");
    }

    #[tokio::test]
    async fn dispatch_respects_staleness_and_task_versions() {
        let spec = PoolSpec {
            name: "p".into(),
            max_staleness: Some(1),
            ..PoolSpec::default()
        };
        let pool = Pool::new(
            spec,
            Arc::new(TaskStore::default()),
            crate::upstream::Upstream::new(),
        );
        for (id, v) in [("old", 0), ("behind", 2), ("latest", 3)] {
            pool.add_replica(replica(id, v));
        }
        // Version 3 was synced (a replica proved it).
        pool.make_latest(3, "http://127.0.0.1:9/v1/weights/p/v3");

        // Staleness 1 from version 3: "old" (0) never gets a task.
        for _ in 0..3 {
            submit(&pool, None);
        }
        let (_, a) = pool.next().expect("first");
        let (_, b) = pool.next().expect("second");
        let mut got = [a.id.clone(), b.id.clone()];
        got.sort();
        assert_eq!(got, ["behind".to_string(), "latest".to_string()]);
        assert!(pool.next().is_none(), "only a stale replica is free");
        a.release();
        b.release();
        let (_, c) = pool.next().expect("third");
        assert_ne!(c.id, "old");
        c.release();

        // A task asking for version 3 waits for "latest" even when
        // "behind" is free.
        let latest = pool.state.lock().replicas[2].clone();
        latest.acquire();
        submit(&pool, Some(3));
        assert!(pool.next().is_none());
        latest.release();
        let (_, d) = pool.next().expect("fourth");
        assert_eq!(d.id, "latest");

        // Versions beyond the latest synced are refused at once.
        let e = pool
            .submit(Submit {
                input: Bytes::from_static(b"1"),
                priority: 0,
                tenant: DEFAULT_TENANT.into(),
                timeout: None,
                retries: None,
                min_weights_version: Some(4),
                traceparent: None,
                hold: None,
                durable: false,
                id: None,
            })
            .expect_err("refused");
        assert_eq!(e.kind, ErrorKind::Conflict);
        // A sync of an older version, or of the latest's number with
        // another checkpoint, is a new version: going back is a step
        // forward, not a conflict.
        pool.state.lock().syncing_to = None;
        pool.state.lock().latest_checkpoint = Some("file:///v3".into());
        assert_eq!(pool.version_for(2, "file:///v1"), 4);
        assert_eq!(pool.version_for(3, "file:///v3"), 3);
        assert_eq!(pool.version_for(3, "file:///v1"), 4);
        assert_eq!(pool.version_for(1, "file:///v3"), 3);
        assert_eq!(pool.version_for(9, "file:///v9"), 9);
    }
}
