//! The task queue of a pool: bounded, priority first, weighted round-robin
//! across tenants within a priority, FIFO within a tenant, with per-tenant
//! quotas.
//!
//! A tenant's weight is the number of tasks it takes per turn (default 1):
//! with weights `a = 3` and `b = 1`, a busy `a` gets three tasks for each of
//! `b`'s, and neither can starve the other.
//!
//! It is a plain data structure with synchronous operations; the async task
//! API (issue 5) drives it. Every operation is O(log P) in the number of
//! distinct priorities and O(1) otherwise.

use std::collections::{BTreeMap, HashMap, VecDeque};

/// Why a task was not accepted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refused {
    /// The pool's backlog is at `max_pending`.
    QueueFull {
        /// The bound.
        max_pending: usize,
    },
    /// This tenant already has its quota of tasks pending or in flight.
    TenantQuota {
        /// The tenant.
        tenant: String,
        /// Its quota.
        quota: usize,
    },
}

/// Bounds of a queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Tasks waiting, all tenants together: queued, or waiting out the
    /// pause before a retry.
    pub max_pending: usize,
    /// Tasks pending plus in flight for one tenant (`None`: no quota).
    pub tenant_quota: Option<usize>,
}

/// One priority level: tenants in round-robin order, each with its FIFO.
#[derive(Debug)]
struct Level<T> {
    ring: VecDeque<String>,
    queues: HashMap<String, VecDeque<T>>,
    /// Tasks the tenant at the head of `ring` has taken in its turn.
    turns: u32,
}

/// A bounded task queue with priorities and fairness across tenants.
#[derive(Debug)]
pub struct TaskQueue<T> {
    limits: Limits,
    /// Highest priority first.
    levels: BTreeMap<std::cmp::Reverse<i32>, Level<T>>,
    /// Per tenant: (pending, in flight).
    tenants: HashMap<String, (usize, usize)>,
    pending: usize,
    /// Tasks popped whose attempt failed, waiting out the pause before they
    /// are put back ([`TaskQueue::retry_later`]): they count as waiting.
    retrying: usize,
    /// Turns per round of the tenants that have more than one.
    weights: HashMap<String, u32>,
}

impl<T> TaskQueue<T> {
    /// An empty queue.
    pub fn new(limits: Limits) -> Self {
        TaskQueue {
            limits,
            levels: BTreeMap::new(),
            tenants: HashMap::new(),
            pending: 0,
            retrying: 0,
            weights: HashMap::new(),
        }
    }

    /// Gives tenants more than one task per turn.
    pub fn with_weights(mut self, weights: impl IntoIterator<Item = (String, u32)>) -> Self {
        self.set_weights(weights);
        self
    }

    /// Changes the tenants' turns per round from the next turn on.
    pub fn set_weights(&mut self, weights: impl IntoIterator<Item = (String, u32)>) {
        self.weights = weights.into_iter().filter(|(_, w)| *w > 1).collect();
    }

    /// Changes the bounds for tasks pushed from now on; tasks already
    /// queued stay, even beyond a lower bound.
    pub fn set_limits(&mut self, limits: Limits) {
        self.limits = limits;
    }

    /// The task [`TaskQueue::pop`] would return next.
    pub fn peek(&self) -> Option<&T> {
        let (_, level) = self.levels.first_key_value()?;
        let tenant = level.ring.front()?;
        level.queues.get(tenant)?.front()
    }

    /// Tasks waiting: queued, or waiting out the pause before a retry.
    pub fn pending(&self) -> usize {
        self.pending + self.retrying
    }

    /// (pending, in flight) of a tenant.
    pub fn tenant(&self, tenant: &str) -> (usize, usize) {
        self.tenants.get(tenant).copied().unwrap_or((0, 0))
    }

    /// Accepts a task, or says at once why not.
    pub fn push(&mut self, tenant: &str, priority: i32, task: T) -> Result<(), Refused> {
        if self.pending() >= self.limits.max_pending {
            return Err(Refused::QueueFull {
                max_pending: self.limits.max_pending,
            });
        }
        let (pending, inflight) = self.tenant(tenant);
        if let Some(quota) = self.limits.tenant_quota
            && pending + inflight >= quota
        {
            return Err(Refused::TenantQuota {
                tenant: tenant.to_string(),
                quota,
            });
        }
        self.enqueue(tenant, priority, task, false);
        self.tenants.entry(tenant.to_string()).or_default().0 += 1;
        self.pending += 1;
        Ok(())
    }

