//! Gateway replicas serving together (the operator's replicas): the
//! leader runs the pods, the autoscaler and the promotions; every other
//! replica, a follower, serves the apps' traffic on the leader's pods.
//!
//! Once a second each follower posts a [`Report`] of the demand it saw to
//! the leader's [`PEERS_PATH`] and gets a [`Table`] back: the apps, their
//! live revisions and split, the ready replicas of each, and its place
//! among the gateways serving. The leader counts every follower's demand
//! in its autoscaler, and every gateway, the leader included, allows only
//! its part of each replica's `concurrency` in flight
//! ([`warmgate_pool::replica::part_of`]), so the limit holds in total.
//!
//! This module holds what they tell each other and what each keeps of
//! the others; what the gateway does with it is in `peering.rs`.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use warmgate_deploy::AppSpec;
use warmgate_deploy::revision::Revision;
use warmgate_pool::peer::{PeerBackend, Routes};

/// Where the leader takes reports.
pub const PEERS_PATH: &str = "/v1/internal/peers";
/// A follower not heard from for this long no longer counts as serving.
/// (Longer than a report's own timeout, so a slow answer does not drop
/// a follower that is still serving.)
pub const PEER_TTL: Duration = Duration::from_secs(5);
/// The most followers the leader counts: past it, a report is refused.
pub const MAX_PEERS: usize = 64;
/// The largest report the leader reads.
pub const MAX_REPORT_BYTES: usize = 1 << 20;

/// What a gateway saw of one revision over about a second.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct PeerReading {
    /// Requests in flight, averaged over the interval.
    pub concurrency: f64,
    /// Replica-seconds spent on requests.
    pub busy: f64,
    /// Requests that arrived.
    pub arrivals: u32,
    /// Requests answered.
    pub completions: u32,
    /// Requests held, waiting for a slot, at the end.
    pub queued: u32,
    /// Answers, for a canary's health.
    #[serde(default)]
    pub answered: u32,
    /// Of which failed (a gateway error or a 5xx from the worker).
    #[serde(default)]
    pub failed: u32,
}

impl PeerReading {
    /// The reading with every figure finite and not negative: a report
    /// cannot cancel another gateway's demand.
    pub(crate) fn sane(self) -> PeerReading {
        let ok = |v: f64| if v.is_finite() { v.max(0.0) } else { 0.0 };
        PeerReading {
            concurrency: ok(self.concurrency),
            busy: ok(self.busy),
            ..self
        }
    }

    /// Two readings of the same revision as one: counts add, levels keep
    /// the latest.
    pub(crate) fn then(self, later: PeerReading) -> PeerReading {
        PeerReading {
            concurrency: later.concurrency,
            busy: self.busy + later.busy,
            arrivals: self.arrivals.saturating_add(later.arrivals),
            completions: self.completions.saturating_add(later.completions),
            queued: later.queued,
            answered: self.answered.saturating_add(later.answered),
            failed: self.failed.saturating_add(later.failed),
        }
    }
}

/// A follower's report.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Report {
    /// Its name (the pod's).
    pub member: String,
    /// What it saw, by revision id.
    pub load: BTreeMap<String, PeerReading>,
    /// Its requests in flight, by replica address: the leader drains a
    /// replica only once they are done.
    #[serde(default)]
    pub inflight: BTreeMap<warmgate_pool::Endpoint, u32>,
    /// The [`Table::epoch`] it serves by (0: none yet).
    #[serde(default)]
    pub applied: u64,
}

/// The leader's answer.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Table {
    /// Which of the leader's tables this is, from 1.
    #[serde(default)]
    pub epoch: u64,
    /// The follower's place among the gateways serving (the leader is 0).
    pub index: u32,
    /// How many gateways serve.
    pub count: u32,
    /// The apps served on their own replicas.
    pub apps: Vec<AppEntry>,
}

/// One app in a [`Table`].
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct AppEntry {
    /// Its spec.
    pub spec: AppSpec,
    /// Its live revisions.
    pub revisions: Vec<Revision>,
    /// Traffic by revision id, in percent.
    pub split: Vec<(String, u8)>,
    /// The ready replicas of each live revision.
    pub routes: Routes,
}

/// Requests in flight by replica address.
pub type InFlight = BTreeMap<warmgate_pool::Endpoint, u32>;

