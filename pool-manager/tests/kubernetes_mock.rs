//! The kubernetes backend against a mock API server (`tower_test`): a
//! scenario verifier answers each call the backend makes and checks it,
//! so every request is pinned down: the created pod field by field, the
//! pod watch, the deletion on scale-down, and eviction.

use std::collections::BTreeMap;
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::Full;
use k8s_openapi::api::core::v1::Pod;
use kube::client::Body;
use serde_json::{Value, json};
use tower_test::mock;
use warmgate_deploy::{KubeBackendConfig, PodSpec, Toleration};
use warmgate_pool::kubernetes::{KubeBackend, KubeSettings, PodError, pod_for};
use warmgate_pool::{Backend, Launch};

type Handle = mock::Handle<Request<Body>, Response<Full<Bytes>>>;

const NS: &str = "ml";
const SELECTOR: &str = "app.kubernetes.io/managed-by=warmgate,warmgate.dev/instance=wg";

fn settings() -> KubeSettings {
    KubeSettings {
        namespace: NS.into(),
        instance: "wg".into(),
        config: KubeBackendConfig {
            spot_tolerations: vec![Toleration {
                key: Some("cloud.google.com/gke-spot".into()),
                operator: Some("Exists".into()),
                effect: Some("NoSchedule".into()),
                value: None,
            }],
            ..KubeBackendConfig::default()
        },
        stop_grace: Duration::from_secs(30),
    }
}

fn launch(replica: &str) -> Launch {
    Launch {
        replica: replica.into(),
        target: "llm".into(),
        revision: "llm-00002".into(),
        command: vec![],
        env: BTreeMap::from([("HF_HOME".to_string(), "/cache".to_string())]),
        gpus: vec![],
        workdir: None,
        checkpoint: Some("s3://ckpt/llm/step-900".into()),
        image: Some("registry.example/llm-worker:1.4".into()),
        pod: PodSpec {
            gpu_type: Some("NVIDIA-H100-80GB-HBM3".into()),
            cpu: Some("8".into()),
            memory: Some("64Gi".into()),
            interruptible: true,
            ..PodSpec::default()
        },
        gpu_count: 2,
        pool: false,
        health: warmgate_deploy::HealthSpec {
            path: "/v2/health/ready".into(),
            period: Duration::from_secs(5),
            timeout: Duration::from_millis(1500),
            failure_threshold: 4,
            ..warmgate_deploy::HealthSpec::default()
        },
        listen: Default::default(),
        startup_timeout: Duration::from_secs(600),
    }
}

fn json_response(status: StatusCode, v: &Value) -> Response<Full<Bytes>> {
    Response::builder()
        .status(status)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(v.to_string())))
        .expect("response")
}

async fn body_json(req: Request<Body>) -> Value {
    let bytes = req.into_body().collect_bytes().await.expect("body");
    serde_json::from_slice(&bytes).unwrap_or(Value::Null)
}

/// The next call, which must be `method` on a path starting with `path`.
async fn expect(
    handle: &mut Handle,
    method: Method,
    path: &str,
) -> (Request<Body>, mock::SendResponse<Response<Full<Bytes>>>) {
    let (req, send) = tokio::time::timeout(Duration::from_secs(10), handle.next_request())
        .await
        .unwrap_or_else(|_| panic!("no {method} {path} within 10s"))
        .expect("the client is alive");
    assert_eq!(req.method(), method, "{}", req.uri());
    assert!(
        req.uri().path().starts_with(path),
        "expected {method} {path}, got {} {}",
        req.method(),
        req.uri()
    );
    (req, send)
}

/// The backend's first calls, in whichever order they come: the watcher
/// lists (no pods) and watches; the backend creates `replica`'s pod, which
/// must be exactly the pod `pod_for` builds. Returns the created pod and
/// the open watch, to be answered when the scenario needs an event.
async fn create_and_watch(
    handle: &mut Handle,
    replica: &str,
) -> (Value, mock::SendResponse<Response<Full<Bytes>>>) {
    // The watcher lists, then watches; the backend creates the pod. The
    // two run concurrently, so take the calls in either order.
    let mut created: Option<Value> = None;
    let mut watch = None;
    let mut listed = false;
    while created.is_none() || watch.is_none() {
        let (req, send) = tokio::time::timeout(Duration::from_secs(10), handle.next_request())
            .await
            .expect("a call")
            .expect("alive");
        let q = req.uri().query().unwrap_or("").to_string();
        match (req.method().clone(), q.contains("watch=true")) {
            (Method::POST, _) => {
                assert_eq!(req.uri().path(), format!("/api/v1/namespaces/{NS}/pods"));
                let body = body_json(req).await;
                // The pod sent is the one pod_for builds, field by field.
                let want = serde_json::to_value(
                    pod_for(&launch(replica), &settings(), None).expect("pod"),
                )
                .expect("json");
                assert_eq!(body, want);
                assert_locked_down(&body);
                let mut echo = body.clone();
                echo["metadata"]["uid"] = json!("u-1");
                echo["metadata"]["resourceVersion"] = json!("11");
                send.send_response(json_response(StatusCode::CREATED, &echo));
                created = Some(echo);
            }
            (Method::GET, false) => {
                assert!(
                    q.contains(&format!("labelSelector={}", urlencode(SELECTOR))),
                    "{q}"
                );
                send.send_response(json_response(
                    StatusCode::OK,
                    &json!({"apiVersion": "v1", "kind": "PodList", "metadata": {"resourceVersion": "10"}, "items": []}),
                ));
                listed = true;
            }
            (Method::GET, true) => {
                assert!(listed, "the watch follows the list");
                assert!(q.contains("resourceVersion=10"), "{q}");
                watch = Some(send);
            }
            (m, _) => panic!("unexpected {m} {}", req.uri()),
        }
    }
    (created.expect("created"), watch.expect("watch"))
}

