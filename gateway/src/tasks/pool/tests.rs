//! The warm pool's tests: a task's record is stored before a dispatcher
//! can take it, and dispatch respects staleness and task versions.

use super::*;

fn replica(id: &str, version: u64) -> Arc<ReplicaHandle> {
    let r = ReplicaHandle::new(
        id.into(),
        TargetId::Pool("p".into()),
        "p-00001".into(),
        "127.0.0.1:9".parse().expect("addr"),
        1,
        Instant::now(),
    );
    r.weights_version.store(version, Ordering::Relaxed);
    Arc::new(r)
}

fn submit(pool: &Pool, min: Option<u64>) {
    pool.submit(Submit {
        input: Bytes::from_static(b"1"),
        priority: 0,
        tenant: DEFAULT_TENANT.into(),
        timeout: None,
        retries: None,
        min_weights_version: min,
        traceparent: None,
        hold: None,
        durable: false,
        id: None,
        cancel: None,
    })
    .expect("accepted");
}

/// A dispatcher on another thread may take a task the moment it is
/// queued: its record must already be there for the attempt and the
/// end to land on. And a refused task leaves no record behind.
#[test]
fn a_task_taken_at_once_by_another_thread_has_its_record() {
    const N: usize = 100_000;
    let pool = Arc::new(Pool::new(
        PoolSpec {
            name: "p".into(),
            ..PoolSpec::default()
        },
        Arc::new(TaskStore::default()),
        crate::upstream::Upstream::new(),
    ));
    pool.add_replica(replica("r", 0));
    let taker = {
        let pool = pool.clone();
        std::thread::spawn(move || {
            let (mut taken, mut missing) = (0, 0);
            while taken < N {
                if let Some((task, r)) = pool.next() {
                    if pool.store.get(&task.id).is_none() {
                        missing += 1;
                    }
                    r.release();
                    pool.state.lock().inflight -= 1;
                    pool.state.lock().queue.done(&task.tenant);
                    taken += 1;
                } else {
                    std::thread::yield_now();
                }
            }
            missing
        })
    };
    let mut sent = 0;
    while sent < N {
        let accepted = pool.submit(Submit {
            input: Bytes::from_static(b"1"),
            priority: 0,
            tenant: DEFAULT_TENANT.into(),
            timeout: None,
            retries: None,
            min_weights_version: None,
            traceparent: None,
            hold: None,
            durable: false,
            id: None,
            cancel: None,
        });
        match accepted {
            Ok(_) => sent += 1,
            // The queue is full: the taker catches up.
            Err(e) if e.kind == ErrorKind::QueueFull => std::thread::yield_now(),
            Err(e) => panic!("refused: {e:?}"),
        }
    }
    assert_eq!(
        taker.join().expect("taker"),
        0,
        "tasks taken before their record was stored"
    );

    let before = pool.store.len();
    let refused = pool.submit(Submit {
        input: Bytes::from_static(b"1"),
        priority: 0,
        tenant: DEFAULT_TENANT.into(),
        timeout: None,
        retries: None,
        min_weights_version: Some(9),
        traceparent: None,
        hold: None,
        durable: false,
        id: None,
        cancel: None,
    });
    assert!(refused.is_err());
    assert_eq!(pool.store.len(), before, "a refused task left its record");
}

