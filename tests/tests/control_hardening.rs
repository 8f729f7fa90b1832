//! Issue 15, the control half: a failed save changes nothing and says so;
//! a data-plane client can neither jump ahead of other tenants, strip the
//! tenant the gateway vouches for, nor fail a canary by pinning it; the
//! state is private; the open-file limit is raised and a flood of refused
//! connections holds no descriptor each.

mod common;

use std::os::unix::fs::PermissionsExt as _;
use std::path::Path;

use common::{Gateway, eventually, kind};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

const KEY_A: &str = "key-alpha-7d1e";
const KEY_B: &str = "key-bravo-2c9f";

/// `config` with the temporary folder's checkpoints allowed.
fn with_temp_checkpoints(config: &str) -> String {
    format!("{config}{}", common::allow_temp_checkpoints())
}

/// A checkpoint folder with one file.
fn checkpoint(root: &Path, name: &str) -> String {
    let dir = root.join(name);
    std::fs::create_dir_all(&dir).expect("mkdir");
    std::fs::write(dir.join("model.bin"), name.repeat(1000)).expect("write");
    format!("file://{}", dir.display())
}

async fn post(gw: &Gateway, path: &str, body: Value) -> (u16, Value) {
    gw.post(path, &body).await
}

/// POST with a tenant's key.
async fn post_as(gw: &Gateway, key: &str, path: &str, body: Value) -> (u16, Value) {
    let r = gw
        .http
        .post(gw.at(path))
        .bearer_auth(key)
        .json(&body)
        .send()
        .await
        .expect("send");
    (r.status().as_u16(), r.json().await.unwrap_or(Value::Null))
}

/// GET with a tenant's key.
async fn get_as(gw: &Gateway, key: &str, path: &str) -> Value {
    gw.http
        .get(gw.at(path))
        .bearer_auth(key)
        .send()
        .await
        .expect("send")
        .json()
        .await
        .expect("json")
}

