//! Tenants and limits: data-plane API keys with quotas, the connection
//! bound, header-read and request deadlines. Each test talks to the real
//! binary over real sockets, the way a misbehaving client would.

mod common;

use std::time::Duration;

use common::{Gateway, WAIT, eventually, kind};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const KEY_A: &str = "wg-key-alpha-7d1e0c";
const KEY_B: &str = "wg-key-bravo-42aa91";

fn sha256_hex(s: &str) -> String {
    Sha256::digest(s.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn tenants_gateway() -> Gateway {
    let config = format!(
        r#"
        [[apps]]
        name = "m"
        command = ["{{worker}}"]
        concurrency = 8
        [apps.autoscale]
        min = 1
        max = 1
        [[pools]]
        name = "p"
        command = ["{{worker}}"]
        replicas = [1, 1]
        [[tenants]]
        name = "alpha"
        api_key_sha256 = "{}"
        max_inflight = 2
        max_pending = 1
        [[tenants]]
        name = "bravo"
        api_key_env = "TEST_KEY_BRAVO"
        rps = 0.1
        "#,
        sha256_hex(KEY_A)
    );
    Gateway::start_with(&config, &[], &[("TEST_KEY_BRAVO", KEY_B)])
}

async fn send(
    gw: &Gateway,
    method: reqwest::Method,
    path: &str,
    key: Option<&str>,
    body: Option<Value>,
) -> (u16, reqwest::header::HeaderMap, Value) {
    let mut r = gw
        .http
        .request(method, gw.at(path))
        .timeout(WAIT)
        .header("x-warmgate-tenant", "someone-else");
    if let Some(k) = key {
        r = r.bearer_auth(k);
    }
    if let Some(b) = body {
        r = r.json(&b);
    }
    let r = r.send().await.expect("send");
    let (status, headers) = (r.status().as_u16(), r.headers().clone());
    (status, headers, r.json().await.unwrap_or(Value::Null))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_keys_name_the_tenant_and_its_quotas_hold() {
    let gw = tenants_gateway();
    gw.wait_ready("m", 1).await;
    let get = reqwest::Method::GET;

    // No key, or a wrong one: 401 on every data-plane route.
    for (path, key) in [
        ("/apps/m/x", None),
        ("/apps/m/x", Some("wrong")),
        ("/v1/models", None),
        ("/v1/tasks/p-0-0", None),
    ] {
        let (status, _, body) = send(&gw, get.clone(), path, key, None).await;
        assert_eq!(status, 401, "{path} with {key:?}: {body}");
        assert_eq!(kind(&body), "unauthorized");
    }
    let (status, _, body) = send(
        &gw,
        reqwest::Method::POST,
        "/v1/embeddings",
        None,
        Some(json!({"model": "m", "input": "x"})),
    )
    .await;
    assert_eq!(status, 401, "{body}");

    // A key names its tenant: the worker sees the tenant's name, whatever
    // the client claims, and never sees the key.
    let (status, _, echo) = send(&gw, get.clone(), "/apps/m/x", Some(KEY_A), None).await;
    assert_eq!(status, 200, "{echo}");
    assert_eq!(echo["headers"]["x-warmgate-tenant"], "alpha");
    assert!(echo["headers"].get("authorization").is_none(), "{echo}");

    // max_inflight = 2: a third request at once is refused, and a slot is
    // given back when a response ends.
    let slow = |n: u32| {
        let (http, url) = (
            gw.http.clone(),
            gw.at(&format!("/apps/m/slow{n}?latency_ms=3000")),
        );
        tokio::spawn(async move { http.get(url).bearer_auth(KEY_A).send().await })
    };
    let (s1, s2) = (slow(1), slow(2));
    eventually("alpha has 2 requests in flight", || async {
        let t = tenant(&gw, "alpha").await;
        (t["inflight"] == 2).then_some(())
    })
    .await;
    let (status, headers, body) = send(&gw, get.clone(), "/apps/m/x", Some(KEY_A), None).await;
    assert_eq!(status, 429, "{body}");
    assert_eq!(kind(&body), "quota_exceeded");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap_or("")
            .contains("max_inflight")
    );
    assert!(headers.contains_key("retry-after"));
    // Another tenant is not affected by alpha's quota.
    let (status, _, body) = send(&gw, get.clone(), "/apps/m/x", Some(KEY_B), None).await;
    assert_eq!(status, 200, "{body}");
    for h in [s1, s2] {
        assert_eq!(h.await.expect("join").expect("send").status(), 200);
    }
    let (status, _, _) = send(&gw, get.clone(), "/apps/m/x", Some(KEY_A), None).await;
    assert_eq!(status, 200, "the slots came back");

    // rps = 0.1 with a burst of 1: bravo's next request within ten seconds
    // is refused, with the wait in Retry-After.
    let (status, headers, body) = send(&gw, get.clone(), "/apps/m/x", Some(KEY_B), None).await;
    assert_eq!(status, 429, "{body}");
    assert_eq!(kind(&body), "quota_exceeded");
    let retry: u64 = headers["retry-after"]
        .to_str()
        .unwrap_or("")
        .parse()
        .expect("seconds");
    assert!((1..=10).contains(&retry), "retry-after {retry}");

    // max_pending = 1: a second task while the first runs is refused; the
    // slot frees when the first finishes.
    let post = reqwest::Method::POST;
    let (status, _, first) = send(
        &gw,
        post.clone(),
        "/v1/pools/p/tasks?async=true",
        Some(KEY_A),
        Some(json!({"input": {"sleep_ms": 1000}})),
    )
    .await;
    assert_eq!(status, 202, "{first}");
    let id = first["id"].as_str().expect("id").to_string();
    let (status, _, body) = send(
        &gw,
        post.clone(),
        "/v1/pools/p/tasks?async=true",
        Some(KEY_A),
        Some(json!({"input": {}})),
    )
    .await;
    assert_eq!(status, 429, "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap_or("")
            .contains("max_pending")
    );
    // Only the owner can read a task back.
    let (status, _, _) = send(
        &gw,
        get.clone(),
        &format!("/v1/tasks/{id}"),
        Some(KEY_B),
        None,
    )
    .await;
    assert!(
        status == 404 || status == 429,
        "bravo must not see alpha's task: {status}"
    );
    eventually("alpha's task finishes", || async {
        let (_, _, t) = send(
            &gw,
            reqwest::Method::GET,
            &format!("/v1/tasks/{id}"),
            Some(KEY_A),
            None,
        )
        .await;
        (t["state"] == "succeeded").then_some(())
    })
    .await;
    eventually("alpha's pending slot is free", || async {
        (tenant(&gw, "alpha").await["pending"] == 0).then_some(())
    })
    .await;
    let (status, _, body) = send(
        &gw,
        post,
        "/v1/pools/p/tasks",
        Some(KEY_A),
        Some(json!({"input": {"n": 1}})),
    )
    .await;
    assert_eq!(status, 200, "{body}");

    // Keys never show up: not in status, metrics or the log.
    let status_text = gw.json("/v1/status").await.to_string();
    let metrics = gw
        .http
        .get(gw.at("/metrics"))
        .bearer_auth(gw.admin_token())
        .send()
        .await
        .expect("metrics")
        .text()
        .await
        .expect("text");
    let t = tenant(&gw, "alpha").await;
    assert!(t["rejected"].as_u64().unwrap_or(0) >= 2, "{t}");
    for secret in [KEY_A, KEY_B, &sha256_hex(KEY_B)] {
        assert!(!status_text.contains(secret), "status leaks a key");
        assert!(!metrics.contains(secret), "metrics leak a key");
        assert!(!gw.log().contains(secret), "the log leaks a key");
    }
    assert!(
        metrics.contains("warmgate_tenant_rejected_total{tenant=\"alpha\"}"),
        "per-tenant refusals are counted"
    );
}

/// One tenant's tasks cannot take the whole pending-bytes budget: each of
/// two tenants holds at most half of `limits.max_pending_task_bytes`, so
/// the other's task still gets in.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_tenant_holds_at_most_its_share_of_the_pending_task_bytes() {
    let config = format!(
        r#"
        [limits]
        max_pending_task_bytes = "2MiB"
        max_task_body_bytes = "1MiB"
        [[pools]]
        name = "p"
        command = ["{{worker}}"]
        replicas = [1, 1]
        concurrency = 1
        [[tenants]]
        name = "alpha"
        api_key_sha256 = "{}"
        [[tenants]]
        name = "bravo"
        api_key_env = "TEST_KEY_BRAVO"
        "#,
        sha256_hex(KEY_A)
    );
    let gw = Gateway::start_with(&config, &[], &[("TEST_KEY_BRAVO", KEY_B)]);
    // 400 KB of input each, running (or waiting) for 10 s: the submissions
    // below take milliseconds, and the gateway's stop waits out the one
    // running.
    let big = json!({"input": {"sleep_ms": 10000, "pad": "x".repeat(400_000)}});
    let submit = |key: &'static str| {
        send(
            &gw,
            reqwest::Method::POST,
            "/v1/pools/p/tasks?async=true",
            Some(key),
            Some(big.clone()),
        )
    };
    for _ in 0..2 {
        let (status, _, body) = submit(KEY_A).await;
        assert_eq!(status, 202, "{body}");
    }
    // A third would pass alpha's share of 1 MiB; the budget itself has room.
    let (status, headers, body) = submit(KEY_A).await;
    assert_eq!(status, 429, "{body}");
    assert_eq!(kind(&body), "quota_exceeded", "{body}");
    assert!(headers.contains_key("retry-after"));
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap_or_default()
            .contains("max_pending_task_bytes"),
        "{body}"
    );
    // Bravo's own share is untouched.
    for _ in 0..2 {
        let (status, _, body) = submit(KEY_B).await;
        assert_eq!(status, 202, "{body}");
    }
    let alpha = tenant(&gw, "alpha").await;
    assert_eq!(alpha["pending"], 2, "{alpha}");
    assert!(
        alpha["pending_bytes"].as_u64().unwrap_or(0) >= 800_000,
        "{alpha}"
    );
}

