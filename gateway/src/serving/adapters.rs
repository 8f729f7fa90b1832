//! Which LoRA adapters each replica of a revision holds, and where a
//! request for one goes: the gateway's own record, which is the truth it
//! routes on (an engine's metrics list adapters with requests in flight,
//! not those loaded). Pure: no I/O, no clock (recency is a counter).
//!
//! A request for adapter `a` goes, among the replicas with a free slot:
//! 1. to the least loaded one that holds `a` (loaded or loading) and is
//!    under the load bound: `bound` × the mean, or `slack` more requests
//!    than the least loaded replica, whichever is more (a load costs far
//!    more than waiting behind a few requests of a batch);
//! 2. else to the least loaded one with room for another adapter, which
//!    loads `a`;
//! 3. else to the least loaded one holding an idle adapter (no request in
//!    flight), which unloads its least recently used idle adapter and
//!    loads `a`;
//! 4. else to the least loaded holder of `a`, over the bound;
//! 5. else it waits for a slot.
//!
//! So an adapter stays where it is while its traffic fits there, and only
//! an idle adapter is ever pushed out: no request is sent to a replica for
//! an adapter before its load answered (a request that finds its adapter
//! loading waits for that load).
//!
//! With tenants, the adapter slots are shared fairly: an adapter belongs
//! to the tenant that asks for it most lately, and a tenant's request may
//! push out (step 3) only its own idle adapters, or those of a tenant that
//! holds more than its fair share (the slots over the tenants holding or
//! asking for adapters). One tenant cycling through many adapters then
//! churns its own share, never another's hot adapter.

use std::collections::HashMap;
use std::sync::Arc;

use tokio::sync::watch;

/// Where a load stands, as the requests waiting for it see it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LoadState {
    /// Under way.
    Loading,
    /// The engine answered success.
    Ready,
    /// The load failed, with why.
    Failed(String),
}

/// What a request given a slot must do before it is forwarded.
#[derive(Debug)]
pub enum Ticket {
    /// The adapter is loaded on its replica.
    Ready,
    /// Another request is loading it there: wait for that.
    Wait(watch::Receiver<LoadState>),
    /// Load it there (after unloading `evict`), and tell `done`.
    Load {
        /// Where the outcome goes.
        done: watch::Sender<LoadState>,
        /// An idle adapter to unload first.
        evict: Option<Arc<str>>,
    },
}

/// One replica's view, for [`AdapterTable::choose`].
#[derive(Debug, Clone)]
pub struct Candidate<'a> {
    /// The replica's id.
    pub replica: &'a str,
    /// Requests in flight on it.
    pub load: u32,
}

/// How far a replica holding the adapter may be above the others and
/// still get its requests (`[apps.routing]` `load_bound`, `load_slack`).
#[derive(Debug, Clone, Copy)]
pub struct Bound {
    /// Times the mean load.
    pub factor: f64,
    /// Or this many requests above the least loaded replica.
    pub slack: u32,
}

/// Why a replica was chosen (the metric label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    /// It holds the adapter, under the bound.
    Held,
    /// It had room: the adapter loads there.
    Room,
    /// An idle adapter makes room.
    Evict,
    /// It holds the adapter, over the bound (nowhere else could load it).
    Over,
}

impl Reason {
    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::Held => "held",
            Reason::Room => "room",
            Reason::Evict => "evict",
            Reason::Over => "over_bound",
        }
    }
}

/// The adapters of every replica of one revision.
#[derive(Debug, Default)]
pub struct AdapterTable {
    replicas: HashMap<String, Vec<Held>>,
    /// The recency counter.
    tick: u64,
    /// Requests per adapter, halved every [`DECAY_EVERY`] requests: how
    /// often each is asked for lately.
    uses: HashMap<Arc<str>, u64>,
    /// The same by adapter and tenant: whose each adapter is.
    tenant_uses: HashMap<(Arc<str>, Option<Arc<str>>), u64>,
}

/// Requests between two halvings of the use counts.
const DECAY_EVERY: u64 = 1024;

#[derive(Debug)]
struct Held {
    name: Arc<str>,
    state: watch::Receiver<LoadState>,
    inflight: u32,
    last_used: u64,
    /// Chosen to make room: its unload is under way. It still takes its
    /// room, serves nothing, and no load of it goes to this replica until
    /// the unload has answered (else the unload could overtake it).
    unloading: bool,
}

