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

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use parking_lot::Mutex;
use serde::Serialize;
use serde_json::Value;
use tokio::sync::{Notify, oneshot};
use warmgate_deploy::{Fairness, PoolSpec};
use warmgate_pool::ReplicaHandle;

use crate::error::{ApiError, ErrorKind};
use crate::taskqueue::{Limits, Refused, TaskQueue};

/// Replicas lost under one task before it fails for good.
pub const MAX_SYSTEM_RETRIES: u32 = 5;
/// Pause before retrying a task whose replica was lost, times the number of
/// losses: the pool manager sees a process exit within milliseconds.
const SYSTEM_RETRY_PAUSE: Duration = Duration::from_millis(100);
/// Finished tasks kept for `GET /v1/tasks/{id}`; the oldest go first.
const MAX_FINISHED: usize = 100_000;
/// The largest worker answer read.
const MAX_OUTPUT_BYTES: usize = 64 * 1024 * 1024;
/// First delay before retrying a task that failed in user code.
const RETRY_BASE: Duration = Duration::from_millis(100);
/// Tenant of tasks without `X-Warmgate-Tenant`.
pub const DEFAULT_TENANT: &str = "default";

/// A task's lifecycle state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum TaskState {
    /// Waiting in the queue.
    Pending,
    /// On a replica.
    Running,
    /// Done, with an output.
    Succeeded,
    /// Done, with an error.
    Failed,
}

/// What `GET /v1/tasks/{id}` shows.
#[derive(Debug, Clone, Serialize)]
pub struct TaskRecord {
    /// Task id.
    pub id: String,
    /// Pool.
    pub pool: String,
    /// State.
    pub state: TaskState,
    /// The worker's answer, once succeeded.
    pub output: Option<Value>,
    /// Why it failed, once failed.
    pub error: Option<Value>,
    /// Attempts made.
    pub attempts: u32,
    /// The replica of the last attempt.
    pub replica: Option<String>,
    /// Its weights version.
    pub weights_version: Option<u64>,
}

/// A finished task, as the synchronous API answers it.
pub type Outcome = Result<TaskRecord, ApiError>;

/// Every task the gateway knows, bounded.
#[derive(Default)]
pub struct TaskStore {
    inner: Mutex<StoreInner>,
}

#[derive(Default)]
struct StoreInner {
    records: HashMap<String, TaskRecord>,
    finished: VecDeque<String>,
}

impl TaskStore {
    /// A task's record.
    pub fn get(&self, id: &str) -> Option<TaskRecord> {
        self.inner.lock().records.get(id).cloned()
    }

    fn insert(&self, r: TaskRecord) {
        self.inner.lock().records.insert(r.id.clone(), r);
    }

    fn update(&self, id: &str, f: impl FnOnce(&mut TaskRecord)) -> Option<TaskRecord> {
        let mut s = self.inner.lock();
        let r = s.records.get_mut(id)?;
        f(r);
        let out = r.clone();
        if matches!(out.state, TaskState::Succeeded | TaskState::Failed) {
            s.finished.push_back(id.to_string());
            while s.finished.len() > MAX_FINISHED {
                if let Some(old) = s.finished.pop_front() {
                    s.records.remove(&old);
                }
            }
        }
        Some(out)
    }
}

/// One accepted task.
struct Task {
    id: String,
    tenant: String,
    priority: i32,
    input: Bytes,
    deadline: Instant,
    retries_left: u32,
    system_failures: u32,
    attempts: u32,
    waiter: Option<oneshot::Sender<Outcome>>,
}

/// What a submitter asks for.
#[derive(Debug, Clone)]
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
}

/// One warm pool.
pub struct Pool {
    /// Name.
    pub name: String,
    /// Spec.
    pub spec: PoolSpec,
    state: Mutex<PoolState>,
    wake: Notify,
    store: Arc<TaskStore>,
    client: Client<HttpConnector, Full<Bytes>>,
    ids: AtomicU64,
}

struct PoolState {
    queue: TaskQueue<Task>,
    replicas: Vec<Arc<ReplicaHandle>>,
    inflight: u32,
    /// Last time the demand needed at least the desired count.
    busy_at: Instant,
    desired: u32,
}

// === impl Pool ===

impl Pool {
    /// A pool at zero replicas.
    pub fn new(spec: PoolSpec, store: Arc<TaskStore>) -> Arc<Self> {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        Arc::new(Pool {
            name: spec.name.clone(),
            state: Mutex::new(PoolState {
                queue: TaskQueue::new(Limits {
                    max_pending: spec.queue.max_pending as usize,
                    tenant_quota: spec.queue.tenant_quota.map(|q| q as usize),
                }),
                replicas: Vec::new(),
                inflight: 0,
                busy_at: Instant::now(),
                desired: spec.replicas[0],
            }),
            spec,
            wake: Notify::new(),
            store,
            client: Client::builder(TokioExecutor::new()).build(connector),
            ids: AtomicU64::new(0),
        })
    }

