//! Property tests of the slot accounting under random interleavings of
//! arrivals, completions, cancellations and replicas coming and going.

use std::sync::Arc;
use std::time::Instant;

use proptest::prelude::*;
use warmgate_deploy::AppSpec;
use warmgate_gateway::ErrorKind;
use warmgate_gateway::serving::dispatch::{Acquire, App, PendingSlot, SlotGuard, Slotted};
use warmgate_pool::ReplicaHandle;

#[derive(Debug, Clone)]
enum Op {
    Arrive,
    Finish(usize),
    Cancel(usize),
    AddReplica(u32),
    RemoveReplica(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => Just(Op::Arrive),
        3 => any::<usize>().prop_map(Op::Finish),
        1 => any::<usize>().prop_map(Op::Cancel),
        1 => (1u32..4).prop_map(Op::AddReplica),
        1 => any::<usize>().prop_map(Op::RemoveReplica),
    ]
}

struct Waiting {
    seq: u64,
    slot: PendingSlot,
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn limits_hold_no_slot_leaks_and_waiters_are_served_in_order(
        max_pending in 0u32..6,
        ops in proptest::collection::vec(op(), 1..200),
    ) {
        let mut spec = AppSpec {
            name: "p".into(),
            command: vec!["x".into()],
            ..AppSpec::default()
        };
        spec.queue.max_pending = max_pending;
        let app = Arc::new(App::new(spec, warmgate_deploy::TargetId::revision("p", 1)));
        let mut replicas: Vec<Arc<ReplicaHandle>> = Vec::new();
        let mut routed: Vec<Arc<ReplicaHandle>> = Vec::new();
        let mut running: Vec<SlotGuard> = Vec::new();
        let mut waiting: Vec<Waiting> = Vec::new();
        let mut next_seq = 0u64;
        let mut next_id = 0u32;

        for op in ops {
            match op {
                Op::Arrive => {
                    let held = waiting.len();
                    match app.acquire() {
                        Ok(Acquire::Ready(g)) => {
                            prop_assert_eq!(held, 0, "a newcomer never overtakes a waiter");
                            running.push(g);
                        }
                        Ok(Acquire::Held { pending, .. }) => {
                            waiting.push(Waiting { seq: next_seq, slot: pending });
                            next_seq += 1;
                        }
                        Ok(Acquire::Moved(_)) => prop_assert!(false, "nothing moved"),
                        Err(e) => {
                            prop_assert!(matches!(e.kind, ErrorKind::QueueFull | ErrorKind::Starting));
                            prop_assert!(e.retry_after.is_some());
                            prop_assert_eq!(held, max_pending as usize, "refused only when the queue is full");
                        }
                    }
                }
                Op::Finish(i) if !running.is_empty() => {
                    let g = running.swap_remove(i % running.len());
                    drop(g);
                }
                Op::Cancel(i) if !waiting.is_empty() => {
                    let w = waiting.remove(i % waiting.len());
                    drop(w);
                }
                Op::AddReplica(concurrency) => {
                    next_id += 1;
                    let r = Arc::new(ReplicaHandle::new(
                        format!("p-{next_id}"),
                        warmgate_deploy::TargetId::revision("p", 1),
                        "p-00001".into(),
                        "127.0.0.1:9".parse().expect("addr"),
                        concurrency,
                        Instant::now(),
                    ));
                    replicas.push(r.clone());
                    routed.push(r.clone());
                    app.add_replica(r);
                }
                Op::RemoveReplica(i) if !routed.is_empty() => {
                    let r = routed.swap_remove(i % routed.len());
                    r.set_unroutable();
                    app.remove_replica(&r);
                }
                _ => {}
            }

            // Collect grants; they must come oldest first.
            let mut granted_seqs = Vec::new();
            let mut still = Vec::new();
            for mut w in waiting.drain(..) {
                match w.slot.try_take() {
                    Some(Ok(Slotted::Slot(g, _))) => {
                        granted_seqs.push(w.seq);
                        running.push(g);
                    }
                    Some(Ok(Slotted::Moved(_))) => prop_assert!(false, "nothing moved"),
                    Some(Err(e)) => prop_assert!(false, "unexpected failure {e}"),
                    None => still.push(w),
                }
            }
            if let (Some(last_granted), Some(first_waiting)) =
                (granted_seqs.iter().max(), still.iter().map(|w| w.seq).min())
            {
                prop_assert!(last_granted < &first_waiting, "FIFO: {granted_seqs:?} before {first_waiting}");
            }
            waiting = still;

            // The limit holds on every replica, and nothing leaks.
            for r in &replicas {
                prop_assert!(r.inflight() <= r.concurrency);
            }
            let total: u32 = replicas.iter().map(|r| r.inflight()).sum();
            prop_assert_eq!(total as usize, running.len());
            prop_assert_eq!(app.load(), (total, waiting.len()));
            // Work conserving: nobody waits while a routed replica has room.
            if !waiting.is_empty() {
                for r in &routed {
                    prop_assert!(!r.has_free_slot(), "{} has room while {} wait", r.id, waiting.len());
                }
            }
        }
        drop(running);
        drop(waiting);
        prop_assert_eq!(app.load(), (0, 0));
        for r in &replicas {
            prop_assert_eq!(r.inflight(), 0);
        }
    }
}