/// A worker pod holds no API token, cannot gain privileges, holds no
/// capability and runs under the default seccomp profile.
fn assert_locked_down(pod: &Value) {
    let spec = &pod["spec"];
    assert_eq!(spec["automountServiceAccountToken"], false, "{spec}");
    assert_eq!(
        spec["securityContext"]["seccompProfile"]["type"], "RuntimeDefault",
        "{spec}"
    );
    for c in spec["containers"].as_array().expect("containers") {
        let sc = &c["securityContext"];
        assert_eq!(sc["allowPrivilegeEscalation"], false, "{sc}");
        assert_eq!(sc["privileged"], false, "{sc}");
        assert_eq!(sc["capabilities"]["drop"], json!(["ALL"]), "{sc}");
        assert!(sc["capabilities"].get("add").is_none(), "{sc}");
    }
}

fn urlencode(s: &str) -> String {
    s.replace('/', "%2F")
        .replace('=', "%3D")
        .replace(',', "%2C")
}

/// A watch answer carrying these events, one JSON object a line.
fn watch_events(events: &[(&str, Value)]) -> Response<Full<Bytes>> {
    let mut text = String::new();
    for (kind, obj) in events {
        text.push_str(&json!({"type": kind, "object": obj}).to_string());
        text.push('\n');
    }
    Response::builder()
        .status(StatusCode::OK)
        .body(Full::new(Bytes::from(text)))
        .expect("response")
}

/// `pod` with a status patched in, and a resource version.
fn with_status(pod: &Value, rv: u32, status: Value) -> Value {
    let mut p = pod.clone();
    p["metadata"]["resourceVersion"] = json!(rv.to_string());
    p["status"] = status;
    p
}

