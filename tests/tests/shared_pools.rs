//! One warm pool for rollouts and inference: an app served by a pool's
//! replicas (`[[apps]] pool = ...`) takes OpenAI requests on the same
//! worker processes that run the pool's tasks, under one per-replica
//! limit; a weight sync in the middle moves both kinds of work to the new
//! version; requests can ask for a minimum version.

mod common;

use std::collections::BTreeSet;
use std::sync::Arc;

use common::{Gateway, checkpoint, eventually, kind, replica_json};
use serde_json::{Value, json};

const MIN_VERSION: &str = "x-warmgate-min-weights-version";

fn config(initial: &str, replicas: [u32; 2], extra: &str) -> String {
    format!(
        r#"
        [[pools]]
        name = "policy"
        command = ["{{worker}}"]
        checkpoint = "{initial}"
        replicas = [{min}, {max}]
        concurrency = 2
        {extra}

        [[apps]]
        name = "policy-chat"
        aliases = ["tiny-lm"]
        pool = "policy"
        {allow}
        "#,
        min = replicas[0],
        max = replicas[1],
        allow = common::allow_temp_checkpoints()
    )
}

/// The pool's ready replicas as `/v1/status` lists them.
async fn ready_replicas(gw: &Gateway, n: usize) -> Vec<Value> {
    eventually(&format!("{n} ready replicas"), || async {
        let s = gw.json("/v1/status").await;
        let rs: Vec<Value> = s["pools"][0]["pool"]["replicas"]
            .as_array()
            .cloned()
            .unwrap_or_default()
            .into_iter()
            .filter(|r| r["state"] == "ready")
            .collect();
        (rs.len() == n).then_some(rs)
    })
    .await
}

