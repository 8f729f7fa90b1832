//! Revisions of an app and the promotion lifecycle, as pure state machines.
//!
//! A revision is an immutable snapshot of an app: its checkpoint (with the
//! ETag or version it resolved to), its spec, and when it was made. Its
//! state and traffic share change as promotions run:
//!
//! ```text
//! Pending ──▶ Warming ──▶ Serving ──▶ Retired
//!    │           │           │
//!    └───────────┴───────────┴──▶ Failed (with the reason)
//! ```
//!
//! A [`Promotion`] moves traffic from the serving revision to a new one.
//! It reacts to [`Event`]s (the new revision is ready, the bake time is
//! over, it is unhealthy, an operator rolls back) with [`Effect`]s that the
//! gateway carries out (start replicas, set the traffic split, retire a
//! revision). No I/O happens here, so every transition is tested directly,
//! and the caller can persist a step before it acts on it.

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// Where a revision is in its life.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "state", rename_all = "snake_case")]
pub enum RevisionState {
    /// Created; nothing started.
    Pending,
    /// Its replicas are starting and loading weights.
    Warming,
    /// Healthy, without traffic yet.
    Ready,
    /// Taking a share of the traffic.
    Serving,
    /// Replaced; its replicas drain and stop.
    Retired,
    /// Failed to start, or rolled back; `reason` says why.
    Failed {
        /// What went wrong.
        reason: String,
    },
}

impl RevisionState {
    /// A short name for tables.
    pub fn name(&self) -> &'static str {
        match self {
            RevisionState::Pending => "pending",
            RevisionState::Warming => "warming",
            RevisionState::Ready => "ready",
            RevisionState::Serving => "serving",
            RevisionState::Retired => "retired",
            RevisionState::Failed { .. } => "failed",
        }
    }
}

/// One revision of an app.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Revision {
    /// `<app>-<5-digit seq>`, e.g. `minilm-00002`.
    pub id: String,
    /// The app.
    pub app: String,
    /// Order within the app, from 1.
    pub seq: u32,
    /// Checkpoint URI.
    pub checkpoint: Option<String>,
    /// The ETag or version the checkpoint resolved to when it was made.
    pub checkpoint_version: Option<String>,
    /// The app spec it runs, as JSON.
    pub spec: String,
    /// Unix seconds.
    pub created_unix: f64,
    /// Lifecycle state.
    #[serde(flatten)]
    pub state: RevisionState,
    /// Share of the app's traffic, in percent.
    pub traffic: u8,
    /// Whether it has ever served traffic (a rollback target).
    pub served: bool,
}

impl Revision {
    /// The target whose replicas run it.
    pub fn target(&self) -> crate::TargetId {
        crate::TargetId::revision(&self.app, self.seq)
    }
}

/// The id of an app's `seq`-th revision.
pub fn revision_id(app: &str, seq: u32) -> String {
    crate::TargetId::revision(app, seq).to_string()
}

/// How a promotion moves traffic.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Plan {
    /// Percent of traffic to the new revision during the bake; `None`
    /// shifts everything at once when it is ready.
    pub canary: Option<u8>,
    /// How long the canary runs before the rest of the traffic moves.
    #[serde(with = "humantime_serde")]
    pub bake: Duration,
    /// The app had no replicas when the promotion began. The new revision
    /// still starts one replica, is gated and switched to only once it is
    /// ready (then scales to zero again with no traffic); only
    /// [`Promotion::switch`] moves traffic without starting anything.
    pub at_zero: bool,
    /// The new revision's weights are swapped into the serving revision's
    /// replicas (the worker's `POST /weights`) instead of starting replicas
    /// of its own: the canary is the first replicas swapped, and a
    /// rollback swaps the old weights back. Never needs more GPUs than the
    /// app holds.
    #[serde(default)]
    pub in_place: bool,
    /// In place, the canary percent that was asked for (`canary` holds
    /// whole replicas' share): a fallback to new replicas uses it again.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub canary_asked: Option<u8>,
}

