//! Every operator replica serves: a leader on the kubernetes backend
//! (against the mocked API server, which records every call) and a
//! follower that serves the apps on the leader's pods, over real loopback
//! HTTP between them. The follower starts and deletes nothing, splits each
//! replica's concurrency with the leader, passes the control plane to the
//! leader, and a request it holds for an app at zero wakes the app on the
//! leader. Nothing here has met a real API server.

mod kube_mock;

use std::sync::Arc;
use std::time::Duration;

use kube_mock::{Cluster, eventually, healthz_server, pods_of, ready};
use parking_lot::Mutex;
use serde_json::{Value, json};
use warmgate_gateway::operator::follower;
use warmgate_pool::peer::PeerBackend;

const TOKEN: &str = "peer-token-for-the-test";

fn spec(port: u16, min: u32) -> Value {
    json!({
        "image": "registry.example/worker:1",
        "concurrency": 2,
        "kubernetes": {"port": port},
        "autoscale": {"min": min, "max": 1},
    })
}

async fn serve(router: axum::Router) -> std::net::SocketAddr {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = l.local_addr().expect("addr");
    tokio::spawn(async move {
        let _ = axum::serve(l, router).await;
    });
    addr
}

/// `method path` at `addr`: (status, body).
async fn call(addr: std::net::SocketAddr, method: &str, path: &str) -> (u16, String) {
    use http_body_util::BodyExt as _;
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<http_body_util::Full<bytes::Bytes>>();
    let req = http::Request::builder()
        .method(method)
        .uri(format!("http://{addr}{path}"))
        .header("content-type", "application/json")
        .body(http_body_util::Full::new(bytes::Bytes::from_static(b"{}")))
        .expect("request");
    let resp = tokio::time::timeout(Duration::from_secs(60), client.request(req))
        .await
        .expect("answered in time")
        .expect("answered");
    let status = resp.status().as_u16();
    let body = resp.into_body().collect().await.expect("body").to_bytes();
    (status, String::from_utf8_lossy(&body).into_owned())
}

/// `POST path` at `addr` with an Authorization header and a body.
async fn call_with(
    addr: std::net::SocketAddr,
    path: &str,
    auth: &str,
    body: &str,
) -> (u16, String) {
    use http_body_util::BodyExt as _;
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<http_body_util::Full<bytes::Bytes>>();
    let req = http::Request::post(format!("http://{addr}{path}"))
        .header("content-type", "application/json")
        .header("authorization", auth)
        .body(http_body_util::Full::new(bytes::Bytes::from(
            body.to_string(),
        )))
        .expect("request");
    let resp = client.request(req).await.expect("answered");
    let status = resp.status().as_u16();
    let body = resp.into_body().collect().await.expect("body").to_bytes();
    (status, String::from_utf8_lossy(&body).into_owned())
}

/// A leader on the mocked API server serving `apps` (name, spec), and a
/// follower reporting to it, both on loopback.
struct Scene {
    cluster: Arc<Mutex<Cluster>>,
    leader: Arc<warmgate_gateway::Gateway>,
    follower: Arc<warmgate_gateway::Gateway>,
    leader_addr: std::net::SocketAddr,
    follower_addr: std::net::SocketAddr,
    /// Calls made before the follower started.
    before_follower: usize,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    _dir: tempfile::TempDir,
}

