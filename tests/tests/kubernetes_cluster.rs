//! The kubernetes backend and operator on a real cluster (kind or k3d, no
//! GPUs needed). Not run in CI: no cluster can run there. Run it with the
//! commands in `docs/kubernetes.md` ("A real-cluster test"):
//!
//! ```sh
//! kubectl port-forward svc/wg 8080:8080 &
//! cargo nextest run -p warmgate-e2e --test kubernetes_cluster --run-ignored only
//! ```

use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use serde_json::json;
use warmgate_deploy::crd::ServingApp;

const NAME: &str = "e2e-echo";
/// Pods start slower than processes: image pulls, scheduling.
const WAIT: Duration = Duration::from_secs(180);

async fn eventually<T, F, Fut>(what: &str, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = Instant::now() + WAIT;
    loop {
        if let Some(v) = check().await {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out waiting for: {what}");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

#[tokio::test]
#[ignore = "needs a cluster"]
async fn a_serving_app_runs_as_pods_serves_and_is_cleaned_up() {
    let client = kube::Client::try_default().await.expect("a kubeconfig");
    let ns = std::env::var("WARMGATE_TEST_NAMESPACE").unwrap_or_else(|_| "default".into());
    let gateway =
        std::env::var("WARMGATE_GATEWAY").unwrap_or_else(|_| "http://127.0.0.1:8080".into());
    let image = std::env::var("WARMGATE_TEST_WORKER_IMAGE")
        .unwrap_or_else(|_| "warmgate/test-worker:dev".into());
    let apps: Api<ServingApp> = Api::namespaced(client.clone(), &ns);
    let pods: Api<Pod> = Api::namespaced(client, &ns);
    let _ = apps.delete(NAME, &DeleteParams::default()).await;

    let app: ServingApp = serde_json::from_value(json!({
        "apiVersion": "warmgate.dev/v1alpha1", "kind": "ServingApp",
        "metadata": {"name": NAME},
        "spec": {"image": image, "autoscale": {"min": 1, "max": 2},
                 "kubernetes": {"cpu": "100m", "memory": "64Mi"}},
    }))
    .expect("a ServingApp");
    apps.create(&PostParams::default(), &app)
        .await
        .expect("created");

    // The operator starts a pod with the app's labels, owned by the app.
    let selector = format!("warmgate.dev/app={NAME}");
    let pod = eventually("a replica pod", || async {
        pods.list(&ListParams::default().labels(&selector))
            .await
            .ok()
            .and_then(|l| l.items.into_iter().next())
    })
    .await;
    let owner = &pod.metadata.owner_references.as_ref().expect("owned")[0];
    assert_eq!(
        (owner.kind.as_str(), owner.name.as_str()),
        ("ServingApp", NAME)
    );

    // It serves through the gateway, and the status says so.
    let http = reqwest::Client::new();
    let replica = eventually("a request served by the pod", || async {
        let r = http
            .get(format!("{gateway}/apps/{NAME}/hello"))
            .send()
            .await
            .ok()?;
        if r.status() != 200 {
            return None;
        }
        r.headers()
            .get("x-warmgate-replica")?
            .to_str()
            .ok()
            .map(str::to_string)
    })
    .await;
    assert!(replica.starts_with(NAME), "{replica}");
    eventually("status.replicas.ready = 1", || async {
        let a = apps.get(NAME).await.ok()?;
        (a.status?.replicas.ready == 1).then_some(())
    })
    .await;

    // Deleting the app deletes its pods (owner references).
    apps.delete(NAME, &DeleteParams::default())
        .await
        .expect("deleted");
    eventually("the pods are gone", || async {
        let l = pods
            .list(&ListParams::default().labels(&selector))
            .await
            .ok()?;
        l.items.is_empty().then_some(())
    })
    .await;
}
