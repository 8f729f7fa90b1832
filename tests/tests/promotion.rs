//! Promotion end to end: new revisions from checkpoints under load, an
//! automatic rollback of a broken canary, and a `kill -9` in the middle of
//! a promotion.

mod common;

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use common::{Gateway, eventually, kind};
use serde_json::{Value, json};

/// A checkpoint folder; `broken` adds the file that makes the test worker
/// fail every other request.
fn checkpoint(root: &Path, name: &str, broken: bool) -> String {
    checkpoint_with(root, name, if broken { &["BROKEN"] } else { &[] })
}

/// A checkpoint folder with these marker files too.
fn checkpoint_with(root: &Path, name: &str, markers: &[&str]) -> String {
    let dir = root.join(name);
    std::fs::create_dir_all(&dir).expect("mkdir");
    std::fs::write(dir.join("model.bin"), name.repeat(1000)).expect("write");
    for m in markers {
        std::fs::write(dir.join(m), "yes").expect("write");
    }
    format!("file://{}", dir.display())
}

fn config(extra: &str) -> String {
    format!(
        r#"
        [[apps]]
        name = "m"
        command = ["{{worker}}"]
        concurrency = 16

        [apps.autoscale]
        min = 1
        max = 2

        [apps.promotion]
        bake = "30s"
        min_requests = 10
        {extra}
        {allow}
        "#,
        allow = common::allow_temp_checkpoints()
    )
}

/// Steady traffic until stopped: counts answers, failures, and the
/// revisions that answered.
struct Load {
    stop: Arc<AtomicBool>,
    ok: Arc<AtomicU64>,
    failed: Arc<AtomicU64>,
    revisions: Arc<parking_lot_free::Seen>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

mod parking_lot_free {
    //! The revisions that answered, in order of first sight.
    use std::sync::Mutex;

    #[derive(Default)]
    pub struct Seen(Mutex<Vec<String>>);

    impl Seen {
        pub fn note(&self, rev: &str) {
            let mut v = self.0.lock().unwrap_or_else(|e| e.into_inner());
            if v.last().map(String::as_str) != Some(rev) {
                v.push(rev.to_string());
            }
        }

