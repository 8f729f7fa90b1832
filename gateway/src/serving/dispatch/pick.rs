//! Which replica a request gets: routed on its key (prefix or session
//! affinity, perhaps waiting for the full replica that holds it) or its
//! adapter, or the less loaded of two random replicas.

use std::sync::Arc;
use std::time::Instant;

use warmgate_deploy::{AppSpec, RoutingPolicy};
use warmgate_pool::ReplicaHandle;

use super::Slots;
use crate::serving::adapters::{Candidate as AdapterCandidate, Ticket};
use crate::serving::route::{self, Candidate, Reason, ReplicaKey, RouteKey};

/// Where a request goes.
pub(super) enum Routed {
    /// A slot on this replica, what to do there first for its adapter,
    /// and how many chunks of its prompt the replica is expected to miss
    /// (for a request routed on its prompt).
    Go(Arc<ReplicaHandle>, Option<Ticket>, Option<u32>),
    /// Wait for this full replica's next free slot: it holds the prompt.
    Wait(ReplicaKey),
    /// Wait for any slot.
    Hold,
}

impl Slots {
    /// Where a request with `key` goes (see [`crate::serving::route`]):
    /// a free replica, or a full one that holds its prompt, to wait for.
    /// Without a key, or under `least_loaded`, the less loaded of two
    /// random replicas with a free slot. The requests already waiting for
    /// a replica are read from `held_for`.
    pub(super) fn route(&mut self, key: Option<&RouteKey>, spec: &AppSpec) -> Routed {
        let (routing, max_age) = (&spec.routing, spec.engine.max_age);
        let key = match (key, routing.policy) {
            (Some(k), RoutingPolicy::Prefix | RoutingPolicy::Session) => k,
            _ => return pick(&self.replicas).map_or(Routed::Hold, |r| Routed::Go(r, None, None)),
        };
        let ready: Vec<&Arc<ReplicaHandle>> =
            self.replicas.iter().filter(|r| r.is_routable()).collect();
        let now = Instant::now();
        let candidates: Vec<Candidate> = ready
            .iter()
            .map(|r| {
                let engine = r.engine().filter(|e| e.fresh(now, max_age).is_some());
                let replica = ReplicaKey::of(&r.id);
                let waiting = self.held_for.get(&replica).copied().unwrap_or(0);
                Candidate {
                    replica,
                    // What this gateway has in flight and holds for it,
                    // plus what the engine held for others when it was
                    // last read.
                    load: r
                        .inflight()
                        .saturating_add(waiting)
                        .saturating_add(engine.map_or(0, |e| e.others())),
                    cache_permille: engine
                        .and_then(|e| e.load.kv_cache_usage)
                        .map_or(0, |k| (k * 1000.0) as u16),
                    free: r.has_free_slot(),
                    waiting,
                    limit: r.limit(),
                }
            })
            .collect();
        let Some(choice) = route::choose(
            &candidates,
            key,
            &self.index,
            route::Bound {
                factor: routing.load_bound,
                slack: routing.load_slack,
            },
            self.learned.costs(),
            &mut self.scratch,
        ) else {
            return Routed::Hold;
        };
        let replica = candidates[choice.index].replica;
        if choice.reason == Reason::Wait {
            return Routed::Wait(replica);
        }
        self.index.set_bound(routing.index_bytes);
        self.index.record(&key.chunks, replica);
        metrics::counter!("warmgate_route_decisions_total", "reason" => choice.reason.as_str())
            .increment(1);
        let uncached = (key.chunks.len() as u32).saturating_sub(choice.matched);
        Routed::Go(ready[choice.index].clone(), None, Some(uncached))
    }

    /// The replica a request for `adapter` goes to, and what it must do
    /// there first (see [`crate::serving::adapters`]); `None` when it must
    /// wait.
    pub(super) fn route_adapter(
        &mut self,
        adapter: &Arc<str>,
        tenant: Option<&Arc<str>>,
        spec: &AppSpec,
        avoid: &[Arc<ReplicaHandle>],
    ) -> Option<(Arc<ReplicaHandle>, Option<Ticket>)> {
        let free: Vec<&Arc<ReplicaHandle>> = self
            .replicas
            .iter()
            .filter(|r| r.has_free_slot() && r.is_routable())
            .filter(|r| !avoid.iter().any(|a| Arc::ptr_eq(a, r)))
            .collect();
        let candidates: Vec<AdapterCandidate<'_>> = free
            .iter()
            .map(|r| AdapterCandidate {
                replica: &r.id,
                load: r.inflight(),
            })
            .collect();
        let share = self.adapters.fair_share(
            tenant.map(|t| &**t),
            candidates.len(),
            spec.adapters.max_loaded,
        );
        let (i, reason) = self.adapters.choose_for(
            adapter,
            tenant.map(|t| &**t),
            share,
            &candidates,
            spec.adapters.max_loaded,
            crate::serving::adapters::Bound {
                factor: spec.routing.load_bound,
                slack: spec.routing.load_slack,
            },
        )?;
        let replica = free[i].clone();
        let ticket = self
            .adapters
            .reserve_for(&replica.id, adapter, tenant, share, reason);
        metrics::counter!("warmgate_adapter_route_decisions_total", "reason" => reason.as_str())
            .increment(1);
        Some((replica, Some(ticket)))
    }
}

/// The least loaded ready replica with a free slot that is not in
/// `avoid`; `None` when `avoid` is empty (then [`pick`] chooses).
pub(super) fn pick_avoiding(
    replicas: &[Arc<ReplicaHandle>],
    avoid: &[Arc<ReplicaHandle>],
) -> Option<Arc<ReplicaHandle>> {
    if avoid.is_empty() {
        return None;
    }
    replicas
        .iter()
        .filter(|r| r.has_free_slot() && r.is_routable())
        .filter(|r| !avoid.iter().any(|a| Arc::ptr_eq(a, r)))
        .min_by_key(|r| r.inflight())
        .cloned()
}

/// Least loaded of two random ready replicas with a free slot; falls back to
/// a scan so a free slot is never missed.
fn pick(replicas: &[Arc<ReplicaHandle>]) -> Option<Arc<ReplicaHandle>> {
    match replicas.len() {
        0 => None,
        1 => replicas
            .first()
            .filter(|r| r.has_free_slot() && r.is_routable())
            .cloned(),
        n => {
            let a = fastrand::usize(..n);
            let mut b = fastrand::usize(..n - 1);
            if b >= a {
                b += 1;
            }
            let (ra, rb) = (&replicas[a], &replicas[b]);
            let free = |r: &Arc<ReplicaHandle>| r.has_free_slot() && r.is_routable();
            let best = match (free(ra), free(rb)) {
                (true, true) => Some(if rb.inflight() < ra.inflight() {
                    rb
                } else {
                    ra
                }),
                (true, false) => Some(ra),
                (false, true) => Some(rb),
                (false, false) => None,
            };
            best.or_else(|| {
                replicas
                    .iter()
                    .filter(|r| free(r))
                    .min_by_key(|r| r.inflight())
            })
            .cloned()
        }
    }
}
