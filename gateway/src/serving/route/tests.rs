//! The choice on its own: the bound holds for every input, affinity wins
//! within it, homes agree between gateways that share nothing, and a hot
//! prefix spreads over a few replicas instead of piling onto one.

use proptest::prelude::*;

use super::*;

fn cands(loads: &[u32]) -> Vec<Candidate> {
    loads
        .iter()
        .enumerate()
        .map(|(i, l)| Candidate {
            replica: ReplicaKey::of(&format!("llm-{i}")),
            load: *l,
            cache_permille: 0,
            free: true,
            waiting: 0,
            limit: 1000,
        })
        .collect()
}

fn key(text: &str) -> RouteKey {
    RouteKey::prompt([text.as_bytes()])
}

const BOUND: Bound = Bound {
    factor: 1.25,
    slack: 2,
};

fn pick(cs: &[Candidate], k: &RouteKey, ix: &PrefixIndex) -> Choice {
    choose(cs, k, ix, BOUND, Costs::default(), &mut Vec::new()).expect("a candidate")
}

#[test]
fn the_replica_that_was_sent_the_prompt_gets_it_again() {
    let cs = cands(&[0, 0, 0, 0]);
    let mut ix = PrefixIndex::new(1 << 20);
    let k = key(&"shared system prompt ".repeat(100));
    let first = pick(&cs, &k, &ix);
    assert_eq!(first.reason, Reason::Home);
    ix.record(&k.chunks, cs[first.index].replica);
    let again = pick(&cs, &k, &ix);
    assert_eq!(again.index, first.index);
    assert_eq!(again.reason, Reason::Affinity);
    assert_eq!(again.matched as usize, k.chunks.len());
}

#[test]
fn a_loaded_replica_past_the_bound_is_passed_over_for_the_next_home() {
    let mut ix = PrefixIndex::new(1 << 20);
    let k = key(&"hot prefix ".repeat(100));
    let home = pick(&cands(&[0, 0, 0, 0]), &k, &ix).index;
    let mut loads = [0u32; 4];
    ix.record(&k.chunks, cands(&loads)[home].replica);
    // The home is past both bounds: the mean's (5 + 1) / 4 × 1.25 → cap 2,
    // and the least loaded's 0 + slack 2.
    loads[home] = 5;
    let cs = cands(&loads);
    let next = pick(&cs, &k, &ix);
    assert_ne!(next.index, home);
    assert_eq!(next.reason, Reason::Home);
    // Its second home is the same on every call (and every gateway).
    assert_eq!(pick(&cs, &k, &ix).index, next.index);
}

#[test]
fn two_gateways_that_share_nothing_send_a_new_prompt_to_the_same_replica() {
    let cs = cands(&[1, 0, 2, 1]);
    let (a, b) = (PrefixIndex::new(1 << 20), PrefixIndex::new(1 << 20));
    for i in 0..50 {
        let k = key(&format!(
            "conversation {i} opens with its own words, long enough to fill a chunk or more of text"
        ));
        assert_eq!(pick(&cs, &k, &a).index, pick(&cs, &k, &b).index);
    }
}

#[test]
fn homes_spread_prompts_evenly_over_replicas() {
    let cs = cands(&[0, 0, 0, 0]);
    let ix = PrefixIndex::new(1 << 20);
    let mut counts = [0u32; 4];
    for i in 0..4000 {
        counts[pick(&cs, &key(&format!("prompt number {i}")), &ix).index] += 1;
    }
    for c in counts {
        assert!((800..1200).contains(&c), "{counts:?}");
    }
}

