//! What waiting costs against recomputing: learned by the gateway from its
//! own requests to an app, with no engine-specific reading.
//!
//! Two figures decide whether a request should wait for a replica that is
//! at its limit but holds the request's prompt (see [`super::choose`]):
//!
//! - how long a request holds a slot (from the slot taken to the answer's
//!   end), so that the wait for the holder's next free slot is about
//!   `(requests already waiting for it + 1) × hold / limit`;
//! - how long an engine takes per chunk of prompt it has not cached
//!   before its first token: the slope of the time to first byte (from the
//!   slot taken) against the chunks the route expected to be uncached,
//!   fitted over the latest requests. A queue inside the engine adds to
//!   every request alike and goes into the intercept, not the slope.
//!
//! Both are exponentially weighted, so they follow a change of model,
//! hardware or load in some [`WINDOW`] requests. Until there are
//! [`MIN_SAMPLES`] of each, and the prompts' uncached parts differ enough
//! to fit a slope, the figures are unknown and no request waits for a full
//! replica: the routing is then what it was without them.

/// Requests an estimate mostly reflects: the weight of a new one is
/// `1 / WINDOW`.
pub const WINDOW: f64 = 64.0;
/// Requests seen before an estimate is used.
pub const MIN_SAMPLES: u32 = 32;
/// The uncached chunks of the prompts fitted must vary by at least this
/// (a standard deviation, in chunks) for the slope to mean anything.
const MIN_SPREAD_CHUNKS: f64 = 2.0;
/// No chunk of prompt takes longer than this to prefill: a bound on what
/// a noisy fit may claim.
const MAX_SECONDS_PER_CHUNK: f64 = 1.0;

/// The two figures, when known.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Costs {
    /// Mean seconds a request holds a slot.
    pub hold_seconds: f64,
    /// Seconds of prefill per chunk of prompt a replica has not cached.
    pub prefill_per_chunk: f64,
}

impl Costs {
    /// Whether a request should wait for a full replica that holds
    /// `saved` more chunks of its prompt than the best replica it could
    /// take now, with `waiting` requests already waiting for that replica,
    /// whose limit is `limit`. With a free replica elsewhere the wait is
    /// weighed whole; with none, every choice waits for at least one slot
    /// to turn over, so only the requests ahead count.
    pub fn worth_waiting(
        &self,
        saved: u32,
        waiting: u32,
        limit: u32,
        free_elsewhere: bool,
    ) -> bool {
        if self.prefill_per_chunk <= 0.0 || self.hold_seconds <= 0.0 || saved == 0 {
            return false;
        }
        let ahead = f64::from(waiting) + if free_elsewhere { 1.0 } else { 0.0 };
        let wait = ahead * self.hold_seconds / f64::from(limit.max(1));
        wait < f64::from(saved) * self.prefill_per_chunk
    }
}

/// An exponentially weighted mean.
#[derive(Debug, Clone, Copy, Default)]
struct Mean {
    value: f64,
    n: u32,
}

impl Mean {
    fn add(&mut self, x: f64) {
        self.n = self.n.saturating_add(1);
        // The plain mean until the window fills, then the weighted one.
        let w = 1.0 / f64::from(self.n).min(WINDOW);
        self.value += w * (x - self.value);
    }
}

/// The running estimates of one app.
#[derive(Debug, Clone, Default)]
pub struct Learned {
    hold: Mean,
    /// Moments of (uncached chunks, seconds to first byte).
    x: Mean,
    y: Mean,
    xx: Mean,
    xy: Mean,
}

impl Learned {
    /// A request held its slot `seconds`.
    pub fn held(&mut self, seconds: f64) {
        if seconds.is_finite() && seconds >= 0.0 {
            self.hold.add(seconds);
        }
    }

    /// A request the route expected `uncached` chunks of prompt to be
    /// missing for got its first byte `seconds` after its slot.
    pub fn first_byte(&mut self, uncached: u32, seconds: f64) {
        if !(seconds.is_finite() && seconds >= 0.0) {
            return;
        }
        let x = f64::from(uncached);
        self.x.add(x);
        self.y.add(seconds);
        self.xx.add(x * x);
        self.xy.add(x * seconds);
    }

    /// The figures, each `0` while unknown.
    pub fn costs(&self) -> Costs {
        let hold_seconds = if self.hold.n >= MIN_SAMPLES {
            self.hold.value
        } else {
            0.0
        };
        let var = self.xx.value - self.x.value * self.x.value;
        let prefill_per_chunk = if self.x.n >= MIN_SAMPLES && var >= MIN_SPREAD_CHUNKS.powi(2) {
            let cov = self.xy.value - self.x.value * self.y.value;
            (cov / var).clamp(0.0, MAX_SECONDS_PER_CHUNK)
        } else {
            0.0
        };
        Costs {
            hold_seconds,
            prefill_per_chunk,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nothing_is_known_before_enough_requests_and_then_the_slope_is_the_prefill() {
        let mut l = Learned::default();
        assert_eq!(l.costs(), Costs::default());
        // 5 ms of queue for everyone, 4.8 ms a chunk (0.15 ms a token).
        for i in 0..200u32 {
            let uncached = (i * 7) % 40;
            l.first_byte(uncached, 0.005 + 0.0048 * f64::from(uncached));
            l.held(0.1);
            if i + 1 < MIN_SAMPLES {
                assert_eq!(l.costs(), Costs::default(), "after {} requests", i + 1);
            }
        }
        let c = l.costs();
        assert!((c.prefill_per_chunk - 0.0048).abs() < 1e-6, "{c:?}");
        assert!((c.hold_seconds - 0.1).abs() < 1e-9, "{c:?}");
    }

    #[test]
    fn prompts_alike_in_what_is_uncached_teach_no_slope() {
        let mut l = Learned::default();
        for _ in 0..200 {
            l.first_byte(10, 0.05);
            l.held(0.1);
        }
        assert_eq!(l.costs().prefill_per_chunk, 0.0);
    }

    #[test]
    fn the_estimates_follow_a_change_within_a_few_windows() {
        let mut l = Learned::default();
        for i in 0..500u32 {
            l.held(1.0);
            l.first_byte(i % 30, 0.01 * f64::from(i % 30));
        }
        for i in 0..500u32 {
            l.held(0.2);
            l.first_byte(i % 30, 0.002 * f64::from(i % 30));
        }
        let c = l.costs();
        assert!((c.hold_seconds - 0.2).abs() < 0.01, "{c:?}");
        assert!((c.prefill_per_chunk - 0.002).abs() < 0.0005, "{c:?}");
    }

    #[test]
    fn waiting_is_worth_it_while_the_wait_is_shorter_than_the_prefill_it_saves() {
        // A slot turns over every 100 ms / 8 = 12.5 ms; a chunk costs 5 ms.
        let c = Costs {
            hold_seconds: 0.1,
            prefill_per_chunk: 0.005,
        };
        // 10 chunks saved (50 ms): worth up to three requests ahead.
        assert!(c.worth_waiting(10, 0, 8, true));
        assert!(c.worth_waiting(10, 2, 8, true));
        assert!(!c.worth_waiting(10, 4, 8, true));
        // 2 chunks (10 ms) are not worth a turn-over (12.5 ms)...
        assert!(!c.worth_waiting(2, 0, 8, true));
        // ...unless every replica is full and nobody waits ahead.
        assert!(c.worth_waiting(2, 0, 8, false));
        // Unknown figures or nothing saved: never.
        assert!(!Costs::default().worth_waiting(10, 0, 8, true));
        assert!(!c.worth_waiting(0, 0, 8, false));
    }
}
