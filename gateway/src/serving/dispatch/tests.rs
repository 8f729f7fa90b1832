//! A revision's slots and hold queue: the meter's readings, the limit,
//! the oldest waiter first, timeouts, failures, redirects, and P2C.

use super::*;
use crate::serving::proxy::Slot as _;

#[test]
fn the_meter_reads_arrivals_completions_and_busy_slot_seconds_per_tick() {
    let t0 = Instant::now();
    let at = |ms: u64| t0 + Duration::from_millis(ms);
    let mut m = Meter {
        value: 0,
        inflight: 0,
        last: t0,
        window_start: t0,
        area: 0.0,
        busy: 0.0,
        active: false,
        arrivals: 0,
        completions: 0,
    };
    // Two requests arrive; one runs at once, one waits 500 ms; each
    // runs a second.
    m.arrivals += 2;
    m.set(at(0), 1, 2);
    m.set(at(500), 2, 2);
    m.set(at(1000), 1, 1);
    m.completions += 1;
    let r = m.take(at(1000));
    assert_eq!((r.arrivals, r.completions), (2, 1));
    assert!((r.busy - 1.5).abs() < 1e-6, "{r:?}");
    assert!((r.concurrency - 2.0).abs() < 1e-6, "{r:?}");
    m.set(at(1500), 0, 0);
    m.completions += 1;
    let r = m.take(at(2000));
    assert_eq!((r.arrivals, r.completions), (0, 1));
    assert!((r.busy - 0.5).abs() < 1e-6, "{r:?}");
}

fn app(concurrency: u32, max_pending: u32) -> Arc<App> {
    let mut spec = AppSpec {
        name: "a".into(),
        command: vec!["x".into()],
        concurrency,
        ..AppSpec::default()
    };
    spec.queue.max_pending = max_pending;
    Arc::new(App::new(spec, TargetId::revision("a", 1)))
}

fn replica(id: &str, concurrency: u32) -> Arc<ReplicaHandle> {
    Arc::new(ReplicaHandle::new(
        id.into(),
        TargetId::revision("a", 1),
        "a-00001".into(),
        "127.0.0.1:1".parse().expect("addr"),
        concurrency,
        Instant::now(),
    ))
}

fn ready(a: Acquire) -> SlotGuard {
    match a {
        Acquire::Ready(g) => g,
        _ => panic!("expected a free slot"),
    }
}

fn held(a: Acquire) -> PendingSlot {
    match a {
        Acquire::Held { pending, .. } => pending,
        _ => panic!("expected to be held"),
    }
}

fn slot(s: Slotted) -> SlotGuard {
    match s {
        Slotted::Slot(g, _) => g,
        Slotted::Moved(_) => panic!("expected a slot"),
    }
}

/// A revision whose last replica went to another (in place) sends what
/// it holds there, and what reaches it later, until it has a replica
/// again; no request waits for a replica that will not come.
#[tokio::test]
async fn a_revision_without_replicas_sends_its_requests_where_its_last_one_went() {
    let old = app(1, 10);
    let new = app(1, 10);
    let r = replica("a-1", 1);
    old.add_replica(r.clone());
    let g = ready(old.acquire().expect("slot"));
    let waiting = held(old.acquire().expect("held"));
    // The replica moves: out of the old revision, into the new one.
    assert!(old.remove_replica(&r));
    drop(g);
    new.add_replica(r.clone());
    old.redirect_to(&new);
    match waiting.wait(Duration::from_secs(1)).await.expect("sent on") {
        Slotted::Moved(to) => assert!(Arc::ptr_eq(&to, &new)),
        Slotted::Slot(..) => panic!("no slot on a replica it gave away"),
    }
    assert_eq!(old.load(), (0, 0), "nothing left held");
    match old.acquire().expect("sent on") {
        Acquire::Moved(to) => assert!(Arc::ptr_eq(&to, &new)),
        _ => panic!("a newcomer goes where the replica went"),
    }
    // With a replica of its own again, it serves.
    old.add_replica(replica("a-2", 1));
    let _g = ready(old.acquire().expect("slot"));
    // A redirect while it still has a replica does nothing.
    let other = app(1, 10);
    other.add_replica(replica("a-3", 1));
    other.redirect_to(&new);
    let _g = ready(other.acquire().expect("slot"));
}