async fn tenant(gw: &Gateway, name: &str) -> Value {
    let s = gw.json("/v1/status").await;
    s["tenants"]
        .as_array()
        .and_then(|ts| ts.iter().find(|t| t["name"] == name).cloned())
        .unwrap_or_else(|| panic!("tenant {name} not in status: {s}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_variable_that_is_not_set_stops_the_gateway_with_its_name() {
    let dir = tempfile::tempdir().expect("dir");
    let path = dir.path().join("w.toml");
    std::fs::write(
        &path,
        "[[tenants]]\nname = \"a\"\napi_key_env = \"WARMGATE_TEST_UNSET_KEY\"\n",
    )
    .expect("write");
    let out = std::process::Command::new(common::bin("warmgate"))
        .args(["serve", "--config"])
        .arg(&path)
        .args(["--listen", "127.0.0.1:0"])
        .env_remove("WARMGATE_TEST_UNSET_KEY")
        .output()
        .expect("run");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("tenants[0].api_key_env") && err.contains("WARMGATE_TEST_UNSET_KEY"),
        "{err}"
    );
}

fn limits_gateway() -> Gateway {
    Gateway::start(
        r#"
        [limits]
        max_connections = 4
        header_read_timeout = "1s"
        request_timeout = "2s"
        [[apps]]
        name = "m"
        command = ["{worker}"]
        [apps.autoscale]
        min = 1
        max = 1
        "#,
    )
}

/// The gateway's `host:port`.
fn addr(gw: &Gateway) -> String {
    gw.url.trim_start_matches("http://").to_string()
}

/// Reads until the server closes the connection (bounded by `WAIT`).
async fn read_to_close(s: &mut TcpStream) -> String {
    let mut out = Vec::new();
    let _ = tokio::time::timeout(WAIT, s.read_to_end(&mut out))
        .await
        .expect("the server closes the connection");
    String::from_utf8_lossy(&out).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_clients_cannot_hold_sockets_and_connections_are_bounded() {
    let gw = limits_gateway();
    gw.wait_ready("m", 1).await;

    // Slowloris: half a request's headers, then nothing. The gateway hangs
    // up after header_read_timeout.
    let mut slow = TcpStream::connect(addr(&gw)).await.expect("connect");
    slow.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        .await
        .expect("write");
    let got = read_to_close(&mut slow).await;
    assert!(
        !got.contains("200 OK"),
        "no answer to half a request: {got}"
    );

    // An idle keep-alive connection is closed too.
    let mut idle = TcpStream::connect(addr(&gw)).await.expect("connect");
    idle.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .expect("write");
    let got = read_to_close(&mut idle).await;
    assert!(got.starts_with("HTTP/1.1 200"), "{got}");

    // A body that trickles in is cut off at request_timeout.
    let mut trickle = TcpStream::connect(addr(&gw)).await.expect("connect");
    trickle
        .write_all(
            b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
              Content-Length: 100\r\n\r\n{\"model\":",
        )
        .await
        .expect("write");
    let got = read_to_close(&mut trickle).await;
    assert!(got.starts_with("HTTP/1.1 504"), "{got}");
    assert!(got.contains("limits.request_timeout"), "{got}");

    // A worker slower than request_timeout: 504 timeout.
    let r = gw
        .http
        .get(gw.at("/apps/m/x?latency_ms=10000"))
        .send()
        .await
        .expect("send");
    assert_eq!(r.status(), 504);
    let body: Value = r.json().await.expect("json");
    assert_eq!(kind(&body), "timeout");

    // max_connections = 4: with four open, a fifth is told why and closed.
    let mut held = Vec::new();
    for _ in 0..4 {
        let mut s = TcpStream::connect(addr(&gw)).await.expect("connect");
        // A request in flight keeps each connection busy.
        s.write_all(b"GET /apps/m/x?latency_ms=1500 HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .expect("write");
        held.push(s);
    }
    let refused = eventually("a fifth connection is refused", || async {
        let mut s = TcpStream::connect(addr(&gw)).await.ok()?;
        s.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .ok()?;
        let got = read_to_close(&mut s).await;
        got.starts_with("HTTP/1.1 503").then_some(got)
    })
    .await;
    assert!(refused.contains("\"kind\":\"no_capacity\""), "{refused}");
    assert!(refused.contains("limits.max_connections"), "{refused}");
    assert!(
        refused.to_ascii_lowercase().contains("retry-after: 1"),
        "{refused}"
    );
    drop(held);
    // Once they close, new connections are served again.
    eventually("connections are served again", || async {
        let r = gw
            .http
            .get(gw.at("/healthz"))
            .timeout(Duration::from_secs(2))
            .send()
            .await
            .ok()?;
        (r.status() == 200).then_some(())
    })
    .await;
}

/// Bodies being read hold their bytes in `limits.max_buffered_body_bytes`:
/// clients that announce large bodies and send them slowly cannot together
/// hold more memory than the budget; past it a request gets `429` at once,
/// and the bytes come back when such a client goes away.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bodies_being_read_hold_their_bytes_in_the_buffered_budget() {
    let gw = Gateway::start(
        r#"
        [limits]
        max_body_bytes = "1MiB"
        max_task_body_bytes = "1MiB"
        max_buffered_body_bytes = "2MiB"
        "#,
    );
    let head = "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n\
                Content-Type: application/json\r\nContent-Length: 1048576\r\n\r\n";
    let small = json!({"model": "nope", "messages": [{"role": "user", "content": "hi"}]});
    let answered = || async {
        gw.http
            .post(gw.at("/v1/chat/completions"))
            .json(&small)
            .send()
            .await
            .expect("send")
    };
    // Announcing a body costs nothing until its bytes come: three clients
    // that send headers alone leave the budget to the others.
    let mut silent = Vec::new();
    for _ in 0..3 {
        let mut s = TcpStream::connect(addr(&gw)).await.expect("connect");
        s.write_all(head.as_bytes()).await.expect("write");
        silent.push(s);
    }
    assert_eq!(answered().await.status(), 404, "no such model");
    // Two that send all but the last byte hold it all.
    let mut held = Vec::new();
    for _ in 0..2 {
        let mut s = TcpStream::connect(addr(&gw)).await.expect("connect");
        s.write_all(head.as_bytes()).await.expect("write");
        s.write_all(format!("{{{}", " ".repeat(1048574)).as_bytes())
            .await
            .expect("write");
        held.push(s);
    }
    // Probed only once both bodies are held: a probe read while one still
    // grows could take the room it grows into, and have it refused instead.
    eventually("both bodies are held", || async {
        (gw.metric("warmgate_buffered_body_bytes").await >= (2 * 1048576) as f64).then_some(())
    })
    .await;
    let refused: Value = eventually("a request is refused while the budget is held", || async {
        let r = answered().await;
        if r.status() != 429 {
            return None;
        }
        assert!(r.headers().contains_key("retry-after"));
        Some(r.json().await.expect("json"))
    })
    .await;
    assert_eq!(kind(&refused), "queue_full", "{refused}");
    assert!(
        refused["error"]["message"]
            .as_str()
            .unwrap_or_default()
            .contains("max_buffered_body_bytes"),
        "{refused}"
    );
    // One slow client goes away: its bytes are free, and the small
    // request is read and answered (no such model).
    drop(held.pop());
    eventually("the budget is free again", || async {
        (answered().await.status() == 404).then_some(())
    })
    .await;
    drop(silent);
}

/// A gateway with `idle_timeout = "1s"` (and `limits`, more keys of
/// `[limits]`) and one app of one replica with one slot, ready.
async fn one_slot_gateway(limits: &str) -> Gateway {
    let gw = Gateway::start(&format!(
        r#"
        [limits]
        idle_timeout = "1s"
        {limits}
        [[apps]]
        name = "m"
        command = ["{{worker}}"]
        concurrency = 1
        [apps.autoscale]
        min = 1
        max = 1
        "#
    ));
    gw.wait_ready("m", 1).await;
    gw
}

/// The app's only slot is free: nothing in flight, and a request is served.
async fn the_slot_is_free_again(gw: &Gateway) {
    eventually("the slot is free again", || async {
        (gw.app_status("m").await["inflight"] == 0).then_some(())
    })
    .await;
    let r = gw.http.get(gw.at("/apps/m/x")).send().await.expect("send");
    assert_eq!(r.status(), 200);
}

/// A streamed body that stops moving is cut off after `idle_timeout`, well
/// before `request_timeout`, and the replica's only slot is free again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streamed_body_that_stalls_gives_up_its_slot_after_the_idle_timeout() {
    let gw = one_slot_gateway("request_timeout = \"120s\"").await;
    let mut stalled = TcpStream::connect(addr(&gw)).await.expect("connect");
    stalled
        .write_all(
            b"POST /apps/m/echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n\
              5\r\nhello\r\n",
        )
        .await
        .expect("write");
    let got = read_to_close(&mut stalled).await;
    assert!(got.starts_with("HTTP/1.1 504"), "{got}");
    assert!(got.contains("limits.idle_timeout"), "{got}");
    the_slot_is_free_again(&gw).await;
}

/// A replica that sends its headers and a first event, then hangs, is cut
/// off after `idle_timeout` (nginx's `proxy_read_timeout`): the client's
/// stream ends, and the replica's only slot is free for the next request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_that_stalls_mid_answer_gives_up_its_slot_after_the_idle_timeout() {
    let gw = one_slot_gateway("").await;
    // Three events ten minutes apart: only the first comes before the
    // gateway gives up on the rest.
    let mut s = TcpStream::connect(addr(&gw)).await.expect("connect");
    s.write_all(
        b"GET /apps/m/stream?sse=3&interval_ms=600000 HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    )
    .await
    .expect("write");
    let got = read_to_close(&mut s).await;
    assert!(got.starts_with("HTTP/1.1 200"), "{got}");
    assert!(got.contains("tok0"), "{got}");
    assert!(!got.contains("tok1") && !got.contains("[DONE]"), "{got}");
    the_slot_is_free_again(&gw).await;
    let metrics = gw
        .http
        .get(gw.at("/metrics"))
        .bearer_auth(gw.admin_token())
        .send()
        .await
        .expect("metrics");
    let text = metrics.text().await.expect("text");
    assert!(
        text.lines()
            .any(|l| l.starts_with("warmgate_stalled_answers_total") && l.ends_with(" 1")),
        "{text}"
    );
}

/// One request over a fresh connection (no keep-alive pool, which would hold
/// the only slot); the status line, or `None` if the connection failed.
async fn status_line(addr: &str, path: &str) -> Option<String> {
    let mut s = TcpStream::connect(addr).await.ok()?;
    s.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes())
        .await
        .ok()?;
    let got = read_to_close(&mut s).await;
    got.lines().next().map(str::to_string)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_stops_reading_is_cut_off_after_the_idle_timeout() {
    let gw = Gateway::start(
        r#"
        [limits]
        max_connections = 1
        idle_timeout = "3s"
        max_body_bytes = "64MiB"
        [[apps]]
        name = "m"
        command = ["{worker}"]
        [apps.autoscale]
        min = 1
        max = 1
        "#,
    );
    let addr = addr(&gw);
    eventually("the app is ready", || async {
        status_line(&addr, "/apps/m/ready")
            .await
            .filter(|l| l.starts_with("HTTP/1.1 200"))
    })
    .await;
    // A sends 48 MB for the worker to echo back, and never reads the
    // answer: more than the socket buffers on both sides can take, so the
    // gateway's writes stall. (12 MB could fit in autotuned buffers: the
    // answer then went out whole, and the slot was free again a second
    // later, before a busy machine looked.) The idle timeout leaves a
    // loaded machine three seconds to see A hold the slot.
    //
    // A's connection can itself be refused if the last readiness probe's
    // connection has not given its slot back yet: A then reads the 503 and
    // tries again once the slot is free. Reading the status line takes a
    // few kilobytes of the answer at most, nothing like 48 MB.
    let body = vec![b'a'; 48 * 1024 * 1024];
    let mut tries = 0;
    let _a = loop {
        tries += 1;
        assert!(tries <= 20, "A never got the connection slot");
        let mut a = TcpStream::connect(&addr).await.expect("connect");
        let head = format!(
            "POST /apps/m/echo HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n\r\n",
            body.len()
        );
        // A refused connection may be closed before the body is all sent.
        let sent = async {
            a.write_all(head.as_bytes()).await?;
            a.write_all(&body).await?;
            let mut line = Vec::new();
            let mut buf = [0u8; 256];
            while !line.windows(2).any(|w| w == b"\r\n") {
                let n = a.read(&mut buf).await?;
                if n == 0 {
                    break;
                }
                line.extend_from_slice(&buf[..n]);
            }
            std::io::Result::Ok(line)
        }
        .await;
        match sent {
            Ok(line) if line.starts_with(b"HTTP/1.1 200") => break a,
            Ok(line) => assert!(
                line.is_empty() || line.starts_with(b"HTTP/1.1 503"),
                "{}",
                String::from_utf8_lossy(&line)
            ),
            Err(_) => {}
        }
        drop(a);
        eventually("the slot is free again", || async {
            status_line(&addr, "/healthz")
                .await
                .filter(|l| l.starts_with("HTTP/1.1 200"))
        })
        .await;
    };
    // While A holds the only connection slot, others are refused...
    eventually("A holds the slot", || async {
        status_line(&addr, "/healthz")
            .await
            .filter(|l| l.starts_with("HTTP/1.1 503"))
    })
    .await;
    // ...until nothing has moved on A for idle_timeout and the gateway
    // hangs up on it, freeing the slot.
    eventually("A is cut off, and the next client is served", || async {
        status_line(&addr, "/healthz")
            .await
            .filter(|l| l.starts_with("HTTP/1.1 200"))
    })
    .await;
}

/// One answer read off `s`: its head (lowercased) and its body, by its
/// `content-length`; `None` if the connection ends first.
async fn read_answer(s: &mut TcpStream) -> Option<(String, String)> {
    let mut buf = Vec::new();
    let mut byte = [0u8; 1];
    while !buf.ends_with(b"\r\n\r\n") {
        match tokio::time::timeout(WAIT, s.read(&mut byte)).await {
            Ok(Ok(1)) => buf.push(byte[0]),
            _ => return None,
        }
    }
    let head = String::from_utf8_lossy(&buf).to_ascii_lowercase();
    let len: usize = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0);
    let mut body = vec![0u8; len];
    tokio::time::timeout(WAIT, s.read_exact(&mut body))
        .await
        .ok()?
        .ok()?;
    Some((head, String::from_utf8_lossy(&body).into_owned()))
}

/// The head of a chat request with `key` whose body is `len` bytes, and
/// `extra` headers.
fn chat_head(key: &str, len: usize, extra: &str) -> String {
    format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {key}\r\n\
         content-type: application/json\r\ncontent-length: {len}\r\n{extra}\r\n"
    )
}

