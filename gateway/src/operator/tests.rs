//! The operator's tests: resources made into the config or refused, statuses, conditions, events.

use super::status::{Was, refused_conditions, settle, write_if_changed};
use super::*;
use serde_json::json;
use warmgate_deploy::crd::{ReplicaCounts, ServingAppStatus};
use warmgate_pool::{ReplicaState, TargetStatus};

use crate::status::AppStatus;
use bytes::Bytes;
use http::{Request, Response};
use http_body_util::Full;
use serde_json::Value;

fn app(name: &str, spec: Value) -> ServingApp {
    serde_json::from_value(json!({
        "apiVersion": "warmgate.dev/v1alpha1", "kind": "ServingApp",
        "metadata": {"name": name, "namespace": "ml", "uid": "u-app", "generation": 3},
        "spec": spec,
    }))
    .expect("a ServingApp")
}

#[test]
fn a_checkpoint_only_edit_is_a_promotion_and_other_edits_are_applied() {
    let dir = tempfile::tempdir().expect("dir");
    for v in ["1", "2"] {
        std::fs::create_dir_all(dir.path().join("ck").join(v)).expect("mkdir");
    }
    let ck = |v: &str| format!("file://{}/ck/{v}", dir.path().display());
    let mut base = Config::default();
    base.weights.allowed_prefixes = Some(vec![format!("file://{}/ck", dir.path().display())]);
    let running = config_from(
        base.clone(),
        &[app("m", json!({"image": "r/m:1", "checkpoint": ck("1")}))],
        &[],
    )
    .expect("valid")
    .0;
    // Only the checkpoint: promoted, from the running one.
    let (edited, _) = config_from(
        base.clone(),
        &[app("m", json!({"image": "r/m:1", "checkpoint": ck("2")}))],
        &[],
    )
    .expect("valid");
    assert_eq!(
        checkpoint_only_change(&edited.apps[0], &running),
        Some((Some(ck("1")), ck("2")))
    );
    // The checkpoint and the image: a roll, not a promotion.
    let (edited, _) = config_from(
        base.clone(),
        &[app("m", json!({"image": "r/m:2", "checkpoint": ck("2")}))],
        &[],
    )
    .expect("valid");
    assert_eq!(checkpoint_only_change(&edited.apps[0], &running), None);
    // Unchanged, or a new app: nothing to promote.
    assert_eq!(checkpoint_only_change(&running.apps[0], &running), None);
    let (other, _) = config_from(base, &[app("n", json!({"image": "r/n:1"}))], &[]).expect("valid");
    assert_eq!(checkpoint_only_change(&other.apps[0], &running), None);
}

#[test]
fn resources_become_the_config_with_their_names() {
    let a = app(
        "minilm",
        json!({"image": "r/embedder:1", "gpus": 1, "autoscale": {"max": 2}}),
    );
    let p: WarmPool = serde_json::from_value(json!({
        "apiVersion": "warmgate.dev/v1alpha1", "kind": "WarmPool",
        "metadata": {"name": "rollouts"},
        "spec": {"image": "r/cartpole:1", "replicas": [1, 3]},
    }))
    .expect("a WarmPool");
    let (c, refused) =
        config_from(Config::default(), std::slice::from_ref(&a), &[p]).expect("valid");
    assert_eq!(refused, []);
    assert_eq!(c.backend.kind, BackendKind::Kubernetes);
    assert_eq!(c.apps[0].name, "minilm");
    assert_eq!(c.apps[0].autoscale.max, 2);
    assert_eq!(c.pools[0].name, "rollouts");
    assert_eq!(c.pools[0].replicas, [1, 3]);
    // The pods are owned by the resource.
    let owner = owner_of(&a).expect("owner");
    assert_eq!(
        (owner.kind.as_str(), owner.name.as_str(), owner.uid.as_str()),
        ("ServingApp", "minilm", "u-app")
    );
    assert_eq!(owner.controller, Some(true));
    // A resource without an image is refused with the key at fault,
    // and the others are still served.
    let bad = app("x", json!({"command": ["./w"]}));
    let (c, refused) = config_from(Config::default(), &[bad, a], &[]).expect("base is valid");
    assert_eq!(c.apps.len(), 1);
    assert_eq!(c.apps[0].name, "minilm");
    assert_eq!(refused.len(), 1);
    assert_eq!(
        (refused[0].name.as_str(), refused[0].key.as_str()),
        ("x", "spec.image")
    );
}