#[test]
fn the_pod_carries_the_worker_contract_gpus_placement_and_labels() {
    let owner = k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference {
        api_version: "warmgate.dev/v1alpha1".into(),
        kind: "ServingApp".into(),
        name: "llm".into(),
        uid: "6f1c".into(),
        controller: Some(true),
        ..Default::default()
    };
    let pod = pod_for(&launch("llm-00002-1"), &settings(), Some(owner)).expect("pod");
    let v = serde_json::to_value(&pod).expect("json");
    let m = &v["metadata"];
    assert_eq!(m["name"], "llm-00002-1");
    assert_eq!(m["namespace"], NS);
    assert_eq!(m["labels"]["app.kubernetes.io/managed-by"], "warmgate");
    assert_eq!(m["labels"]["warmgate.dev/instance"], "wg");
    assert_eq!(m["labels"]["warmgate.dev/app"], "llm");
    assert_eq!(m["labels"]["warmgate.dev/revision"], "llm-00002");
    assert_eq!(m["labels"]["warmgate.dev/replica"], "llm-00002-1");
    assert!(m["labels"].get("warmgate.dev/pool").is_none());
    assert_eq!(m["ownerReferences"][0]["kind"], "ServingApp");
    assert_eq!(m["ownerReferences"][0]["uid"], "6f1c");
    let spec = &v["spec"];
    assert_eq!(spec["restartPolicy"], "Never");
    assert_eq!(spec["terminationGracePeriodSeconds"], 30);
    assert_eq!(
        spec["nodeSelector"]["nvidia.com/gpu.product"],
        "NVIDIA-H100-80GB-HBM3"
    );
    assert_eq!(
        spec["nodeSelector"]["karpenter.sh/capacity-type"], "spot",
        "interruptible"
    );
    let tolerations = spec["tolerations"].as_array().expect("tolerations");
    assert!(
        tolerations
            .iter()
            .any(|t| t["key"] == "cloud.google.com/gke-spot")
    );
    assert!(
        tolerations
            .iter()
            .any(|t| t["key"] == "nvidia.com/gpu" && t["operator"] == "Exists")
    );
    let c = &spec["containers"][0];
    assert_eq!(c["image"], "registry.example/llm-worker:1.4");
    assert!(c.get("command").is_none(), "the image's entrypoint runs");
    for (r, q) in [("nvidia.com/gpu", "2"), ("cpu", "8"), ("memory", "64Gi")] {
        assert_eq!(c["resources"]["limits"][r], q, "{r} limit");
        assert_eq!(c["resources"]["requests"][r], q, "{r} request");
    }
    assert_eq!(c["ports"][0]["containerPort"], 8080);
    // The probes are the spec's: Triton's path, its period, timeout and
    // threshold; the startup probe gives the worker its startup_timeout.
    let ready = &c["readinessProbe"];
    assert_eq!(ready["httpGet"]["path"], "/v2/health/ready");
    assert_eq!(ready["httpGet"]["port"], 8080);
    assert_eq!(
        (
            &ready["periodSeconds"],
            &ready["timeoutSeconds"],
            &ready["failureThreshold"]
        ),
        (&json!(5), &json!(2), &json!(4))
    );
    let startup = &c["startupProbe"];
    assert_eq!(startup["httpGet"]["path"], "/v2/health/ready");
    assert_eq!(
        startup["periodSeconds"].as_i64().unwrap_or(0)
            * startup["failureThreshold"].as_i64().unwrap_or(0),
        600,
        "{startup}"
    );
    let env: BTreeMap<String, String> = c["env"]
        .as_array()
        .expect("env")
        .iter()
        .map(|e| {
            (
                e["name"].as_str().unwrap_or("").to_string(),
                e["value"].as_str().unwrap_or("").to_string(),
            )
        })
        .collect();
    assert_eq!(env["PORT"], "8080");
    assert_eq!(env["WARMGATE_REPLICA"], "llm-00002-1");
    assert_eq!(env["WARMGATE_TARGET"], "llm");
    assert_eq!(env["WARMGATE_REVISION"], "llm-00002");
    assert_eq!(env["WARMGATE_CHECKPOINT"], "s3://ckpt/llm/step-900");
    assert_eq!(env["HF_HOME"], "/cache");
    assert!(
        !env.contains_key("CUDA_VISIBLE_DEVICES"),
        "the device plugin sets it"
    );
    assert_locked_down(&v);
    assert!(
        v["spec"]["securityContext"].get("runAsNonRoot").is_none(),
        "model-server images commonly run as root"
    );
    assert!(v["spec"].get("serviceAccountName").is_none());
    // It deserialises as a Pod, as the API server would read it.
    let _: Pod = serde_json::from_value(v).expect("a valid Pod");

    // Non-root when the operator's settings ask for it.
    let mut strict = settings();
    strict.config.run_as_non_root = true;
    let v = serde_json::to_value(pod_for(&launch("llm-00002-1"), &strict, None).expect("pod"))
        .expect("json");
    assert_eq!(v["spec"]["securityContext"]["runAsNonRoot"], true);

    // A pool's pod, without GPUs or spot: no GPU toleration or selector.
    let mut l = launch("rollouts-1");
    l.pool = true;
    l.target = "rollouts".into();
    l.gpu_count = 0;
    l.pod = PodSpec::default();
    let v = serde_json::to_value(pod_for(&l, &settings(), None).expect("pod")).expect("json");
    assert_eq!(v["metadata"]["labels"]["warmgate.dev/pool"], "rollouts");
    assert!(v["spec"].get("nodeSelector").is_none());
    assert!(v["spec"].get("tolerations").is_none());
    assert!(v["spec"]["containers"][0].get("resources").is_none());
    // No image: a clear error, no pod.
    l.image = None;
    assert!(pod_for(&l, &settings(), None).unwrap_err() == PodError::NoImage);
}

#[test]
fn a_service_account_is_used_only_when_the_settings_allow_it() {
    let mut l = launch("llm-00002-1");
    l.pod.service_account = Some("warmgate".into());
    let err = pod_for(&l, &settings(), None)
        .map_err(|e| e.to_string())
        .expect_err("not allowed");
    assert!(err.contains("allowed_service_accounts"), "{err}");
    let mut allowing = settings();
    allowing.config.allowed_service_accounts = vec!["llm-reader".into()];
    assert!(
        pod_for(&l, &allowing, None).is_err(),
        "only the listed ones"
    );
    l.pod.service_account = Some("llm-reader".into());
    let v = serde_json::to_value(pod_for(&l, &allowing, None).expect("allowed")).expect("json");
    assert_eq!(v["spec"]["serviceAccountName"], "llm-reader");
    assert_eq!(
        v["spec"]["automountServiceAccountToken"], false,
        "a workload-identity account needs no API token in the pod"
    );
}

#[tokio::test]
async fn a_pod_with_a_service_account_not_allowed_is_never_created() {
    let (service, mut handle) = mock::pair::<Request<Body>, Response<Full<Bytes>>>();
    let client = kube::Client::new(service, NS);
    let backend = KubeBackend::new(client, settings());
    let mut l = launch("llm-00002-1");
    l.pod.service_account = Some("warmgate".into());
    let err = backend.spawn(&l).await.err().expect("refused");
    assert!(
        err.to_string().contains("allowed_service_accounts"),
        "{err}"
    );
    // The only calls made are the watcher's: no pod is created.
    let (req, send) = tokio::time::timeout(Duration::from_secs(10), handle.next_request())
        .await
        .expect("the watcher lists")
        .expect("alive");
    assert_eq!(req.method(), Method::GET, "{}", req.uri());
    drop(send);
}