#[tokio::test]
async fn limit_holds_and_freed_slots_go_to_the_oldest_waiter() {
    let app = app(2, 10);
    let r = replica("a-1", 2);
    app.add_replica(r.clone());
    let g1 = ready(app.acquire().expect("slot"));
    let _g2 = ready(app.acquire().expect("slot"));
    assert_eq!(r.inflight(), 2);
    let p1 = held(app.acquire().expect("held"));
    let p2 = held(app.acquire().expect("held"));
    assert_eq!(app.load(), (2, 2));
    drop(g1);
    assert_eq!(r.inflight(), 2, "the slot went straight to a waiter");
    let g3 = slot(p1.wait(Duration::from_secs(1)).await.expect("granted"));
    assert_eq!(g3.replica().id, "a-1");
    assert_eq!(app.load(), (2, 1));
    drop(p2);
    assert_eq!(app.load(), (2, 0), "a cancelled waiter leaves the queue");
}

#[tokio::test]
async fn queue_full_is_429_with_retry_after_and_cold_is_503() {
    let cold = app(1, 1);
    let _p = held(cold.acquire().expect("held"));
    let err = cold.acquire().err().expect("full");
    assert_eq!(err.kind, ErrorKind::Starting);
    assert_eq!(err.retry_after, Some(1));

    let warm = app(1, 1);
    warm.add_replica(replica("a-1", 1));
    let _g = ready(warm.acquire().expect("slot"));
    let _p = held(warm.acquire().expect("held"));
    let err = warm.acquire().err().expect("full");
    assert_eq!(err.kind, ErrorKind::QueueFull);
    assert_eq!(err.retry_after, Some(1));
}

#[tokio::test(start_paused = true)]
async fn held_request_times_out_and_its_slot_is_not_lost() {
    let app = app(1, 10);
    let r = replica("a-1", 1);
    app.add_replica(r.clone());
    let g = ready(app.acquire().expect("slot"));
    let p = held(app.acquire().expect("held"));
    let err = p.wait(Duration::from_secs(5)).await.err().expect("timeout");
    assert_eq!(err.kind, ErrorKind::Timeout);
    drop(g);
    assert_eq!(r.inflight(), 0);
    assert_eq!(app.load(), (0, 0));
}

#[tokio::test]
async fn new_replica_serves_held_requests_and_failure_reaches_them() {
    let app = app(4, 10);
    let p = held(app.acquire().expect("held"));
    app.add_replica(replica("a-1", 4));
    let g = slot(p.wait(Duration::from_secs(1)).await.expect("granted"));
    drop(g);

    let app2 = self::app(4, 10);
    let p = held(app2.acquire().expect("held"));
    app2.fail_waiters(&Error::new(ErrorKind::ReplicaFailed, "boom"));
    let err = p.wait(Duration::from_secs(1)).await.err().expect("failed");
    assert_eq!(err.kind, ErrorKind::ReplicaFailed);
    assert_eq!(app2.load(), (0, 0));
}

#[test]
fn p2c_spreads_load_and_respects_limits() {
    let app = app(3, 0);
    let rs: Vec<_> = (0..3).map(|i| replica(&format!("a-{i}"), 3)).collect();
    for r in &rs {
        app.add_replica(r.clone());
    }
    let guards: Vec<_> = (0..9)
        .map(|_| ready(app.acquire().expect("slot")))
        .collect();
    for r in &rs {
        assert_eq!(r.inflight(), 3);
    }
    assert!(app.acquire().is_err(), "no queue: full");
    drop(guards);
    for r in &rs {
        assert_eq!(r.inflight(), 0);
    }
}
