//! The custom resources: the committed YAML is what `warmgate crds`
//! prints, every manifest reads as the Kubernetes types, and a TOML app
//! definition and its ServingApp are the same spec.

use std::path::Path;

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use warmgate_deploy::Config;
use warmgate_deploy::crd::{ServingApp, WarmPool, crds_yaml};

fn repo(path: &str) -> String {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(path);
    std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("read {}: {e}", p.display()))
}

#[test]
fn the_committed_crds_are_the_generated_ones() {
    let generated = crds_yaml().expect("the CRDs serialise");
    let committed = repo("deploy/kubernetes/chart/warmgate/crds/crds.yaml");
    assert!(
        generated == committed,
        "deploy/kubernetes/chart/warmgate/crds/crds.yaml is out of date: run \
         `cargo run -p warmgate-gateway -- crds > deploy/kubernetes/chart/warmgate/crds/crds.yaml`"
    );
}

#[test]
fn the_crds_read_as_kubernetes_crds_with_a_status_subresource() {
    let crds: Vec<CustomResourceDefinition> =
        serde_saphyr::from_multiple(&repo("deploy/kubernetes/chart/warmgate/crds/crds.yaml"))
            .expect("CRDs");
    let kinds: Vec<&str> = crds.iter().map(|c| c.spec.names.kind.as_str()).collect();
    assert_eq!(kinds, ["ServingApp", "WarmPool"]);
    for crd in &crds {
        assert_eq!(crd.spec.group, "warmgate.dev");
        assert_eq!(crd.spec.scope, "Namespaced");
        let v = &crd.spec.versions[0];
        assert!(v.served && v.storage);
        assert!(
            v.subresources
                .as_ref()
                .and_then(|s| s.status.as_ref())
                .is_some(),
            "{} has a status subresource",
            crd.spec.names.kind
        );
        let schema = v
            .schema
            .as_ref()
            .and_then(|s| s.open_api_v3_schema.as_ref());
        let props = schema
            .and_then(|s| s.properties.as_ref())
            .expect("properties");
        assert!(props.contains_key("spec") && props.contains_key("status"));
    }
}

#[test]
fn a_toml_app_and_its_serving_app_are_the_same_spec() {
    let config = Config::parse(
        &repo("examples/configs/kubernetes.toml"),
        Path::new("kubernetes.toml"),
        Path::new("/"),
    )
    .expect("the example config is valid");
    let text = repo("deploy/kubernetes/examples/quickstart.yaml");
    let docs: Vec<serde_json::Value> = serde_saphyr::from_multiple(&text).expect("YAML");
    let app: ServingApp = serde_json::from_value(docs[0].clone()).expect("a ServingApp");
    let pool: WarmPool = serde_json::from_value(docs[1].clone()).expect("a WarmPool");
    let mut spec = app.spec.clone();
    spec.name = app.metadata.name.clone().expect("name");
    assert_eq!(spec, config.apps[0]);
    let mut spec = pool.spec.clone();
    spec.name = pool.metadata.name.clone().expect("name");
    assert_eq!(spec, config.pools[0]);
}
