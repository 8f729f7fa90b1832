//! A promotion of a LoRA adapter from a new checkpoint: the same canary,
//! gate and bake as a revision's, on the adapter's own traffic. Pure: the
//! caller gives the time and the canary's answers, this decides.
//!
//! 1. **Gating**: the new revision takes no routed traffic; the app's
//!    evaluation gate (if any) is run against it by name (`name@n`).
//! 2. **Canary**: `canary` percent of the requests for the adapter (by its
//!    name or an alias) go to the new revision for the bake time, judged
//!    as a revision's canary is (`min_requests`, `max_error_rate`).
//! 3. **Done** (the new revision becomes the adapter's checkpoint) or
//!    **RolledBack** (the requests go back to the old one, which never
//!    stopped serving the rest).
//!
//! No replica starts or stops for it: the new revision is loaded where
//! its requests go, as any adapter is, so the base model and the other
//! adapters keep their replicas and their slots.

use std::time::Duration;

use serde::Serialize;

/// How a promotion is judged, from the app's `[apps.promotion]` and the
/// request's overrides.
#[derive(Debug, Clone, PartialEq)]
pub struct AdapterPlan {
    /// Percent of the adapter's requests the new revision takes (1..=100).
    pub canary: u8,
    /// How long the canary runs before it takes all of them.
    pub bake: Duration,
    /// Answers before the error rate is judged during the bake.
    pub min_requests: u64,
    /// The error rate above which it rolls back.
    pub max_error_rate: f64,
}

/// Where a promotion stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum AdapterPhase {
    /// The evaluation gate runs; no routed request goes to it.
    Gating,
    /// It takes its share of the adapter's requests.
    Canary,
    /// It is the adapter's checkpoint now.
    Done,
    /// It was dropped; the old revision serves.
    RolledBack,
}

impl AdapterPhase {
    /// Whether the promotion has ended.
    pub fn is_terminal(self) -> bool {
        matches!(self, AdapterPhase::Done | AdapterPhase::RolledBack)
    }
}

/// What the caller does after a step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AdapterStep {
    /// Nothing yet.
    Wait,
    /// Make the new revision the adapter's checkpoint.
    Commit,
    /// Stop routing to the new revision.
    Drop,
}

/// One promotion of one adapter.
#[derive(Debug, Clone, Serialize)]
pub struct AdapterPromotion {
    /// The adapter's name.
    pub adapter: String,
    /// The revision serving when it began.
    pub from_revision: u32,
    /// The new revision.
    pub to_revision: u32,
    /// The new revision's checkpoint.
    pub checkpoint: String,
    /// Percent of the adapter's requests it takes during the canary.
    pub canary: u8,
    /// Where it stands.
    pub phase: AdapterPhase,
    /// Why it rolled back.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// Routed requests it answered during the canary.
    pub answered: u64,
    /// Of those, the ones that failed (5xx, a failed load, a timeout).
    pub failed: u64,
    #[serde(skip)]
    plan: AdapterPlan,
    /// When the canary began, on the caller's clock.
    #[serde(skip)]
    canary_since: Option<Duration>,
}

impl AdapterPromotion {
    /// A promotion of `adapter` from revision `from` to `to`, at the gate.
    pub fn begin(adapter: &str, from: u32, to: u32, checkpoint: &str, plan: AdapterPlan) -> Self {
        AdapterPromotion {
            adapter: adapter.to_string(),
            from_revision: from,
            to_revision: to.max(from + 1),
            checkpoint: checkpoint.to_string(),
            canary: plan.canary.clamp(1, 100),
            phase: AdapterPhase::Gating,
            reason: None,
            answered: 0,
            failed: 0,
            plan,
            canary_since: None,
        }
    }

    /// The percent of the adapter's routed requests the new revision takes
    /// now.
    pub fn share(&self) -> u8 {
        match self.phase {
            AdapterPhase::Canary => self.canary,
            AdapterPhase::Done => 100,
            AdapterPhase::Gating | AdapterPhase::RolledBack => 0,
        }
    }

    /// The gate's outcome, at `now`: the canary begins, or it rolls back.
    pub fn gated(&mut self, now: Duration, outcome: Result<(), String>) -> AdapterStep {
        if self.phase != AdapterPhase::Gating {
            return AdapterStep::Wait;
        }
        match outcome {
            Ok(()) => {
                self.phase = AdapterPhase::Canary;
                self.canary_since = Some(now);
                AdapterStep::Wait
            }
            Err(why) => self.roll_back(why),
        }
    }

