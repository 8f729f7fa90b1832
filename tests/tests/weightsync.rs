//! In-place weight sync end to end: `POST /v1/pools/{pool}/weights` rolls a
//! new checkpoint out to warm test-worker processes, which fetch it through
//! the gateway; failures and hangs are replaced within the deadline; and
//! tasks that ask for a weights version only run on replicas that have it.

mod common;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use common::{Gateway, checkpoint, eventually, kind};
use serde_json::{Value, json};

fn config(initial: &str, replicas: u32, extra: &str) -> String {
    format!(
        r#"
        [[pools]]
        name = "rollouts"
        command = ["{{worker}}"]
        checkpoint = "{initial}"
        replicas = [{replicas}, {replicas}]
        concurrency = 2
        {extra}
        {allow}
        "#,
        allow = common::allow_temp_checkpoints()
    )
}

async fn sync(gw: &Gateway, body: Value) -> (u16, Value) {
    gw.post("/v1/pools/rollouts/weights", &body).await
}

async fn task(gw: &Gateway, body: Value) -> (u16, Value) {
    gw.post("/v1/pools/rollouts/tasks", &body).await
}

/// The pool's replicas as the pool manager reports them.
async fn replicas(gw: &Gateway) -> Vec<Value> {
    let s = gw.json("/v1/status").await;
    s["pools"][0]["pool"]["replicas"]
        .as_array()
        .cloned()
        .unwrap_or_default()
}

async fn wait_ready(gw: &Gateway, n: usize) -> Vec<Value> {
    eventually(&format!("{n} ready replicas"), || async {
        let rs = replicas(gw).await;
        let ready: Vec<Value> = rs.into_iter().filter(|r| r["state"] == "ready").collect();
        (ready.len() == n).then_some(ready)
    })
    .await
}

/// Waits for `n` ready replicas on weights `version`; returns them.
async fn ready_on(gw: &Gateway, n: usize, version: u64) -> Vec<Value> {
    eventually(
        &format!("{n} ready replicas on version {version}"),
        || async {
            let ok: Vec<Value> = replicas(gw)
                .await
                .into_iter()
                .filter(|r| r["state"] == "ready" && r["weights_version"] == version)
                .collect();
            (ok.len() == n).then_some(ok)
        },
    )
    .await
}

/// A worker's `/stats`, straight from its own port.
async fn stats(gw: &Gateway, replica: &Value) -> Value {
    let _ = gw;
    common::replica_json(replica["addr"].as_str().expect("addr"), "/stats").await
}