#[tokio::test]
async fn a_pod_is_created_becomes_routable_on_a_watch_event_and_is_deleted_on_scale_down() {
    let (service, mut handle) = mock::pair::<Request<Body>, Response<Full<Bytes>>>();
    let client = kube::Client::new(service, NS);
    let backend = KubeBackend::new(client, settings());
    let spawn = tokio::spawn(async move {
        let p = backend.spawn(&launch("llm-00002-1")).await;
        (backend, p)
    });

    let (pod, watch) = create_and_watch(&mut handle, "llm-00002-1").await;
    // Scheduled and running with an IP: the replica becomes reachable.
    let running = with_status(
        &pod,
        12,
        json!({
            "phase": "Running", "podIP": "10.4.2.17",
            "conditions": [{"type": "PodScheduled", "status": "True"}, {"type": "Ready", "status": "True"}]
        }),
    );
    watch.send_response(watch_events(&[("MODIFIED", running)]));
    let (backend, proc) = tokio::time::timeout(Duration::from_secs(10), spawn)
        .await
        .expect("spawn returns once the pod has an IP")
        .expect("join");
    let mut proc = proc.expect("spawned");
    assert_eq!(proc.addr().to_string(), "10.4.2.17:8080");
    assert_eq!(proc.log(), format!("kubectl logs -n {NS} pod/llm-00002-1"));
    assert!(backend.view("llm-00002-1").expect("view").ready);

    // Scale-down: after draining, the pod is deleted with the grace period.
    let (_, send) = list_or_watch(&mut handle).await;
    proc.terminate();
    let (req, del) = expect(
        &mut handle,
        Method::DELETE,
        &format!("/api/v1/namespaces/{NS}/pods/llm-00002-1"),
    )
    .await;
    let body = body_json(req).await;
    assert_eq!(body["gracePeriodSeconds"], 30, "{body}");
    del.send_response(json_response(StatusCode::OK, &pod));
    // The watch reports it gone: the replica's exit.
    send.send_response(watch_events(&[(
        "DELETED",
        with_status(&pod, 13, json!({"phase": "Running", "podIP": "10.4.2.17"})),
    )]));
    let how = tokio::time::timeout(Duration::from_secs(10), proc.wait())
        .await
        .expect("exit seen");
    assert_eq!(how, "was deleted");
    drop(proc);
}

/// The watcher's next call after a watch answer ends: a new WATCH.
async fn list_or_watch(
    handle: &mut Handle,
) -> (Request<Body>, mock::SendResponse<Response<Full<Bytes>>>) {
    let (req, send) = expect(
        handle,
        Method::GET,
        &format!("/api/v1/namespaces/{NS}/pods"),
    )
    .await;
    let q = req.uri().query().unwrap_or("").to_string();
    assert!(q.contains("watch=true"), "the watch resumes: {q}");
    (req, send)
}

