//! The gateway on the Kubernetes backend against a mocked API server
//! (`tower_test`): a change to one app (as the operator applies a changed
//! `ServingApp`), a new app, and a deleted app touch only their own pods.
//! Every call the gateway makes is answered and recorded here; the pods
//! "run" on loopback, where a tiny server answers their health checks.
//!
//! Nothing here has met a real API server: the mock answers as one would
//! for what the gateway asks (list, watch, create, delete, patch).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::Full;
use kube::client::Body;
use parking_lot::Mutex;
use serde_json::{Value, json};
use tower_test::mock;
use warmgate_deploy::Config;
use warmgate_pool::kubernetes::{KubeBackend, KubeSettings};

type Handle = mock::Handle<Request<Body>, Response<Full<Bytes>>>;
type Send = mock::SendResponse<Response<Full<Bytes>>>;

const NS: &str = "ml";

fn json_response(status: StatusCode, v: &Value) -> Response<Full<Bytes>> {
    Response::builder()
        .status(status)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(v.to_string())))
        .expect("response")
}

/// Health checks of every pod, on loopback: `200 {}`.
async fn healthz_server() -> u16 {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let l = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let port = l.local_addr().expect("addr").port();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            tokio::spawn(async move {
                let mut buf = [0u8; 4096];
                let _ = s.read(&mut buf).await;
                let _ = s
                    .write_all(
                        b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\n{}",
                    )
                    .await;
            });
        }
    });
    port
}

/// What the fake API server holds and has been asked.
#[derive(Default)]
struct Cluster {
    pods: BTreeMap<String, Value>,
    /// Watch events not yet sent: (type, pod).
    pending: Vec<(String, Value)>,
    version: u64,
    /// `POST pod-name` and `DELETE pod-name`, in order.
    calls: Vec<String>,
    /// Unreachable: every call fails (503) until it is back.
    down: bool,
}

impl Cluster {
    fn bump(&mut self) -> String {
        self.version += 1;
        self.version.to_string()
    }
}

/// Answers the gateway's calls as an API server would, forever.
async fn serve(mut handle: Handle, cluster: Arc<Mutex<Cluster>>) {
    let mut watches: Vec<Send> = Vec::new();
    loop {
        // Events for whoever watches, once there are some.
        let events = std::mem::take(&mut cluster.lock().pending);
        if !events.is_empty() && !watches.is_empty() {
            let mut text = String::new();
            for (kind, obj) in &events {
                text.push_str(&json!({"type": kind, "object": obj}).to_string());
                text.push('\n');
            }
            for w in watches.drain(..) {
                w.send_response(
                    Response::builder()
                        .status(StatusCode::OK)
                        .body(Full::new(Bytes::from(text.clone())))
                        .expect("response"),
                );
            }
        } else {
            cluster.lock().pending.extend(events);
        }
        let next = tokio::time::timeout(Duration::from_millis(20), handle.next_request()).await;
        let Ok(Some((req, send))) = next else {
            if matches!(next, Ok(None)) {
                return;
            }
            continue;
        };
        let path = req.uri().path().to_string();
        let watch = req.uri().query().unwrap_or("").contains("watch=true");
        let method = req.method().clone();
        if cluster.lock().down {
            send.send_response(json_response(
                StatusCode::SERVICE_UNAVAILABLE,
                &json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "ServiceUnavailable", "code": 503}),
            ));
            continue;
        }
        let pods = format!("/api/v1/namespaces/{NS}/pods");
        match (method, path.as_str()) {
            (Method::GET, p) if p == pods && watch => watches.push(send),
            (Method::GET, p) if p == pods => {
                let mut c = cluster.lock();
                let rv = c.bump();
                let items: Vec<Value> = c.pods.values().cloned().collect();
                send.send_response(json_response(
                    StatusCode::OK,
                    &json!({"apiVersion": "v1", "kind": "PodList", "metadata": {"resourceVersion": rv}, "items": items}),
                ));
            }
            (Method::POST, p) if p == pods => {
                let bytes = req.into_body().collect_bytes().await.expect("body");
                let mut pod: Value = serde_json::from_slice(&bytes).expect("a pod");
                let name = pod["metadata"]["name"].as_str().unwrap_or("").to_string();
                let mut c = cluster.lock();
                c.calls.push(format!("POST {name}"));
                pod["metadata"]["resourceVersion"] = json!(c.bump());
                pod["metadata"]["uid"] = json!(format!("uid-{name}"));
                send.send_response(json_response(StatusCode::CREATED, &pod));
                // Scheduled, started and ready at once, on loopback.
                let mut running = pod.clone();
                running["metadata"]["resourceVersion"] = json!(c.bump());
                running["status"] = json!({"phase": "Running", "podIP": "127.0.0.1",
                    "conditions": [{"type": "Ready", "status": "True"}]});
                c.pods.insert(name, running.clone());
                c.pending.push(("MODIFIED".into(), running));
            }
            (Method::DELETE, p) if p.starts_with(&format!("{pods}/")) => {
                let name = p.rsplit('/').next().unwrap_or("").to_string();
                let mut c = cluster.lock();
                c.calls.push(format!("DELETE {name}"));
                match c.pods.remove(&name) {
                    Some(mut pod) => {
                        pod["metadata"]["resourceVersion"] = json!(c.bump());
                        send.send_response(json_response(StatusCode::OK, &pod));
                        c.pending.push(("DELETED".into(), pod));
                    }
                    None => send.send_response(json_response(
                        StatusCode::NOT_FOUND,
                        &json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound", "code": 404}),
                    )),
                }
            }
            (m, p) => {
                cluster.lock().calls.push(format!("{m} {p} (unexpected)"));
                send.send_response(json_response(StatusCode::NOT_FOUND, &json!({})));
            }
        }
    }
}

