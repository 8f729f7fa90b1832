//! What the gateway does with its peers ([`crate::peers`]): the
//! leader's answer to a follower's report (their demand into its
//! autoscaler, their requests in flight into its drains, the concurrency
//! split), and the follower's side (its report, and serving what the
//! leader's table says).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use warmgate_deploy::revision::{History, Revision};
use warmgate_pool::peer::{PeerBackend, Route, Routes};

use crate::peers::{AppEntry, Counted, MAX_PEERS, PEER_TTL, Report, TABLES_KEPT, Table, place};
use crate::server::Gateway;
use crate::serving::served::Served;

impl Gateway {
    /// Serves with peers that show `token` (unless `WARMGATE_PEER_TOKEN`
    /// set one already). The operator's replicas use their admin token.
    pub fn set_peer_token(&self, token: String) {
        if !token.is_empty() {
            let _ = self.peers.token.set(token);
        }
    }

    /// Makes this gateway a follower serving the replicas `peer` lists.
    /// Once only.
    pub fn set_follower(&self, peer: Arc<PeerBackend>) {
        let _ = self.peers.follower.set(peer);
    }

    /// This gateway's place among those serving and their count (0 of 1
    /// when it serves alone).
    pub fn serving_share(&self) -> (u32, u32) {
        self.pool.share().get()
    }

    /// The follower's report: what it saw since the last one.
    pub fn peer_report(&self, member: &str) -> Report {
        let mut inflight = BTreeMap::new();
        for h in self.pool.shared_handles() {
            let n = h.inflight();
            if n > 0 {
                *inflight.entry(h.addr.clone()).or_insert(0u32) += n;
            }
        }
        Report {
            member: member.to_string(),
            load: std::mem::take(&mut *self.peers.outbox.lock()),
            inflight,
            applied: self.peers.applied.load(Ordering::Acquire),
        }
    }

    /// Leader: tells each replica's handle what the fresh followers have
    /// on it, and what they knew: the oldest table any of them served by
    /// (one served by a table too old to know counts as knowing nothing,
    /// so a drain waits for its next report).
    fn count_elsewhere(&self, now: Instant) {
        let (as_of, totals) = {
            let mut e = self.peers.elsewhere.lock();
            e.retain(|_, c| now.saturating_duration_since(c.at) < PEER_TTL);
            let as_of = if e.is_empty() {
                None
            } else if e.values().any(|c| c.knew.is_none()) {
                Some(self.host.started)
            } else {
                e.values().filter_map(|c| c.knew).min()
            };
            let mut totals: BTreeMap<warmgate_pool::Endpoint, u32> = BTreeMap::new();
            for c in e.values() {
                for (addr, n) in &c.inflight {
                    let t = totals.entry(addr.clone()).or_insert(0);
                    *t = t.saturating_add(*n);
                }
            }
            (as_of, totals)
        };
        for h in self.pool.shared_handles() {
            h.set_elsewhere(totals.get(&h.addr).copied().unwrap_or(0), as_of);
        }
    }

