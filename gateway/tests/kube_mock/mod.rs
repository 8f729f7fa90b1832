//! A mocked Kubernetes API server for the gateway's tests (`tower_test`):
//! it answers what the gateway asks (pods: list, watch, create, delete;
//! Secrets: get and server-side apply) as an API server would, records
//! every call, and can be made unreachable. The pods "run" on loopback,
//! where a tiny server answers their health checks.
//!
//! Nothing here has met a real API server.

#![allow(dead_code)]

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

pub type Handle = mock::Handle<Request<Body>, Response<Full<Bytes>>>;
pub type Send = mock::SendResponse<Response<Full<Bytes>>>;

pub const NS: &str = "ml";

pub fn json_response(status: StatusCode, v: &Value) -> Response<Full<Bytes>> {
    Response::builder()
        .status(status)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(v.to_string())))
        .expect("response")
}

/// Health checks of every pod, on loopback: `200 {}`.
pub async fn healthz_server() -> u16 {
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
pub struct Cluster {
    pub pods: BTreeMap<String, Value>,
    /// Secrets by name.
    pub secrets: BTreeMap<String, Value>,
    /// Watch events not yet sent: (type, pod).
    pub pending: Vec<(String, Value)>,
    pub version: u64,
    /// `POST pod-name`, `DELETE pod-name` and `PATCH secret/name`, in
    /// order.
    pub calls: Vec<String>,
    /// Unreachable: every call fails (503) until it is back.
    pub down: bool,
}

impl Cluster {
    pub fn bump(&mut self) -> String {
        self.version += 1;
        self.version.to_string()
    }
}

/// Answers the gateway's calls as an API server would, forever.
pub async fn serve(mut handle: Handle, cluster: Arc<Mutex<Cluster>>) {
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
        let secrets = format!("/api/v1/namespaces/{NS}/secrets/");
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
                    None => send.send_response(not_found()),
                }
            }
            (Method::GET, p) if p.starts_with(&secrets) => {
                let name = p.rsplit('/').next().unwrap_or("").to_string();
                match cluster.lock().secrets.get(&name) {
                    Some(s) => send.send_response(json_response(StatusCode::OK, s)),
                    None => send.send_response(not_found()),
                }
            }
            (Method::PATCH, p) if p.starts_with(&secrets) => {
                // A server-side apply by the one manager that writes it:
                // what it applies is the object's data from now on.
                let name = p.rsplit('/').next().unwrap_or("").to_string();
                let apply = req
                    .headers()
                    .get("content-type")
                    .is_some_and(|v| v == "application/apply-patch+yaml");
                let bytes = req.into_body().collect_bytes().await.expect("body");
                let patch: Value = serde_json::from_slice(&bytes).expect("a secret");
                let mut c = cluster.lock();
                c.calls.push(format!("PATCH secret/{name}"));
                if !apply || patch["metadata"]["name"] != name.as_str() {
                    c.calls.push(format!(
                        "PATCH secret/{name} (unexpected: not an apply of it)"
                    ));
                }
                // A resourceVersion in the applied object is a
                // precondition.
                let held = c
                    .secrets
                    .get(&name)
                    .map(|s| s["metadata"]["resourceVersion"].clone());
                let asked = &patch["metadata"]["resourceVersion"];
                if !asked.is_null() && held.as_ref() != Some(asked) {
                    c.calls.push(format!("PATCH secret/{name} refused: stale"));
                    send.send_response(json_response(
                        StatusCode::CONFLICT,
                        &json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                            "reason": "Conflict", "code": 409,
                            "message": "the object has been modified; please apply your changes to the latest version and try again"}),
                    ));
                    continue;
                }
                // The applied manager's fields replace its own; an apply
                // that changes nothing leaves the version as it was.
                let same = c.secrets.get(&name).is_some_and(|s| {
                    s["data"] == patch["data"]
                        && s["metadata"]["annotations"] == patch["metadata"]["annotations"]
                });
                let rv = if same { String::new() } else { c.bump() };
                let secret = c.secrets.entry(name.clone()).or_insert_with(|| {
                    json!({"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
                        "metadata": {"name": name, "namespace": NS}})
                });
                if !same {
                    secret["data"] = patch["data"].clone();
                    secret["metadata"]["annotations"] = patch["metadata"]["annotations"].clone();
                    secret["metadata"]["resourceVersion"] = json!(rv);
                }
                let secret = secret.clone();
                send.send_response(json_response(StatusCode::OK, &secret));
            }
            (m, p) => {
                cluster.lock().calls.push(format!("{m} {p} (unexpected)"));
                send.send_response(json_response(StatusCode::NOT_FOUND, &json!({})));
            }
        }
    }
}

/// Whether `app` has a ready replica.
pub fn ready(gw: &warmgate_gateway::Gateway, app: &str) -> bool {
    gw.status_report()
        .apps
        .iter()
        .find(|a| a.name == app)
        .is_some_and(|a| a.ready >= 1)
}

/// The app's pods' names, as the cluster holds them.
pub fn pods_of(cluster: &Mutex<Cluster>, app: &str) -> Vec<String> {
    cluster
        .lock()
        .pods
        .values()
        .filter(|p| p["metadata"]["labels"]["warmgate.dev/app"] == app)
        .filter_map(|p| p["metadata"]["name"].as_str().map(str::to_string))
        .collect()
}

pub async fn eventually<T>(what: &str, mut f: impl FnMut() -> Option<T>) -> T {
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
pub fn calls_about(cluster: &Mutex<Cluster>, from: usize, app: &str) -> Vec<String> {
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

fn not_found() -> Response<Full<Bytes>> {
    json_response(
        StatusCode::NOT_FOUND,
        &json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound", "code": 404}),
    )
}

/// A client whose every call `cluster` answers, by a task on the current
/// runtime.
pub fn client(cluster: &Arc<Mutex<Cluster>>) -> (kube::Client, tokio::task::JoinHandle<()>) {
    let (service, handle) = mock::pair::<Request<Body>, Response<Full<Bytes>>>();
    let server = tokio::spawn(serve(handle, cluster.clone()));
    (kube::Client::new(service, NS), server)
}

/// The calls nobody expected.
pub fn unexpected(cluster: &Mutex<Cluster>) -> Vec<String> {
    cluster
        .lock()
        .calls
        .iter()
        .filter(|c| c.contains("(unexpected"))
        .cloned()
        .collect()
}