#[tokio::test]
async fn unschedulable_pods_report_the_scheduler_and_evictions_end_the_replica() {
    let (service, mut handle) = mock::pair::<Request<Body>, Response<Full<Bytes>>>();
    let client = kube::Client::new(service, NS);
    let backend = std::sync::Arc::new(KubeBackend::new(client, settings()));
    let b = backend.clone();
    let spawn = tokio::spawn(async move { b.spawn(&launch("llm-00002-2")).await });
    let (pod, watch) = create_and_watch(&mut handle, "llm-00002-2").await;

    // No GPU free: the pod stays pending, with the scheduler's reason.
    let reason = "0/4 nodes are available: 4 Insufficient nvidia.com/gpu.";
    watch.send_response(watch_events(&[(
        "MODIFIED",
        with_status(&pod, 12, json!({"phase": "Pending", "conditions": [
            {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": reason}
        ]})),
    )]));
    let (_, watch) = list_or_watch(&mut handle).await;
    assert_eq!(
        backend.pending_reason("llm-00002-2").as_deref(),
        Some(reason)
    );
    assert!(
        !spawn.is_finished(),
        "an unschedulable pod does not fail the replica"
    );

    // A node frees up: it runs. Then the kubelet evicts it.
    watch.send_response(watch_events(&[(
        "MODIFIED",
        with_status(
            &pod,
            13,
            json!({"phase": "Running", "podIP": "10.4.3.9", "conditions": [
                {"type": "PodScheduled", "status": "True"}, {"type": "Ready", "status": "True"}
            ]}),
        ),
    )]));
    let mut proc = tokio::time::timeout(Duration::from_secs(10), spawn)
        .await
        .expect("spawned")
        .expect("join")
        .expect("ok");
    assert_eq!(backend.pending_reason("llm-00002-2"), None);
    let (_, watch) = list_or_watch(&mut handle).await;
    watch.send_response(watch_events(&[(
        "MODIFIED",
        with_status(
            &pod,
            14,
            json!({"phase": "Failed", "reason": "Evicted",
            "message": "The node was low on resource: memory."}),
        ),
    )]));
    let how = tokio::time::timeout(Duration::from_secs(10), proc.wait())
        .await
        .expect("exit seen");
    assert_eq!(how, "was evicted: The node was low on resource: memory.");
    // The ended pod object is cleaned up at once (no grace: it is dead).
    drop(proc);
    let (req, del) = loop {
        let (req, send) = tokio::time::timeout(Duration::from_secs(10), handle.next_request())
            .await
            .expect("a call")
            .expect("alive");
        if req.method() == Method::DELETE {
            break (req, send);
        }
        // A resumed watch: leave it open.
        assert!(
            req.uri().query().unwrap_or("").contains("watch=true"),
            "{}",
            req.uri()
        );
        std::mem::forget(send);
    };
    assert_eq!(
        req.uri().path(),
        format!("/api/v1/namespaces/{NS}/pods/llm-00002-2")
    );
    assert_eq!(body_json(req).await["gracePeriodSeconds"], 0);
    del.send_response(json_response(StatusCode::OK, &pod));
}

/// A gateway that stops leading leaves its pods for the next leader: a
/// replica stopped (or dropped) then ends here at once, and no pod is
/// deleted; the next call the API server sees is the next create.
#[tokio::test]
async fn a_leader_that_steps_down_leaves_its_pods_running() {
    let (service, mut handle) = mock::pair::<Request<Body>, Response<Full<Bytes>>>();
    let client = kube::Client::new(service, NS);
    let backend = std::sync::Arc::new(KubeBackend::new(client, settings()));
    let b = backend.clone();
    let spawn = tokio::spawn(async move { b.spawn(&launch("llm-00001-1")).await });
    let (pod, watch) = create_and_watch(&mut handle, "llm-00001-1").await;
    watch.send_response(watch_events(&[(
        "MODIFIED",
        with_status(
            &pod,
            12,
            json!({"phase": "Running", "podIP": "10.4.3.7", "conditions": [
                {"type": "PodScheduled", "status": "True"}, {"type": "Ready", "status": "True"}
            ]}),
        ),
    )]));
    let mut proc = tokio::time::timeout(Duration::from_secs(10), spawn)
        .await
        .expect("spawned")
        .expect("join")
        .expect("ok");
    backend.leave_pods();
    proc.terminate();
    let how = tokio::time::timeout(Duration::from_secs(10), proc.wait())
        .await
        .expect("ends at once");
    assert_eq!(how, "was left running for the next leader");
    proc.kill();
    drop(proc);
    // The next create is the next call: no DELETE came before it.
    let b = backend.clone();
    let _next = tokio::spawn(async move { b.spawn(&launch("llm-00001-2")).await });
    loop {
        let (req, send) = tokio::time::timeout(Duration::from_secs(10), handle.next_request())
            .await
            .expect("a call")
            .expect("alive");
        assert_ne!(req.method(), Method::DELETE, "{}", req.uri());
        if req.method() == Method::POST {
            assert_eq!(req.uri().path(), format!("/api/v1/namespaces/{NS}/pods"));
            break;
        }
        // A resumed watch: leave it open.
        std::mem::forget(send);
    }
}

#[test]
fn a_container_held_back_by_its_image_or_a_secret_says_why() {
    let pod = |status: Value| -> Pod {
        serde_json::from_value(json!({"metadata": {"name": "x"}, "status": status})).expect("pod")
    };
    let waiting = |status| warmgate_pool::kubernetes::view_of(&pod(status)).waiting;
    let container = |state: Value| {
        json!({"phase": "Pending", "podIP": "10.4.3.9", "containerStatuses": [
            {"name": "worker", "image": "r/w:typo", "imageID": "", "ready": false,
             "restartCount": 0, "state": state}
        ]})
    };
    assert_eq!(
        waiting(container(json!({"waiting": {"reason": "ImagePullBackOff",
            "message": "Back-off pulling image \"r/w:typo\""}})))
        .as_deref(),
        Some("container worker is waiting: ImagePullBackOff: Back-off pulling image \"r/w:typo\"")
    );
    assert_eq!(
        waiting(container(
            json!({"waiting": {"reason": "CreateContainerConfigError",
            "message": "secret \"hf-token\" not found"}})
        ))
        .as_deref(),
        Some(
            "container worker is waiting: CreateContainerConfigError: secret \"hf-token\" not found"
        )
    );
    // Its ordinary start is no reason to report.
    assert_eq!(
        waiting(container(
            json!({"waiting": {"reason": "ContainerCreating"}})
        )),
        None
    );
    assert_eq!(waiting(container(json!({"running": {}}))), None);
    assert_eq!(waiting(json!({"phase": "Pending"})), None);
}

#[test]
fn preemption_and_node_loss_are_named_as_disruptions() {
    let pod = |status: Value| -> Pod {
        serde_json::from_value(json!({"metadata": {"name": "x"}, "status": status})).expect("pod")
    };
    let ended = |status| warmgate_pool::kubernetes::ended_of(&pod(status));
    assert_eq!(
        ended(json!({"phase": "Running", "conditions": [{"type": "DisruptionTarget", "status": "True", "reason": "PreemptionByScheduler", "message": "Preempted by a higher priority pod"}]})).as_deref(),
        Some("was preempted by the scheduler: Preempted by a higher priority pod")
    );
    assert_eq!(
        ended(json!({"phase": "Running", "conditions": [{"type": "DisruptionTarget", "status": "True", "reason": "DeletionByTaintManager"}]})).as_deref(),
        Some("lost its node (taint eviction)")
    );
    assert_eq!(
        ended(json!({"phase": "Unknown", "reason": "NodeLost"})).as_deref(),
        Some("lost its node")
    );
    assert_eq!(
        ended(json!({"phase": "Failed", "containerStatuses": [{"name": "worker", "image": "i", "imageID": "", "ready": false, "restartCount": 0,
            "state": {"terminated": {"exitCode": 137, "reason": "OOMKilled"}}}]})).as_deref(),
        Some("exited with status 137 (OOMKilled)")
    );
    assert_eq!(ended(json!({"phase": "Running"})), None);
}

#[test]
fn the_command_takes_its_port_and_variables_without_a_shell() {
    let mut l = launch("llm-00002-1");
    l.command = [
        "vllm",
        "serve",
        "${MODEL}",
        "--port",
        "$PORT",
        "--served-model-name=$WARMGATE_TARGET",
    ]
    .map(String::from)
    .to_vec();
    l.env.insert("MODEL".into(), "Qwen/Qwen2.5-0.5B".into());
    let v = serde_json::to_value(pod_for(&l, &settings(), None).expect("pod")).expect("json");
    assert_eq!(
        v["spec"]["containers"][0]["command"],
        json!([
            "vllm",
            "serve",
            "Qwen/Qwen2.5-0.5B",
            "--port",
            "8080",
            "--served-model-name=llm"
        ])
    );
    l.command = vec!["serve".into(), "--model".into(), "$MODLE".into()];
    let err = pod_for(&l, &settings(), None)
        .map_err(|e| e.to_string())
        .expect_err("an unset variable");
    assert!(err.contains("$MODLE"), "{err}");
}

#[test]
fn a_pod_reads_allowed_secrets_pulls_with_them_and_gets_a_memory_backed_shm() {
    let mut l = launch("llm-00002-3");
    l.pod.secret_env = BTreeMap::from([(
        "HF_TOKEN".to_string(),
        warmgate_deploy::SecretKey {
            secret: "hf".into(),
            key: "token".into(),
        },
    )]);
    l.pod.env_from_secrets = vec!["s3-credentials".into()];
    l.pod.image_pull_secrets = vec!["registry".into()];
    let mut s = settings();
    // A secret the operator does not allow is never read into a pod.
    let err = pod_for(&l, &s, None)
        .map_err(|e| e.to_string())
        .expect_err("not allowed");
    assert!(err.contains("allowed_secrets"), "{err}");
    s.config.allowed_secrets = vec!["hf".into(), "s3-credentials".into(), "registry".into()];
    let pod = pod_for(&l, &s, None).expect("pod");
    let v = serde_json::to_value(&pod).expect("json");
    let c = &v["spec"]["containers"][0];
    let hf = c["env"]
        .as_array()
        .expect("env")
        .iter()
        .find(|e| e["name"] == "HF_TOKEN")
        .expect("HF_TOKEN");
    assert!(hf.get("value").is_none(), "never the value itself: {hf}");
    assert_eq!(hf["valueFrom"]["secretKeyRef"]["name"], "hf");
    assert_eq!(hf["valueFrom"]["secretKeyRef"]["key"], "token");
    assert_eq!(c["envFrom"][0]["secretRef"]["name"], "s3-credentials");
    assert_eq!(v["spec"]["imagePullSecrets"][0]["name"], "registry");
    // Two GPUs: a memory-backed /dev/shm, and the security context holds.
    assert_eq!(c["volumeMounts"][0]["mountPath"], "/dev/shm");
    let vol = &v["spec"]["volumes"][0];
    assert_eq!(vol["name"], c["volumeMounts"][0]["name"]);
    assert_eq!(vol["emptyDir"]["medium"], "Memory");
    assert_eq!(c["securityContext"]["allowPrivilegeEscalation"], false);
    assert_eq!(c["securityContext"]["capabilities"]["drop"][0], "ALL");
    // A size, or none at all.
    l.pod.shm_size = Some("8Gi".into());
    let v = serde_json::to_value(pod_for(&l, &s, None).expect("pod")).expect("json");
    assert_eq!(v["spec"]["volumes"][0]["emptyDir"]["sizeLimit"], "8Gi");
    l.pod.shm_size = Some("0".into());
    let v = serde_json::to_value(pod_for(&l, &s, None).expect("pod")).expect("json");
    assert!(v["spec"].get("volumes").is_none(), "{}", v["spec"]);
    // A CPU worker gets none unless it asks.
    l.pod.shm_size = None;
    l.gpu_count = 0;
    let v = serde_json::to_value(pod_for(&l, &s, None).expect("pod")).expect("json");
    assert!(v["spec"].get("volumes").is_none());
}

/// A worker's health endpoint on loopback, standing in for a pod that an
/// earlier leader left running: every request gets `200 {}`.
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
                        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\nconnection: close\r\n\r\n{}",
                    )
                    .await;
            });
        }
    });
    port
}

