//! Work that stops when nobody waits for it: a task or a batch cancelled
//! through the API, a client that leaves.

mod common;

use common::{Gateway, eventually, kind};
use futures_util::StreamExt as _;
use serde_json::{Value, json};

/// A pool of two test workers running four tasks each.
fn pool() -> &'static str {
    r#"
    [[pools]]
    name = "rollouts"
    command = ["{worker}"]
    replicas = [2, 2]
    concurrency = 4
    "#
}

/// The ready replicas' addresses.
async fn replicas(gw: &Gateway) -> Vec<String> {
    let s = gw.json("/v1/status").await;
    s["pools"][0]["pool"]["replicas"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .iter()
        .filter(|r| r["state"] == "ready")
        .filter_map(|r| r["addr"].as_str().map(str::to_string))
        .collect()
}

/// `/invoke` calls the workers began, and those running now.
async fn worker_counts(addrs: &[String]) -> (u64, u64) {
    let (mut started, mut running) = (0, 0);
    for a in addrs {
        let s = common::replica_json(a, "/stats").await;
        started += s["requests"].as_u64().expect("requests");
        running += s["in_flight"].as_u64().expect("in_flight");
    }
    (started, running)
}

async fn ready_pool(gw: &Gateway) -> Vec<String> {
    eventually("two ready replicas", || async {
        let a = replicas(gw).await;
        (a.len() == 2).then_some(a)
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_cancelled_after_20_runs_no_more_than_those_in_flight() {
    let gw = Gateway::start(pool());
    let addrs = ready_pool(&gw).await;
    let inputs: Vec<Value> = (0..200).map(|i| json!({"i": i, "sleep_ms": 150})).collect();
    let r = gw
        .http
        .post(gw.at("/v1/pools/rollouts/tasks/batch"))
        .json(&json!({"inputs": inputs, "retries": 0}))
        .send()
        .await
        .expect("send");
    assert_eq!(r.status(), 200);
    let batch = r.headers()["x-warmgate-batch-id"]
        .to_str()
        .expect("id")
        .to_string();
    let mut body = r.bytes_stream();
    let mut buf = Vec::new();
    let mut lines: Vec<Value> = Vec::new();
    let take_lines = |buf: &mut Vec<u8>, lines: &mut Vec<Value>| {
        while let Some(i) = buf.iter().position(|b| *b == b'\n') {
            let line: Vec<u8> = buf.drain(..=i).collect();
            lines.push(serde_json::from_slice(&line).expect("a JSON line"));
        }
    };
    while lines.iter().filter(|l| l.get("output").is_some()).count() < 20 {
        let chunk = body.next().await.expect("more lines").expect("bytes");
        buf.extend_from_slice(&chunk);
        take_lines(&mut buf, &mut lines);
    }
    let cancel = gw
        .http
        .delete(gw.at(&format!("/v1/batches/{batch}")))
        .send()
        .await
        .expect("delete");
    assert_eq!(cancel.status(), 200);
    // From here on nothing starts (a call already on its way to a worker
    // was in flight, and is cut).
    let (started, running) = worker_counts(&addrs).await;
    while let Some(chunk) = body.next().await {
        buf.extend_from_slice(&chunk.expect("bytes"));
        take_lines(&mut buf, &mut lines);
    }
    assert_eq!(lines.len(), 200, "one line per input");
    let done = lines.iter().filter(|l| l.get("output").is_some()).count() as u64;
    let cancelled = lines
        .iter()
        .filter(|l| l["error"]["kind"] == "cancelled")
        .count() as u64;
    assert_eq!(done + cancelled, 200, "every task done or cancelled");
    let (after, _) = worker_counts(&addrs).await;
    // What began and did not finish was in flight when it was cancelled:
    // at most the pool's eight slots.
    assert!(
        after - done <= 8,
        "began {after}, done {done}: more than the 8 in flight were cut"
    );
    eprintln!(
        "batch of 200 cancelled after 20 finished lines: {done} done, {cancelled} cancelled, {after} run at all ({} cut while running; {started} begun and {running} still running as the DELETE answered)",
        after - done
    );
    // The cut ones stop at once: the workers see their clients leave.
    eventually("the workers idle", || async {
        (worker_counts(&addrs).await.1 == 0).then_some(())
    })
    .await;
    // The batch is gone once its stream ended.
    let again = gw
        .http
        .delete(gw.at(&format!("/v1/batches/{batch}")))
        .send()
        .await
        .expect("delete");
    assert_eq!(again.status(), 404);
    // Tasks that were submitted and cancelled count as such; those never
    // submitted were never tasks.
    let submitted_cancelled = lines
        .iter()
        .filter(|l| l["error"]["kind"] == "cancelled" && l["id"].is_string())
        .count();
    let metric = gw
        .metric(r#"warmgate_tasks_total{pool="rollouts",outcome="cancelled"}"#)
        .await;
    assert_eq!(metric as usize, submitted_cancelled);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_is_cancelled_queued_or_running_and_a_leaving_client_cancels_its_own() {
    let gw = Gateway::start(pool());
    let addrs = ready_pool(&gw).await;
    let submit = |input: Value| {
        let (http, url) = (
            gw.http.clone(),
            gw.at("/v1/pools/rollouts/tasks?async=true"),
        );
        async move {
            let r = http
                .post(url)
                .json(&json!({"input": input}))
                .send()
                .await
                .expect("send");
            assert_eq!(r.status(), 202);
            r.json::<Value>().await.expect("json")["id"]
                .as_str()
                .expect("id")
                .to_string()
        }
    };
    // Eight long tasks fill the slots; the ninth waits in the queue.
    let mut long = Vec::new();
    for i in 0..8 {
        long.push(submit(json!({"i": i, "sleep_ms": 30_000})).await);
    }
    let queued = submit(json!({"queued": true})).await;
    eventually("eight running", || async {
        (worker_counts(&addrs).await.1 == 8).then_some(())
    })
    .await;
    let (started, _) = worker_counts(&addrs).await;

    let delete = |id: String| {
        let (http, url) = (gw.http.clone(), gw.at(&format!("/v1/tasks/{id}")));
        async move {
            let r = http.delete(url).send().await.expect("delete");
            (r.status().as_u16(), r.json::<Value>().await.expect("json"))
        }
    };
    let (status, body) = delete(queued.clone()).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["state"], "cancelled", "{body}");
    assert_eq!(body["cancelled"], "queued", "{body}");
    let (status, body) = delete(long[0].clone()).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        (body["state"].as_str(), body["cancelled"].as_str()),
        (Some("cancelled"), Some("running")),
        "{body}"
    );
    // The worker's call was dropped, and the queued task never ran.
    eventually("seven running", || async {
        (worker_counts(&addrs).await.1 == 7).then_some(())
    })
    .await;
    let read = gw.json(&format!("/v1/tasks/{}", long[0])).await;
    assert_eq!(read["state"], "cancelled", "{read}");
    assert_eq!(read["error"]["kind"], "cancelled", "{read}");
    // A cancelled task cannot be cancelled again into another state; an
    // unknown one is not found.
    let (status, body) = delete(long[0].clone()).await;
    assert_eq!((status, body["state"].as_str()), (200, Some("cancelled")));
    let (status, body) = delete("rollouts-nope".into()).await;
    assert_eq!((status, kind(&body)), (404, "not_found"), "{body}");

    // A client waiting on a task that leaves: its task is cancelled.
    let waiting = {
        let (http, url) = (gw.http.clone(), gw.at("/v1/pools/rollouts/tasks"));
        tokio::spawn(async move {
            let _ = http
                .post(url)
                .json(&json!({"input": {"sleep_ms": 30_000}}))
                .send()
                .await;
        })
    };
    eventually("the waiting client's task running", || async {
        (worker_counts(&addrs).await.1 == 8).then_some(())
    })
    .await;
    waiting.abort();
    eventually("its task stopped with its client", || async {
        (worker_counts(&addrs).await.1 == 7).then_some(())
    })
    .await;
    // The CLI cancels one; the API the rest.
    let (code, out, err) = gw.warmgate(&["cancel", &long[1]]);
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(
        out.trim(),
        format!("task {}: cancelled (it was running)", long[1])
    );
    let (code, _, err) = gw.warmgate(&["cancel", &long[1]]);
    assert_eq!(code, Some(0), "cancelling a cancelled task again: {err}");
    let (code, _, err) = gw.warmgate(&["cancel", "--batch", "batch-0"]);
    assert_ne!(code, Some(0));
    assert!(err.contains("no batch"), "{err}");
    for id in &long[2..] {
        let (status, _) = delete(id.clone()).await;
        assert_eq!(status, 200);
    }
    eventually("all stopped", || async {
        (worker_counts(&addrs).await.1 == 0).then_some(())
    })
    .await;
    let (after, _) = worker_counts(&addrs).await;
    assert_eq!(
        after,
        started + 1,
        "only the waiting client's task started since"
    );
}

/// An inference request past `limits.request_timeout` is answered `504`
/// and its request to the engine dropped: the engine stops it (the
/// stand-in, as vLLM, aborts a request whose client left).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_past_its_deadline_ends_the_engine_s_work() {
    let gw = Gateway::start(&format!(
        r#"
        [limits]
        request_timeout = "1s"
        [[apps]]
        name = "llm"
        command = ["python3", "{engine}", "--model", "llm", "--uds", "$WARMGATE_SOCKET",
                   "--prefill-ms-per-token", "20", "--decode-ms-per-token", "1"]
        startup_timeout = "60s"
        [apps.health]
        path = "/health"
        [apps.autoscale]
        min = 1
        "#,
        engine = common::llm_engine()
    ));
    let s = gw.wait_ready("llm", 1).await;
    let addr = s["pool"]["replicas"][0]["addr"]
        .as_str()
        .expect("addr")
        .to_string();
    // Some 500 prompt tokens: ten seconds of prefill.
    let prompt: String = (0..500).map(|i| format!("w{i} ")).collect();
    let slow = {
        let (http, url) = (gw.http.clone(), gw.at("/v1/completions"));
        tokio::spawn(async move {
            let r = http
                .post(url)
                .json(&json!({"model": "llm", "prompt": prompt, "max_tokens": 4}))
                .send()
                .await
                .expect("send");
            (r.status().as_u16(), r.json::<Value>().await.expect("json"))
        })
    };
    eventually("the engine runs it", || async {
        (common::vllm::engine_metric(&addr, "vllm:num_requests_running").await >= 1.0).then_some(())
    })
    .await;
    let (status, body) = slow.await.expect("the request");
    assert_eq!((status, kind(&body)), (504, "timeout"), "{body}");
    let answered = std::time::Instant::now();
    eventually("the engine dropped it", || async {
        (common::vllm::engine_metric(&addr, "vllm:num_requests_running").await == 0.0).then_some(())
    })
    .await;
    eprintln!(
        "the engine dropped the request {:.0} ms after its 504 (its prefill had some 9 s to go)",
        answered.elapsed().as_secs_f64() * 1000.0
    );
    assert_eq!(
        common::vllm::engine_metric(&addr, "vllm:request_success_total").await,
        0.0,
        "the engine finished a request nobody waited for"
    );
}