impl Scene {
    async fn start(apps: &[(&str, Value)], first_ready: &str) -> Scene {
        let dir = tempfile::tempdir().expect("dir");
        let cluster = Arc::new(Mutex::new(Cluster::default()));
        {
            let mut c = cluster.lock();
            for (name, spec) in apps {
                c.put_resource("servingapps", name, spec.clone());
            }
            c.pending.clear();
        }
        let (leader, reconciling, server) =
            kube_mock::leader_on(&cluster, &dir.path().join("leader"));
        leader.set_peer_token(TOKEN.into());
        let leader_ticks = warmgate_gateway::runtime::autoscale::spawn(&leader);
        let leader_addr = serve(warmgate_gateway::router(leader.clone())).await;
        eventually("the first app is ready on the leader", || {
            ready(&leader, first_ready).then_some(())
        })
        .await;
        let before_follower = cluster.lock().calls.len();

        // The follower: the leader's replicas, nothing of its own.
        let peer = Arc::new(PeerBackend::new());
        let follower = warmgate_gateway::Gateway::new(
            kube_mock::operator_base(&dir.path().join("follower")),
            peer.clone(),
            None,
            "127.0.0.1:8080".parse().expect("addr"),
        )
        .expect("the follower starts");
        follower.set_peer_token(TOKEN.into());
        follower.set_follower(peer);
        let follower_ticks = warmgate_gateway::runtime::autoscale::spawn(&follower);
        let found: follower::LeaderAddr = Arc::default();
        let follower_addr = serve(follower::router(follower.clone(), found.clone())).await;
        assert_eq!(
            call(follower_addr, "GET", "/readyz").await.0,
            503,
            "not ready before the leader answers"
        );
        let reports = tokio::spawn(follower::follow(
            follower.clone(),
            "operator-1".into(),
            found,
            move || async move { Some(leader_addr) },
        ));
        Scene {
            cluster,
            leader,
            follower,
            leader_addr,
            follower_addr,
            before_follower,
            tasks: vec![server, leader_ticks, reconciling, follower_ticks, reports],
            _dir: dir,
        }
    }
}

impl Drop for Scene {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follower_serves_on_the_leader_s_pods_and_its_demand_wakes_the_leader() {
    let port = healthz_server().await;
    let scene = Scene::start(&[("a", spec(port, 1)), ("z", spec(port, 0))], "a").await;
    let Scene {
        cluster,
        leader,
        follower: fgw,
        leader_addr,
        follower_addr,
        before_follower: pods_before,
        ..
    } = &scene;
    let (cluster, leader, fgw, leader_addr, follower_addr, pods_before) = (
        cluster,
        leader,
        fgw,
        *leader_addr,
        *follower_addr,
        *pods_before,
    );
    // It serves a on the leader's pod, under the leader's name for it.
    eventually("a is ready on the follower", || {
        ready(fgw, "a").then_some(())
    })
    .await;
    let leader_replicas: Vec<String> = pods_of(cluster, "a");
    let follower_status = serde_json::to_value(fgw.status_report()).expect("json");
    let text = follower_status.to_string();
    assert!(
        leader_replicas.iter().all(|r| text.contains(r.as_str())),
        "the follower routes to the leader's {leader_replicas:?}: {text}"
    );
    let (status, body) = call(follower_addr, "POST", "/apps/a/echo").await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(call(follower_addr, "GET", "/readyz").await.0, 200);

    // Each replica's concurrency (2) is split: one each.
    eventually("both gateways count two serving", || {
        (leader.serving_share() == (0, 2) && fgw.serving_share() == (1, 2)).then_some(())
    })
    .await;

    // The control plane is the leader's: the follower passes it on (its
    // own gateway keeps no history).
    let (status, body) = call(follower_addr, "GET", "/v1/apps/a/revisions").await;
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("a-00001"), "the leader's history: {body}");

    // z is at zero. A request to the follower is held there; its report
    // wakes z on the leader, which starts z's pod; the follower then
    // serves the request on it.
    assert!(pods_of(cluster, "z").is_empty());
    let (status, body) = call(follower_addr, "POST", "/apps/z/echo").await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(pods_of(cluster, "z").len(), 1);

    // The follower made no pod call of its own: every call since it
    // started is the leader's z pod.
    let calls: Vec<String> = cluster.lock().calls[pods_before..]
        .iter()
        .filter(|c| c.starts_with("POST ") || c.starts_with("DELETE "))
        .cloned()
        .collect();
    assert!(calls.iter().all(|c| c.starts_with("POST z-")), "{calls:?}");
    assert!(kube_mock::unexpected(cluster).is_empty());

