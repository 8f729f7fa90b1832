//! How long the last replica stays through an idle spell when
//! `scale_to_zero_after = "auto"`: ski rental over the spells seen.
//!
//! Stopping the last replica saves its replica-seconds until demand comes
//! back, and costs a cold start then: the replica-seconds of the start,
//! plus the requests that arrive during it, each waiting half a cold start
//! on average (a waiting request costs one slot, as in the standby rule of
//! [`crate::aware`]). Keeping it through a spell of `g` seconds costs `g`.
//! Over the last [`SPELLS`] idle spells, the linger `h` that minimises
//! `Σ min(g, h) + [g > h] × restart` wins; the candidates are zero and
//! each spell's length, up to [`MAX_LINGER_COLD_STARTS`] cold starts.
//! Unless stopping at once wins, the linger is never shorter than the
//! break-even, `restart` seconds (at most the cap): the spells seen say
//! nothing of longer ones, and keeping a replica up to the break-even
//! costs at most twice what the best choice would have (ski rental's
//! deterministic bound), where a linger cut at the longest spell seen
//! restarts on every spell a little longer. How
//! many requests a wake meets is measured too: the arrivals in the first
//! cold start after each spell ended, whether the replica was kept or not.
//!
//! Until a cold start and [`MIN_SPELLS`] spells are known, it has no
//! answer, and the caller keeps its default linger.

use std::collections::VecDeque;
use std::time::Duration;

/// Idle spells remembered.
pub const SPELLS: usize = 64;

/// Fewer spells than this: no answer yet.
pub const MIN_SPELLS: usize = 3;

/// The longest linger, in measured cold starts.
pub const MAX_LINGER_COLD_STARTS: f64 = 20.0;

/// Wakes remembered for the demand a cold start meets.
const WAKES: usize = 32;

/// The idle spells seen and the demand that ended them.
#[derive(Debug, Clone, Default)]
pub(crate) struct IdleSpells {
    /// Seconds from the last activity before a spell to the first after.
    spells: VecDeque<f64>,
    /// Arrivals in the first cold start after each spell ended.
    wakes: VecDeque<f64>,
    /// The last observation with activity.
    last_active: Option<Duration>,
    /// Whether an observation without activity came since.
    quiet_since_active: bool,
    /// A spell that ended: when, and the arrivals counted since.
    waking: Option<(Duration, u64)>,
}

impl IdleSpells {
    /// One observation: `active` when a request arrived, ran or waited
    /// since the last.
    pub fn observe(&mut self, now: Duration, active: bool, arrivals: u32, cold: Option<Duration>) {
        if let Some((since, counted)) = &mut self.waking {
            *counted += u64::from(arrivals);
            match cold {
                Some(c) if now.saturating_sub(*since) >= c => {
                    push(&mut self.wakes, *counted as f64, WAKES);
                    self.waking = None;
                }
                None => self.waking = None,
                _ => {}
            }
        }
        if !active {
            self.quiet_since_active = true;
            return;
        }
        if let Some(last) = self.last_active {
            // Without a quiet observation between, activity goes on.
            if std::mem::take(&mut self.quiet_since_active) {
                let spell = now.saturating_sub(last);
                push(&mut self.spells, spell.as_secs_f64(), SPELLS);
                if self.waking.is_none() && cold.is_some() {
                    self.waking = Some((now, u64::from(arrivals)));
                }
            }
        }
        self.last_active = Some(now);
    }

    /// The linger that would have cost least over the spells seen, for a
    /// replica of `slots` slots and the measured `cold` start; `None`
    /// until both are known.
    pub fn linger(&self, cold: Option<Duration>, slots: f64) -> Option<Duration> {
        let cold = cold?.as_secs_f64();
        if self.spells.len() < MIN_SPELLS || !cold.is_finite() {
            return None;
        }
        let slots = if slots.is_finite() && slots >= 1.0 {
            slots
        } else {
            1.0
        };
        let met = if self.wakes.is_empty() {
            0.0
        } else {
            self.wakes.iter().sum::<f64>() / self.wakes.len() as f64
        };
        let restart = cold + met * (cold / 2.0) / slots;
        let cost = |h: f64| -> f64 {
            self.spells
                .iter()
                .map(|&g| g.min(h) + if g > h { restart } else { 0.0 })
                .sum()
        };
        let longest = cold * MAX_LINGER_COLD_STARTS;
        let best = std::iter::once(0.0)
            .chain(self.spells.iter().copied())
            .filter(|&h| h <= longest)
            .map(|h| (cost(h), h))
            .min_by(|a, b| a.0.total_cmp(&b.0).then(a.1.total_cmp(&b.1)))
            .map_or(0.0, |(_, h)| h);
        let linger = if best > 0.0 {
            best.max(restart.min(longest))
        } else {
            0.0
        };
        Some(Duration::from_secs_f64(linger))
    }
}

