//! The warm-pool policy, with Union's ReusePolicy semantics: replicas stay
//! warm between tasks and go one by one once idle past `idle_ttl`.
//!
//! - **Up:** when the queued tasks exceed the free slots (those of the
//!   starting replicas included), start enough replicas for every task.
//! - **Down:** stop the replicas idle for `idle_ttl` or longer, never below
//!   `min` and never while tasks wait. The pool manager stops the longest
//!   idle first.
//! - **Buffer:** keep `buffer` spare replicas beyond what the tasks need,
//!   as Modal's `buffer_containers` does, so a burst finds warm capacity.
//!
//! Pure: the caller passes the idle time of each ready replica.

use std::time::Duration;

/// Knobs of a pool.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolScaling {
    /// Replicas kept even when idle.
    pub min: u32,
    /// Replicas never exceeded.
    pub max: u32,
    /// Tasks in flight per replica.
    pub concurrency: u32,
    /// A replica idle this long may be stopped.
    pub idle_ttl: Duration,
    /// Spare replicas kept beyond what the tasks need.
    pub buffer: u32,
}

/// What the pool looks like now.
#[derive(Debug, Clone, Copy)]
pub struct PoolLoad<'a> {
    /// Tasks waiting.
    pub pending: usize,
    /// Tasks running.
    pub inflight: u32,
    /// Replicas started and not ready yet.
    pub starting: u32,
    /// How long each ready replica has had nothing in flight (zero while
    /// busy).
    pub idle: &'a [Duration],
}

/// The replica count the pool should have now.
pub fn pool_desired(cfg: &PoolScaling, load: &PoolLoad<'_>) -> u32 {
    let max = cfg.max.max(1);
    let min = cfg.min.min(max);
    let conc = u64::from(cfg.concurrency.max(1));
    let ready = load.idle.len() as u64;
    let total = ready + u64::from(load.starting);
    let pending = load.pending as u64;
    let work = pending + u64::from(load.inflight);
    let need = work.div_ceil(conc);

    let free = (ready * conc).saturating_sub(u64::from(load.inflight));
    let coming = u64::from(load.starting) * conc;
    let up = if pending > free + coming { need } else { 0 };

    let keep = if pending > 0 {
        total
    } else {
        let expired = load.idle.iter().filter(|d| **d >= cfg.idle_ttl).count() as u64;
        total - expired
    };
    let buffered = need + u64::from(cfg.buffer);
    let desired = keep.max(up).max(buffered).max(u64::from(min));
    desired.min(u64::from(max)) as u32
}

/// Whether a pool that stops entirely after `suspend_after` of idleness
/// is suspended now: nothing waiting or running, and either it already
/// was, or every ready replica has been idle that long (none starting).
/// Any work ends a suspension.
pub fn suspended(suspend_after: Option<Duration>, was: bool, load: &PoolLoad<'_>) -> bool {
    let Some(after) = suspend_after else {
        return false;
    };
    if load.pending > 0 || load.inflight > 0 {
        return false;
    }
    was || (load.starting == 0 && !load.idle.is_empty() && load.idle.iter().all(|d| *d >= after))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pool_suspends_after_the_whole_pool_is_idle_and_work_wakes_it() {
        let after = Some(secs(600));
        let load = |pending, inflight, idle: &'static [Duration]| PoolLoad {
            pending,
            inflight,
            starting: 0,
            idle,
        };
        const YOUNG: &[Duration] = &[Duration::from_secs(600), Duration::from_secs(599)];
        const OLD: &[Duration] = &[Duration::from_secs(600), Duration::from_secs(601)];
        // Off unless set.
        assert!(!suspended(None, false, &load(0, 0, OLD)));
        // Every replica must have been idle that long.
        assert!(!suspended(after, false, &load(0, 0, YOUNG)));
        assert!(suspended(after, false, &load(0, 0, OLD)));
        // Suspended, it stays so with no replica left...
        assert!(suspended(after, true, &load(0, 0, &[])));
        // ...until a task waits or runs.
        assert!(!suspended(after, true, &load(1, 0, &[])));
        assert!(!suspended(after, true, &load(0, 1, &[])));
        // Never with work, nor at start before any replica is ready.
        assert!(!suspended(after, false, &load(0, 1, OLD)));
        assert!(!suspended(after, false, &load(0, 0, &[])));
    }

    fn cfg() -> PoolScaling {
        PoolScaling {
            min: 1,
            max: 8,
            concurrency: 4,
            idle_ttl: Duration::from_secs(300),
            buffer: 0,
        }
    }

    fn secs(s: u64) -> Duration {
        Duration::from_secs(s)
    }

    #[test]
    fn queued_tasks_beyond_free_slots_start_replicas() {
        let idle = [Duration::ZERO, Duration::ZERO];
        // 8 slots, all busy, 9 waiting: 17 tasks need 5 replicas.
        let load = PoolLoad {
            pending: 9,
            inflight: 8,
            starting: 0,
            idle: &idle,
        };
        assert_eq!(pool_desired(&cfg(), &load), 5);
        // Replicas already starting cover them: no more.
        let load = PoolLoad {
            starting: 3,
            ..load
        };
        assert_eq!(pool_desired(&cfg(), &load), 5);
        // Capped at max.
        let load = PoolLoad {
            pending: 100,
            starting: 0,
            ..load
        };
        assert_eq!(pool_desired(&cfg(), &load), 8);
    }

    #[test]
    fn idle_replicas_go_after_the_ttl_never_below_min() {
        let idle = [secs(400), secs(10), secs(301), Duration::ZERO];
        let load = PoolLoad {
            pending: 0,
            inflight: 1,
            starting: 0,
            idle: &idle,
        };
        // Two are past 300 s: 4 -> 2.
        assert_eq!(pool_desired(&cfg(), &load), 2);
        let all_idle = [secs(999); 3];
        let load = PoolLoad {
            inflight: 0,
            idle: &all_idle,
            ..load
        };
        assert_eq!(pool_desired(&cfg(), &load), 1);
        // Not while tasks wait (version-gated ones, say).
        let load = PoolLoad { pending: 1, ..load };
        assert_eq!(pool_desired(&cfg(), &load), 3);
    }

    #[test]
    fn the_buffer_keeps_spare_replicas() {
        let c = PoolScaling {
            buffer: 2,
            min: 0,
            ..cfg()
        };
        let idle = [Duration::ZERO];
        let load = PoolLoad {
            pending: 0,
            inflight: 3,
            starting: 0,
            idle: &idle,
        };
        // 1 needed + 2 spare.
        assert_eq!(pool_desired(&c, &load), 3);
        // Spare replicas past their TTL are still kept: they are the buffer.
        let idle = [Duration::ZERO, secs(999), secs(999), secs(999)];
        let load = PoolLoad {
            idle: &idle,
            ..load
        };
        assert_eq!(pool_desired(&c, &load), 3);
    }
}
