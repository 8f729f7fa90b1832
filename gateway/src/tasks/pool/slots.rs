//! Requests of the app a pool serves: a slot on one of its replicas (within
//! the split with tasks and the weights version asked for), the wait for
//! one, and the slot given back when the request ends.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use warmgate_pool::ReplicaHandle;

use super::{Pool, PoolState};
use crate::error::{Error, ErrorKind};

impl Pool {
    /// The newest weights version in the pool: the latest synced, or a
    /// replica's own when it started on newer weights than any sync.
    fn newest_version(st: &PoolState) -> u64 {
        st.replicas
            .iter()
            .map(|r| r.weights_version.load(Ordering::Relaxed))
            .fold(st.latest_version, u64::max)
    }

    /// Refuses a request for weights newer than any the pool has: nothing
    /// would ever serve it, so it is not held.
    pub fn check_min_version(&self, min_version: u64) -> Result<(), Error> {
        let newest = Self::newest_version(&self.state.lock());
        if min_version > newest {
            return Err(Error::new(
                ErrorKind::Conflict,
                format!(
                    "pool '{}' has weights up to version {newest}; version {min_version} has not been synced",
                    self.name
                ),
            ));
        }
        Ok(())
    }

    /// A slot for a request of the app this pool serves, on a replica whose
    /// weights are at least `min_version` and within `max_staleness` of the
    /// latest, under the per-replica limit and the split with tasks, and
    /// not one of `avoid` (replicas that refused it): at
    /// once, or after a wait of at most `timeout` (as one of at most
    /// `max_pending` waiting requests). `on_wait` runs once if it must wait,
    /// to wake the pool. Gives the slot and the time waited.
    #[allow(clippy::too_many_arguments)]
    pub async fn acquire_request(
        self: &Arc<Self>,
        app: &str,
        min_version: u64,
        avoid: &[String],
        timeout: Duration,
        max_pending: u32,
        on_wait: impl FnOnce(),
    ) -> Result<(RequestSlot, Duration), Error> {
        self.check_min_version(min_version)?;
        let since = Instant::now();
        let failures_seen = {
            let mut st = self.state.lock();
            if self.is_closed() {
                return Err(Error::new(
                    ErrorKind::NotFound,
                    format!("pool '{}' was deleted", self.name),
                ));
            }
            if let Some(slot) = self.take_request_slot(&mut st, app, min_version, avoid, since) {
                return Ok((slot, Duration::ZERO));
            }
            if st.requests_waiting >= max_pending as usize {
                return Err(Error::new(
                    ErrorKind::QueueFull,
                    format!(
                        "pool '{}' is at capacity and already holds {max_pending} requests",
                        self.name
                    ),
                )
                .retry_after(1));
            }
            st.requests_waiting += 1;
            *st.requests_waiting_need.entry(min_version).or_default() += 1;
            st.start_failures
        };
        let _waiting = Waiting(self, min_version);
        on_wait();
        let deadline = since + timeout;
        loop {
            let freed = self.freed.notified();
            tokio::pin!(freed);
            freed.as_mut().enable();
            {
                let mut st = self.state.lock();
                if let Some(slot) = self.take_request_slot(&mut st, app, min_version, avoid, since)
                {
                    return Ok((slot, since.elapsed()));
                }
                // The pool cannot start a replica: waiting would only
                // run out the timeout.
                if st.start_failures != failures_seen
                    && st.ready_pool_replicas() == 0
                    && let Some(e) = st.last_start_error.clone()
                {
                    return Err(e);
                }
            }
            if self.is_closed() {
                return Err(Error::new(
                    ErrorKind::NotFound,
                    format!("pool '{}' was deleted", self.name),
                ));
            }
            if tokio::time::timeout_at(deadline.into(), freed)
                .await
                .is_err()
            {
                return Err(Error::new(
                    ErrorKind::Timeout,
                    format!(
                        "no replica of pool '{}' with weights version {min_version} or newer had a free slot within {:.1}s",
                        self.name,
                        timeout.as_secs_f64()
                    ),
                ));
            }
        }
    }

    /// Takes a slot for a request, if a replica has one it may use.
    fn take_request_slot(
        self: &Arc<Self>,
        st: &mut PoolState,
        app: &str,
        min_version: u64,
        avoid: &[String],
        since: Instant,
    ) -> Option<RequestSlot> {
        let floor = self.staleness_floor(st);
        let need = min_version.max(floor);
        let split = self.split();
        // Only a task that could run on the replica holds a request back
        // from it.
        let task_need = st.queue.peek().map(|t| t.min_version.max(floor));
        let replica = st.least_loaded(need, |r| {
            if avoid.contains(&r.id) {
                return false;
            }
            let tasks_waiting =
                task_need.is_some_and(|n| r.weights_version.load(Ordering::Relaxed) >= n);
            split.request_may_take(st.requests_on_replica(&r.id), tasks_waiting)
        })?;
        replica.acquire();
        st.requests_inflight += 1;
        *st.requests_on.entry(replica.id.clone()).or_default() += 1;
        Some(RequestSlot {
            pool: self.clone(),
            app: app.to_string(),
            replica,
            since,
        })
    }

    /// A request's slot is free again.
    fn release_request(&self, replica: &ReplicaHandle) {
        {
            let mut st = self.state.lock();
            st.requests_inflight = st.requests_inflight.saturating_sub(1);
            if let Some(n) = st.requests_on.get_mut(&replica.id) {
                *n -= 1;
                if *n == 0 {
                    st.requests_on.remove(&replica.id);
                }
            }
        }
        replica.release();
        self.notify();
    }
}

/// A request of the app a pool serves, counted as waiting (for weights
/// at least this version) while it lives.
struct Waiting<'a>(&'a Pool, u64);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        {
            let mut st = self.0.state.lock();
            st.requests_waiting -= 1;
            if let Some(n) = st.requests_waiting_need.get_mut(&self.1) {
                *n -= 1;
                if *n == 0 {
                    st.requests_waiting_need.remove(&self.1);
                }
            }
        }
        // Tasks held back for it may go now.
        self.0.wake.notify_one();
    }
}

/// A slot on a pool's replica held by a request of the app the pool
/// serves; dropping it frees the slot.
pub struct RequestSlot {
    pool: Arc<Pool>,
    app: String,
    replica: Arc<ReplicaHandle>,
    since: Instant,
}

impl crate::serving::proxy::Slot for RequestSlot {
    fn replica(&self) -> &Arc<ReplicaHandle> {
        &self.replica
    }

    fn eject(&self, cause: crate::serving::outlier::Cause) {
        self.pool.eject(&self.replica, cause);
    }

    fn first_byte(&self) {
        metrics::histogram!("warmgate_time_to_first_byte_seconds", "app" => self.app.clone())
            .record(self.since.elapsed().as_secs_f64());
    }
}

impl Drop for RequestSlot {
    fn drop(&mut self) {
        metrics::histogram!("warmgate_request_duration_seconds", "app" => std::mem::take(&mut self.app))
            .record(self.since.elapsed().as_secs_f64());
        self.pool.release_request(&self.replica);
    }
}
