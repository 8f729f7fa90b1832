//! Who may open and read checkpoints: URIs outside the allowed prefixes
//! are refused before anything is opened, `/v1/weights` answers only the
//! workers' own tokens and the admin token, symlinks out of a checkpoint
//! are not followed, and a revision that is gone is no longer served.

mod common;

use std::path::Path;

use common::{Gateway, eventually, kind};
use serde_json::{Value, json};

const ADMIN: &str = "admin-token-for-weights-4b1d";
const TENANT_KEY: &str = "wg-tenant-key-weights-0a9e";

/// A one-file checkpoint folder; returns its `file://` URI.
fn checkpoint(root: &Path, name: &str) -> String {
    let dir = root.join(name);
    std::fs::create_dir_all(&dir).expect("mkdir");
    std::fs::write(dir.join("model.bin"), name.repeat(100)).expect("write");
    format!("file://{}", dir.display())
}

async fn get(gw: &Gateway, path: &str, bearer: Option<&str>) -> (u16, Value) {
    let mut r = gw.http.get(gw.at(path));
    if let Some(b) = bearer {
        r = r.bearer_auth(b);
    }
    let r = r.send().await.expect("send");
    (r.status().as_u16(), r.json().await.unwrap_or(Value::Null))
}

async fn post(gw: &Gateway, path: &str, body: Value) -> (u16, Value) {
    let r = gw
        .http
        .post(gw.at(path))
        .bearer_auth(ADMIN)
        .json(&body)
        .send()
        .await
        .expect("send");
    (r.status().as_u16(), r.json().await.unwrap_or(Value::Null))
}

