//! The Helm chart: every template, rendered with the chart's values by a
//! Go-template engine (gtmpl, with the two Sprig functions the chart uses),
//! must read as its Kubernetes type, and the RBAC must grant exactly what
//! the operator calls. No Helm binary can be installed here, so this is
//! the check that runs in CI; `helm template` on a workstation renders the
//! same text.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use gtmpl_value::{FuncError, Value as Tv};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ConfigMap, Service, ServiceAccount};
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use serde_json::Value;

fn chart() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("kubernetes/chart/warmgate")
}

fn to_tv(v: &Value) -> Tv {
    match v {
        Value::Null => Tv::Nil,
        Value::Bool(b) => Tv::Bool(*b),
        Value::Number(n) => match (n.as_i64(), n.as_f64()) {
            (Some(i), _) => Tv::from(i),
            (None, Some(f)) => Tv::from(f),
            _ => Tv::Nil,
        },
        Value::String(s) => Tv::String(s.clone()),
        Value::Array(a) => Tv::Array(a.iter().map(to_tv).collect()),
        Value::Object(o) => Tv::Map(o.iter().map(|(k, v)| (k.clone(), to_tv(v))).collect()),
    }
}

fn from_tv(v: &Tv) -> Value {
    match v {
        Tv::Nil | Tv::NoValue | Tv::Function(_) => Value::Null,
        Tv::Bool(b) => Value::Bool(*b),
        Tv::String(s) => Value::String(s.clone()),
        Tv::Number(n) => serde_json::from_str(&n.to_string()).unwrap_or(Value::Null),
        Tv::Array(a) => Value::Array(a.iter().map(from_tv).collect()),
        Tv::Map(m) | Tv::Object(m) => {
            Value::Object(m.iter().map(|(k, v)| (k.clone(), from_tv(v))).collect())
        }
    }
}

/// Sprig's `toYaml`.
fn to_yaml(args: &[Tv]) -> Result<Tv, FuncError> {
    let v = args
        .first()
        .ok_or_else(|| FuncError::ExactlyXArgs("toYaml".into(), 1))?;
    serde_saphyr::to_string(&from_tv(v))
        .map(|s| Tv::String(s.trim_end().to_string()))
        .map_err(|e| FuncError::Generic(e.to_string()))
}

/// Sprig's `indent N TEXT` (as a pipeline: `TEXT | indent N`).
fn indent(args: &[Tv]) -> Result<Tv, FuncError> {
    let [n, text] = args else {
        return Err(FuncError::ExactlyXArgs("indent".into(), 2));
    };
    let n: usize = n
        .to_string()
        .parse()
        .map_err(|_| FuncError::UnableToConvertFromValue)?;
    let pad = " ".repeat(n);
    let text = match text {
        Tv::String(s) => s.clone(),
        other => other.to_string(),
    };
    Ok(Tv::String(
        text.lines()
            .map(|l| format!("{pad}{l}"))
            .collect::<Vec<_>>()
            .join("\n"),
    ))
}

/// Renders one template as `helm template wg . --namespace ml` would.
fn render(name: &str, values: &Value) -> String {
    let text = std::fs::read_to_string(chart().join("templates").join(name)).expect("template");
    let mut t = gtmpl::Template::default();
    t.add_func("toYaml", to_yaml);
    t.add_func("indent", indent);
    t.parse(text).unwrap_or_else(|e| panic!("{name}: {e}"));
    let mut ctx = HashMap::new();
    ctx.insert("Values".to_string(), to_tv(values));
    ctx.insert(
        "Release".to_string(),
        to_tv(&serde_json::json!({"Name": "wg", "Namespace": "ml"})),
    );
    t.render(&gtmpl::Context::from(Tv::Map(ctx)))
        .unwrap_or_else(|e| panic!("{name}: {e}"))
}

fn values() -> Value {
    let text = std::fs::read_to_string(chart().join("values.yaml")).expect("values");
    serde_saphyr::from_str(&text).expect("values.yaml is YAML")
}

fn read<T: serde::de::DeserializeOwned>(name: &str, values: &Value) -> T {
    let yaml = render(name, values);
    serde_saphyr::from_str(&yaml)
        .unwrap_or_else(|e| panic!("{name} does not read as its type: {e}\n{yaml}"))
}