/// One chat completion: status, the replica and the version the worker
/// says it ran on, and the body.
async fn chat(
    http: &reqwest::Client,
    url: &str,
    latency_ms: u64,
    min_version: Option<&str>,
) -> (u16, String, Option<u64>, Value) {
    let mut req = http
        .post(format!("{url}/v1/chat/completions"))
        .header("x-test-latency-ms", latency_ms.to_string())
        .json(&json!({"model": "tiny-lm", "messages": [{"role": "user", "content": "hi"}]}));
    if let Some(v) = min_version {
        req = req.header(MIN_VERSION, v);
    }
    let r = req.send().await.expect("send");
    let status = r.status().as_u16();
    let header = |n: &str| {
        r.headers()
            .get(n)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
    };
    let replica = header("x-warmgate-replica").unwrap_or_default();
    let version = header("x-worker-weights-version").and_then(|v| v.parse().ok());
    (
        status,
        replica,
        version,
        r.json().await.unwrap_or(Value::Null),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_and_tasks_share_the_replicas_through_a_weight_sync() {
    let dir = tempfile::tempdir().expect("tmp");
    let (v0, _) = checkpoint(dir.path(), "v0", 200_000);
    let (v1, sha1) = checkpoint(dir.path(), "v1", 400_000);
    let gw = Gateway::start(&config(&v0, [2, 2], ""));
    let replicas = ready_replicas(&gw, 2).await;

    // Both kinds of work at once, more than the two replicas' four slots,
    // with a weight sync in the middle; the requests go on alone at the
    // end, more of them than there are slots.
    let mut requests = Vec::new();
    for _ in 0..6 {
        let (http, url) = (gw.http.clone(), gw.url.clone());
        requests.push(tokio::spawn(async move {
            let mut seen = Vec::new();
            for _ in 0..10 {
                seen.push(chat(&http, &url, 60, None).await);
            }
            seen
        }));
    }
    let mut tasks = Vec::new();
    for _ in 0..6 {
        let (http, url) = (gw.http.clone(), gw.url.clone());
        tasks.push(tokio::spawn(async move {
            let mut seen = Vec::new();
            for _ in 0..4 {
                let r = http
                    .post(format!("{url}/v1/pools/policy/tasks"))
                    .json(&json!({"input": {"sleep_ms": 60}}))
                    .send()
                    .await
                    .expect("send");
                seen.push((r.status().as_u16(), r.json::<Value>().await.expect("json")));
            }
            seen
        }));
    }
    // Once both kinds have run, sync the new weights.
    eventually("both kinds of work running", || async {
        let s = gw.json("/v1/status").await;
        let p = &s["pools"][0];
        (p["requests_inflight"].as_u64() > Some(0) && p["inflight"].as_u64() > Some(0))
            .then_some(())
    })
    .await;
    let (status, synced) = gw
        .post(
            "/v1/pools/policy/weights",
            &json!({"checkpoint": v1, "version": 1, "max_unavailable": 1}),
        )
        .await;
    assert_eq!(status, 200, "{synced}");
    assert_eq!(synced["synced"], 2, "{synced}");

    let mut by_replica: std::collections::BTreeMap<String, (u32, u32)> = Default::default();
    let mut versions = BTreeSet::new();
    for h in requests {
        for (status, replica, version, body) in h.await.expect("join") {
            assert_eq!(status, 200, "a request failed during the sync: {body}");
            versions.insert(version.expect("the worker names its version"));
            by_replica.entry(replica).or_default().0 += 1;
        }
    }
    for h in tasks {
        for (status, out) in h.await.expect("join") {
            assert_eq!(status, 200, "a task failed during the sync: {out}");
            let replica = out["replica"].as_str().expect("replica").to_string();
            by_replica.entry(replica).or_default().1 += 1;
        }
    }
    // The same processes ran both kinds: each replica answered requests
    // and tasks, and no worker ever ran more than its limit of both.
    assert_eq!(by_replica.len(), 2, "{by_replica:?}");
    for (replica, (reqs, tasks)) in &by_replica {
        assert!(
            *reqs > 0 && *tasks > 0,
            "{replica} ran {reqs} requests and {tasks} tasks"
        );
    }
    for r in &replicas {
        let addr = r["addr"].as_str().expect("addr");
        let stats: Value = replica_json(addr, "/stats").await;
        let peak = stats["peak_in_flight"].as_u64().expect("peak");
        assert!(
            (1..=2).contains(&peak),
            "a worker ran {peak} requests and tasks at once: {stats}"
        );
        assert_eq!(stats["weights"]["sha256"], sha1.as_str(), "{stats}");
    }
    assert!(
        versions.contains(&0),
        "requests ran before the sync: {versions:?}"
    );

    // After the sync both kinds run on the new weights.
    let (status, _, version, body) = chat(&gw.http, &gw.url, 0, None).await;
    assert_eq!((status, version), (200, Some(1)), "{body}");
    let (status, out) = gw
        .post(
            "/v1/pools/policy/tasks",
            &json!({"input": {}, "min_weights_version": 1}),
        )
        .await;
    assert_eq!(status, 200, "{out}");
    assert_eq!(out["output"]["weights_version"], 1, "{out}");

    // A request may pin a version it has; a version not yet synced is
    // refused at once, and a malformed one is a bad request.
    let (status, _, version, body) = chat(&gw.http, &gw.url, 0, Some("1")).await;
    assert_eq!((status, version), (200, Some(1)), "{body}");
    // (Held, it would have waited for the queue timeout and got 504.)
    let (status, _, _, body) = chat(&gw.http, &gw.url, 0, Some("2")).await;
    assert_eq!(status, 409, "{body}");
    assert_eq!(kind(&body), "conflict");
    assert!(
        body["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("version 2")),
        "{body}"
    );
    let (status, _, _, body) = chat(&gw.http, &gw.url, 0, Some("latest")).await;
    assert_eq!(status, 400, "{body}");

    // The app shows the pool it runs on; it has no revisions to promote,
    // and the pool cannot go while it serves the app.
    let s = gw.app_status("policy-chat").await;
    assert_eq!(s["served_by"], "policy", "{s}");
    assert_eq!(s["ready"], 2, "{s}");
    let (status, body) = gw
        .post("/v1/apps/policy-chat/promote", &json!({"checkpoint": v1}))
        .await;
    assert_eq!(status, 409, "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("/v1/pools/policy/weights")),
        "{body}"
    );
    let r = gw
        .http
        .delete(gw.at("/v1/pools/policy"))
        .send()
        .await
        .expect("delete");
    assert_eq!(r.status(), 409);
    // The worker contract's control paths are the gateway's alone: a
    // data-plane client cannot load weights or run a task through the
    // passthrough, however it spells the path.
    for path in [
        "/apps/policy-chat/weights",
        "/apps/tiny-lm//Weights/",
        "/apps/policy-chat/x/../invoke",
        "/apps/policy-chat/%77eights",
        "/apps/policy-chat/./invoke?x=1",
    ] {
        let r = gw
            .http
            .post(gw.at(path))
            .json(&json!({"url": "http://127.0.0.1:9/x", "version": 9}))
            .send()
            .await
            .expect("send");
        assert_eq!(r.status(), 404, "{path}");
    }
    let s = gw.json("/v1/status").await;
    assert_eq!(s["pools"][0]["weights_version"], 1, "{s}");
    let models: Value = gw.json("/v1/models").await;
    let ids: Vec<&str> = models["data"]
        .as_array()
        .expect("data")
        .iter()
        .filter_map(|m| m["id"].as_str())
        .collect();
    assert!(
        ids.contains(&"policy-chat") && ids.contains(&"tiny-lm"),
        "{ids:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_wakes_a_shared_pool_at_zero_and_waits_for_a_synced_version() {
    let dir = tempfile::tempdir().expect("tmp");
    let (v0, _) = checkpoint(dir.path(), "v0", 1000);
    let gw = Arc::new(Gateway::start(&config(&v0, [0, 1], "")));
    // Nothing runs until a request comes; the request wakes the pool.
    let s = gw.json("/v1/status").await;
    assert_eq!(s["pools"][0]["ready"], 0, "{s}");
    let (status, replica, version, body) = chat(&gw.http, &gw.url, 0, None).await;
    assert_eq!(status, 200, "{body}");
    assert!(replica.starts_with("policy-"), "{replica}");
    assert_eq!(version, Some(0));
    // A version that is synced but not yet loaded is waited for, not
    // refused: the request runs once the replica has it.
    let (v1, _) = checkpoint(dir.path(), "v1", 1000);
    let sync = {
        let gw = gw.clone();
        tokio::spawn(async move {
            gw.post(
                "/v1/pools/policy/weights",
                &json!({"checkpoint": v1, "version": 1}),
            )
            .await
        })
    };
    eventually("the sync to begin", || async {
        let s = gw.json("/v1/status").await;
        (s["pools"][0]["weights_version"] == 1).then_some(())
    })
    .await;
    let (status, _, version, body) = chat(&gw.http, &gw.url, 0, Some("1")).await;
    assert_eq!((status, version), (200, Some(1)), "{body}");
    let (status, synced) = sync.await.expect("join");
    assert_eq!(status, 200, "{synced}");
}