fn config(port: u16, state: &std::path::Path, apps: &[(&str, &str)]) -> Config {
    let mut text = format!(
        "state_dir = \"{}\"\n[backend]\nkind = \"kubernetes\"\n[backend.kubernetes]\nadvertise = \"wg.ml.svc:8080\"\n",
        state.display()
    );
    for (name, generation) in apps {
        text.push_str(&format!(
            "[[apps]]\nname = \"{name}\"\nimage = \"registry.example/worker:1\"\nenv = {{ GENERATION = \"{generation}\" }}\n[apps.kubernetes]\nport = {port}\n[apps.autoscale]\nmin = 1\nmax = 1\n"
        ));
    }
    let path = state.join("warmgate.toml");
    std::fs::create_dir_all(state).expect("mkdir");
    std::fs::write(&path, text).expect("write");
    Config::load(&path).expect("a valid config")
}

/// A gateway on the kubernetes backend, its mocked cluster, and the
/// loopback server its pods' health checks reach.
struct Scene {
    gw: Arc<warmgate_gateway::Gateway>,
    cluster: Arc<Mutex<Cluster>>,
    server: tokio::task::JoinHandle<()>,
    port: u16,
    state: std::path::PathBuf,
    _dir: tempfile::TempDir,
}

impl Scene {
    /// Serves `apps` (name, generation) from a fresh state folder.
    async fn start(apps: &[(&str, &str)]) -> Scene {
        let port = healthz_server().await;
        let dir = tempfile::tempdir().expect("dir");
        let state = dir.path().join("state");
        let (service, handle) = mock::pair::<Request<Body>, Response<Full<Bytes>>>();
        let cluster = Arc::new(Mutex::new(Cluster::default()));
        let server = tokio::spawn(serve(handle, cluster.clone()));
        let client = kube::Client::new(service, NS);
        let cfg = config(port, &state, apps);
        let backend = Arc::new(KubeBackend::new(
            client,
            KubeSettings {
                namespace: NS.into(),
                instance: "wg".into(),
                config: cfg.backend.kubernetes.clone(),
                stop_grace: Duration::from_secs(1),
            },
        ));
        let gw = warmgate_gateway::Gateway::new(
            cfg,
            backend,
            None,
            "127.0.0.1:8080".parse().expect("addr"),
        )
        .expect("the gateway starts");
        Scene {
            gw,
            cluster,
            server,
            port,
            state,
            _dir: dir,
        }
    }
}

/// Whether `app` has a ready replica.
fn ready(gw: &warmgate_gateway::Gateway, app: &str) -> bool {
    gw.status_report()
        .apps
        .iter()
        .find(|a| a.name == app)
        .is_some_and(|a| a.ready >= 1)
}

/// The app's pods' names, as the cluster holds them.
fn pods_of(cluster: &Mutex<Cluster>, app: &str) -> Vec<String> {
    cluster
        .lock()
        .pods
        .values()
        .filter(|p| p["metadata"]["labels"]["warmgate.dev/app"] == app)
        .filter_map(|p| p["metadata"]["name"].as_str().map(str::to_string))
        .collect()
}