/// A pod an earlier leader made for `l`, named `name`, running on
/// loopback and ready, with the weights token it was started with.
fn left_running(l: &Launch, name: &str) -> Value {
    let mut l = l.clone();
    l.env
        .insert("WARMGATE_WEIGHTS_TOKEN".into(), "ab".repeat(32));
    let mut pod = serde_json::to_value(pod_for(&l, &settings(), None).expect("pod")).expect("json");
    pod["metadata"]["name"] = json!(name);
    pod["metadata"]["labels"]["warmgate.dev/replica"] = json!(name);
    pod["status"] = json!({"phase": "Running", "podIP": "127.0.0.1", "conditions": [
        {"type": "Ready", "status": "True"}
    ]});
    pod
}

/// Records what the pool manager tells the gateway.
#[derive(Default)]
struct Recorder {
    ready: parking_lot::Mutex<Vec<String>>,
    adopted: parking_lot::Mutex<Vec<(String, Option<String>)>>,
    minted: parking_lot::Mutex<Vec<String>>,
}

impl warmgate_pool::ReplicaSink for Recorder {
    fn replica_ready(&self, replica: std::sync::Arc<warmgate_pool::ReplicaHandle>) {
        self.ready.lock().push(replica.id.clone());
    }
    fn replica_removed(&self, _: &std::sync::Arc<warmgate_pool::ReplicaHandle>) {}
    fn start_failed(
        &self,
        _: &warmgate_deploy::TargetId,
        _: &warmgate_pool::Error,
        _: &warmgate_pool::TargetHealth,
    ) {
    }
    fn replica_env(
        &self,
        _: &warmgate_pool::TargetSpec,
        replica: &str,
    ) -> BTreeMap<String, String> {
        self.minted.lock().push(replica.to_string());
        BTreeMap::new()
    }
    fn replica_adopted(
        &self,
        _: &warmgate_pool::TargetSpec,
        replica: &str,
        env: &BTreeMap<String, String>,
    ) {
        self.adopted.lock().push((
            replica.to_string(),
            env.get("WARMGATE_WEIGHTS_TOKEN").cloned(),
        ));
    }
}

