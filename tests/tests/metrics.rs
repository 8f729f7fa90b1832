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
            .bearer_auth(gw.admin_token())
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

    // What Prometheus itself reads: the exposition parses with the
    // official Python client's parser (promtool's rules: one TYPE and HELP
    // per family, well-formed samples), every family has HELP, and every
    // sample's labels are the catalog's.
    let python_ok = std::process::Command::new("python3")
        .args(["-c", "import prometheus_client"])
        .status()
        .is_ok_and(|s| s.success());
    if !python_ok {
        assert!(
            std::env::var_os("CI").is_none(),
            "prometheus_client is required under CI"
        );
        eprintln!("SKIPPED the parser check: pip install prometheus_client");
        return;
    }
    let labels: Vec<(String, Vec<String>)> = METRICS
        .iter()
        .map(|m| {
            (
                m.name.to_string(),
                m.labels.iter().map(|l| l.to_string()).collect(),
            )
        })
        .collect();
    let script = r#"
import json, sys
from prometheus_client.parser import text_string_to_metric_families
catalog = dict(json.loads(sys.argv[1]))
text = sys.stdin.read()
n = 0
for fam in text_string_to_metric_families(text):
    assert fam.documentation, f"{fam.name} has no HELP"
    # The parser names a counter's family without its _total suffix.
    name = fam.name if fam.name in catalog else fam.name + "_total"
    assert name in catalog, f"{fam.name} is not in the catalog"
    for s in fam.samples:
        extra = set(s.labels) - set(catalog[name]) - {"le", "quantile"}
        assert not extra, f"{s.name} has labels {extra} the catalog does not list"
        n += 1
print("PARSED", n)
"#;
    let mut child = std::process::Command::new("python3")
        .args(["-c", script, &serde_json::to_string(&labels).expect("json")])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("python3");
    {
        use std::io::Write as _;
        let mut stdin = child.stdin.take().expect("stdin");
        stdin.write_all(text.as_bytes()).expect("write");
    }
    let out = child.wait_with_output().expect("wait");
    assert!(
        out.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("PARSED"));
}
