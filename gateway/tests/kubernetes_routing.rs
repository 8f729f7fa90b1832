//! Two gateways in front of the same engines, as an operator's leader and
//! its follower on Kubernetes: the leader on the mocked API server (which
//! records every call; its pods get addresses of their own on loopback),
//! the follower serving the apps on the leader's pods. Each pod is a real
//! stand-in vLLM engine (`tests/standins/llm_engine.py`, a prefix cache of
//! chained blocks). The two gateways share no prefix index; the test
//! measures what that costs: the engines' cached-token ratio with the
//! traffic split between the two, against one gateway taking it all.
//! Nothing here has met a real API server.

mod kube_mock;

use std::sync::Arc;
use std::time::Duration;

use kube_mock::{Cluster, eventually};
use parking_lot::Mutex;
use serde_json::{Value, json};
use warmgate_gateway::operator::follower;
use warmgate_pool::peer::PeerBackend;

const TOKEN: &str = "peer-token-for-the-routing-test";
const ENGINES: usize = 4;

fn engine_script() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/standins/llm_engine.py")
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

/// `method path` at `addr` with a JSON body: (status, body).
async fn call(addr: std::net::SocketAddr, method: &str, path: &str, body: &Value) -> (u16, Value) {
    use http_body_util::BodyExt as _;
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<http_body_util::Full<bytes::Bytes>>();
    let req = http::Request::builder()
        .method(method)
        .uri(format!("http://{addr}{path}"))
        .header("content-type", "application/json")
        .body(http_body_util::Full::new(bytes::Bytes::from(
            body.to_string(),
        )))
        .expect("request");
    let resp = tokio::time::timeout(Duration::from_secs(60), client.request(req))
        .await
        .expect("answered in time")
        .expect("answered");
    let status = resp.status().as_u16();
    let bytes = resp.into_body().collect().await.expect("body").to_bytes();
    (
        status,
        serde_json::from_slice(&bytes).unwrap_or(Value::Null),
    )
}

/// Stand-in engines, one per pod address, killed when dropped.
struct Engines(Vec<std::process::Child>);

impl Drop for Engines {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// The system prompt of group `g` of set `set`: 600 words of its own.
fn system_prompt(set: usize, g: usize) -> String {
    (0..600)
        .map(|i| format!("s{set}g{g}w{}", (i * 7919 + g * 31) % 1000))
        .collect::<Vec<_>>()
        .join(" ")
}

/// Sends twelve groups of a shared system prompt, eight questions each in
/// a shuffled order, alternating between `gateways`; the engines' cached
/// share of the prompt tokens.
async fn cached_ratio(gateways: &[std::net::SocketAddr], set: usize) -> f64 {
    let mut order: Vec<(usize, usize)> =
        (0..12).flat_map(|g| (0..8).map(move |q| (g, q))).collect();
    fastrand::Rng::with_seed(5).shuffle(&mut order);
    let (mut prompt, mut cached) = (0u64, 0u64);
    for (n, (g, q)) in order.iter().enumerate() {
        let gw = gateways[n % gateways.len()];
        let body = json!({
            "model": "llm",
            "max_tokens": 2,
            "messages": [
                {"role": "system", "content": system_prompt(set, *g)},
                {"role": "user", "content": format!("question {q} of group {g}")},
            ],
        });
        let (status, answer) = call(gw, "POST", "/v1/chat/completions", &body).await;
        assert_eq!(status, 200, "{answer}");
        prompt += answer["usage"]["prompt_tokens"]
            .as_u64()
            .expect("prompt_tokens");
        cached += answer["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .expect("cached_tokens");
    }
    cached as f64 / prompt as f64
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_gateways_sharing_no_index_keep_most_of_one_gateway_s_cache_hits() {
    // One engine per pod address, all on one port.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr")
        .port();
    let ips: Vec<String> = (2..2 + ENGINES).map(|i| format!("127.0.0.{i}")).collect();
    let engines = Engines(
        ips.iter()
            .map(|ip| {
                std::process::Command::new("python3")
                    .arg(engine_script())
                    .args(["--host", ip, "--port", &port.to_string(), "--model", "llm"])
                    .args([
                        "--prefill-ms-per-token",
                        "0.01",
                        "--decode-ms-per-token",
                        "1",
                    ])
                    .args(["--cache-tokens", "4000"])
                    .stdin(std::process::Stdio::null())
                    .stdout(std::process::Stdio::null())
                    .spawn()
                    .expect("start a stand-in engine")
            })
            .collect(),
    );
    for ip in &ips {
        let addr: std::net::SocketAddr = format!("{ip}:{port}").parse().expect("addr");
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        while tokio::net::TcpStream::connect(addr).await.is_err() {
            assert!(tokio::time::Instant::now() < deadline, "engine on {addr}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    let dir = tempfile::tempdir().expect("dir");
    let cluster = Arc::new(Mutex::new(Cluster {
        pod_ips: ips.clone(),
        ..Cluster::default()
    }));
    {
        let mut c = cluster.lock();
        c.put_resource(
            "servingapps",
            "llm",
            json!({
                "image": "registry.example/vllm:1",
                "concurrency": 64,
                "kubernetes": {"port": port},
                "health": {"path": "/health"},
                "autoscale": {"min": ENGINES, "max": ENGINES},
                "routing": {"policy": "prefix"},
            }),
        );
        c.pending.clear();
    }
    let (leader, reconciling, server) = kube_mock::leader_on(&cluster, &dir.path().join("leader"));
    leader.set_peer_token(TOKEN.into());
    let leader_ticks = warmgate_gateway::runtime::autoscale::spawn(&leader);
    let leader_addr = serve(warmgate_gateway::router(leader.clone())).await;
    let ready = |gw: &warmgate_gateway::Gateway| {
        gw.status_report()
            .apps
            .iter()
            .find(|a| a.name == "llm")
            .is_some_and(|a| a.ready >= ENGINES)
    };
    eventually("four engines ready on the leader", || {
        ready(&leader).then_some(())
    })
    .await;

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
    let reports = tokio::spawn(follower::follow(
        follower.clone(),
        "operator-1".into(),
        found,
        move || async move { Some(leader_addr) },
    ));
    eventually("four engines ready on the follower", || {
        ready(&follower).then_some(())
    })
    .await;

    // One gateway takes all the traffic of one set of prompts; then the
    // two share another set, request by request.
    let one = cached_ratio(&[leader_addr], 1).await;
    let two = cached_ratio(&[leader_addr, follower_addr], 2).await;
    eprintln!(
        "cached-token ratio: one gateway {one:.3}, two gateways {two:.3} ({:.2}×)",
        two / one
    );
    assert!(one > 0.75, "one gateway cached {one:.3}");
    assert!(
        two >= 0.8 * one,
        "two gateways cached {two:.3} against {one:.3}"
    );

    for t in [server, leader_ticks, reconciling, follower_ticks, reports] {
        t.abort();
    }
    drop(engines);
}
