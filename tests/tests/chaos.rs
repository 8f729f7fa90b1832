//! Reliability under faults and load, end to end:
//! - chaos: steady inference and task traffic while worker processes are
//!   killed with `kill -9` at random;
//! - overload: ten times the capacity of an app and a pool;
//! - restart: `kill -9` of the gateway itself under load.
//!
//! Each prints a `RELIABILITY` line with its counts (run with
//! `--no-capture` to see them); the reliability table in `docs/benchmarks.md` comes from
//! these lines.

mod common;

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::{Gateway, eventually, kind};
use serde_json::{Value, json};
use tokio::sync::Mutex;
use warmgate_pool::backend::exited;

/// A client gives up on a request after this long: longer than any
/// deadline the gateway applies in these tests, so a give-up is a hang.
const CLIENT_DEADLINE: Duration = Duration::from_secs(40);

/// What became of one request.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
enum Outcome {
    /// 2xx.
    Ok,
    /// An error in the JSON format: status, kind, message.
    Error(u16, String, String),
    /// The client's deadline passed.
    Hung,
    /// The connection failed without an answer.
    Transport(String),
}

async fn call(req: reqwest::RequestBuilder) -> (Outcome, Option<Value>, Option<String>) {
    match req.timeout(CLIENT_DEADLINE).send().await {
        Ok(r) => {
            let status = r.status().as_u16();
            let retry_after = r
                .headers()
                .get("retry-after")
                .and_then(|v| v.to_str().ok())
                .map(str::to_string);
            let body: Value = r.json().await.unwrap_or(Value::Null);
            if (200..300).contains(&status) {
                (Outcome::Ok, Some(body), retry_after)
            } else {
                let message = body["error"]["message"].as_str().unwrap_or("").to_string();
                (
                    Outcome::Error(status, kind(&body).to_string(), message),
                    Some(body),
                    retry_after,
                )
            }
        }
        Err(e) if e.is_timeout() => (Outcome::Hung, None, None),
        Err(e) => (Outcome::Transport(e.to_string()), None, None),
    }
}

/// Ready replicas (id, pid) of every app and pool.
async fn ready_replicas(gw: &Gateway) -> Vec<(String, i32)> {
    let s = gw.json("/v1/status").await;
    let mut out = Vec::new();
    let groups = s["apps"]
        .as_array()
        .into_iter()
        .flatten()
        .chain(s["pools"].as_array().into_iter().flatten());
    for g in groups {
        for r in g["pool"]["replicas"].as_array().into_iter().flatten() {
            if r["state"] == "ready"
                && let (Some(id), Some(pid)) = (r["id"].as_str(), r["pid"].as_i64())
            {
                out.push((id.to_string(), pid as i32));
            }
        }
    }
    out
}

fn kill9_group(pid: i32) {
    let _ = nix::sys::signal::killpg(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGKILL,
    );
}