#[test]
fn resources_may_not_run_commands_or_reach_addresses_from_the_operator() {
    let gate_command = app(
        "evil",
        json!({"image": "r/e:1", "promotion": {"gate_command": ["sh", "-c", "cat /var/run/secrets/kubernetes.io/serviceaccount/token"]}}),
    );
    let gate_url = app(
        "probe",
        json!({"image": "r/e:1", "promotion": {"gate_url": "http://10.0.0.1:6443/api"}}),
    );
    let plain = app("plain", json!({"image": "r/e:1"}));
    let all = [gate_command, gate_url, plain];
    let (c, refused) = config_from(Config::default(), &all, &[]).expect("base is valid");
    assert_eq!(
        c.apps.iter().map(|a| a.name.as_str()).collect::<Vec<_>>(),
        ["plain"],
        "only the resource without gates is served"
    );
    let keys: Vec<(&str, &str)> = refused
        .iter()
        .map(|r| (r.name.as_str(), r.key.as_str()))
        .collect();
    assert_eq!(
        keys,
        [
            ("evil", "spec.promotion.gate_command"),
            ("probe", "spec.promotion.gate_url")
        ]
    );
    assert!(refused[0].message.contains("allow_gate_command"));
    // The refusal reaches the resource's status as a condition.
    let cond = &refused_conditions(&refused[0], "t")[0];
    assert_eq!(
        (
            cond.type_.as_str(),
            cond.status.as_str(),
            cond.reason.as_str()
        ),
        ("Ready", "False", "Refused")
    );
    assert!(cond.message.starts_with("spec.promotion.gate_command: "));
    // The operator's own config may allow them.
    let mut base = Config::default();
    base.operator.allow_gate_command = true;
    base.operator.allow_gate_url = true;
    let (c, refused) = config_from(base, &all, &[]).expect("base is valid");
    assert_eq!(refused, []);
    assert_eq!(c.apps.len(), 3);
}

#[test]
fn a_resource_reading_a_checkpoint_outside_the_operator_s_prefixes_is_refused() {
    let inside = app(
        "minilm",
        json!({"image": "r/e:1", "checkpoint": "s3://models/minilm/v1"}),
    );
    let outside = app(
        "other",
        json!({"image": "r/e:1", "checkpoint": "s3://models-private/secret"}),
    );
    let watch = app(
        "watcher",
        json!({"image": "r/e:1", "promotion": {"watch": "file:///etc"}}),
    );
    let pool: WarmPool = serde_json::from_value(json!({
        "apiVersion": "warmgate.dev/v1alpha1", "kind": "WarmPool",
        "metadata": {"name": "rollouts"},
        "spec": {"image": "r/c:1", "checkpoint": "gs://elsewhere/ckpt"},
    }))
    .expect("a WarmPool");
    let mut base = Config::default();
    base.weights.allowed_prefixes = Some(vec!["s3://models/".into()]);
    let (c, refused) =
        config_from(base, &[inside, outside, watch], &[pool]).expect("base is valid");
    assert_eq!(
        c.apps.iter().map(|a| a.name.as_str()).collect::<Vec<_>>(),
        ["minilm"]
    );
    assert!(c.pools.is_empty());
    let keys: Vec<(&str, &str)> = refused
        .iter()
        .map(|r| (r.name.as_str(), r.key.as_str()))
        .collect();
    assert_eq!(
        keys,
        [
            ("other", "spec.checkpoint"),
            ("watcher", "spec.promotion.watch"),
            ("rollouts", "spec.checkpoint")
        ]
    );
    // A URI the list allows but the store cannot open (an empty
    // segment) is refused alone instead of stopping the gateway.
    let odd = app(
        "odd",
        json!({"image": "r/e:1", "checkpoint": "s3://models//x"}),
    );
    let mut base = Config::default();
    base.weights.allowed_prefixes = Some(vec!["s3://models/".into()]);
    let (_, refused) = config_from(base, &[odd], &[]).expect("base is valid");
    assert_eq!(refused.len(), 1, "{refused:?}");
    // Without a list in the operator's config, no resource may name a
    // checkpoint: its own spec cannot vouch for itself.
    let a = app(
        "m",
        json!({"image": "r/e:1", "checkpoint": "s3://models/m"}),
    );
    let (_, refused) = config_from(Config::default(), &[a], &[]).expect("base is valid");
    assert_eq!(refused.len(), 1);
}