#[tokio::test]
async fn dispatch_respects_staleness_and_task_versions() {
    let spec = PoolSpec {
        name: "p".into(),
        max_staleness: Some(1),
        ..PoolSpec::default()
    };
    let pool = Pool::new(
        spec,
        Arc::new(TaskStore::default()),
        crate::upstream::Upstream::new(),
    );
    for (id, v) in [("old", 0), ("behind", 2), ("latest", 3)] {
        pool.add_replica(replica(id, v));
    }
    // Version 3 was synced (a replica proved it).
    pool.make_latest(
        3,
        &super::sync::WeightsAt::url("http://127.0.0.1:9/v1/weights/p/v3"),
    );

    // Staleness 1 from version 3: "old" (0) never gets a task.
    for _ in 0..3 {
        submit(&pool, None);
    }
    let (_, a) = pool.next().expect("first");
    let (_, b) = pool.next().expect("second");
    let mut got = [a.id.clone(), b.id.clone()];
    got.sort();
    assert_eq!(got, ["behind".to_string(), "latest".to_string()]);
    assert!(pool.next().is_none(), "only a stale replica is free");
    a.release();
    b.release();
    let (_, c) = pool.next().expect("third");
    assert_ne!(c.id, "old");
    c.release();

    // A task asking for version 3 waits for "latest" even when
    // "behind" is free.
    let latest = pool.state.lock().replicas[2].clone();
    latest.acquire();
    submit(&pool, Some(3));
    assert!(pool.next().is_none());
    latest.release();
    let (_, d) = pool.next().expect("fourth");
    assert_eq!(d.id, "latest");

    // Versions beyond the latest synced are refused at once.
    let e = pool
        .submit(Submit {
            input: Bytes::from_static(b"1"),
            priority: 0,
            tenant: DEFAULT_TENANT.into(),
            timeout: None,
            retries: None,
            min_weights_version: Some(4),
            traceparent: None,
            hold: None,
            durable: false,
            id: None,
            cancel: None,
        })
        .expect_err("refused");
    assert_eq!(e.kind, ErrorKind::Conflict);
    // A sync of an older version, or of the latest's number with
    // another checkpoint, is a new version: going back is a step
    // forward, not a conflict.
    pool.state.lock().syncing_to = None;
    pool.state.lock().latest_checkpoint = Some("file:///v3".into());
    assert_eq!(pool.version_for(2, "file:///v1"), 4);
    assert_eq!(pool.version_for(3, "file:///v3"), 3);
    assert_eq!(pool.version_for(3, "file:///v1"), 4);
    assert_eq!(pool.version_for(1, "file:///v3"), 3);
    assert_eq!(pool.version_for(9, "file:///v9"), 9);
}

/// A queued task cancelled never runs, its waiter hears `cancelled` and
/// its record says so; one already taken by a dispatcher is cancelled
/// through its token; a finished one cannot be.
#[tokio::test]
async fn a_cancelled_task_never_runs_and_says_so() {
    let pool = Pool::new(
        PoolSpec {
            name: "p".into(),
            ..PoolSpec::default()
        },
        Arc::new(TaskStore::default()),
        crate::upstream::Upstream::new(),
    );
    let send = || {
        pool.submit(Submit {
            input: Bytes::from_static(b"1"),
            priority: 0,
            tenant: DEFAULT_TENANT.into(),
            timeout: None,
            retries: None,
            min_weights_version: None,
            traceparent: None,
            hold: None,
            durable: false,
            id: None,
            cancel: None,
        })
        .expect("accepted")
    };
    let (queued, rx) = send();
    let (running, _rx2) = send();
    let (cancelled, ended) = pool.cancel(&queued).expect("held");
    assert_eq!(cancelled, Cancelled::Queued);
    assert_eq!(ended.wait(Duration::ZERO).await, Some(TaskState::Cancelled));
    let outcome = rx.await.expect("an answer");
    assert_eq!(outcome.expect_err("cancelled").kind, ErrorKind::Cancelled);
    assert!(pool.cancel(&queued).is_none(), "ended already");
    // The other is taken to run: its token is what stops it.
    pool.add_replica(replica("r", 0));
    let (task, r) = pool.next().expect("the second task");
    assert_eq!(task.id, running);
    assert_eq!(pool.cancel(&running).map(|c| c.0), Some(Cancelled::Running));
    assert!(task.cancel.is_cancelled());
    assert_eq!(pool.state.lock().queue.pending(), 0);
    r.release();
}
