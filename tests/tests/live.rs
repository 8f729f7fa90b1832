//! A live gateway: apps and pools put and deleted through the API while
//! traffic flows, without touching the rest. Unchanged apps keep their
//! very processes, a retuned app keeps them too, a changed app moves to
//! new replicas without a failed request, a deleted pool finishes its
//! tasks, and every change survives a restart.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use common::{Gateway, eventually, kind};
use serde_json::{Value, json};

const CONFIG: &str = r#"
[[apps]]
name = "a"
command = ["{worker}"]
[apps.autoscale]
min = 1
max = 1

[[apps]]
name = "b"
command = ["{worker}"]
[apps.autoscale]
min = 1
max = 2

[[apps]]
name = "e"
command = ["{worker}"]
env = { GENERATION = "1" }
[apps.autoscale]
min = 1
max = 1

[[pools]]
name = "d"
command = ["{worker}"]
replicas = [1, 1]
concurrency = 2
"#;

/// Requests sent and failed per app by the load loops.
#[derive(Default)]
struct Tally {
    sent: AtomicU64,
    failed: AtomicU64,
}

/// One app's load: its tally and its client loops.
type AppLoad = (&'static str, Arc<Tally>, Vec<tokio::task::JoinHandle<()>>);

/// Closed-loop clients on each app until `stop`, counting answers that
/// are not 200.
fn load(
    gw: &Gateway,
    apps: &[&'static str],
    clients: usize,
    stop: &Arc<AtomicBool>,
) -> Vec<AppLoad> {
    apps.iter()
        .map(|app| {
            let tally = Arc::new(Tally::default());
            let loops = (0..clients)
                .map(|_| {
                    let (http, url) = (gw.http.clone(), gw.at(&format!("/apps/{app}/work")));
                    let (tally, stop) = (tally.clone(), stop.clone());
                    tokio::spawn(async move {
                        while !stop.load(Ordering::Relaxed) {
                            let ok = http
                                .get(&url)
                                .send()
                                .await
                                .is_ok_and(|r| r.status().is_success());
                            tally.sent.fetch_add(1, Ordering::Relaxed);
                            if !ok {
                                tally.failed.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                    })
                })
                .collect();
            (*app, tally, loops)
        })
        .collect()
}

/// Stops the load and asserts that every app got requests and none failed.
async fn stop_load(stop: &AtomicBool, loads: Vec<AppLoad>) {
    stop.store(true, Ordering::Relaxed);
    for (app, tally, loops) in loads {
        for l in loops {
            l.await.expect("load loop");
        }
        let (sent, failed) = (
            tally.sent.load(Ordering::Relaxed),
            tally.failed.load(Ordering::Relaxed),
        );
        eprintln!("{app}: {sent} requests, {failed} failed");
        assert!(sent > 0, "no request reached {app}");
        assert_eq!(failed, 0, "{failed} of {sent} requests to {app} failed");
    }
}

/// Asserts that `app` runs on the very processes it ran on before.
async fn same_replicas(gw: &Gateway, app: &str, before: &[i32]) {
    assert_eq!(
        sorted(gw.replica_pids(app).await),
        before,
        "{app}'s replicas changed"
    );
}

async fn put(gw: &Gateway, path: &str, body: &Value) -> (u16, Value) {
    let r = gw
        .http
        .put(gw.at(path))
        .json(body)
        .send()
        .await
        .expect("put");
    (r.status().as_u16(), r.json().await.unwrap_or(Value::Null))
}

async fn delete(gw: &Gateway, path: &str) -> (u16, Value) {
    let r = gw.http.delete(gw.at(path)).send().await.expect("delete");
    (r.status().as_u16(), r.json().await.unwrap_or(Value::Null))
}

async fn pool_ready(gw: &Gateway, pool: &str) {
    eventually(&format!("pool {pool} has a ready replica"), || async {
        let s = gw.json("/v1/status").await;
        s["pools"]
            .as_array()
            .and_then(|ps| ps.iter().find(|p| p["name"] == pool))
            .and_then(|p| p["ready"].as_u64())
            .filter(|n| *n > 0)
    })
    .await;
}

fn sorted(mut v: Vec<i32>) -> Vec<i32> {
    v.sort_unstable();
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn apps_and_pools_change_at_runtime_without_touching_the_rest() {
    let mut gw = Gateway::start(CONFIG);
    for app in ["a", "b", "e"] {
        gw.wait_ready(app, 1).await;
    }
    pool_ready(&gw, "d").await;
    let a_pids = sorted(gw.replica_pids("a").await);
    let b_pids = sorted(gw.replica_pids("b").await);
    let e_pids = sorted(gw.replica_pids("e").await);
    assert_eq!((a_pids.len(), b_pids.len(), e_pids.len()), (1, 1, 1));

    // Two tasks still running on D when it is deleted.
    let mut running = Vec::new();
    for _ in 0..2 {
        let r = gw
            .http
            .post(gw.at("/v1/pools/d/tasks?async=true"))
            .json(&json!({"input": {"sleep_ms": 1500}}))
            .send()
            .await
            .expect("submit");
        assert_eq!(r.status().as_u16(), 202);
        let v: Value = r.json().await.expect("json");
        running.push(v["id"].as_str().expect("id").to_string());
    }
    eventually("both of D's tasks are running", || async {
        let s = gw.json("/v1/pools/d").await;
        (s["inflight"].as_u64() == Some(2)).then_some(())
    })
    .await;

    let stop = Arc::new(AtomicBool::new(false));
    let loads = load(&gw, &["a", "b", "e"], 3, &stop);

    // B: a larger max and a longer queue apply in place.
    let mut b = gw.json("/v1/apps/b").await;
    assert_eq!(b["max"], 2);
    let (status, body) = put(
        &gw,
        "/v1/apps/b",
        &json!({"command": [common::test_worker()], "autoscale": {"min": 1, "max": 3}, "queue": {"max_pending": 500}}),
    )
    .await;
    assert_eq!(
        (status, body["change"].as_str()),
        (200, Some("in_place")),
        "{body}"
    );
    b = gw.json("/v1/apps/b").await;
    assert_eq!(
        (b["max"].as_u64(), b["max_pending"].as_u64()),
        (Some(3), Some(500)),
        "{b}"
    );

    // C: a new app serves.
    let (status, body) = put(
        &gw,
        "/v1/apps/c",
        &json!({"command": [common::test_worker()], "autoscale": {"min": 0, "max": 1}}),
    )
    .await;
    assert_eq!(
        (status, body["change"].as_str()),
        (201, Some("created")),
        "{body}"
    );
    let r = gw.http.get(gw.at("/apps/c/hello")).send().await.expect("c");
    assert_eq!(r.status().as_u16(), 200);

    // D: deleted while two tasks run; they finish, new ones are refused.
    let (status, body) = delete(&gw, "/v1/pools/d").await;
    assert_eq!(
        (status, body["change"].as_str()),
        (200, Some("deleted")),
        "{body}"
    );
    let (status, body) = gw.post("/v1/pools/d/tasks", &json!({"input": {}})).await;
    assert_eq!((status, kind(&body)), (404, "not_found"), "{body}");
    for id in &running {
        let task = eventually(&format!("task {id} of the deleted pool ends"), || async {
            let t = gw.json(&format!("/v1/tasks/{id}")).await;
            (t["state"] != "pending" && t["state"] != "running").then_some(t)
        })
        .await;
        assert_eq!(task["state"], "succeeded", "{task}");
    }

    // E: a new environment rolls it to new replicas.
    let (status, body) = put(
        &gw,
        "/v1/apps/e",
        &json!({"command": [common::test_worker()], "env": {"GENERATION": "2"}, "autoscale": {"min": 1, "max": 1}}),
    )
    .await;
    assert_eq!(
        (status, body["change"].as_str()),
        (200, Some("rolled")),
        "{body}"
    );
    let new_revision = body["revision"].as_str().expect("revision").to_string();
    eventually("e serves from its new revision alone", || async {
        let s = gw.app_status("e").await;
        let pids = sorted(gw.replica_pids("e").await);
        (s["revision"] == new_revision.as_str()
            && s["revisions"].as_array().is_some_and(|r| r.len() == 1)
            && !pids.is_empty()
            && pids.iter().all(|p| !e_pids.contains(p)))
        .then_some(())
    })
    .await;

    stop_load(&stop, loads).await;
    same_replicas(&gw, "a", &a_pids).await;
    same_replicas(&gw, "b", &b_pids).await;
    eventually("the deleted pool is gone from status", || async {
        let s = gw.json("/v1/status").await;
        s["pools"]
            .as_array()
            .is_some_and(|p| p.is_empty())
            .then_some(())
    })
    .await;

    // Every change made through the API is still there after a restart.
    gw.restart();
    let s = gw.json("/v1/status").await;
    let names: Vec<&str> = s["apps"]
        .as_array()
        .expect("apps")
        .iter()
        .filter_map(|a| a["name"].as_str())
        .collect();
    assert_eq!(names, ["a", "b", "e", "c"], "{s}");
    assert!(s["pools"].as_array().is_some_and(|p| p.is_empty()), "{s}");
    let b = gw.json("/v1/apps/b").await;
    assert_eq!(b["max"].as_u64(), Some(3), "{b}");
    let e = gw.app_status("e").await;
    assert_eq!(e["revision"], new_revision.as_str(), "{e}");
    let r = gw.http.get(gw.at("/apps/c/hello")).send().await.expect("c");
    assert_eq!(r.status().as_u16(), 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_changes_are_refused_and_change_nothing() {
    let gw = Gateway::start(CONFIG);
    let worker = common::test_worker();
    let spec = json!({"command": [worker]});
    let hostile = [
        "/v1/apps/..%2Fetc",
        "/v1/apps/%2e%2e%2fx",
        "/v1/apps/A",
        "/v1/apps/-x",
        "/v1/apps/a%00b",
        "/v1/pools/..%2Fetc",
        "/v1/pools/x%20y",
    ];
    for path in hostile {
        let (status, body) = put(&gw, path, &spec).await;
        assert_eq!(
            (status, kind(&body)),
            (400, "bad_request"),
            "{path}: {body}"
        );
    }
    let cases = [
        // An unknown key, named.
        (
            "/v1/apps/x",
            json!({"command": [worker], "autoscale": {"maxx": 2}}),
            "autoscale.maxx",
        ),
        // A bad value, named.
        (
            "/v1/apps/x",
            json!({"command": [worker], "autoscale": {"max": "lots"}}),
            "autoscale.max",
        ),
        // The body names another app.
        (
            "/v1/apps/x",
            json!({"name": "y", "command": [worker]}),
            "name",
        ),
        // A pool named like a revision of app a would take its traffic.
        ("/v1/pools/a-00001", json!({"command": [worker]}), "a-00001"),
        // An alias already routed to another app.
        (
            "/v1/apps/x",
            json!({"command": [worker], "aliases": ["b"]}),
            "b",
        ),
        // A checkpoint outside the allowed prefixes.
        (
            "/v1/apps/x",
            json!({"command": [worker], "checkpoint": "file:///etc"}),
            "file:///etc",
        ),
    ];
    for (path, body, named) in cases {
        let (status, answer) = put(&gw, path, &body).await;
        assert_eq!(status, 400, "{path} {body}: {answer}");
        let message = answer["error"]["message"].as_str().unwrap_or_default();
        assert!(
            message.contains(named),
            "{path} {body}: {message} does not name {named}"
        );
    }
    let s = gw.json("/v1/status").await;
    let names: Vec<&str> = s["apps"]
        .as_array()
        .expect("apps")
        .iter()
        .filter_map(|a| a["name"].as_str())
        .collect();
    assert_eq!(
        names,
        ["a", "b", "e"],
        "a refused change left something: {s}"
    );
    assert_eq!(s["pools"].as_array().map(Vec::len), Some(1), "{s}");
    let (status, body) = delete(&gw, "/v1/apps/nope").await;
    assert_eq!((status, kind(&body)), (404, "not_found"), "{body}");
    // The same spec again changes nothing.
    let d = gw.json("/v1/pools/d").await;
    assert_eq!(d["name"], "d", "{d}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn changes_need_the_admin_token() {
    let gw = Gateway::start_with(CONFIG, &[], &[("WARMGATE_ADMIN_TOKEN", "s3cret")]);
    let spec = json!({"command": [common::test_worker()]});
    let (status, _) = put(&gw, "/v1/apps/x", &spec).await;
    assert_eq!(status, 401);
    let (status, _) = delete(&gw, "/v1/apps/a").await;
    assert_eq!(status, 401);
    let (status, _) = delete(&gw, "/v1/pools/d").await;
    assert_eq!(status, 401);
    let r = gw
        .http
        .put(gw.at("/v1/apps/x"))
        .bearer_auth("s3cret")
        .json(&spec)
        .send()
        .await
        .expect("put");
    assert_eq!(r.status().as_u16(), 201);
}

/// Runs `warmgate apply` (with `-o json` when `json`) on `file`.
async fn apply(gw: &Gateway, file: &std::path::Path, json: bool) -> std::process::Output {
    let mut cmd = tokio::process::Command::new(common::bin("warmgate"));
    cmd.arg("apply");
    if json {
        cmd.args(["-o", "json"]);
    }
    cmd.arg("--config")
        .arg(file)
        .args(["--gateway", &gw.url])
        .output()
        .await
        .expect("run warmgate apply")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn warmgate_apply_makes_the_gateway_serve_a_file_and_prints_what_changed() {
    let gw = Gateway::start(CONFIG);
    for app in ["a", "b"] {
        gw.wait_ready(app, 1).await;
    }
    let a_pids = sorted(gw.replica_pids("a").await);
    let b_pids = sorted(gw.replica_pids("b").await);
    let stop = Arc::new(AtomicBool::new(false));
    let loads = load(&gw, &["a", "b"], 2, &stop);
    // The file: a as it was, b with a larger max, e gone, pool d gone, c
    // new.
    let next = CONFIG
        .replace("min = 1\nmax = 2", "min = 1\nmax = 4")
        .replace(
            "[[apps]]\nname = \"e\"\ncommand = [\"{worker}\"]\nenv = { GENERATION = \"1\" }\n[apps.autoscale]\nmin = 1\nmax = 1\n",
            "[[apps]]\nname = \"c\"\ncommand = [\"{worker}\"]\n",
        )
        .replace("[[pools]]\nname = \"d\"\ncommand = [\"{worker}\"]\nreplicas = [1, 1]\nconcurrency = 2\n", "")
        .replace("{worker}", &common::test_worker());
    assert!(next.contains("max = 4") && next.contains("\"c\"") && !next.contains("\"d\""));
    let file = gw.dir.path().join("next.toml");
    std::fs::write(&file, format!("state_dir = \"state\"\n{next}")).expect("write");
    let out = apply(&gw, &file, false).await;
    let printed = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{printed}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines: Vec<&str> = printed.lines().collect();
    for expected in [
        "pool d: deleted",
        "app e: deleted",
        "app a: unchanged",
        "app b: in place",
        "app c: created",
    ] {
        assert!(lines.contains(&expected), "{expected:?} not in:\n{printed}");
    }
    let r = gw.http.get(gw.at("/apps/c/hello")).send().await.expect("c");
    assert_eq!(r.status().as_u16(), 200);
    stop_load(&stop, loads).await;
    same_replicas(&gw, "a", &a_pids).await;
    same_replicas(&gw, "b", &b_pids).await;
    assert_eq!(gw.json("/v1/apps/b").await["max"].as_u64(), Some(4));
    // Applying the same file again changes nothing; `-o json` says so to
    // a script, one row per app and pool.
    let again = apply(&gw, &file, true).await;
    let printed = String::from_utf8_lossy(&again.stdout);
    assert!(again.status.success(), "{printed}");
    let v: Value = serde_json::from_str(&printed).expect("apply -o json prints JSON");
    let rows = v["changes"].as_array().expect("changes");
    let mut seen: Vec<String> = rows
        .iter()
        .map(|r| {
            format!(
                "{} {}",
                r["kind"].as_str().unwrap_or("?"),
                r["name"].as_str().unwrap_or("?")
            )
        })
        .collect();
    seen.sort();
    assert_eq!(seen, ["app a", "app b", "app c"], "{v}");
    assert!(rows.iter().all(|r| r["change"] == "unchanged"), "{v}");
    // A refused change is a row with the gateway's status and message, and
    // exit 1.
    std::fs::write(
        &file,
        format!(
            "state_dir = \"state\"\n{}",
            next.replace(
                "name = \"c\"\ncommand",
                "name = \"c\"\ncheckpoint = \"file:///etc\"\ncommand"
            )
        ),
    )
    .expect("write");
    let refused = apply(&gw, &file, true).await;
    let printed = String::from_utf8_lossy(&refused.stdout);
    assert_eq!(refused.status.code(), Some(1), "{printed}");
    let v: Value = serde_json::from_str(&printed).expect("apply -o json prints JSON");
    let c = v["changes"]
        .as_array()
        .and_then(|rows| rows.iter().find(|r| r["name"] == "c"))
        .expect("a row for c");
    assert_eq!(c["error"]["status"], 400, "{v}");
    assert!(
        c["error"]["message"]
            .as_str()
            .is_some_and(|m| !m.is_empty()),
        "{v}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_applies_the_edited_config_file() {
    let mut gw = Gateway::start(CONFIG);
    gw.wait_ready("a", 1).await;
    // A change through the API, which the file does not have.
    let (status, _) = put(
        &gw,
        "/v1/apps/g",
        &json!({"command": [common::test_worker()]}),
    )
    .await;
    assert_eq!(status, 201);
    let a_pids = sorted(gw.replica_pids("a").await);
    let path = gw.dir.path().join("warmgate.toml");
    let text = std::fs::read_to_string(&path).expect("config");
    let edited = text.replace("min = 1\nmax = 2", "min = 1\nmax = 5")
        + &format!(
            "\n[[apps]]\nname = \"f\"\ncommand = [\"{}\"]\n",
            common::test_worker()
        );
    let edited_text = edited.clone();
    std::fs::write(&path, edited).expect("write");
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(gw.pid()),
        nix::sys::signal::Signal::SIGHUP,
    )
    .expect("SIGHUP");
    eventually("the edited file is applied", || async {
        let s = gw.json("/v1/status").await;
        let apps = s["apps"].as_array()?;
        let b = apps.iter().find(|a| a["name"] == "b")?;
        (b["max"] == 5
            && apps.iter().any(|a| a["name"] == "f")
            && !apps.iter().any(|a| a["name"] == "g"))
        .then_some(())
    })
    .await;
    let r = gw.http.get(gw.at("/apps/f/hello")).send().await.expect("f");
    assert_eq!(r.status().as_u16(), 200);
    same_replicas(&gw, "a", &a_pids).await;
    // A file that does not load changes nothing, and the gateway stays up.
    std::fs::write(&path, "[[apps]]\nname = 7\n").expect("write");
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(gw.pid()),
        nix::sys::signal::Signal::SIGHUP,
    )
    .expect("SIGHUP");
    eventually("the bad file is reported", || async {
        gw.log().contains("does not load").then_some(())
    })
    .await;
    let s = gw.json("/v1/status").await;
    assert_eq!(s["apps"].as_array().map(Vec::len), Some(4), "{s}");
    // The file is the truth after SIGHUP: a restart on the edited file
    // (fixed again) brings back neither g nor anything the API saved.
    std::fs::write(&path, &edited_text).expect("write");
    gw.restart();
    let s = gw.json("/v1/status").await;
    let names: Vec<&str> = s["apps"]
        .as_array()
        .expect("apps")
        .iter()
        .filter_map(|a| a["name"].as_str())
        .collect();
    assert_eq!(names, ["a", "b", "e", "f"], "{s}");
    assert_eq!(gw.json("/v1/apps/b").await["max"].as_u64(), Some(5));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_changes_to_one_app_never_mix() {
    let gw = Gateway::start(CONFIG);
    gw.wait_ready("b", 1).await;
    let worker = common::test_worker();
    let puts = (2..10u64).map(|max| {
        let (http, url) = (gw.http.clone(), gw.at("/v1/apps/b"));
        let body = json!({"command": [worker], "autoscale": {"min": 1, "max": max}, "queue": {"max_pending": 100 + max}});
        tokio::spawn(async move {
            let r = http.put(url).json(&body).send().await.expect("put");
            (max, r.status().as_u16())
        })
    });
    let mut taken = Vec::new();
    for p in puts.collect::<Vec<_>>() {
        let (max, status) = p.await.expect("join");
        assert!(status == 200 || status == 409, "max {max}: {status}");
        if status == 200 {
            taken.push(max);
        }
    }
    eprintln!("puts taken: {taken:?}");
    assert!(!taken.is_empty());
    // Whatever won, max and max_pending come from one and the same put.
    let b = gw.json("/v1/apps/b").await;
    let max = b["max"].as_u64().expect("max");
    assert!(taken.contains(&max), "max {max} was not taken: {taken:?}");
    assert_eq!(b["max_pending"].as_u64(), Some(100 + max), "{b}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_change_while_the_app_rolls_is_refused() {
    let gw = Gateway::start(CONFIG);
    gw.wait_ready("e", 1).await;
    let worker = common::test_worker();
    // A new revision that takes a while to start: the roll is running.
    let (status, body) = put(
        &gw,
        "/v1/apps/e",
        &json!({"command": [worker], "env": {"GENERATION": "2", "TEST_WORKER_STARTUP_MS": "3000"}, "autoscale": {"min": 1, "max": 1}}),
    )
    .await;
    assert_eq!(
        (status, body["change"].as_str()),
        (200, Some("rolled")),
        "{body}"
    );
    let (status, body) = put(
        &gw,
        "/v1/apps/e",
        &json!({"command": [worker], "env": {"GENERATION": "3"}, "autoscale": {"min": 1, "max": 1}}),
    )
    .await;
    assert_eq!((status, kind(&body)), (409, "conflict"), "{body}");
    let (status, body) = delete(&gw, "/v1/apps/e").await;
    assert_eq!((status, kind(&body)), (409, "conflict"), "{body}");
    // The old revision serves meanwhile.
    let r = gw.http.get(gw.at("/apps/e/hello")).send().await.expect("e");
    assert_eq!(r.status().as_u16(), 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_roll_that_failed_is_tried_again_by_the_same_put() {
    let gw = Gateway::start(CONFIG);
    gw.wait_ready("e", 1).await;
    let worker = common::test_worker();
    let broken = json!({"command": [worker], "env": {"GENERATION": "2", "TEST_WORKER_EXIT_AT_START": "3"}, "autoscale": {"min": 1, "max": 1}, "startup_timeout": "2s"});
    let (status, body) = put(&gw, "/v1/apps/e", &broken).await;
    assert_eq!(
        (status, body["change"].as_str()),
        (200, Some("rolled")),
        "{body}"
    );
    let first = body["revision"].as_str().expect("revision").to_string();
    eventually(
        "the broken roll ends and the old revision serves",
        || async {
            let e = gw.json("/v1/apps/e").await;
            (e["promotion"]["to"] == first.as_str()
                && e["promotion"]["phase"] == "failed"
                && e["revision"] != first.as_str())
            .then_some(())
        },
    )
    .await;
    let r = gw.http.get(gw.at("/apps/e/hello")).send().await.expect("e");
    assert_eq!(r.status().as_u16(), 200);
    // The same put again is not "unchanged": nothing runs it yet.
    let (status, body) = put(&gw, "/v1/apps/e", &broken).await;
    assert_eq!(
        (status, body["change"].as_str()),
        (200, Some("rolled")),
        "{body}"
    );
    assert_ne!(body["revision"].as_str(), Some(first.as_str()), "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_name_may_not_move_between_a_pool_and_an_app_while_the_old_one_drains() {
    let gw = Gateway::start(CONFIG);
    pool_ready(&gw, "d").await;
    let r = gw
        .http
        .post(gw.at("/v1/pools/d/tasks?async=true"))
        .json(&json!({"input": {"sleep_ms": 2000}}))
        .send()
        .await
        .expect("submit");
    assert_eq!(r.status().as_u16(), 202);
    eventually("d's task runs", || async {
        let s = gw.json("/v1/pools/d").await;
        (s["inflight"].as_u64() == Some(1)).then_some(())
    })
    .await;
    let (status, body) = delete(&gw, "/v1/pools/d").await;
    assert_eq!(status, 200, "{body}");
    let spec = json!({"command": [common::test_worker()]});
    let (status, body) = put(&gw, "/v1/apps/d", &spec).await;
    assert_eq!((status, kind(&body)), (409, "conflict"), "{body}");
    // Once the pool is gone, the name is free.
    let body = eventually("the app d may be put once the pool is gone", || async {
        let (status, body) = put(&gw, "/v1/apps/d", &spec).await;
        (status == 201).then_some(body)
    })
    .await;
    assert_eq!(body["change"], "created");
    let r = gw.http.get(gw.at("/apps/d/hello")).send().await.expect("d");
    assert_eq!(r.status().as_u16(), 200);
}

/// The pids of a pool's replicas.
async fn pool_pids(gw: &Gateway, pool: &str) -> Vec<i32> {
    let p = gw.json(&format!("/v1/pools/{pool}")).await;
    sorted(
        p["pool"]["replicas"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|r| r["state"] == "ready")
            .filter_map(|r| r["pid"].as_i64())
            .map(|p| p as i32)
            .collect(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_changes_in_place_keeps_its_replicas_and_the_change_survives_a_restart() {
    let mut gw = Gateway::start(CONFIG);
    pool_ready(&gw, "d").await;
    let before = pool_pids(&gw, "d").await;
    assert_eq!(before.len(), 1, "{before:?}");
    let worker = common::test_worker();
    // More replicas and a smaller queue: no new replica is needed for the
    // one running, which keeps its process.
    let spec = json!({"command": [worker], "replicas": [2, 3], "concurrency": 2,
        "queue": {"max_pending": 3}, "retries": 1});
    let (status, body) = put(&gw, "/v1/pools/d", &spec).await;
    assert_eq!(
        (status, body["change"].as_str()),
        (200, Some("in_place")),
        "{body}"
    );
    let both = eventually("pool d runs two replicas", || async {
        let pids = pool_pids(&gw, "d").await;
        (pids.len() == 2).then_some(pids)
    })
    .await;
    assert!(both.contains(&before[0]), "{before:?} -> {both:?}");
    let d = gw.json("/v1/pools/d").await;
    assert_eq!(
        (d["min"].as_u64(), d["max"].as_u64()),
        (Some(2), Some(3)),
        "{d}"
    );
    // The same spec again changes nothing.
    let (status, body) = put(&gw, "/v1/pools/d", &spec).await;
    assert_eq!(
        (status, body["change"].as_str()),
        (200, Some("unchanged")),
        "{body}"
    );
    // A change that needs new replicas is refused and changes nothing.
    let mut other = spec.clone();
    other["env"] = json!({"GENERATION": "2"});
    let (status, body) = put(&gw, "/v1/pools/d", &other).await;
    assert_eq!((status, kind(&body)), (409, "conflict"), "{body}");
    let message = body["error"]["message"].as_str().unwrap_or_default();
    assert!(message.contains("new replicas"), "{message}");
    assert_eq!(sorted(pool_pids(&gw, "d").await), both);
    // Kept across a restart of serve.
    gw.restart();
    eventually("pool d comes back with its new bounds", || async {
        let d = gw.json("/v1/pools/d").await;
        (d["min"] == 2 && d["max"] == 3).then_some(())
    })
    .await;
}

/// A relative `file://` checkpoint means the same through the API as in
/// the file (the config's folder), in a `PUT` and in a promotion, whatever
/// folder the CLI runs in.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relative_checkpoint_works_through_the_api_as_in_the_file() {
    let gw = Gateway::start(
        r#"
        [[apps]]
        name = "m"
        command = ["{worker}"]
        [apps.promotion]
        watch = "file://ck"
        watch_interval = "1h"
        "#,
    );
    for v in ["v1", "v2"] {
        let dir = gw.dir.path().join("ck").join(v);
        std::fs::create_dir_all(&dir).expect("mkdir");
        std::fs::write(dir.join("model.bin"), v.repeat(100)).expect("write");
    }
    let spec = json!({
        "command": [common::test_worker()],
        "checkpoint": "file://ck/v1",
        "promotion": {"watch": "file://ck", "watch_interval": "1h"},
    });
    let (status, body) = put(&gw, "/v1/apps/m", &spec).await;
    assert_eq!(
        (status, body["change"].as_str()),
        (200, Some("rolled")),
        "{body}"
    );
    let revision = body["revision"].as_str().expect("revision").to_string();
    let r = eventually("the new revision serves", || async {
        let r = gw.http.get(gw.at("/apps/m/x")).send().await.ok()?;
        (r.headers().get("x-warmgate-revision")?.to_str().ok()? == revision).then_some(r)
    })
    .await;
    assert_eq!(r.status().as_u16(), 200);
    let out = std::process::Command::new(common::bin("warmgate"))
        .args([
            "promote",
            "m",
            "file://ck/v2",
            "--wait",
            "--gateway",
            &gw.url,
        ])
        .current_dir("/")
        .output()
        .expect("warmgate promote");
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let revs = gw.json("/v1/apps/m/revisions").await;
    let checkpoint = revs["revisions"][0]["checkpoint"]
        .as_str()
        .unwrap_or_default();
    assert!(
        checkpoint.starts_with("file:///") && checkpoint.ends_with("/ck/v2"),
        "resolved against the config's folder: {revs}"
    );
}
