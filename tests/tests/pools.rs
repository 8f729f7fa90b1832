//! Warm pools end to end: tasks to `POST /invoke`, sync and async, retries
//! by cause, timeouts, fairness, and bounds.

mod common;

use common::{Gateway, eventually, kind};
use serde_json::{Value, json};

fn pool(extra: &str) -> String {
    format!(
        r#"
        [[pools]]
        name = "rollouts"
        command = ["{{worker}}"]
        replicas = [1, 2]
        concurrency = 2
        retries = 2
        {extra}
        "#
    )
}

/// One replica with one slot, and a queue of two (`queue`: more keys of
/// `[pools.queue]`).
fn one_slot_pool(queue: &str) -> String {
    format!(
        r#"
        [[pools]]
        name = "rollouts"
        command = ["{{worker}}"]
        replicas = [1, 1]
        concurrency = 1
        [pools.queue]
        max_pending = 2
        {queue}
        "#
    )
}

async fn task(gw: &Gateway, body: Value) -> (u16, Value) {
    gw.post("/v1/pools/rollouts/tasks", &body).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_runs_on_a_warm_replica_and_answers_with_its_output() {
    let gw = Gateway::start(&pool(""));
    let (status, body) = task(&gw, json!({"input": {"x": 1}})).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["output"]["echo"], json!({"x": 1}));
    assert_eq!(body["attempts"], 1);
    assert!(
        body["replica"]
            .as_str()
            .is_some_and(|r| r.starts_with("rollouts-"))
    );
    assert_eq!(body["weights_version"], 0);
    // Its result was delivered in the answer, and is not kept after it.
    let id = body["id"].as_str().expect("id");
    let rec = gw.json(&format!("/v1/tasks/{id}")).await;
    assert_eq!(kind(&rec), "not_found", "{rec}");

    // The same replica serves the next task: the pool stays warm.
    let (_, again) = task(&gw, json!({"input": 2})).await;
    assert_eq!(again["output"]["echo"], 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn async_tasks_are_polled_to_completion() {
    let gw = Gateway::start(&pool(""));
    let r = gw
        .http
        .post(gw.at("/v1/pools/rollouts/tasks?async=true"))
        .json(&json!({"input": {"sleep_ms": 200}}))
        .send()
        .await
        .expect("send");
    assert_eq!(r.status(), 202);
    let id = r.json::<Value>().await.expect("json")["id"]
        .as_str()
        .expect("id")
        .to_string();
    let rec = eventually("the async task finishes", || async {
        let rec = gw.json(&format!("/v1/tasks/{id}")).await;
        (rec["state"] == "succeeded").then_some(rec)
    })
    .await;
    assert_eq!(rec["output"]["echo"]["sleep_ms"], 200);
    let r = gw
        .http
        .get(gw.at("/v1/tasks/nope"))
        .send()
        .await
        .expect("send");
    assert_eq!(r.status(), 404);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn user_failures_spend_retries_and_system_failures_do_not() {
    let gw = Gateway::start(&pool(""));
    // Fails twice in user code, then succeeds: within the budget of 2.
    let (status, body) = task(&gw, json!({"input": {"fail_before_attempt": 3}})).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["attempts"], 3);
    // Always fails: 1 try + 2 retries, then an explicit error.
    let (status, body) = task(&gw, json!({"input": {"fail": true}})).await;
    assert_eq!(status, 502, "{body}");
    assert_eq!(kind(&body), "replica_failed");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap_or_default()
            .contains("after 3 attempt(s)"),
        "{body}"
    );
    // A per-task budget of 0 fails at once.
    let (status, _) = task(&gw, json!({"input": {"fail": true}, "retries": 0})).await;
    assert_eq!(status, 502);
    // The replica dies under the first attempt: a system failure, retried
    // on a new replica without spending the (zero) budget.
    let (status, body) = task(&gw, json!({"input": {"crash_on_attempt": 1}, "retries": 0})).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["attempts"], 2);
    assert!(
        gw.metric(r#"warmgate_task_retries_total{pool="rollouts",cause="system"}"#)
            .await
            >= 1.0
    );
}

/// Tasks that keep failing wait out their retry's pause outside the
/// queue; they still count against `max_pending`, so a client cannot pile
/// up tasks beyond it by making them fail, and the retries a client may
/// ask for are bounded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tasks_waiting_to_retry_count_against_the_queue_bound() {
    let gw = Gateway::start(&one_slot_pool(""));
    let (status, body) = task(&gw, json!({"input": 1, "retries": 21})).await;
    assert_eq!(status, 400, "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap_or_default()
            .contains("at most 20"),
        "{body}"
    );
    let (status, body) = gw
        .post(
            "/v1/pools/rollouts/tasks/batch",
            &json!({"inputs": [1, 2], "retries": 21}),
        )
        .await;
    assert_eq!(status, 400, "a batch is refused whole: {body}");
    // The replica is up (a task waits for it).
    let (status, body) = task(&gw, json!({"input": 1})).await;
    assert_eq!(status, 200, "{body}");
    let failing =
        json!({"input": {"fail": true, "sleep_ms": 300}, "retries": 20, "timeout": "120s"});
    // Three get in: one running while two wait. (A fourth would wait too,
    // so once a task is in its pause it refuses any more.)
    let mut ids = Vec::new();
    for _ in 0..3 {
        let id = eventually("a failing task accepted", || async {
            let (status, body) = gw
                .post("/v1/pools/rollouts/tasks?async=true", &failing)
                .await;
            match status {
                202 => Some(body["id"].as_str().expect("id").to_string()),
                429 => None,
                _ => panic!("{status}: {body}"),
            }
        })
        .await;
        ids.push(id);
    }
    // All three are retrying: each is running, queued or in a pause.
    eventually("every task has been tried twice", || async {
        for id in &ids {
            let t = gw.json(&format!("/v1/tasks/{id}")).await;
            if t["attempts"].as_u64().unwrap_or(0) < 2 {
                return None;
            }
        }
        Some(())
    })
    .await;
    // One runs at a time and two wait, so the bound is reached whether a
    // waiting task is in the queue or in its pause; the tries are spread
    // over a second so that some fall in the pauses.
    for _ in 0..20 {
        let (status, body) = gw
            .post("/v1/pools/rollouts/tasks?async=true", &failing)
            .await;
        assert_eq!(status, 429, "{body}");
        assert_eq!(kind(&body), "queue_full");
        let s = gw.json("/v1/status").await;
        let (pending, inflight) = (&s["pools"][0]["pending"], &s["pools"][0]["inflight"]);
        assert_eq!(
            pending.as_u64().unwrap_or(0) + inflight.as_u64().unwrap_or(0),
            3,
            "{s}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_past_its_timeout_fails_with_504() {
    let gw = Gateway::start(&pool(""));
    let (status, body) = task(
        &gw,
        json!({"input": {"sleep_ms": 5000}, "timeout": "300ms"}),
    )
    .await;
    assert_eq!(status, 504, "{body}");
    assert_eq!(kind(&body), "timeout");
    let (status, body) = task(&gw, json!({"input": 1, "timeout": "soon"})).await;
    assert_eq!(status, 400, "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_tasks_and_full_queues_are_refused_clearly() {
    let gw = Gateway::start(&one_slot_pool("tenant_quota = 2"));
    let r = gw
        .http
        .post(gw.at("/v1/pools/nope/tasks"))
        .json(&json!({"input": 1}))
        .send()
        .await
        .expect("send");
    assert_eq!(r.status(), 404);
    let (status, body) = task(&gw, json!({"inputs": [1]})).await;
    assert_eq!(status, 400, "{body}");
    let (status, body) = task(&gw, json!({"input": 1, "min_weights_version": 3})).await;
    assert_eq!(
        status, 409,
        "a version no replica can reach is refused, not left waiting: {body}"
    );
    assert_eq!(kind(&body), "conflict");

    let submit = |tenant: &'static str| {
        let http = gw.http.clone();
        let url = gw.at("/v1/pools/rollouts/tasks?async=true");
        async move {
            http.post(url)
                .header("x-warmgate-tenant", tenant)
                .json(&json!({"input": {"sleep_ms": 3000}}))
                .send()
                .await
                .expect("send")
        }
    };
    // The quota counts pending and running tasks of one tenant.
    assert_eq!(submit("a").await.status(), 202);
    assert_eq!(submit("a").await.status(), 202);
    // (Once one runs, the backlog has room: the quota is what refuses.)
    eventually("one task running, one queued", || async {
        let s = gw.json("/v1/status").await;
        (s["pools"][0]["inflight"] == 1 && s["pools"][0]["pending"] == 1).then_some(())
    })
    .await;
    let r = submit("a").await;
    assert_eq!(r.status(), 429);
    assert!(r.headers().contains_key("retry-after"));
    let body: Value = r.json().await.expect("json");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap_or_default()
            .contains("quota"),
        "{body}"
    );
    // Another tenant still gets in, until the backlog bound.
    eventually("one task running, one queued", || async {
        let s = gw.json("/v1/status").await;
        (s["pools"][0]["inflight"] == 1 && s["pools"][0]["pending"] == 1).then_some(())
    })
    .await;
    assert_eq!(submit("b").await.status(), 202);
    let r = submit("c").await;
    assert_eq!(r.status(), 429);
    let body: Value = r.json().await.expect("json");
    assert_eq!(kind(&body), "queue_full");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_streams_one_line_per_input_in_input_order() {
    let gw = Gateway::start(&pool(""));
    // Later inputs finish first; one input always fails.
    let inputs: Vec<Value> = (0..20)
        .map(|i| {
            if i == 7 {
                json!({"fail": true})
            } else {
                json!({"i": i, "sleep_ms": (20 - i) * 10})
            }
        })
        .collect();
    let r = gw
        .http
        .post(gw.at("/v1/pools/rollouts/tasks/batch"))
        .json(&json!({"inputs": inputs, "retries": 0}))
        .send()
        .await
        .expect("send");
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["content-type"], "application/x-ndjson");
    let text = r.text().await.expect("body");
    let lines: Vec<Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).expect("each line is JSON"))
        .collect();
    assert_eq!(lines.len(), 20, "one line per input");
    for (i, line) in lines.iter().enumerate() {
        assert_eq!(line["index"], i, "input order");
        if i == 7 {
            assert_eq!(line["error"]["kind"], "replica_failed", "{line}");
        } else {
            assert_eq!(line["output"]["echo"]["i"], i, "{line}");
        }
    }
    let (status, body) = {
        let r = gw
            .http
            .post(gw.at("/v1/pools/rollouts/tasks/batch"))
            .json(&json!({"input": [1]}))
            .send()
            .await
            .expect("send");
        (r.status().as_u16(), r.json::<Value>().await.expect("json"))
    };
    assert_eq!(status, 400, "{body}");
}

