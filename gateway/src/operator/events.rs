//! Kubernetes Events for what happens to a resource, as `kubectl describe`
//! shows them: scaling, promotions and rollbacks, refusals and failures.
//!
//! They are read off the resource's status as it changes: each time the
//! operator writes a status, the difference from the one before becomes
//! events ([`transitions`], pure), which the recorder publishes
//! (kube-runtime's, which folds repeats into an `EventSeries`). So every
//! event has a status behind it, and nothing is said twice.

use k8s_openapi::api::core::v1::ObjectReference;
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use warmgate_deploy::crd::{Condition, PromotionState, ServingAppStatus, WarmPoolStatus};

/// The controller name events are reported under.
const CONTROLLER: &str = "warmgate-operator";

/// Longest note an event may carry (the API's limit is 1 kB).
const NOTE_LIMIT: usize = 1000;

/// One event to publish.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Notice {
    /// A warning (something failed or was refused) rather than news.
    pub warning: bool,
    /// `kubectl describe`'s Reason: one PascalCase word.
    pub reason: String,
    /// What was done, in one word (the event's `action`).
    pub action: &'static str,
    /// What happened, for people.
    pub note: String,
}

/// What the events are read from: the parts of a status that change
/// when something happens.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Observed {
    /// Replicas asked for.
    pub desired: u32,
    /// Conditions.
    pub conditions: Vec<Condition>,
    /// An app's last promotion.
    pub promotion: Option<PromotionState>,
}

impl From<&ServingAppStatus> for Observed {
    fn from(s: &ServingAppStatus) -> Self {
        Observed {
            desired: s.replicas.desired,
            conditions: s.conditions.clone(),
            promotion: s.promotion.clone(),
        }
    }
}

impl From<&WarmPoolStatus> for Observed {
    fn from(s: &WarmPoolStatus) -> Self {
        Observed {
            desired: s.replicas.desired,
            conditions: s.conditions.clone(),
            promotion: None,
        }
    }
}

/// The events between two statuses of one resource (`was` is `None` for
/// its first).
pub fn transitions(was: Option<&Observed>, next: &Observed) -> Vec<Notice> {
    let empty = Observed::default();
    let was = was.unwrap_or(&empty);
    let mut out = Vec::new();
    for c in &next.conditions {
        let before = was.conditions.iter().find(|o| o.type_ == c.type_);
        if before.is_some_and(|b| b.status == c.status && b.reason == c.reason) {
            continue;
        }
        let notice = match (c.type_.as_str(), c.status.as_str()) {
            // Ready again (not: ready at the operator's start, nor a change
            // between serving and scaled to zero, which `Scaled` says).
            ("Ready", "True") if before.is_some_and(|b| b.status != "True") => {
                Some(notice(false, "Ready", "Serve", c))
            }
            // Starting replicas is news; anything else (refused) is not.
            ("Ready", "False") if !c.reason.is_empty() => {
                Some(notice(c.reason != "Starting", &c.reason, "Serve", c))
            }
            ("Unschedulable", "True") => Some(notice(true, "Unschedulable", "Schedule", c)),
            _ => None,
        };
        out.extend(notice);
    }
    if next.desired != was.desired {
        out.push(Notice {
            warning: false,
            reason: "Scaled".into(),
            action: "Scale",
            note: format!("from {} to {} replicas", was.desired, next.desired),
        });
    }
    if let Some(p) = &next.promotion
        && was.promotion.as_ref() != Some(p)
    {
        let same = was
            .promotion
            .as_ref()
            .is_some_and(|w| w.revision == p.revision && w.phase == p.phase);
        if !same {
            out.extend(promotion_notice(p));
        }
    }
    out
}

fn notice(warning: bool, reason: &str, action: &'static str, c: &Condition) -> Notice {
    Notice {
        warning,
        reason: reason.to_string(),
        action,
        note: if c.message.is_empty() {
            format!("{} is {}", c.type_, c.status)
        } else {
            c.message.clone()
        },
    }
}

fn promotion_notice(p: &PromotionState) -> Option<Notice> {
    let how = if p.in_place { " in place" } else { "" };
    let why = p.reason.clone().unwrap_or_default();
    let (warning, reason, note) = match p.phase.as_str() {
        "warming" => (false, "Promoting", format!("promoting {}{how}", p.revision)),
        "canary" => (
            false,
            "Canary",
            format!("{} takes the canary's share", p.revision),
        ),
        "done" => (
            false,
            "Promoted",
            format!("{} takes all the traffic", p.revision),
        ),
        "rolled_back" => (
            true,
            "RolledBack",
            format!("{} rolled back: {why}", p.revision),
        ),
        "failed" => (
            true,
            "PromotionFailed",
            format!("{} failed: {why}", p.revision),
        ),
        _ => return None,
    };
    Some(Notice {
        warning,
        reason: reason.into(),
        action: "Promote",
        note,
    })
}