fn root() -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().expect("tmp");
    let path = dir.path().to_path_buf();
    (dir, path)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn weights_roll_out_in_place_one_replica_at_a_time() {
    let (_keep, root) = root();
    let (v0, sha0) = checkpoint(&root, "v0", 300_000);
    let (v1, sha1) = checkpoint(&root, "v1", 1_000_000);
    let gw = Gateway::start(&config(&v0, 3, ""));
    let before = wait_ready(&gw, 3).await;
    for r in &before {
        let st = stats(&gw, r).await;
        assert_eq!(st["weights"]["sha256"], sha0.as_str(), "loaded at start");
        assert_eq!(r["weights_version"], 0);
    }
    let pids: Vec<Value> = before.iter().map(|r| r["pid"].clone()).collect();
    // The workers reported their weight loads: a cold-start phase of its own.
    assert_eq!(
        gw.metric(r#"warmgate_cold_start_seconds_count{pool="rollouts",phase="weights"}"#)
            .await,
        3.0
    );
    // A pool's series carry the `pool` label, never `app`.
    eventually("the pool's ready replicas on /metrics", || async {
        (gw.metric(r#"warmgate_replicas{pool="rollouts",state="ready"}"#)
            .await
            == 3.0)
            .then_some(())
    })
    .await;
    let text = gw.metrics_text().await;
    assert!(
        !text.contains(r#"app="rollouts""#),
        "a pool is labelled as a pool: {text}"
    );
    let s = gw.json("/v1/status").await;
    assert!(
        s["pools"][0]["pool"]["last_cold_start"]["weights_seconds"].is_number(),
        "{s}"
    );

    let (status, body) = sync(
        &gw,
        json!({"checkpoint": v1, "version": 1, "max_unavailable": 1}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["synced"], 3, "{body}");
    assert_eq!(body["replaced"], 0, "{body}");
    for r in body["replicas"].as_array().expect("replicas") {
        assert_eq!(r["ok"], true, "{r}");
        assert_eq!(r["from_version"], 0);
        assert_eq!(r["version"], 1);
    }

    // Same processes (no restart), new weights, new version everywhere.
    let after = wait_ready(&gw, 3).await;
    let mut windows = Vec::new();
    for r in &after {
        assert!(pids.contains(&r["pid"]), "{r} was restarted");
        assert_eq!(r["weights_version"], 1);
        let st = stats(&gw, r).await;
        assert_eq!(st["weights"]["sha256"], sha1.as_str());
        assert_eq!(st["weights"]["bytes"], 1_000_000);
        windows.push((
            st["weights"]["started_ms"].as_u64().expect("start"),
            st["weights"]["finished_ms"].as_u64().expect("end"),
        ));
    }
    // max_unavailable = 1: no two replicas were loading at the same time.
    windows.sort();
    for w in windows.windows(2) {
        assert!(w[0].1 <= w[1].0, "loads overlapped: {windows:?}");
    }

    let s = gw.json("/v1/status").await;
    assert_eq!(s["pools"][0]["weights_version"], 1);
    // `warmgate status` shows the pool's version and each replica's.
    let out = std::process::Command::new(common::bin("warmgate"))
        .args(["status", "--gateway", &gw.url])
        .output()
        .expect("warmgate status");
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{table}");
    let pool_line = table
        .lines()
        .find(|l| l.starts_with("rollouts"))
        .unwrap_or_else(|| panic!("no pool line in\n{table}"));
    assert!(pool_line.trim_end().ends_with("v1"), "{table}");
    assert_eq!(
        table
            .lines()
            .filter(|l| l.trim_start().starts_with("rollouts-") && l.contains(" v1 "))
            .count(),
        3,
        "{table}"
    );

    // Tasks see the version; a version not yet synced is refused at once.
    let (status, out) = task(&gw, json!({"input": 1, "min_weights_version": 1})).await;
    assert_eq!(status, 200, "{out}");
    assert_eq!(out["weights_version"], 1);
    assert_eq!(out["output"]["weights_version"], 1);
    let (status, out) = task(&gw, json!({"input": 1, "min_weights_version": 2})).await;
    assert_eq!(status, 409, "{out}");
    assert_eq!(kind(&out), "conflict");

    // Bad requests say what is wrong (going back a version is a new
    // version: `a_sync_no_replica_can_load_is_rolled_back_...`).
    let (status, out) = sync(&gw, json!({"checkpoint": "nope://x", "version": 2})).await;
    assert_eq!(status, 400, "{out}");
    let missing = format!("file://{}", root.join("absent").display());
    let (status, out) = sync(&gw, json!({"checkpoint": missing, "version": 2})).await;
    assert_eq!(status, 404, "{out}");
    let (status, out) = sync(&gw, json!({"version": 2})).await;
    assert_eq!(status, 400, "{out}");
    assert!(
        out["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("checkpoint")),
        "{out}"
    );
    let (status, out) = sync(
        &gw,
        json!({"checkpoint": v1, "version": 2, "max_unavailable": "0%"}),
    )
    .await;
    assert_eq!(status, 400, "{out}");
    // None of the refused syncs moved the pool's version.
    let s = gw.json("/v1/status").await;
    assert_eq!(s["pools"][0]["weights_version"], 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failing_and_hanging_replicas_are_replaced_within_the_deadline() {
    let (_keep, root) = root();
    let (v0, _) = checkpoint(&root, "v0", 10_000);
    let (v1, sha1) = checkpoint(&root, "v1", 200_000);
    // Lenient probes: the replicas are named, so one replaced because a
    // loaded machine answered its probe late would change the outcome.
    let extra = r#"env = { TEST_WORKER_WEIGHTS_FAIL = "rollouts-1", TEST_WORKER_WEIGHTS_HANG = "rollouts-2" }
        [pools.health]
        timeout = "10s"
        failure_threshold = 10"#;
    let gw = Gateway::start(&config(&v0, 3, extra));
    wait_ready(&gw, 3).await;

    let started = Instant::now();
    let (status, body) = sync(
        &gw,
        json!({"checkpoint": v1, "version": 1, "max_unavailable": "100%", "timeout": "3s"}),
    )
    .await;
    let took = started.elapsed();
    assert_eq!(status, 200, "{body}");
    // The hung replica did not hold the sync past its deadline (the bound
    // is loose: this checks "did not hang", not speed).
    assert!(took < Duration::from_secs(30), "took {took:?}");
    assert_eq!(body["synced"], 1, "{body}");
    assert_eq!(body["replaced"], 2, "{body}");
    let by_id = |id: &str| {
        body["replicas"]
            .as_array()
            .and_then(|rs| rs.iter().find(|r| r["replica"] == id).cloned())
            .unwrap_or_else(|| panic!("{id} not in {body}"))
    };
    let failed = by_id("rollouts-1");
    assert_eq!(failed["action"], "replaced");
    assert!(
        failed["error"].as_str().is_some_and(|e| e.contains("500")),
        "{failed}"
    );
    let hung = by_id("rollouts-2");
    assert_eq!(hung["action"], "replaced");
    assert!(
        hung["error"]
            .as_str()
            .is_some_and(|e| e.contains("deadline")),
        "{hung}"
    );
    assert_eq!(by_id("rollouts-3")["ok"], true);

    // The replacements start with the new weights: the pool converges.
    let ready = ready_on(&gw, 3, 1).await;
    for r in &ready {
        assert!(
            r["id"] != "rollouts-1" && r["id"] != "rollouts-2",
            "{r} should have been replaced"
        );
        let st = stats(&gw, r).await;
        assert_eq!(st["weights"]["sha256"], sha1.as_str(), "{r}");
    }
    let (status, out) = task(&gw, json!({"input": 1, "min_weights_version": 1})).await;
    assert_eq!(status, 200, "{out}");
    assert_eq!(out["output"]["weights_version"], 1);
}

/// A checkpoint the workers crash on is synced to a pool serving version
/// 1: the first replica to try it fails, the sync stops and rolls back
/// (502, with the worker's words), the pool keeps serving version 1 on
/// every replica, and syncing an older checkpoint afterwards is a new
/// version rather than a conflict.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sync_no_replica_can_load_is_rolled_back_and_the_pool_keeps_serving() {
    let (_keep, root) = root();
    let (v0, sha0) = checkpoint(&root, "v0", 10_000);
    let (v1, sha1) = checkpoint(&root, "v1", 20_000);
    let (bad, _) = checkpoint(&root, "bad", 10_000);
    std::fs::write(root.join("bad").join("CRASH"), "yes").expect("write");
    let gw = Gateway::start(&config(&v0, 2, ""));
    wait_ready(&gw, 2).await;
    let (status, out) = sync(&gw, json!({"checkpoint": v1, "version": 1})).await;
    assert_eq!(status, 200, "{out}");

    let r = gw
        .http
        .post(gw.at("/v1/pools/rollouts/weights"))
        .json(&json!({"checkpoint": bad, "version": 2}))
        .send()
        .await
        .expect("sync");
    assert_eq!(r.status().as_u16(), 502);
    assert_eq!(r.headers()["x-should-retry"], "false");
    let out: Value = r.json().await.expect("json");
    let msg = out["error"]["message"].as_str().unwrap_or_default();
    assert!(
        msg.contains("rolled back")
            && msg.contains("keeps version 1")
            && msg.contains("CUDA out of memory"),
        "{out}"
    );
    let s = gw.json("/v1/status").await;
    assert_eq!(s["pools"][0]["weights_version"], 1, "{s}");
    assert!(s["pools"][0]["syncing_to"].is_null(), "{s}");
    // Every replica serves version 1 again, the failed one replaced.
    let ready = ready_on(&gw, 2, 1).await;
    for r in &ready {
        assert_eq!(
            stats(&gw, r).await["weights"]["sha256"],
            sha1.as_str(),
            "{r}"
        );
    }
    let (status, out) = task(&gw, json!({"input": 1, "min_weights_version": 1})).await;
    assert_eq!(status, 200, "{out}");
    let (status, out) = task(&gw, json!({"input": 1, "min_weights_version": 2})).await;
    assert_eq!(status, 409, "version 2 was never served: {out}");

    // Back to the first checkpoint: a new version, 2, not a conflict.
    let (status, out) = sync(&gw, json!({"checkpoint": v0, "version": 0})).await;
    assert_eq!(status, 200, "{out}");
    assert_eq!(
        (out["version"].as_u64(), out["asked_version"].as_u64()),
        (Some(2), Some(0)),
        "{out}"
    );
    let ready = ready_on(&gw, 2, 2).await;
    for r in &ready {
        assert_eq!(
            stats(&gw, r).await["weights"]["sha256"],
            sha0.as_str(),
            "{r}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tasks_keep_flowing_during_a_rolling_sync() {
    let (_keep, root) = root();
    let (v0, _) = checkpoint(&root, "v0", 10_000);
    let (v1, _) = checkpoint(&root, "v1", 20_000);
    // rollouts-1 never finishes loading: for the whole 4 s sync, the other
    // replica must keep taking tasks, and none may be lost.
    let extra = r#"env = { TEST_WORKER_WEIGHTS_HANG = "rollouts-1" }"#;
    let gw = Gateway::start(&config(&v0, 2, extra));
    wait_ready(&gw, 2).await;
    let syncing = {
        let http = gw.http.clone();
        let url = gw.at("/v1/pools/rollouts/weights");
        tokio::spawn(async move {
            http.post(url)
                .json(
                    &json!({"checkpoint": v1, "version": 1, "max_unavailable": 1, "timeout": "4s"}),
                )
                .send()
                .await
                .expect("sync")
                .json::<Value>()
                .await
                .expect("json")
        })
    };
    eventually("the sync is under way", || async {
        let s = gw.json("/v1/status").await;
        (s["pools"][0]["syncing_to"] == 1).then_some(())
    })
    .await;
    let mut served = 0;
    while !syncing.is_finished() {
        let (status, out) = task(&gw, json!({"input": {"sleep_ms": 20}})).await;
        assert_eq!(status, 200, "{out}");
        served += 1;
    }
    let body = syncing.await.expect("join");
    // Done, or (when the hung replica's turn came first and took the whole
    // deadline) rolled back with the pool on version 0: either way the
    // other replica served throughout.
    let rolled_back = body["error"]["message"]
        .as_str()
        .is_some_and(|m| m.contains("rolled back") && m.contains("keeps version 0"));
    assert!(body["version"] == 1 || rolled_back, "{body}");
    assert!(served > 0, "no task ran during the sync");
}

/// Workers that read each file where the manifest says it lies (the
/// Python kit's way on the local backend; the test worker's with
/// `TEST_WORKER_WEIGHTS_LOCAL=1`) load a `file://` checkpoint, at start and
/// in a sync, with every byte right and none of it through the gateway.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_on_this_machine_read_the_files_where_they_lie() {
    let (_keep, root) = root();
    let (v0, sha0) = checkpoint(&root, "v0", 300_000);
    let (v1, sha1) = checkpoint(&root, "v1", 1_000_000);
    let extra = r#"env = { TEST_WORKER_WEIGHTS_LOCAL = "1" }"#;
    let gw = Gateway::start(&config(&v0, 2, extra));
    for r in &wait_ready(&gw, 2).await {
        let st = stats(&gw, r).await;
        assert_eq!(st["weights"]["sha256"], sha0.as_str(), "loaded at start");
    }
    let (status, body) = sync(
        &gw,
        json!({"checkpoint": v1, "version": 1, "max_unavailable": "100%"}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["synced"], 2, "{body}");
    for r in &wait_ready(&gw, 2).await {
        let st = stats(&gw, r).await;
        assert_eq!(st["weights"]["sha256"], sha1.as_str(), "{st}");
        assert_eq!(st["weights"]["bytes"], 1_000_000, "{st}");
    }
    // Not a byte went through the gateway's store reader or its cache.
    for series in [
        "warmgate_weights_store_bytes_total",
        "warmgate_weights_cache_bytes_total",
    ] {
        assert_eq!(gw.metric(series).await, 0.0, "{series}");
    }
}