/// A worker's output nested deeper than a JSON tree may be reaches the
/// client as the worker wrote it, on every task route, and the lines after
/// it in a batch still come.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outputs_nested_past_any_parser_limit_arrive_whole() {
    let gw = Gateway::start(&pool(""));
    let deep = format!("{}{}", "[".repeat(300), "]".repeat(300));
    let batch = format!(r#"{{"inputs": [{deep}, {{"i": 1}}], "retries": 0}}"#);
    let r = gw
        .http
        .post(gw.at("/v1/pools/rollouts/tasks/batch"))
        .header("content-type", "application/json")
        .body(batch)
        .send()
        .await
        .expect("send");
    assert_eq!(r.status(), 200);
    let text = r.text().await.expect("the whole batch answer");
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 2, "{text:.300}");
    assert!(
        lines[0].contains(&format!(r#""output":{{"echo_raw": {deep}}}"#)),
        "{:.300}",
        lines[0]
    );
    let second: Value = serde_json::from_str(lines[1]).expect("JSON");
    assert_eq!(second["output"]["echo"]["i"], 1, "{second}");

    let r = gw
        .http
        .post(gw.at("/v1/pools/rollouts/tasks"))
        .header("content-type", "application/json")
        .body(format!(r#"{{"input": {deep}}}"#))
        .send()
        .await
        .expect("send");
    assert_eq!(r.status(), 200);
    assert!(r.text().await.expect("body").contains(&deep));
}

/// The pool's replicas as the pool manager reports them.
async fn pool_replicas(gw: &Gateway) -> Vec<Value> {
    let s = gw.json("/v1/status").await;
    s["pools"][0]["pool"]["replicas"]
        .as_array()
        .cloned()
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_scales_the_pool_up_and_idle_replicas_go_one_by_one_down_to_the_buffer() {
    let gw = Gateway::start(
        r#"
        [[pools]]
        name = "rollouts"
        command = ["{worker}"]
        replicas = [0, 3]
        concurrency = 2
        idle_ttl = "1s"
        buffer = 1
        "#,
    );
    // The buffer keeps one replica warm with nothing to do.
    eventually("the buffer replica is ready", || async {
        let rs = pool_replicas(&gw).await;
        (rs.len() == 1 && rs[0]["state"] == "ready").then_some(())
    })
    .await;

    // Six tasks of 1.5 s on 2 slots per replica: the queue beyond the free
    // slots starts replicas up to max.
    let http = gw.http.clone();
    let url = gw.at("/v1/pools/rollouts/tasks");
    let burst: Vec<_> = (0..6)
        .map(|_| {
            let (http, url) = (http.clone(), url.clone());
            tokio::spawn(async move {
                http.post(url)
                    .json(&json!({"input": {"sleep_ms": 1500}}))
                    .send()
                    .await
                    .expect("send")
                    .status()
            })
        })
        .collect();
    eventually("3 replicas for the burst", || async {
        let rs = pool_replicas(&gw).await;
        (rs.iter().filter(|r| r["state"] == "ready").count() == 3).then_some(())
    })
    .await;
    for t in burst {
        assert_eq!(t.await.expect("join"), 200);
    }
    // Idle past the TTL, the extra replicas stop; the buffer stays.
    eventually("back to the buffer", || async {
        let rs = pool_replicas(&gw).await;
        (rs.len() == 1 && rs[0]["state"] == "ready").then_some(())
    })
    .await;
    // And it stays there: the buffer replica is not stopped for idling.
    let s = gw.json("/v1/status").await;
    assert_eq!(s["pools"][0]["pool"]["desired"], 1, "{s}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_with_suspend_after_stops_its_min_replicas_when_idle_and_a_task_wakes_it() {
    let gw = Gateway::start(&pool("suspend_after = \"2s\"\nidle_ttl = \"1s\""));
    let replicas = |s: &Value| {
        s["pool"]["replicas"]
            .as_array()
            .map_or(0, |r| r.iter().filter(|r| r["state"] != "stopped").count())
    };
    // Warm at start: min is 1.
    eventually("the pool's min replica is up", || async {
        let s = gw.json("/v1/pools/rollouts").await;
        (s["ready"] == 1).then_some(())
    })
    .await;
    // Idle for suspend_after: even the min replica stops.
    let s = eventually("the idle pool suspends to zero", || async {
        let s = gw.json("/v1/pools/rollouts").await;
        (s["suspended"] == true && replicas(&s) == 0).then_some(s)
    })
    .await;
    assert_eq!(s["pool"]["desired"], 0, "{s}");
    // The next task wakes it and is served.
    let (status, body) = task(&gw, json!({"input": "wake"})).await;
    assert_eq!(
        (status, &body["output"]["echo"]),
        (200, &json!("wake")),
        "{body}"
    );
    let s = gw.json("/v1/pools/rollouts").await;
    assert_eq!(s["suspended"], false, "{s}");
}