/// Where a promotion is.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "phase", rename_all = "snake_case")]
pub enum Phase {
    /// The new revision's replicas are starting.
    Warming,
    /// The new revision takes the canary share while it bakes.
    Canary,
    /// The new revision takes all traffic.
    Done,
    /// Traffic went back to the previous revision.
    RolledBack {
        /// Why.
        reason: String,
    },
    /// The new revision never became ready; the old one kept serving.
    Failed {
        /// Why.
        reason: String,
    },
}

impl Phase {
    /// Whether nothing more can happen.
    pub fn is_terminal(&self) -> bool {
        matches!(
            self,
            Phase::Done | Phase::RolledBack { .. } | Phase::Failed { .. }
        )
    }
}

/// What can happen during a promotion.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// The new revision's replicas are healthy.
    Ready,
    /// The new revision could not start.
    StartFailed(String),
    /// The canary has run for the bake time without trouble.
    BakeElapsed,
    /// The new revision passed an error or latency threshold.
    Unhealthy(String),
    /// An operator asked to roll back.
    Rollback(String),
    /// In place only: a worker cannot swap its weights (it has no
    /// `POST /weights`); the promotion starts new replicas instead.
    InPlaceUnsupported(String),
}

/// What the gateway must do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Effect {
    /// Start the revision's replicas (and stream its weights).
    Start(String),
    /// Route traffic by these shares (they add up to 100).
    Traffic(Vec<(String, u8)>),
    /// Record the revision's new state.
    State(String, RevisionState),
    /// Drain and stop the revision's replicas.
    Retire(String),
}

/// A transition that cannot happen.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("promotion of {to} is {phase}: {event} does not apply")]
pub struct Invalid {
    /// The revision being promoted.
    pub to: String,
    /// Its phase.
    pub phase: String,
    /// The event.
    pub event: String,
}

/// Traffic moving from one revision to another.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Promotion {
    /// The app.
    pub app: String,
    /// The revision serving before (none for an app's first revision).
    pub from: Option<String>,
    /// The revision being promoted.
    pub to: String,
    /// How.
    pub plan: Plan,
    /// Where it is.
    #[serde(flatten)]
    pub phase: Phase,
    /// Why an in-place promotion fell back to new replicas (a worker that
    /// cannot swap its weights), when it did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fell_back: Option<String>,
}

impl Promotion {
    /// Starts promoting `to` over `from`: `to` starts (one replica even
    /// when the app is at zero) and takes traffic only once it is ready,
    /// as a Knative revision does. Nothing is switched to unseen.
    pub fn begin(app: &str, from: Option<&str>, to: &str, plan: Plan) -> (Promotion, Vec<Effect>) {
        let p = Promotion {
            app: app.to_string(),
            from: from.map(str::to_string),
            to: to.to_string(),
            plan,
            phase: Phase::Warming,
            fell_back: None,
        };
        let effects = vec![
            Effect::State(p.to.clone(), RevisionState::Warming),
            Effect::Start(p.to.clone()),
        ];
        (p, effects)
    }

    /// Moves all traffic to `to` at once, starting nothing: for a
    /// gateway's start from its config (nothing runs yet, and the first
    /// request wakes the revision) and a rollback at zero to a revision
    /// that already served.
    pub fn switch(app: &str, from: Option<&str>, to: &str, plan: Plan) -> (Promotion, Vec<Effect>) {
        let p = Promotion {
            app: app.to_string(),
            from: from.map(str::to_string),
            to: to.to_string(),
            plan: Plan {
                canary: None,
                ..plan
            },
            phase: Phase::Warming,
            fell_back: None,
        };
        p.finish()
    }

