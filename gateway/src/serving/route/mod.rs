//! Which replica a request goes to: a pure choice, no I/O and no clock.
//!
//! Given the replicas that can take it now (each with its load), the
//! request's key ([`key::RouteKey`]) and what the app's [`index`] knows of
//! where prompts went, [`choose`] returns one:
//!
//! 1. The load bound: with `c` the app's `routing.load_bound`, the cap is
//!    `ceil(c × (total load + 1) / replicas)` (consistent hashing with
//!    bounded loads); a replica that was sent the prompt before may also
//!    go up to `routing.load_slack` requests above the least loaded one
//!    (at low load the relative cap alone would move a prompt off its
//!    cache as soon as one other request ran there). The least loaded
//!    replica is always under the cap.
//! 2. Among the replicas under that bound, the one that was sent the
//!    longest leading part of the prompt wins (its KV cache most likely
//!    still holds it); ties go to the less loaded.
//! 3. A prompt no such replica has seen goes to its *home*: the replica
//!    under the strict cap of highest rendezvous weight for the prompt's
//!    first chunks. Every gateway computes the same weights from the same
//!    replica ids, so gateways that share no index still send a new prefix
//!    to the same replica, and each one's index then agrees with the
//!    others'. When the home is over the bound, the next in rendezvous
//!    order takes it, so a hot prefix spreads over a few replicas, always
//!    the same few.
//!
//! 4. A replica at its concurrency limit takes nothing now, but it may
//!    hold the prompt: the request then waits for its next free slot when
//!    that wait is shorter than the prefill it saves over the best replica
//!    free now (see [`cost`]), within the same bound (the requests already
//!    waiting for it count as its load). A hard limit thus does not send a
//!    conversation cold to another replica whenever its own is full.
//!
//! A new replica earns traffic as homes and as the overflow of loaded
//! ones; one that leaves is [`index::PrefixIndex::forget`]-ten.

pub mod cost;
pub mod index;
pub mod key;

pub use cost::{Costs, Learned};
pub use index::{PrefixIndex, ReplicaKey};
pub use key::RouteKey;

/// A replica in rotation.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Candidate {
    /// Who it is.
    pub replica: ReplicaKey,
    /// Its load: requests in flight to it from this gateway, or what its
    /// engine last said it holds (running and waiting), when that reading
    /// is fresh and larger (other gateways send to it too), and the
    /// requests held waiting for it.
    pub load: u32,
    /// Its KV cache's fill in thousandths, when its engine says (0
    /// otherwise): of two replicas alike in all else, the emptier wins.
    pub cache_permille: u16,
    /// It has a free slot now.
    pub free: bool,
    /// Requests held waiting for its next free slot (part of `load`).
    pub waiting: u32,
    /// Its concurrency limit (this gateway's share).
    pub limit: u32,
}

/// Why a replica was chosen (for metrics and tests).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    /// It was sent the longest part of this prompt (or this session).
    Affinity,
    /// Nobody eligible had seen the prompt: its home, or the next one in
    /// rendezvous order under the bound.
    Home,
    /// It holds the prompt and is full: the request waits for its next
    /// free slot.
    Wait,
}

impl Reason {
    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::Affinity => "affinity",
            Reason::Home => "home",
            Reason::Wait => "wait",
        }
    }
}

/// The choice: the candidate's position, how many chunks it matched, why.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Choice {
    /// Index into the candidates.
    pub index: usize,
    /// Chunks of the key it was sent before.
    pub matched: u32,
    /// Why.
    pub reason: Reason,
}

/// The load bound of one decision (see the module's text).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Bound {
    /// `routing.load_bound`: no replica above this × the mean.
    pub factor: f64,
    /// `routing.load_slack`: a replica that holds the prompt may carry
    /// this many requests more than the least loaded one, whatever the
    /// mean.
    pub slack: u32,
}