    // A report without the token, or with another, is refused.
    let (status, body) = call(leader_addr, "POST", warmgate_gateway::peers::PEERS_PATH).await;
    assert_eq!(status, 401, "{body}");
    let (status, body) = call_with(
        leader_addr,
        warmgate_gateway::peers::PEERS_PATH,
        "Bearer not-the-token",
        r#"{"member": "x", "load": {"a-00001": {"concurrency": 100.0, "busy": 0.0, "arrivals": 0, "completions": 0, "queued": 50}}}"#,
    )
    .await;
    assert_eq!(status, 401, "{body}");
}

/// The leader drains a replica only once the follower's requests on it are
/// done: a stream held through a roll is answered, not cut.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_roll_waits_for_the_follower_s_requests_on_the_old_replica() {
    let release = Arc::new(tokio::sync::Notify::new());
    let port = kube_mock::worker_server(release.clone()).await;
    let scene = Scene::start(&[("a", spec(port, 1))], "a").await;
    let (cluster, fgw) = (&scene.cluster, &scene.follower);
    eventually("a is ready on the follower", || {
        ready(fgw, "a").then_some(())
    })
    .await;
    let old = pods_of(cluster, "a");
    assert_eq!(old.len(), 1);

    // A request on the follower that lasts until released.
    let follower_addr = scene.follower_addr;
    let slow = tokio::spawn(async move { call(follower_addr, "POST", "/apps/a/slow").await });
    eventually("the follower has it in flight", || {
        let text = serde_json::to_value(fgw.status_report())
            .expect("json")
            .to_string();
        text.contains("\"inflight\":1").then_some(())
    })
    .await;

    // a's spec changes: the leader rolls it to a new pod.
    let mut next = spec(port, 1);
    next["env"] = json!({"GENERATION": "2"});
    cluster.lock().put_resource("servingapps", "a", next);
    eventually("the follower serves a-00002", || {
        let text = serde_json::to_value(fgw.status_report())
            .expect("json")
            .to_string();
        (text.contains("a-00002") && ready(fgw, "a")).then_some(())
    })
    .await;
    // The follower's request still runs on the old pod: it is not deleted.
    assert!(
        !cluster
            .lock()
            .calls
            .iter()
            .any(|c| *c == format!("DELETE {}", old[0])),
        "the old pod went while the follower's request ran on it"
    );
    let mark = cluster.lock().calls.len();
    release.notify_waiters();
    let (status, body) = slow.await.expect("joined");
    assert_eq!(status, 200, "the held request is answered, not cut: {body}");
    eventually("then the old pod is deleted", || {
        cluster.lock().calls[mark..]
            .iter()
            .any(|c| *c == format!("DELETE {}", old[0]))
            .then_some(())
    })
    .await;
}

/// With `concurrency = 1` and two gateways, each replica's one slot is
/// one gateway's. A follower without it passes the request to the leader,
/// which has it, rather than holding it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follower_without_a_part_of_a_replica_passes_its_requests_to_the_leader() {
    use warmgate_pool::replica::{part_of, salt_of};
    // A worker whose address gives the follower (gateway 1 of 2) no part.
    let mut port = 0;
    for _ in 0..64 {
        let p = healthz_server().await;
        if part_of(
            1,
            1,
            2,
            salt_of(&std::net::SocketAddr::from(([127, 0, 0, 1], p)).into()),
        ) == 0
        {
            port = p;
            break;
        }
    }
    assert_ne!(port, 0, "no worker port gives the follower no part");
    let mut one = spec(port, 1);
    one["concurrency"] = json!(1);
    let scene = Scene::start(&[("a", one)], "a").await;
    let (leader, fgw) = (&scene.leader, &scene.follower);
    eventually("a is ready on the follower, shared by two", || {
        (ready(fgw, "a") && fgw.serving_share() == (1, 2) && leader.serving_share() == (0, 2))
            .then_some(())
    })
    .await;
    let (status, body) = call(scene.follower_addr, "POST", "/apps/a/echo").await;
    assert_eq!(status, 200, "{body}");
}