    /// Adds a task to its tenant's queue at its priority, at the back, or
    /// at the front (a requeue, which also puts the tenant first in turn).
    fn enqueue(&mut self, tenant: &str, priority: i32, task: T, front: bool) {
        let level = self
            .levels
            .entry(std::cmp::Reverse(priority))
            .or_insert_with(|| Level {
                ring: VecDeque::new(),
                queues: HashMap::new(),
                turns: 0,
            });
        let q = level.queues.entry(tenant.to_string()).or_default();
        if q.is_empty() {
            if front {
                level.turns = 0;
                level.ring.push_front(tenant.to_string());
            } else {
                level.ring.push_back(tenant.to_string());
            }
        }
        if front {
            q.push_front(task);
        } else {
            q.push_back(task);
        }
    }

    /// The next task to dispatch: the highest priority, then the tenant
    /// whose turn it is at that priority, then that tenant's oldest task. It
    /// counts as in flight for its tenant until [`TaskQueue::done`].
    pub fn pop(&mut self) -> Option<(String, T)> {
        let mut entry = self.levels.first_entry()?;
        let level = entry.get_mut();
        let tenant = level
            .ring
            .front()
            .cloned()
            .expect("a level with tasks has tenants");
        let q = level
            .queues
            .get_mut(&tenant)
            .expect("a tenant in the ring has a queue");
        let task = q.pop_front().expect("a tenant in the ring has tasks");
        level.turns += 1;
        let weight = self.weights.get(&tenant).copied().unwrap_or(1);
        if q.is_empty() {
            level.queues.remove(&tenant);
            level.ring.pop_front();
            level.turns = 0;
        } else if level.turns >= weight {
            level.ring.rotate_left(1);
            level.turns = 0;
        }
        if level.ring.is_empty() {
            entry.remove();
        }
        let t = self.tenants.entry(tenant.clone()).or_default();
        t.0 -= 1;
        t.1 += 1;
        self.pending -= 1;
        Some((tenant, task))
    }

    /// A popped task of `tenant` has finished (or failed for good).
    pub fn done(&mut self, tenant: &str) {
        if let Some(t) = self.tenants.get_mut(tenant) {
            t.1 = t.1.saturating_sub(1);
            if *t == (0, 0) {
                self.tenants.remove(tenant);
            }
        }
    }

    /// Takes out every waiting task `pred` picks (expired ones, say), as
    /// if each had been popped and finished. O(n) in the tasks waiting.
    pub fn take_where(&mut self, mut pred: impl FnMut(&T) -> bool) -> Vec<(String, T)> {
        let mut out = Vec::new();
        for level in self.levels.values_mut() {
            for (tenant, q) in level.queues.iter_mut() {
                if !q.iter().any(&mut pred) {
                    continue;
                }
                let mut kept = VecDeque::with_capacity(q.len());
                for task in q.drain(..) {
                    if pred(&task) {
                        out.push((tenant.clone(), task));
                    } else {
                        kept.push_back(task);
                    }
                }
                *q = kept;
            }
            let head = level.ring.front().cloned();
            level.queues.retain(|_, q| !q.is_empty());
            level.ring.retain(|t| level.queues.contains_key(t));
            if level.ring.front() != head.as_ref() {
                level.turns = 0;
            }
        }
        self.levels.retain(|_, l| !l.ring.is_empty());
        for (tenant, _) in &out {
            if let Some(t) = self.tenants.get_mut(tenant) {
                t.0 -= 1;
                if *t == (0, 0) {
                    self.tenants.remove(tenant);
                }
            }
            self.pending -= 1;
        }
        out
    }

    /// A popped task's attempt failed and it will be tried again after a
    /// pause: until [`TaskQueue::requeue`] (or [`TaskQueue::retry_elsewhere`])
    /// it counts as waiting, so tasks that keep failing cannot pile up
    /// beyond `max_pending` while they are out of the queue.
    pub fn retry_later(&mut self) {
        self.retrying += 1;
    }

    /// A task given [`TaskQueue::retry_later`] goes on outside this queue
    /// (to on-demand capacity): it no longer counts as waiting here, and
    /// still counts as in flight for its tenant.
    pub fn retry_elsewhere(&mut self) {
        self.retrying = self.retrying.saturating_sub(1);
    }