    /// Leader: counts a follower's report and answers with the table;
    /// `None` when [`MAX_PEERS`] others are serving already.
    pub fn answer_peer(&self, report: &Report) -> Option<Table> {
        let now = Instant::now();
        {
            let mut m = self.peers.members.lock();
            m.retain(|_, at| now.saturating_duration_since(*at) < PEER_TTL);
            if !m.contains_key(&report.member) && m.len() >= MAX_PEERS {
                return None;
            }
            m.insert(report.member.clone(), now);
        }
        let knew = self.peers.issued.lock().get(&report.applied).copied();
        self.peers.elsewhere.lock().insert(
            report.member.clone(),
            Counted {
                at: now,
                knew,
                inflight: report.inflight.clone(),
            },
        );
        self.count_elsewhere(now);
        let registry = self.registry.load_full();
        let t = self.now();
        for served in registry.apps() {
            for app in served.live() {
                if app.is_guest() {
                    continue;
                }
                if let Some(r) = report.load.get(&app.revision) {
                    app.add_remote(&report.member, r, t, |n| {
                        self.pool.scale(&app.target, n);
                    });
                    app.add_answers(r.answered, r.failed);
                }
            }
        }
        let fresh = self.peers.fresh(now);
        let (index, count) = place(&fresh, &report.member);
        self.pool.share().set(0, count);
        // Before the replicas are read: a replica out of rotation by now
        // is not in the table.
        let made = Instant::now();
        let apps = registry
            .apps()
            .iter()
            .filter(|s| s.spec().pool.is_none())
            .map(|served| {
                let live = served.live();
                let history = served.history.lock();
                let revisions: Vec<Revision> = history
                    .revisions
                    .iter()
                    .filter(|r| live.iter().any(|a| a.revision == r.id))
                    .cloned()
                    .collect();
                drop(history);
                let routes: Routes = live
                    .iter()
                    .map(|a| {
                        let ready = a
                            .replicas()
                            .into_iter()
                            .filter(|h| h.is_routable())
                            .map(|h| Route {
                                replica: h.id.clone(),
                                addr: h.addr.clone(),
                            })
                            .collect();
                        (a.revision.clone(), ready)
                    })
                    .collect();
                AppEntry {
                    spec: (*served.spec()).clone(),
                    revisions,
                    split: served.shares(),
                    routes,
                }
            })
            .collect();
        // Made now: a replica drained before now is not in it.
        let epoch = self.peers.epoch.fetch_add(1, Ordering::AcqRel) + 1;
        {
            let mut issued = self.peers.issued.lock();
            issued.insert(epoch, made);
            while issued.len() > TABLES_KEPT {
                issued.pop_first();
            }
        }
        Some(Table {
            epoch,
            index,
            count,
            apps,
        })
    }

    /// Leader: forgets the followers not heard from lately, so its own
    /// part of each replica grows back when they go.
    pub(crate) fn expire_peers(&self) {
        // A follower counts nothing; without a token nobody reports.
        if self.peers.follower().is_some() || self.peers.token().is_none() {
            return;
        }
        let now = Instant::now();
        let fresh = self.peers.fresh(now);
        self.pool
            .share()
            .set(0, u32::try_from(fresh.len() + 1).unwrap_or(u32::MAX));
        self.count_elsewhere(now);
    }

    /// Follower: serves what the leader's table says: its apps, their
    /// live revisions and split, on the leader's ready replicas, with this
    /// gateway's part of each replica's concurrency.
    pub async fn follow(self: &Arc<Self>, table: Table) {
        let Some(peer) = self.peers.follower().cloned() else {
            return;
        };
        *self.peers.last_table.lock() = Some(Instant::now());
        self.pool.share().set(table.index, table.count);
        let mut routes = Routes::new();
        for a in &table.apps {
            routes.extend(a.routes.clone());
        }
        peer.update(routes);
        let _changing = self.changes.lock.one_at_a_time().await;
        let registry = self.registry.load_full();
        // Apps gone from the table: out. Their replicas are let go as the
        // leader stops listing them; nothing here is stopped.
        for served in registry.apps() {
            if !table.apps.iter().any(|e| e.spec.name == served.name) {
                self.registry.rcu(|r| Arc::new(r.without_app(&served.name)));
                served.mark_removed();
                for app in served.live() {
                    served.remove_live(&app.revision);
                    self.pool.scale(&app.target, 0);
                }
            }
        }
        for entry in table.apps {
            let served = match self.registry.load().app(&entry.spec.name).cloned() {
                // A changed spec (a new checkpoint, new queue settings)
                // is taken in place; the revisions below are the leader's.
                Some(s) if s.name == entry.spec.name => {
                    if *s.spec() != entry.spec {
                        s.set_spec(entry.spec.clone());
                    }
                    s
                }
                _ => {
                    let s = Arc::new(Served::new(entry.spec.clone(), History::default()));
                    self.registry.rcu(|r| Arc::new(r.with_app(s.clone())));
                    s
                }
            };
            for rev in &entry.revisions {
                if served.revision(&rev.id).is_none()
                    && let Err(e) = self.promotions.materialize(&served, rev)
                {
                    tracing::warn!(app = %served.name, revision = %rev.id, error = %e.message, "cannot serve a revision the leader serves");
                }
            }
            for app in served.live() {
                if !entry.revisions.iter().any(|r| r.id == app.revision) {
                    served.remove_live(&app.revision);
                    self.pool.scale(&app.target, 0);
                }
            }
            served.set_split(&entry.split);
        }
        // Served by this table from now on: the leader may count this
        // gateway's requests on a replica it left out as the last ones.
        self.peers.applied.store(table.epoch, Ordering::Release);
    }
}