/// Counts of outcomes, for the report.
fn tally(outcomes: &[Outcome]) -> BTreeMap<String, usize> {
    let mut m = BTreeMap::new();
    for o in outcomes {
        let k = match o {
            Outcome::Ok => "ok".to_string(),
            Outcome::Error(s, k, _) => format!("{s} {k}"),
            Outcome::Hung => "hung".to_string(),
            Outcome::Transport(_) => "transport error".to_string(),
        };
        *m.entry(k).or_insert(0) += 1;
    }
    m
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_kill_9_of_workers_under_load_loses_nothing() {
    const RUN: Duration = Duration::from_secs(30);
    let gw = Arc::new(Gateway::start(
        r#"
        [[apps]]
        name = "m"
        command = ["{worker}"]
        concurrency = 4
        [apps.autoscale]
        min = 3
        max = 3
        [apps.queue]
        timeout = "20s"
        [[pools]]
        name = "p"
        command = ["{worker}"]
        replicas = [3, 3]
        concurrency = 2
        task_timeout = "20s"
        "#,
    ));
    gw.wait_ready("m", 3).await;
    eventually("the pool is warm", || async {
        (ready_replicas(&gw).await.len() == 6).then_some(())
    })
    .await;

    let stop = Arc::new(AtomicBool::new(false));
    let inference = Arc::new(Mutex::new(Vec::new()));
    let tasks = Arc::new(Mutex::new(Vec::new()));
    let retried = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut load = Vec::new();
    for i in 0..6 {
        let (gw, stop, out) = (gw.clone(), stop.clone(), inference.clone());
        load.push(tokio::spawn(async move {
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                n += 1;
                let url = gw.at(&format!("/apps/m/c{i}-{n}?latency_ms=20"));
                let (o, _, _) = call(gw.http.get(url)).await;
                out.lock().await.push(o);
            }
        }));
    }
    for _ in 0..4 {
        let (gw, stop, out, retried) = (gw.clone(), stop.clone(), tasks.clone(), retried.clone());
        load.push(tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                let req = gw
                    .http
                    .post(gw.at("/v1/pools/p/tasks"))
                    .json(&json!({"input": {"sleep_ms": 20}}));
                let (o, body, _) = call(req).await;
                if o == Outcome::Ok
                    && body
                        .as_ref()
                        .and_then(|b| b["attempts"].as_u64())
                        .unwrap_or(1)
                        > 1
                {
                    retried.fetch_add(1, Ordering::Relaxed);
                }
                out.lock().await.push(o);
            }
        }));
    }

    // The killer: every 1.5-3 s, one random ready worker, whole group.
    let started = Instant::now();
    let mut killed: HashSet<String> = HashSet::new();
    let mut kills = 0;
    while started.elapsed() < RUN {
        tokio::time::sleep(Duration::from_millis(fastrand::u64(1500..3000))).await;
        let ready = ready_replicas(&gw).await;
        if ready.is_empty() {
            continue;
        }
        let (id, pid) = ready[fastrand::usize(..ready.len())].clone();
        kill9_group(pid);
        killed.insert(id);
        kills += 1;
    }
    stop.store(true, Ordering::Relaxed);
    for h in load {
        h.await.expect("load task");
    }

    let inference = inference.lock().await.clone();
    let tasks = tasks.lock().await.clone();
    println!(
        "RELIABILITY chaos: {RUN:?} of load, {kills} kill -9 of workers; inference {:?}; tasks {:?}, {} needed a retry",
        tally(&inference),
        tally(&tasks),
        retried.load(Ordering::Relaxed)
    );
    assert!(kills >= 8, "the killer ran: {kills} kills");
    assert!(inference.len() > 100 && tasks.len() > 100, "load ran");
    // Nothing hung past its deadline; every answer was an answer.
    for o in inference.iter().chain(&tasks) {
        assert!(
            !matches!(o, Outcome::Hung | Outcome::Transport(_)),
            "no request may hang or lose its connection: {o:?}"
        );
    }
    // Inference fails only as 502 replica_failed, naming a killed replica.
    for o in &inference {
        if let Outcome::Error(status, k, message) = o {
            assert_eq!((*status, k.as_str()), (502, "replica_failed"), "{message}");
            assert!(
                killed
                    .iter()
                    .any(|id| message.contains(&format!("replica {id} "))),
                "a failure names a replica that was killed: {message}"
            );
        }
    }
    // Every task completes through the system-failure retries.
    for o in &tasks {
        assert_eq!(o, &Outcome::Ok, "every task completes");
    }
    // And the app and the pool come back to their size.
    eventually("app and pool back to 3 ready replicas each", || async {
        (ready_replicas(&gw).await.len() == 6).then_some(())
    })
    .await;
}