    /// The next step after `event`.
    pub fn on(&self, event: Event) -> Result<(Promotion, Vec<Effect>), Invalid> {
        match (&self.phase, event) {
            (Phase::Warming, Event::Ready) => Ok(self.ready()),
            (Phase::Warming, Event::StartFailed(reason)) => {
                let reason = format!("failed to start: {reason}");
                Ok(self.with(
                    Phase::Failed {
                        reason: reason.clone(),
                    },
                    vec![
                        Effect::State(self.to.clone(), RevisionState::Failed { reason }),
                        Effect::Retire(self.to.clone()),
                    ],
                ))
            }
            (Phase::Warming, Event::InPlaceUnsupported(reason)) if self.plan.in_place => {
                // Nothing was swapped: the old revision serves as it did,
                // and the new one starts replicas of its own.
                let mut plan = self.plan.clone();
                plan.in_place = false;
                plan.canary = plan.canary_asked.take().or(plan.canary);
                Ok((
                    Promotion {
                        plan,
                        fell_back: Some(reason),
                        ..self.clone()
                    },
                    vec![Effect::Start(self.to.clone())],
                ))
            }
            (Phase::Canary, Event::BakeElapsed) => Ok(self.finish()),
            (Phase::Warming | Phase::Canary, Event::Unhealthy(reason)) => {
                Ok(self.roll_back(reason))
            }
            (Phase::Warming | Phase::Canary, Event::Rollback(reason)) => {
                Ok(self.roll_back(format!("rolled back by hand: {reason}")))
            }
            (phase, event) => Err(Invalid {
                to: self.to.clone(),
                phase: format!("{phase:?}"),
                event: format!("{event:?}"),
            }),
        }
    }

    fn with(&self, phase: Phase, effects: Vec<Effect>) -> (Promotion, Vec<Effect>) {
        (
            Promotion {
                phase,
                ..self.clone()
            },
            effects,
        )
    }

    /// Ready: the canary share, or everything. In place, a canary that
    /// holds every replica (an app of one) still bakes: a rollback swaps
    /// the old weights back.
    fn ready(&self) -> (Promotion, Vec<Effect>) {
        match (self.plan.canary, &self.from) {
            (Some(pct), Some(from)) if pct < 100 || self.plan.in_place => self.with(
                Phase::Canary,
                vec![
                    Effect::State(self.to.clone(), RevisionState::Serving),
                    Effect::Traffic(vec![(self.to.clone(), pct), (from.clone(), 100 - pct)]),
                ],
            ),
            _ => self.finish(),
        }
    }

    /// All traffic to the new revision; the old one retires.
    fn finish(&self) -> (Promotion, Vec<Effect>) {
        let mut effects = vec![
            Effect::State(self.to.clone(), RevisionState::Serving),
            Effect::Traffic(vec![(self.to.clone(), 100)]),
        ];
        if let Some(from) = &self.from {
            effects.push(Effect::State(from.clone(), RevisionState::Retired));
            effects.push(Effect::Retire(from.clone()));
        }
        self.with(Phase::Done, effects)
    }

    /// All traffic back to the old revision; the new one is Failed.
    fn roll_back(&self, reason: String) -> (Promotion, Vec<Effect>) {
        let mut effects = Vec::new();
        if let Some(from) = &self.from {
            effects.push(Effect::Traffic(vec![(from.clone(), 100)]));
            effects.push(Effect::State(from.clone(), RevisionState::Serving));
        } else {
            effects.push(Effect::Traffic(Vec::new()));
        }
        effects.push(Effect::State(
            self.to.clone(),
            RevisionState::Failed {
                reason: reason.clone(),
            },
        ));
        effects.push(Effect::Retire(self.to.clone()));
        self.with(Phase::RolledBack { reason }, effects)
    }
}

/// An app's revisions and its promotion in progress: what is persisted.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct History {
    /// Oldest first.
    pub revisions: Vec<Revision>,
    /// The last promotion (in progress, or how the last one ended).
    pub promotion: Option<Promotion>,
    /// The app's config spec (JSON) the revisions were last made from: a
    /// changed config makes a new revision.
    #[serde(default)]
    pub config: Option<String>,
}

impl History {
    /// A revision by id.
    pub fn get(&self, id: &str) -> Option<&Revision> {
        self.revisions.iter().find(|r| r.id == id)
    }

    /// The next revision number.
    pub fn next_seq(&self) -> u32 {
        self.revisions.iter().map(|r| r.seq).max().unwrap_or(0) + 1
    }

    /// The revisions with traffic, and their shares.
    pub fn split(&self) -> Vec<(String, u8)> {
        self.revisions
            .iter()
            .filter(|r| r.traffic > 0)
            .map(|r| (r.id.clone(), r.traffic))
            .collect()
    }

    /// The revision with the most traffic (the newer one on a tie).
    pub fn serving(&self) -> Option<&Revision> {
        self.revisions
            .iter()
            .filter(|r| r.traffic > 0)
            .max_by_key(|r| (r.traffic, r.seq))
    }