fn push(q: &mut VecDeque<f64>, v: f64, cap: usize) {
    if q.len() == cap {
        q.pop_front();
    }
    q.push_back(v);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Activity at each of `at` (seconds), one arrival each, nothing
    /// between.
    fn seen(at: &[u64], cold: Duration) -> IdleSpells {
        let mut s = IdleSpells::default();
        let end = at.last().copied().unwrap_or(0);
        for t in 0..=end {
            let active = at.contains(&t);
            s.observe(
                Duration::from_secs(t),
                active,
                u32::from(active),
                Some(cold),
            );
        }
        s
    }

    #[test]
    fn nothing_is_said_before_a_cold_start_and_three_spells_are_known() {
        let s = seen(&[0, 100, 200], Duration::from_secs(20));
        assert_eq!(s.linger(None, 8.0), None);
        assert_eq!(s.linger(Some(Duration::from_secs(20)), 8.0), None);
        let s = seen(&[0, 100, 200, 300], Duration::from_secs(20));
        assert!(s.linger(Some(Duration::from_secs(20)), 8.0).is_some());
    }

    #[test]
    fn spells_shorter_than_a_restart_are_ridden_out_and_longer_ones_are_not() {
        let cold = Duration::from_secs(60);
        // Spells of 40 s, well under a 60 s cold start: keep through
        // them, and through longer ones up to the break-even (a restart:
        // 60 s, and each wake's one request waiting 30 s, a slot of 8).
        let short = seen(&[0, 40, 80, 120, 160], cold);
        let h = short.linger(Some(cold), 8.0).expect("known");
        assert!(
            h > Duration::from_secs(60) && h < Duration::from_secs(70),
            "{h:?}"
        );
        // Spells of 1,000 s: ten cold starts each; going to zero at once
        // costs a restart, keeping costs the whole spell.
        let long = seen(&[0, 1000, 2000, 3000], cold);
        assert_eq!(long.linger(Some(cold), 8.0), Some(Duration::ZERO));
    }

    #[test]
    fn a_wake_that_meets_a_burst_makes_a_restart_dearer() {
        let cold = Duration::from_secs(20);
        // Spells of 30 s: a bare restart (20 s) is cheaper than keeping
        // the replica; a wake that meets 40 requests adds 40 × 10 s / 8.
        let quiet = seen(&[0, 30, 60, 90, 120], cold);
        assert_eq!(quiet.linger(Some(cold), 8.0), Some(Duration::ZERO));
        let mut busy = IdleSpells::default();
        // Four seconds of 10 requests each, then 26 s of nothing: spells
        // of 27 s, each wake meeting 40 requests, so a restart costs
        // 20 + 40 × 10 / 8 = 70 replica-seconds against 27 to keep.
        for t in 0..=150u64 {
            let burst = t % 30 < 4;
            busy.observe(
                Duration::from_secs(t),
                burst,
                if burst { 10 } else { 0 },
                Some(cold),
            );
        }
        assert_eq!(busy.linger(Some(cold), 8.0), Some(Duration::from_secs(70)));
    }

    #[test]
    fn the_linger_is_capped_at_twenty_cold_starts() {
        let cold = Duration::from_secs(2);
        let s = seen(&[0, 50, 100, 150, 200], cold);
        // 50 s spells against a 2 s cold start: 25 cold starts; never
        // kept through.
        assert_eq!(s.linger(Some(cold), 8.0), Some(Duration::ZERO));
    }
}
