//! Cancelling a task: a queued one is taken out and never runs; a running
//! one's request to the worker is dropped (the worker sees its client
//! leave) and it is not tried again. Either way its record says
//! `cancelled`, and a client waiting for it is answered so.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use super::{Pool, Task, TaskState};
use crate::error::{Error, ErrorKind};

/// A task's cancellation, kept while it is unfinished.
#[derive(Debug, Clone)]
pub(super) struct Handle {
    token: CancellationToken,
    /// Its end, once recorded.
    pub(super) ended: Arc<Ended>,
}

impl Handle {
    pub(super) fn new(token: CancellationToken) -> Self {
        Handle {
            token,
            ended: Arc::default(),
        }
    }
}

/// How a task ended, told to whoever cancelled it.
#[derive(Debug, Default)]
pub struct Ended {
    state: OnceLock<TaskState>,
    told: Notify,
}

impl Ended {
    /// The task ended in `state` (its record is written).
    pub(super) fn set(&self, state: TaskState) {
        let _ = self.state.set(state);
        self.told.notify_waiters();
    }

    /// Its final state, waited for up to `within`; `None` if it has not
    /// ended by then.
    pub async fn wait(&self, within: Duration) -> Option<TaskState> {
        let told = self.told.notified();
        tokio::pin!(told);
        told.as_mut().enable();
        if let Some(s) = self.state.get() {
            return Some(*s);
        }
        let _ = tokio::time::timeout(within, told).await;
        self.state.get().copied()
    }
}

/// Where a task was when it was cancelled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cancelled {
    /// Waiting in the queue (or for on-demand capacity): it never runs.
    Queued,
    /// On a replica, or pausing before a retry: its attempt is dropped.
    Running,
}

impl Pool {
    /// Cancels task `id` of this pool: where it was, and what is told
    /// once its end is recorded (at once for a queued one; as soon as its
    /// attempt is dropped for a running one). `None` when the pool holds
    /// no such task unfinished (it ended, or is not this pool's).
    pub fn cancel(&self, id: &str) -> Option<(Cancelled, Arc<Ended>)> {
        let (handle, taken) = {
            let mut st = self.state.lock();
            let handle = st.cancels.get(id)?.clone();
            let mut taken: Vec<Task> = st
                .queue
                .take_where(|t| t.id == id)
                .into_iter()
                .map(|(_, t)| t)
                .collect();
            if let Some(i) = st.fallback.iter().position(|t| t.id == id)
                && let Some(t) = st.fallback.remove(i)
            {
                st.queue.done(&t.tenant);
                taken.push(t);
            }
            (handle, taken)
        };
        handle.token.cancel();
        metrics::counter!("warmgate_tasks_cancelled_total", "pool" => self.name.clone())
            .increment(1);
        if taken.is_empty() {
            // Its attempt (or its pause before a retry) sees the token.
            return Some((Cancelled::Running, handle.ended));
        }
        for task in taken {
            self.finish(task, Err(cancelled("before it ran")), None);
        }
        // Requests and tasks held back by it may go now.
        self.notify();
        Some((Cancelled::Queued, handle.ended))
    }
}

/// The error a cancelled task ends with.
pub(super) fn cancelled(when: &str) -> Error {
    Error::new(
        ErrorKind::Cancelled,
        format!("the task was cancelled {when}"),
    )
}
