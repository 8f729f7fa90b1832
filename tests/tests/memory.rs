//! What a request may cost the gateway in memory: bounded by its size, not
//! by its shape. Hostile JSON bodies at the largest accepted size go to
//! every JSON route of the real binary while its resident set is read from
//! `/proc`; finished task results are kept within their byte budget; and
//! an async task that cannot be journaled is refused and never runs.

mod common;

use common::{Gateway, eventually, kind, replica_json};
use serde_json::{Value, json};

const MIB: usize = 1024 * 1024;
/// The bound the issue sets for the gateway under hostile bodies: 100 MB
/// of resident memory for the release binary, which idles at about 36 MB.
/// The debug build this test runs idles at about 60 MB (its larger code
/// and debug sections), so what is held to the bound is the growth over
/// the idle size: at most 64 MB, what the release binary may grow.
const MAX_GROWTH_BYTES: u64 = (100 - 36) * MIB as u64;
/// The defaults of `limits.max_body_bytes` and `limits.max_task_body_bytes`.
const BODY_LIMIT: usize = 16 * MIB;
const TASK_BODY_LIMIT: usize = 8 * MIB;

/// The resident set of a process, from `/proc/<pid>/status`.
fn rss_bytes(pid: i32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("proc status");
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS");
    kib * 1024
}

/// `prefix`, then `unit` repeated, then `suffix`, padded with spaces to
/// exactly `size` bytes (JSON allows the whitespace).
fn fill(prefix: &str, unit: &str, suffix: &str, size: usize) -> Vec<u8> {
    let room = size - prefix.len() - suffix.len();
    let mut body = String::with_capacity(size);
    body.push_str(prefix);
    body.push_str(&unit.repeat(room / unit.len()));
    body.push_str(suffix);
    body.push_str(&" ".repeat(size - body.len()));
    body.into_bytes()
}

