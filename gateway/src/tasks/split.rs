//! How a shared pool's replica splits its slots between the two kinds of
//! work it takes: its app's requests and the pool's tasks.
//!
//! Each replica has `concurrency` slots. The app's requests are sure of
//! `reserve = ceil(inference_share × concurrency)` of them and the tasks of
//! the rest, but only while the other kind is waiting: a slot the other
//! kind does not want goes to whichever waits, so no slot idles while work
//! waits (a work-conserving split, as a weighted fair scheduler gives
//! each class its share only under contention). `inference_share = 1.0`
//! gives requests priority; `0.0` gives tasks priority. Nothing running is
//! ever preempted: a kind over its share gives slots back as its work ends.

/// A replica's split of its slots.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Split {
    concurrency: u32,
    reserve: u32,
}

impl Split {
    /// The split of `concurrency` slots with `share` of them (0 to 1) sure
    /// for requests.
    pub fn new(concurrency: u32, share: f64) -> Self {
        let share = if share.is_finite() {
            share.clamp(0.0, 1.0)
        } else {
            0.0
        };
        let reserve = ((f64::from(concurrency) * share).ceil() as u32).min(concurrency);
        Split {
            concurrency,
            reserve,
        }
    }

    /// Slots requests are sure of while tasks wait.
    pub fn requests_reserved(&self) -> u32 {
        self.reserve
    }

    /// Whether a request may take a free slot on a replica that runs
    /// `requests_on` requests, with tasks waiting or not.
    pub fn request_may_take(&self, requests_on: u32, tasks_waiting: bool) -> bool {
        !tasks_waiting || requests_on < self.reserve
    }

    /// Whether a task may take a free slot on a replica that runs
    /// `tasks_on` tasks, with requests waiting or not.
    pub fn task_may_take(&self, tasks_on: u32, requests_waiting: bool) -> bool {
        !requests_waiting || tasks_on < self.concurrency - self.reserve
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn the_share_rounds_up_and_the_ends_are_priorities() {
        assert_eq!(Split::new(4, 0.5).requests_reserved(), 2);
        assert_eq!(Split::new(3, 0.5).requests_reserved(), 2);
        assert_eq!(Split::new(4, 0.01).requests_reserved(), 1);
        // Requests first: a task never takes a slot a request waits for.
        let first = Split::new(4, 1.0);
        assert!(!first.task_may_take(0, true));
        assert!(first.request_may_take(3, true));
        // Tasks first: the mirror image.
        let last = Split::new(4, 0.0);
        assert!(!last.request_may_take(0, true));
        assert!(last.task_may_take(3, true));
        assert_eq!(Split::new(4, f64::NAN).requests_reserved(), 0);
    }

    proptest! {
        /// Under contention, filling a replica's free slots one at a time
        /// (each to a kind the split allows) never starves a kind below its
        /// share, never leaves a slot free while a kind may take it, and
        /// never goes past the limit.
        #[test]
        fn contended_slots_respect_both_shares(
            concurrency in 1u32..16,
            share in 0.0f64..=1.0,
            requests0 in 0u32..16,
            tasks0 in 0u32..16,
        ) {
            let split = Split::new(concurrency, share);
            let (mut requests, mut tasks) = (requests0, tasks0);
            if requests + tasks > concurrency {
                return Ok(());
            }
            // Both kinds wait for as long as slots remain: requests take
            // first, then tasks, as the dispatchers might race.
            while requests + tasks < concurrency {
                if split.request_may_take(requests, true) {
                    requests += 1;
                } else if split.task_may_take(tasks, true) {
                    tasks += 1;
                } else {
                    prop_assert!(false, "a free slot neither kind may take: {requests}+{tasks} of {concurrency}");
                }
            }
            prop_assert_eq!(requests + tasks, concurrency);
            // Each kind holds its share unless it started above the other's.
            let reserve = split.requests_reserved();
            prop_assert!(requests >= reserve.min(concurrency - tasks0));
            prop_assert!(tasks >= (concurrency - reserve).min(concurrency - requests0));
        }

        /// Without contention either kind may fill every free slot.
        #[test]
        fn an_uncontended_kind_takes_any_free_slot(
            concurrency in 1u32..16,
            share in 0.0f64..=1.0,
            on in 0u32..16,
        ) {
            let split = Split::new(concurrency, share);
            prop_assert!(split.request_may_take(on, false));
            prop_assert!(split.task_may_take(on, false));
        }
    }
}
