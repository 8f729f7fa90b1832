//! A tenant's token rate (`tokens_per_minute`, with a burst): a bucket
//! that fills at the rate up to the burst, is charged each answer's
//! prompt and completion tokens when the answer ends, and may go into
//! debt. A request is let in while the bucket holds any token; once it is
//! empty or in debt, requests are refused until the debt is repaid, and
//! told when that will be. Pure, on a clock the caller gives.
//!
//! An answer's tokens are known only at its end, so the requests in
//! flight when the bucket runs out still finish: the overshoot is at most
//! what those requests use, each bounded by its prompt and its
//! `max_tokens` (which a tenant's `max_tokens` caps), and their number by
//! `max_inflight`. The debt they leave is paid before the next request.

use std::time::Duration;

/// A token bucket that may go into debt.
#[derive(Debug, Clone)]
pub struct TokenBudget {
    /// Tokens a second.
    rate: f64,
    burst: f64,
    /// Tokens in the bucket; below zero, a debt.
    level: f64,
    /// When `level` was last brought up to date.
    at: Duration,
}

impl TokenBudget {
    /// A full bucket of `burst` tokens filling at `per_minute`.
    pub fn new(per_minute: u64, burst: u64, now: Duration) -> Self {
        TokenBudget {
            rate: per_minute as f64 / 60.0,
            burst: burst as f64,
            level: burst as f64,
            at: now,
        }
    }

    /// Brings the level up to `now`, filling at a `share` of the rate.
    fn refill(&mut self, now: Duration, share: f64) {
        let dt = now.saturating_sub(self.at).as_secs_f64();
        self.at = self.at.max(now);
        self.level = (self.level + dt * self.rate * share).min(self.burst);
    }

    /// Lets a request in while the bucket holds a token, at a `share` of
    /// the rate (`1/n` when `n` gateways serve together); otherwise how
    /// long until it will.
    pub fn admit(&mut self, now: Duration, share: f64) -> Result<(), Duration> {
        let share = share.clamp(f64::MIN_POSITIVE, 1.0);
        self.refill(now, share);
        if self.level >= 1.0 {
            return Ok(());
        }
        let rate = (self.rate * share).max(f64::MIN_POSITIVE);
        let wait = (1.0 - self.level) / rate;
        Err(Duration::from_secs_f64(wait.min(1e9)))
    }

    /// Charges `tokens` an answer used (the bucket filled at `share` of
    /// the rate until now).
    pub fn charge(&mut self, now: Duration, tokens: u64, share: f64) {
        self.refill(now, share.clamp(f64::MIN_POSITIVE, 1.0));
        self.level -= tokens as f64;
    }

    /// Tokens in the bucket at `now` (negative: the debt), had it filled
    /// at `share` of the rate since it was last charged or asked; the
    /// bucket is left as it is.
    pub fn level(&self, now: Duration, share: f64) -> f64 {
        let mut projected = self.clone();
        projected.refill(now, share.clamp(f64::MIN_POSITIVE, 1.0));
        projected.level
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: fn(u64) -> Duration = Duration::from_secs;

    #[test]
    fn a_debt_refuses_until_it_is_repaid_and_says_how_long() {
        // 600 a minute: 10 a second; a burst of 100.
        let mut b = TokenBudget::new(600, 100, S(0));
        assert!(b.admit(S(0), 1.0).is_ok());
        // Two requests in flight when the bucket runs dry: both finish.
        b.charge(S(0), 80, 1.0);
        assert!(b.admit(S(0), 1.0).is_ok());
        b.charge(S(1), 150, 1.0);
        // 100 - 80 + 10 - 150 = -120: 12.1 s to one token.
        let wait = b.admit(S(1), 1.0).unwrap_err();
        assert!((wait.as_secs_f64() - 12.1).abs() < 1e-6, "{wait:?}");
        assert!(b.admit(S(13), 1.0).is_err());
        assert!(b.admit(S(1) + wait, 1.0).is_ok());
    }

    #[test]
    fn the_bucket_fills_no_higher_than_the_burst() {
        let mut b = TokenBudget::new(60, 5, S(0));
        assert_eq!(b.level(S(1000), 1.0), 5.0);
        b.charge(S(1000), 5, 1.0);
        assert!(b.admit(S(1000), 1.0).is_err());
        assert!(b.admit(S(1001), 1.0).is_ok());
    }

    #[test]
    fn a_share_of_the_rate_waits_longer() {
        let mut b = TokenBudget::new(60, 1, S(0));
        b.charge(S(0), 10, 1.0);
        let alone = b.clone().admit(S(0), 1.0).unwrap_err();
        let half = b.admit(S(0), 0.5).unwrap_err();
        assert_eq!(half, alone * 2);
    }
}
