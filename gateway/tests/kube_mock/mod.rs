//! A mocked Kubernetes API server for the gateway's tests (`tower_test`):
//! it answers what the gateway asks (pods: list, watch, create, delete;
//! Secrets: get and server-side apply; `ServingApp`s and `WarmPool`s:
//! list, watch and status merge patches; Events: create) as an API server
//! would, records
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
    worker_server(Arc::new(tokio::sync::Notify::new())).await
}

/// A worker on loopback for every pod: it answers `200 {}` at once, but a
/// request whose path has `slow` only once `release` is notified.
pub async fn worker_server(release: Arc<tokio::sync::Notify>) -> u16 {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let l = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let port = l.local_addr().expect("addr").port();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            let release = release.clone();
            tokio::spawn(async move {
                let mut buf = vec![0u8; 8192];
                let n = s.read(&mut buf).await.unwrap_or(0);
                let head = String::from_utf8_lossy(&buf[..n]).to_string();
                if head.lines().next().is_some_and(|l| l.contains("slow")) {
                    release.notified().await;
                }
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

/// The operator's settings for a test: its state folder, the kubernetes
/// backend.
pub fn operator_base(state: &std::path::Path) -> warmgate_deploy::Config {
    let path = state.join("warmgate.toml");
    std::fs::create_dir_all(state).expect("mkdir");
    std::fs::write(
        &path,
        format!(
            "state_dir = \"{}\"\n[backend]\nkind = \"kubernetes\"\n[backend.kubernetes]\nadvertise = \"wg.ml.svc:8080\"\n",
            state.display()
        ),
    )
    .expect("write");
    warmgate_deploy::Config::load(&path).expect("a valid config")
}

/// A leader's gateway on the resources `cluster` holds, as the operator
/// starts it, and its reconcile loop; with the task answering the API
/// calls.
pub fn leader_on(
    cluster: &Arc<Mutex<Cluster>>,
    state: &std::path::Path,
) -> (
    Arc<warmgate_gateway::Gateway>,
    tokio::task::JoinHandle<()>,
    tokio::task::JoinHandle<()>,
) {
    let (client, server) = client(cluster);
    let apps: Vec<warmgate_deploy::crd::ServingApp> = cluster
        .lock()
        .resources
        .values()
        .map(|v| serde_json::from_value(v.clone()).expect("a ServingApp"))
        .collect();
    let (config, refused) =
        warmgate_gateway::operator::config_from(operator_base(state), &apps, &[]).expect("valid");
    assert!(refused.is_empty(), "{refused:?}");
    let backend = Arc::new(warmgate_pool::kubernetes::KubeBackend::new(
        client.clone(),
        warmgate_pool::kubernetes::KubeSettings {
            namespace: NS.into(),
            instance: "wg".into(),
            config: config.backend.kubernetes.clone(),
            stop_grace: Duration::from_secs(1),
        },
    ));
    let gw = warmgate_gateway::Gateway::new(
        config,
        backend.clone(),
        None,
        "127.0.0.1:8080".parse().expect("addr"),
    )
    .expect("the gateway starts");
    let reconciling = tokio::spawn({
        let gw = gw.clone();
        async move {
            warmgate_gateway::operator::reconcile_into(gw, backend, client, NS).await;
        }
    });
    (gw, reconciling, server)
}

/// What the fake API server holds and has been asked.
#[derive(Default)]
pub struct Cluster {
    pub pods: BTreeMap<String, Value>,
    /// Secrets by name.
    pub secrets: BTreeMap<String, Value>,
    /// Watch events not yet sent: (type, object), a pod or a resource.
    pub pending: Vec<(String, Value)>,
    /// `ServingApp`s and `WarmPool`s, by (plural, name).
    pub resources: BTreeMap<(String, String), Value>,
    /// Events created: (reason, the object's name).
    pub events: Vec<(String, String)>,
    /// The events as created (and counted since), by name.
    pub event_objects: BTreeMap<String, Value>,
    pub version: u64,
    /// `POST pod-name`, `DELETE pod-name` and `PATCH secret/name`, in
    /// order.
    pub calls: Vec<String>,
    /// Unreachable: every call fails (503) until it is back.
    pub down: bool,
    /// Pod IPs handed out in turn, one per pod created (so each pod can
    /// be a process of its own on a loopback address); none: every pod
    /// is on `127.0.0.1`.
    pub pod_ips: Vec<String>,
    /// Pods created so far.
    pub created: usize,
}

impl Cluster {
    pub fn bump(&mut self) -> String {
        self.version += 1;
        self.version.to_string()
    }

    /// Creates or replaces a `ServingApp` (`servingapps`) or `WarmPool`
    /// (`warmpools`) spec, as `kubectl apply` would: a changed spec bumps
    /// the generation, and watchers are told.
    pub fn put_resource(&mut self, plural: &str, name: &str, spec: Value) {
        let rv = self.bump();
        let key = (plural.to_string(), name.to_string());
        let kind = if plural == "servingapps" {
            "ServingApp"
        } else {
            "WarmPool"
        };
        let (event, obj) = match self.resources.get_mut(&key) {
            Some(obj) => {
                if obj["spec"] != spec {
                    let g = obj["metadata"]["generation"].as_i64().unwrap_or(1) + 1;
                    obj["metadata"]["generation"] = json!(g);
                    obj["spec"] = spec;
                }
                obj["metadata"]["resourceVersion"] = json!(rv);
                ("MODIFIED", obj.clone())
            }
            None => {
                let obj = json!({
                    "apiVersion": "warmgate.dev/v1alpha1", "kind": kind,
                    "metadata": {"name": name, "namespace": NS, "uid": format!("uid-{plural}-{name}"),
                        "generation": 1, "resourceVersion": rv},
                    "spec": spec,
                });
                self.resources.insert(key, obj.clone());
                ("ADDED", obj)
            }
        };
        self.pending.push((event.into(), obj));
    }

    /// Deletes a resource; watchers are told.
    pub fn delete_resource(&mut self, plural: &str, name: &str) {
        if let Some(mut obj) = self
            .resources
            .remove(&(plural.to_string(), name.to_string()))
        {
            obj["metadata"]["resourceVersion"] = json!(self.bump());
            self.pending.push(("DELETED".into(), obj));
        }
    }

    /// The status a resource holds.
    pub fn status_of(&self, plural: &str, name: &str) -> Value {
        self.resources
            .get(&(plural.to_string(), name.to_string()))
            .map(|o| o["status"].clone())
            .unwrap_or(Value::Null)
    }
}

/// The collection a watch event belongs to.
fn collection_of(obj: &Value) -> String {
    match obj["kind"].as_str() {
        Some("ServingApp") => format!("{CRDS}/servingapps"),
        Some("WarmPool") => format!("{CRDS}/warmpools"),
        _ => format!("/api/v1/namespaces/{NS}/pods"),
    }
}

/// Where the namespace's resources are.
const CRDS: &str = "/apis/warmgate.dev/v1alpha1/namespaces/ml";

/// JSON merge patch (RFC 7386) of `patch` onto `target`.
fn merge(target: &mut Value, patch: &Value) {
    match (target.as_object_mut(), patch.as_object()) {
        (Some(t), Some(p)) => {
            for (k, v) in p {
                if v.is_null() {
                    t.remove(k);
                } else {
                    merge(t.entry(k.clone()).or_insert(Value::Null), v);
                }
            }
        }
        _ => *target = patch.clone(),
    }
}

/// Answers the gateway's calls as an API server would, forever.
pub async fn serve(mut handle: Handle, cluster: Arc<Mutex<Cluster>>) {
    // Open watches, by the collection they watch.
    let mut watches: Vec<(String, Send)> = Vec::new();
    loop {
        // Events for whoever watches their collection, once there are
        // some; the others wait for a watcher.
        let events = std::mem::take(&mut cluster.lock().pending);
        let mut by_collection: BTreeMap<String, Vec<(String, Value)>> = BTreeMap::new();
        for e in events {
            by_collection
                .entry(collection_of(&e.1))
                .or_default()
                .push(e);
        }
        for (collection, events) in by_collection {
            if !watches.iter().any(|(c, _)| *c == collection) {
                cluster.lock().pending.extend(events);
                continue;
            }
            let mut text = String::new();
            for (kind, obj) in &events {
                text.push_str(&json!({"type": kind, "object": obj}).to_string());
                text.push('\n');
            }
            let (now, later): (Vec<_>, Vec<_>) = std::mem::take(&mut watches)
                .into_iter()
                .partition(|(c, _)| *c == collection);
            watches = later;
            for (_, w) in now {
                w.send_response(
                    Response::builder()
                        .status(StatusCode::OK)
                        .body(Full::new(Bytes::from(text.clone())))
                        .expect("response"),
                );
            }
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
        let resource = ["servingapps", "warmpools"]
            .into_iter()
            .find(|r| path.starts_with(&format!("{CRDS}/{r}")));
        if let Some(plural) = resource {
            answer_resource(
                &cluster,
                plural,
                method,
                &path,
                watch,
                req,
                send,
                &mut watches,
            )
            .await;
            continue;
        }
        if method == Method::POST && path == "/apis/events.k8s.io/v1/namespaces/ml/events" {
            let bytes = req.into_body().collect_bytes().await.expect("body");
            let ev: Value = serde_json::from_slice(&bytes).expect("an event");
            let reason = ev["reason"].as_str().unwrap_or("").to_string();
            let about = ev["regarding"]["name"].as_str().unwrap_or("").to_string();
            let mut c = cluster.lock();
            c.events.push((reason, about));
            let name = ev["metadata"]["name"].as_str().unwrap_or("").to_string();
            c.event_objects.insert(name, ev.clone());
            send.send_response(json_response(StatusCode::CREATED, &ev));
            continue;
        }
        // A repeated event: the recorder counts it in the event's series.
        if method == Method::PATCH
            && let Some(name) = path.strip_prefix("/apis/events.k8s.io/v1/namespaces/ml/events/")
        {
            let name = name.to_string();
            let bytes = req.into_body().collect_bytes().await.expect("body");
            let patch: Value = serde_json::from_slice(&bytes).expect("a patch");
            let mut c = cluster.lock();
            match c.event_objects.get_mut(&name) {
                Some(ev) => {
                    merge(ev, &patch);
                    let ev = ev.clone();
                    send.send_response(json_response(StatusCode::OK, &ev));
                }
                None => send.send_response(not_found()),
            }
            continue;
        }
        match (method, path.as_str()) {
            (Method::GET, p) if p == pods && watch => watches.push((p.to_string(), send)),
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
                let ip = if c.pod_ips.is_empty() {
                    "127.0.0.1".to_string()
                } else {
                    c.pod_ips[c.created % c.pod_ips.len()].clone()
                };
                c.created += 1;
                running["status"] = json!({"phase": "Running", "podIP": ip,
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

/// Answers a call about `ServingApp`s or `WarmPool`s: a list, a watch
/// (held until there are events), or a merge patch of one's status.
#[allow(clippy::too_many_arguments)]
async fn answer_resource(
    cluster: &Mutex<Cluster>,
    plural: &str,
    method: Method,
    path: &str,
    watch: bool,
    req: Request<Body>,
    send: Send,
    watches: &mut Vec<(String, Send)>,
) {
    let collection = format!("{CRDS}/{plural}");
    let rest = path.strip_prefix(&collection).unwrap_or("");
    match (method, rest) {
        (Method::GET, "") if watch => watches.push((collection, send)),
        (Method::GET, "") => {
            let mut c = cluster.lock();
            let rv = c.bump();
            let items: Vec<Value> = c
                .resources
                .iter()
                .filter(|((p, _), _)| p == plural)
                .map(|(_, v)| v.clone())
                .collect();
            send.send_response(json_response(
                StatusCode::OK,
                &json!({"apiVersion": "warmgate.dev/v1alpha1", "kind": "List", "metadata": {"resourceVersion": rv}, "items": items}),
            ));
        }
        (Method::PATCH, r) if r.ends_with("/status") => {
            let name = r
                .trim_start_matches('/')
                .trim_end_matches("/status")
                .to_string();
            let bytes = req.into_body().collect_bytes().await.expect("body");
            let patch: Value = serde_json::from_slice(&bytes).expect("a patch");
            let mut c = cluster.lock();
            c.calls.push(format!("PATCH {plural}/{name}/status"));
            let rv = c.bump();
            match c.resources.get_mut(&(plural.to_string(), name)) {
                Some(obj) => {
                    merge(obj, &patch);
                    obj["metadata"]["resourceVersion"] = json!(rv);
                    let obj = obj.clone();
                    send.send_response(json_response(StatusCode::OK, &obj));
                    c.pending.push(("MODIFIED".into(), obj));
                }
                None => send.send_response(not_found()),
            }
        }
        (m, p) => {
            cluster
                .lock()
                .calls
                .push(format!("{m} {plural}{p} (unexpected)"));
            send.send_response(json_response(StatusCode::NOT_FOUND, &json!({})));
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

/// Asserts that `app` got no pod call since `from` and holds `pods` still,
/// and that nobody made a call the mock did not expect.
pub fn assert_untouched(cluster: &Mutex<Cluster>, from: usize, app: &str, pods: &[String]) {
    let calls = calls_about(cluster, from, app);
    assert!(calls.is_empty(), "{app} was touched: {calls:?}");
    assert_eq!(pods_of(cluster, app), pods);
    let odd = unexpected(cluster);
    assert!(odd.is_empty(), "{odd:?}");
}