/// The gateways serving together, as this one knows them.
pub struct Peers {
    /// `WARMGATE_PEER_TOKEN`: what followers and the leader show each
    /// other (`None`: this gateway serves alone).
    pub(crate) token: std::sync::OnceLock<String>,
    /// Leader: the followers heard from, and when.
    pub(crate) members: parking_lot::Mutex<BTreeMap<String, Instant>>,
    /// Follower: the leader's replicas.
    pub(crate) follower: std::sync::OnceLock<Arc<PeerBackend>>,
    /// Follower: demand seen since the last report, by revision.
    pub(crate) outbox: parking_lot::Mutex<BTreeMap<String, PeerReading>>,
    /// Follower: when the leader last answered.
    pub(crate) last_table: parking_lot::Mutex<Option<Instant>>,
    /// Follower: each revision's (answered, failed) as last reported.
    pub(crate) reported_health: parking_lot::Mutex<BTreeMap<String, (u64, u64)>>,
    /// Leader: each follower's requests in flight by replica, when it
    /// reported them, and when the table it served by was made.
    pub(crate) elsewhere: parking_lot::Mutex<BTreeMap<String, Counted>>,
    /// Leader: the tables made lately, by epoch, and when.
    pub(crate) issued: parking_lot::Mutex<BTreeMap<u64, Instant>>,
    /// Leader: the last epoch made.
    pub(crate) epoch: std::sync::atomic::AtomicU64,
    /// Follower: the epoch of the table it serves by.
    pub(crate) applied: std::sync::atomic::AtomicU64,
}

/// A follower's requests in flight, as the leader keeps them.
pub(crate) struct Counted {
    /// When the report came.
    pub(crate) at: Instant,
    /// When the table the follower served by was made (`None`: one too
    /// old to know, or none).
    pub(crate) knew: Option<Instant>,
    pub(crate) inflight: InFlight,
}

/// Tables whose time the leader keeps, for the drains.
pub const TABLES_KEPT: usize = 256;

impl Default for Peers {
    fn default() -> Self {
        Peers {
            token: std::env::var("WARMGATE_PEER_TOKEN")
                .ok()
                .filter(|t| !t.is_empty())
                .map(std::sync::OnceLock::from)
                .unwrap_or_default(),
            members: parking_lot::Mutex::default(),
            follower: std::sync::OnceLock::new(),
            outbox: parking_lot::Mutex::default(),
            last_table: parking_lot::Mutex::default(),
            reported_health: parking_lot::Mutex::default(),
            elsewhere: parking_lot::Mutex::default(),
            issued: parking_lot::Mutex::default(),
            epoch: std::sync::atomic::AtomicU64::new(0),
            applied: std::sync::atomic::AtomicU64::new(0),
        }
    }
}

impl Peers {
    /// The token peers show each other, if any.
    pub fn token(&self) -> Option<&str> {
        self.token.get().map(String::as_str)
    }

    /// The leader's replica list, on a follower.
    pub fn follower(&self) -> Option<&Arc<PeerBackend>> {
        self.follower.get()
    }

    /// Counts what a follower saw of a revision this tick; `health` is
    /// the revision's (answered, failed) so far.
    pub(crate) fn note(&self, revision: &str, mut reading: PeerReading, health: (u64, u64)) {
        let before = self
            .reported_health
            .lock()
            .insert(revision.to_string(), health)
            .unwrap_or((0, 0));
        reading.answered = u32::try_from(health.0.saturating_sub(before.0)).unwrap_or(u32::MAX);
        reading.failed = u32::try_from(health.1.saturating_sub(before.1)).unwrap_or(u32::MAX);
        let mut out = self.outbox.lock();
        let r = out.entry(revision.to_string()).or_default();
        *r = r.then(reading);
    }

    /// The followers heard from within [`PEER_TTL`] of `now`, by name.
    pub(crate) fn fresh(&self, now: Instant) -> Vec<String> {
        let mut m = self.members.lock();
        m.retain(|_, at| now.saturating_duration_since(*at) < PEER_TTL);
        m.keys().cloned().collect()
    }

    /// Whether the leader answered within `within`.
    pub fn leader_heard_within(&self, within: Duration) -> bool {
        self.last_table.lock().is_some_and(|t| t.elapsed() < within)
    }
}

/// A follower's place and the count, the leader being 0: the followers
/// in name order after it.
pub fn place(fresh: &[String], member: &str) -> (u32, u32) {
    let count = u32::try_from(fresh.len() + 1).unwrap_or(u32::MAX);
    let index = fresh
        .iter()
        .position(|m| m == member)
        .map_or(count, |i| u32::try_from(i + 1).unwrap_or(u32::MAX));
    (index, count)
}