    /// The revision a rollback returns to: the newest one that served and
    /// is now retired.
    pub fn previous_good(&self) -> Option<&Revision> {
        self.revisions
            .iter()
            .rev()
            .find(|r| r.served && r.state == RevisionState::Retired)
    }

    /// Whether a promotion is running.
    pub fn promoting(&self) -> bool {
        self.promotion
            .as_ref()
            .is_some_and(|p| !p.phase.is_terminal())
    }

    /// Records a step: the promotion's new phase and its effects on the
    /// revisions' states and shares.
    pub fn apply(&mut self, promotion: &Promotion, effects: &[Effect]) {
        for e in effects {
            match e {
                Effect::State(id, state) => {
                    if let Some(r) = self.revisions.iter_mut().find(|r| &r.id == id) {
                        r.state = state.clone();
                        if *state == RevisionState::Serving {
                            r.served = true;
                        }
                    }
                }
                Effect::Traffic(split) => {
                    for r in &mut self.revisions {
                        r.traffic = split
                            .iter()
                            .find(|(id, _)| *id == r.id)
                            .map_or(0, |(_, p)| *p);
                    }
                }
                Effect::Start(_) | Effect::Retire(_) => {}
            }
        }
        self.promotion = Some(promotion.clone());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rev(app: &str, seq: u32, state: RevisionState, traffic: u8) -> Revision {
        Revision {
            id: revision_id(app, seq),
            app: app.into(),
            seq,
            checkpoint: Some(format!("file:///ckpt/{seq}")),
            checkpoint_version: None,
            spec: "{}".into(),
            created_unix: f64::from(seq),
            served: traffic > 0,
            state,
            traffic,
        }
    }

    fn history() -> History {
        History {
            revisions: vec![
                rev("m", 1, RevisionState::Serving, 100),
                rev("m", 2, RevisionState::Pending, 0),
            ],
            promotion: None,
            config: None,
        }
    }

    fn plan(canary: Option<u8>) -> Plan {
        Plan {
            canary,
            bake: Duration::from_secs(60),
            at_zero: false,
            in_place: false,
            canary_asked: None,
        }
    }

    fn in_place(canary: Option<u8>) -> Plan {
        Plan {
            in_place: true,
            ..plan(canary)
        }
    }

    #[test]
    fn in_place_a_worker_that_cannot_swap_falls_back_to_new_replicas() {
        let mut h = history();
        let mut how = in_place(Some(50));
        how.canary_asked = Some(10);
        let (p, fx) = Promotion::begin("m", Some("m-00001"), "m-00002", how);
        h.apply(&p, &fx);
        let (p, fx) = p
            .on(Event::InPlaceUnsupported(
                "POST /weights answered 404".into(),
            ))
            .expect("valid while warming");
        assert_eq!(
            p.plan.canary,
            Some(10),
            "the canary asked for, not whole replicas'"
        );
        assert_eq!(p.phase, Phase::Warming, "it warms replicas of its own now");
        assert!(!p.plan.in_place);
        assert_eq!(p.fell_back.as_deref(), Some("POST /weights answered 404"));
        assert_eq!(fx, [Effect::Start("m-00002".into())]);
        h.apply(&p, &fx);
        assert_eq!(h.split(), [("m-00001".to_string(), 100)]);
        // Once fallen back, it is an ordinary promotion.
        assert!(p.on(Event::InPlaceUnsupported("again".into())).is_err());
        let (p, _) = p.on(Event::Ready).expect("ready");
        assert_eq!(p.phase, Phase::Canary);
        // Not in place, the event means nothing.
        let (q, _) = Promotion::begin("m", Some("m-00001"), "m-00002", plan(None));
        assert!(q.on(Event::InPlaceUnsupported("x".into())).is_err());
    }

    #[test]
    fn in_place_an_app_of_one_replica_still_bakes_its_canary() {
        let (p, _) = Promotion::begin("m", Some("m-00001"), "m-00002", in_place(Some(100)));
        let (p, fx) = p.on(Event::Ready).expect("ready");
        assert_eq!(p.phase, Phase::Canary);
        assert!(fx.contains(&Effect::Traffic(vec![
            ("m-00002".into(), 100),
            ("m-00001".into(), 0)
        ])));
        let (p, fx) = p.on(Event::Unhealthy("5xx".into())).expect("unhealthy");
        assert!(matches!(p.phase, Phase::RolledBack { .. }));
        assert!(fx.contains(&Effect::Traffic(vec![("m-00001".into(), 100)])));
        assert!(fx.contains(&Effect::Retire("m-00002".into())));
        // Not in place, a canary of 100% is all at once.
        let (p, _) = Promotion::begin("m", Some("m-00001"), "m-00002", plan(Some(100)));
        assert_eq!(p.on(Event::Ready).expect("ready").0.phase, Phase::Done);
    }

    #[test]
    fn an_in_place_promotion_read_back_from_an_older_record_is_not_in_place() {
        let text = r#"{"app":"m","from":"m-00001","to":"m-00002","plan":{"canary":null,"bake":"1m","at_zero":false},"phase":"warming"}"#;
        let p: Promotion = serde_json::from_str(text).expect("an older record parses");
        assert!(!p.plan.in_place);
        assert!(p.fell_back.is_none());
        let json = serde_json::to_string(&p).expect("json");
        assert!(!json.contains("fell_back"), "{json}");
    }

    /// Runs `events` from `begin`, applying every step to `h`.
    fn run(h: &mut History, canary: Option<u8>, events: &[Event]) -> Promotion {
        let (mut p, fx) = Promotion::begin("m", Some("m-00001"), "m-00002", plan(canary));
        h.apply(&p, &fx);
        for e in events {
            let (next, fx) = p.on(e.clone()).expect("valid");
            h.apply(&next, &fx);
            p = next;
        }
        p
    }

    #[test]
    fn all_at_once_moves_every_request_when_ready() {
        let mut h = history();
        let (p, fx) = Promotion::begin("m", Some("m-00001"), "m-00002", plan(None));
        assert_eq!(
            fx,
            [
                Effect::State("m-00002".into(), RevisionState::Warming),
                Effect::Start("m-00002".into())
            ]
        );
        h.apply(&p, &fx);
        assert_eq!(
            h.split(),
            [("m-00001".to_string(), 100)],
            "old serves while warming"
        );
        let p = run(&mut h, None, &[Event::Ready]);
        assert_eq!(p.phase, Phase::Done);
        assert_eq!(h.split(), [("m-00002".to_string(), 100)]);
        assert_eq!(h.get("m-00001").expect("old").state, RevisionState::Retired);
        assert_eq!(h.previous_good().expect("rollback target").id, "m-00001");
        assert!(!h.promoting());
    }

    #[test]
    fn a_canary_bakes_then_takes_everything() {
        let mut h = history();
        let p = run(&mut h, Some(10), &[Event::Ready]);
        assert_eq!(p.phase, Phase::Canary);
        let mut split = h.split();
        split.sort();
        assert_eq!(
            split,
            [("m-00001".to_string(), 90), ("m-00002".to_string(), 10)]
        );
        assert!(h.promoting());
        let mut h = history();
        let p = run(&mut h, Some(10), &[Event::Ready, Event::BakeElapsed]);
        assert_eq!(p.phase, Phase::Done);
        assert_eq!(h.split(), [("m-00002".to_string(), 100)]);
    }

    #[test]
    fn an_unhealthy_canary_is_rolled_back_and_marked_failed() {
        let mut h = history();
        let p = run(
            &mut h,
            Some(50),
            &[Event::Ready, Event::Unhealthy("error rate 48% > 5%".into())],
        );
        assert!(matches!(p.phase, Phase::RolledBack { .. }));
        assert_eq!(h.split(), [("m-00001".to_string(), 100)]);
        match &h.get("m-00002").expect("new").state {
            RevisionState::Failed { reason } => assert!(reason.contains("48%"), "{reason}"),
            s => panic!("{s:?}"),
        }
        // A failed revision is never a rollback target.
        assert!(h.previous_good().is_none());
        // Nothing more happens to a finished promotion.
        assert!(p.on(Event::BakeElapsed).is_err());
    }

    #[test]
    fn a_revision_that_never_starts_leaves_the_old_one_serving() {
        let mut h = history();
        let p = run(&mut h, Some(10), &[Event::StartFailed("exit 1".into())]);
        assert!(matches!(p.phase, Phase::Failed { .. }));
        assert_eq!(h.split(), [("m-00001".to_string(), 100)]);
        assert_eq!(h.get("m-00001").expect("old").state, RevisionState::Serving);
    }

    #[test]
    fn an_app_at_zero_starts_the_new_revision_and_switches_when_it_is_ready() {
        let at_zero = Plan {
            at_zero: true,
            ..plan(None)
        };
        let (p, fx) = Promotion::begin("m", Some("m-00001"), "m-00002", at_zero.clone());
        assert_eq!(p.phase, Phase::Warming);
        assert!(fx.contains(&Effect::Start("m-00002".into())));
        assert!(!fx.iter().any(|e| matches!(e, Effect::Traffic(_))));
        // It fails to start: nothing moved, the old revision still serves.
        let mut h = history();
        let p = run(&mut h, None, &[Event::StartFailed("exit 1".into())]);
        assert!(matches!(p.phase, Phase::Failed { .. }));
        assert_eq!(h.split(), [("m-00001".to_string(), 100)]);
        // A switch (a start from the config) starts nothing.
        let (p, fx) = Promotion::switch("m", Some("m-00001"), "m-00002", at_zero);
        assert_eq!(p.phase, Phase::Done);
        assert!(!fx.iter().any(|e| matches!(e, Effect::Start(_))));
        assert!(fx.contains(&Effect::Traffic(vec![("m-00002".into(), 100)])));
    }

    #[test]
    fn the_first_revision_takes_everything() {
        let (p, fx) = Promotion::begin("m", None, "m-00001", plan(Some(10)));
        let (p, fx2) = p.on(Event::Ready).expect("ready");
        assert_eq!(p.phase, Phase::Done, "no canary without an old revision");
        assert!(fx.contains(&Effect::Start("m-00001".into())));
        assert!(fx2.contains(&Effect::Traffic(vec![("m-00001".into(), 100)])));
    }

    #[test]
    fn events_out_of_order_are_refused() {
        let (p, _) = Promotion::begin("m", Some("m-00001"), "m-00002", plan(Some(10)));
        assert!(p.on(Event::BakeElapsed).is_err(), "no bake before ready");
        let (p, _) = p.on(Event::Ready).expect("ready");
        assert!(p.on(Event::Ready).is_err());
        assert!(p.on(Event::StartFailed("late".into())).is_err());
    }

    #[test]
    fn the_history_round_trips_through_json() {
        let mut h = history();
        run(&mut h, Some(25), &[Event::Ready]);
        let text = serde_json::to_string(&h).expect("json");
        let back: History = serde_json::from_str(&text).expect("parse");
        assert_eq!(back, h);
    }

    mod props {
        use proptest::prelude::*;

        use super::*;

        fn event() -> impl Strategy<Value = Event> {
            prop_oneof![
                Just(Event::Ready),
                Just(Event::BakeElapsed),
                Just(Event::StartFailed("x".into())),
                Just(Event::Unhealthy("y".into())),
                Just(Event::Rollback("z".into())),
                Just(Event::InPlaceUnsupported("w".into())),
            ]
        }

        proptest! {
            /// Whatever happens, traffic adds up to 100 and never goes to a
            /// failed revision, and at most two revisions take traffic.
            #[test]
            fn traffic_always_adds_up(
                canary in prop_oneof![Just(None), (1_u8..=100).prop_map(Some)],
                swap in any::<bool>(),
                events in prop::collection::vec(event(), 0..8),
            ) {
                let mut h = history();
                let how = if swap { in_place(canary) } else { plan(canary) };
                let (mut p, fx) = Promotion::begin("m", Some("m-00001"), "m-00002", how);
                h.apply(&p, &fx);
                for e in events {
                    if let Ok((next, fx)) = p.on(e) {
                        h.apply(&next, &fx);
                        p = next;
                    }
                    let total: u32 = h.revisions.iter().map(|r| u32::from(r.traffic)).sum();
                    prop_assert_eq!(total, 100);
                    prop_assert!(h.split().len() <= 2);
                    for r in &h.revisions {
                        if matches!(r.state, RevisionState::Failed { .. }) {
                            prop_assert_eq!(r.traffic, 0);
                        }
                    }
                }
            }
        }
    }
}
