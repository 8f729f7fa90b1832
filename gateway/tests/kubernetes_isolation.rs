//! The gateway on the Kubernetes backend against a mocked API server
//! (`tower_test`): a change to one app (as the operator applies a changed
//! `ServingApp`), a new app, and a deleted app touch only their own pods.
//! Every call the gateway makes is answered and recorded by the mock in
//! `kube_mock`; nothing here has met a real API server.

mod kube_mock;

use std::sync::Arc;
use std::time::Duration;

use http::StatusCode;
use kube_mock::{Cluster, NS, calls_about, eventually, healthz_server, pods_of, ready};
use parking_lot::Mutex;
use warmgate_deploy::Config;
use warmgate_pool::kubernetes::{KubeBackend, KubeSettings};

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
        let cluster = Arc::new(Mutex::new(Cluster::default()));
        let (client, server) = kube_mock::client(&cluster);
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
        .changes()
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
        .changes()
        .apply_file(config(port, &state, &[("a", "1"), ("b", "2"), ("c", "1")]))
        .await;
    assert!(added.iter().all(|c| c.outcome.is_ok()), "{added:?}");
    eventually("c is ready", || ready(&gw, "c").then_some(())).await;
    // c deleted again: its pod goes, nothing else.
    let gone = gw
        .changes()
        .apply_file(config(port, &state, &[("a", "1"), ("b", "2")]))
        .await;
    assert!(gone.iter().all(|c| c.outcome.is_ok()), "{gone:?}");
    eventually("c's pod is deleted", || {
        pods_of(&cluster, "c").is_empty().then_some(())
    })
    .await;

    // Through all of it, a's pod was neither deleted nor made again.
    kube_mock::assert_untouched(&cluster, mark, "a", &a_pods);
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
        .changes()
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
