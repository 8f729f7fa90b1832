//! A pool's dispatcher: the loop that hands queued tasks to replicas with
//! room and new enough weights, each attempt's `POST /invoke`, and what
//! follows its outcome (done, retried with backoff, requeued after a lost
//! replica, or moved to on-demand capacity for its last try).

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use http_body_util::{BodyExt, Limited};
use warmgate_deploy::TargetId;
use warmgate_pool::ReplicaHandle;

use super::cancel::cancelled;
use super::{MAX_SYSTEM_RETRIES, Output, Pool, Task, TaskState, timeout_error};
use crate::error::{Error, ErrorKind};

/// Pause before retrying a task whose replica was lost, times the number of
/// losses: the pool manager sees a process exit within milliseconds.
const SYSTEM_RETRY_PAUSE: Duration = Duration::from_millis(100);
/// The largest worker answer read.
const MAX_OUTPUT_BYTES: usize = 64 * 1024 * 1024;
/// First delay before retrying a task that failed in user code.
const RETRY_BASE: Duration = Duration::from_millis(100);

/// The task's id, on its `POST /invoke`.
const X_TASK_ID: http::HeaderName = http::HeaderName::from_static("x-warmgate-task-id");
/// Which try of the task this is, from 1.
const X_ATTEMPT: http::HeaderName = http::HeaderName::from_static("x-warmgate-attempt");

impl Pool {
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
    pub(super) fn next(&self) -> Option<(Task, Arc<ReplicaHandle>)> {
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

    /// Runs `task` once on `replica`, then ends it or has it tried again.
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
        let invoked = tokio::select! {
            biased;
            () = task.cancel.cancelled() => None,
            r = tokio::time::timeout(left, self.invoke(&task, &replica)) => Some(r),
        };
        let Some(result) = invoked else {
            // Cancelled: the request to the worker is dropped with the
            // future above, and the task is not tried again.
            {
                let mut st = self.state.lock();
                st.inflight -= 1;
                st.queue.done(&task.tenant);
            }
            replica.release();
            self.notify();
            let when = format!("while it ran on replica {}", replica.id);
            self.finish(task, Err(cancelled(&when)), Some(&replica));
            return;
        };
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
            Ok(Err(Failure::System(why))) => self.after_lost_replica(task, &replica, why).await,
            Ok(Err(Failure::User(why))) => self.after_worker_error(task, &replica, why).await,
        }
    }

    /// After the task's replica was lost under it: requeued (its last try
    /// on an on-demand replica, when the pool has them) unless it lost too
    /// many in a row.
    async fn after_lost_replica(&self, mut task: Task, replica: &Arc<ReplicaHandle>, why: String) {
        let id = task.id.clone();
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
                Err(Error::new(ErrorKind::ReplicaFailed, msg)),
                Some(replica),
            );
        } else {
            tracing::warn!(task = %id, replica = %replica.id, %why, "replica lost under a task; requeued");
            // Give the pool manager a moment to take the lost
            // replica out of rotation before the task is retried.
            self.store.update(&id, |r| r.state = TaskState::Pending);
            let pause = SYSTEM_RETRY_PAUSE * task.system_failures;
            if self.paused_or_cancelled(&task, pause).await {
                self.finish(task, Err(cancelled("before its retry")), Some(replica));
                return;
            }
            if task.system_failures == MAX_SYSTEM_RETRIES && self.ondemand_target().is_some() {
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
                self.requeue(task, replica);
            }
            self.notify();
        }
    }

    /// After the worker failed the task: tried again after a backoff
    /// while it has retries left.
    async fn after_worker_error(&self, mut task: Task, replica: &Arc<ReplicaHandle>, why: String) {
        let id = task.id.clone();
        if task.retries_left == 0 {
            self.state.lock().queue.done(&task.tenant);
            let msg = format!(
                "the task failed in the worker after {} attempt(s): {why}",
                task.attempts
            );
            self.finish(
                task,
                Err(Error::new(ErrorKind::ReplicaFailed, msg)),
                Some(replica),
            );
            return;
        }
        task.retries_left -= 1;
        metrics::counter!("warmgate_task_retries_total", "pool" => self.name.clone(), "cause" => "user").increment(1);
        let backoff = RETRY_BASE.saturating_mul(1 << task.attempts.saturating_sub(1).min(10));
        self.store.update(&id, |r| r.state = TaskState::Pending);
        let pause = backoff.min(task.deadline.saturating_duration_since(Instant::now()));
        if self.paused_or_cancelled(&task, pause).await {
            self.finish(task, Err(cancelled("before its retry")), Some(replica));
            return;
        }
        self.requeue(task, replica);
        self.notify();
    }

    /// Puts a task back at the head of its queue after its pause, unless it
    /// was cancelled meanwhile (checked under the lock a cancel takes, so
    /// a cancel either finds it queued or sees it ended here).
    fn requeue(&self, task: Task, replica: &ReplicaHandle) {
        let mut st = self.state.lock();
        if task.cancel.is_cancelled() {
            st.queue.retry_elsewhere();
            st.queue.done(&task.tenant);
            drop(st);
            self.finish(task, Err(cancelled("before its retry")), Some(replica));
            return;
        }
        let (tenant, priority) = (task.tenant.clone(), task.priority);
        st.queue.requeue(&tenant, priority, task);
    }

    /// Waits out a retry's `pause`; whether the task was cancelled in it
    /// (then it no longer counts as waiting, nor in flight for its tenant).
    async fn paused_or_cancelled(&self, task: &Task, pause: Duration) -> bool {
        tokio::select! {
            biased;
            () = task.cancel.cancelled() => {
                let mut st = self.state.lock();
                st.queue.retry_elsewhere();
                st.queue.done(&task.tenant);
                true
            }
            () = tokio::time::sleep(pause) => false,
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
            .send_to(&replica.addr, req)
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
}

enum Failure {
    /// The replica went away: requeue without spending the budget.
    System(String),
    /// The worker answered with an error: spends the budget.
    User(String),
}
