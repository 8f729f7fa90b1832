//! The batches being streamed now, by id, so that one can be cancelled
//! (`DELETE /v1/batches/{id}`): its tasks not yet submitted never are, and
//! those queued or running are cancelled at once, whether or not its
//! client is reading. A batch leaves the registry when its stream ends or
//! its client goes (which cancels what is left of it too).

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use parking_lot::Mutex;
use tokio_util::sync::CancellationToken;

use super::pool::Pool;

/// The live batches.
#[derive(Default)]
pub struct Batches {
    live: Mutex<HashMap<String, Live>>,
}

struct Live {
    /// The tenant that submitted it, when keys are configured.
    owner: Option<String>,
    token: CancellationToken,
    pool: Arc<Pool>,
    /// Its tasks submitted and not finished.
    tasks: HashSet<String>,
}

impl Live {
    /// Cancels the batch and its unfinished tasks.
    fn cancel(&mut self) {
        self.token.cancel();
        for id in self.tasks.drain() {
            self.pool.cancel(&id);
        }
    }
}

/// Why a batch could not be cancelled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NotCancelled {
    /// No batch streams under that id now (it ended, or never was), or it
    /// is another tenant's.
    Unknown,
}

impl Batches {
    /// Registers a new batch of `owner` on `pool`: the guard that keeps
    /// it registered (and cancels what is left of it when dropped).
    pub fn begin(self: &Arc<Self>, owner: Option<String>, pool: Arc<Pool>) -> Arc<BatchGuard> {
        let id = format!("batch-{:016x}", fastrand::u64(..));
        let token = CancellationToken::new();
        self.live.lock().insert(
            id.clone(),
            Live {
                owner,
                token: token.clone(),
                pool,
                tasks: HashSet::new(),
            },
        );
        Arc::new(BatchGuard {
            batches: self.clone(),
            id,
            token,
        })
    }

    /// Cancels batch `id`, if `caller` (a tenant, or `None` for any) may.
    /// Its tasks' tokens are the batch's children, cancelled at once; the
    /// queued ones are then taken out, outside the registry's lock.
    pub fn cancel(&self, id: &str, caller: Option<&str>) -> Result<(), NotCancelled> {
        let (pool, tasks) = {
            let mut live = self.live.lock();
            let b = live.get_mut(id).ok_or(NotCancelled::Unknown)?;
            if caller.is_some() && b.owner.as_deref() != caller {
                return Err(NotCancelled::Unknown);
            }
            b.token.cancel();
            (b.pool.clone(), std::mem::take(&mut b.tasks))
        };
        for task in tasks {
            pool.cancel(&task);
        }
        Ok(())
    }

    /// Batches streaming now.
    pub fn len(&self) -> usize {
        self.live.lock().len()
    }

    /// Whether none is.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A live batch: registered until dropped, which happens when its stream
/// ends or is dropped (its client left); dropping it cancels what is left.
pub struct BatchGuard {
    batches: Arc<Batches>,
    id: String,
    token: CancellationToken,
}

impl BatchGuard {
    /// Its cancellation.
    pub fn token(&self) -> &CancellationToken {
        &self.token
    }

    /// Its id.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// Task `task` of the batch was submitted: cancelled with the batch.
    /// Whether the batch still runs (if not, cancel the task yourself).
    pub fn track(&self, task: &str) -> bool {
        let mut live = self.batches.live.lock();
        match live.get_mut(&self.id) {
            Some(b) if !b.token.is_cancelled() => {
                b.tasks.insert(task.to_string());
                true
            }
            _ => false,
        }
    }

    /// Task `task` ended.
    pub fn untrack(&self, task: &str) {
        if let Some(b) = self.batches.live.lock().get_mut(&self.id) {
            b.tasks.remove(task);
        }
    }
}

impl Drop for BatchGuard {
    fn drop(&mut self) {
        let live = self.batches.live.lock().remove(&self.id);
        if let Some(mut b) = live {
            b.cancel();
        }
    }
}