        pub fn all(&self) -> Vec<String> {
            self.0.lock().unwrap_or_else(|e| e.into_inner()).clone()
        }
    }
}

impl Load {
    /// `clients` loops, each sending requests back to back.
    fn start(gw: &Gateway, clients: usize) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let ok = Arc::new(AtomicU64::new(0));
        let failed = Arc::new(AtomicU64::new(0));
        let revisions = Arc::new(parking_lot_free::Seen::default());
        let tasks = (0..clients)
            .map(|_| {
                let (stop, ok, failed, revisions) =
                    (stop.clone(), ok.clone(), failed.clone(), revisions.clone());
                let (http, url) = (gw.http.clone(), gw.at("/apps/m/work"));
                tokio::spawn(async move {
                    while !stop.load(Ordering::Relaxed) {
                        match http.get(&url).send().await {
                            Ok(r) if r.status().is_success() => {
                                if let Some(rev) = r
                                    .headers()
                                    .get("x-warmgate-revision")
                                    .and_then(|v| v.to_str().ok())
                                {
                                    revisions.note(rev);
                                }
                                let _ = r.bytes().await;
                                ok.fetch_add(1, Ordering::Relaxed);
                            }
                            _ => {
                                failed.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                        tokio::time::sleep(Duration::from_millis(5)).await;
                    }
                })
            })
            .collect();
        Load {
            stop,
            ok,
            failed,
            revisions,
            tasks,
        }
    }

    async fn stop(self) -> (u64, u64, Vec<String>) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.tasks {
            let _ = t.await;
        }
        (
            self.ok.load(Ordering::Relaxed),
            self.failed.load(Ordering::Relaxed),
            self.revisions.all(),
        )
    }
}

async fn post(gw: &Gateway, path: &str, body: Value) -> (u16, Value) {
    let r = gw
        .http
        .post(gw.at(path))
        .json(&body)
        .send()
        .await
        .expect("send");
    (r.status().as_u16(), r.json().await.unwrap_or(Value::Null))
}

/// Runs `warmgate ARGS --gateway URL`; returns its output, asserting success.
fn cli(gw: &Gateway, args: &[&str]) -> String {
    let out = std::process::Command::new(common::bin("warmgate"))
        .args(args)
        .args(["--gateway", &gw.url])
        .output()
        .expect("run warmgate");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "warmgate {args:?} failed: {text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    text
}

/// Promotes `checkpoint` with `"wait": true`; returns the answer once the
/// promotion has ended.
async fn promote_and_wait(gw: &Gateway, checkpoint: &str) -> Value {
    let (status, body) = post(
        gw,
        "/v1/apps/m/promote",
        json!({"checkpoint": checkpoint, "wait": true}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    body
}

async fn app(gw: &Gateway) -> Value {
    gw.app_status("m").await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_promotion_under_load_loses_no_request() {
    let root = tempfile::tempdir().expect("dir");
    let v2 = checkpoint(root.path(), "v2", false);
    let gw = Gateway::start(&config(""));
    gw.wait_ready("m", 1).await;
    assert_eq!(app(&gw).await["revision"], "m-00001");

    let load = Load::start(&gw, 8);
    let started = std::time::Instant::now();
    eventually("traffic flows", || async {
        (load.ok.load(Ordering::Relaxed) > 50).then_some(())
    })
    .await;
    // Through the CLI, as a script would: `-o json` prints the API's answer.
    let out = tokio::process::Command::new(common::bin("warmgate"))
        .args([
            "promote",
            "m",
            &v2,
            "--wait",
            "-o",
            "json",
            "--gateway",
            &gw.url,
        ])
        .output()
        .await
        .expect("run warmgate promote");
    let printed = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{printed}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let body: Value = serde_json::from_str(&printed).expect("promote -o json prints JSON");
    assert_eq!(body["revision"], "m-00002");
    assert_eq!(body["promotion"]["phase"], "done", "{body}");
    // Traffic keeps flowing on the new revision for a moment.
    let before = load.ok.load(Ordering::Relaxed);
    eventually("traffic on the new revision", || async {
        (load.ok.load(Ordering::Relaxed) > before + 50).then_some(())
    })
    .await;
    let took = started.elapsed().as_secs_f64();
    let (ok, failed, seen) = load.stop().await;
    eprintln!(
        "promotion under load: {ok} answers in {took:.1}s ({:.0}/s), {failed} failed",
        ok as f64 / took
    );
    assert_eq!(failed, 0, "{ok} ok, {failed} failed");
    assert_eq!(seen.last().map(String::as_str), Some("m-00002"), "{seen:?}");
    assert!(seen.contains(&"m-00001".to_string()), "{seen:?}");

    let s = app(&gw).await;
    assert_eq!(s["revision"], "m-00002", "{s}");
    let revs = gw.json("/v1/apps/m/revisions").await;
    let list = revs["revisions"].as_array().expect("revisions");
    assert_eq!(list[0]["id"], "m-00002");
    assert_eq!(list[0]["state"], "serving");
    assert_eq!(list[0]["traffic"], 100);
    assert!(
        list[0]["checkpoint_version"]
            .as_str()
            .is_some_and(|v| v.starts_with("sha256:")),
        "{revs}"
    );
    assert_eq!(list[1]["id"], "m-00001");
    assert_eq!(list[1]["state"], "retired");
    // The old revision's replicas drain and stop.
    eventually("the old revision has no replicas", || async {
        let st = gw.json("/v1/status").await;
        let live = st["apps"][0]["revisions"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        (live.len() == 1).then_some(())
    })
    .await;

    // Pinned traffic for evaluation; a promotion while one runs, a bad
    // checkpoint and an unknown app are refused clearly.
    let r = gw
        .http
        .get(gw.at("/apps/m/x"))
        .header("x-warmgate-revision", "m-00001")
        .send()
        .await
        .expect("pinned");
    assert_eq!(r.status(), 404, "a retired revision is not live");
    let (status, body) = post(&gw, "/v1/apps/m/promote", json!({"checkpoint": "nope://x"})).await;
    assert_eq!(status, 400, "{body}");
    let missing = format!("file://{}", root.path().join("absent").display());
    let (status, body) = post(&gw, "/v1/apps/m/promote", json!({"checkpoint": missing})).await;
    assert_eq!(status, 404, "{body}");
    let (status, body) = post(&gw, "/v1/apps/nope/promote", json!({"checkpoint": v2})).await;
    assert_eq!(status, 404, "{body}");
    assert_eq!(kind(&body), "not_found");

    // `warmgate revisions` shows the history.
    let out = cli(&gw, &["revisions", "m"]);
    assert!(out.contains("m-00002") && out.contains("serving"), "{out}");
    assert!(out.contains("m-00001") && out.contains("retired"), "{out}");
    assert!(out.contains("promote m-00002"), "{out}");

    // Roll back by hand: the previous good revision serves again.
    let out = cli(&gw, &["rollback", "m", "-o", "json"]);
    let v: Value = serde_json::from_str(&out).expect("rollback -o json prints JSON");
    assert_eq!(v["revision"], "m-00001", "{v}");
    eventually("m-00001 serves again", || async {
        let s = app(&gw).await;
        (s["revision"] == "m-00001" && s["promotion"]["phase"] == "done").then_some(())
    })
    .await;
    let r = gw.http.get(gw.at("/apps/m/x")).send().await.expect("get");
    assert_eq!(r.headers()["x-warmgate-revision"], "m-00001");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broken_canary_is_rolled_back_automatically() {
    let root = tempfile::tempdir().expect("dir");
    let broken = checkpoint(root.path(), "broken", true);
    let gw = Gateway::start(&config("canary = 20"));
    gw.wait_ready("m", 1).await;
    let load = Load::start(&gw, 8);
    let body = promote_and_wait(&gw, &broken).await;
    assert_eq!(body["promotion"]["phase"], "rolled_back", "{body}");
    assert!(
        body["promotion"]["reason"]
            .as_str()
            .is_some_and(|r| r.contains("error rate")),
        "{body}"
    );
    // Keep the load on the good revision for a while, as a user would.
    let before = load.ok.load(Ordering::Relaxed);
    eventually("traffic back on m-00001", || async {
        (load.ok.load(Ordering::Relaxed) > before + 400).then_some(())
    })
    .await;
    let (ok, failed, _) = load.stop().await;
    let share = failed as f64 / (ok + failed) as f64;
    assert!(share < 0.05, "{failed} of {} failed", ok + failed);

    let revs = gw.json("/v1/apps/m/revisions").await;
    let new = &revs["revisions"][0];
    assert_eq!(new["id"], "m-00002");
    assert_eq!(new["state"], "failed", "{revs}");
    assert_eq!(new["traffic"], 0);
    assert_eq!(revs["revisions"][1]["traffic"], 100);
    assert_eq!(app(&gw).await["revision"], "m-00001");
}

/// A quiet app: its canary answers fewer than `min_requests` in the bake,
/// and is judged on those rather than promoted unseen.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broken_canary_of_a_quiet_app_is_judged_on_the_answers_it_had() {
    let root = tempfile::tempdir().expect("dir");
    let broken = checkpoint(root.path(), "broken", true);
    let gw = Gateway::start(
        &config("canary = 50")
            .replace("bake = \"30s\"", "bake = \"2s\"")
            .replace("min_requests = 10", "min_requests = 1000"),
    );
    gw.wait_ready("m", 1).await;
    let (status, body) = post(&gw, "/v1/apps/m/promote", json!({"checkpoint": broken})).await;
    assert_eq!(status, 202, "{body}");
    let promotion = eventually("the promotion ends", || async {
        // A user now and then.
        let _ = gw.http.get(gw.at("/apps/m/x")).send().await;
        let s = app(&gw).await;
        let phase = s["promotion"]["phase"].as_str().unwrap_or("").to_string();
        (phase == "rolled_back" || phase == "done").then(|| s["promotion"].clone())
    })
    .await;
    assert_eq!(promotion["phase"], "rolled_back", "{promotion}");
    let reason = promotion["reason"].as_str().unwrap_or("");
    assert!(reason.contains("fewer than min_requests"), "{reason}");
    assert_eq!(app(&gw).await["revision"], "m-00001");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kill_9_mid_promotion_keeps_the_history_and_the_split() {
    let root = tempfile::tempdir().expect("dir");
    let v2 = checkpoint(root.path(), "v2", false);
    let mut gw = Gateway::start(&config("canary = 50"));
    gw.wait_ready("m", 1).await;
    let (status, body) = post(&gw, "/v1/apps/m/promote", json!({"checkpoint": v2})).await;
    assert_eq!(status, 202, "{body}");
    let split = eventually("the canary runs", || async {
        let s = app(&gw).await;
        (s["promotion"]["phase"] == "canary").then_some(s["revisions"].clone())
    })
    .await;
    let all_pids = replica_pids(&gw).await;
    assert!(all_pids.len() >= 2, "both revisions run: {all_pids:?}");
    let history_before = gw.json("/v1/apps/m/revisions").await;

    gw.kill9_and_restart(&all_pids);

    let history_after = gw.json("/v1/apps/m/revisions").await;
    assert_eq!(
        history_after["revisions"], history_before["revisions"],
        "the history is intact"
    );
    assert_eq!(history_after["promotion"]["phase"], "canary");
    let s = app(&gw).await;
    let before = shares(&split);
    let after = shares(&s["revisions"]);
    assert_eq!(after, before, "the same split after the restart");
    // And it serves: both revisions answer.
    eventually("both revisions answer after the restart", || async {
        let mut seen = std::collections::HashSet::new();
        for _ in 0..40 {
            if let Ok(r) = gw.http.get(gw.at("/apps/m/x")).send().await
                && let Some(v) = r.headers().get("x-warmgate-revision")
            {
                seen.insert(v.to_str().unwrap_or("").to_string());
            }
        }
        (seen.len() == 2).then_some(())
    })
    .await;
}

/// (revision, traffic) of a status's `revisions`, sorted.
fn shares(revisions: &Value) -> Vec<(String, u64)> {
    let mut v: Vec<(String, u64)> = revisions
        .as_array()
        .expect("revisions")
        .iter()
        .map(|r| {
            (
                r["id"].as_str().unwrap_or("").to_string(),
                r["traffic"].as_u64().unwrap_or(0),
            )
        })
        .collect();
    v.sort();
    v
}

/// Pids of every replica of every live revision.
async fn replica_pids(gw: &Gateway) -> Vec<i32> {
    let s = gw.json("/v1/status").await;
    s["apps"][0]["revisions"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|r| r["replicas"].as_array().cloned().unwrap_or_default())
        .filter_map(|r| r["pid"].as_i64())
        .map(|p| p as i32)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_watcher_promotes_complete_checkpoints_only() {
    let root = tempfile::tempdir().expect("dir");
    let watch = root.path().join("ckpts");
    std::fs::create_dir_all(&watch).expect("mkdir");
    let gw = Gateway::start(&config(&format!(
        "watch = \"file://{}\"\nwatch_interval = \"100ms\"",
        watch.display()
    )));
    gw.wait_ready("m", 1).await;
    let scans = || async { app(&gw).await["watch_scans"].as_u64().unwrap_or(0) };

    // A checkpoint still being written: files, no marker.
    checkpoint(&watch, "epoch-1", false);
    let seen = scans().await;
    eventually("the watcher looked three more times", || async {
        (scans().await >= seen + 3).then_some(())
    })
    .await;
    let revs = gw.json("/v1/apps/m/revisions").await;
    assert_eq!(
        revs["revisions"].as_array().map(Vec::len),
        Some(1),
        "a half-written checkpoint is never promoted: {revs}"
    );

    // The marker makes it whole: promoted, and served.
    std::fs::write(watch.join("epoch-1/_COMPLETE"), "").expect("marker");
    eventually("epoch-1 serves", || async {
        let s = app(&gw).await;
        (s["revision"] == "m-00002" && s["promotion"]["phase"] == "done").then_some(())
    })
    .await;
    let revs = gw.json("/v1/apps/m/revisions").await;
    assert!(
        revs["revisions"][0]["checkpoint"]
            .as_str()
            .is_some_and(|c| c.ends_with("/epoch-1")),
        "{revs}"
    );
    // The same checkpoint is not promoted twice.
    let seen = scans().await;
    eventually("the watcher looked again", || async {
        (scans().await >= seen + 3).then_some(())
    })
    .await;
    assert_eq!(
        gw.json("/v1/apps/m/revisions").await["revisions"]
            .as_array()
            .map(Vec::len),
        Some(2)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_canary_is_rolled_back_on_its_p99() {
    let root = tempfile::tempdir().expect("dir");
    let slow = checkpoint_with(root.path(), "slow", &["SLOW"]);
    let gw = Gateway::start(&config("canary = 50\nmax_p99 = \"100ms\""));
    gw.wait_ready("m", 1).await;
    let load = Load::start(&gw, 8);
    let (status, body) = post(
        &gw,
        "/v1/apps/m/promote",
        json!({"checkpoint": slow, "wait": true}),
    )
    .await;
    let (_, failed, _) = load.stop().await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["promotion"]["phase"], "rolled_back", "{body}");
    assert!(
        body["promotion"]["reason"]
            .as_str()
            .is_some_and(|r| r.contains("p99")),
        "{body}"
    );
    assert_eq!(failed, 0, "slow is not failed");
    assert_eq!(app(&gw).await["revision"], "m-00001");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_evaluation_gate_decides_before_traffic_moves() {
    let root = tempfile::tempdir().expect("dir");
    let good = checkpoint(root.path(), "good", false);
    let broken = checkpoint(root.path(), "broken", true);
    // The gate asks the new revision, pinned, four times: a broken model
    // fails one of them.
    let gate = r#"gate_command = ["sh", "-c", "for i in 1 2 3 4; do curl -sf -H \"x-warmgate-revision: $WARMGATE_EVAL_REVISION\" \"$WARMGATE_EVAL_URL/probe\" > /dev/null || { echo \"probe $i failed\" >&2; exit 1; }; done"]"#;
    let gw = Gateway::start(&config(gate));
    gw.wait_ready("m", 1).await;

    let body = promote_and_wait(&gw, &broken).await;
    assert_eq!(body["promotion"]["phase"], "rolled_back", "{body}");
    let reason = body["promotion"]["reason"].as_str().unwrap_or("");
    assert!(
        reason.contains("evaluation gate") && reason.contains("failed"),
        "{body}"
    );
    assert_eq!(app(&gw).await["revision"], "m-00001");

    let body = promote_and_wait(&gw, &good).await;
    assert_eq!(body["promotion"]["phase"], "done", "{body}");
    assert_eq!(app(&gw).await["revision"], "m-00003");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_gate_hook_keeps_the_old_revision() {
    let root = tempfile::tempdir().expect("dir");
    let good = checkpoint(root.path(), "good", false);
    let gw = Gateway::start(&config(r#"gate_url = "http://127.0.0.1:9/hook""#));
    gw.wait_ready("m", 1).await;
    let body = promote_and_wait(&gw, &good).await;
    assert_eq!(body["promotion"]["phase"], "rolled_back", "{body}");
    assert!(
        body["promotion"]["reason"]
            .as_str()
            .is_some_and(|r| r.contains("127.0.0.1:9")),
        "{body}"
    );
    assert_eq!(app(&gw).await["revision"], "m-00001");
}

/// Every GPU of `backend.gpus` taken by the app's two replicas: a
/// promotion that started replicas beside them could not place them.
fn full_box_config(v1: &str, extra: &str) -> String {
    format!(
        r#"
        [backend]
        gpus = [0, 1]

        [[apps]]
        name = "m"
        command = ["{{worker}}"]
        checkpoint = "{v1}"
        concurrency = 16
        gpus = 1

        [apps.autoscale]
        min = 2
        max = 2

        [apps.promotion]
        in_place = true
        min_requests = 10
        {extra}
        {allow}
        "#,
        allow = common::allow_temp_checkpoints()
    )
}

/// The full box shrunk to one GPU and one replica.
fn one_replica(config: String) -> String {
    config
        .replace("gpus = [0, 1]", "gpus = [0]")
        .replace("min = 2\n        max = 2", "min = 1\n        max = 1")
}

/// `config` with the app's worker concurrency and environment, and its
/// queue's timeout.
fn with_worker(config: String, concurrency: u32, env: &str, queue_timeout: &str) -> String {
    config
        .replace(
            "concurrency = 16",
            &format!("concurrency = {concurrency}\n        env = {{ {env} }}"),
        )
        .replace(
            "[apps.promotion]",
            &format!(
                "[apps.queue]\n        timeout = \"{queue_timeout}\"\n\n        [apps.promotion]"
            ),
        )
}

/// What the replicas answer now: (revision header, the worker's own
/// weights version), over a few requests.
async fn answered_by(gw: &Gateway) -> std::collections::BTreeSet<(String, String)> {
    let mut seen = std::collections::BTreeSet::new();
    for _ in 0..20 {
        let r = gw.http.get(gw.at("/apps/m/x")).send().await.expect("get");
        assert!(r.status().is_success(), "{}", r.status());
        let h = |name: &str| {
            r.headers()
                .get(name)
                .and_then(|v| v.to_str().ok())
                .unwrap_or("")
                .to_string()
        };
        seen.insert((h("x-warmgate-revision"), h("x-worker-weights-version")));
    }
    seen
}

fn sorted(mut pids: Vec<i32>) -> Vec<i32> {
    pids.sort_unstable();
    pids
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_in_place_promotion_on_a_full_box_swaps_the_weights_under_load() {
    let root = tempfile::tempdir().expect("dir");
    let v1 = checkpoint(root.path(), "v1", false);
    let v2 = checkpoint(root.path(), "v2", false);
    let gw = Gateway::start(&full_box_config(&v1, "canary = 50\nbake = \"2s\""));
    gw.wait_ready("m", 2).await;
    let pids = sorted(replica_pids(&gw).await);
    assert_eq!(pids.len(), 2);

    let load = Load::start(&gw, 8);
    eventually("traffic flows", || async {
        (load.ok.load(Ordering::Relaxed) > 50).then_some(())
    })
    .await;
    let (status, body) = post(
        &gw,
        "/v1/apps/m/promote",
        json!({"checkpoint": v2, "wait": true}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let p = &body["promotion"];
    assert_eq!(p["phase"], "done", "{body}");
    assert_eq!(p["plan"]["in_place"], true, "{body}");
    assert_eq!(p["plan"]["canary"], 50, "one of two replicas: {body}");
    assert!(p.get("fell_back").is_none(), "{body}");
    let before = load.ok.load(Ordering::Relaxed);
    eventually("traffic on the new revision", || async {
        (load.ok.load(Ordering::Relaxed) > before + 50).then_some(())
    })
    .await;
    let (ok, failed, seen) = load.stop().await;
    eprintln!("IN-PLACE promotion on a full box: {ok} answers under load, {failed} failed");
    assert_eq!(failed, 0, "{ok} ok, {failed} failed");
    assert!(seen.contains(&"m-00001".to_string()), "{seen:?}");
    assert_eq!(seen.last().map(String::as_str), Some("m-00002"), "{seen:?}");

    // The same two processes, now on the new weights, and nothing else.
    assert_eq!(sorted(replica_pids(&gw).await), pids, "no new process");
    let answers = answered_by(&gw).await;
    assert_eq!(
        answers,
        [("m-00002".to_string(), "2".to_string())].into(),
        "every replica runs m-00002's weights"
    );
    let revs = gw.json("/v1/apps/m/revisions").await;
    assert_eq!(revs["revisions"][0]["id"], "m-00002");
    assert_eq!(revs["revisions"][0]["state"], "serving");
    assert_eq!(revs["revisions"][1]["state"], "retired");
    let notes = revs["notes"].to_string();
    assert!(
        notes.contains("in place: canary of 1 of 2 replicas"),
        "{notes}"
    );

    // A rollback by hand swaps the old weights back into the same
    // processes, under load too.
    let load = Load::start(&gw, 8);
    let out = cli(&gw, &["rollback", "m"]);
    assert!(out.contains("rolling back to m-00001"), "{out}");
    eventually("m-00001 serves again", || async {
        let s = app(&gw).await;
        (s["revision"] == "m-00001" && s["promotion"]["phase"] == "done").then_some(())
    })
    .await;
    let (ok, failed, _) = load.stop().await;
    assert_eq!(failed, 0, "{ok} ok, {failed} failed");
    eventually("every replica back on m-00001's weights", || async {
        (answered_by(&gw).await == [("m-00001".to_string(), "1".to_string())].into()).then_some(())
    })
    .await;
    assert_eq!(sorted(replica_pids(&gw).await), pids, "no new process");
    let notes = gw.json("/v1/apps/m/revisions").await["notes"].to_string();
    assert!(notes.contains("roll back to m-00001 (in place"), "{notes}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broken_in_place_canary_is_swapped_back_under_load() {
    let root = tempfile::tempdir().expect("dir");
    let v1 = checkpoint(root.path(), "v1", false);
    let broken = checkpoint(root.path(), "broken", true);
    let gw = Gateway::start(&full_box_config(&v1, "canary = 50\nbake = \"30s\""));
    gw.wait_ready("m", 2).await;
    let pids = sorted(replica_pids(&gw).await);
    let load = Load::start(&gw, 8);
    let body = promote_and_wait(&gw, &broken).await;
    assert_eq!(body["promotion"]["phase"], "rolled_back", "{body}");
    assert!(
        body["promotion"]["reason"]
            .as_str()
            .is_some_and(|r| r.contains("error rate")),
        "{body}"
    );
    // The canary's replica loads the old weights again: every answer is
    // good once it has.
    // (The replica that never left reports the version it started with,
    // 0; the one swapped back, m-00001's number.)
    eventually("the canary's replica back on m-00001's weights", || async {
        let v = answered_by(&gw).await;
        (v.iter().all(|(rev, _)| rev == "m-00001")
            && v.contains(&("m-00001".to_string(), "1".to_string())))
        .then_some(())
    })
    .await;
    let before = load.failed.load(Ordering::Relaxed);
    let ok_before = load.ok.load(Ordering::Relaxed);
    eventually("traffic flows on the old weights", || async {
        (load.ok.load(Ordering::Relaxed) > ok_before + 200).then_some(())
    })
    .await;
    let (ok, failed, _) = load.stop().await;
    eprintln!(
        "IN-PLACE broken canary: {ok} answers under load, {before} failed while the canary ran, {} after the swap back",
        failed - before
    );
    assert_eq!(failed, before, "nothing fails once swapped back");
    assert_eq!(sorted(replica_pids(&gw).await), pids, "no new process");

    let revs = gw.json("/v1/apps/m/revisions").await;
    assert_eq!(revs["revisions"][0]["state"], "failed", "{revs}");
    assert_eq!(revs["revisions"][1]["traffic"], 100, "{revs}");
    let notes = revs["notes"].to_string();
    assert!(notes.contains("m-00002 rolled back"), "{notes}");
    assert!(notes.contains("in place"), "{notes}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_that_cannot_swap_makes_the_promotion_start_new_replicas() {
    let root = tempfile::tempdir().expect("dir");
    let v2 = checkpoint(root.path(), "v2", false);
    // A stock server: no POST /weights.
    let gw = Gateway::start(&config("").replace(
        "concurrency = 16",
        "concurrency = 16\n        env = { TEST_WORKER_NO_WEIGHTS = \"1\" }",
    ));
    gw.wait_ready("m", 1).await;
    let pids = replica_pids(&gw).await;
    let load = Load::start(&gw, 4);
    let (status, body) = post(
        &gw,
        "/v1/apps/m/promote",
        json!({"checkpoint": v2, "wait": true, "in_place": true}),
    )
    .await;
    let (ok, failed, _) = load.stop().await;
    assert_eq!(status, 200, "{body}");
    let p = &body["promotion"];
    assert_eq!(p["phase"], "done", "{body}");
    assert_eq!(p["plan"]["in_place"], false, "{body}");
    assert!(
        p["fell_back"]
            .as_str()
            .is_some_and(|r| r.contains("does not support in-place")),
        "the record says why: {body}"
    );
    assert_eq!(failed, 0, "{ok} ok, {failed} failed");
    assert_eq!(app(&gw).await["revision"], "m-00002");
    eventually("the new revision's own replica serves", || async {
        let now = replica_pids(&gw).await;
        (!now.is_empty() && now.iter().all(|p| !pids.contains(p))).then_some(())
    })
    .await;
    let notes = gw.json("/v1/apps/m/revisions").await["notes"].to_string();
    assert!(notes.contains("starts new replicas instead"), "{notes}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_app_of_one_replica_is_promoted_in_place_without_failing_a_request() {
    let root = tempfile::tempdir().expect("dir");
    let v1 = checkpoint(root.path(), "v1", false);
    let v2 = checkpoint(root.path(), "v2", false);
    // More clients than the replica has slots, and a load that takes a
    // while: requests are held while it swaps, and none may be lost.
    let config = with_worker(
        one_replica(full_box_config(&v1, "bake = \"1s\"")),
        2,
        "TEST_WORKER_WEIGHTS_DELAY_MS = \"500\"",
        "10s",
    );
    let gw = Gateway::start(&config);
    gw.wait_ready("m", 1).await;
    let pids = replica_pids(&gw).await;
    let load = Load::start(&gw, 8);
    eventually("traffic flows", || async {
        (load.ok.load(Ordering::Relaxed) > 50).then_some(())
    })
    .await;
    // All at once: the only replica stops taking m-00001's requests,
    // swaps, then serves what m-00001 still held before taking m-00002's.
    let body = promote_and_wait(&gw, &v2).await;
    assert_eq!(body["promotion"]["phase"], "done", "{body}");
    let before = load.ok.load(Ordering::Relaxed);
    eventually("traffic on the new revision", || async {
        (load.ok.load(Ordering::Relaxed) > before + 50).then_some(())
    })
    .await;
    let (ok, failed, seen) = load.stop().await;
    assert_eq!(failed, 0, "{ok} ok, {failed} failed");
    assert_eq!(seen.last().map(String::as_str), Some("m-00002"), "{seen:?}");
    assert_eq!(replica_pids(&gw).await, pids, "the same process");
    assert_eq!(
        answered_by(&gw).await,
        [("m-00002".to_string(), "2".to_string())].into()
    );
}

/// A rollback while the first replica is still loading the new weights:
/// the swap stops, the replica that loaded them is sent back, and no
/// request fails or is routed to a revision with nothing behind it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rollback_in_the_middle_of_an_in_place_swap_sends_everything_back() {
    let root = tempfile::tempdir().expect("dir");
    let v1 = checkpoint(root.path(), "v1", false);
    let v2 = checkpoint(root.path(), "v2", false);
    let cfg = full_box_config(&v1, "").replace(
        "concurrency = 16",
        "concurrency = 16\n        env = { TEST_WORKER_WEIGHTS_DELAY_MS = \"1500\" }",
    );
    let gw = Gateway::start(&cfg);
    gw.wait_ready("m", 2).await;
    let pids = sorted(replica_pids(&gw).await);
    let load = Load::start(&gw, 8);
    let (status, body) = post(&gw, "/v1/apps/m/promote", json!({"checkpoint": v2})).await;
    assert_eq!(status, 202, "{body}");
    eventually("a replica is loading m-00002", || async {
        let s = app(&gw).await;
        let ready: u64 = s["revisions"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|r| r["ready"].as_u64())
            .sum();
        (ready < 2).then_some(())
    })
    .await;
    let (status, body) = post(&gw, "/v1/apps/m/rollback", json!({})).await;
    assert_eq!(status, 200, "{body}");
    // Both replicas end on m-00001's weights (the one that was loading
    // m-00002 loads m-00001's again, reporting its number, 1).
    eventually("every replica back on m-00001", || async {
        let s = gw.json("/v1/status").await;
        let revs = s["apps"][0]["revisions"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        let versions: Vec<u64> = revs
            .iter()
            .flat_map(|r| r["replicas"].as_array().cloned().unwrap_or_default())
            .filter_map(|r| r["weights_version"].as_u64())
            .collect();
        (revs.len() == 1
            && revs[0]["id"] == "m-00001"
            && revs[0]["ready"] == 2
            && versions.len() == 2
            && versions.iter().all(|v| *v != 2))
        .then_some(())
    })
    .await;
    let (ok, failed, _) = load.stop().await;
    assert_eq!(failed, 0, "{ok} ok, {failed} failed");
    assert!(
        answered_by(&gw)
            .await
            .iter()
            .all(|(rev, v)| rev == "m-00001" && v != "2"),
        "nothing answers with m-00002's weights"
    );
    assert_eq!(sorted(replica_pids(&gw).await), pids, "no new process");
    // A new promotion may start once the swap back is over.
    let v3 = checkpoint(root.path(), "v3", false);
    let (status, body) = post(&gw, "/v1/apps/m/promote", json!({"checkpoint": v3})).await;
    assert_eq!(status, 202, "{body}");
}

/// Without a canary, one replica swaps for the gate and takes only the
/// gate's pinned requests: a gate that fails keeps every user request on
/// the old weights.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_gate_in_place_never_shows_users_the_new_weights() {
    let root = tempfile::tempdir().expect("dir");
    let v1 = checkpoint(root.path(), "v1", false);
    let broken = checkpoint(root.path(), "broken", true);
    let gw = Gateway::start(&full_box_config(&v1, "gate_command = [\"false\"]"));
    gw.wait_ready("m", 2).await;
    let load = Load::start(&gw, 8);
    let body = promote_and_wait(&gw, &broken).await;
    assert_eq!(body["promotion"]["phase"], "rolled_back", "{body}");
    let before = load.ok.load(Ordering::Relaxed);
    eventually("traffic goes on", || async {
        (load.ok.load(Ordering::Relaxed) > before + 100).then_some(())
    })
    .await;
    let (ok, failed, seen) = load.stop().await;
    assert_eq!(
        failed, 0,
        "{ok} ok, {failed} failed: a user met the broken weights"
    );
    assert_eq!(seen, ["m-00001"], "only the old revision answered users");
}

/// An in-place canary whose only replica crashes: its share of the
/// traffic is served by the old revision's replica that replaces it, and
/// the canary is rolled back at once instead of baking on nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_in_place_canary_that_loses_its_replicas_is_rolled_back() {
    let root = tempfile::tempdir().expect("dir");
    let v1 = checkpoint(root.path(), "v1", false);
    let v2 = checkpoint(root.path(), "v2", false);
    let config = full_box_config(&v1, "canary = 50\nbake = \"60s\"");
    let gw = Gateway::start(&config);
    gw.wait_ready("m", 2).await;
    let (status, body) = post(&gw, "/v1/apps/m/promote", json!({"checkpoint": v2})).await;
    assert_eq!(status, 202, "{body}");
    let canary = eventually("the canary runs", || async {
        let s = gw.json("/v1/status").await;
        if s["apps"][0]["promotion"]["phase"] != "canary" {
            return None;
        }
        first_pid(&s["apps"][0]["revisions"], "m-00002")
    })
    .await;
    let _ = std::process::Command::new("kill")
        .args(["-9", &canary.to_string()])
        .status();
    let body = eventually("rolled back", || async {
        let s = app(&gw).await;
        (s["promotion"]["phase"] == "rolled_back").then_some(s)
    })
    .await;
    assert!(
        body["promotion"]["reason"]
            .as_str()
            .is_some_and(|r| r.contains("replicas were lost")),
        "{body}"
    );
    eventually("both replicas serve m-00001 again", || async {
        (app(&gw).await["ready"] == 2).then_some(())
    })
    .await;
    assert!(
        answered_by(&gw)
            .await
            .iter()
            .all(|(rev, _)| rev == "m-00001")
    );
}

/// The pid of the first replica of revision `id` in a status's revisions.
fn first_pid(revisions: &Value, id: &str) -> Option<i64> {
    revisions.as_array()?.iter().find(|r| r["id"] == id)?["replicas"]
        .as_array()?
        .first()?["pid"]
        .as_i64()
}

/// After two in-place promotions (the app's default being new replicas),
/// a rollback by hand is in place too: the previous revision's replicas
/// are the serving one's. While those replicas restart it waits (409)
/// rather than failing the previous revision for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rollback_after_in_place_promotions_swaps_back_or_waits_for_the_replicas() {
    let root = tempfile::tempdir().expect("dir");
    let v1 = checkpoint(root.path(), "v1", false);
    let v2 = checkpoint(root.path(), "v2", false);
    let v3 = checkpoint(root.path(), "v3", false);
    let cfg = full_box_config(&v1, "").replace("in_place = true", "in_place = false");
    let gw = Gateway::start(&cfg);
    gw.wait_ready("m", 2).await;
    let pids = sorted(replica_pids(&gw).await);
    for v in [&v2, &v3] {
        let (status, body) = post(
            &gw,
            "/v1/apps/m/promote",
            json!({"checkpoint": v, "wait": true, "in_place": true}),
        )
        .await;
        assert_eq!(status, 200, "{body}");
        assert_eq!(body["promotion"]["phase"], "done", "{body}");
    }
    let (status, body) = post(&gw, "/v1/apps/m/rollback", json!({})).await;
    assert_eq!(status, 200, "{body}");
    eventually("m-00002 serves again", || async {
        let s = app(&gw).await;
        (s["revision"] == "m-00002" && s["promotion"]["phase"] == "done").then_some(())
    })
    .await;
    assert_eq!(
        answered_by(&gw).await,
        [("m-00002".to_string(), "2".to_string())].into()
    );
    assert_eq!(
        sorted(replica_pids(&gw).await),
        pids,
        "in place: no new process"
    );

    // The replicas crash: a rollback must wait for them, not give up.
    for p in &pids {
        let _ = std::process::Command::new("kill")
            .args(["-9", &p.to_string()])
            .status();
    }
    eventually("the replicas are gone", || async {
        (app(&gw).await["ready"] == 0).then_some(())
    })
    .await;
    let (status, body) = post(&gw, "/v1/apps/m/rollback", json!({})).await;
    assert_eq!(status, 409, "{body}");
    let revs = gw.json("/v1/apps/m/revisions").await;
    assert_eq!(
        revs["promotion"]["to"], "m-00002",
        "nothing was saved: {revs}"
    );
    eventually("the rollback goes through once they are back", || async {
        let (status, _) = post(&gw, "/v1/apps/m/rollback", json!({})).await;
        (status == 200).then_some(())
    })
    .await;
}

/// No canary, a gate. The new revision's only replica crashes while the
/// gate runs (as new weights that run out of memory would): the gate's
/// requests pinned to it are refused, never answered by the old weights,
/// so the gate fails and nothing unevaluated is swapped in.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gate_whose_replica_crashes_is_not_answered_by_the_old_weights() {
    let root = tempfile::tempdir().expect("dir");
    let v1 = checkpoint(root.path(), "v1", false);
    let v2 = checkpoint(root.path(), "v2", false);
    let out = root.path().join("gate.out");
    let script = root.path().join("gate.sh");
    std::fs::write(
        &script,
        format!(
            "#!/bin/sh\n\
             curl -s -o /dev/null -H \"X-Warmgate-Revision: $WARMGATE_EVAL_REVISION\" \"$WARMGATE_EVAL_URL/x?crash=1\"\n\
             sleep 1\n\
             curl -s -D - -o /dev/null -H \"X-Warmgate-Revision: $WARMGATE_EVAL_REVISION\" \"$WARMGATE_EVAL_URL/x\" > {out}\n\
             grep -q '^HTTP/1.1 200' {out}\n",
            out = out.display()
        ),
    )
    .expect("script");
    let cfg = full_box_config(
        &v1,
        &format!("gate_command = [\"sh\", \"{}\"]", script.display()),
    );
    let gw = Gateway::start(&cfg);
    gw.wait_ready("m", 2).await;
    let body = promote_and_wait(&gw, &v2).await;
    let seen = std::fs::read_to_string(&out).unwrap_or_default();
    assert_eq!(body["promotion"]["phase"], "rolled_back", "{body}");
    assert!(
        seen.starts_with("HTTP/1.1 503"),
        "the gate's pinned request to m-00002 went elsewhere: {seen}"
    );
    assert!(
        !seen
            .to_ascii_lowercase()
            .contains("x-warmgate-revision: m-00001"),
        "{seen}"
    );
}

/// A long request on each replica (any client can send one): the swap
/// waits for them to finish instead of killing the replica or failing the
/// promotion, and they are answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_requests_wait_out_an_in_place_swap_instead_of_failing_it() {
    let root = tempfile::tempdir().expect("dir");
    let v1 = checkpoint(root.path(), "v1", false);
    let v2 = checkpoint(root.path(), "v2", false);
    let cfg = full_box_config(&v1, "").replace(
        "concurrency = 16",
        "concurrency = 16\n        startup_timeout = \"3s\"",
    );
    let gw = Gateway::start(&cfg);
    gw.wait_ready("m", 2).await;
    let mut long = Vec::new();
    for _ in 0..4 {
        let (http, url) = (gw.http.clone(), gw.at("/apps/m/x?latency_ms=8000"));
        long.push(tokio::spawn(async move {
            http.get(&url).send().await.map(|r| r.status().as_u16())
        }));
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let body = promote_and_wait(&gw, &v2).await;
    let mut statuses = Vec::new();
    for t in long {
        statuses.push(t.await.expect("join").ok());
    }
    assert_eq!(
        body["promotion"]["phase"], "done",
        "{body}; long requests {statuses:?}"
    );
    assert!(statuses.iter().all(|s| *s == Some(200)), "{statuses:?}");
}

/// An app of one replica, in-place canary (all the traffic). The canary's
/// only replica crashes: neither revision has a replica, and requests are
/// held for the replacement (which starts on the old weights) instead of
/// bouncing between the two revisions and failing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_app_of_one_whose_canary_crashes_holds_its_requests_for_the_replacement() {
    let root = tempfile::tempdir().expect("dir");
    let v1 = checkpoint(root.path(), "v1", false);
    let v2 = checkpoint(root.path(), "v2", false);
    let config = with_worker(
        one_replica(full_box_config(&v1, "canary = 50\nbake = \"60s\"")),
        16,
        "TEST_WORKER_STARTUP_MS = \"1500\"",
        "20s",
    );
    let gw = Gateway::start(&config);
    gw.wait_ready("m", 1).await;
    let (status, body) = post(&gw, "/v1/apps/m/promote", json!({"checkpoint": v2})).await;
    assert_eq!(status, 202, "{body}");
    let canary = eventually("the canary runs", || async {
        let s = gw.json("/v1/status").await;
        if s["apps"][0]["promotion"]["phase"] != "canary" {
            return None;
        }
        first_pid(&s["apps"][0]["revisions"], "m-00002")
    })
    .await;
    let load = Load::start(&gw, 4);
    eventually("traffic flows", || async {
        (load.ok.load(Ordering::Relaxed) > 20).then_some(())
    })
    .await;
    let _ = std::process::Command::new("kill")
        .args(["-9", &canary.to_string()])
        .status();
    // One request by hand, to see the error.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let r = gw.http.get(gw.at("/apps/m/x")).send().await.expect("get");
    let st = r.status().as_u16();
    let text = r.text().await.unwrap_or_default();
    eventually("served again", || async {
        (app(&gw).await["ready"] == 1).then_some(())
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (ok, failed, _) = load.stop().await;
    // Only what was in flight on the replica that died (4 clients).
    assert!(failed <= 4, "{ok} ok, {failed} failed; e.g. {st} {text}");
}

/// A rollback to a revision made from other settings (another
/// environment) is not done in place: swapping only the weights would run
/// it on the serving replicas' settings. It starts replicas of its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_in_place_rollback_never_runs_a_revision_on_another_s_settings() {
    let root = tempfile::tempdir().expect("dir");
    let v1 = checkpoint(root.path(), "v1", false);
    let v3 = checkpoint(root.path(), "v3", false);
    let script = root.path().join("gate.sh");
    std::fs::write(
        &script,
        "#!/bin/sh\n[ \"$WARMGATE_EVAL_REVISION\" != \"m-00003\" ]\n",
    )
    .expect("script");
    let gate = format!("gate_command = [\"sh\", \"{}\"]", script.display());
    let cfg = full_box_config(&v1, &gate).replace("gpus = [0, 1]", "gpus = [0, 1, 2, 3]");
    let gw = Gateway::start(&cfg);
    gw.wait_ready("m", 2).await;
    // A config change: every request now takes 400 ms (a new engine flag,
    // say). It rolls to m-00002 on new replicas.
    let spec = json!({
        "name": "m",
        "command": [common::test_worker()],
        "checkpoint": v1,
        "concurrency": 16,
        "gpus": 1,
        "env": {"TEST_WORKER_LATENCY_MS": "400"},
        "autoscale": {"min": 2, "max": 2},
        "promotion": {"in_place": true, "min_requests": 10, "gate_command": ["sh", script.display().to_string()]},
    });
    let r = gw
        .http
        .put(gw.at("/v1/apps/m"))
        .json(&spec)
        .send()
        .await
        .expect("put");
    let st = r.status();
    let txt = r.text().await.unwrap_or_default();
    assert!(st.is_success(), "{st} {txt}");
    eventually("m-00002 serves", || async {
        let s = app(&gw).await;
        (s["revision"] == "m-00002" && s["promotion"]["phase"] == "done" && s["ready"] == 2)
            .then_some(())
    })
    .await;
    // An in-place promotion whose gate fails: m-00003 is failed.
    let body = promote_and_wait(&gw, &v3).await;
    assert_eq!(body["promotion"]["phase"], "rolled_back", "{body}");
    eventually("swap back over", || async {
        let (st, _) = post(&gw, "/v1/apps/m/rollback", json!({})).await;
        (st == 200).then_some(())
    })
    .await;
    eventually("m-00001 serves", || async {
        let s = app(&gw).await;
        (s["revision"] == "m-00001" && s["promotion"]["phase"] == "done").then_some(())
    })
    .await;
    let notes = gw.json("/v1/apps/m/revisions").await["notes"].to_string();
    assert!(
        notes.contains("its settings differ from the serving replicas', so new replicas"),
        "{notes}"
    );
    assert!(
        answered_by(&gw)
            .await
            .iter()
            .all(|(rev, _)| rev == "m-00001"),
        "{notes}"
    );
}

/// The attack of issue 40 on gates, against the real binary: a gate that
/// prints its environment and leaves children behind, one in its process
/// group and one in a session of its own (`setsid`). It sees none of the
/// gateway's secrets, the child in its group dies with it, and the one
/// that escaped the group (which only a cgroup could catch) does not hold
/// the promotion.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gate_sees_no_secret_and_its_children_hold_nothing() {
    const ADMIN: &str = "admin-token-for-gates-5d0e";
    const CLOUD: &str = "cloud-secret-for-gates-77a1";
    let root = tempfile::tempdir().expect("dir");
    let v1 = checkpoint(root.path(), "v1", false);
    let v2 = checkpoint(root.path(), "v2", false);
    let (env, kept, escaped) = (
        root.path().join("gate.env"),
        root.path().join("kept.pid"),
        root.path().join("escaped.pid"),
    );
    let script = root.path().join("gate.sh");
    std::fs::write(
        &script,
        format!(
            "#!/bin/sh\n\
             env > {env}\n\
             sleep 60 & echo $! > {kept}\n\
             setsid sh -c 'echo $$ > {escaped}; exec sleep 60' > /dev/null 2>&1 &\n\
             while [ ! -s {escaped} ]; do sleep 0.01; done\n\
             echo 'the evaluation failed' >&2\n\
             exit 1\n",
            env = env.display(),
            kept = kept.display(),
            escaped = escaped.display()
        ),
    )
    .expect("script");
    let cfg = full_box_config(
        &v1,
        &format!("gate_command = [\"sh\", \"{}\"]", script.display()),
    );
    let gw = Gateway::start_with(
        &cfg,
        &[],
        &[
            ("WARMGATE_ADMIN_TOKEN", ADMIN),
            ("AWS_SECRET_ACCESS_KEY", CLOUD),
        ],
    );
    eventually("m is ready", || async {
        let r = gw
            .http
            .get(gw.at("/v1/status"))
            .bearer_auth(ADMIN)
            .send()
            .await
            .ok()?;
        let s: Value = r.json().await.ok()?;
        (s["apps"][0]["ready"] == 2).then_some(())
    })
    .await;
    let t0 = std::time::Instant::now();
    let r = gw
        .http
        .post(gw.at("/v1/apps/m/promote"))
        .bearer_auth(ADMIN)
        .json(&json!({"checkpoint": v2, "wait": true}))
        .send()
        .await
        .expect("send");
    assert_eq!(r.status(), 200);
    let body: Value = r.json().await.expect("json");
    assert_eq!(body["promotion"]["phase"], "rolled_back", "{body}");
    let took = t0.elapsed();
    let pid = |p: &Path| -> i32 {
        std::fs::read_to_string(p)
            .expect("pid file")
            .trim()
            .parse()
            .expect("pid")
    };
    // Running: alive and not a zombie waiting to be reaped.
    let running = |pid: i32| {
        std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .ok()
            .and_then(|s| s.rsplit_once(") ").map(|(_, rest)| !rest.starts_with('Z')))
            .unwrap_or(false)
    };
    let escaped_pid = pid(&escaped);
    // The promotion ended while the escaped child still ran: not held.
    assert!(
        running(escaped_pid),
        "the escaped child ended first: the promotion waited for it ({took:?})"
    );
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(escaped_pid),
        nix::sys::signal::Signal::SIGKILL,
    );
    // The child in the gate's group was killed with it.
    let kept_pid = pid(&kept);
    eventually("the gate's own child is gone", || async {
        (!running(kept_pid)).then_some(())
    })
    .await;
    // No secret of the gateway's reached the gate.
    let seen = std::fs::read_to_string(&env).expect("the gate's environment");
    for secret in [ADMIN, CLOUD] {
        assert!(
            !seen.contains(secret),
            "a secret leaked into the gate:\n{seen}"
        );
    }
    assert!(seen.contains("WARMGATE_EVAL_URL="), "{seen}");
}

/// An app at zero replicas (the default) is promoted to a checkpoint its
/// workers cannot load: the promotion starts one replica, sees it fail,
/// and the old revision keeps serving; `--wait` exits 1 with the worker's
/// own words. A good checkpoint is then switched to only once a replica
/// of it is ready, and the app scales back to zero.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_checkpoint_promoted_at_zero_fails_and_the_old_revision_serves() {
    let root = tempfile::tempdir().expect("dir");
    let crash = checkpoint_with(root.path(), "crash", &["CRASH"]);
    let good = checkpoint(root.path(), "good", false);
    let gw = Gateway::start(
        &config("").replace("min = 1", "min = 0\n        scale_to_zero_after = \"2s\""),
    );
    assert_eq!(app(&gw).await["revision"], "m-00001");

    let (code, out, err) = gw.warmgate(&["promote", "m", &crash, "--wait"]);
    assert_eq!(code, Some(1), "{out}{err}");
    assert!(
        err.contains("CUDA out of memory") && !out.contains("serves 100%"),
        "the cause is shown: {out}{err}"
    );
    assert!(
        !err.contains("/logs/"),
        "no path on the gateway's disk: {err}"
    );
    let revs = gw.json("/v1/apps/m/revisions").await;
    assert_eq!(revs["revisions"][0]["id"], "m-00002", "{revs}");
    assert_eq!(revs["revisions"][0]["state"], "failed", "{revs}");
    assert_eq!(revs["revisions"][1]["traffic"], 100, "{revs}");
    let r = gw.http.get(gw.at("/apps/m/x")).send().await.expect("get");
    assert_eq!(r.status().as_u16(), 200);
    assert_eq!(r.headers()["x-warmgate-revision"], "m-00001");

    let (code, out, err) = gw.warmgate(&["promote", "m", &good, "--wait"]);
    assert_eq!(code, Some(0), "{out}{err}");
    assert!(out.contains("m-00003 serves 100%"), "{out}{err}");
    let s = app(&gw).await;
    assert_eq!(s["revision"], "m-00003", "{s}");
    eventually("the app scales back to zero", || async {
        let s = app(&gw).await;
        (s["pool"]["desired"] == 0 && s["pool"]["replicas"].as_array().is_some_and(Vec::is_empty))
            .then_some(())
    })
    .await;
}

/// The same for a live change that rolls an app at zero: the new revision
/// must come up before it serves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_put_that_rolls_an_app_at_zero_onto_a_crashing_spec_keeps_the_old_revision() {
    let gw = Gateway::start(&config("").replace("min = 1", "min = 0"));
    let spec = json!({
        "command": [common::test_worker()],
        "env": {"TEST_WORKER_EXIT_AT_START": "3"},
        "concurrency": 16,
    });
    let (_, body) = gw.put("/v1/apps/m", &spec).await;
    assert_eq!(body["change"], "rolled", "{body}");
    eventually("the roll fails and m-00001 still serves", || async {
        let s = app(&gw).await;
        (s["promotion"]["phase"] == "failed" && s["revision"] == "m-00001").then_some(s)
    })
    .await;
    let r = gw.http.get(gw.at("/apps/m/x")).send().await.expect("get");
    assert_eq!(r.status().as_u16(), 200);
    assert_eq!(r.headers()["x-warmgate-revision"], "m-00001");
}
