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
use parking_lot::Mutex;
use tokio::sync::{Notify, oneshot};
use warmgate_deploy::{PoolSpec, TargetId};
use warmgate_pool::ReplicaHandle;

use super::queue::{Limits, TaskQueue};
use super::split::Split;
use super::store::{InputCharge, TaskStore};
use crate::error::{Error, ErrorKind};

mod cancel;
mod dispatch;
mod replicas;
mod slots;
mod submit;
mod sync;
#[cfg(test)]
mod tests;

pub use cancel::{Cancelled, Ended};
pub use slots::RequestSlot;
pub use sync::{ReplicaSync, SyncOutcome, WeightsAt};

/// Replicas lost under one task before it fails for good.
pub const MAX_SYSTEM_RETRIES: u32 = 5;
/// The most `retries` a client may ask for on a pool whose own `retries`
/// is lower: each retry of a task that keeps failing is another call on a
/// worker, for as long as the task's timeout.
pub const MAX_CLIENT_RETRIES: u32 = 20;
/// Tenant of tasks without `X-Warmgate-Tenant`.
pub const DEFAULT_TENANT: &str = "default";

pub use super::record::{Output, TaskRecord, TaskState};

/// A finished task, as the synchronous API answers it.
pub type Outcome = Result<TaskRecord, Error>;

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
    /// Cancelled by `DELETE /v1/tasks/{id}` (or its batch, or its client
    /// leaving): its attempt is dropped, and it is not run again.
    cancel: tokio_util::sync::CancellationToken,
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
    /// Its cancellation, when it belongs to something cancelled as a whole
    /// (a batch's child token); a fresh one if `None`. Already cancelled,
    /// the task is refused; cancelled later, it never starts a call.
    pub cancel: Option<tokio_util::sync::CancellationToken>,
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

/// The metrics every task updates, resolved once for the pool: looking
/// them up by name and labels cost more than updating them.
struct TaskMetrics {
    /// `warmgate_tasks_total` by outcome: `ok`, then [`ErrorKind::ALL`].
    outcomes: crate::outcomes::Outcomes,
    /// `warmgate_task_queued_seconds`.
    queued: metrics::Histogram,
    /// `warmgate_task_duration_seconds`.
    duration: metrics::Histogram,
}

impl TaskMetrics {
    fn new(pool: &str) -> Self {
        TaskMetrics {
            outcomes: crate::outcomes::Outcomes::new("warmgate_tasks_total", "pool", pool),
            queued: metrics::histogram!("warmgate_task_queued_seconds", "pool" => pool.to_string()),
            duration: metrics::histogram!("warmgate_task_duration_seconds", "pool" => pool.to_string()),
        }
    }

    fn finished(&self, outcome: Option<ErrorKind>) {
        self.outcomes.count(outcome);
    }
}

struct PoolState {
    queue: TaskQueue<Task>,
    replicas: Vec<Arc<ReplicaHandle>>,
    inflight: u32,
    /// The newest weights version synced into the pool.
    latest_version: u64,
    /// Where workers fetch it (`None` until the first sync).
    latest_url: Option<sync::WeightsAt>,
    /// The checkpoint it was synced from (the spec's until the first sync).
    latest_checkpoint: Option<String>,
    /// The version a sync in progress is rolling out, and where from; the
    /// pool's latest only once a replica has loaded it.
    syncing_to: Option<u64>,
    syncing_url: Option<sync::WeightsAt>,
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
    last_start_error: Option<Error>,
    /// Those in flight, in all and by replica id.
    requests_inflight: u32,
    requests_on: HashMap<String, u32>,
    /// The cancellation of every task accepted and not finished, by id.
    cancels: HashMap<String, cancel::Handle>,
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
                cancels: HashMap::new(),
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

    /// The oldest weights version `max_staleness` lets work run on.
    fn staleness_floor(&self, st: &PoolState) -> u64 {
        self.spec()
            .max_staleness
            .map_or(0, |s| st.latest_version.saturating_sub(s))
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

/// A task's timeout passed; `cause` is the pool's last failure to start
/// a replica when none is ready, so the answer says why it never ran.
fn timeout_error(pool: &str, cause: Option<&Error>) -> Error {
    let because = cause.map_or(String::new(), |e| {
        format!(" (no replica is ready: {})", e.message)
    });
    Error::new(
        ErrorKind::Timeout,
        format!("the task did not finish within its timeout in pool '{pool}'{because}"),
    )
}
