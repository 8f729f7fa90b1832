//! The Helm chart: every template, rendered with the chart's values by a
//! Go-template engine (gtmpl, with the Sprig and Helm functions the chart
//! uses: `toYaml`, `indent`, `randAlphaNum`, `b64enc` and `lookup`),
//! must read as its Kubernetes type, and the RBAC must grant exactly what
//! the operator calls. No Helm binary can be installed here, so this is
//! the check that runs in CI; `helm template` on a workstation renders the
//! same text.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use base64::Engine as _;
use gtmpl_value::{FuncError, Value as Tv};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ConfigMap, Secret, Service, ServiceAccount};
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

/// Sprig's `randAlphaNum N`.
fn rand_alpha_num(args: &[Tv]) -> Result<Tv, FuncError> {
    let [n] = args else {
        return Err(FuncError::ExactlyXArgs("randAlphaNum".into(), 1));
    };
    let n: usize = n
        .to_string()
        .parse()
        .map_err(|_| FuncError::UnableToConvertFromValue)?;
    Ok(Tv::String(
        std::iter::repeat_with(fastrand::alphanumeric)
            .take(n)
            .collect(),
    ))
}

/// Sprig's `b64enc`.
fn b64enc(args: &[Tv]) -> Result<Tv, FuncError> {
    let [Tv::String(s)] = args else {
        return Err(FuncError::ExactlyXArgs("b64enc".into(), 1));
    };
    Ok(Tv::String(
        base64::engine::general_purpose::STANDARD.encode(s),
    ))
}

/// Helm's `lookup` without a cluster (as `helm template` and a first
/// install see it): nothing exists.
fn lookup_nothing(args: &[Tv]) -> Result<Tv, FuncError> {
    if args.len() != 4 {
        return Err(FuncError::ExactlyXArgs("lookup".into(), 4));
    }
    Ok(Tv::Map(HashMap::new()))
}

/// The generated token already in the cluster (an upgrade).
const KEPT_TOKEN: &str = "a-token-made-at-install";

/// Helm's `lookup` on an upgrade: the Secret made at install exists.
fn lookup_existing(args: &[Tv]) -> Result<Tv, FuncError> {
    let [kind_version, kind, ns, name] = args else {
        return Err(FuncError::ExactlyXArgs("lookup".into(), 4));
    };
    let found = kind_version.to_string() == "v1"
        && kind.to_string() == "Secret"
        && ns.to_string() == "ml"
        && name.to_string() == "wg-admin-token";
    if !found {
        return Ok(Tv::Map(HashMap::new()));
    }
    let secret = serde_json::json!({
        "apiVersion": "v1", "kind": "Secret",
        "metadata": {"name": "wg-admin-token", "namespace": "ml"},
        "data": {"token": base64::engine::general_purpose::STANDARD.encode(KEPT_TOKEN)},
    });
    Ok(to_tv(&secret))
}

/// Renders one template as `helm template wg . --namespace ml` would.
fn render(name: &str, values: &Value) -> String {
    render_with(name, values, lookup_nothing)
}