impl Held {
    fn ready(&self) -> bool {
        !self.unloading && *self.state.borrow() == LoadState::Ready
    }
}

impl AdapterTable {
    /// The replica a request for `name` goes to (its index in
    /// `candidates`, which all have a free slot) and why; `None`: wait.
    /// `max_loaded` adapters fit on a replica; `bound` and `slack` are the
    /// load factor and slack of `[apps.routing]`.
    pub fn choose(
        &self,
        name: &str,
        candidates: &[Candidate<'_>],
        max_loaded: u32,
        bound: Bound,
    ) -> Option<(usize, Reason)> {
        let share = self.fair_share(None, candidates.len(), max_loaded);
        self.choose_for(name, None, share, candidates, max_loaded, bound)
    }

    /// [`AdapterTable::choose`] for a request of `tenant`, which may push
    /// out only its own idle adapters or those of a tenant holding more
    /// than `share` (see [`AdapterTable::fair_share`]).
    pub fn choose_for(
        &self,
        name: &str,
        tenant: Option<&str>,
        share: usize,
        candidates: &[Candidate<'_>],
        max_loaded: u32,
        bound: Bound,
    ) -> Option<(usize, Reason)> {
        if candidates.is_empty() {
            return None;
        }
        let total: u32 = candidates.iter().map(|c| c.load).sum();
        let least = candidates.iter().map(|c| c.load).min().unwrap_or(0);
        let limit = ((bound.factor * f64::from(total + 1) / candidates.len() as f64).ceil() as u32)
            .max(least + bound.slack);
        let held = |c: &Candidate<'_>| self.holds(c.replica, name);
        let least = |f: &dyn Fn(&Candidate<'_>) -> bool| {
            candidates
                .iter()
                .enumerate()
                .filter(|(_, c)| !self.is_unloading(c.replica, name))
                .filter(|(_, c)| f(c))
                .min_by_key(|(_, c)| c.load)
                .map(|(i, _)| i)
        };
        if let Some(i) = least(&|c| held(c) && c.load < limit) {
            return Some((i, Reason::Held));
        }
        if let Some(i) = least(&|c| self.count(c.replica) < max_loaded as usize) {
            return Some((i, Reason::Room));
        }
        // The replica whose idle adapter is the least asked for lately (the
        // least recently used among equals): an adapter in steady use is
        // not pushed out for a rare one, and rare ones take turns in the
        // room left.
        let victim = candidates
            .iter()
            .enumerate()
            .filter(|(_, c)| !self.is_unloading(c.replica, name))
            .filter_map(|(i, c)| {
                self.idle(c.replica, tenant, share)
                    .map(|h| (i, (self.uses_of(&h.name), h.last_used, c.load)))
            })
            .min_by_key(|&(_, rank)| rank)
            .map(|(i, _)| i);
        if let Some(i) = victim {
            return Some((i, Reason::Evict));
        }
        least(&|c| held(c)).map(|i| (i, Reason::Over))
    }

    /// Takes a place for a request for `name` on `replica`, chosen by
    /// [`AdapterTable::choose`] for `reason`: what the request must do.
    pub fn reserve(&mut self, replica: &str, name: &Arc<str>, reason: Reason) -> Ticket {
        self.reserve_for(replica, name, None, usize::MAX, reason)
    }

    /// [`AdapterTable::reserve`] for a request of `tenant`, as chosen by
    /// [`AdapterTable::choose_for`] with the same `share`.
    pub fn reserve_for(
        &mut self,
        replica: &str,
        name: &Arc<str>,
        tenant: Option<&Arc<str>>,
        share: usize,
        reason: Reason,
    ) -> Ticket {
        let victim = if reason == Reason::Evict {
            self.idle(replica, tenant.map(|t| &**t), share)
                .map(|h| h.name.clone())
        } else {
            None
        };
        self.tick += 1;
        let tick = self.tick;
        if tick.is_multiple_of(DECAY_EVERY) {
            self.uses.retain(|_, n| {
                *n /= 2;
                *n > 0
            });
            self.tenant_uses.retain(|_, n| {
                *n /= 2;
                *n > 0
            });
        }
        *self.uses.entry(name.clone()).or_default() += 1;
        *self
            .tenant_uses
            .entry((name.clone(), tenant.cloned()))
            .or_default() += 1;
        let held = self.replicas.entry(replica.to_string()).or_default();
        if let Some(h) = held.iter_mut().find(|h| *h.name == **name && !h.unloading) {
            h.inflight += 1;
            h.last_used = tick;
            return if h.ready() {
                Ticket::Ready
            } else {
                Ticket::Wait(h.state.clone())
            };
        }
        let evict = victim.and_then(|v| {
            let h = held
                .iter_mut()
                .find(|h| h.name == v && h.inflight == 0 && h.ready())?;
            h.unloading = true;
            Some(h.name.clone())
        });
        let (done, state) = watch::channel(LoadState::Loading);
        held.push(Held {
            name: name.clone(),
            state,
            inflight: 1,
            last_used: tick,
            unloading: false,
        });
        Ticket::Load { done, evict }
    }

    /// Records `name` as loaded on `replica` (found in its engine), when
    /// it is not held there already and `max_loaded` leaves room; whether
    /// it was.
    pub fn adopt(&mut self, replica: &str, name: Arc<str>, max_loaded: usize) -> bool {
        let held = self.replicas.entry(replica.to_string()).or_default();
        if held.iter().any(|h| h.name == name && !h.unloading) {
            return true;
        }
        if held.len() >= max_loaded {
            return false;
        }
        let (_done, state) = watch::channel(LoadState::Ready);
        held.push(Held {
            name,
            state,
            inflight: 0,
            last_used: 0,
            unloading: false,
        });
        true
    }

    /// A load on `replica` ended: a failed one leaves nothing behind.
    pub fn loaded(&mut self, replica: &str, name: &str, ok: bool) {
        if ok {
            return;
        }
        if let Some(held) = self.replicas.get_mut(replica) {
            held.retain(|h| &*h.name != name || h.unloading);
        }
    }

    /// The unload of `name` made for room on `replica` was sent (whatever
    /// it answered): its room is free.
    pub fn unloaded(&mut self, replica: &str, name: &str) {
        if let Some(held) = self.replicas.get_mut(replica) {
            held.retain(|h| &*h.name != name || !h.unloading);
        }
    }

    /// A load that was to unload `name` for room never started: `name`
    /// stays as it was.
    pub fn keep(&mut self, replica: &str, name: &str) {
        if let Some(h) = self
            .replicas
            .get_mut(replica)
            .and_then(|held| held.iter_mut().find(|h| &*h.name == name && h.unloading))
        {
            h.unloading = false;
        }
    }

    /// A request for `name` on `replica` ended.
    pub fn release(&mut self, replica: &str, name: &str) {
        self.tick += 1;
        let tick = self.tick;
        if let Some(h) = self
            .replicas
            .get_mut(replica)
            .and_then(|held| held.iter_mut().find(|h| &*h.name == name))
        {
            h.inflight = h.inflight.saturating_sub(1);
            h.last_used = tick;
        }
    }

    /// A replica left: what it held goes with it.
    pub fn forget(&mut self, replica: &str) {
        self.replicas.remove(replica);
    }

    /// The adapters loaded on `replica`.
    pub fn names_on(&self, replica: &str) -> Vec<Arc<str>> {
        self.replicas
            .get(replica)
            .map(|h| {
                h.iter()
                    .filter(|h| h.ready())
                    .map(|h| h.name.clone())
                    .collect()
            })
            .unwrap_or_default()
    }

    /// The replicas holding `name` loaded.
    pub fn holders(&self, name: &str) -> Vec<String> {
        let mut v: Vec<String> = self
            .replicas
            .iter()
            .filter(|(_, held)| held.iter().any(|h| &*h.name == name && h.ready()))
            .map(|(r, _)| r.clone())
            .collect();
        v.sort();
        v
    }

    fn holds(&self, replica: &str, name: &str) -> bool {
        self.replicas
            .get(replica)
            .is_some_and(|held| held.iter().any(|h| &*h.name == name && !h.unloading))
    }

    fn is_unloading(&self, replica: &str, name: &str) -> bool {
        self.replicas
            .get(replica)
            .is_some_and(|held| held.iter().any(|h| &*h.name == name && h.unloading))
    }

    fn count(&self, replica: &str) -> usize {
        self.replicas.get(replica).map_or(0, Vec::len)
    }

    /// The idle adapter of `replica` a request of `tenant` would push
    /// out: one of its own, or of a tenant holding more than `share`; the
    /// least asked for, then the least recently used.
    fn idle(&self, replica: &str, tenant: Option<&str>, share: usize) -> Option<&Held> {
        self.replicas
            .get(replica)?
            .iter()
            .filter(|h| h.inflight == 0 && h.ready())
            .filter(|h| {
                let owner = self.owner_of(&h.name);
                owner.as_deref() == tenant || self.held_by(owner.as_deref()) > share
            })
            .min_by_key(|h| (self.uses_of(&h.name), h.last_used))
    }

    /// The tenant that asks for `name` most lately (`None`: no tenant).
    fn owner_of(&self, name: &str) -> Option<Arc<str>> {
        self.tenant_uses
            .iter()
            .filter(|((n, _), _)| &**n == name)
            .max_by_key(|((_, t), uses)| (**uses, t.clone()))
            .and_then(|((_, t), _)| t.clone())
    }

    /// Adapters held (loaded or loading) whose owner is `tenant`.
    fn held_by(&self, tenant: Option<&str>) -> usize {
        self.replicas
            .values()
            .flatten()
            .filter(|h| !h.unloading && self.owner_of(&h.name).as_deref() == tenant)
            .count()
    }

    /// A tenant's fair share of the adapter slots: the slots of `replicas`
    /// replicas of `max_loaded` each (or of every replica that held one),
    /// over the tenants holding adapters and `tenant`, rounded up.
    pub fn fair_share(&self, tenant: Option<&str>, replicas: usize, max_loaded: u32) -> usize {
        let slots = replicas.max(self.replicas.len()) * max_loaded as usize;
        let mut tenants: Vec<Option<Arc<str>>> = self
            .replicas
            .values()
            .flatten()
            .filter(|h| !h.unloading)
            .map(|h| self.owner_of(&h.name))
            .collect();
        tenants.push(tenant.map(Arc::from));
        tenants.sort();
        tenants.dedup();
        slots.div_ceil(tenants.len().max(1))
    }

    fn uses_of(&self, name: &str) -> u64 {
        self.uses.get(name).copied().unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const B: Bound = Bound {
        factor: 1.25,
        slack: 4,
    };

    fn cands<'a>(loads: &[(&'a str, u32)]) -> Vec<Candidate<'a>> {
        loads
            .iter()
            .map(|(r, l)| Candidate {
                replica: r,
                load: *l,
            })
            .collect()
    }

    /// Chooses and reserves; a load succeeds at once. Returns the replica.
    fn send(t: &mut AdapterTable, name: &str, c: &[Candidate<'_>], max: u32) -> Option<String> {
        let (i, why) = t.choose(name, c, max, B)?;
        let name: Arc<str> = Arc::from(name);
        if let Ticket::Load { done, .. } = t.reserve(c[i].replica, &name, why) {
            done.send(LoadState::Ready).expect("a receiver is kept");
            t.loaded(c[i].replica, &name, true);
        }
        Some(c[i].replica.to_string())
    }

    /// [`send`] for a tenant; whether the adapter had to be loaded.
    fn send_as(t: &mut AdapterTable, tenant: &str, name: &str, c: &[Candidate<'_>]) -> bool {
        let share = t.fair_share(Some(tenant), c.len(), 2);
        let (i, why) = t
            .choose_for(name, Some(tenant), share, c, 2, B)
            .expect("a replica");
        let name: Arc<str> = Arc::from(name);
        let who: Arc<str> = Arc::from(tenant);
        let loaded = match t.reserve_for(c[i].replica, &name, Some(&who), share, why) {
            Ticket::Load { done, evict } => {
                done.send(LoadState::Ready).expect("a receiver is kept");
                t.loaded(c[i].replica, &name, true);
                if let Some(e) = evict {
                    t.unloaded(c[i].replica, &e);
                }
                true
            }
            _ => false,
        };
        t.release(c[i].replica, &name);
        loaded
    }

    #[test]
    fn a_tenant_cycling_adapters_churns_its_own_share_not_another_s_hot_adapter() {
        let mut t = AdapterTable::default();
        let c = cands(&[("r1", 0), ("r2", 0)]);
        assert!(send_as(&mut t, "b", "hot", &c), "loaded once");
        let mut reloads = 0;
        for round in 0..60 {
            let a = format!("a{}", round % 6);
            send_as(&mut t, "a", &a, &c);
            if round % 3 == 0 && send_as(&mut t, "b", "hot", &c) {
                reloads += 1;
            }
        }
        assert_eq!(reloads, 0, "team b's adapter was pushed out by team a's");
        // Without tenants the same traffic pushes it out: the rare hot one
        // is the least asked for.
        let mut t = AdapterTable::default();
        send(&mut t, "hot", &c, 2);
        t.release("r1", "hot");
        t.release("r2", "hot");
        let mut gone = false;
        for round in 0..60 {
            let a = format!("a{}", round % 6);
            if let Some(r) = send(&mut t, &a, &c, 2) {
                t.release(&r, &a);
            }
            gone |= t.holders("hot").is_empty();
        }
        assert!(
            gone,
            "the test's traffic is one that evicts it without tenants"
        );
    }

    #[test]
    fn an_adapter_stays_where_it_is_loaded_while_its_replica_is_under_the_bound() {
        let mut t = AdapterTable::default();
        let c = cands(&[("r1", 0), ("r2", 0)]);
        let first = send(&mut t, "sql", &c, 2).expect("a replica");
        t.release(&first, "sql");
        for _ in 0..10 {
            let again = send(&mut t, "sql", &c, 2).expect("a replica");
            assert_eq!(again, first);
            t.release(&again, "sql");
        }
        // Its replica busy past the bound: another loads it.
        let busy = if first == "r1" {
            cands(&[("r1", 9), ("r2", 0)])
        } else {
            cands(&[("r1", 0), ("r2", 9)])
        };
        let (i, why) = t.choose("sql", &busy, 2, B).expect("a replica");
        assert_ne!(busy[i].replica, first);
        assert_eq!(why, Reason::Room);
    }

    #[test]
    fn room_is_made_only_by_unloading_the_least_recently_used_idle_adapter() {
        let mut t = AdapterTable::default();
        let c = cands(&[("r1", 0)]);
        for name in ["a", "b"] {
            send(&mut t, name, &c, 2);
            t.release("r1", name);
        }
        // `a` used again: `b` is the least recently used.
        send(&mut t, "a", &c, 2);
        t.release("r1", "a");
        let name: Arc<str> = Arc::from("c");
        let (i, why) = t.choose("c", &c, 2, B).expect("room by eviction");
        assert_eq!(why, Reason::Evict);
        match t.reserve(c[i].replica, &name, why) {
            Ticket::Load { evict, .. } => assert_eq!(evict.as_deref(), Some("b")),
            other => panic!("{other:?}"),
        }
        // With both remaining adapters busy, nothing is evicted: wait.
        let busy = Arc::from("a");
        t.reserve("r1", &busy, Reason::Held);
        assert_eq!(t.choose("d", &c, 2, B), None);
    }

    #[test]
    fn a_request_that_finds_its_adapter_loading_waits_for_that_load() {
        let mut t = AdapterTable::default();
        let c = cands(&[("r1", 0)]);
        let name: Arc<str> = Arc::from("sql");
        let (_, why) = t.choose("sql", &c, 2, B).expect("room");
        let Ticket::Load { done, .. } = t.reserve("r1", &name, why) else {
            panic!("the first loads");
        };
        let (_, why) = t.choose("sql", &c, 2, B).expect("held");
        assert_eq!(why, Reason::Held);
        let Ticket::Wait(rx) = t.reserve("r1", &name, why) else {
            panic!("the second waits");
        };
        assert_eq!(*rx.borrow(), LoadState::Loading);
        assert!(
            t.holders("sql").is_empty(),
            "not loaded until the engine says so"
        );
        done.send(LoadState::Ready).expect("send");
        assert_eq!(*rx.borrow(), LoadState::Ready);
        assert_eq!(t.holders("sql"), ["r1"]);
        // A failed load leaves nothing: the next request loads again.
        let other: Arc<str> = Arc::from("bad");
        let (_, why) = t.choose("bad", &c, 2, B).expect("room");
        let Ticket::Load { done, .. } = t.reserve("r1", &other, why) else {
            panic!("loads");
        };
        done.send(LoadState::Failed("no such folder".into()))
            .expect("send");
        t.loaded("r1", "bad", false);
        assert!(matches!(
            t.reserve("r1", &other, Reason::Room),
            Ticket::Load { .. }
        ));
    }

    #[test]
    fn a_replica_that_leaves_takes_its_adapters_with_it() {
        let mut t = AdapterTable::default();
        let c = cands(&[("r1", 0)]);
        send(&mut t, "sql", &c, 2);
        t.forget("r1");
        assert!(t.holders("sql").is_empty());
        assert!(t.names_on("r1").is_empty());
    }

    #[test]
    fn an_adapter_in_steady_use_is_not_pushed_out_for_a_rare_one() {
        let mut t = AdapterTable::default();
        let c = cands(&[("r1", 0), ("r2", 0)]);
        // r1 holds hot and x, r2 holds y and z, all idle now.
        for (r, name) in [("r1", "x"), ("r2", "y"), ("r2", "z"), ("r1", "hot")] {
            let n: Arc<str> = Arc::from(name);
            if let Ticket::Load { done, .. } = t.reserve(r, &n, Reason::Room) {
                done.send(LoadState::Ready).expect("send");
            }
            t.release(r, name);
        }
        // hot is used again and again; a rare adapter pushes out x, y or
        // z (the least recently used of all: x), never hot.
        let hot: Arc<str> = Arc::from("hot");
        t.reserve("r1", &hot, Reason::Held);
        t.release("r1", "hot");
        let rare: Arc<str> = Arc::from("rare");
        let (i, why) = t.choose("rare", &c, 2, B).expect("room by eviction");
        assert_eq!((c[i].replica, why), ("r1", Reason::Evict));
        match t.reserve(c[i].replica, &rare, why) {
            Ticket::Load { evict, .. } => assert_eq!(evict.as_deref(), Some("x")),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn adapters_found_in_an_engine_are_adopted_within_its_room() {
        let mut t = AdapterTable::default();
        let (a, b, c): (Arc<str>, Arc<str>, Arc<str>) = ("a".into(), "b".into(), "c".into());
        assert!(t.adopt("r1", a.clone(), 2));
        assert!(t.adopt("r1", a.clone(), 2), "once");
        assert!(t.adopt("r1", b.clone(), 2));
        assert!(!t.adopt("r1", c.clone(), 2), "no room");
        assert_eq!(t.holders("a"), vec!["r1".to_string()]);
        assert!(matches!(t.reserve("r1", &a, Reason::Held), Ticket::Ready));
    }

    #[test]
    fn an_adapter_being_unloaded_keeps_its_room_and_is_not_loaded_there_again_meanwhile() {
        let mut t = AdapterTable::default();
        let c = [Candidate {
            replica: "r1",
            load: 0,
        }];
        let (x, y): (Arc<str>, Arc<str>) = ("x".into(), "y".into());
        assert!(t.adopt("r1", x.clone(), 1));
        // y pushes x out: x's unload is under way.
        let (_, why) = t.choose("y", &c, 1, B).expect("evict");
        assert_eq!(why, Reason::Evict);
        let Ticket::Load { evict, .. } = t.reserve("r1", &y, why) else {
            panic!("a load");
        };
        assert_eq!(evict.as_deref(), Some("x"));
        assert!(t.holders("x").is_empty());
        // x is not loaded there again before its unload answered.
        assert_eq!(t.choose("x", &c, 2, B), None);
        t.unloaded("r1", "x");
        assert_eq!(t.choose("x", &c, 2, B).map(|(_, r)| r), Some(Reason::Room));
        // A load that never started gives the adapter back.
        let mut u = AdapterTable::default();
        assert!(u.adopt("r1", x.clone(), 1));
        let Ticket::Load { .. } = u.reserve("r1", &y, Reason::Evict) else {
            panic!("a load");
        };
        u.loaded("r1", "y", false);
        u.keep("r1", "x");
        assert_eq!(u.holders("x"), vec!["r1".to_string()]);
    }
}