    /// Puts a task given [`TaskQueue::retry_later`] back at the head of its
    /// tenant's queue (a retry goes first again). Never refused: it was
    /// already accepted.
    pub fn requeue(&mut self, tenant: &str, priority: i32, task: T) {
        self.retrying = self.retrying.saturating_sub(1);
        self.enqueue(tenant, priority, task, true);
        let t = self.tenants.entry(tenant.to_string()).or_default();
        t.0 += 1;
        t.1 = t.1.saturating_sub(1);
        self.pending += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn q(max: usize, quota: Option<usize>) -> TaskQueue<u32> {
        TaskQueue::new(Limits {
            max_pending: max,
            tenant_quota: quota,
        })
    }

    #[test]
    fn a_flooding_tenant_cannot_starve_a_single_task() {
        let mut tq = q(100_000, None);
        for i in 0..10_000 {
            tq.push("bulk", 0, i).expect("room");
        }
        tq.pop();
        tq.push("light", 0, 42).expect("room");
        let next: Vec<_> = (0..2).map(|_| tq.pop().expect("task").0).collect();
        assert!(next.contains(&"light".to_string()), "{next:?}");
    }

    #[test]
    fn higher_priority_goes_first_then_fifo() {
        let mut tq = q(10, None);
        tq.push("a", 0, 1).expect("room");
        tq.push("a", 5, 2).expect("room");
        tq.push("a", 0, 3).expect("room");
        assert_eq!(tq.pop(), Some(("a".into(), 2)));
        assert_eq!(tq.pop(), Some(("a".into(), 1)));
        assert_eq!(tq.pop(), Some(("a".into(), 3)));
        assert_eq!(tq.pop(), None);
    }

    #[test]
    fn a_task_waiting_to_retry_counts_against_the_bound() {
        let mut tq = q(1, None);
        tq.push("a", 0, 1).expect("room");
        let (t, task) = tq.pop().expect("task");
        tq.push("b", 0, 2).expect("room: the first runs");
        let (_, second) = tq.pop().expect("task");
        // Its attempt failed: out of the queue, in its pause, still waiting.
        tq.retry_later();
        assert_eq!(tq.pending(), 1);
        assert_eq!(
            tq.push("c", 0, 3),
            Err(Refused::QueueFull { max_pending: 1 })
        );
        tq.requeue(&t, 0, task);
        assert_eq!(tq.pending(), 1);
        assert_eq!(tq.tenant("a"), (1, 0));
        assert!(tq.push("c", 0, 3).is_err());
        // One that goes on elsewhere no longer waits here.
        tq.retry_later();
        tq.retry_elsewhere();
        assert_eq!(tq.pending(), 1);
        assert_eq!(tq.pop(), Some(("a".into(), 1)));
        tq.done("a");
        tq.done("b");
        let _ = second;
        assert_eq!(tq.pending(), 0);
        tq.push("c", 0, 3).expect("room again");
    }

    #[test]
    fn bounds_and_quotas_refuse_at_once() {
        let mut tq = q(3, Some(2));
        tq.push("a", 0, 1).expect("room");
        tq.push("a", 0, 2).expect("room");
        assert_eq!(
            tq.push("a", 0, 3),
            Err(Refused::TenantQuota {
                tenant: "a".into(),
                quota: 2
            })
        );
        tq.push("b", 0, 4).expect("room");
        assert_eq!(
            tq.push("c", 0, 5),
            Err(Refused::QueueFull { max_pending: 3 })
        );
        // In-flight tasks count toward the quota until done.
        let (t, _) = tq.pop().expect("task");
        assert_eq!(t, "a");
        assert!(tq.push("a", 0, 6).is_err());
        tq.done("a");
        tq.push("a", 0, 6).expect("room again");
    }

    #[test]
    fn weights_give_turns_in_proportion() {
        let mut tq =
            q(1000, None).with_weights([("heavy".to_string(), 3), ("light".to_string(), 1)]);
        for i in 0..100 {
            tq.push("heavy", 0, i).expect("room");
            tq.push("light", 0, i).expect("room");
            tq.push("other", 0, i).expect("room");
        }
        let first: Vec<String> = (0..50).map(|_| tq.pop().expect("task").0).collect();
        let count = |t: &str| first.iter().filter(|x| *x == t).count();
        assert_eq!(count("heavy"), 30, "{first:?}");
        assert_eq!(count("light"), 10);
        assert_eq!(count("other"), 10);
        assert_eq!(tq.peek(), Some(&30));
    }

    #[test]
    fn take_where_removes_and_keeps_order() {
        let mut tq = q(100, Some(50));
        for i in 0..10 {
            tq.push("a", 0, i).expect("room");
            tq.push("b", 1, 100 + i).expect("room");
        }
        let taken = tq.take_where(|t| t % 2 == 0);
        assert_eq!(taken.len(), 10);
        assert_eq!(tq.pending(), 10);
        assert_eq!(tq.tenant("a"), (5, 0));
        let rest: Vec<u32> = std::iter::from_fn(|| tq.pop().map(|p| p.1)).collect();
        assert_eq!(rest, vec![101, 103, 105, 107, 109, 1, 3, 5, 7, 9]);
        assert!(tq.take_where(|_| true).is_empty());
    }

    #[test]
    fn a_requeued_task_goes_first() {
        let mut tq = q(10, None);
        tq.push("a", 0, 1).expect("room");
        tq.push("a", 0, 2).expect("room");
        let (t, task) = tq.pop().expect("task");
        tq.requeue(&t, 0, task);
        assert_eq!(tq.pop(), Some(("a".into(), 1)));
        assert_eq!(tq.tenant("a"), (1, 1));
    }

    #[derive(Debug, Clone)]
    enum Op {
        Push(u8, i8),
        Pop,
        Done,
        Take(u8),
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        /// Bounded, nothing lost or duplicated, priorities respected, FIFO
        /// per tenant and priority, and quotas hold.
        #[test]
        fn invariants_hold_under_random_operations(
            ops in proptest::collection::vec(
                prop_oneof![
                    4 => (0u8..4, -2i8..3).prop_map(|(t, p)| Op::Push(t, p)),
                    3 => Just(Op::Pop),
                    2 => Just(Op::Done),
                    1 => (0u8..5).prop_map(Op::Take),
                ],
                1..300,
            ),
        ) {
            let mut tq = q(20, Some(8)).with_weights([("t1".to_string(), 3)]);
            let mut next_id = 0u32;
            let mut waiting: Vec<(String, i32, u32)> = Vec::new();
            let mut running: Vec<String> = Vec::new();
            for op in ops {
                match op {
                    Op::Push(t, p) => {
                        let tenant = format!("t{t}");
                        if tq.push(&tenant, i32::from(p), next_id).is_ok() {
                            waiting.push((tenant, i32::from(p), next_id));
                        }
                        next_id += 1;
                    }
                    Op::Pop => {
                        let best = waiting.iter().map(|w| w.1).max();
                        let peeked = tq.peek().copied();
                        let popped = tq.pop();
                        prop_assert_eq!(peeked, popped.as_ref().map(|p| p.1));
                        match popped {
                            Some((tenant, id)) => {
                                let i = waiting.iter().position(|w| w.2 == id).expect("was accepted");
                                let (wt, wp, _) = waiting.remove(i);
                                prop_assert_eq!(&wt, &tenant);
                                prop_assert_eq!(Some(wp), best, "highest priority first");
                                prop_assert!(
                                    !waiting.iter().any(|w| w.0 == wt && w.1 == wp && w.2 < id),
                                    "FIFO within a tenant and priority"
                                );
                                running.push(tenant);
                            }
                            None => prop_assert!(waiting.is_empty()),
                        }
                    }
                    Op::Done => {
                        if let Some(t) = running.pop() {
                            tq.done(&t);
                        }
                    }
                    Op::Take(k) => {
                        let taken = tq.take_where(|id| id % 5 == u32::from(k));
                        let before = waiting.len();
                        waiting.retain(|w| w.2 % 5 != u32::from(k));
                        prop_assert_eq!(taken.len(), before - waiting.len());
                    }
                }
                prop_assert!(tq.pending() <= 20);
                prop_assert_eq!(tq.pending(), waiting.len());
                for t in 0..4 {
                    let tenant = format!("t{t}");
                    let (p, f) = tq.tenant(&tenant);
                    prop_assert!(p + f <= 8, "quota");
                    prop_assert_eq!(p, waiting.iter().filter(|w| w.0 == tenant).count());
                    prop_assert_eq!(f, running.iter().filter(|r| **r == tenant).count());
                }
            }
        }
    }
}
