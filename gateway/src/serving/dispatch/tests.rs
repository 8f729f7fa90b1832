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

/// Teaches `app` that a request holds its slot 100 ms and a chunk of
/// prompt costs 5 ms of prefill.
fn teach(app: &App) {
    let mut s = app.slots.lock();
    for i in 0..100u32 {
        s.learned.held(0.1);
        s.learned.first_byte(i % 40, 0.005 * f64::from(i % 40));
    }
}

fn prompt_key(text: &str) -> Arc<RouteKey> {
    Arc::new(RouteKey::prompt([text.repeat(120).as_bytes()]))
}

/// A conversation whose replica is full waits for that replica's next slot
/// when recomputing its prompt elsewhere would cost more; requests behind
/// it with nothing to wait for pass it; and when its replica leaves, it
/// chooses again at once.
#[tokio::test]
async fn a_request_waits_for_the_full_replica_that_holds_its_prompt_while_others_pass() {
    let app = app(1, 10);
    teach(&app);
    let (a, b) = (replica("a-1", 1), replica("a-2", 1));
    app.add_replica(a.clone());
    app.add_replica(b.clone());
    let key = prompt_key("a long conversation, turn after turn; ");
    let first = ready(app.acquire_avoiding(&[], Some(&key), None).expect("slot"));
    let holder = first.replica().clone();
    let other = if Arc::ptr_eq(&holder, &a) { &b } else { &a };
    // Its replica is full: 35 chunks saved (175 ms) against a 100 ms wait.
    let again = held(app.acquire_avoiding(&[], Some(&key), None).expect("held"));
    assert_eq!(other.inflight(), 0, "the other replica was left free");
    // A request with nothing to wait for is not queued behind it.
    let passer = ready(app.acquire().expect("a free slot"));
    assert!(Arc::ptr_eq(passer.replica(), other));
    drop(first);
    let second = slot(again.wait(Duration::from_secs(1)).await.expect("granted"));
    assert!(
        Arc::ptr_eq(second.replica(), &holder),
        "served where its prompt is"
    );
    drop((second, passer));

    // Waiting for a replica that leaves: it goes to the one that is free.
    let first = ready(app.acquire_avoiding(&[], Some(&key), None).expect("slot"));
    let holder = first.replica().clone();
    let again = held(app.acquire_avoiding(&[], Some(&key), None).expect("held"));
    assert!(app.remove_replica(&holder));
    let moved = slot(again.wait(Duration::from_secs(1)).await.expect("granted"));
    assert!(!Arc::ptr_eq(moved.replica(), &holder));
}

/// Until the gateway has learned what a slot and a chunk of prefill cost,
/// a full replica is not waited for: the request goes to a free one.
#[test]
fn with_nothing_learned_a_full_holder_is_passed_over() {
    let app = app(1, 10);
    app.add_replica(replica("a-1", 1));
    app.add_replica(replica("a-2", 1));
    let key = prompt_key("a long conversation, turn after turn; ");
    let first = ready(app.acquire_avoiding(&[], Some(&key), None).expect("slot"));
    let second = ready(app.acquire_avoiding(&[], Some(&key), None).expect("slot"));
    assert!(!Arc::ptr_eq(first.replica(), second.replica()));
}

/// A few chunks in common are not worth a whole slot's turn-over.
#[test]
fn a_short_shared_start_is_not_worth_waiting_for() {
    let app = app(1, 10);
    teach(&app);
    app.add_replica(replica("a-1", 1));
    app.add_replica(replica("a-2", 1));
    let first = ready(
        app.acquire_avoiding(&[], Some(&prompt_key("one system prompt ")), None)
            .expect("slot"),
    );
    // 720 bytes in common with the first (5 chunks, 25 ms of prefill)
    // against a 100 ms wait.
    let other = Arc::new(RouteKey::prompt([format!(
        "{}and another question",
        "one system prompt ".repeat(40)
    )
    .as_bytes()]));
    let second = ready(app.acquire_avoiding(&[], Some(&other), None).expect("slot"));
    assert!(!Arc::ptr_eq(first.replica(), second.replica()));
}
