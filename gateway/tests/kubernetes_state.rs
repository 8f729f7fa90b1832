//! The operator's state in the API server: a leader that dies in the
//! middle of a canary leaves the revision history, the split and the
//! promotion in the cluster (the state Secret), and the next leader, with
//! an empty state folder of its own, reads them back and finishes the
//! promotion. Every call either leader makes is answered and recorded by
//! the mocked API server in `kube_mock`; nothing here has met a real one.

mod kube_mock;

use std::sync::Arc;
use std::time::Duration;

use http::StatusCode;
use kube_mock::{Cluster, NS, eventually, healthz_server, ready, unexpected};
use parking_lot::Mutex;
use serde_json::{Value, json};
use tower::ServiceExt as _;
use warmgate_deploy::Config;
use warmgate_gateway::operator::state::KubeState;
use warmgate_pool::kubernetes::{KubeBackend, KubeSettings};

const SECRET: &str = "wg-state";

/// One app `a` on `ck/v1`, its checkpoints allowed under `ck/`.
fn config(port: u16, dir: &std::path::Path, state: &str) -> Config {
    let ck = dir.join("ck");
    let text = format!(
        r#"
state_dir = "{state}"
[backend]
kind = "kubernetes"
[backend.kubernetes]
advertise = "wg.ml.svc:8080"
[weights]
allowed_prefixes = ["file://{ck}"]
[[apps]]
name = "a"
image = "registry.example/worker:1"
checkpoint = "file://{v1}"
[apps.kubernetes]
port = {port}
[apps.autoscale]
min = 1
max = 1
"#,
        state = dir.join(state).display(),
        ck = ck.display(),
        v1 = ck.join("v1").display(),
    );
    let path = dir.join(format!("{state}.toml"));
    std::fs::write(&path, text).expect("write");
    Config::load(&path).expect("a valid config")
}

/// A folder with two checkpoints, `ck/v1` and `ck/v2`.
fn checkpoints() -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("dir");
    for v in ["v1", "v2"] {
        let ck = dir.path().join("ck").join(v);
        std::fs::create_dir_all(&ck).expect("mkdir");
        std::fs::write(ck.join("model.bin"), v).expect("write");
    }
    dir
}

/// A leader: the gateway on the kubernetes backend with its state in the
/// cluster's Secret, and its own (fresh) state folder.
async fn leader(
    cluster: &Arc<Mutex<Cluster>>,
    cfg: Config,
    identity: &str,
) -> Arc<warmgate_gateway::Gateway> {
    let (client, _server) = kube_mock::client(cluster);
    let backend = Arc::new(KubeBackend::new(
        client.clone(),
        KubeSettings {
            namespace: NS.into(),
            instance: "wg".into(),
            config: cfg.backend.kubernetes.clone(),
            stop_grace: Duration::from_secs(1),
        },
    ));
    backend
        .find_previous()
        .await
        .expect("list the pods an earlier leader left");
    let state = KubeState::load(move || Ok(client), NS, SECRET, identity)
        .await
        .expect("read and claim the state Secret");
    warmgate_gateway::Gateway::with_state(
        cfg,
        backend,
        None,
        "127.0.0.1:8080".parse().expect("addr"),
        Some(Box::new(state)),
    )
    .expect("the gateway starts")
}

async fn call(
    gw: &Arc<warmgate_gateway::Gateway>,
    req: http::Request<axum::body::Body>,
) -> (StatusCode, Value) {
    let resp = warmgate_gateway::router(gw.clone())
        .oneshot(req)
        .await
        .expect("infallible");
    let status = resp.status();
    let body = axum::body::to_bytes(resp.into_body(), 1 << 20)
        .await
        .expect("body");
    (status, serde_json::from_slice(&body).unwrap_or(Value::Null))
}

async fn revisions(gw: &Arc<warmgate_gateway::Gateway>) -> Value {
    let req = http::Request::get("/v1/apps/a/revisions")
        .body(axum::body::Body::empty())
        .expect("request");
    let (status, body) = call(gw, req).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    body
}

/// The state Secret's `a.json`, as the cluster holds it.
fn stored(cluster: &Mutex<Cluster>) -> Option<Value> {
    let c = cluster.lock();
    let b64 = c.secrets.get(SECRET)?["data"]["a.json"].clone();
    let bytes: k8s_openapi::ByteString = serde_json::from_value(b64).ok()?;
    serde_json::from_slice(&bytes.0).ok()
}

