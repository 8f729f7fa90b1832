//! Bad input and broken workers: every failure is a clear JSON error, never
//! a panic or a hang.

mod common;

use common::{Gateway, eventually, kind, replica_refuses};
use serde_json::{Value, json};

/// A request that waited for a start which failed: 502 `replica_failed`,
/// with the cause in the message.
async fn expect_start_failure(gw: &Gateway, path: &str, cause: &str) {
    let (status, body) = error_of(gw.http.get(gw.at(path)).send().await.expect("send")).await;
    assert_eq!(status, 502, "{body}");
    assert_eq!(kind(&body), "replica_failed");
    let msg = body["error"]["message"].as_str().unwrap_or_default();
    assert!(msg.contains(cause), "{msg}");
}

async fn error_of(resp: reqwest::Response) -> (u16, Value) {
    let status = resp.status().as_u16();
    let body: Value = resp.json().await.expect("errors are JSON");
    (status, body)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_clear_json_errors() {
    let gw = Gateway::start(
        r#"
        [limits]
        max_body_bytes = 1024
        [[apps]]
        name = "echo"
        command = ["{worker}"]
        "#,
    );
    let cases: Vec<(reqwest::RequestBuilder, u16, &str, &str)> = vec![
        (
            gw.http.get(gw.at("/apps/nope/x")),
            404,
            "not_found",
            "app 'nope'",
        ),
        (
            gw.http
                .post(gw.at("/v1/chat/completions"))
                .json(&json!({"model": "gpt-5"})),
            404,
            "not_found",
            "available models: echo",
        ),
        (
            gw.http
                .post(gw.at("/v1/chat/completions"))
                .json(&json!({"messages": []})),
            400,
            "bad_request",
            "no \"model\" field",
        ),
        (
            gw.http
                .post(gw.at("/v1/completions"))
                .json(&json!({"model": 3})),
            400,
            "bad_request",
            "must be a string",
        ),
        (
            gw.http.post(gw.at("/v1/embeddings")).body("{not json"),
            400,
            "bad_request",
            "JSON object",
        ),
        (
            gw.http.post(gw.at("/v1/embeddings")).body(format!(
                r#"{{"model":"echo","input":"{}"}}"#,
                "x".repeat(4096)
            )),
            413,
            "too_large",
            "1024 bytes",
        ),
        (
            gw.http
                .post(gw.at("/apps/echo/upload"))
                .body(vec![b'x'; 4096]),
            413,
            "too_large",
            "1024 bytes",
        ),
        (
            gw.http.get(gw.at("/v1/embeddings")),
            405,
            "method_not_allowed",
            "GET",
        ),
        (gw.http.get(gw.at("/nowhere")), 404, "not_found", "/nowhere"),
    ];
    for (req, status, want_kind, words) in cases {
        let (got, body) = error_of(req.send().await.expect("send")).await;
        assert_eq!(got, status, "{body}");
        assert_eq!(kind(&body), want_kind, "{body}");
        let msg = body["error"]["message"].as_str().expect("a message");
        assert!(
            msg.contains(words),
            "message {msg:?} should mention {words:?}"
        );
    }

    // A chunked upload without Content-Length is cut off at the limit too.
    let chunks = futures_util::stream::iter(
        (0..8).map(|_| Ok::<_, std::io::Error>(bytes::Bytes::from(vec![b'y'; 512]))),
    );
    let resp = gw
        .http
        .post(gw.at("/apps/echo/upload"))
        .body(reqwest::Body::wrap_stream(chunks))
        .send()
        .await
        .expect("send");
    let (status, body) = error_of(resp).await;
    assert_eq!(status, 413, "{body}");
    assert_eq!(kind(&body), "too_large");

    // The app still works.
    let resp = gw
        .http
        .post(gw.at("/apps/echo/ok"))
        .body("small")
        .send()
        .await
        .expect("send");
    assert_eq!(resp.status(), 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crashed_replica_is_replaced_and_later_requests_succeed() {
    let gw = Gateway::start(
        r#"
        [[apps]]
        name = "fragile"
        command = ["{worker}"]
        [apps.autoscale]
        min = 1
        max = 1
        "#,
    );
    let first = gw.wait_ready("fragile", 1).await["pool"]["replicas"][0]["id"]
        .as_str()
        .expect("a replica id")
        .to_string();

    let (status, body) = error_of(
        gw.http
            .get(gw.at("/apps/fragile/boom?crash=1"))
            .send()
            .await
            .expect("send"),
    )
    .await;
    assert_eq!(status, 502, "{body}");
    assert_eq!(kind(&body), "replica_failed");

    let second = eventually("a new replica replaces the crashed one", || async {
        let s = gw.app_status("fragile").await;
        let id = s["pool"]["replicas"][0]["id"].as_str().map(String::from)?;
        (s["ready"] == 1 && id != first).then_some(id)
    })
    .await;
    for _ in 0..5 {
        let resp = gw
            .http
            .get(gw.at("/apps/fragile/ok"))
            .send()
            .await
            .expect("send");
        assert_eq!(resp.status(), 200);
        assert_eq!(resp.headers()["x-warmgate-replica"], second.as_str());
    }
    let s = gw.app_status("fragile").await;
    assert_eq!(s["pool"]["restarts"], 1, "{s}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_mid_response_cuts_the_stream_and_frees_the_slot() {
    let gw = Gateway::start(
        r#"
        [[apps]]
        name = "midway"
        command = ["{worker}"]
        [apps.autoscale]
        min = 1
        max = 1
        "#,
    );
    let mut resp = gw
        .http
        .get(gw.at("/apps/midway/x?crash_mid=1"))
        .send()
        .await
        .expect("headers arrive before the crash");
    assert_eq!(resp.status(), 200);
    let mut got = Vec::new();
    let outcome = loop {
        match resp.chunk().await {
            Ok(Some(c)) => got.extend_from_slice(&c),
            Ok(None) => break Ok(()),
            Err(e) => break Err(e),
        }
    };
    assert!(
        outcome.is_err(),
        "the client sees a broken body, not a clean end"
    );
    assert_eq!(String::from_utf8_lossy(&got), "partial\n");
    eventually("the app recovers", || async {
        let r = gw.http.get(gw.at("/apps/midway/ok")).send().await.ok()?;
        (r.status() == 200).then_some(())
    })
    .await;
    let s = gw.app_status("midway").await;
    assert_eq!(s["inflight"], 0, "no slot leaked: {s}");
}

/// A replica whose answer broke off mid-body is ejected from rotation at
/// once (a dying engine's next requests would fail the same way), and,
/// being alive, is back as soon as it answers its probe: the next request
/// is served by it, not by a replacement.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_whose_answer_broke_off_is_ejected_and_back_once_it_answers() {
    let gw = Gateway::start(
        r#"
        [[apps]]
        name = "midway"
        command = ["{worker}"]
        [apps.autoscale]
        min = 1
        max = 1
        [apps.health]
        failure_threshold = 1000
        "#,
    );
    let ready = gw.wait_ready("midway", 1).await;
    let first = ready["pool"]["replicas"][0]["id"]
        .as_str()
        .expect("a replica id")
        .to_string();
    let mut resp = gw
        .http
        .get(gw.at("/apps/midway/x?abort_mid=1"))
        .send()
        .await
        .expect("headers arrive before the break");
    assert_eq!(resp.status(), 200);
    let broke = loop {
        match resp.chunk().await {
            Ok(Some(_)) => {}
            Ok(None) => break false,
            Err(_) => break true,
        }
    };
    assert!(broke, "the client sees a broken body, not a clean end");
    assert_eq!(
        gw.metric(r#"warmgate_replica_ejections_total{cause="broke"}"#)
            .await,
        1.0,
        "ejected"
    );
    let r = gw
        .http
        .get(gw.at("/apps/midway/ok"))
        .send()
        .await
        .expect("send");
    let by = r
        .headers()
        .get("x-warmgate-replica")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    assert_eq!(r.status(), 200);
    assert_eq!(
        by.as_deref(),
        Some(first.as_str()),
        "readmitted, not replaced"
    );
}

/// App `deaf`'s one replica closes its listener (`query` for
/// `/close-listener`) and refuses connections; then one request: the
/// replica's id, and the request's status, answering replica and body.
async fn deafened_then_asked(
    gw: &Gateway,
    query: &str,
) -> (String, reqwest::StatusCode, Option<String>, String) {
    let ready = gw.wait_ready("deaf", 1).await;
    let first = &ready["pool"]["replicas"][0];
    let (first_id, first_addr) = (
        first["id"].as_str().expect("a replica id").to_string(),
        first["addr"].as_str().expect("its address").to_string(),
    );
    let resp = gw
        .http
        .post(gw.at(&format!("/apps/deaf/close-listener{query}")))
        .send()
        .await
        .expect("send");
    assert_eq!(resp.status(), 202);
    eventually("the deaf replica refuses connections", || async {
        replica_refuses(&first_addr).await.then_some(())
    })
    .await;
    let r = gw
        .http
        .get(gw.at("/apps/deaf/x"))
        .send()
        .await
        .expect("send");
    let status = r.status();
    let replica = r
        .headers()
        .get("x-warmgate-replica")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    (
        first_id,
        status,
        replica,
        r.text().await.unwrap_or_default(),
    )
}

/// A replica that refuses connections (its listener closed, its process
/// alive) is taken out of rotation at the first refusal: the request that
/// found it so waits in the hold queue and is answered by the replica the
/// liveness probe starts in its place, not failed (it used to get a `502`
/// three times in 60 ms, until the probe replaced the replica).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_a_deaf_replica_refused_waits_for_its_replacement() {
    let gw = Gateway::start(
        r#"
        [[apps]]
        name = "deaf"
        command = ["{worker}"]
        [apps.autoscale]
        min = 1
        max = 1
        [apps.health]
        period = "500ms"
        "#,
    );
    let (first_id, status, replica, body) = deafened_then_asked(&gw, "").await;
    assert_eq!(status, 200, "answered by the replacement: {body}");
    assert_ne!(replica.as_deref(), Some(first_id.as_str()), "{body}");
    assert!(
        gw.metric(r#"warmgate_replica_ejections_total{cause="refused"}"#)
            .await
            >= 1.0,
        "the refusal took it out of rotation"
    );
}

/// A replica that refused connections for a moment (its listener closed,
/// then open again) is back in rotation once it answers its probe, and the
/// request held meanwhile is answered by it, without a replacement.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_deaf_for_a_moment_is_back_once_it_answers_its_probe() {
    let gw = Gateway::start(
        r#"
        [[apps]]
        name = "deaf"
        command = ["{worker}"]
        [apps.autoscale]
        min = 1
        max = 1
        [apps.health]
        period = "300ms"
        failure_threshold = 1000
        "#,
    );
    let (first_id, status, replica, body) = deafened_then_asked(&gw, "?reopen_ms=1500").await;
    assert_eq!(status, 200, "held, then answered: {body}");
    assert_eq!(replica.as_deref(), Some(first_id.as_str()), "{body}");
    let s = gw.app_status("deaf").await;
    let ids: Vec<&str> = s["pool"]["replicas"]
        .as_array()
        .expect("replicas")
        .iter()
        .filter_map(|r| r["id"].as_str())
        .collect();
    assert_eq!(ids, [first_id.as_str()], "not replaced: {s}");
}

/// A replica that refuses connections (its listener closed, its process
/// not yet seen to fail) was sent nothing: the request goes to the other
/// replica with its whole body, however large (the gateway used to replay
/// only bodies of at most 64 KiB). A request that meets a kept-alive
/// connection the worker closes as it goes deaf may have been read: it
/// fails with that reason rather than being sent twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_a_deaf_replica_refused_goes_to_another_with_its_whole_body() {
    let gw = Gateway::start(
        r#"
        [[apps]]
        name = "deaf"
        command = ["{worker}"]
        [apps.autoscale]
        min = 2
        max = 2
        "#,
    );
    let status = gw.wait_ready("deaf", 2).await;
    let addrs: Vec<String> = status["pool"]["replicas"]
        .as_array()
        .expect("replicas")
        .iter()
        .filter_map(|r| r["addr"].as_str().map(str::to_string))
        .collect();
    let resp = gw
        .http
        .post(gw.at("/apps/deaf/close-listener"))
        .send()
        .await
        .expect("send");
    assert_eq!(resp.status(), 202);
    let deaf = resp
        .headers()
        .get("x-warmgate-replica")
        .and_then(|v| v.to_str().ok())
        .expect("the replica that answered")
        .to_string();
    let deaf_addr = status["pool"]["replicas"]
        .as_array()
        .expect("replicas")
        .iter()
        .find(|r| r["id"] == deaf.as_str())
        .and_then(|r| r["addr"].as_str())
        .unwrap_or_else(|| panic!("{deaf} in {addrs:?}"))
        .to_string();
    // Until the worker has closed its listening socket, the kernel still
    // completes connections into its backlog, and drops them unread when
    // the socket closes: a request sent then was never read, but the
    // gateway cannot tell it from one a replica dropped mid-work. Wait for
    // the refusal itself, which is what this test is about.
    eventually("the deaf replica refuses connections", || async {
        replica_refuses(&deaf_addr).await.then_some(())
    })
    .await;
    let size = 256 * 1024;
    let body = vec![b'z'; size];
    eventually(
        "a request is refused by the deaf replica and sent on",
        || {
            let body = body.clone();
            let gw = &gw;
            async move {
                let r = gw
                    .http
                    .post(gw.at("/apps/deaf/upload"))
                    .body(body)
                    .send()
                    .await
                    .expect("send");
                let status = r.status();
                let v: Value = r.json().await.expect("json");
                if status == 502 {
                    // A request that met a kept-alive connection the worker
                    // was closing as it went deaf (a race the gateway cannot
                    // see coming): it fails with the reason, and what the
                    // client can do about it, never silently.
                    let msg = v["error"]["message"].as_str().unwrap_or_default();
                    assert!(
                        kind(&v) == "replica_failed"
                            && msg.contains("closed the connection before answering")
                            && msg.contains("send it again if it is safe to repeat"),
                        "{v}"
                    );
                    return None;
                }
                assert_eq!(status, 200, "every request is answered: {v}");
                assert_eq!(v["body_bytes"], size, "the whole body arrived: {v}");
                (gw.metric("warmgate_connect_retries_total").await >= 1.0).then_some(())
            }
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_that_never_becomes_ready_fails_held_requests_clearly() {
    let gw = Gateway::start(
        r#"
        [[apps]]
        name = "stuck"
        command = ["{worker}"]
        startup_timeout = "1s"
        env = { TEST_WORKER_NEVER_READY = "1" }
        "#,
    );
    expect_start_failure(&gw, "/apps/stuck/x", "did not become ready within 1s").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_that_exits_at_start_fails_fast_and_backs_off() {
    let gw = Gateway::start(
        r#"
        [[apps]]
        name = "broken"
        command = ["{worker}"]
        env = { TEST_WORKER_EXIT_AT_START = "3" }
        "#,
    );
    expect_start_failure(&gw, "/apps/broken/x", "exited with status 3").await;

    // While it crash-loops, requests are refused at once with Retry-After,
    // instead of waiting out the backoff.
    let resp = eventually("a request is refused during the backoff", || async {
        let r = gw.http.get(gw.at("/apps/broken/x")).send().await.ok()?;
        (r.status() == 503).then_some(r)
    })
    .await;
    assert!(resp.headers().contains_key("retry-after"));
    let (_, body) = error_of(resp).await;
    assert_eq!(kind(&body), "no_capacity", "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap_or_default()
            .contains("failing to start"),
        "{body}"
    );
    let s = gw.app_status("broken").await;
    assert!(s["pool"]["health"]["failing_to_start"] == true, "{s}");
}

/// An app whose worker exits at every start, asked for until it is in a
/// crash loop: every request then gets the same answer at once (502 with
/// `x-should-retry: false`, the state and the worker's last words, no path
/// on the gateway's disk), status and the CLI say `CrashLoopBackOff`, and
/// once nothing asks for it and its idle time has passed it is not started
/// again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_looping_app_stops_restarting_and_answers_one_clear_error() {
    let gw = Gateway::start(
        r#"
        [[apps]]
        name = "looping"
        command = ["{worker}"]
        env = { TEST_WORKER_EXIT_AT_START = "3", HF_TOKEN = "hf_do_not_echo_this" }
        [apps.autoscale]
        scale_to_zero_after = "2s"
        "#,
    );
    let (headers, body) = gw.wait_crash_loop("looping").await;
    assert_eq!(kind(&body), "replica_failed", "{body}");
    assert_eq!(headers["x-should-retry"], "false", "{headers:?}");
    assert!(!headers.contains_key("retry-after"), "{headers:?}");
    let msg = body["error"]["message"].as_str().unwrap_or_default();
    // The failure and the replica; the worker's own words (which may
    // quote a request or a secret) only for admins, in the status below.
    assert!(
        msg.contains("exited with status 3") && msg.contains("replica looping-00001-"),
        "{msg}"
    );
    assert!(
        !msg.contains("exiting before binding") && !msg.contains("/logs/"),
        "no worker output, no path: {msg}"
    );
    // The same answer while it lasts, not 503 one time and 502 the next.
    for _ in 0..5 {
        let r = gw
            .http
            .get(gw.at("/apps/looping/x"))
            .send()
            .await
            .expect("send");
        assert_eq!(r.status().as_u16(), 502);
        assert_eq!(r.headers()["x-should-retry"], "false");
    }
    let s = gw.app_status("looping").await;
    let health = &s["pool"]["health"];
    assert_eq!(health["crash_loop"], true, "{s}");
    assert!(health["failures"].as_u64() >= Some(5), "{s}");
    let (_, text, _) = gw.warmgate(&["status"]);
    assert!(
        text.contains("CrashLoopBackOff") && text.contains("exiting before binding"),
        "{text}"
    );

    // Nothing asks for it any more: it scales to zero, and once its
    // backoff has passed nothing starts it again.
    eventually("the app scales to zero", || async {
        let s = gw.app_status("looping").await;
        (s["pool"]["desired"] == 0).then_some(())
    })
    .await;
    let restarts = gw.app_status("looping").await["pool"]["restarts"].clone();
    eventually("its backoff has passed", || async {
        let s = gw.app_status("looping").await;
        s["pool"]["health"]["retry_in"].is_null().then_some(())
    })
    .await;
    let s = gw.app_status("looping").await;
    assert_eq!(
        s["pool"]["restarts"], restarts,
        "restarted with nothing asking: {s}"
    );
    assert_eq!(s["pool"]["desired"], 0, "{s}");
    assert!(
        s["pool"]["replicas"].as_array().is_some_and(Vec::is_empty),
        "{s}"
    );
}

/// A pool in the same state answers its tasks as an app does, instead of
/// holding them until a bare 504.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_looping_pool_answers_its_tasks_with_the_cause() {
    let gw = Gateway::start(
        r#"
        [[pools]]
        name = "looping"
        command = ["{worker}"]
        replicas = [0, 1]
        env = { TEST_WORKER_EXIT_AT_START = "3" }
        "#,
    );
    let (status, headers, body) = eventually("the pool is in a crash loop", || async {
        let r = gw
            .http
            .post(gw.at("/v1/pools/looping/tasks"))
            .json(&json!({"input": {}, "timeout": "1s"}))
            .send()
            .await
            .ok()?;
        let (status, headers) = (r.status().as_u16(), r.headers().clone());
        let body: Value = r.json().await.ok()?;
        let msg = body["error"]["message"].as_str().unwrap_or_default();
        // Never a timeout that does not say why (the failure, not the
        // worker's words: those are the admins').
        if status == 504 {
            assert!(msg.contains("exited with status 3"), "{body}");
            assert!(!msg.contains("exiting before binding"), "{body}");
        }
        msg.contains("CrashLoopBackOff")
            .then_some((status, headers, body))
    })
    .await;
    assert_eq!((status, kind(&body)), (502, "replica_failed"), "{body}");
    assert_eq!(headers["x-should-retry"], "false");
    assert!(
        body["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("exited with status 3") && !m.contains("binding")),
        "{body}"
    );
    let s = gw.json("/v1/pools/looping").await;
    assert_eq!(s["pool"]["health"]["crash_loop"], true, "{s}");
    assert!(
        s["pool"]["health"]["last_error"]
            .as_str()
            .is_some_and(|m| m.contains("exiting before binding")),
        "the admins read the worker's words: {s}"
    );
}