/// A new leader finds the pods an earlier one left. The one its target
/// wants as it is (same model, weights and settings) is taken over: probed,
/// routed to, with the token it holds, and neither created again nor
/// deleted. One for a changed app is deleted once the grace is over; one
/// that is not running is deleted at once. A GPU pod needs no GPU of this
/// machine's inventory: the cluster places it.
#[tokio::test]
async fn a_new_leader_takes_over_the_pods_its_targets_want_and_deletes_only_the_rest() {
    let port = healthz_server().await;
    let mut wanted = launch("llm-00002-1");
    wanted.pod.port = port;
    let mut changed = wanted.clone();
    changed
        .env
        .insert("HF_HOME".into(), "/elsewhere".to_string());
    let mut starting = left_running(&wanted, "llm-00002-9");
    starting["status"] = json!({"phase": "Pending"});
    let pods = vec![
        left_running(&wanted, "llm-00002-7"),
        left_running(&changed, "llm-00002-8"),
        starting,
    ];

    let (service, mut handle) = mock::pair::<Request<Body>, Response<Full<Bytes>>>();
    let client = kube::Client::new(service, NS);
    let calls = std::sync::Arc::new(parking_lot::Mutex::new(Vec::<String>::new()));
    let seen = calls.clone();
    let server = tokio::spawn(async move {
        let mut watches = Vec::new();
        while let Some((req, send)) = handle.next_request().await {
            let q = req.uri().query().unwrap_or("").to_string();
            let path = req.uri().path().to_string();
            let method = req.method().clone();
            seen.lock().push(format!("{method} {path}"));
            match (method, q.contains("watch=true")) {
                (Method::GET, false) => {
                    assert!(
                        q.contains(&format!("labelSelector={}", urlencode(SELECTOR))),
                        "only this instance's pods: {q}"
                    );
                    send.send_response(json_response(
                        StatusCode::OK,
                        &json!({"apiVersion": "v1", "kind": "PodList", "metadata": {"resourceVersion": "10"}, "items": pods}),
                    ));
                }
                // Held open: no pod changes during the scenario.
                (Method::GET, true) => watches.push(send),
                (Method::DELETE, _) => {
                    let name = path.rsplit('/').next().unwrap_or("").to_string();
                    send.send_response(json_response(
                        StatusCode::OK,
                        &json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}}),
                    ));
                }
                (m, _) => {
                    send.send_response(json_response(StatusCode::CONFLICT, &json!({})));
                    panic!("unexpected {m} {path}");
                }
            }
        }
    });

    let backend = std::sync::Arc::new(KubeBackend::new(client, settings()));
    assert_eq!(
        backend.find_previous().await.expect("list"),
        2,
        "two can be taken over"
    );
    let sink = std::sync::Arc::new(Recorder::default());
    let pm = warmgate_pool::PoolManager::new(backend.clone(), Vec::new(), sink.clone());
    let id = warmgate_deploy::TargetId::revision("llm", 2);
    pm.add_target(warmgate_pool::TargetSpec {
        id: id.clone(),
        health: wanted.health.clone(),
        listen: Default::default(),
        engine: warmgate_deploy::EngineSpec::default(),
        revision: wanted.revision.clone(),
        command: wanted.command.clone(),
        env: wanted.env.clone(),
        checkpoint: wanted.checkpoint.clone(),
        workdir: None,
        concurrency: 4,
        gpus: wanted.gpu_count,
        startup_timeout: wanted.startup_timeout,
        stop_grace: Duration::from_secs(30),
        image: wanted.image.clone(),
        pod: wanted.pod.clone(),
    });
    assert_eq!(pm.adoptable(&id), 1, "only the pod of the same settings");
    pm.scale(&id, 1);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while sink.ready.lock().is_empty() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the pod was not taken over: {:?}",
            pm.status()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(*sink.ready.lock(), ["llm-00002-7"]);
    assert_eq!(
        *sink.adopted.lock(),
        [("llm-00002-7".to_string(), Some("ab".repeat(32)))],
        "its token is honoured again"
    );
    assert!(
        sink.minted.lock().is_empty(),
        "no token minted: nothing new started"
    );
    let status = pm.status();
    assert_eq!(status[0].replicas[0].id, "llm-00002-7");
    assert_eq!(
        status[0].replicas[0]
            .addr
            .as_ref()
            .and_then(|a| a.tcp())
            .map(|a| a.port()),
        Some(port)
    );

    // Kept while its app may still take it over (it could not start yet).
    assert!(
        backend
            .delete_unadopted_except(|app| app == "llm")
            .is_empty()
    );
    assert_eq!(backend.previous_left(), 1);
    assert_eq!(backend.delete_unadopted(), ["llm-00002-8"]);
    assert_eq!(backend.previous_left(), 0);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !calls
        .lock()
        .iter()
        .any(|c| c.ends_with("/pods/llm-00002-8"))
    {
        assert!(tokio::time::Instant::now() < deadline, "{:?}", calls.lock());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let calls = calls.lock().clone();
    assert!(
        !calls.iter().any(|c| c.starts_with("POST")),
        "nothing created: {calls:?}"
    );
    let deleted: Vec<&String> = calls.iter().filter(|c| c.starts_with("DELETE")).collect();
    assert_eq!(
        deleted,
        [
            &format!("DELETE /api/v1/namespaces/{NS}/pods/llm-00002-9"),
            &format!("DELETE /api/v1/namespaces/{NS}/pods/llm-00002-8")
        ],
        "the pod taken over is never deleted"
    );
    server.abort();
}

