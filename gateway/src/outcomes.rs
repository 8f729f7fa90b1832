//! A counter by outcome (`ok`, then each [`ErrorKind`]) for one app or
//! pool, each series registered the first time it counts. An app that never
//! timed out has no `outcome="timeout"` series at zero, and a start with
//! thousands of apps registers none: looking a counter up by name and
//! labels is what cost, not counting.

use std::sync::OnceLock;

use crate::error::ErrorKind;

/// `metric{label=owner, outcome=…}`, one lazily registered series per
/// outcome.
pub struct Outcomes {
    metric: &'static str,
    label: &'static str,
    owner: String,
    /// `ok`, then [`ErrorKind::ALL`] in order.
    counters: [OnceLock<metrics::Counter>; ErrorKind::ALL.len() + 1],
}

impl Outcomes {
    /// The counters of `owner`, none registered yet.
    pub fn new(metric: &'static str, label: &'static str, owner: &str) -> Self {
        Outcomes {
            metric,
            label,
            owner: owner.to_string(),
            counters: std::array::from_fn(|_| OnceLock::new()),
        }
    }

    /// Counts one outcome: `None` is success.
    pub fn count(&self, outcome: Option<ErrorKind>) {
        let (i, name) = match outcome {
            None => (0, "ok"),
            Some(k) => (k as usize + 1, k.as_str()),
        };
        if let Some(slot) = self.counters.get(i) {
            slot.get_or_init(|| {
                metrics::counter!(
                    self.metric,
                    self.label => self.owner.clone(),
                    "outcome" => name
                )
            })
            .increment(1);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_outcome_has_its_own_slot() {
        // `k as usize + 1` indexes the array: every kind fits, in order.
        for (i, k) in ErrorKind::ALL.iter().enumerate() {
            assert_eq!(*k as usize, i, "{k:?} is out of order in ErrorKind::ALL");
        }
        let o = Outcomes::new("warmgate_requests_total", "app", "m");
        o.count(None);
        for k in ErrorKind::ALL {
            o.count(Some(k));
        }
        assert!(o.counters.iter().all(|c| c.get().is_some()));
    }
}