/// The gateway's resident memory, in KiB.
fn rss_kib(pid: i32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse().ok())
        })
        .unwrap_or(0)
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overload_at_ten_times_capacity_is_refused_with_retry_after_and_recovers() {
    // Capacity: 2 replicas x 2 slots of 200 ms = 20 requests per second,
    // for the app and for the pool alike. A queue as deep as the slots
    // bounds an admitted request's wait to one service time.
    let gw = Arc::new(Gateway::start(
        r#"
        [[apps]]
        name = "m"
        command = ["{worker}"]
        concurrency = 2
        [apps.autoscale]
        min = 2
        max = 2
        [apps.queue]
        max_pending = 4
        timeout = "10s"
        [[pools]]
        name = "p"
        command = ["{worker}"]
        replicas = [2, 2]
        concurrency = 2
        [pools.queue]
        max_pending = 4
        "#,
    ));
    gw.wait_ready("m", 2).await;
    eventually("the pool is warm", || async {
        (ready_replicas(&gw).await.len() == 4).then_some(())
    })
    .await;
    let inference = |gw: &Gateway| gw.http.get(gw.at("/apps/m/x?latency_ms=200"));
    let task = |gw: &Gateway| {
        gw.http
            .post(gw.at("/v1/pools/p/tasks"))
            .json(&json!({"input": {"sleep_ms": 200}}))
    };

    // Unloaded latency, for comparison.
    let mut unloaded = Vec::new();
    for _ in 0..10 {
        let t = Instant::now();
        assert_eq!(call(inference(&gw)).await.0, Outcome::Ok);
        unloaded.push(t.elapsed());
    }
    unloaded.sort();

    let pid = gw.pid();
    let rss_before = rss_kib(pid);
    let peak = Arc::new(std::sync::atomic::AtomicU64::new(rss_before));
    let sampling = Arc::new(AtomicBool::new(true));
    let sampler = {
        let (peak, sampling) = (peak.clone(), sampling.clone());
        tokio::spawn(async move {
            while sampling.load(Ordering::Relaxed) {
                peak.fetch_max(rss_kib(pid), Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
    };

    // Open loop: 200 inference requests and 200 tasks per second (10x),
    // for 10 seconds.
    const RATE: u64 = 200;
    const SECS: u64 = 10;
    let started = Instant::now();
    let mut calls = Vec::new();
    for i in 0..RATE * SECS {
        let due = started + Duration::from_micros(i * 1_000_000 / RATE);
        tokio::time::sleep_until(due.into()).await;
        let (a, b) = (inference(&gw), task(&gw));
        calls.push(tokio::spawn(async move {
            let t = Instant::now();
            let (o, _, retry) = call(a).await;
            (o, retry, t.elapsed(), true)
        }));
        calls.push(tokio::spawn(async move {
            let t = Instant::now();
            let (o, _, retry) = call(b).await;
            (o, retry, t.elapsed(), false)
        }));
    }
    let mut results = Vec::new();
    for c in calls {
        results.push(c.await.expect("call"));
    }
    sampling.store(false, Ordering::Relaxed);
    sampler.await.expect("sampler");
    let peak = peak.load(Ordering::Relaxed);

    let mut admitted: Vec<Duration> = results
        .iter()
        .filter(|r| r.3 && r.0 == Outcome::Ok)
        .map(|r| r.2)
        .collect();
    admitted.sort();
    let outcomes: Vec<Outcome> = results.iter().map(|r| r.0.clone()).collect();
    println!(
        "RELIABILITY overload: {} requests at 10x capacity; {:?}; gateway RSS {} KiB before, {} KiB peak; \
         admitted inference p50 {:?} p99 {:?} (unloaded p50 {:?})",
        results.len(),
        tally(&outcomes),
        rss_before,
        peak,
        percentile(&admitted, 0.5),
        percentile(&admitted, 0.99),
        percentile(&unloaded, 0.5),
    );
    // Excess load is refused at once with a reason and a time to retry.
    for (o, retry, _, _) in &results {
        match o {
            Outcome::Ok => {}
            Outcome::Error(status, k, m) => {
                assert!(
                    *status == 429 || *status == 503,
                    "excess load gets 429 or 503, not {status} {k}: {m}"
                );
                assert!(retry.is_some(), "{status} {k} carries Retry-After");
            }
            other => panic!("no hang or dropped connection under overload: {other:?}"),
        }
    }
    let ok = outcomes.iter().filter(|o| **o == Outcome::Ok).count();
    assert!(ok > 100, "the app and pool kept serving: {ok} ok");
    assert!(ok < results.len(), "the load was above capacity");
    // Memory stays bounded: the queues are bounded, so the gateway does
    // not grow with the offered load.
    assert!(
        peak < rss_before + 128 * 1024,
        "gateway RSS grew from {rss_before} KiB to {peak} KiB"
    );

    // And it recovers fully: nothing left queued or in flight, and every
    // request served.
    eventually("the queues drain", || async {
        let s = gw.json("/v1/status").await;
        let app = &s["apps"][0];
        let pool = &s["pools"][0];
        (app["inflight"] == 0
            && app["queued"] == 0
            && pool["pending"] == 0
            && pool["inflight"] == 0)
            .then_some(())
    })
    .await;
    for _ in 0..10 {
        assert_eq!(call(inference(&gw)).await.0, Outcome::Ok);
        assert_eq!(call(task(&gw)).await.0, Outcome::Ok);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kill_9_of_the_gateway_under_load_reports_every_accepted_task() {
    let mut gw = Gateway::start(
        r#"
        [[apps]]
        name = "m"
        command = ["{worker}"]
        [apps.autoscale]
        min = 2
        max = 2
        [[pools]]
        name = "p"
        command = ["{worker}"]
        replicas = [2, 2]
        concurrency = 2
        "#,
    );
    gw.wait_ready("m", 2).await;
    eventually("the pool is warm", || async {
        (ready_replicas(&gw).await.len() == 4).then_some(())
    })
    .await;
    let revisions = gw.json("/v1/apps/m/revisions").await;

    // Fast async tasks that finish before the crash...
    let mut done_ids = Vec::new();
    for i in 0..20 {
        let (status, body) = gw
            .post("/v1/pools/p/tasks?async=true", &json!({"input": {"n": i}}))
            .await;
        assert_eq!(status, 202, "{body}");
        done_ids.push(body["id"].as_str().expect("id").to_string());
    }
    for id in &done_ids {
        eventually("a fast task finishes", || async {
            (gw.json(&format!("/v1/tasks/{id}")).await["state"] == "succeeded").then_some(())
        })
        .await;
    }
    // ...and slow ones that cannot: running, and queued behind them.
    let mut cut_ids = Vec::new();
    for _ in 0..30 {
        let (status, body) = gw
            .post(
                "/v1/pools/p/tasks?async=true",
                &json!({"input": {"sleep_ms": 60000}}),
            )
            .await;
        assert_eq!(status, 202, "{body}");
        cut_ids.push(body["id"].as_str().expect("id").to_string());
    }
    // Inference traffic in flight at the moment of the crash.
    let mut inflight = Vec::new();
    for i in 0..8 {
        inflight.push(tokio::spawn(
            gw.http
                .get(gw.at(&format!("/apps/m/r{i}?latency_ms=5000")))
                .timeout(CLIENT_DEADLINE)
                .send(),
        ));
    }
    eventually("requests in flight", || async {
        (gw.app_status("m").await["inflight"].as_u64() >= Some(4)).then_some(())
    })
    .await;
    let old: Vec<(String, i32)> = ready_replicas(&gw).await;
    assert_eq!(old.len(), 4);

    gw.kill9_and_restart(&[]);

    // The clients of the dead gateway got an error, not a hang.
    for h in inflight {
        let r = h.await.expect("join");
        assert!(
            r.as_ref().map_or(true, |r| !r.status().is_success()),
            "a request cut by the crash did not succeed silently"
        );
        if let Err(e) = r {
            assert!(!e.is_timeout(), "a client of the dead gateway hung: {e}");
        }
    }
    // The old replicas are found and stopped.
    eventually("orphaned replicas are stopped", || async {
        old.iter().all(|(_, pid)| exited(*pid)).then_some(())
    })
    .await;
    assert!(
        gw.log()
            .contains("stopped replicas a previous run left running"),
        "{}",
        gw.log()
    );
    // State is intact.
    assert_eq!(
        gw.json("/v1/apps/m/revisions").await["revisions"],
        revisions["revisions"]
    );
    // Accepted tasks are accounted for: finished ones keep their output,
    // cut ones read as failed, none is unknown.
    for id in &done_ids {
        let t = gw.json(&format!("/v1/tasks/{id}")).await;
        assert_eq!(t["state"], "succeeded", "{t}");
        assert!(t["output"].is_object(), "{t}");
    }
    for id in &cut_ids {
        let t = gw.json(&format!("/v1/tasks/{id}")).await;
        assert_eq!(t["state"], "failed", "{t}");
        assert_eq!(t["error"]["kind"], "gateway_restarted", "{t}");
    }
    assert_eq!(
        gw.metric("warmgate_tasks_failed_by_restart_total").await,
        30.0
    );
    assert_eq!(gw.metric("warmgate_orphans_stopped_total").await, 4.0);
    println!(
        "RELIABILITY restart: kill -9 of the gateway with 8 requests and 30 async tasks in flight; \
         4 orphaned replicas stopped; 20 finished tasks kept, 30 cut tasks reported failed, 0 unknown"
    );
    // And it serves again.
    gw.wait_ready("m", 2).await;
    let (status, body) = gw
        .post("/v1/pools/p/tasks", &json!({"input": {"n": 1}}))
        .await;
    assert_eq!(status, 200, "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_interruptible_pool_runs_a_task_s_last_try_on_demand() {
    let gw = Gateway::start(
        r#"
        [[pools]]
        name = "p"
        command = ["{worker}"]
        replicas = [1, 1]
        concurrency = 1
        idle_ttl = "1s"
        [pools.kubernetes]
        interruptible = true
        "#,
    );
    eventually("the spot replica is warm", || async {
        (ready_replicas(&gw).await.len() == 1).then_some(())
    })
    .await;
    let (status, body) = gw
        .post(
            "/v1/pools/p/tasks?async=true",
            &json!({"input": {"sleep_ms": 2000}}),
        )
        .await;
    assert_eq!(status, 202, "{body}");
    let id = body["id"].as_str().expect("id").to_string();
    // Preempt it five times (MAX_SYSTEM_RETRIES): each time the replica
    // running it dies.
    for attempt in 1..=5u64 {
        let replica = eventually("the task runs on a spot replica", || async {
            let t = gw.json(&format!("/v1/tasks/{id}")).await;
            (t["state"] == "running" && t["attempts"] == attempt)
                .then(|| t["replica"].as_str().unwrap_or("").to_string())
        })
        .await;
        assert!(
            !replica.contains("ondemand"),
            "try {attempt} ran on {replica}"
        );
        let pid = eventually("its pid", || async {
            ready_replicas(&gw)
                .await
                .into_iter()
                .find(|(r, _)| *r == replica)
                .map(|(_, pid)| pid)
        })
        .await;
        kill9_group(pid);
    }
    // The last try runs on an on-demand replica, and succeeds there.
    let done = eventually("the task finishes", || async {
        let t = gw.json(&format!("/v1/tasks/{id}")).await;
        (t["state"] == "succeeded" || t["state"] == "failed").then_some(t)
    })
    .await;
    assert_eq!(done["state"], "succeeded", "{done}");
    assert_eq!(done["attempts"], 6);
    let on = done["replica"].as_str().unwrap_or("");
    assert!(on.starts_with("p-ondemand-"), "the last try ran on {on}");
    // Idle past idle_ttl, the on-demand replica goes again.
    eventually("the on-demand replica scales back to zero", || async {
        let s = gw.json("/v1/status").await;
        let od = &s["pools"][0]["ondemand"]["replicas"];
        od.as_array().is_some_and(Vec::is_empty).then_some(())
    })
    .await;
}
