//! What operators see: trace context passed to workers, one JSON log line
//! per request, and the pool and weight-sync counters.

mod common;

use common::{Gateway, eventually};
use serde_json::{Value, json};

const TRACEPARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn traceparent_reaches_workers_and_each_request_logs_one_json_line() {
    let gw = Gateway::start_with(
        r#"
        [[apps]]
        name = "m"
        command = ["{worker}"]
        [apps.autoscale]
        min = 1

        [[pools]]
        name = "rollouts"
        command = ["{worker}"]
        replicas = [1, 1]
        "#,
        &["--log-format", "json"],
        &[("WARMGATE_LOG", "info,warmgate_gateway=debug")],
    );
    gw.wait_ready("m", 1).await;

    // The client's trace context reaches the worker unchanged.
    let r = gw
        .http
        .get(gw.at("/apps/m/echo"))
        .header("traceparent", TRACEPARENT)
        .send()
        .await
        .expect("send");
    let echo: Value = r.json().await.expect("json");
    assert_eq!(echo["headers"]["traceparent"], TRACEPARENT, "{echo}");
    // Without one, the worker still gets a valid new one.
    let echo: Value = gw
        .http
        .get(gw.at("/apps/m/echo"))
        .send()
        .await
        .expect("send")
        .json()
        .await
        .expect("json");
    let made = echo["headers"]["traceparent"]
        .as_str()
        .expect("traceparent");
    assert!(
        made.starts_with("00-") && made.len() == 55 && made != TRACEPARENT,
        "{made}"
    );
    // And for pool tasks, to `/invoke`.
    let r = gw
        .http
        .post(gw.at("/v1/pools/rollouts/tasks"))
        .header("traceparent", TRACEPARENT)
        .json(&json!({"input": 1}))
        .send()
        .await
        .expect("task");
    let out: Value = r.json().await.expect("json");
    assert_eq!(out["output"]["traceparent"], TRACEPARENT, "{out}");

    // The log is JSON, one object per line, with a line per request that
    // names the app, revision, replica, trace and outcome.
    let line = eventually("the request's log line", || async {
        gw.log()
            .lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .find(|v| {
                v["message"] == "request done"
                    && v["span"]["trace_id"] == "4bf92f3577b34da6a3ce929d0e0e4736"
            })
    })
    .await;
    let span = &line["span"];
    assert_eq!(span["app"], "m", "{line}");
    assert_eq!(span["revision"], "m-00001", "{line}");
    assert!(
        span["replica"]
            .as_str()
            .is_some_and(|r| r.starts_with("m-00001-")),
        "{line}"
    );
    assert_eq!(span["status"], 200, "{line}");
    assert!(line["took_ms"].as_f64().is_some(), "{line}");
    assert!(
        gw.log()
            .lines()
            .filter(|l| !l.trim().is_empty())
            .all(|l| serde_json::from_str::<Value>(l).is_ok()),
        "every log line is JSON"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pool_counters_follow_tasks_retries_and_weight_syncs() {
    let root = tempfile::tempdir().expect("dir");
    let v1 = root.path().join("v1");
    std::fs::create_dir_all(&v1).expect("mkdir");
    std::fs::write(v1.join("model.bin"), b"weights").expect("write");
    let gw = Gateway::start(&format!(
        r#"
        [[pools]]
        name = "rollouts"
        command = ["{{worker}}"]
        replicas = [1, 1]
        retries = 3
        {}
        "#,
        common::allow_temp_checkpoints()
    ));
    let task = |input: Value| {
        let (http, url) = (gw.http.clone(), gw.at("/v1/pools/rollouts/tasks"));
        async move {
            http.post(url)
                .json(&json!({"input": input}))
                .send()
                .await
                .expect("task")
                .status()
                .as_u16()
        }
    };
    assert_eq!(task(json!(1)).await, 200);
    assert_eq!(task(json!({"fail_before_attempt": 2})).await, 200);
    assert_eq!(task(json!({"fail": true, "x": 1})).await, 502);
    assert_eq!(task(json!({"crash_on_attempt": 1})).await, 200);
    let r = gw
        .http
        .post(gw.at("/v1/pools/rollouts/weights"))
        .json(&json!({"checkpoint": format!("file://{}", v1.display()), "version": 1}))
        .send()
        .await
        .expect("sync");
    assert_eq!(r.status(), 200);

    let m = |q: &'static str| {
        let gw = &gw;
        async move { gw.metric(q).await }
    };
    eventually("the counters", || async {
        let ok = m(r#"warmgate_tasks_total{pool="rollouts",outcome="ok"}"#).await;
        let failed = m(r#"warmgate_tasks_total{pool="rollouts",outcome="replica_failed"}"#).await;
        (ok == 3.0 && failed == 1.0).then_some(())
    })
    .await;
    // One retry for the flaky task, three for the failing one; the crash is
    // a system retry.
    assert_eq!(
        m(r#"warmgate_task_retries_total{pool="rollouts",cause="user"}"#).await,
        4.0
    );
    assert_eq!(
        m(r#"warmgate_task_retries_total{pool="rollouts",cause="system"}"#).await,
        1.0
    );
    assert_eq!(
        m(r#"warmgate_weight_syncs_total{pool="rollouts"}"#).await,
        1.0
    );
    assert_eq!(
        m(r#"warmgate_weight_sync_replicas_total{pool="rollouts",outcome="synced"}"#).await,
        1.0
    );
    assert_eq!(
        m(r#"warmgate_weight_sync_seconds_count{pool="rollouts"}"#).await,
        1.0
    );
}