/// A body named by its shape.
type Shaped = (&'static str, Vec<u8>);

/// A value of each hostile shape, placed after `prefix` and closed by
/// `suffix`, each body exactly `size` bytes.
fn shapes(prefix: &str, suffix: &str, size: usize) -> Vec<Shaped> {
    // Deep arrays: serde_json stops at a depth of 128; the rest of the
    // body still has to be read and refused.
    let depth = (size - prefix.len() - suffix.len()) / 2;
    let deep = {
        let mut b = prefix.as_bytes().to_vec();
        b.extend(std::iter::repeat_n(b'[', depth));
        b.extend(std::iter::repeat_n(b']', depth));
        b.extend_from_slice(suffix.as_bytes());
        b.resize(size, b' ');
        b
    };
    let keys = {
        let mut b = format!("{prefix}{{").into_bytes();
        let mut i = 0u64;
        while b.len() + suffix.len() + 24 < size {
            b.extend_from_slice(format!("\"k{i}\":0,").as_bytes());
            i += 1;
        }
        b.extend_from_slice(format!("\"k{i}\":0}}{suffix}").as_bytes());
        b.resize(size, b' ');
        b
    };
    vec![
        ("deep arrays", deep),
        (
            "a long string",
            fill(&format!("{prefix}\""), "a", &format!("\"{suffix}"), size),
        ),
        ("many keys", keys),
        (
            "a big array of numbers",
            fill(&format!("{prefix}[0"), ",0", &format!("]{suffix}"), size),
        ),
    ]
}

/// Every JSON route, with where a hostile value goes in its body so that
/// the whole body has to be read before it is refused, and its limit.
fn routes() -> Vec<(&'static str, Vec<Shaped>)> {
    let openai = |size| {
        let mut all = shapes(r#"{"model":"#, "}", size);
        // An OpenAI body with many keys and no model at all.
        all.push(("many keys, no model", shapes("", "", size).remove(2).1));
        all
    };
    let task = |size| shapes(r#"{"input":"#, r#","timeout":"never"}"#, size);
    let batch = |size| shapes(r#"{"inputs":"#, r#","timeout":"never"}"#, size);
    let sync = |size| shapes(r#"{"checkpoint":"x","version":1,"timeout":"#, "}", size);
    let promote = |size| shapes(r#"{"checkpoint":"x","bake":"#, "}", size);
    vec![
        ("/v1/chat/completions", openai(BODY_LIMIT)),
        ("/v1/completions", openai(BODY_LIMIT)),
        ("/v1/embeddings", openai(BODY_LIMIT)),
        ("/v1/pools/p/tasks", task(TASK_BODY_LIMIT)),
        ("/v1/pools/p/tasks?async=true", task(TASK_BODY_LIMIT)),
        ("/v1/pools/p/tasks/batch", batch(TASK_BODY_LIMIT)),
        ("/v1/pools/p/weights", sync(BODY_LIMIT)),
        ("/v1/apps/m/promote", promote(BODY_LIMIT)),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_bodies_on_every_json_route_keep_the_gateway_under_100_mb() {
    // The binary as users run it, with no allocator setting: it returns
    // freed pages to the OS at once by itself (`gateway/src/main.rs`).
    // Two rounds, so that memory kept from one body to the next shows.
    let gw = Gateway::start(
        r#"
        [[apps]]
        name = "m"
        command = ["{worker}"]
        [apps.autoscale]
        min = 0
        [[pools]]
        name = "p"
        command = ["{worker}"]
        replicas = [0, 1]
        "#,
    );
    let routes = routes();
    let baseline = rss_bytes(gw.pid());
    let mut peak = baseline;
    for round in 0..2 {
        for (path, bodies) in &routes {
            for (shape, body) in bodies {
                let r = gw
                    .http
                    .post(gw.at(path))
                    .header("content-type", "application/json")
                    .body(body.clone())
                    .send()
                    .await
                    .expect("send");
                let status = r.status().as_u16();
                let answer: Value = r.json().await.unwrap_or(Value::Null);
                assert!(
                    (400..500).contains(&status),
                    "{path} with {shape}: {status} {answer}"
                );
                assert!(
                    !kind(&answer).is_empty(),
                    "{path} with {shape}: not a JSON error: {answer}"
                );
                let rss = rss_bytes(gw.pid());
                peak = peak.max(rss);
                assert!(
                    rss.saturating_sub(baseline) < MAX_GROWTH_BYTES,
                    "round {round}, {path} with {shape} ({} bytes): RSS {} MB (at start {} MB)",
                    body.len(),
                    rss / MIB as u64,
                    baseline / MIB as u64
                );
            }
        }
    }
    eprintln!(
        "gateway RSS: {} MB at start, {} MB at most",
        baseline / MIB as u64,
        peak / MIB as u64
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn finished_async_results_are_kept_within_their_byte_budget() {
    const BUDGET: usize = 8 * MIB;
    let gw = Gateway::start(&format!(
        r#"
        [limits]
        max_task_results_bytes = {BUDGET}
        [[pools]]
        name = "p"
        command = ["{{worker}}"]
        replicas = [1, 1]
        concurrency = 4
        "#
    ));
    eventually("the pool's replica is ready", || async {
        let s = gw.json("/v1/status").await;
        (s["pools"][0]["ready"].as_u64() == Some(1)).then_some(())
    })
    .await;
    // The worker echoes its input: 1.5 MiB in, 1.5 MiB out. 60 tasks make
    // 90 MiB of results, then 30 more another 45 MiB: past the budget, the
    // gateway must not grow with them.
    let pad = "x".repeat(3 * MIB / 2);
    let mut ids = Vec::new();
    let mut run = async |from: usize, to: usize| {
        for i in from..to {
            let (status, body) = gw
                .post(
                    "/v1/pools/p/tasks?async=true",
                    &json!({"input": {"n": i, "pad": pad}}),
                )
                .await;
            assert_eq!(status, 202, "{}", body["error"]);
            ids.push(body["id"].as_str().expect("id").to_string());
        }
        for id in &ids[from..to] {
            eventually("the task ends", || async {
                let t = gw.json(&format!("/v1/tasks/{id}")).await;
                (t["state"] == "succeeded").then_some(())
            })
            .await;
        }
        rss_bytes(gw.pid())
    };
    let after_60 = run(0, 60).await;
    let after_90 = run(60, 90).await;
    let grown = after_90.saturating_sub(after_60);
    assert!(
        grown < (2 * BUDGET) as u64,
        "RSS grew by {} MB (to {} MB) over 45 MiB more results, with a budget of {} MB",
        grown / MIB as u64,
        after_90 / MIB as u64,
        BUDGET / MIB
    );
    // The newest result is in memory, whole.
    let last = gw.json(&format!("/v1/tasks/{}", ids[89])).await;
    assert_eq!(last["output"]["echo"]["n"], 89, "{}", last["state"]);
    // The oldest was dropped from memory: the journal still knows it
    // ended, and says its large output was not kept.
    let first = gw.json(&format!("/v1/tasks/{}", ids[0])).await;
    assert_eq!(first["state"], "succeeded", "{first}");
    assert!(
        first["output"].is_null(),
        "kept in memory: {}",
        first["state"]
    );
    assert!(first["output_dropped"].is_string(), "{first}");
    assert!(gw.metric("warmgate_task_results_evicted_total").await >= 1.0);

    // A task answered synchronously is not kept once delivered.
    let (status, body) = gw.post("/v1/pools/p/tasks", &json!({"input": 1})).await;
    assert_eq!(status, 200, "{body}");
    let id = body["id"].as_str().expect("id");
    let r = gw
        .http
        .get(gw.at(&format!("/v1/tasks/{id}")))
        .send()
        .await
        .expect("get");
    assert_eq!(r.status(), 404);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_async_task_that_cannot_be_journaled_is_refused_and_never_runs() {
    let gw = Gateway::start(
        r#"
        [[pools]]
        name = "p"
        command = ["{worker}"]
        replicas = [1, 1]
        concurrency = 1
        "#,
    );
    let worker = eventually("the pool's replica is ready", || async {
        let s = gw.json("/v1/status").await;
        s["pools"][0]["pool"]["replicas"][0]["addr"]
            .as_str()
            .filter(|_| s["pools"][0]["ready"].as_u64() == Some(1))
            .map(str::to_string)
    })
    .await;
    // The journal's writes now fail, as on a full disk: a trigger in the
    // gateway's own state.db aborts every insert.
    let db = gw.dir.path().join("state").join("state.db");
    let conn = rusqlite::Connection::open(&db).expect("open state.db");
    conn.busy_timeout(std::time::Duration::from_secs(5))
        .expect("busy timeout");
    conn.execute_batch(
        "CREATE TRIGGER full_disk BEFORE INSERT ON tasks \
         BEGIN SELECT RAISE(ABORT, 'database or disk is full'); END;",
    )
    .expect("add the trigger");

    let (status, body) = gw
        .post("/v1/pools/p/tasks?async=true", &json!({"input": {"n": 1}}))
        .await;
    assert_eq!(status, 500, "{body}");
    assert_eq!(kind(&body), "internal");

    // A synchronous task (not journaled) runs after it on the only slot:
    // once it has answered, the refused one would have reached the worker.
    let (status, body) = gw
        .post("/v1/pools/p/tasks", &json!({"input": {"n": 2}}))
        .await;
    assert_eq!(status, 200, "{body}");
    let stats: Value = replica_json(&worker, "/stats").await;
    assert_eq!(
        stats["requests"], 1,
        "the worker received the refused task: {stats}"
    );
}

/// Opens `n` connections to `addr`, each sending the request line and
/// headers of `POST path` announcing `announced` bytes, then `sent` bytes
/// of the body; the streams are kept open (and silent) by the caller.
async fn announce(
    addr: &str,
    path: &str,
    n: usize,
    announced: usize,
    sent: usize,
) -> Vec<tokio::net::TcpStream> {
    use tokio::io::AsyncWriteExt as _;
    let mut body = br#"{"model": "m", "input": ""#.to_vec();
    body.resize(sent.max(body.len()), b'a');
    let head = format!(
        "POST {path} HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\ncontent-length: {announced}\r\n\r\n"
    );
    let mut streams = Vec::with_capacity(n);
    for _ in 0..n {
        let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
        s.write_all(head.as_bytes()).await.expect("headers");
        s.write_all(&body[..sent]).await.expect("body");
        streams.push(s);
    }
    streams
}

/// The attack of the third security review: thousands of connections that
/// announce 16 MiB bodies and send only their headers (or a little of the
/// body) held 2 MiB of resident memory each, charged to no budget (the
/// buffer was reserved at the announced length, and transparent huge
/// pages backed its first touched page with 2 MiB). The buffer now grows
/// with what has arrived, each step charged first, and huge pages are off:
/// 2,000 such connections cost the gateway a bounded, small amount each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_announcing_large_bodies_hold_only_what_they_sent() {
    let gw = Gateway::start(
        r#"
        [limits]
        max_buffered_body_bytes = "64MiB"
        [[apps]]
        name = "m"
        command = ["{worker}"]
        [apps.autoscale]
        min = 0
        "#,
    );
    let addr = gw.url.trim_start_matches("http://").to_string();
    let baseline = rss_bytes(gw.pid());
    // Headers and 1 KiB of a body that announces almost 16 MiB.
    const CONNECTIONS: usize = 2_000;
    let silent = announce(&addr, "/v1/embeddings", CONNECTIONS, 16_777_000, 1024).await;
    // Every connection is being read by the gateway: wait until the
    // resident set stops growing (the handlers have all taken their
    // first step), within a bounded time.
    let last = std::sync::atomic::AtomicU64::new(0);
    let pid = gw.pid();
    let settled = eventually("the gateway to take every connection", || {
        let rss = rss_bytes(pid);
        let open = std::fs::read_dir(format!("/proc/{pid}/fd"))
            .map(|d| d.count())
            .unwrap_or(0);
        let before = last.swap(rss, std::sync::atomic::Ordering::Relaxed);
        let still = rss.abs_diff(before) < MIB as u64 && open >= CONNECTIONS;
        async move { still.then_some(rss) }
    })
    .await;
    let per_connection = settled.saturating_sub(baseline) / CONNECTIONS as u64;
    eprintln!(
        "{CONNECTIONS} connections announcing 16 MiB: RSS {} MB (at start {} MB), {} KiB each",
        settled / MIB as u64,
        baseline / MIB as u64,
        per_connection / 1024
    );
    // The bound documented in docs/reliability.md ("Memory per
    // connection"): two 64 KiB connection buffers and the first 16 KiB
    // step of the body, with room for the allocator's rounding. Before,
    // each cost about 2 MiB.
    assert!(
        per_connection < 160 * 1024,
        "each silent connection holds {} KiB",
        per_connection / 1024
    );
    // The gateway still answers others while they wait.
    let models = gw.json("/v1/models").await;
    assert!(models["data"].is_array(), "{models}");
    drop(silent);

    // Bodies that really arrive are held within the budget: 96
    // connections each sending 1 MiB of an announced 16 MiB hold at most
    // the 64 MiB budget (the rest are refused with 429 as they grow), not
    // 96 MiB of buffers reserved ahead.
    let before = rss_bytes(gw.pid());
    let sending = announce(&addr, "/v1/embeddings", 96, 16_777_000, MIB).await;
    let held = eventually("the gateway to read what was sent", || async {
        let status = gw.json("/v1/status").await;
        let rss = rss_bytes(gw.pid());
        let refused = gw.metric("warmgate_buffered_body_refusals_total").await;
        (refused > 0.0).then_some((rss, status))
    })
    .await;
    eprintln!(
        "96 connections sending 1 MiB each: RSS {} MB (before {} MB)",
        held.0 / MIB as u64,
        before / MIB as u64
    );
    assert!(
        held.0.saturating_sub(before) < 64 * MIB as u64 + 32 * MIB as u64,
        "RSS grew {} MB with a 64 MiB budget",
        held.0.saturating_sub(before) / MIB as u64
    );
    drop(sending);
}

/// The attack of issue 40: team-b's flood of large async results pushed
/// out team-a's one unread result, which then read back as dropped "by a
/// restart". Results are now shared fairly between tenants.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_tenant_s_flood_of_results_leaves_another_s_unread_result() {
    const BUDGET: usize = 16 * MIB;
    const KEY_A: &str = "wg-team-a-key-results-5c1e";
    const KEY_B: &str = "wg-team-b-key-results-93fa";
    let gw = Gateway::start_with(
        &format!(
            r#"
            [limits]
            max_task_results_bytes = {BUDGET}
            [[pools]]
            name = "p"
            command = ["{{worker}}"]
            replicas = [1, 1]
            concurrency = 4
            [[tenants]]
            name = "team-a"
            api_key_env = "TEST_RESULTS_KEY_A"
            [[tenants]]
            name = "team-b"
            api_key_env = "TEST_RESULTS_KEY_B"
            "#
        ),
        &[],
        &[("TEST_RESULTS_KEY_A", KEY_A), ("TEST_RESULTS_KEY_B", KEY_B)],
    );
    eventually("the pool's replica is ready", || async {
        let s = gw.json("/v1/status").await;
        (s["pools"][0]["ready"].as_u64() == Some(1)).then_some(())
    })
    .await;
    let submit = async |key: &str, n: usize, bytes: usize| {
        let r = gw
            .http
            .post(gw.at("/v1/pools/p/tasks?async=true"))
            .bearer_auth(key)
            .json(&json!({"input": {"n": n, "pad": "x".repeat(bytes)}}))
            .send()
            .await
            .expect("send");
        assert_eq!(r.status(), 202);
        let body: Value = r.json().await.expect("json");
        body["id"].as_str().expect("id").to_string()
    };
    let read = async |key: &str, id: &str| -> Value {
        gw.http
            .get(gw.at(&format!("/v1/tasks/{id}")))
            .bearer_auth(key)
            .send()
            .await
            .expect("get")
            .json()
            .await
            .expect("json")
    };
    let ended = async |key: &str, id: &str| {
        let t = eventually("the task ends", || async {
            let t = read(key, id).await;
            (t["state"] == "succeeded" || t["state"] == "failed" || t["error"].is_object())
                .then_some(t)
        })
        .await;
        assert_eq!(t["state"], "succeeded", "{t}");
    };
    // team-a: one 1.5 MiB result, left unread (the test worker takes
    // bodies of 2 MB at most).
    let size = 3 * MIB / 2;
    let a = submit(KEY_A, 0, size).await;
    ended(KEY_A, &a).await;
    // team-b: 20 results of 1.5 MiB, 30 MiB against a 16 MiB budget.
    let mut b = Vec::new();
    for i in 0..20 {
        let id = submit(KEY_B, i, size).await;
        ended(KEY_B, &id).await;
        b.push(id);
    }
    let kept = read(KEY_A, &a).await;
    assert_eq!(kept["state"], "succeeded");
    assert_eq!(
        kept["output"]["echo"]["pad"].as_str().map(str::len),
        Some(size),
        "team-a's result was dropped: {}",
        kept.get("output_dropped").unwrap_or(&Value::Null)
    );
    // team-b's own oldest went, and says why, truthfully.
    let oldest = read(KEY_B, &b[0]).await;
    assert!(oldest["output"].is_null(), "{}", oldest["state"]);
    assert_eq!(oldest["output_dropped_cause"], "result_budget", "{oldest}");
    let why = oldest["output_dropped"].as_str().unwrap_or_default();
    assert!(
        why.contains("max_task_results_bytes") && !why.contains("restart"),
        "{why}"
    );
    let newest = read(KEY_B, &b[19]).await;
    assert_eq!(newest["output"]["echo"]["n"], 19);
}