/// A refusal made on the headers (a wrong key, a tenant over its rate)
/// before the body has arrived: the gateway reads the body and keeps the
/// connection, so the client's next request on it is answered (it used
/// to close the connection after an answer that said it stayed open, and
/// the official `openai` client's next request failed with "server
/// disconnected"). A body that does not come, or one the client waits to
/// be asked for (`Expect: 100-continue`), ends the connection, and the
/// answer says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refusal_before_the_body_keeps_the_connection_or_says_it_closes() {
    let gw = tenants_gateway();
    gw.wait_ready("m", 1).await;
    let body = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).to_string();
    // Bravo's one request a burst goes through; its next is over its rate.
    let (status, _, _) = send(
        &gw,
        reqwest::Method::POST,
        "/v1/chat/completions",
        Some(KEY_B),
        Some(serde_json::from_str(&body).expect("json")),
    )
    .await;
    assert_eq!(status, 200);
    for (key, expected) in [("not-a-key", "401"), (KEY_B, "429")] {
        let mut s = TcpStream::connect(addr(&gw)).await.expect("connect");
        s.set_nodelay(true).expect("nodelay");
        s.write_all(chat_head(key, body.len(), "").as_bytes())
            .await
            .expect("head");
        // The body comes after the head, as a client's second write does
        // on a busy machine.
        tokio::time::sleep(Duration::from_millis(300)).await;
        s.write_all(body.as_bytes()).await.expect("body");
        let (head, answer) = read_answer(&mut s).await.expect("the refusal");
        assert!(head.starts_with(&format!("http/1.1 {expected}")), "{head}");
        assert!(!head.contains("connection: close"), "{head}{answer}");
        // The same connection serves the next request.
        s.write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
            .await
            .expect("next request");
        let (head, answer) = read_answer(&mut s)
            .await
            .unwrap_or_else(|| panic!("the connection after a {expected} closed"));
        assert!(head.starts_with("http/1.1 200"), "{head}{answer}");
    }
    // A body announced and never sent: answered within moments, closing.
    let mut s = TcpStream::connect(addr(&gw)).await.expect("connect");
    s.write_all(chat_head("not-a-key", 100, "").as_bytes())
        .await
        .expect("head");
    let (head, _) = read_answer(&mut s).await.expect("the refusal");
    assert!(head.starts_with("http/1.1 401"), "{head}");
    assert!(head.contains("connection: close"), "{head}");
    assert_eq!(read_to_close(&mut s).await, "", "then the connection ends");
    // A client waiting for `100 Continue` is not asked for its body.
    let mut s = TcpStream::connect(addr(&gw)).await.expect("connect");
    s.write_all(chat_head("not-a-key", 100, "expect: 100-continue\r\n").as_bytes())
        .await
        .expect("head");
    let (head, _) = read_answer(&mut s).await.expect("the refusal");
    assert!(head.starts_with("http/1.1 401"), "{head}");
    assert!(head.contains("connection: close"), "{head}");
    assert!(
        gw.metric("warmgate_unread_bodies_closed_total").await >= 2.0,
        "counted"
    );
}