    /// Queues a task. The receiver gets its outcome.
    pub fn submit(&self, s: Submit) -> Result<(String, oneshot::Receiver<Outcome>), ApiError> {
        let n = self.ids.fetch_add(1, Ordering::Relaxed);
        let id = format!("{}-{:x}-{:x}", self.name, fastrand::u32(..), n);
        let (tx, rx) = oneshot::channel();
        let tenant = match self.spec.queue.fairness {
            Fairness::Tenant => s.tenant.clone(),
            Fairness::None => DEFAULT_TENANT.to_string(),
        };
        let task = Task {
            id: id.clone(),
            tenant: tenant.clone(),
            priority: s.priority,
            input: s.input,
            deadline: Instant::now() + s.timeout.unwrap_or(self.spec.task_timeout),
            retries_left: s.retries.unwrap_or(self.spec.retries),
            system_failures: 0,
            attempts: 0,
            waiter: Some(tx),
        };
        {
            let mut st = self.state.lock();
            st.queue
                .push(&tenant, s.priority, task)
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
        }
        self.store.insert(TaskRecord {
            id: id.clone(),
            pool: self.name.clone(),
            state: TaskState::Pending,
            output: None,
            error: None,
            attempts: 0,
            replica: None,
            weights_version: None,
        });
        self.wake.notify_one();
        Ok((id, rx))
    }

    /// A replica is ready.
    pub fn add_replica(&self, r: Arc<ReplicaHandle>) {
        self.state.lock().replicas.push(r);
        self.wake.notify_one();
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
    pub fn status(&self) -> serde_json::Value {
        let st = self.state.lock();
        serde_json::json!({
            "name": self.name,
            "pending": st.queue.pending(),
            "inflight": st.inflight,
            "ready": st.replicas.len(),
            "desired": st.desired,
            "min": self.spec.replicas[0],
            "max": self.spec.replicas[1],
            "concurrency": self.spec.concurrency,
        })
    }

    /// The replica count the pool wants now: enough slots for its tasks,
    /// within `[min, max]`, and a count lowers only after `idle_ttl` below it.
    pub fn desired(&self, now: Instant) -> u32 {
        let mut st = self.state.lock();
        let [min, max] = self.spec.replicas;
        let demand = st.queue.pending() as u32 + st.inflight;
        let need = demand
            .div_ceil(self.spec.concurrency)
            .clamp(min, max.max(1));
        if need >= st.desired {
            st.busy_at = now;
            st.desired = need;
        } else if now.saturating_duration_since(st.busy_at) >= self.spec.idle_ttl {
            st.desired = need;
            st.busy_at = now;
        }
        st.desired
    }

    /// Runs the dispatcher until the runtime stops.
    pub async fn run(self: Arc<Self>) {
        loop {
            let notified = self.wake.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            while let Some((task, replica)) = self.next() {
                let pool = self.clone();
                tokio::spawn(async move { pool.attempt(task, replica).await });
            }
            notified.await;
        }
    }

    /// The next task and a replica with room for it; expired tasks fail.
    fn next(&self) -> Option<(Task, Arc<ReplicaHandle>)> {
        loop {
            let mut st = self.state.lock();
            let replica = st
                .replicas
                .iter()
                .filter(|r| r.is_routable() && r.has_free_slot())
                .min_by_key(|r| r.inflight())
                .cloned()?;
            let (_, task) = st.queue.pop()?;
            if Instant::now() >= task.deadline {
                st.queue.done(&task.tenant);
                drop(st);
                self.finish(task, Err(timeout_error(&self.name)), None);
                continue;
            }
            replica.acquire();
            st.inflight += 1;
            return Some((task, replica));
        }
    }

    async fn attempt(self: Arc<Self>, mut task: Task, replica: Arc<ReplicaHandle>) {
        task.attempts += 1;
        let id = task.id.clone();
        self.store.update(&id, |r| {
            r.state = TaskState::Running;
            r.attempts = task.attempts;
            r.replica = Some(replica.id.clone());
        });
        let left = task.deadline.saturating_duration_since(Instant::now());
        let result = tokio::time::timeout(left, self.invoke(&task, &replica)).await;
        {
            let mut st = self.state.lock();
            st.inflight -= 1;
        }
        replica.release();
        self.wake.notify_one();
        match result {
            Err(_) => {
                self.state.lock().queue.done(&task.tenant);
                self.finish(task, Err(timeout_error(&self.name)), Some(&replica));
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
                    let (tenant, priority) = (task.tenant.clone(), task.priority);
                    self.state.lock().queue.requeue(&tenant, priority, task);
                    self.wake.notify_one();
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
                self.wake.notify_one();
            }
        }
    }

    async fn invoke(&self, task: &Task, replica: &ReplicaHandle) -> Result<Value, Failure> {
        let uri = format!("http://{}/invoke", replica.addr);
        let req = http::Request::post(uri)
            .header(http::header::CONTENT_TYPE, "application/json")
            .header("x-warmgate-task-id", task.id.as_str())
            .header("x-warmgate-attempt", task.attempts)
            .body(Full::new(task.input.clone()))
            .map_err(|e| Failure::User(format!("bad request: {e}")))?;
        let resp = self
            .client
            .request(req)
            .await
            .map_err(|e| Failure::System(format!("replica {}: {e}", replica.id)))?;
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
        serde_json::from_slice(&body)
            .map_err(|e| Failure::User(format!("the worker's answer is not JSON: {e}")))
    }

    fn finish(
        &self,
        mut task: Task,
        result: Result<Value, ApiError>,
        replica: Option<&ReplicaHandle>,
    ) {
        let weights_version = replica.map(|r| r.weights_version.load(Ordering::Relaxed));
        let outcome_label = if result.is_ok() { "ok" } else { "failed" };
        metrics::counter!("warmgate_tasks_total", "pool" => self.name.clone(), "outcome" => outcome_label).increment(1);
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

enum Failure {
    /// The replica went away: requeue without spending the budget.
    System(String),
    /// The worker answered with an error: spends the budget.
    User(String),
}

fn timeout_error(pool: &str) -> ApiError {
    ApiError::new(
        ErrorKind::Timeout,
        format!("the task did not finish within its timeout in pool '{pool}'"),
    )
}
