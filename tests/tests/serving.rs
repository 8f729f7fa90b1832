//! The serving path end to end: scale from zero, limits, the hold queue,
//! streaming.

mod common;

use std::collections::HashSet;

use common::{Gateway, eventually, kind};
use serde_json::{Value, json};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_requests_wake_an_app_from_zero_and_it_scales_back_to_zero() {
    let gw = Gateway::start(
        r#"
        [[apps]]
        name = "echo"
        command = ["{worker}"]
        concurrency = 8
        env = { TEST_WORKER_STARTUP_MS = "300" }
        [apps.autoscale]
        max = 4
        target = 4
        scale_to_zero_after = "2s"
        stable_window = "4s"
        panic_window = "2s"
        "#,
    );
    let before = gw.app_status("echo").await;
    assert_eq!(before["ready"], 0, "starts at zero: {before}");
    assert_eq!(before["scale_to_zero_after_s"], 2.0, "{before}");

    let mut tasks = Vec::new();
    for i in 0..50 {
        let http = gw.http.clone();
        let url = gw.at(&format!("/apps/echo/work?latency_ms=50&i={i}"));
        tasks.push(tokio::spawn(async move {
            let resp = http.post(url).body("x").send().await.expect("send");
            let status = resp.status();
            let cold = resp.headers().contains_key("x-warmgate-cold-start");
            let queued = resp.headers().contains_key("x-warmgate-queued-ms");
            let body: Value = resp.json().await.expect("json");
            (status, cold, queued, body)
        }));
    }
    let mut cold = 0;
    for t in tasks {
        let (status, was_cold, queued, body) = t.await.expect("task");
        assert_eq!(status, 200, "{body}");
        assert!(queued, "X-Warmgate-Queued-Ms is always set");
        assert_eq!(body["path"], "/work", "the /apps/echo prefix is stripped");
        if was_cold {
            cold += 1;
        }
    }
    assert!(cold >= 1, "the requests that woke the app are marked cold");

    let s = gw.app_status("echo").await;
    assert!(
        s["pool"]["last_cold_start"]["ready_seconds"].is_number(),
        "{s}"
    );
    assert!(
        s["handoff_ms"].is_number(),
        "the gateway's share is measured: {s}"
    );

    eventually("the app scales back to zero", || async {
        let s = gw.app_status("echo").await;
        let replicas = s["pool"]["replicas"].as_array().map_or(0, Vec::len);
        (s["desired"] == 0 && replicas == 0).then_some(())
    })
    .await;

    // And it wakes again.
    let resp = gw
        .http
        .get(gw.at("/apps/echo/again"))
        .send()
        .await
        .expect("send");
    assert_eq!(resp.status(), 200);
    assert!(resp.headers().contains_key("x-warmgate-cold-start"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_concurrency_limit_is_never_exceeded() {
    let gw = Gateway::start(
        r#"
        [[apps]]
        name = "limited"
        command = ["{worker}"]
        concurrency = 3
        [apps.autoscale]
        min = 1
        max = 1
        "#,
    );
    gw.wait_ready("limited", 1).await;
    let mut tasks = Vec::new();
    for _ in 0..30 {
        let http = gw.http.clone();
        let url = gw.at("/apps/limited/slow?latency_ms=40");
        tasks.push(tokio::spawn(async move {
            http.get(url).send().await.expect("send").status()
        }));
    }
    for t in tasks {
        assert_eq!(t.await.expect("task"), 200);
    }
    let stats: Value = gw.json("/apps/limited/stats").await;
    assert_eq!(
        stats["peak_in_flight"], 3,
        "the worker saw exactly the limit at its peak: {stats}"
    );
    assert_eq!(stats["requests"], 30);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_hold_queue_answers_429_with_retry_after() {
    let gw = Gateway::start(
        r#"
        [[apps]]
        name = "tiny"
        command = ["{worker}"]
        concurrency = 1
        [apps.autoscale]
        min = 1
        max = 1
        [apps.queue]
        max_pending = 2
        "#,
    );
    gw.wait_ready("tiny", 1).await;

    // One request takes the only slot.
    let first = gw.occupy("tiny", "/apps/tiny/a?latency_ms=3000").await;
    let mut held = Vec::new();
    for _ in 0..2 {
        let http = gw.http.clone();
        held.push(tokio::spawn(http.get(gw.at("/apps/tiny/b")).send()));
    }
    eventually("two requests are held", || async {
        (gw.app_status("tiny").await["queued"] == 2).then_some(())
    })
    .await;
    for _ in 0..3 {
        let resp = gw
            .http
            .get(gw.at("/apps/tiny/c"))
            .send()
            .await
            .expect("send");
        assert_eq!(resp.status(), 429);
        let retry = resp
            .headers()
            .get("retry-after")
            .expect("Retry-After is set")
            .to_str()
            .expect("ascii")
            .parse::<u64>()
            .expect("whole seconds");
        assert!(retry >= 1);
        let body: Value = resp.json().await.expect("json");
        assert_eq!(kind(&body), "queue_full", "{body}");
    }
    assert_eq!(first.await.expect("task").expect("send").status(), 200);
    for h in held {
        let resp = h.await.expect("task").expect("send");
        assert_eq!(resp.status(), 200, "held requests are served in the end");
        let queued: u64 = resp.headers()["x-warmgate-queued-ms"]
            .to_str()
            .expect("ascii")
            .parse()
            .expect("number");
        assert!(queued > 0, "held requests report their wait");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_request_times_out_with_504() {
    let gw = Gateway::start(
        r#"
        [[apps]]
        name = "busy"
        command = ["{worker}"]
        concurrency = 1
        [apps.autoscale]
        min = 1
        max = 1
        [apps.queue]
        timeout = "300ms"
        "#,
    );
    gw.wait_ready("busy", 1).await;
    // One request takes the only slot.
    let first = gw.occupy("busy", "/apps/busy/a?latency_ms=3000").await;
    let resp = gw
        .http
        .get(gw.at("/apps/busy/b"))
        .send()
        .await
        .expect("send");
    assert_eq!(resp.status(), 504);
    let body: Value = resp.json().await.expect("json");
    assert_eq!(kind(&body), "timeout", "{body}");
    assert_eq!(first.await.expect("task").expect("send").status(), 200);
    let s = gw.app_status("busy").await;
    assert_eq!(s["queued"], 0, "the timed-out request left the queue: {s}");
    assert_eq!(s["inflight"], 0, "no slot leaked: {s}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sse_chunks_reach_the_client_as_the_worker_writes_them() {
    let gw = Gateway::start(
        r#"
        [[apps]]
        name = "chat"
        command = ["{worker}"]
        "#,
    );
    let mut resp = gw
        .http
        .post(gw.at("/v1/chat/completions?sse=4&interval_ms=400"))
        .json(&json!({"model": "chat", "messages": [], "stream": true}))
        .send()
        .await
        .expect("send");
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["content-type"], "text/event-stream");
    let first = resp.chunk().await.expect("read").expect("a first chunk");
    let first = String::from_utf8_lossy(&first).to_string();
    assert!(first.contains("tok0"), "{first}");
    assert!(
        !first.contains("[DONE]") && !first.contains("tok3"),
        "the first chunk came before the worker finished: {first}"
    );
    let mut rest = String::new();
    while let Some(c) = resp.chunk().await.expect("read") {
        rest.push_str(&String::from_utf8_lossy(&c));
    }
    assert!(
        rest.contains("tok3") && rest.trim_end().ends_with("data: [DONE]"),
        "{rest}"
    );
    // The slot was released when the stream ended.
    eventually("the stream's slot is released", || async {
        (gw.app_status("chat").await["inflight"] == 0).then_some(())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openai_routing_by_model_and_alias_with_headers() {
    let gw = Gateway::start(
        r#"
        [[apps]]
        name = "a"
        command = ["{worker}"]
        [[apps]]
        name = "b"
        aliases = ["org/model-b"]
        command = ["{worker}"]
        "#,
    );
    let models = gw.json("/v1/models").await;
    let ids: HashSet<&str> = models["data"]
        .as_array()
        .expect("list")
        .iter()
        .filter_map(|m| m["id"].as_str())
        .collect();
    assert_eq!(ids, HashSet::from(["a", "b", "org/model-b"]));

    let resp = gw
        .http
        .post(gw.at("/v1/embeddings"))
        .header("x-request-id", "req-123")
        .json(&json!({"model": "org/model-b", "input": ["hi", "there"]}))
        .send()
        .await
        .expect("send");
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["x-request-id"], "req-123");
    assert_eq!(resp.headers()["x-warmgate-revision"], "b-00001");
    assert!(
        resp.headers()["x-warmgate-replica"]
            .to_str()
            .expect("ascii")
            .starts_with("b-")
    );
    let body: Value = resp.json().await.expect("json");
    assert_eq!(body["data"].as_array().map(Vec::len), Some(2), "{body}");
    assert_eq!(
        body["model"], "org/model-b",
        "the body reached the worker untouched"
    );

    // The other model-addressed routes (OpenAI's Responses, vLLM's
    // rerank, score and tokenizer) reach the app the body names, at the
    // same path.
    for path in [
        "/v1/responses",
        "/v1/rerank",
        "/rerank",
        "/v1/score",
        "/tokenize",
    ] {
        let resp = gw
            .http
            .post(gw.at(path))
            .json(&json!({"model": "org/model-b", "query": "q", "documents": ["d"]}))
            .send()
            .await
            .expect("send");
        assert_eq!(resp.status(), 200, "{path}");
        let body: Value = resp.json().await.expect("json");
        assert_eq!(body["path"], path, "{body}");
        assert!(
            body["replica"]
                .as_str()
                .is_some_and(|r| r.starts_with("b-")),
            "{body}"
        );
    }
    let resp = gw
        .http
        .post(gw.at("/v1/rerank"))
        .json(&json!({"query": "q"}))
        .send()
        .await
        .expect("send");
    assert_eq!(resp.status(), 400, "a route by model needs one");

    // The request id is generated when absent, and reaches the worker.
    let resp = gw
        .http
        .post(gw.at("/apps/a/echo"))
        .send()
        .await
        .expect("send");
    let id = resp.headers()["x-request-id"]
        .to_str()
        .expect("ascii")
        .to_string();
    assert!(!id.is_empty());
    let body: Value = resp.json().await.expect("json");
    assert_eq!(body["headers"]["x-request-id"], id.as_str());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_count_requests_waits_replicas_and_cold_starts() {
    let gw = Gateway::start(
        r#"
        [[apps]]
        name = "m"
        command = ["{worker}"]
        concurrency = 2
        [apps.autoscale]
        min = 0
        max = 1
        "#,
    );
    let mut tasks = Vec::new();
    for _ in 0..10 {
        let http = gw.http.clone();
        let url = gw.at("/apps/m/x?latency_ms=30");
        tasks.push(tokio::spawn(async move {
            http.get(url).send().await.expect("send").status()
        }));
    }
    for t in tasks {
        assert_eq!(t.await.expect("task"), 200);
    }
    let _ = gw.http.get(gw.at("/apps/nope/x")).send().await;
    assert_eq!(
        gw.metric(r#"warmgate_requests_total{app="m",outcome="ok"}"#)
            .await,
        10.0
    );
    // Recorded when each response body ends, which may be a moment after
    // the client has read it.
    eventually("every request's end-to-end time is recorded", || async {
        let n = gw
            .metric(r#"warmgate_request_duration_seconds_count{app="m"}"#)
            .await;
        (n == 10.0).then_some(())
    })
    .await;
    assert_eq!(
        gw.metric(r#"warmgate_request_queued_seconds_count{app="m"}"#)
            .await,
        10.0
    );
    assert!(
        gw.metric(r#"warmgate_request_queued_seconds_sum{app="m"}"#)
            .await
            > 0.0,
        "requests held during the cold start and behind the limit waited"
    );
    assert_eq!(
        gw.metric(r#"warmgate_cold_start_seconds_count{app="m",phase="ready"}"#)
            .await,
        1.0
    );
    eventually("replica gauges and replica-seconds", || async {
        let ready = gw
            .metric(r#"warmgate_replicas{app="m",state="ready"}"#)
            .await;
        let secs = gw
            .metric(r#"warmgate_replica_seconds_total{app="m"}"#)
            .await;
        (ready == 1.0 && secs >= 1.0).then_some(())
    })
    .await;
}