fn message(body: &Value) -> String {
    body["error"]["message"]
        .as_str()
        .unwrap_or_default()
        .to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn checkpoint_uris_outside_the_allowed_prefixes_are_refused_before_opening() {
    let root = tempfile::tempdir().expect("dir");
    let v1 = checkpoint(root.path(), "v1");
    let p0 = checkpoint(root.path(), "p0");
    let _sibling = checkpoint(root.path(), "v1-other");
    let _secret = checkpoint(root.path(), "secret");
    let watch = root.path().join("watch");
    let c1 = checkpoint(&watch, "c1");
    let gw = Gateway::start_with(
        &format!(
            r#"
            [[apps]]
            name = "m"
            command = ["{{worker}}"]
            checkpoint = "{v1}"
            [apps.autoscale]
            min = 0
            [apps.promotion]
            watch = "file://{}"
            watch_interval = "1h"
            [[pools]]
            name = "p"
            command = ["{{worker}}"]
            checkpoint = "{p0}"
            replicas = [0, 1]
            "#,
            watch.display()
        ),
        &[],
        &[("WARMGATE_ADMIN_TOKEN", ADMIN)],
    );
    let root_uri = format!("file://{}", root.path().display());
    for bad in [
        "file:///etc/passwd".to_string(),
        format!("{v1}/../secret"),
        format!("{v1}/%2e%2e/secret"),
        format!("{v1}-other"),
        format!("{root_uri}/secret"),
        "s3://some-bucket/checkpoints".to_string(),
    ] {
        let (status, body) = post(&gw, "/v1/apps/m/promote", json!({"checkpoint": bad})).await;
        assert_eq!(status, 400, "{bad}: {body}");
        assert_eq!(kind(&body), "bad_request");
        let m = message(&body);
        assert!(m.contains("allowed") && m.contains(&v1), "{bad}: {m}");
    }
    // An HTTP store is never contacted unless it is listed.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    listener.set_nonblocking(true).expect("nonblocking");
    let internal = format!(
        "http://{}/internal/admin",
        listener.local_addr().expect("addr")
    );
    let (status, body) = post(
        &gw,
        "/v1/pools/p/weights",
        json!({"checkpoint": internal, "version": 1}),
    )
    .await;
    assert_eq!(status, 400, "{body}");
    assert!(message(&body).contains("allowed"), "{body}");
    let (status, body) = post(&gw, "/v1/apps/m/promote", json!({"checkpoint": internal})).await;
    assert_eq!(status, 400, "{body}");
    assert!(
        matches!(listener.accept(), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock),
        "the gateway connected to {internal}"
    );
    // Under the watch prefix and under a configured checkpoint is fine.
    let (status, body) = post(&gw, "/v1/apps/m/promote", json!({"checkpoint": c1})).await;
    assert_eq!(status, 202, "{body}");
    let (status, body) = post(
        &gw,
        "/v1/pools/p/weights",
        json!({"checkpoint": p0, "version": 1}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn weights_need_the_workers_token_or_the_admin_token() {
    let root = tempfile::tempdir().expect("dir");
    let v1 = checkpoint(root.path(), "v1");
    let outside = root.path().join("outside.bin");
    std::fs::write(&outside, "not part of the checkpoint").expect("write");
    std::os::unix::fs::symlink(&outside, root.path().join("v1/link.bin")).expect("symlink");
    let gw = Gateway::start_with(
        &format!(
            r#"
            [[apps]]
            name = "m"
            command = ["{{worker}}"]
            checkpoint = "{v1}"
            [apps.autoscale]
            min = 1
            [[tenants]]
            name = "team"
            api_key_env = "TEST_WEIGHTS_TENANT_KEY"
            "#
        ),
        &[],
        &[
            ("WARMGATE_ADMIN_TOKEN", ADMIN),
            ("TEST_WEIGHTS_TENANT_KEY", TENANT_KEY),
        ],
    );
    // The worker loads its weights with its own token: it becomes ready.
    eventually("the worker is ready", || async {
        let (status, s) = get(&gw, "/v1/status", Some(ADMIN)).await;
        (status == 200 && s["apps"][0]["ready"] == 1).then_some(())
    })
    .await;
    let manifest = "/v1/weights/m/m-00001";
    let file = "/v1/weights/m/m-00001/model.bin";
    for path in [manifest, file] {
        for bearer in [None, Some(TENANT_KEY), Some("wrong"), Some(&ADMIN[1..])] {
            let (status, body) = get(&gw, path, bearer).await;
            assert_eq!(status, 401, "{path} with {bearer:?}: {body}");
            assert_eq!(kind(&body), "unauthorized");
        }
    }
    let (status, body) = get(&gw, manifest, Some(ADMIN)).await;
    assert_eq!(status, 200, "{body}");
    let names: Vec<&str> = body["files"]
        .as_array()
        .expect("files")
        .iter()
        .filter_map(|f| f["name"].as_str())
        .collect();
    assert_eq!(
        names,
        ["model.bin"],
        "a symlink out of the checkpoint is not listed"
    );
    let r = gw
        .http
        .get(gw.at(file))
        .bearer_auth(ADMIN)
        .send()
        .await
        .expect("send");
    assert_eq!(r.status(), 200);
    assert_eq!(r.text().await.expect("body"), "v1".repeat(100));
    let (status, _) = get(&gw, "/v1/weights/m/m-00001/link.bin", Some(ADMIN)).await;
    assert_eq!(status, 404, "a symlink out of the checkpoint is not served");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replaced_revision_is_no_longer_served() {
    let root = tempfile::tempdir().expect("dir");
    let v1 = checkpoint(root.path(), "v1");
    let v2 = checkpoint(root.path(), "v2");
    let gw = Gateway::start_with(
        &format!(
            r#"
            [[apps]]
            name = "m"
            command = ["{{worker}}"]
            checkpoint = "{v1}"
            [apps.autoscale]
            min = 1
            [apps.promotion]
            watch = "file://{}"
            watch_interval = "1h"
            "#,
            root.path().display()
        ),
        &[],
        &[("WARMGATE_ADMIN_TOKEN", ADMIN)],
    );
    let (status, _) = get(&gw, "/v1/weights/m/m-00001", Some(ADMIN)).await;
    assert_eq!(status, 200);
    let (status, body) = post(
        &gw,
        "/v1/apps/m/promote",
        json!({"checkpoint": v2, "wait": true}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["promotion"]["phase"], "done", "{body}");
    let (status, _) = get(&gw, "/v1/weights/m/m-00002", Some(ADMIN)).await;
    assert_eq!(status, 200);
    let (status, body) = get(&gw, "/v1/weights/m/m-00001", Some(ADMIN)).await;
    assert_eq!(status, 404, "the replaced revision is still served: {body}");
    // A rollback serves it again.
    let (status, body) = post(&gw, "/v1/apps/m/rollback", json!({})).await;
    assert_eq!(status, 200, "{body}");
    eventually("m-00001 serves again", || async {
        let (_, s) = get(&gw, "/v1/status", Some(ADMIN)).await;
        let app = &s["apps"][0];
        (app["revision"] == "m-00001" && app["ready"] == 1).then_some(())
    })
    .await;
    let (status, _) = get(&gw, "/v1/weights/m/m-00001", Some(ADMIN)).await;
    assert_eq!(status, 200);
}

/// Each ready replica of app `m`: `(id, pid)`.
async fn ready_replicas(gw: &Gateway) -> Vec<(String, i32)> {
    let (_, s) = get(gw, "/v1/status", Some(ADMIN)).await;
    s["apps"][0]["pool"]["replicas"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|r| r["state"] == "ready")
        .filter_map(|r| Some((r["id"].as_str()?.to_string(), r["pid"].as_i64()? as i32)))
        .collect()
}

/// The `WARMGATE_WEIGHTS_TOKEN` in a worker's environment.
fn weights_token(pid: i32) -> String {
    let raw = std::fs::read(format!("/proc/{pid}/environ")).expect("read environ");
    raw.split(|b| *b == 0)
        .filter_map(|v| std::str::from_utf8(v).ok())
        .find_map(|v| v.strip_prefix("WARMGATE_WEIGHTS_TOKEN="))
        .expect("the worker has a weights token")
        .to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_replica_has_its_own_weights_token_which_ends_with_it() {
    let root = tempfile::tempdir().expect("dir");
    let v1 = checkpoint(root.path(), "v1");
    let gw = Gateway::start_with(
        &format!(
            r#"
            [[apps]]
            name = "m"
            command = ["{{worker}}"]
            checkpoint = "{v1}"
            [apps.autoscale]
            min = 2
            max = 2
            "#
        ),
        &[],
        &[("WARMGATE_ADMIN_TOKEN", ADMIN)],
    );
    let first = eventually("two ready replicas", || async {
        let r = ready_replicas(&gw).await;
        (r.len() == 2).then_some(r)
    })
    .await;
    let tokens: Vec<String> = first.iter().map(|(_, pid)| weights_token(*pid)).collect();
    assert_ne!(tokens[0], tokens[1], "each replica has its own token");
    let manifest = "/v1/weights/m/m-00001";
    for t in &tokens {
        let (status, body) = get(&gw, manifest, Some(t)).await;
        assert_eq!(status, 200, "{body}");
    }
    // One replica dies: its token dies with it, the other's still reads.
    let (dead_id, dead_pid) = first[0].clone();
    let _ = nix::sys::signal::killpg(
        nix::unistd::Pid::from_raw(dead_pid),
        nix::sys::signal::Signal::SIGKILL,
    );
    eventually("the dead replica is replaced", || async {
        let r = ready_replicas(&gw).await;
        (r.len() == 2 && r.iter().all(|(id, _)| *id != dead_id)).then_some(())
    })
    .await;
    let (status, body) = get(&gw, manifest, Some(&tokens[0])).await;
    assert_eq!(status, 401, "the dead replica's token is revoked: {body}");
    let (status, body) = get(&gw, manifest, Some(&tokens[1])).await;
    assert_eq!(status, 200, "the live replica's token still reads: {body}");
}

/// The attack of issue 40: a checkpoint folder swapped for a symlink to
/// elsewhere after it was checked, and symlinks planted in it after it was
/// listed. The gateway keeps reading the folder it checked, from the
/// descriptor it holds, and serves nothing outside it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_checkpoint_swapped_for_a_symlink_or_given_one_later_serves_nothing_outside() {
    let root = tempfile::tempdir().expect("dir");
    let ck = root.path().join("ck");
    let v6 = checkpoint(&ck, "v6");
    std::fs::write(ck.join("v6/extra.bin"), "extra").expect("write");
    let secret = root.path().join("secret");
    std::fs::create_dir_all(&secret).expect("mkdir");
    std::fs::write(secret.join("shadow"), "root:SECRET-HASH").expect("write");
    std::fs::write(secret.join("model.bin"), "SECRET-MODEL").expect("write");
    // No replica reads the checkpoint: its listing is made on first read,
    // after the swap.
    let gw = Gateway::start_with(
        &format!(
            r#"
            [[apps]]
            name = "m"
            command = ["{{worker}}"]
            checkpoint = "{v6}"
            [apps.autoscale]
            min = 0
            "#
        ),
        &[],
        &[("WARMGATE_ADMIN_TOKEN", ADMIN)],
    );
    let v6_dir = ck.join("v6");
    std::fs::rename(&v6_dir, ck.join("v6.real")).expect("mv");
    std::os::unix::fs::symlink(&secret, &v6_dir).expect("ln -s");
    let manifest = "/v1/weights/m/m-00001";
    let (status, body) = get(&gw, manifest, Some(ADMIN)).await;
    assert_eq!(status, 200, "{body}");
    let names: Vec<&str> = body["files"]
        .as_array()
        .expect("files")
        .iter()
        .filter_map(|f| f["name"].as_str())
        .collect();
    assert_eq!(
        names,
        ["extra.bin", "model.bin"],
        "the swapped-in folder is listed: {body}"
    );
    let read = |name: &'static str| {
        let gw = &gw;
        async move {
            // A refused read may end before its headers (the body fails
            // on its first chunk, and the connection closes) or after.
            let r = match gw
                .http
                .get(gw.at(&format!("{manifest}/{name}")))
                .bearer_auth(ADMIN)
                .send()
                .await
            {
                Ok(r) => r,
                Err(e) => return (0, format!("the answer failed: {e}")),
            };
            let status = r.status().as_u16();
            match r.text().await {
                Ok(text) => (status, text),
                // The body ended with an error, never a clean end.
                Err(e) => (0, format!("the body failed: {e}")),
            }
        }
    };
    let (status, text) = read("model.bin").await;
    assert_eq!((status, text.as_str()), (200, "v6".repeat(100).as_str()));
    let (status, text) = read("shadow").await;
    assert_eq!(status, 404, "{text}");
    // A symlink planted in the checked folder after listing, and a listed
    // file not read yet replaced by one: neither leads out. (A file read
    // once is served from the cache's verified copy.)
    let real = ck.join("v6.real");
    std::os::unix::fs::symlink(secret.join("shadow"), real.join("late.bin")).expect("ln -s");
    let (status, text) = read("late.bin").await;
    assert_eq!(status, 404, "{text}");
    std::fs::remove_file(real.join("extra.bin")).expect("rm");
    std::os::unix::fs::symlink(secret.join("model.bin"), real.join("extra.bin")).expect("ln -s");
    let (status, text) = read("extra.bin").await;
    assert!(!text.contains("SECRET"), "{status}: {text}");
    assert!(
        status == 0 || status >= 400,
        "a replaced file is refused: {status} {text}"
    );
}