/// The notes of `app`'s key in the state Secret (read without claiming it).
fn stored_notes(cluster: &Mutex<Cluster>, app: &str) -> Vec<String> {
    let c = cluster.lock();
    let raw = c.secrets[SECRET]["data"][format!("{app}.json")].clone();
    let bytes: k8s_openapi::ByteString = serde_json::from_value(raw).expect("base64");
    let v: Value = serde_json::from_slice(&bytes.0).expect("json");
    v["notes"]
        .as_array()
        .map(|n| {
            n.iter()
                .filter_map(|n| n["what"].as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default()
}

fn phase(v: &Value) -> &str {
    v["promotion"]["phase"].as_str().unwrap_or("")
}

#[test]
fn a_new_leader_reads_the_history_and_the_canary_back_from_the_cluster_and_finishes_it() {
    let driver = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    driver.block_on(async {
        let port = healthz_server().await;
        let dir = checkpoints();
        let cluster = Arc::new(Mutex::new(Cluster::default()));

        // The first leader runs on a runtime of its own, so that it can
        // die whole, every task at once, as a killed pod does.
        let first = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("runtime");
        let (c1, cfg1, ck2) = (
            cluster.clone(),
            config(port, dir.path(), "first"),
            format!("file://{}", dir.path().join("ck").join("v2").display()),
        );
        let before = first
            .spawn(async move {
                let gw = leader(&c1, cfg1, "first").await;
                eventually("a is ready", || ready(&gw, "a").then_some(())).await;
                let req = http::Request::post("/v1/apps/a/promote")
                    .header("content-type", "application/json")
                    .body(axum::body::Body::from(
                        json!({"checkpoint": ck2, "canary": 50, "bake": "3s"}).to_string(),
                    ))
                    .expect("request");
                let (status, body) = call(&gw, req).await;
                assert!(status.is_success(), "{status} {body}");
                // Canary: the new revision takes half the traffic.
                let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
                loop {
                    let r = revisions(&gw).await;
                    if phase(&r) == "canary" {
                        return r;
                    }
                    assert!(tokio::time::Instant::now() < deadline, "no canary: {r}");
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            })
            .await
            .expect("the first leader's steps");
        // It dies in the middle of the bake.
        first.shutdown_background();

        // What it left in the cluster is what it showed.
        let left = stored(&cluster).expect("the state Secret holds a.json");
        assert_eq!(left["history"]["promotion"]["to"], "a-00002", "{left}");
        assert_eq!(left["history"]["promotion"]["phase"], "canary", "{left}");
        let split: Vec<(String, u64)> = left["history"]["revisions"]
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
        assert_eq!(
            split,
            [("a-00001".to_string(), 50), ("a-00002".to_string(), 50)]
        );

        // The next leader: a fresh state folder (the dead pod's emptyDir
        // is gone), the same cluster.
        let gw = leader(&cluster, config(port, dir.path(), "second"), "second").await;
        let after = revisions(&gw).await;
        let ids = |v: &Value| -> Vec<String> {
            v["revisions"]
                .as_array()
                .map(|a| {
                    a.iter()
                        .filter_map(|r| r["id"].as_str().map(str::to_string))
                        .collect()
                })
                .unwrap_or_default()
        };
        assert_eq!(ids(&after), ids(&before), "the history was not read back");
        assert_eq!(after["promotion"]["to"], "a-00002");
        assert!(
            after["notes"].as_array().is_some_and(|n| n
                .iter()
                .any(|n| n["what"].as_str().is_some_and(|w| w.contains("a-00002")))),
            "the first leader's notes were lost: {after}"
        );
        // It carries the canary on and finishes it.
        let done = eventually("the promotion finishes under the new leader", || {
            let r = stored(&cluster)?;
            (r["history"]["promotion"]["phase"] == "done").then_some(r)
        })
        .await;
        let serving: Vec<&Value> = done["history"]["revisions"]
            .as_array()
            .expect("revisions")
            .iter()
            .filter(|r| r["traffic"].as_u64().unwrap_or(0) > 0)
            .collect();
        assert_eq!(serving.len(), 1, "{done}");
        assert_eq!(serving[0]["id"], "a-00002");
        assert_eq!(serving[0]["traffic"], 100);
        let r = revisions(&gw).await;
        assert_eq!(phase(&r), "done", "{r}");
        assert!(
            unexpected(&cluster).is_empty(),
            "{:?}",
            unexpected(&cluster)
        );
    });
    driver.shutdown_background();
}

/// The API server unreachable when a promotion would start: the step
/// cannot be written, so nothing starts and the user is told why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_the_cluster_cannot_store_is_not_taken() {
    let port = healthz_server().await;
    let dir = checkpoints();
    let cluster = Arc::new(Mutex::new(Cluster::default()));
    let gw = leader(&cluster, config(port, dir.path(), "only"), "only").await;
    eventually("a is ready", || ready(&gw, "a").then_some(())).await;
    let pods = cluster.lock().pods.len();
    cluster.lock().down = true;
    let ck2 = format!("file://{}", dir.path().join("ck").join("v2").display());
    let req = http::Request::post("/v1/apps/a/promote")
        .header("content-type", "application/json")
        .body(axum::body::Body::from(
            json!({"checkpoint": ck2, "canary": 50}).to_string(),
        ))
        .expect("request");
    let (status, body) = call(&gw, req).await;
    assert!(status.is_server_error(), "{status} {body}");
    let message = body["error"]["message"].as_str().unwrap_or("");
    assert!(message.contains(SECRET), "{body}");
    let r = revisions(&gw).await;
    assert_eq!(r["revisions"].as_array().map(Vec::len), Some(1), "{r}");
    assert_ne!(r["promotion"]["to"], "a-00002", "{r}");
    cluster.lock().down = false;
    assert_eq!(cluster.lock().pods.len(), pods, "a replica started anyway");
    let left = stored(&cluster).expect("a.json");
    assert_eq!(
        left["history"]["revisions"].as_array().map(Vec::len),
        Some(1)
    );
}

/// A deposed leader that still reaches the API server cannot write over
/// its successor, whichever writes first after the handover: the new one
/// claims the state as soon as it has read it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deposed_leader_cannot_write_over_the_next_one() {
    use warmgate_deploy::revision::History;
    use warmgate_deploy::store::StateStore as _;
    let cluster = Arc::new(Mutex::new(Cluster::default()));
    let (client, _server) = kube_mock::client(&cluster);
    let load = |who: &'static str| {
        let client = client.clone();
        async move {
            KubeState::load(move || Ok(client), NS, SECRET, who)
                .await
                .expect("load and claim")
        }
    };
    let notes = |s: &KubeState| -> Vec<String> {
        s.notes("a", 10)
            .expect("notes")
            .into_iter()
            .map(|n| n.what)
            .collect()
    };
    let old = load("old").await;
    old.save("a", &History::default(), "old 1")
        .expect("the first write");
    // The next leader reads and claims (every load claims); the old one,
    // still running,
    // writes before the new one's first step: refused.
    let new = load("new").await;
    assert_eq!(notes(&new), ["old 1"]);
    let err = old
        .save("a", &History::default(), "old 2, stale")
        .expect_err("a stale write is refused");
    assert!(err.to_string().contains("another leader"), "{err}");
    new.save("a", &History::default(), "new 1")
        .expect("the new leader writes");
    assert!(old.save("a", &History::default(), "old 3, stale").is_err());
    assert_eq!(notes(&load("reader").await), ["old 1", "new 1"]);
    {
        let c = cluster.lock();
        assert!(
            c.secrets[SECRET]["metadata"]["annotations"]["warmgate.dev/leader"]
                .as_str()
                .is_some_and(|l| l.starts_with("reader-")),
            "{}",
            c.secrets[SECRET]
        );
    }

    // Someone labels the Secret by hand (its version moves, its data does
    // not): the leader's next write goes through over the new version.
    let leader = load("leader").await;
    {
        let mut c = cluster.lock();
        let rv = c.bump();
        let s = c.secrets.get_mut(SECRET).expect("secret");
        s["metadata"]["labels"] = json!({"team": "ml"});
        s["metadata"]["resourceVersion"] = json!(rv);
    }
    leader
        .save("a", &History::default(), "after a label")
        .expect("a metadata change does not lock the leader out");
    assert_eq!(
        stored_notes(&cluster, "a"),
        ["old 1", "new 1", "after a label"]
    );

    // Someone fixes the data by hand (here: drops an app's key, as the
    // docs say to do with one this version cannot read): the leader's
    // next write builds on it instead of writing the old bytes back.
    leader
        .save("b", &History::default(), "b 1")
        .expect("b is stored");
    {
        let mut c = cluster.lock();
        let rv = c.bump();
        let s = c.secrets.get_mut(SECRET).expect("secret");
        s["data"].as_object_mut().expect("data").remove("b.json");
        s["metadata"]["resourceVersion"] = json!(rv);
    }
    leader
        .save("a", &History::default(), "after a hand edit")
        .expect("a hand edit does not lock the leader out");
    let after = load("reader 3").await;
    assert_eq!(after.notes("b", 10).expect("notes").len(), 0, "b came back");
    assert_eq!(
        notes(&after).last().map(String::as_str),
        Some("after a hand edit")
    );
}

/// Apps come and go as their resources do: one added is stored beside
/// the others, and a deleted one's state leaves the shared Secret once its
/// replicas have stopped (the Secret is bounded, and app names come and
/// go).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn apps_added_and_deleted_come_and_go_from_the_secret() {
    let port = healthz_server().await;
    let dir = checkpoints();
    let cluster = Arc::new(Mutex::new(Cluster::default()));
    let cfg = config(port, dir.path(), "only");
    let gw = leader(&cluster, cfg.clone(), "only").await;
    eventually("a is ready", || ready(&gw, "a").then_some(())).await;
    assert!(stored(&cluster).is_some(), "a's state is in the Secret");
    // b is added, as a new ServingApp is.
    let mut with_b = cfg.clone();
    let mut b = with_b.apps[0].clone();
    b.name = "b".into();
    with_b.apps.push(b);
    let changed = gw.changes().apply_file(with_b).await;
    assert!(changed.iter().all(|c| c.outcome.is_ok()), "{changed:?}");
    eventually("b is ready", || ready(&gw, "b").then_some(())).await;
    assert!(
        cluster.lock().secrets[SECRET]["data"]
            .get("b.json")
            .is_some(),
        "b's state is in the Secret"
    );
    // Both are deleted.
    let mut without = cfg;
    without.apps.clear();
    let changed = gw.changes().apply_file(without).await;
    assert!(changed.iter().all(|c| c.outcome.is_ok()), "{changed:?}");
    eventually("a's and b's keys leave the Secret", || {
        let c = cluster.lock();
        let data = &c.secrets.get(SECRET)?["data"];
        (data.get("a.json").is_none() && data.get("b.json").is_none()).then_some(())
    })
    .await;
    assert!(
        unexpected(&cluster).is_empty(),
        "{:?}",
        unexpected(&cluster)
    );
}

