//! Every task the gateway knows: records bounded in count and bytes, and
//! the input bytes of the tasks alive (`limits.max_pending_task_bytes`).

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use parking_lot::Mutex;

use super::record::{TaskRecord, TaskState};

/// Finished async tasks kept for `GET /v1/tasks/{id}`, whatever their
/// size; the oldest go first (`limits.max_task_results_bytes` bounds their
/// bytes).
const MAX_FINISHED: usize = 100_000;

/// Byte bounds of the task store.
#[derive(Debug, Clone, Copy)]
pub struct StoreLimits {
    /// Input bytes of the tasks accepted and not ended, over every pool.
    pub max_pending_bytes: u64,
    /// Bytes of finished async task records kept in memory.
    pub max_results_bytes: u64,
}

impl Default for StoreLimits {
    fn default() -> Self {
        StoreLimits {
            max_pending_bytes: warmgate_deploy::defaults::MAX_PENDING_TASK_BYTES,
            max_results_bytes: warmgate_deploy::defaults::MAX_TASK_RESULTS_BYTES,
        }
    }
}

/// Every task the gateway knows, bounded in count and in bytes. A task
/// submitted without `?async=true` (one task or a batch) is forgotten once
/// its outcome is handed to its waiter; finished async tasks are kept
/// within `limits.max_task_results_bytes`, oldest dropped first.
#[derive(Default)]
pub struct TaskStore {
    inner: Mutex<StoreInner>,
    journal: OnceLock<Arc<super::journal::Journal>>,
    limits: StoreLimits,
    /// Input bytes charged by live tasks (see [`InputCharge`]).
    pending_bytes: Arc<AtomicU64>,
}

#[derive(Default)]
struct StoreInner {
    records: HashMap<String, TaskRecord>,
    /// Finished async tasks, oldest first, with the bytes each holds.
    finished: VecDeque<(String, u64)>,
    finished_bytes: u64,
}

/// A live task's share of `limits.max_pending_task_bytes`, given back when
/// the task is dropped (it ended, or was refused).
#[derive(Debug)]
pub struct InputCharge {
    bytes: u64,
    total: Arc<AtomicU64>,
}

impl Drop for InputCharge {
    fn drop(&mut self) {
        self.total.fetch_sub(self.bytes, Ordering::Relaxed);
    }
}

/// Bytes a finished record holds in memory, about.
fn record_bytes(r: &TaskRecord) -> u64 {
    let output = r.output.as_ref().map_or(0, |o| o.get().len());
    // The error is a short message; ids and names are small.
    let rest = 256 + r.id.len() + r.error.as_ref().map_or(0, |_| 512);
    (output + rest) as u64
}

impl TaskStore {
    /// An empty store within `limits`.
    pub fn new(limits: StoreLimits) -> Self {
        TaskStore {
            limits,
            ..TaskStore::default()
        }
    }

    /// Charges `bytes` of input to the pending budget, or `None` when the
    /// tasks alive already hold too much.
    pub(super) fn charge(&self, bytes: u64) -> Option<InputCharge> {
        let max = self.limits.max_pending_bytes;
        self.pending_bytes
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |cur| {
                cur.checked_add(bytes).filter(|n| *n <= max)
            })
            .ok()?;
        Some(InputCharge {
            bytes,
            total: self.pending_bytes.clone(),
        })
    }

    /// Input bytes held by the tasks alive.
    pub fn pending_bytes(&self) -> u64 {
        self.pending_bytes.load(Ordering::Relaxed)
    }

    /// Records held, for tests.
    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.inner.lock().records.len()
    }

    /// A task's record.
    pub fn get(&self, id: &str) -> Option<TaskRecord> {
        self.inner.lock().records.get(id).cloned()
    }

    /// Where async tasks are journaled (set once, at start).
    pub fn set_journal(&self, j: Arc<super::journal::Journal>) {
        let _ = self.journal.set(j);
    }

    /// The journal, if any.
    pub fn journal(&self) -> Option<&Arc<super::journal::Journal>> {
        self.journal.get()
    }

    pub(super) fn insert(&self, r: TaskRecord) {
        self.inner.lock().records.insert(r.id.clone(), r);
    }

    /// Forgets a record that never ran (its task was refused).
    pub(super) fn remove(&self, id: &str) {
        self.inner.lock().records.remove(id);
    }

    pub(super) fn update(&self, id: &str, f: impl FnOnce(&mut TaskRecord)) -> Option<TaskRecord> {
        let mut s = self.inner.lock();
        let r = s.records.get_mut(id)?;
        f(r);
        let out = r.clone();
        let ended = matches!(out.state, TaskState::Succeeded | TaskState::Failed);
        if ended && !out.durable {
            // Its outcome goes to its waiter, the only one who asked.
            s.records.remove(id);
        } else if ended {
            let bytes = record_bytes(&out);
            s.finished.push_back((id.to_string(), bytes));
            s.finished_bytes += bytes;
            let mut evicted = 0u64;
            while s.finished.len() > MAX_FINISHED
                || s.finished_bytes > self.limits.max_results_bytes
            {
                let Some((old, n)) = s.finished.pop_front() else {
                    break;
                };
                s.records.remove(&old);
                s.finished_bytes -= n;
                evicted += 1;
            }
            if evicted > 0 {
                metrics::counter!("warmgate_task_results_evicted_total").increment(evicted);
            }
        }
        drop(s);
        if ended
            && out.durable
            && let Some(j) = self.journal.get()
        {
            j.end(&out);
        }
        Some(out)
    }
}