/// Publishes events about the operator's resources.
pub struct Events {
    recorder: Recorder,
}

impl Events {
    /// Events through `client`, reported by this operator replica.
    pub fn new(client: kube::Client, instance: Option<String>) -> Self {
        let reporter = Reporter {
            controller: CONTROLLER.into(),
            instance,
        };
        Events {
            recorder: Recorder::new(client, reporter),
        }
    }

    /// Publishes each notice about `regarding`. An event that cannot be
    /// written is logged, never an error: events are advice.
    pub async fn publish(&self, regarding: &ObjectReference, notices: Vec<Notice>) {
        for n in notices {
            let mut note = n.note;
            if note.len() > NOTE_LIMIT {
                let mut end = NOTE_LIMIT;
                while !note.is_char_boundary(end) {
                    end -= 1;
                }
                note.truncate(end);
            }
            let ev = Event {
                type_: if n.warning {
                    EventType::Warning
                } else {
                    EventType::Normal
                },
                reason: n.reason,
                note: Some(note),
                action: n.action.into(),
                secondary: None,
            };
            if let Err(e) = self.recorder.publish(&ev, regarding).await {
                tracing::debug!(error = %e, "could not write an event");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cond(type_: &str, status: &str, reason: &str, message: &str) -> Condition {
        Condition {
            type_: type_.into(),
            status: status.into(),
            reason: reason.into(),
            message: message.into(),
            last_transition_time: "2026-12-01T00:00:00Z".into(),
        }
    }

    fn reasons(n: &[Notice]) -> Vec<(&str, bool)> {
        n.iter().map(|n| (n.reason.as_str(), n.warning)).collect()
    }

    #[test]
    fn a_refused_resource_gets_a_warning_with_the_key_and_the_reason() {
        let next = Observed {
            conditions: vec![cond(
                "Ready",
                "False",
                "Refused",
                "spec.concurrency: must be at least 1",
            )],
            ..Observed::default()
        };
        let n = transitions(None, &next);
        assert_eq!(reasons(&n), [("Refused", true)]);
        assert_eq!(n[0].note, "spec.concurrency: must be at least 1");
        // The same status again says nothing.
        assert!(transitions(Some(&next), &next).is_empty());
    }

    #[test]
    fn scaling_and_a_promotion_s_steps_are_news_and_a_rollback_is_a_warning() {
        let mut was = Observed {
            desired: 1,
            conditions: vec![cond("Ready", "True", "Ready", "")],
            ..Observed::default()
        };
        let mut next = was.clone();
        next.desired = 3;
        next.promotion = Some(PromotionState {
            revision: "m-00002".into(),
            phase: "canary".into(),
            reason: None,
            in_place: true,
        });
        let n = transitions(Some(&was), &next);
        assert_eq!(reasons(&n), [("Scaled", false), ("Canary", false)]);
        assert_eq!(n[0].note, "from 1 to 3 replicas");
        was = next.clone();
        next.promotion = Some(PromotionState {
            phase: "rolled_back".into(),
            reason: Some("error rate 50% over 20 answers is above 5%".into()),
            ..next.promotion.clone().expect("set")
        });
        let n = transitions(Some(&was), &next);
        assert_eq!(reasons(&n), [("RolledBack", true)]);
        assert!(n[0].note.contains("error rate 50%"), "{}", n[0].note);
    }

    #[test]
    fn an_unschedulable_replica_is_a_warning_and_recovery_is_news() {
        let ready = cond("Ready", "True", "Ready", "");
        let was = Observed {
            conditions: vec![ready.clone()],
            ..Observed::default()
        };
        let next = Observed {
            conditions: vec![
                cond("Ready", "False", "Starting", "0 of 1 ready"),
                cond(
                    "Unschedulable",
                    "True",
                    "Unschedulable",
                    "0/4 nodes: Insufficient nvidia.com/gpu",
                ),
            ],
            ..Observed::default()
        };
        let n = transitions(Some(&was), &next);
        assert_eq!(reasons(&n), [("Starting", false), ("Unschedulable", true)]);
        let back = Observed {
            conditions: vec![ready, cond("Unschedulable", "False", "NoUnschedulable", "")],
            ..Observed::default()
        };
        assert_eq!(
            reasons(&transitions(Some(&next), &back)),
            [("Ready", false)]
        );
    }
}