/// Virtual time: requests of one hot prefix (half the traffic) and of 63
/// others arrive while earlier ones hold their replica for a while; the
/// hot prefix ends up on a few replicas, no replica ever passes the bound,
/// and most requests of every prefix find it where they go.
#[test]
fn a_hot_prefix_spreads_under_the_bound_and_keeps_its_caches() {
    let replicas = 4usize;
    let mut ix = PrefixIndex::new(8 << 20);
    let mut loads = vec![0u32; replicas];
    let mut ends: Vec<(u32, usize)> = Vec::new(); // (time it ends, replica)
    let mut rng = fastrand::Rng::with_seed(7);
    let mut hot_on = std::collections::BTreeSet::new();
    let (mut hits, mut total) = (0u32, 0u32);
    let groups: Vec<RouteKey> = (0..64)
        .map(|g| key(&format!("system prompt of group {g}: ").repeat(60)))
        .collect();
    for t in 0..20_000u32 {
        ends.retain(|(end, r)| {
            if *end <= t {
                loads[*r] -= 1;
                false
            } else {
                true
            }
        });
        let g = if rng.bool() { 0 } else { rng.usize(1..64) };
        let cs = cands(&loads);
        let cap = affinity_cap(&cs, BOUND);
        let c = pick(&cs, &groups[g], &ix);
        assert!(
            f64::from(cs[c.index].load) < cap,
            "load {} at cap {cap}",
            cs[c.index].load
        );
        total += 1;
        hits += u32::from(c.reason == Reason::Affinity);
        ix.record(&groups[g].chunks, cs[c.index].replica);
        if g == 0 {
            hot_on.insert(c.index);
        }
        loads[c.index] += 1;
        ends.push((t + 6, c.index));
    }
    assert!(hot_on.len() >= 2, "the hot prefix stayed on {hot_on:?}");
    let ratio = f64::from(hits) / f64::from(total);
    assert!(ratio > 0.9, "affinity for {ratio:.2} of requests");
}

proptest! {
    /// Whatever the loads, keys, history, free slots and learned costs: an
    /// affinity choice is a free replica under the affinity cap that
    /// matched no less than any other free one under it; a wait is for a
    /// full replica under the cap that matched more than any free one, and
    /// only with costs known; a home choice is free and under the strict
    /// cap, which the least loaded replica always is; and there is no
    /// choice only when nothing is free.
    #[test]
    fn the_choice_is_never_above_the_bound(
        loads in proptest::collection::vec((0u32..50, any::<bool>(), 0u32..4), 1..12),
        seen in proptest::collection::vec((0usize..12, 0usize..8), 0..20),
        prompt in 0u32..20,
        factor in 1.0f64..3.0,
        slack in 0u32..8,
        known in any::<bool>(),
    ) {
        let mut cs = cands(&loads.iter().map(|l| l.0).collect::<Vec<_>>());
        for (c, (load, free, waiting)) in cs.iter_mut().zip(&loads) {
            c.free = *free;
            c.waiting = if *free { 0 } else { (*waiting).min(*load) };
            c.limit = 8;
        }
        let costs = if known {
            Costs { hold_seconds: 0.1, prefill_per_chunk: 0.005 }
        } else {
            Costs::default()
        };
        let bound = Bound { factor, slack };
        let mut ix = PrefixIndex::new(1 << 20);
        let k = key(&format!("prompt {prompt} ").repeat(50));
        for (r, upto) in seen {
            if r < cs.len() {
                let n = upto.min(k.chunks.len());
                ix.record(&k.chunks[..n], cs[r].replica);
            }
        }
        let cap = load_cap(&cs, factor);
        let sticky = affinity_cap(&cs, bound);
        let min = cs.iter().map(|c| c.load).min().unwrap_or(0);
        prop_assert!(f64::from(min) < cap);
        let mut out = vec![0; cs.len()];
        let keys: Vec<_> = cs.iter().map(|c| c.replica).collect();
        ix.matches(&k.chunks, &keys, &mut out);
        let free_match = |i: usize| cs[i].free && f64::from(cs[i].load) < sticky;
        let Some(c) = choose(&cs, &k, &ix, bound, costs, &mut Vec::new()) else {
            prop_assert!(cs.iter().all(|c| !c.free));
            return Ok(());
        };
        match c.reason {
            Reason::Affinity => {
                prop_assert!(cs[c.index].free);
                prop_assert!(f64::from(cs[c.index].load) < sticky);
                prop_assert_eq!(out[c.index], c.matched);
                prop_assert!(out.iter().enumerate().all(|(i, m)| *m <= c.matched || !free_match(i)));
            }
            Reason::Wait => {
                prop_assert!(known);
                prop_assert!(!cs[c.index].free);
                prop_assert!(f64::from(cs[c.index].load) < sticky);
                prop_assert_eq!(out[c.index], c.matched);
                prop_assert!(out.iter().enumerate().all(|(i, m)| *m < c.matched || !free_match(i)));
            }
            Reason::Home => {
                prop_assert!(cs[c.index].free);
                // Nobody free under the affinity cap had seen any of it;
                // the strict cap holds unless every free one is above it.
                prop_assert!(out.iter().enumerate().all(|(i, m)| *m == 0 || !free_match(i)));
                prop_assert!(
                    f64::from(cs[c.index].load) < cap
                        || cs.iter().all(|x| !x.free || f64::from(x.load) >= cap)
                );
            }
        }
    }
}