/// [`render`] with a given `lookup`.
fn render_with(name: &str, values: &Value, lookup: gtmpl_value::Func) -> String {
    let text = std::fs::read_to_string(chart().join("templates").join(name)).expect("template");
    let mut t = gtmpl::Template::default();
    t.add_func("toYaml", to_yaml);
    t.add_func("indent", indent);
    t.add_func("randAlphaNum", rand_alpha_num);
    t.add_func("b64enc", b64enc);
    t.add_func("lookup", lookup);
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
    let _: Secret = read("secret.yaml", &v);
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
            "secret.yaml",
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

/// The `WARMGATE_ADMIN_TOKEN` variable of the operator's container: the
/// Secret's name and key it comes from.
fn token_source(dep: Deployment) -> (String, String) {
    let env = dep.spec.template.spec.expect("pod").containers[0]
        .env
        .clone()
        .expect("env");
    let token = env
        .iter()
        .find(|e| e.name == "WARMGATE_ADMIN_TOKEN")
        .expect("the token variable is always set");
    let secret = token
        .value_from
        .as_ref()
        .and_then(|f| f.secret_key_ref.as_ref())
        .expect("from a secret");
    (secret.name.clone(), secret.key.clone())
}

#[test]
fn the_admin_token_comes_from_a_secret_when_named() {
    let mut v = values();
    v["adminTokenSecret"] = Value::String("wg-admin".into());
    let dep: Deployment = read("deployment.yaml", &v);
    assert_eq!(token_source(dep), ("wg-admin".into(), "token".into()));
    // Then the chart makes no Secret of its own.
    assert!(
        render("secret.yaml", &v).trim().is_empty(),
        "{}",
        render("secret.yaml", &v)
    );
}

#[test]
fn without_a_named_secret_the_chart_generates_a_token_and_keeps_it() {
    let v = values();
    assert_eq!(v["adminTokenSecret"], "", "the default names no Secret");
    let dep: Deployment = read("deployment.yaml", &v);
    assert_eq!(
        token_source(dep),
        ("wg-admin-token".into(), "token".into()),
        "the operator reads the generated Secret"
    );
    let token = |secret: Secret| -> String {
        assert_eq!(secret.metadata.name.as_deref(), Some("wg-admin-token"));
        assert_eq!(secret.metadata.namespace.as_deref(), Some("ml"));
        let data = secret.data.expect("data");
        String::from_utf8(data["token"].0.clone()).expect("utf-8")
    };
    // A first install: a fresh random token, different each time.
    let first = token(read("secret.yaml", &v));
    assert_eq!(first.len(), 48, "{first}");
    assert!(first.chars().all(|c| c.is_ascii_alphanumeric()), "{first}");
    assert_ne!(first, token(read("secret.yaml", &v)), "random");
    // An upgrade: the token in the cluster is kept.
    let yaml = render_with("secret.yaml", &v, lookup_existing);
    let kept: Secret = serde_saphyr::from_str(&yaml).unwrap_or_else(|e| panic!("{e}\n{yaml}"));
    assert_eq!(token(kept), KEPT_TOKEN);
}

#[test]
fn the_workers_settings_reach_the_operators_config() {
    let config = |v: &Value| {
        let cm: ConfigMap = read("configmap.yaml", v);
        let toml = cm.data.expect("data")["warmgate.toml"].clone();
        warmgate_deploy::Config::parse(&toml, Path::new("warmgate.toml"), Path::new("/"))
            .unwrap_or_else(|e| panic!("{e}\n{toml}"))
    };
    let k = config(&values()).backend.kubernetes;
    assert!(
        k.allowed_service_accounts.is_empty(),
        "no service account by default"
    );
    assert!(!k.run_as_non_root);
    let mut v = values();
    v["workers"]["allowedServiceAccounts"] = serde_json::json!(["llm-reader", "s3-reader"]);
    v["workers"]["runAsNonRoot"] = Value::Bool(true);
    let k = config(&v).backend.kubernetes;
    assert_eq!(k.allowed_service_accounts, ["llm-reader", "s3-reader"]);
    assert!(k.run_as_non_root);
}

#[test]
fn the_operator_runs_locked_down() {
    let dep: Deployment = read("deployment.yaml", &values());
    let pod = dep.spec.template.spec.expect("pod");
    let psc = pod.security_context.expect("pod securityContext");
    assert_eq!(psc.run_as_non_root, Some(true));
    assert_eq!(
        psc.seccomp_profile.map(|p| p.type_).as_deref(),
        Some("RuntimeDefault")
    );
    let c = &pod.containers[0];
    let sc = c
        .security_context
        .clone()
        .expect("container securityContext");
    assert_eq!(sc.allow_privilege_escalation, Some(false));
    assert_eq!(sc.read_only_root_filesystem, Some(true));
    assert_eq!(sc.run_as_non_root, Some(true));
    assert_eq!(sc.privileged, Some(false));
    let caps = sc.capabilities.expect("capabilities");
    assert_eq!(caps.drop.as_deref(), Some(&["ALL".to_string()][..]));
    assert!(caps.add.is_none());
    // With a read-only root, what it writes (its state folder, temporary
    // files) is on emptyDirs.
    let mounts = c.volume_mounts.clone().expect("mounts");
    let volumes = pod.volumes.expect("volumes");
    for path in ["/var/lib/warmgate", "/tmp"] {
        let m = mounts
            .iter()
            .find(|m| m.mount_path == path)
            .unwrap_or_else(|| panic!("{path} is mounted"));
        let vol = volumes
            .iter()
            .find(|v| v.name == m.name)
            .expect("its volume");
        assert!(vol.empty_dir.is_some(), "{path} is an emptyDir");
    }
    let cm: ConfigMap = read("configmap.yaml", &values());
    let toml = &cm.data.expect("data")["warmgate.toml"];
    assert!(
        toml.contains("state_dir = \"/var/lib/warmgate\""),
        "the state folder is the writable mount: {toml}"
    );
}