#[test]
fn a_resource_colliding_with_an_earlier_one_is_refused_alone() {
    let first = app("minilm", json!({"image": "r/e:1", "aliases": ["embed"]}));
    let second = app("other", json!({"image": "r/e:1", "aliases": ["embed"]}));
    let (c, refused) = config_from(Config::default(), &[first, second], &[]).expect("valid");
    assert_eq!(c.apps.len(), 1);
    assert_eq!(refused[0].name, "other");
    assert!(refused[0].key.starts_with("spec."), "{}", refused[0].key);
}

#[test]
fn a_resource_naming_a_service_account_not_allowed_is_refused() {
    let a = app(
        "minilm",
        json!({"image": "r/e:1", "kubernetes": {"service_account": "warmgate"}}),
    );
    let (c, refused) =
        config_from(Config::default(), std::slice::from_ref(&a), &[]).expect("base is valid");
    assert!(c.apps.is_empty());
    assert_eq!(refused[0].key, "spec.kubernetes.service_account");
    assert!(
        refused[0].message.contains("allowed_service_accounts"),
        "{}",
        refused[0].message
    );
    // Allowed by the operator's own settings: accepted.
    let mut base = Config::default();
    base.backend.kubernetes.allowed_service_accounts = vec!["warmgate".into()];
    let (c, refused) = config_from(base, &[a], &[]).expect("allowed");
    assert_eq!(refused, []);
    assert_eq!(
        c.apps[0].kubernetes.service_account.as_deref(),
        Some("warmgate")
    );
}

fn target(desired: u32, replicas: &[(&str, ReplicaState)]) -> TargetStatus {
    TargetStatus {
        id: warmgate_deploy::TargetId::revision("minilm", 2),
        name: "minilm-00002".into(),
        app: "minilm".into(),
        revision: "minilm-00002".into(),
        desired,
        replicas: replicas
            .iter()
            .map(|(id, state)| warmgate_pool::ReplicaStatus {
                id: (*id).into(),
                state: state.clone(),
                revision: "minilm-00002".into(),
                addr: None,
                pid: None,
                gpus: Vec::new(),
                inflight: 0,
                concurrency: 1,
                idle_seconds: None,
                age_seconds: 0.0,
                weights_version: None,
                log: None,
                engine: None,
            })
            .collect(),
        restarts: 0,
        health: Default::default(),
        last_cold_start: None,
    }
}

fn gateway_app_status() -> AppStatus {
    let revision = |id: &str, traffic| crate::status::RevisionStatus {
        id: id.into(),
        traffic,
        ready: 1,
        ..Default::default()
    };
    AppStatus {
        name: "minilm".into(),
        revision: "minilm-00002".into(),
        revisions: vec![revision("minilm-00002", 90), revision("minilm-00001", 10)],
        pool: Some(target(
            3,
            &[
                ("minilm-00002-1", ReplicaState::Ready),
                ("minilm-00002-2", ReplicaState::Starting),
                (
                    "minilm-00002-3",
                    ReplicaState::Pending {
                        reason: "0/4 nodes are available: 4 Insufficient nvidia.com/gpu.".into(),
                    },
                ),
            ],
        )),
        ..Default::default()
    }
}