#[test]
fn every_template_reads_as_its_kubernetes_type() {
    let v = values();
    let sa: ServiceAccount = read("serviceaccount.yaml", &v);
    let role: Role = read("role.yaml", &v);
    let binding: RoleBinding = read("rolebinding.yaml", &v);
    let cm: ConfigMap = read("configmap.yaml", &v);
    let svc: Service = read("service.yaml", &v);
    let dep: Deployment = read("deployment.yaml", &v);
    let mut files: Vec<String> = std::fs::read_dir(chart().join("templates"))
        .expect("templates")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    files.sort();
    assert_eq!(
        files,
        [
            "configmap.yaml",
            "deployment.yaml",
            "role.yaml",
            "rolebinding.yaml",
            "service.yaml",
            "serviceaccount.yaml"
        ],
        "a new template needs a check here"
    );

    // The operator runs as the service account the binding names.
    let spec = dep.spec.template.spec.expect("pod spec");
    assert_eq!(spec.service_account_name.as_deref(), Some("wg"));
    assert_eq!(sa.metadata.name.as_deref(), Some("wg"));
    assert_eq!(binding.role_ref.name, "wg");
    assert_eq!(binding.subjects.expect("subjects")[0].name, "wg");
    let c = &spec.containers[0];
    assert_eq!(c.image.as_deref(), Some("ghcr.io/warmgate/warmgate:0.1.0"));
    assert_eq!(c.args.as_ref().expect("args")[0], "operator");
    assert_eq!(
        c.readiness_probe
            .as_ref()
            .and_then(|p| p.http_get.as_ref())
            .and_then(|g| g.path.as_deref()),
        Some("/readyz"),
        "standby replicas are not ready, so the Service sends them nothing"
    );
    let limits = c
        .resources
        .as_ref()
        .and_then(|r| r.limits.as_ref())
        .expect("limits");
    assert_eq!(limits["memory"].0, "1Gi");
    assert_eq!(svc.spec.expect("spec").ports.expect("ports")[0].port, 8080);

    // The config file is a valid settings-only config that advertises the
    // Service to the replica pods.
    let toml = &cm.data.expect("data")["warmgate.toml"];
    let config = warmgate_deploy::Config::parse(toml, Path::new("warmgate.toml"), Path::new("/"))
        .unwrap_or_else(|e| panic!("{e}\n{toml}"));
    assert!(config.apps.is_empty() && config.pools.is_empty());
    assert_eq!(
        config.backend.kubernetes.advertise.as_deref(),
        Some("wg.ml.svc:8080")
    );

    // Least privilege: exactly the calls the operator makes.
    let rules = role.rules.expect("rules");
    let grants = |group: &str, resource: &str| -> Vec<String> {
        rules
            .iter()
            .filter(|r| {
                r.api_groups
                    .as_deref()
                    .unwrap_or(&[])
                    .iter()
                    .any(|g| g == group)
            })
            .filter(|r| {
                r.resources
                    .as_deref()
                    .unwrap_or(&[])
                    .iter()
                    .any(|x| x == resource)
            })
            .flat_map(|r| r.verbs.clone())
            .collect()
    };
    let mut pods = grants("", "pods");
    pods.sort();
    assert_eq!(pods, ["create", "delete", "get", "list", "watch"]);
    assert!(grants("warmgate.dev", "servingapps/status").contains(&"patch".to_string()));
    assert!(!grants("warmgate.dev", "servingapps").contains(&"delete".to_string()));
    assert!(grants("coordination.k8s.io", "leases").contains(&"update".to_string()));
    assert!(grants("", "secrets").is_empty(), "no access to secrets");
}

#[test]
fn the_admin_token_comes_from_a_secret_when_named() {
    let mut v = values();
    v["adminTokenSecret"] = Value::String("wg-admin".into());
    let dep: Deployment = read("deployment.yaml", &v);
    let env = dep.spec.template.spec.expect("pod").containers[0]
        .env
        .clone()
        .expect("env");
    let token = env
        .iter()
        .find(|e| e.name == "WARMGATE_ADMIN_TOKEN")
        .expect("token variable");
    let secret = token
        .value_from
        .as_ref()
        .and_then(|f| f.secret_key_ref.as_ref())
        .expect("from a secret");
    assert_eq!(secret.name, "wg-admin");
    // And without one, no variable at all.
    let dep: Deployment = read("deployment.yaml", &values());
    let env = dep.spec.template.spec.expect("pod").containers[0]
        .env
        .clone()
        .expect("env");
    assert!(env.iter().all(|e| e.name != "WARMGATE_ADMIN_TOKEN"));
}