    /// The canary's answers so far, at `now`: rolls back when they fail
    /// too often, commits once the bake has passed.
    pub fn observe(&mut self, now: Duration, answered: u64, failed: u64) -> AdapterStep {
        let Some(since) = self
            .canary_since
            .filter(|_| self.phase == AdapterPhase::Canary)
        else {
            return AdapterStep::Wait;
        };
        self.answered = answered;
        self.failed = failed.min(answered);
        let rate = self.failed as f64 / answered.max(1) as f64;
        let baked = now.saturating_sub(since) >= self.plan.bake;
        let judged = answered >= self.plan.min_requests || baked;
        if judged && rate > self.plan.max_error_rate {
            return self.roll_back(format!(
                "error rate {:.0}% over {answered} answers of {}@{} is above {:.0}%",
                rate * 100.0,
                self.adapter,
                self.to_revision,
                self.plan.max_error_rate * 100.0
            ));
        }
        if baked {
            return AdapterStep::Commit;
        }
        AdapterStep::Wait
    }

    /// The new revision was made the adapter's checkpoint.
    pub fn committed(&mut self) {
        if self.phase == AdapterPhase::Canary {
            self.phase = AdapterPhase::Done;
        }
    }

    /// Ends it rolled back (an operator's rollback, a failed commit, the
    /// adapter changed or deleted meanwhile).
    pub fn roll_back(&mut self, why: String) -> AdapterStep {
        if self.phase.is_terminal() {
            return AdapterStep::Wait;
        }
        self.phase = AdapterPhase::RolledBack;
        self.reason = Some(why);
        AdapterStep::Drop
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan() -> AdapterPlan {
        AdapterPlan {
            canary: 20,
            bake: Duration::from_secs(30),
            min_requests: 10,
            max_error_rate: 0.05,
        }
    }

    fn at(s: u64) -> Duration {
        Duration::from_secs(s)
    }

    #[test]
    fn a_healthy_canary_takes_its_share_after_the_gate_and_all_after_the_bake() {
        let mut p = AdapterPromotion::begin("sql", 2, 3, "file:///v3", plan());
        assert_eq!(
            (p.to_revision, p.share()),
            (3, 0),
            "nothing before the gate"
        );
        assert_eq!(p.observe(at(100), 50, 0), AdapterStep::Wait, "not judged");
        assert_eq!(p.gated(at(5), Ok(())), AdapterStep::Wait);
        assert_eq!(p.share(), 20);
        assert_eq!(p.observe(at(34), 40, 1), AdapterStep::Wait, "2.5% is fine");
        assert_eq!(p.observe(at(35), 41, 1), AdapterStep::Commit);
        p.committed();
        assert_eq!((p.phase, p.share()), (AdapterPhase::Done, 100));
        assert_eq!(p.roll_back("late".into()), AdapterStep::Wait, "ended");
    }

    #[test]
    fn a_failing_gate_or_canary_rolls_back_with_why() {
        let mut gated = AdapterPromotion::begin("sql", 1, 2, "file:///v2", plan());
        assert_eq!(gated.gated(at(1), Err("exit 1".into())), AdapterStep::Drop);
        assert_eq!((gated.phase, gated.share()), (AdapterPhase::RolledBack, 0));
        assert_eq!(gated.reason.as_deref(), Some("exit 1"));

        let mut bad = AdapterPromotion::begin("sql", 1, 2, "file:///v2", plan());
        bad.gated(at(0), Ok(()));
        assert_eq!(bad.observe(at(1), 9, 9), AdapterStep::Wait, "too few");
        assert_eq!(bad.observe(at(2), 10, 9), AdapterStep::Drop);
        assert!(bad.reason.as_deref().unwrap_or("").contains("sql@2"));

        // A quiet adapter is judged on the answers it has by the end.
        let mut quiet = AdapterPromotion::begin("sql", 1, 2, "file:///v2", plan());
        quiet.gated(at(0), Ok(()));
        assert_eq!(quiet.observe(at(30), 3, 1), AdapterStep::Drop);
        let mut silent = AdapterPromotion::begin("sql", 1, 2, "file:///v2", plan());
        silent.gated(at(0), Ok(()));
        assert_eq!(silent.observe(at(30), 0, 0), AdapterStep::Commit);
    }
}