#[test]
fn app_status_counts_replicas_and_names_the_scheduler_reason() {
    let s = app_status(&gateway_app_status(), Some(3), "2026-11-29T20:00:00Z");
    assert_eq!(
        s.replicas,
        ReplicaCounts {
            ready: 1,
            starting: 1,
            pending: 1,
            desired: 3
        }
    );
    assert_eq!(s.revision.as_deref(), Some("minilm-00002"));
    assert_eq!(
        s.revisions.iter().map(|r| r.traffic).collect::<Vec<_>>(),
        [90, 10]
    );
    assert_eq!(s.observed_generation, Some(3));
    let ready = &s.conditions[0];
    assert_eq!(
        (ready.type_.as_str(), ready.status.as_str()),
        ("Ready", "True")
    );
    let unsched = s
        .conditions
        .iter()
        .find(|c| c.type_ == "Unschedulable")
        .expect("condition");
    assert!(
        unsched.message.contains("Insufficient nvidia.com/gpu"),
        "{}",
        unsched.message
    );
    // Scaled to zero is ready, not failed.
    let zero = app_status(
        &AppStatus {
            name: "m".into(),
            pool: Some(target(0, &[])),
            ..Default::default()
        },
        None,
        "t",
    );
    assert_eq!(zero.conditions[0].reason, "ScaledToZero");
    assert_eq!(zero.conditions[0].status, "True");
}

#[test]
fn conditions_keep_their_transition_time_and_an_unchanged_status_is_not_written() {
    let t0 = "2026-11-29T20:00:00Z";
    let t1 = "2026-11-29T20:00:05Z";
    let first = app_status(&gateway_app_status(), Some(3), t0);
    // Five seconds on, nothing changed: the same status, so no write.
    let mut again = app_status(&gateway_app_status(), Some(3), t1);
    assert_ne!(again, first, "a naive status differs by its times alone");
    settle(Some(&first.conditions), &mut again.conditions, t1);
    assert_eq!(again, first, "settled, it is the same: nothing to write");
    // Ready's message changes (2 of 3 ready) but its status does not:
    // its transition time stays.
    let mut more = gateway_app_status();
    if let Some(t) = more.pool.as_mut() {
        t.desired = 4;
    }
    let mut next = app_status(&more, Some(3), t1);
    settle(Some(&first.conditions), &mut next.conditions, t1);
    let ready = next
        .conditions
        .iter()
        .find(|c| c.type_ == "Ready")
        .expect("ready");
    assert_eq!(ready.last_transition_time, t0);
    assert_ne!(next, first, "a changed message is written");
    // The scheduler places everything: Unschedulable turns False at
    // t1 rather than disappearing.
    let placed = app_status(
        &AppStatus {
            name: "m".into(),
            pool: Some(target(0, &[])),
            ..Default::default()
        },
        Some(3),
        t1,
    );
    let mut placed_next = placed.clone();
    settle(Some(&first.conditions), &mut placed_next.conditions, t1);
    let unsched = placed_next
        .conditions
        .iter()
        .find(|c| c.type_ == "Unschedulable")
        .expect("kept");
    assert_eq!(unsched.status, "False");
    assert_eq!(unsched.last_transition_time, t1);
    // Ready went from True (Serving) to True (ScaledToZero): no
    // transition.
    let ready = placed_next
        .conditions
        .iter()
        .find(|c| c.type_ == "Ready")
        .expect("ready");
    assert_eq!(ready.last_transition_time, t0);
}

