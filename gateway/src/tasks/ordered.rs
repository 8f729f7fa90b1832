//! A batch's results in input order, within a window of tasks and a budget
//! of bytes.
//!
//! A batch runs its tasks ahead of the line being written, so a slow task
//! does not stall the ones behind it; but every result that finishes before
//! an earlier one is held until that one is written. `buffered(window)`
//! bounds how many are held, not their bytes: with outputs of up to 64 MiB
//! a window of 16 held a gigabyte. [`Ordered`] admits the next task only
//! while what is held, plus what the tasks in flight may bring (each as
//! large as the largest result seen so far), stays within a byte budget. A
//! finished result is never refused; and with nothing held or in flight
//! the next task is always admitted, so a batch never stalls, whatever its
//! sizes. Before the first result no size is known, so the first wave is
//! the window alone.

use std::collections::BTreeMap;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use futures_util::future::BoxFuture;
use futures_util::stream::{FuturesUnordered, Stream, StreamExt};

/// Results of the futures `tasks` yields, in their order.
pub struct Ordered<I> {
    tasks: std::iter::Enumerate<I>,
    /// Whether `tasks` is exhausted.
    drained: bool,
    running: FuturesUnordered<BoxFuture<'static, (usize, Bytes)>>,
    /// Finished results waiting for an earlier one.
    held: BTreeMap<usize, Bytes>,
    held_bytes: u64,
    /// The largest result so far: what a task in flight is assumed to bring.
    largest: u64,
    /// The index of the next result to deliver.
    next: usize,
    window: usize,
    budget: u64,
}

impl<I> Ordered<I>
where
    I: Iterator<Item = BoxFuture<'static, Bytes>>,
{
    /// At most `window` tasks in flight or held at once, and at most
    /// `budget` bytes held or expected (see the module's notes).
    pub fn new(tasks: I, window: usize, budget: u64) -> Self {
        Ordered {
            tasks: tasks.enumerate(),
            drained: false,
            running: FuturesUnordered::new(),
            held: BTreeMap::new(),
            held_bytes: 0,
            largest: 0,
            next: 0,
            window: window.max(1),
            budget,
        }
    }

    /// Tasks in flight or held.
    fn occupied(&self) -> usize {
        self.running.len() + self.held.len()
    }

    /// Whether one more task may start now.
    fn may_admit(&self) -> bool {
        if self.drained || self.occupied() >= self.window {
            return false;
        }
        if self.occupied() == 0 {
            return true;
        }
        let expected = (self.running.len() as u64 + 1).saturating_mul(self.largest);
        self.held_bytes.saturating_add(expected) <= self.budget
    }

    /// Starts tasks while the window and the budget allow.
    fn admit(&mut self) {
        while self.may_admit() {
            match self.tasks.next() {
                Some((i, task)) => self.running.push(Box::pin(async move { (i, task.await) })),
                None => self.drained = true,
            }
        }
    }

    /// Bytes of finished results held now.
    #[cfg(test)]
    fn held_bytes(&self) -> u64 {
        self.held_bytes
    }
}

