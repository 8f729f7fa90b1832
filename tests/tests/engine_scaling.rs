//! Scaling on the engine's own signals against real engine processes:
//! the stand-in vLLM engine (`tests/standins/llm_engine.py`), whose
//! `/metrics` says how many requests run in its batch and how many wait in
//! its queue. Two apps of the same engine take the same load; the one
//! that targets the engines' queue (`target_waiting`) scales out, the one
//! that counts in-flight requests against a `concurrency` the engine
//! cannot reach stays at one replica while its engine's queue grows.

mod common;

use std::path::Path;

use common::{Gateway, eventually};
use serde_json::json;

fn app(name: &str, extra: &str) -> String {
    let engine = Path::new(env!("CARGO_MANIFEST_DIR")).join("standins/llm_engine.py");
    format!(
        r#"
        [[apps]]
        name = "{name}"
        command = ["python3", "{engine}", "--model", "{name}", "--slots", "2",
                   "--decode-ms-per-token", "30"]
        concurrency = 64
        startup_timeout = "60s"
        [apps.health]
        path = "/health"
        [apps.engine]
        metrics_path = "/metrics"
        period = "200ms"
        max_age = "2s"
        [apps.autoscale]
        min = 1
        max = 3
        {extra}
        "#,
        engine = engine.display()
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_s_queue_scales_the_app_where_counting_requests_does_not() {
    let config = format!(
        "{}{}",
        app("queued", "target_waiting = 1"),
        app("counted", "")
    );
    let gw = Gateway::start(&config);
    gw.wait_ready("queued", 1).await;
    gw.wait_ready("counted", 1).await;

    // Ten requests of 100 tokens at 30 ms a token (3 s each) to each app:
    // each engine runs 2 and queues 8, for about 15 s.
    let mut load = Vec::new();
    for model in ["queued", "counted"] {
        for i in 0..10 {
            let (http, url) = (gw.http.clone(), gw.at("/v1/completions"));
            load.push(tokio::spawn(async move {
                http.post(url)
                    .json(&json!({"model": model, "prompt": format!("request {i}"), "max_tokens": 100}))
                    .send()
                    .await
                    .map(|r| r.status().as_u16())
            }));
        }
    }

    // The engine's queue, read from its /metrics, reaches the gateway...
    eventually("the queued engine's waiting requests in status", || async {
        let s = gw.app_status("queued").await;
        let waiting: u64 = s["revisions"]
            .as_array()
            .into_iter()
            .flatten()
            .flat_map(|r| r["replicas"].as_array().cloned().unwrap_or_default())
            .filter_map(|r| r["engine"]["waiting"].as_u64())
            .sum();
        (waiting >= 4).then_some(())
    })
    .await;
    // ...and the app that targets it asks for more replicas and gets them.
    let scaled = eventually("the app that targets the queue at 3 replicas", || async {
        let s = gw.app_status("queued").await;
        (s["desired"] == 3).then_some(s)
    })
    .await;
    assert!(scaled["desired"] == 3, "{scaled}");
    gw.wait_ready("queued", 3).await;
    // The other, under the same load, counts 10 in flight against a
    // target of 44.8 a replica and stays at one, its engine queueing.
    let counted = gw.app_status("counted").await;
    assert_eq!(counted["desired"], 1, "{counted}");
    // `min = 1` keeps a replica: no scale-to-zero time to show.
    assert!(counted.get("scale_to_zero_after_s").is_none(), "{counted}");
    let engines = gw.metrics_text().await;
    assert!(
        engines.contains("warmgate_engine_requests_waiting{app=\"counted\"}"),
        "the counted app's engine queue is in /metrics"
    );

    for l in load {
        assert_eq!(l.await.unwrap().unwrap(), 200);
    }
}
