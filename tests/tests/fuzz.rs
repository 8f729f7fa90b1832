//! Hostile requests against the real binary: random routing headers,
//! bodies and paths, from a fixed seed so a failure can be replayed. Every
//! answer must be an answer (a status from the documented set, errors in
//! the JSON format), and the gateway must never panic or stop serving.

mod common;

use common::{Gateway, kind};
use serde_json::Value;

/// Requests sent; each is cheap, and the seed makes the run repeatable.
const ITERATIONS: usize = 400;

fn random_bytes(rng: &mut fastrand::Rng, max: usize) -> Vec<u8> {
    let n = rng.usize(0..=max);
    (0..n).map(|_| rng.u8(..)).collect()
}

fn random_text(rng: &mut fastrand::Rng) -> String {
    const PIECES: &[&str] = &[
        "m",
        "nope",
        "m-00001",
        "m-99999",
        "../..",
        "%00",
        "\u{202e}",
        "-1",
        "999999999999",
        "1e308",
        "\"",
        "{",
        "}",
        "[",
        ",",
        ":",
        "null",
        "true",
        "🦀",
        " ",
        "\t",
        "",
    ];
    (0..rng.usize(0..5))
        .map(|_| PIECES[rng.usize(..PIECES.len())])
        .collect()
}

fn random_body(rng: &mut fastrand::Rng) -> Vec<u8> {
    match rng.u8(0..6) {
        0 => random_bytes(rng, 200),
        1 => format!("{{\"model\": \"{}\", \"input\": \"x\"}}", random_text(rng)).into_bytes(),
        2 => format!(
            "{{\"input\": {}, \"timeout\": {}, \"priority\": {}, \"retries\": {}}}",
            random_text(rng),
            random_text(rng),
            random_text(rng),
            random_text(rng)
        )
        .into_bytes(),
        3 => format!(
            "{{\"inputs\": [{}], \"timeout\": \"{}\"}}",
            random_text(rng),
            random_text(rng)
        )
        .into_bytes(),
        4 => b"[\"m\"]".to_vec(),
        _ => random_text(rng).into_bytes(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_headers_bodies_and_paths_get_clear_answers() {
    let gw = Gateway::start(
        r#"
        [limits]
        request_timeout = "5s"
        [[apps]]
        name = "m"
        command = ["{worker}"]
        [apps.autoscale]
        min = 1
        max = 1
        [[pools]]
        name = "p"
        command = ["{worker}"]
        replicas = [1, 1]
        task_timeout = "5s"
        "#,
    );
    gw.wait_ready("m", 1).await;
    let mut rng = fastrand::Rng::with_seed(0x5eed_0009);
    let paths = [
        "/v1/chat/completions",
        "/v1/embeddings",
        "/v1/pools/p/tasks",
        "/v1/pools/p/tasks?async=true",
        "/v1/pools/p/tasks/batch",
        "/v1/pools/nope/tasks",
        "/apps/m/x",
        "/apps/nope/x",
        "/v1/tasks/p-0-0",
        "/v1/weights/m/m-00001/..%2F..%2Fetc%2Fpasswd",
        "/v1/weights/m/m-00001/../../etc/passwd",
    ];
    let headers = [
        "x-warmgate-revision",
        "x-warmgate-priority",
        "x-warmgate-tenant",
        "x-request-id",
        "traceparent",
        "authorization",
        "content-type",
    ];
    let mut seen = std::collections::BTreeMap::new();
    for i in 0..ITERATIONS {
        let path = paths[rng.usize(..paths.len())];
        let method = if rng.bool() {
            reqwest::Method::POST
        } else {
            reqwest::Method::GET
        };
        let mut req = gw.http.request(method.clone(), gw.at(path));
        for _ in 0..rng.usize(0..4) {
            let name = headers[rng.usize(..headers.len())];
            let value = if rng.bool() {
                random_text(&mut rng).into_bytes()
            } else {
                random_bytes(&mut rng, 40)
            };
            if let Ok(v) = reqwest::header::HeaderValue::from_bytes(&value) {
                req = req.header(name, v);
            }
        }
        if method == reqwest::Method::POST {
            req = req.body(random_body(&mut rng));
        }
        let r = req
            .timeout(std::time::Duration::from_secs(30))
            .send()
            .await
            .unwrap_or_else(|e| panic!("request {i} to {path} got no answer: {e}"));
        let status = r.status().as_u16();
        let text = r.text().await.expect("body");
        *seen.entry(status).or_insert(0) += 1;
        assert!(
            [200, 202, 400, 401, 404, 405, 409, 413, 429, 502, 503, 504].contains(&status),
            "request {i} to {path}: unexpected status {status}: {text}"
        );
        if status >= 400 {
            let v: Value = serde_json::from_str(&text)
                .unwrap_or_else(|_| panic!("request {i}: error not in the JSON format: {text}"));
            assert_ne!(kind(&v), "<no kind>", "request {i}: {text}");
        }
    }
    println!("RELIABILITY fuzz: {ITERATIONS} hostile requests, statuses {seen:?}");
    assert!(!gw.log().contains("panicked"), "{}", gw.log());
    let r = gw
        .http
        .get(gw.at("/apps/m/ok"))
        .send()
        .await
        .expect("still serving");
    assert_eq!(r.status(), 200);
}