#[test]
fn a_pod_mounts_allowed_volumes_and_runs_on_the_nodes_asked_for() {
    let mut l = launch("llm-00002-4");
    l.pod.volumes = BTreeMap::from([
        (
            "models".to_string(),
            warmgate_deploy::VolumeSpec {
                mount: "/models".into(),
                claim: Some("hf-cache".into()),
                read_only: true,
                ..warmgate_deploy::VolumeSpec::default()
            },
        ),
        (
            "scratch".to_string(),
            warmgate_deploy::VolumeSpec {
                mount: "/scratch".into(),
                empty_dir: Some("20Gi".into()),
                ..warmgate_deploy::VolumeSpec::default()
            },
        ),
    ]);
    l.pod.node_affinity = vec![warmgate_deploy::NodeRequirement {
        key: "topology.kubernetes.io/zone".into(),
        operator: "In".into(),
        values: vec!["us-east-1a".into(), "us-east-1b".into()],
    }];
    let mut s = settings();
    // Another team's claim is never mounted.
    let err = pod_for(&l, &s, None)
        .map_err(|e| e.to_string())
        .expect_err("not allowed");
    assert!(err.contains("allowed_claims"), "{err}");
    s.config.allowed_claims = vec!["hf-cache".into()];
    let v = serde_json::to_value(pod_for(&l, &s, None).expect("pod")).expect("json");
    let spec = &v["spec"];
    let c = &spec["containers"][0];
    // /dev/shm first (two GPUs), then the spec's volumes by name.
    let names: Vec<&str> = spec["volumes"]
        .as_array()
        .expect("volumes")
        .iter()
        .filter_map(|v| v["name"].as_str())
        .collect();
    assert_eq!(names, ["dshm", "models", "scratch"]);
    assert_eq!(
        spec["volumes"][1]["persistentVolumeClaim"]["claimName"],
        "hf-cache"
    );
    assert_eq!(
        spec["volumes"][1]["persistentVolumeClaim"]["readOnly"],
        true
    );
    assert_eq!(spec["volumes"][2]["emptyDir"]["sizeLimit"], "20Gi");
    assert_eq!(c["volumeMounts"][1]["mountPath"], "/models");
    assert_eq!(c["volumeMounts"][1]["readOnly"], true);
    assert_eq!(c["volumeMounts"][2]["mountPath"], "/scratch");
    assert!(
        spec["volumes"]
            .as_array()
            .expect("volumes")
            .iter()
            .all(|v| v.get("hostPath").is_none())
    );
    let term = &spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        ["nodeSelectorTerms"][0]["matchExpressions"][0];
    assert_eq!(term["key"], "topology.kubernetes.io/zone");
    assert_eq!(term["operator"], "In");
    assert_eq!(term["values"], json!(["us-east-1a", "us-east-1b"]));
}
