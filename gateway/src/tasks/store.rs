//! Every task the gateway knows: records bounded in count and bytes, and
//! the input bytes of the tasks alive (`limits.max_pending_task_bytes`).

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use parking_lot::Mutex;

use super::record::TaskRecord;

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
/// within `limits.max_task_results_bytes`, shared fairly between their
/// owners (tenants): when the budget is full, the oldest result of the
/// owner that holds the most goes first, so one tenant's flood of large
/// results drops its own before anyone else's.
#[derive(Default)]
pub struct TaskStore {
    inner: Mutex<StoreInner>,
    journal: OnceLock<Arc<super::journal::Journal>>,
    limits: StoreLimits,
    /// Input bytes charged by live tasks (see [`InputCharge`]).
    pending_bytes: Arc<AtomicU64>,
    /// The batches streaming now.
    pub batches: Arc<super::batches::Batches>,
}

#[derive(Default)]
struct StoreInner {
    records: HashMap<String, TaskRecord>,
    /// Finished async tasks by owner (`None`: no tenant).
    finished: HashMap<Option<String>, Finished>,
    /// Over every owner.
    finished_bytes: u64,
    finished_count: usize,
}

/// One owner's finished async tasks, oldest first, with the bytes each
/// holds.
#[derive(Default)]
struct Finished {
    queue: VecDeque<(String, u64)>,
    bytes: u64,
}

impl StoreInner {
    /// Drops the oldest finished result of the owner holding the most
    /// (bytes, or count when only the count is over), until both bounds
    /// hold. Returns how many were dropped.
    fn evict(&mut self, max_bytes: u64) -> u64 {
        let mut evicted = 0;
        while self.finished_count > MAX_FINISHED || self.finished_bytes > max_bytes {
            let by_count = self.finished_bytes <= max_bytes;
            let heaviest = self
                .finished
                .iter()
                .max_by_key(|(_, f)| {
                    if by_count {
                        f.queue.len() as u64
                    } else {
                        f.bytes
                    }
                })
                .map(|(owner, _)| owner.clone());
            let Some(owner) = heaviest else { break };
            let Some(f) = self.finished.get_mut(&owner) else {
                break;
            };
            let Some((old, n)) = f.queue.pop_front() else {
                self.finished.remove(&owner);
                continue;
            };
            f.bytes -= n;
            if f.queue.is_empty() {
                self.finished.remove(&owner);
            }
            self.records.remove(&old);
            self.finished_bytes -= n;
            self.finished_count -= 1;
            evicted += 1;
        }
        evicted
    }
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
        let ended = out.state.ended();
        if ended && !out.durable {
            // Its outcome goes to its waiter, the only one who asked.
            s.records.remove(id);
        } else if ended {
            let bytes = record_bytes(&out);
            let mine = s.finished.entry(out.owner.clone()).or_default();
            mine.queue.push_back((id.to_string(), bytes));
            mine.bytes += bytes;
            s.finished_bytes += bytes;
            s.finished_count += 1;
            let evicted = s.evict(self.limits.max_results_bytes);
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tasks::record::TaskState;

    fn finish(store: &TaskStore, id: &str, owner: Option<&str>, output_bytes: usize) {
        store.insert(TaskRecord {
            id: id.to_string(),
            pool: "p".into(),
            state: TaskState::Running,
            output: None,
            error: None,
            attempts: 1,
            replica: None,
            weights_version: None,
            owner: owner.map(str::to_string),
            durable: true,
        });
        let text = format!("\"{}\"", "x".repeat(output_bytes));
        let output = super::super::record::Output::parse(text.as_bytes()).expect("json");
        store.update(id, |r| {
            r.state = TaskState::Succeeded;
            r.output = Some(output);
        });
    }

    #[test]
    fn one_tenant_s_flood_of_large_results_drops_its_own_first() {
        const MIB: usize = 1 << 20;
        let store = TaskStore::new(StoreLimits {
            max_pending_bytes: u64::MAX,
            max_results_bytes: 64 * MIB as u64,
        });
        finish(&store, "a-1", Some("team-a"), 2 * MIB);
        for i in 0..20 {
            finish(&store, &format!("b-{i}"), Some("team-b"), 4 * MIB);
        }
        assert!(store.get("a-1").is_some_and(|r| r.output.is_some()));
        // team-b kept what fits beside team-a's share, newest first.
        assert!(store.get("b-19").is_some() && store.get("b-0").is_none());
        let s = store.inner.lock();
        assert!(s.finished_bytes <= 64 * MIB as u64);
        assert_eq!(
            s.finished_count,
            s.finished.values().map(|f| f.queue.len()).sum::<usize>()
        );
    }

    #[test]
    fn with_one_owner_the_oldest_goes_first_as_before() {
        let store = TaskStore::new(StoreLimits {
            max_pending_bytes: u64::MAX,
            max_results_bytes: 10_000,
        });
        for i in 0..10 {
            finish(&store, &format!("t-{i}"), None, 3_000);
        }
        let kept: Vec<bool> = (0..10)
            .map(|i| store.get(&format!("t-{i}")).is_some())
            .collect();
        assert_eq!(
            kept,
            [
                false, false, false, false, false, false, false, true, true, true
            ]
        );
    }
}