fn mode(path: &Path) -> u32 {
    std::fs::metadata(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .permissions()
        .mode()
        & 0o777
}

/// The number of descriptors `pid` has open.
fn open_fds(pid: i32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .expect("read /proc/<pid>/fd")
        .count()
}

/// Holds SQLite's write lock on the gateway's state database until
/// dropped: every save of the gateway then fails (after its busy
/// timeout), as it would on a full or failing disk.
struct WriteLock(rusqlite::Connection);

impl WriteLock {
    fn take(gw: &Gateway) -> WriteLock {
        let conn = rusqlite::Connection::open(gw.dir.path().join("state").join("state.db"))
            .expect("open state.db");
        conn.execute_batch("BEGIN IMMEDIATE")
            .expect("take the write lock");
        WriteLock(conn)
    }

    fn release(self) {
        self.0.execute_batch("ROLLBACK").expect("release");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_promotion_step_that_cannot_be_saved_changes_nothing() {
    let root = tempfile::tempdir().expect("dir");
    let v2 = checkpoint(root.path(), "v2");
    let gw = Gateway::start(&with_temp_checkpoints(
        r#"
        [[apps]]
        name = "m"
        command = ["{worker}"]
        [apps.autoscale]
        min = 1
        max = 2
        "#,
    ));
    gw.wait_ready("m", 1).await;

    // The promotion cannot be saved: an internal error, and nothing moved.
    let lock = WriteLock::take(&gw);
    let (status, body) = post(&gw, "/v1/apps/m/promote", json!({"checkpoint": v2})).await;
    assert_eq!(status, 500, "{body}");
    assert_eq!(kind(&body), "internal", "{body}");
    let s = gw.app_status("m").await;
    assert_eq!(s["revision"], "m-00001", "{s}");
    assert_ne!(s["promotion"]["phase"], "warming", "not stuck warming: {s}");
    let revs = gw.json("/v1/apps/m/revisions").await;
    let ids: Vec<&str> = revs["revisions"]
        .as_array()
        .expect("revisions")
        .iter()
        .filter_map(|r| r["id"].as_str())
        .collect();
    assert_eq!(ids, ["m-00001"], "{revs}");
    // Nothing is running, so a rollback has nothing to do and says so.
    let (status, body) = post(&gw, "/v1/apps/m/rollback", json!({})).await;
    assert_eq!(status, 409, "{body}");
    lock.release();

    // Once the disk is back, the same promotion goes through.
    let (status, body) = post(&gw, "/v1/apps/m/promote", json!({"checkpoint": v2})).await;
    assert_eq!(status, 202, "{body}");
    assert_eq!(body["revision"], "m-00002", "{body}");
    eventually("m-00002 serves", || async {
        let s = gw.app_status("m").await;
        (s["revision"] == "m-00002" && s["promotion"]["phase"] == "done").then_some(())
    })
    .await;

    // A rollback that cannot be saved is an error, and m-00002 serves on.
    let lock = WriteLock::take(&gw);
    let (status, body) = post(&gw, "/v1/apps/m/rollback", json!({})).await;
    assert_eq!(status, 500, "{body}");
    assert_eq!(kind(&body), "internal", "{body}");
    let s = gw.app_status("m").await;
    assert_eq!(s["revision"], "m-00002", "{s}");
    assert_eq!(s["promotion"]["phase"], "done", "{s}");
    let r = gw.http.get(gw.at("/apps/m/x")).send().await.expect("get");
    assert_eq!(r.headers()["x-warmgate-revision"], "m-00002");
    lock.release();
    let (status, body) = post(&gw, "/v1/apps/m/rollback", json!({})).await;
    assert_eq!(status, 200, "{body}");
    eventually("m-00001 serves again", || async {
        let s = gw.app_status("m").await;
        (s["revision"] == "m-00001" && s["promotion"]["phase"] == "done").then_some(())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_the_driver_cannot_save_is_taken_once_the_disk_is_back() {
    let root = tempfile::tempdir().expect("dir");
    let v2 = checkpoint(root.path(), "v2");
    let gw = Gateway::start(&with_temp_checkpoints(
        r#"
        [[apps]]
        name = "m"
        command = ["{worker}"]
        [apps.autoscale]
        min = 1
        max = 2
        [apps.promotion]
        canary = 50
        bake = "1s"
        "#,
    ));
    gw.wait_ready("m", 1).await;
    let (status, body) = post(&gw, "/v1/apps/m/promote", json!({"checkpoint": v2})).await;
    assert_eq!(status, 202, "{body}");
    eventually("the canary runs", || async {
        (gw.app_status("m").await["promotion"]["phase"] == "canary").then_some(())
    })
    .await;
    // The end of the bake cannot be saved while the lock is held.
    let lock = WriteLock::take(&gw);
    eventually("the gateway reports the failed save", || async {
        let log = gw.log();
        // The wording of this version, or of the one before it.
        (log.contains("a promotion step could not be saved")
            || log.contains("promotion step not recorded"))
        .then_some(())
    })
    .await;
    let s = gw.app_status("m").await;
    assert_eq!(s["promotion"]["phase"], "canary", "memory as saved: {s}");
    lock.release();
    eventually("the promotion ends once the step is saved", || async {
        let s = gw.app_status("m").await;
        (s["revision"] == "m-00002" && s["promotion"]["phase"] == "done").then_some(())
    })
    .await;
    let revs = gw.json("/v1/apps/m/revisions").await;
    assert_eq!(revs["revisions"][0]["traffic"], 100, "{revs}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pinned_requests_do_not_count_toward_a_canary_s_health() {
    let root = tempfile::tempdir().expect("dir");
    let v2 = checkpoint(root.path(), "v2");
    let gw = Gateway::start(&with_temp_checkpoints(
        r#"
        [[apps]]
        name = "m"
        command = ["{worker}"]
        [apps.autoscale]
        min = 1
        max = 2
        [apps.promotion]
        canary = 50
        bake = "5s"
        min_requests = 10
        "#,
    ));
    gw.wait_ready("m", 1).await;
    let (status, body) = post(&gw, "/v1/apps/m/promote", json!({"checkpoint": v2})).await;
    assert_eq!(status, 202, "{body}");
    eventually("the canary runs", || async {
        (gw.app_status("m").await["promotion"]["phase"] == "canary").then_some(())
    })
    .await;
    // A data-plane client pins the canary and makes every request fail.
    for _ in 0..30 {
        let r = gw
            .http
            .get(gw.at("/apps/m/x"))
            .header("x-warmgate-revision", "m-00002")
            .header("x-test-status", "500")
            .send()
            .await
            .expect("pinned");
        assert_eq!(r.status(), 500, "the canary is still live");
        assert_eq!(r.headers()["x-warmgate-revision"], "m-00002");
    }
    let promotion = eventually("the promotion ends", || async {
        let p = gw.app_status("m").await["promotion"].clone();
        (p["phase"] != "canary").then_some(p)
    })
    .await;
    assert_eq!(promotion["phase"], "done", "{promotion}");
    assert_eq!(gw.app_status("m").await["revision"], "m-00002");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_cannot_strip_the_tenant_header_the_gateway_sets() {
    let gw = Gateway::start_with(
        r#"
        [[apps]]
        name = "m"
        command = ["{worker}"]
        [apps.autoscale]
        min = 1
        [[tenants]]
        name = "alpha"
        api_key_env = "TEST_KEY_ALPHA"
        "#,
        &[],
        &[("TEST_KEY_ALPHA", KEY_A)],
    );
    let r = gw
        .http
        .get(gw.at("/apps/m/echo"))
        .bearer_auth(KEY_A)
        .header("connection", "x-warmgate-tenant, x-request-id, x-hop")
        .header("x-hop", "one hop only")
        .send()
        .await
        .expect("send");
    assert_eq!(r.status(), 200);
    let echo: Value = r.json().await.expect("json");
    let headers = &echo["headers"];
    assert_eq!(headers["x-warmgate-tenant"], "alpha", "{echo}");
    assert!(headers["x-request-id"].is_string(), "{echo}");
    // What the client named for one hop still ends at the gateway.
    assert!(headers.get("x-hop").is_none(), "{echo}");
    assert!(headers.get("authorization").is_none(), "{echo}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_state_folder_and_database_are_private() {
    let gw = Gateway::start(
        r#"
        [[apps]]
        name = "m"
        command = ["{worker}"]
        "#,
    );
    let state = gw.dir.path().join("state");
    assert_eq!(mode(&state), 0o700);
    for name in ["state.db", "state.db-wal", "state.db-shm"] {
        let path = state.join(name);
        if name == "state.db" || path.exists() {
            assert_eq!(mode(&path), 0o600, "{name}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_soft_open_file_limit_is_raised_to_the_hard_limit() {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    let (_, hard) = getrlimit(Resource::RLIMIT_NOFILE).expect("getrlimit");
    // Start the gateway with a soft limit below the hard one, as most
    // distributions do (1024 of 524288).
    let soft = (hard / 2).min(1024);
    setrlimit(Resource::RLIMIT_NOFILE, soft, hard).expect("lower the soft limit");
    let gw = Gateway::start("");
    let limits = std::fs::read_to_string(format!("/proc/{}/limits", gw.pid())).expect("limits");
    let line = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .expect("a Max open files line");
    let figures: Vec<&str> = line
        .trim_start_matches("Max open files")
        .split_whitespace()
        .collect();
    assert_eq!(figures[0], figures[1], "soft and hard: {line}");
    assert_eq!(figures[1], hard.to_string(), "{line}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_refused_connections_holds_no_descriptor_each() {
    const HELD: usize = 4;
    const FLOOD: usize = 300;
    let gw = Gateway::start(&format!(
        r#"
        [limits]
        max_connections = {HELD}
        header_read_timeout = "120s"
        "#
    ));
    let addr = gw.url.trim_start_matches("http://").to_string();
    let before = open_fds(gw.pid());
    // Every slot taken by a connection that sends nothing.
    let mut held = Vec::new();
    for _ in 0..HELD {
        held.push(
            tokio::net::TcpStream::connect(&addr)
                .await
                .expect("connect"),
        );
    }
    // Then a flood of connections that stay open: each is refused (read
    // to its end, so the gateway has dealt with it) and kept by the client.
    let mut flood = Vec::new();
    let mut answered = 0;
    for _ in 0..FLOOD {
        let mut c = tokio::net::TcpStream::connect(&addr)
            .await
            .expect("connect");
        let mut got = Vec::new();
        let read = tokio::time::timeout(common::WAIT, c.read_to_end(&mut got))
            .await
            .expect("the gateway deals with a refused connection at once");
        if read.is_ok() && String::from_utf8_lossy(&got).starts_with("HTTP/1.1 503") {
            answered += 1;
        }
        flood.push(c);
    }
    let during = open_fds(gw.pid());
    assert!(
        answered > 0,
        "refused connections are told why: {answered} of {FLOOD}"
    );
    // The held connections, the refusals lingering in the one shared task,
    // and a margin; not one descriptor per refused connection.
    assert!(
        during <= before + HELD + 100,
        "{during} descriptors open during a flood of {FLOOD} (before: {before})"
    );
    drop(flood);
    for mut c in held {
        let _ = c.shutdown().await;
    }
    let refused = eventually("the gateway serves again", || async {
        let r = gw
            .http
            .get(gw.at("/metrics"))
            .bearer_auth(gw.admin_token())
            .send()
            .await
            .ok()?;
        if r.status() != 200 {
            return None;
        }
        let v = gw.metric("warmgate_connections_refused_total").await;
        Some(v)
    })
    .await;
    assert!(refused >= FLOOD as f64, "{refused} refused");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_cannot_jump_ahead_of_another_with_priority() {
    let gw = Gateway::start_with(
        r#"
        [[pools]]
        name = "p"
        command = ["{worker}"]
        replicas = [1, 1]
        concurrency = 1
        [[tenants]]
        name = "alpha"
        api_key_env = "TEST_KEY_ALPHA"
        [[tenants]]
        name = "bravo"
        api_key_env = "TEST_KEY_BRAVO"
        "#,
        &[],
        &[("TEST_KEY_ALPHA", KEY_A), ("TEST_KEY_BRAVO", KEY_B)],
    );
    let submit = |key: &'static str, input: Value, priority: i32| {
        let gw = &gw;
        async move {
            let (status, body) = post_as(
                gw,
                key,
                "/v1/pools/p/tasks?async=true",
                json!({"input": input, "priority": priority}),
            )
            .await;
            assert_eq!(status, 202, "{body}");
            body["id"].as_str().expect("id").to_string()
        }
    };
    let state = |key: &'static str, id: String| {
        let gw = &gw;
        async move {
            get_as(gw, key, &format!("/v1/tasks/{id}")).await["state"]
                .as_str()
                .unwrap_or("")
                .to_string()
        }
    };
    // The only slot is busy, so what follows queues.
    let blocker = submit(KEY_A, json!({"sleep_ms": 1000}), 0).await;
    eventually("the blocker runs", || async {
        (state(KEY_A, blocker.clone()).await == "running").then_some(())
    })
    .await;
    let bravo = submit(KEY_B, json!({"sleep_ms": 1000}), 0).await;
    let mut alpha = Vec::new();
    for _ in 0..3 {
        alpha.push(submit(KEY_A, json!({"sleep_ms": 1000}), 1_000_000).await);
    }
    // Whichever leaves the queue first is what the queue put first.
    let first = eventually("the next task starts", || async {
        if state(KEY_B, bravo.clone()).await != "pending" {
            return Some("bravo".to_string());
        }
        for id in &alpha {
            if state(KEY_A, id.clone()).await != "pending" {
                return Some(format!("alpha {id}"));
            }
        }
        None
    })
    .await;
    assert_eq!(first, "bravo", "a higher priority let alpha jump ahead");
    for id in alpha {
        eventually("alpha's tasks finish", || async {
            (state(KEY_A, id.clone()).await == "succeeded").then_some(())
        })
        .await;
    }
}