async fn eventually<T>(what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(tokio::time::Instant::now() < deadline, "timed out: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The calls made about an app's pods since `from`.
fn calls_about(cluster: &Mutex<Cluster>, from: usize, app: &str) -> Vec<String> {
    cluster.lock().calls[from..]
        .iter()
        .filter(|c| {
            c.split(' ')
                .nth(1)
                .is_some_and(|n| n.starts_with(&format!("{app}-")))
        })
        .cloned()
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn changing_one_app_leaves_every_other_app_s_pods_untouched() {
    let Scene {
        gw,
        cluster,
        server,
        port,
        state,
        _dir,
    } = Scene::start(&[("a", "1"), ("b", "1")]).await;
    eventually("a and b are ready", || {
        (ready(&gw, "a") && ready(&gw, "b")).then_some(())
    })
    .await;
    let a_pods = pods_of(&cluster, "a");
    assert_eq!(a_pods.len(), 1);

    // b's spec changes (a new environment): b rolls to a new pod, a is
    // not touched.
    let mark = cluster.lock().calls.len();
    let changed = gw
        .apply_file(config(port, &state, &[("a", "1"), ("b", "2")]))
        .await;
    assert!(changed.iter().all(|c| c.outcome.is_ok()), "{changed:?}");
    eventually("b runs on a new pod", || {
        let b = pods_of(&cluster, "b");
        (b.len() == 1 && b[0].starts_with("b-00002-")).then_some(())
    })
    .await;
    let b_calls = calls_about(&cluster, mark, "b");
    assert!(
        b_calls.iter().any(|c| c.starts_with("POST b-00002-")),
        "{b_calls:?}"
    );
    assert!(
        b_calls.iter().any(|c| c.starts_with("DELETE b-00001-")),
        "{b_calls:?}"
    );

    // A new app c: its pod only.
    let added = gw
        .apply_file(config(port, &state, &[("a", "1"), ("b", "2"), ("c", "1")]))
        .await;
    assert!(added.iter().all(|c| c.outcome.is_ok()), "{added:?}");
    eventually("c is ready", || ready(&gw, "c").then_some(())).await;
    // c deleted again: its pod goes, nothing else.
    let gone = gw
        .apply_file(config(port, &state, &[("a", "1"), ("b", "2")]))
        .await;
    assert!(gone.iter().all(|c| c.outcome.is_ok()), "{gone:?}");
    eventually("c's pod is deleted", || {
        pods_of(&cluster, "c").is_empty().then_some(())
    })
    .await;

    // Through all of it, a's pod was neither deleted nor made again.
    assert!(
        calls_about(&cluster, mark, "a").is_empty(),
        "a was touched: {:?}",
        calls_about(&cluster, mark, "a")
    );
    assert_eq!(pods_of(&cluster, "a"), a_pods);
    let unexpected: Vec<String> = cluster
        .lock()
        .calls
        .iter()
        .filter(|c| c.ends_with("(unexpected)"))
        .cloned()
        .collect();
    assert!(unexpected.is_empty(), "{unexpected:?}");
    server.abort();
}

/// The API server goes away: requests keep flowing to the pods already
/// known, nothing is deleted, and a change made meanwhile is carried out
/// once it is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn traffic_flows_while_the_api_server_is_unreachable_and_changes_catch_up() {
    use tower::ServiceExt as _;
    let Scene {
        gw,
        cluster,
        server,
        port,
        state,
        _dir,
    } = Scene::start(&[("a", "1")]).await;
    eventually("a is ready", || ready(&gw, "a").then_some(())).await;
    let router = warmgate_gateway::router(gw.clone());
    let get = |router: axum::Router| async move {
        let req = http::Request::get("/apps/a/x")
            .body(axum::body::Body::empty())
            .expect("request");
        router.oneshot(req).await.expect("infallible").status()
    };

    cluster.lock().down = true;
    let mark = cluster.lock().calls.len();
    // Meanwhile an app is added: its pod cannot be made yet.
    let added = gw
        .apply_file(config(port, &state, &[("a", "1"), ("c", "1")]))
        .await;
    assert!(added.iter().all(|c| c.outcome.is_ok()), "{added:?}");
    for _ in 0..200 {
        assert_eq!(
            get(router.clone()).await,
            StatusCode::OK,
            "a stops serving while the API is down"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(ready(&gw, "a"), "a's pod is still known");
    assert!(!ready(&gw, "c"));
    assert!(
        cluster.lock().calls[mark..]
            .iter()
            .all(|c| !c.starts_with("DELETE")),
        "{:?}",
        cluster.lock().calls
    );

    // Back: c's pod is made (the pool manager tries again), a untouched.
    cluster.lock().down = false;
    eventually("c is ready once the API is back", || {
        ready(&gw, "c").then_some(())
    })
    .await;
    assert_eq!(get(router.clone()).await, StatusCode::OK);
    assert!(
        calls_about(&cluster, mark, "a").is_empty(),
        "{:?}",
        cluster.lock().calls
    );
    server.abort();
}