/// An app whose key in the Secret is unreadable is left out, the others
/// are not; once the key is fixed by hand (here: removed), the app's next
/// try reads the Secret again and starts it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreadable_key_fixed_by_hand_is_read_again_at_the_app_s_next_try() {
    let port = healthz_server().await;
    let dir = checkpoints();
    let cluster = Arc::new(Mutex::new(Cluster::default()));
    {
        let mut c = cluster.lock();
        let rv = c.bump();
        c.secrets.insert(
            SECRET.into(),
            json!({"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
                "metadata": {"name": SECRET, "namespace": NS, "resourceVersion": rv},
                // "not json"
                "data": {"a.json": "bm90IGpzb24="}}),
        );
    }
    let cfg = config(port, dir.path(), "fixed");
    let gw = leader(&cluster, cfg.clone(), "fixed").await;
    assert!(
        !gw.status_report().apps.iter().any(|a| a.name == "a"),
        "an app whose state cannot be read does not start"
    );
    // Still unreadable: the next try is refused with the key named.
    let tried = gw.changes().apply_file(cfg.clone()).await;
    let a = tried.iter().find(|c| c.name == "a").expect("a was tried");
    let why = a.outcome.as_ref().expect_err("refused").message.clone();
    assert!(why.contains("a.json"), "{why}");

    // Fixed by hand: the key removed.
    {
        let mut c = cluster.lock();
        let rv = c.bump();
        let s = c.secrets.get_mut(SECRET).expect("the Secret");
        s["data"] = json!({});
        s["metadata"]["resourceVersion"] = json!(rv);
    }
    let tried = gw.changes().apply_file(cfg).await;
    let a = tried.iter().find(|c| c.name == "a").expect("a was tried");
    assert!(a.outcome.is_ok(), "{a}");
    eventually("a is ready", || ready(&gw, "a").then_some(())).await;
    let left = stored(&cluster).expect("a.json written again");
    assert_eq!(
        left["history"]["revisions"].as_array().map(Vec::len),
        Some(1)
    );
}
