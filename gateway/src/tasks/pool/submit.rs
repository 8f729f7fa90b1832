//! Tasks into and out of a pool's queue: ids, admission (`submit`, its
//! retries and the queue's limits), tasks failed while they wait (expired,
//! or no replica can start), and a task's end written to the task store
//! and sent to its waiter.

use std::sync::atomic::Ordering;
use std::time::Instant;

use tokio::sync::oneshot;
use warmgate_deploy::Fairness;
use warmgate_pool::ReplicaHandle;

use super::{
    DEFAULT_TENANT, MAX_CLIENT_RETRIES, Outcome, Output, Pool, Submit, Task, TaskRecord, TaskState,
    timeout_error,
};
use crate::error::{Error, ErrorKind};
use crate::tasks::queue::Refused;

impl Pool {
    /// A fresh task id.
    pub fn new_id(&self) -> String {
        let n = self.ids.fetch_add(1, Ordering::Relaxed);
        format!("{}-{:x}-{:x}", self.name, fastrand::u32(..), n)
    }

    /// Refuses `retries` a client asked for above the larger of the pool's
    /// own and [`MAX_CLIENT_RETRIES`].
    pub fn check_retries(&self, retries: Option<u32>) -> Result<(), Error> {
        let most = self.spec().retries.max(MAX_CLIENT_RETRIES);
        match retries {
            Some(asked) if asked > most => Err(Error::new(
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
    pub fn submit(&self, s: Submit) -> Result<(String, oneshot::Receiver<Outcome>), Error> {
        if self.is_closed() {
            return Err(Error::new(
                ErrorKind::NotFound,
                format!("pool '{}' was deleted", self.name),
            ));
        }
        self.check_retries(s.retries)?;
        let id = s.id.unwrap_or_else(|| self.new_id());
        let charge = self.store.charge(s.input.len() as u64).ok_or_else(|| {
            Error::new(
                ErrorKind::QueueFull,
                format!(
                    "the tasks waiting already hold {} bytes of input (limits.max_pending_task_bytes)",
                    self.store.pending_bytes()
                ),
            )
            .retry_after(1)
        })?;
        let (tx, rx) = oneshot::channel();
        let cancel = s.cancel.unwrap_or_default();
        if cancel.is_cancelled() {
            return Err(super::cancel::cancelled("before it was queued"));
        }
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
            cancel: cancel.clone(),
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
    ) -> Result<(), Error> {
        let mut st = self.state.lock();
        let (id, cancel) = (task.id.clone(), task.cancel.clone());
        if let Some(v) = min_weights_version
            && v > st.latest_version
        {
            return Err(Error::new(
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
            return Err(Error::new(
                ErrorKind::QueueFull,
                format!("pool '{}' already holds {max_pending} tasks", self.name),
            )
            .retry_after(1));
        }
        st.queue
            .push(tenant, priority, task)
            .map_err(|r| match r {
                Refused::QueueFull { max_pending } => Error::new(
                    ErrorKind::QueueFull,
                    format!("pool '{}' already holds {max_pending} tasks", self.name),
                )
                .retry_after(1),
                Refused::TenantQuota { tenant, quota } => Error::new(
                    ErrorKind::QueueFull,
                    format!(
                        "tenant '{tenant}' already has {quota} tasks pending or running in pool '{}' (its quota)",
                        self.name
                    ),
                )
                .retry_after(1),
            })?;
        st.cancels.insert(id, super::cancel::Handle::new(cancel));
        // A task ends a suspension: `min` holds again.
        st.suspended = false;
        Ok(())
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
    pub fn fail_pending(&self, error: &Error) {
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

    /// Fails the tasks waiting for an on-demand replica: none can start.
    pub fn fail_fallback(&self, error: &Error) {
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

    pub(super) fn finish(
        &self,
        mut task: Task,
        result: Result<Output, Error>,
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
                    r.state = if e.kind == ErrorKind::Cancelled {
                        TaskState::Cancelled
                    } else {
                        TaskState::Failed
                    };
                    r.error =
                        Some(serde_json::json!({"kind": e.kind.as_str(), "message": e.message}));
                }
            }
        });
        // Whoever cancelled it learns how it ended.
        if let Some(h) = self.state.lock().cancels.remove(&task.id) {
            let state = match &result {
                Ok(_) => TaskState::Succeeded,
                Err(e) if e.kind == ErrorKind::Cancelled => TaskState::Cancelled,
                Err(_) => TaskState::Failed,
            };
            h.ended.set(state);
        }
        if let Some(tx) = task.waiter.take() {
            let _ = tx.send(match result {
                Ok(_) => record
                    .ok_or_else(|| Error::new(ErrorKind::NotFound, "the task record was evicted")),
                Err(e) => Err(e),
            });
        }
    }
}
