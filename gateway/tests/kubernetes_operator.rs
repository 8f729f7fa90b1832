//! The operator's reconcile loop (kube-runtime's `Controller`, one
//! resource at a time) against a mocked API server (`tower_test`) that
//! holds `ServingApp`s, watches them, takes status patches and records
//! every call. Editing, adding, refusing and deleting one resource
//! touches only its own pods, and statuses are written only on change.
//! Nothing here has met a real API server.

mod kube_mock;

use std::sync::Arc;

use kube_mock::{Cluster, calls_about, eventually, healthz_server, pods_of, ready};
use parking_lot::Mutex;
use serde_json::{Value, json};

fn spec(port: u16, generation: &str) -> Value {
    json!({
        "image": "registry.example/worker:1",
        "env": {"GENERATION": generation},
        "kubernetes": {"port": port},
        "autoscale": {"min": 1, "max": 1},
    })
}

/// How many status patches `name` has had since `from`.
fn status_writes(cluster: &Mutex<Cluster>, from: usize, name: &str) -> usize {
    let call = format!("PATCH servingapps/{name}/status");
    cluster.lock().calls[from..]
        .iter()
        .filter(|c| **c == call)
        .count()
}

fn condition(status: &Value, kind: &str) -> Value {
    status["conditions"]
        .as_array()
        .and_then(|cs| cs.iter().find(|c| c["type"] == kind))
        .cloned()
        .unwrap_or(Value::Null)
}

fn serves(status: &Value, revision: &str) -> bool {
    status["revisions"].as_array().is_some_and(|rs| {
        rs.iter()
            .any(|r| r["id"] == revision && r["traffic"] == 100)
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_resource_is_reconciled_alone_and_its_status_written_only_on_change() {
    let port = healthz_server().await;
    let dir = tempfile::tempdir().expect("dir");
    let state = dir.path().join("state");
    let cluster = Arc::new(Mutex::new(Cluster::default()));
    {
        let mut c = cluster.lock();
        c.put_resource("servingapps", "a", spec(port, "1"));
        c.put_resource("servingapps", "b", spec(port, "1"));
        c.pending.clear();
    }
    let (gw, reconciling, server) = kube_mock::leader_on(&cluster, &state);

    // Both serve, and both statuses say so.
    eventually("a and b are ready and say so", || {
        let c = cluster.lock();
        (ready(&gw, "a")
            && ready(&gw, "b")
            && condition(&c.status_of("servingapps", "a"), "Ready")["status"] == "True"
            && condition(&c.status_of("servingapps", "b"), "Ready")["status"] == "True")
            .then_some(())
    })
    .await;
    let a_pods = pods_of(&cluster, "a");
    assert_eq!(a_pods.len(), 1);
    let a_ready = condition(&cluster.lock().status_of("servingapps", "a"), "Ready");
    let mark = cluster.lock().calls.len();

    // b is edited (a new environment): b rolls to a new pod, and its
    // status follows; a gets no call at all, not even a status write.
    cluster
        .lock()
        .put_resource("servingapps", "b", spec(port, "2"));
    eventually("b serves b-00002 on a new pod, and says so", || {
        let b = pods_of(&cluster, "b");
        let status = cluster.lock().status_of("servingapps", "b");
        (b.len() == 1 && b[0].starts_with("b-00002-") && serves(&status, "b-00002")).then_some(())
    })
    .await;
    let b_calls = calls_about(&cluster, mark, "b");
    assert!(
        b_calls.iter().any(|c| c.starts_with("POST b-00002-"))
            && b_calls.iter().any(|c| c.starts_with("DELETE b-00001-")),
        "{b_calls:?}"
    );
    assert!(status_writes(&cluster, mark, "b") >= 1);
    assert_eq!(
        status_writes(&cluster, mark, "a"),
        0,
        "a's status did not change, so it is not written"
    );
    assert_eq!(
        condition(&cluster.lock().status_of("servingapps", "a"), "Ready"),
        a_ready,
        "a's Ready condition keeps its lastTransitionTime"
    );

    // A resource the operator refuses (it would run a command in the
    // operator's container): Ready=False with the key, a warning event,
    // no pod; the others keep serving.
    let mut bad = spec(port, "1");
    bad["promotion"] = json!({"gate_command": ["sh", "-c", "true"]});
    cluster.lock().put_resource("servingapps", "bad", bad);
    eventually("bad is refused on its status, with an event", || {
        let c = cluster.lock();
        let ready = condition(&c.status_of("servingapps", "bad"), "Ready");
        (ready["status"] == "False"
            && ready["message"]
                .as_str()
                .is_some_and(|m| m.contains("spec.promotion.gate_command"))
            && c.events.iter().any(|(r, n)| r == "Refused" && n == "bad"))
        .then_some(())
    })
    .await;
    assert!(pods_of(&cluster, "bad").is_empty());

    // c is added, then deleted: its pod comes, then goes.
    cluster
        .lock()
        .put_resource("servingapps", "c", spec(port, "1"));
    eventually("c is ready", || ready(&gw, "c").then_some(())).await;
    assert_eq!(pods_of(&cluster, "c").len(), 1);
    cluster.lock().delete_resource("servingapps", "c");
    eventually("c is drained and its pod deleted", || {
        (pods_of(&cluster, "c").is_empty()
            && !gw.status_report().apps.iter().any(|s| s.name == "c"))
        .then_some(())
    })
    .await;

    // Through all of it, a's pod was neither deleted nor made again, and
    // a still serves.
    kube_mock::assert_untouched(&cluster, mark, "a", &a_pods);
    reconciling.abort();
    server.abort();
}
