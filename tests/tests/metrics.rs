//! `/metrics` on a live gateway: every series has HELP text and is in the
//! catalog the docs are generated from; histograms have the catalog's
//! buckets; time to first byte and panic mode are there.

mod common;

use common::Gateway;
use serde_json::json;
use warmgate_gateway::metric_catalog::{Kind, METRICS};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_series_has_help_and_is_in_the_catalog() {
    let gw = Gateway::start(
        r#"
        [[apps]]
        name = "m"
        command = ["{worker}"]
        [[pools]]
        name = "p"
        command = ["{worker}"]
        replicas = [0, 1]
        "#,
    );
    // Some traffic: a request (a cold start, a first byte) and a task.
    let resp = gw
        .http
        .post(gw.at("/v1/chat/completions"))
        .json(&json!({"model": "m", "messages": [], "stream": true}))
        .send()
        .await
        .expect("send");
    assert_eq!(resp.status(), 200);
    resp.bytes().await.expect("body");
    let resp = gw
        .http
        .post(gw.at("/v1/pools/p/tasks"))
        .json(&json!({"input": {"x": 1}}))
        .send()
        .await
        .expect("send");
    assert!(resp.status().is_success(), "{}", resp.status());
    // The gauges are set on the autoscaler's next tick.
    let text = common::eventually("the tick's gauges", || async {
        let text = gw
            .http
            .get(gw.at("/metrics"))
            .send()
            .await
            .ok()?
            .text()
            .await
            .ok()?;
        text.contains("warmgate_autoscaler_panicking{")
            .then_some(text)
    })
    .await;

    let mut families = Vec::new();
    for line in text.lines().filter(|l| l.starts_with("# TYPE ")) {
        let mut f = line["# TYPE ".len()..].split_whitespace();
        let (name, kind) = (f.next().expect("name"), f.next().expect("kind"));
        families.push(name.to_string());
        let m = METRICS
            .iter()
            .find(|m| m.name == name)
            .unwrap_or_else(|| panic!("{name} is not in the catalog"));
        assert_eq!(m.kind.as_str(), kind, "{name}");
        assert!(
            text.contains(&format!("# HELP {name} ")),
            "{name} has no HELP text"
        );
    }
    for must in [
        "warmgate_time_to_first_byte_seconds",
        "warmgate_autoscaler_panicking",
        "warmgate_requests_total",
        "warmgate_cold_start_seconds",
        "warmgate_tasks_total",
    ] {
        assert!(
            families.iter().any(|f| f == must),
            "{must} missing:\n{text}"
        );
    }
    // Each histogram has its own buckets: cold starts run to ten minutes,
    // the handoff starts at 100 µs, requests end at 600 s.
    for m in METRICS.iter().filter(|m| m.kind == Kind::Histogram) {
        if !families.iter().any(|f| f == m.name) {
            continue;
        }
        for le in [m.buckets[0], m.buckets[m.buckets.len() - 1]] {
            let bucket = format!("{}_bucket{{", m.name);
            assert!(
                text.lines()
                    .filter(|l| l.starts_with(&bucket))
                    .any(|l| l.contains(&format!("le=\"{le}\""))),
                "{} has no le=\"{le}\" bucket:\n{text}",
                m.name
            );
        }
    }
    let ttfb = gw
        .metric(r#"warmgate_time_to_first_byte_seconds_count{app="m"}"#)
        .await;
    assert_eq!(ttfb, 1.0);
}