/// A resource that is refused: `Ready=False` with the key at fault, and
/// a Warning event about it with the same reason; the same status
/// again writes nothing and says nothing.
#[tokio::test]
async fn a_refused_resource_gets_its_condition_and_a_warning_event_once() {
    let (service, mut handle) =
        tower_test::mock::pair::<Request<kube::client::Body>, Response<Full<Bytes>>>();
    let client = kube::Client::new(service, "ml");
    let api: Api<ServingApp> = Api::namespaced(client.clone(), "ml");
    let recorder = events::Events::new(client, Some("wg-0".into()));
    let mut resource = app("minilm", json!({"image": "r/e:1", "concurrency": 0}));
    resource.metadata.uid = Some("u-7".into());
    let refusal = Refusal {
        kind: ResourceKind::App,
        name: "minilm".into(),
        key: "spec.concurrency".into(),
        message: "must be at least 1".into(),
    };
    let now = "2026-12-01T00:00:00Z";
    let status = ServingAppStatus {
        conditions: refused_conditions(&refusal, now),
        ..ServingAppStatus::default()
    };
    let echo = serde_json::to_value(&resource).expect("json");
    let verifier = tokio::spawn(async move {
        let (req, send) = handle.next_request().await.expect("the status patch");
        assert_eq!(req.method(), http::Method::PATCH);
        assert!(req.uri().path().ends_with("/servingapps/minilm/status"));
        send.send_response(
            Response::builder()
                .header("content-type", "application/json")
                .body(Full::new(Bytes::from(echo.to_string())))
                .expect("response"),
        );
        let (req, send) = handle.next_request().await.expect("the event");
        assert_eq!(req.method(), http::Method::POST);
        assert_eq!(
            req.uri().path(),
            "/apis/events.k8s.io/v1/namespaces/ml/events"
        );
        let body: Value =
            serde_json::from_slice(&req.into_body().collect_bytes().await.expect("body"))
                .expect("json");
        assert_eq!(body["type"], "Warning", "{body}");
        assert_eq!(body["reason"], "Refused", "{body}");
        assert_eq!(
            body["note"], "spec.concurrency: must be at least 1",
            "{body}"
        );
        assert_eq!(body["regarding"]["kind"], "ServingApp", "{body}");
        assert_eq!(body["regarding"]["name"], "minilm", "{body}");
        assert_eq!(body["regarding"]["uid"], "u-7", "{body}");
        assert_eq!(body["reportingController"], "warmgate-operator", "{body}");
        send.send_response(
            Response::builder()
                .header("content-type", "application/json")
                .body(Full::new(Bytes::from(body.to_string())))
                .expect("response"),
        );
        handle
    });
    let was = Was {
        status: None,
        regarding: Some(resource.object_ref(&())),
        events: &recorder,
    };
    write_if_changed(&api, "minilm", was, status.clone(), now)
        .await
        .expect("written");
    let mut handle = verifier.await.expect("the verifier saw both calls");
    // Written once: the same status again is neither patched nor told.
    let again = Was {
        status: Some(status.clone()),
        regarding: Some(resource.object_ref(&())),
        events: &recorder,
    };
    write_if_changed(&api, "minilm", again, status, now)
        .await
        .expect("nothing to write");
    assert!(
        tokio::time::timeout(Duration::from_millis(100), handle.next_request())
            .await
            .is_err(),
        "no call for an unchanged status"
    );
}

#[tokio::test]
async fn status_is_written_through_the_status_subresource_as_a_merge_patch() {
    let (service, mut handle) =
        tower_test::mock::pair::<Request<kube::client::Body>, Response<Full<Bytes>>>();
    let client = kube::Client::new(service, "ml");
    let api: Api<ServingApp> = Api::namespaced(client, "ml");
    let status = app_status(&gateway_app_status(), Some(3), "2026-11-29T20:00:00Z");
    let expected = serde_json::to_value(&status).expect("json");
    let verifier = tokio::spawn(async move {
        let (req, send) = handle.next_request().await.expect("a call");
        assert_eq!(req.method(), http::Method::PATCH);
        assert_eq!(
            req.uri().path(),
            "/apis/warmgate.dev/v1alpha1/namespaces/ml/servingapps/minilm/status"
        );
        assert_eq!(
            req.headers()["content-type"],
            "application/merge-patch+json"
        );
        let body: Value =
            serde_json::from_slice(&req.into_body().collect_bytes().await.expect("body"))
                .expect("json");
        assert_eq!(body, json!({"status": expected}), "only the status is sent");
        let mut obj = serde_json::to_value(app("minilm", json!({"image": "r/e:1"}))).expect("json");
        obj["status"] = expected;
        send.send_response(
            Response::builder()
                .header("content-type", "application/json")
                .body(Full::new(Bytes::from(obj.to_string())))
                .expect("response"),
        );
    });
    patch_status(&api, "minilm", &status)
        .await
        .expect("patched");
    verifier.await.expect("the verifier saw the call");
}