/// The most load a replica may have to take a request it has never seen,
/// exclusive: the bound over the mean after this request, rounded up.
pub fn load_cap(candidates: &[Candidate], factor: f64) -> f64 {
    let total: u64 = candidates.iter().map(|c| u64::from(c.load)).sum();
    let n = candidates.len().max(1) as f64;
    (factor * (total as f64 + 1.0) / n).ceil()
}

/// The most load a replica may have to take a request by affinity,
/// exclusive: [`load_cap`], or the least loaded replica's load plus the
/// slack, whichever is larger. At low load the relative bound alone would
/// move a prompt off its cache as soon as one other request ran there.
pub fn affinity_cap(candidates: &[Candidate], bound: Bound) -> f64 {
    let least = candidates.iter().map(|c| c.load).min().unwrap_or(0);
    load_cap(candidates, bound.factor).max(f64::from(least) + f64::from(bound.slack) + 1.0)
}

/// The rendezvous weight of `replica` for `home`: the highest wins.
pub fn weight(home: u64, replica: ReplicaKey) -> u64 {
    let mut buf = [0u8; 16];
    buf[..8].copy_from_slice(&home.to_le_bytes());
    buf[8..].copy_from_slice(&replica.0.to_le_bytes());
    rapidhash::v3::rapidhash_v3(&buf)
}

/// Chooses among `candidates` for `key` (see the module's text); `None`
/// when no candidate is free and none is worth waiting for (the request
/// then waits for any slot). A choice of a full candidate (reason
/// [`Reason::Wait`]) means: wait for it. `scratch` is reused for the
/// matches.
pub fn choose(
    candidates: &[Candidate],
    key: &RouteKey,
    index: &PrefixIndex,
    bound: Bound,
    costs: Costs,
    scratch: &mut Vec<u32>,
) -> Option<Choice> {
    if candidates.is_empty() {
        return None;
    }
    let keys: Vec<ReplicaKey> = candidates.iter().map(|c| c.replica).collect();
    scratch.clear();
    scratch.resize(candidates.len(), 0);
    index.matches(&key.chunks, &keys, scratch);
    // Affinity: the longest match within the affinity cap, then the least
    // loaded, then the emptier cache, then home; among the free replicas,
    // and among the full ones.
    let sticky = affinity_cap(candidates, bound);
    let best = |free: bool| {
        candidates
            .iter()
            .enumerate()
            .filter(|(i, c)| c.free == free && scratch[*i] > 0 && f64::from(c.load) < sticky)
            .max_by_key(|(i, c)| {
                (
                    scratch[*i],
                    std::cmp::Reverse(c.load),
                    std::cmp::Reverse(c.cache_permille),
                    weight(key.home, c.replica),
                )
            })
            .map(|(i, _)| i)
    };
    let free_best = best(true);
    let any_free = candidates.iter().any(|c| c.free);
    if let Some(h) = best(false) {
        let here = free_best.map_or(0, |i| scratch[i]);
        let held = &candidates[h];
        if costs.worth_waiting(
            scratch[h].saturating_sub(here),
            held.waiting,
            held.limit,
            any_free,
        ) {
            return Some(Choice {
                index: h,
                matched: scratch[h],
                reason: Reason::Wait,
            });
        }
    }
    if let Some(i) = free_best {
        return Some(Choice {
            index: i,
            matched: scratch[i],
            reason: Reason::Affinity,
        });
    }
    // Home: the highest rendezvous weight under the strict bound, among
    // the free. The least loaded free one is the guard should the bound
    // pass over them all.
    let cap = load_cap(candidates, bound.factor);
    let free = || candidates.iter().enumerate().filter(|(_, c)| c.free);
    let index = free()
        .filter(|(_, c)| f64::from(c.load) < cap)
        .max_by_key(|(_, c)| weight(key.home, c.replica))
        .or_else(|| free().min_by_key(|(_, c)| c.load))
        .map(|(i, _)| i)?;
    Some(Choice {
        index,
        matched: 0,
        reason: Reason::Home,
    })
}

#[cfg(test)]
mod tests;