impl<I> Stream for Ordered<I>
where
    I: Iterator<Item = BoxFuture<'static, Bytes>> + Unpin,
{
    type Item = Bytes;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Bytes>> {
        let this = &mut *self;
        loop {
            let next = this.next;
            if let Some(line) = this.held.remove(&next) {
                this.held_bytes -= line.len() as u64;
                this.next += 1;
                return Poll::Ready(Some(line));
            }
            this.admit();
            match this.running.poll_next_unpin(cx) {
                Poll::Ready(Some((i, line))) => {
                    this.largest = this.largest.max(line.len() as u64);
                    this.held_bytes += line.len() as u64;
                    this.held.insert(i, line);
                }
                // Nothing in flight: the next result is neither held nor
                // running, so none is left (it is always admitted first).
                Poll::Ready(None) => return Poll::Ready(None),
                Poll::Pending => return Poll::Pending,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use futures_util::FutureExt as _;
    use proptest::prelude::*;
    use tokio::sync::oneshot;

    use super::*;

    /// Tasks finished by hand: the test says which finishes when, and with
    /// how many bytes. Counts the tasks started.
    struct Hand {
        done: Vec<Option<oneshot::Sender<Bytes>>>,
        started: Arc<AtomicUsize>,
    }

    fn hand(
        n: usize,
    ) -> (
        Hand,
        impl Iterator<Item = BoxFuture<'static, Bytes>> + Unpin,
    ) {
        let started = Arc::new(AtomicUsize::new(0));
        let (tx, rx): (Vec<_>, Vec<_>) = (0..n).map(|_| oneshot::channel::<Bytes>()).unzip();
        let count = started.clone();
        let tasks = rx.into_iter().map(move |rx| {
            count.fetch_add(1, Ordering::SeqCst);
            async move { rx.await.unwrap_or_default() }.boxed()
        });
        (
            Hand {
                done: tx.into_iter().map(Some).collect(),
                started,
            },
            tasks,
        )
    }

    impl Hand {
        fn finish(&mut self, i: usize, len: usize) {
            let tx = self.done[i].take().expect("finished once");
            // The stream may be gone in a test that stops early.
            let _ = tx.send(Bytes::from(vec![b'a' + (i % 26) as u8; len]));
        }
        fn started(&self) -> usize {
            self.started.load(Ordering::SeqCst)
        }
    }

    fn poll<I>(s: &mut Ordered<I>) -> Poll<Option<Bytes>>
    where
        I: Iterator<Item = BoxFuture<'static, Bytes>> + Unpin,
    {
        let mut cx = Context::from_waker(futures_util::task::noop_waker_ref());
        s.poll_next_unpin(&mut cx)
    }

    #[test]
    fn results_come_in_input_order_whatever_order_they_finish_in() {
        let (mut hand, tasks) = hand(3);
        let mut s = Ordered::new(tasks, 8, u64::MAX);
        assert!(poll(&mut s).is_pending());
        assert_eq!(hand.started(), 3, "all three fit in the window");
        hand.finish(2, 1);
        hand.finish(1, 1);
        assert!(poll(&mut s).is_pending(), "the first is not done");
        hand.finish(0, 1);
        let lines: Vec<u8> = (0..3)
            .map(|_| match poll(&mut s) {
                Poll::Ready(Some(b)) => b[0],
                other => panic!("expected a line, got {other:?}"),
            })
            .collect();
        assert_eq!(lines, b"abc");
        assert!(matches!(poll(&mut s), Poll::Ready(None)));
    }

    #[test]
    fn large_results_held_behind_a_slow_one_stop_new_tasks() {
        let (mut hand, tasks) = hand(20);
        let mut s = Ordered::new(tasks, 16, 100);
        assert!(poll(&mut s).is_pending());
        assert_eq!(hand.started(), 16, "no size known yet: the window");
        // Task 0 is slow; the others bring 60 bytes each.
        for i in 1..16 {
            hand.finish(i, 60);
        }
        assert!(poll(&mut s).is_pending());
        assert_eq!(s.held_bytes(), 15 * 60, "the first wave is held");
        assert_eq!(hand.started(), 16, "nothing new while over the budget");
        hand.finish(0, 60);
        for _ in 0..16 {
            assert!(matches!(poll(&mut s), Poll::Ready(Some(_))));
        }
        // Only one 60-byte task at a time fits in 100 bytes.
        assert!(poll(&mut s).is_pending());
        assert_eq!(hand.started(), 17);
        hand.finish(16, 60);
        assert!(matches!(poll(&mut s), Poll::Ready(Some(_))));
        assert!(poll(&mut s).is_pending());
        assert_eq!(hand.started(), 18);
    }

    #[test]
    fn a_result_larger_than_the_budget_still_goes_through() {
        let (mut hand, tasks) = hand(3);
        let mut s = Ordered::new(tasks, 4, 10);
        assert!(poll(&mut s).is_pending());
        hand.finish(0, 1000);
        hand.finish(1, 1000);
        hand.finish(2, 1000);
        for _ in 0..3 {
            assert!(matches!(poll(&mut s), Poll::Ready(Some(b)) if b.len() == 1000));
        }
        assert!(matches!(poll(&mut s), Poll::Ready(None)));
    }

    #[test]
    fn an_empty_batch_ends_at_once() {
        let (_hand, tasks) = hand(0);
        let mut s = Ordered::new(tasks, 4, 10);
        assert!(matches!(poll(&mut s), Poll::Ready(None)));
    }

    proptest! {
        /// Any sizes and budget, finished in any order: every result comes
        /// once, in order; the window is never exceeded; and the batch never
        /// waits with nothing running.
        #[test]
        fn every_result_arrives_in_order_within_window_and_budget(
            sizes in proptest::collection::vec(0usize..200, 0..40),
            picks in proptest::collection::vec(any::<usize>(), 0..200),
            window in 1usize..8,
            budget in 0u64..600,
        ) {
            let n = sizes.len();
            let (mut hand, tasks) = hand(n);
            let mut s = Ordered::new(tasks, window, budget);
            let mut got: Vec<usize> = Vec::new();
            let mut finished = vec![false; n];
            let mut picks = picks.into_iter();
            for _round in 0..(4 * n + 4) {
                match poll(&mut s) {
                    Poll::Ready(Some(b)) => {
                        let i = got.len();
                        prop_assert_eq!(b.len(), sizes[i], "result {} in its place", i);
                        got.push(i);
                        continue;
                    }
                    Poll::Ready(None) => break,
                    Poll::Pending => {}
                }
                let started = hand.started();
                prop_assert!(started - got.len() <= window, "window kept");
                // Finish one running task, chosen by the picks.
                let running: Vec<usize> = (0..started).filter(|i| !finished[*i]).collect();
                prop_assert!(!running.is_empty(), "pending with nothing running");
                let at = picks.next().unwrap_or(0) % running.len();
                let i = running[at];
                finished[i] = true;
                hand.finish(i, sizes[i]);
            }
            prop_assert_eq!(got.len(), n, "every result delivered");
        }
    }
}
