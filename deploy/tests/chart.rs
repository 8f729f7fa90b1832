//! The Helm chart, rendered by the real `helm` (v4, from npm: see
//! `deploy/kubernetes/fetch-helm.sh`, which `make test` and `.ci/run`
//! call): `helm lint` passes, every template reads as its Kubernetes type
//! and validates against the Kubernetes schemas (`kubernetes-validate
//! --strict`, from PyPI), the RBAC grants exactly what the operator calls,
//! and the config file the chart writes is one the operator accepts.
//!
//! One check still renders with a Go-template engine (gtmpl): an upgrade
//! that keeps the admin token already in the cluster needs `lookup` to
//! find it, and `helm template` has no cluster to look in.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use base64::Engine as _;
use gtmpl_value::{FuncError, Value as Tv};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ConfigMap, Pod, Secret, Service, ServiceAccount};
use k8s_openapi::api::networking::v1::NetworkPolicy;
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

/// The `helm` binary: `$WARMGATE_HELM`, or the one `fetch-helm.sh` put
/// under `target/tools`.
fn helm() -> PathBuf {
    if let Some(p) = std::env::var_os("WARMGATE_HELM") {
        return PathBuf::from(p);
    }
    let fetched = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/tools/helm/helm");
    assert!(
        fetched.exists(),
        "no helm: run `bash deploy/kubernetes/fetch-helm.sh` (make test does) or set WARMGATE_HELM"
    );
    fetched
}

/// `helm template wg CHART --namespace ml` with `values`, limited to the
/// template `name` (all of them with `None`): its output, or helm's error.
fn helm_template(name: Option<&str>, values: &Value) -> Result<String, String> {
    let dir = tempfile::tempdir().expect("tmp");
    let file = dir.path().join("values.json");
    std::fs::write(&file, values.to_string()).expect("write values");
    let mut cmd = std::process::Command::new(helm());
    cmd.args(["template", "wg"])
        .arg(chart())
        .args(["--namespace", "ml", "-f"])
        .arg(&file);
    if let Some(n) = name {
        cmd.args(["--show-only", &format!("templates/{n}")]);
    }
    let out = cmd.output().expect("run helm");
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else if stderr.contains("could not find template") {
        // A template that renders nothing (a condition left it empty).
        Ok(String::new())
    } else {
        Err(stderr)
    }
}

/// Renders one template as `helm template wg . --namespace ml` does.
fn render(name: &str, values: &Value) -> String {
    helm_template(Some(name), values).unwrap_or_else(|e| panic!("{name}: {e}"))
}

/// [`render`] by gtmpl with a given `lookup` (helm's needs a cluster).
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
    let state: Secret = read("state-secret.yaml", &v);
    let test: Pod = read("tests/connection.yaml", &v);
    assert_eq!(
        test.metadata.annotations.expect("annotations")["helm.sh/hook"],
        "test"
    );
    assert!(
        render("servicemonitor.yaml", &v).trim().is_empty(),
        "no ServiceMonitor unless asked"
    );
    // The weights cache's claim: see the_weights_cache_can_be_a_persistent_volume.
    let mut files: Vec<String> = std::fs::read_dir(chart().join("templates"))
        .expect("templates")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    files.sort();
    assert_eq!(
        files,
        [
            "NOTES.txt",
            "_helpers.tpl",
            "configmap.yaml",
            "deployment.yaml",
            "networkpolicy.yaml",
            "pvc.yaml",
            "role.yaml",
            "rolebinding.yaml",
            "secret.yaml",
            "service.yaml",
            "serviceaccount.yaml",
            "servicemonitor.yaml",
            "state-secret.yaml",
            "tests"
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
    assert_eq!(pods, ["create", "delete", "get", "list", "patch", "watch"]);
    assert!(grants("warmgate.dev", "servingapps/status").contains(&"patch".to_string()));
    assert!(!grants("warmgate.dev", "servingapps").contains(&"delete".to_string()));
    assert!(grants("coordination.k8s.io", "leases").contains(&"update".to_string()));
    // Events about the resources: written (and folded into series), never read.
    let mut events = grants("events.k8s.io", "events");
    events.sort();
    assert_eq!(events, ["create", "patch"]);
    // Secrets: the one that holds the revision histories, read and
    // written by name, and no other (no list, no watch).
    let secret_rules: Vec<_> = rules
        .iter()
        .filter(|r| {
            r.resources
                .as_deref()
                .unwrap_or(&[])
                .iter()
                .any(|x| x == "secrets")
        })
        .collect();
    assert_eq!(secret_rules.len(), 1);
    assert_eq!(
        secret_rules[0].resource_names.as_deref(),
        Some(&["wg-state".to_string()][..])
    );
    let mut verbs = secret_rules[0].verbs.clone();
    verbs.sort();
    assert_eq!(verbs, ["create", "get", "patch"]);
    // The chart makes it empty and keeps it on uninstall; the operator is
    // told its name.
    assert_eq!(state.metadata.name.as_deref(), Some("wg-state"));
    assert!(state.data.is_none(), "the chart never writes the histories");
    assert_eq!(
        state.metadata.annotations.expect("annotations")["helm.sh/resource-policy"],
        "keep"
    );
    let env = c.env.clone().expect("env");
    assert!(
        env.iter()
            .any(|e| e.name == "WARMGATE_STATE_SECRET" && e.value.as_deref() == Some("wg-state"))
    );
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

#[test]
fn helm_lints_the_chart_and_every_manifest_validates_against_kubernetes() {
    let out = std::process::Command::new(helm())
        .args(["lint", "--strict"])
        .arg(chart())
        .output()
        .expect("run helm lint");
    assert!(
        out.status.success(),
        "helm lint: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let validator = std::env::var("WARMGATE_KUBE_VALIDATE")
        .unwrap_or_else(|_| "kubernetes-validate".to_string());
    let mut named = values();
    named["adminTokenSecret"] = Value::String("wg-admin".into());
    named["workers"]["allowedServiceAccounts"] = serde_json::json!(["s3-reader"]);
    named["backendKubernetes"] = serde_json::json!({"image_pull_policy": "Always"});
    named["serviceAccount"]["annotations"] =
        serde_json::json!({"iam.gke.io/gcp-service-account": "ckpt@p.iam"});
    named["extraEnvFrom"] = serde_json::json!([{"secretRef": {"name": "s3-credentials"}}]);
    named["extraEnv"] = serde_json::json!([{"name": "AWS_REGION", "value": "us-east-1"}]);
    named["imagePullSecrets"] = serde_json::json!([{"name": "registry"}]);
    named["tolerations"] = serde_json::json!([{"key": "dedicated", "operator": "Exists"}]);
    named["networkPolicy"]["allowFrom"] =
        serde_json::json!([{"namespaceSelector": {"matchLabels": {"name": "monitoring"}}}]);
    let mut cached = values();
    cached["weightsCache"]["persistence"] = serde_json::json!({
        "enabled": true, "existingClaim": "", "size": "500Gi",
        "storageClassName": "fast-ssd", "accessMode": "ReadWriteMany"});
    for (what, v) in [
        ("defaults", values()),
        ("a named secret and more keys", named),
        ("a persistent weights cache", cached),
    ] {
        let all = helm_template(None, &v).unwrap_or_else(|e| panic!("{what}: {e}"));
        let dir = tempfile::tempdir().expect("tmp");
        let file = dir.path().join("rendered.yaml");
        std::fs::write(&file, &all).expect("write");
        let out = std::process::Command::new(&validator)
            .args(["--strict", "--quiet"])
            .arg(&file)
            .output()
            .unwrap_or_else(|e| {
                panic!(
                    "cannot run {validator} ({e}): `pip install kubernetes-validate` (.ci/run does)"
                )
            });
        assert!(
            out.status.success(),
            "{what}: the manifests do not validate:\n{}{}\n{all}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

#[test]
fn settings_cannot_define_the_charts_own_table_and_its_keys_have_their_value() {
    // TOML defines a table once: before, this made a config the operator
    // could not read; now helm refuses it and says where the keys go.
    let mut v = values();
    v["settings"] = Value::String(
        "[limits]\nmax_connections = 5\n [backend.kubernetes]\nimage_pull_policy = \"Always\"\n"
            .into(),
    );
    let err = helm_template(Some("configmap.yaml"), &v).expect_err("a second [backend.kubernetes]");
    assert!(err.contains("backendKubernetes"), "{err}");
    // The same key through the value the chart offers for it.
    let mut v = values();
    v["backendKubernetes"] = serde_json::json!({"image_pull_policy": "Always"});
    let cm: ConfigMap = read("configmap.yaml", &v);
    let toml = cm.data.expect("data")["warmgate.toml"].clone();
    let config = warmgate_deploy::Config::parse(&toml, Path::new("warmgate.toml"), Path::new("/"))
        .unwrap_or_else(|e| panic!("{e}\n{toml}"));
    assert_eq!(
        config.backend.kubernetes.image_pull_policy.as_deref(),
        Some("Always")
    );
    assert_eq!(
        config.backend.kubernetes.advertise.as_deref(),
        Some("wg.ml.svc:8080")
    );
}

#[test]
fn the_values_platform_teams_need_reach_the_operators_pods() {
    let mut v = values();
    v["serviceAccount"]["annotations"] =
        serde_json::json!({"eks.amazonaws.com/role-arn": "arn:aws:iam::1:role/ckpt"});
    v["extraEnvFrom"] = serde_json::json!([{"secretRef": {"name": "s3-credentials"}}]);
    v["extraEnv"] = serde_json::json!([{"name": "AWS_REGION", "value": "us-east-1"}]);
    v["imagePullSecrets"] = serde_json::json!([{"name": "registry"}]);
    v["nodeSelector"] = serde_json::json!({"pool": "cpu"});
    v["tolerations"] = serde_json::json!([{"key": "dedicated", "operator": "Exists"}]);
    v["podAnnotations"] = serde_json::json!({"team": "ml"});
    v["serviceMonitor"]["enabled"] = Value::Bool(true);
    let sa: ServiceAccount = read("serviceaccount.yaml", &v);
    assert_eq!(
        sa.metadata.annotations.expect("annotations")["eks.amazonaws.com/role-arn"],
        "arn:aws:iam::1:role/ckpt"
    );
    let dep: Deployment = read("deployment.yaml", &v);
    let pod = dep.spec.template;
    let ann = pod
        .metadata
        .expect("meta")
        .annotations
        .expect("annotations");
    assert_eq!(ann["team"], "ml");
    assert_eq!(ann["checksum/config"].len(), 64, "a sha256 of the config");
    let spec = pod.spec.expect("pod");
    assert_eq!(
        spec.image_pull_secrets.expect("pull secrets")[0].name,
        "registry"
    );
    assert_eq!(spec.node_selector.expect("nodeSelector")["pool"], "cpu");
    assert_eq!(spec.tolerations.expect("tolerations").len(), 1);
    let c = &spec.containers[0];
    assert_eq!(
        c.env_from.as_ref().expect("envFrom")[0]
            .secret_ref
            .as_ref()
            .map(|r| r.name.as_str()),
        Some("s3-credentials")
    );
    let env = c.env.as_ref().expect("env");
    assert!(env.iter().any(|e| e.name == "AWS_REGION"));
    assert!(
        env.iter().any(|e| e.name == "WARMGATE_ADMIN_TOKEN"),
        "the chart's own stay"
    );
    let sm = render("servicemonitor.yaml", &v);
    assert!(
        sm.contains("kind: ServiceMonitor") && sm.contains("path: /metrics"),
        "{sm}"
    );

    // A changed config changes the checksum, so the pods roll.
    let mut other = v.clone();
    other["settings"] = Value::String("[limits]\nmax_connections = 7\n".into());
    let dep2: Deployment = read("deployment.yaml", &other);
    let ann2 = dep2
        .spec
        .template
        .metadata
        .expect("meta")
        .annotations
        .expect("ann");
    assert_ne!(ann["checksum/config"], ann2["checksum/config"]);

    // An existing service account instead of the chart's own.
    let mut v = values();
    v["serviceAccount"] =
        serde_json::json!({"create": false, "name": "platform-sa", "annotations": {}});
    assert!(render("serviceaccount.yaml", &v).trim().is_empty());
    let dep: Deployment = read("deployment.yaml", &v);
    assert_eq!(
        dep.spec
            .template
            .spec
            .expect("pod")
            .service_account_name
            .as_deref(),
        Some("platform-sa")
    );
    let binding: RoleBinding = read("rolebinding.yaml", &v);
    assert_eq!(binding.subjects.expect("subjects")[0].name, "platform-sa");
    v["serviceAccount"]["name"] = Value::String(String::new());
    let err = helm_template(Some("deployment.yaml"), &v).expect_err("no name");
    assert!(err.contains("serviceAccount.name is required"), "{err}");
}

/// The weights cache survives a restart as a claim of its own (or one the
/// platform team made), mounted where the gateway keeps its cache; by
/// default it is an emptyDir and there is no claim.
#[test]
fn the_weights_cache_can_be_a_persistent_volume() {
    let v = values();
    assert_eq!(render("pvc.yaml", &v).trim(), "", "no claim by default");
    let dep: Deployment = read("deployment.yaml", &v);
    let spec = dep.spec.template.spec.expect("pod");
    assert!(
        spec.volumes
            .unwrap_or_default()
            .iter()
            .all(|vol| vol.persistent_volume_claim.is_none())
    );

    let mut on = values();
    on["weightsCache"]["persistence"]["enabled"] = Value::Bool(true);
    on["weightsCache"]["persistence"]["size"] = Value::String("500Gi".into());
    on["weightsCache"]["persistence"]["storageClassName"] = Value::String("fast-ssd".into());
    let pvc: k8s_openapi::api::core::v1::PersistentVolumeClaim = read("pvc.yaml", &on);
    assert_eq!(pvc.metadata.name.as_deref(), Some("wg-weights-cache"));
    let pspec = pvc.spec.expect("spec");
    assert_eq!(pspec.storage_class_name.as_deref(), Some("fast-ssd"));
    assert_eq!(
        pspec
            .resources
            .expect("resources")
            .requests
            .expect("requests")["storage"]
            .0,
        "500Gi"
    );
    let dep: Deployment = read("deployment.yaml", &on);
    let spec = dep.spec.template.spec.expect("pod");
    let claim = spec
        .volumes
        .unwrap_or_default()
        .into_iter()
        .find_map(|vol| vol.persistent_volume_claim)
        .expect("the claim is a volume");
    assert_eq!(claim.claim_name, "wg-weights-cache");
    let mounts = spec.containers[0].volume_mounts.clone().unwrap_or_default();
    assert!(
        mounts
            .iter()
            .any(|m| m.mount_path == "/var/lib/warmgate/cache"),
        "{mounts:?}"
    );

    // A claim of the platform team's: mounted, and the chart makes none.
    on["weightsCache"]["persistence"]["existingClaim"] = Value::String("models".into());
    assert_eq!(render("pvc.yaml", &on).trim(), "");
    let dep: Deployment = read("deployment.yaml", &on);
    let spec = dep.spec.template.spec.expect("pod");
    assert!(spec.volumes.unwrap_or_default().iter().any(|vol| {
        vol.persistent_volume_claim
            .as_ref()
            .is_some_and(|c| c.claim_name == "models")
    }));
}

#[test]
fn a_tls_secret_is_mounted_served_and_workers_keep_a_plain_port() {
    let mut v = values();
    v["tls"]["secretName"] = Value::String("gw-cert".into());
    v["serviceMonitor"]["enabled"] = Value::Bool(true);
    // The operator's config serves HTTPS from the mounted Secret, and
    // workers read weights from the plain port the Service names.
    let cm: ConfigMap = read("configmap.yaml", &v);
    let toml = cm.data.expect("data")["warmgate.toml"].clone();
    let mut config =
        warmgate_deploy::Config::parse(&toml, Path::new("warmgate.toml"), Path::new("/"))
            .unwrap_or_else(|e| panic!("{e}\n{toml}"));
    config.backend.kind = warmgate_deploy::BackendKind::Kubernetes;
    config
        .validate()
        .unwrap_or_else(|e| panic!("{e:?}\n{toml}"));
    let tls = config.tls.as_ref().expect("a [tls] table");
    assert_eq!(tls.cert, Path::new("/etc/warmgate-tls/tls.crt"));
    assert_eq!(tls.worker_listen.map(|a| a.port()), Some(8081));
    assert_eq!(
        config.backend.kubernetes.advertise.as_deref(),
        Some("wg.ml.svc:8081")
    );
    let dep: Deployment = read("deployment.yaml", &v);
    let pod = dep.spec.template.spec.expect("pod");
    let secret = pod
        .volumes
        .iter()
        .flatten()
        .find(|vol| vol.name == "tls")
        .and_then(|vol| vol.secret.as_ref())
        .and_then(|s| s.secret_name.clone());
    assert_eq!(secret.as_deref(), Some("gw-cert"));
    let c = &pod.containers[0];
    assert!(
        c.volume_mounts
            .iter()
            .flatten()
            .any(|m| m.name == "tls" && m.mount_path == "/etc/warmgate-tls")
    );
    let probe = c.readiness_probe.as_ref().and_then(|p| p.http_get.as_ref());
    assert_eq!(probe.and_then(|g| g.scheme.as_deref()), Some("HTTPS"));
    let svc: Service = read("service.yaml", &v);
    let ports: Vec<i32> = svc
        .spec
        .and_then(|s| s.ports)
        .unwrap_or_default()
        .iter()
        .map(|p| p.port)
        .collect();
    assert_eq!(ports, [8080, 8081]);
    // Without the Secret, none of it.
    let cm: ConfigMap = read("configmap.yaml", &values());
    assert!(!cm.data.expect("data")["warmgate.toml"].contains("[tls]"));
    // And settings may not define [tls] beside the chart's own.
    let mut bad = v.clone();
    bad["settings"] = Value::String("[tls]\ncert = \"x\"\nkey = \"y\"\n".into());
    let err = helm_template(Some("configmap.yaml"), &bad).expect_err("refused");
    assert!(err.contains("must not define [tls]"), "{err}");
    // The monitor scrapes with the token over HTTPS.
    let sm = render("servicemonitor.yaml", &v);
    assert!(
        sm.contains("scheme: https") && sm.contains("key: token"),
        "{sm}"
    );
}

#[test]
fn replica_pods_take_traffic_only_from_the_operators_pods() {
    let v = values();
    let policy: NetworkPolicy = read("networkpolicy.yaml", &v);
    let spec = policy.spec.expect("spec");
    // It selects the pods the operator starts for this release: the labels
    // `pool-manager/src/backend/kubernetes/pod.rs` puts on every replica pod.
    let selected = spec
        .pod_selector
        .and_then(|s| s.match_labels)
        .expect("labels");
    assert_eq!(selected["app.kubernetes.io/managed-by"], "warmgate");
    assert_eq!(selected["warmgate.dev/instance"], "wg");
    assert_eq!(spec.policy_types, Some(vec!["Ingress".to_string()]));
    let ingress = spec.ingress.expect("ingress rules");
    assert_eq!(ingress.len(), 1, "one rule");
    let from = ingress[0].from.as_ref().expect("peers");
    assert_eq!(from.len(), 1, "the operator's pods only: {from:?}");
    let peer = from[0]
        .pod_selector
        .as_ref()
        .and_then(|s| s.match_labels.clone())
        .expect("a pod selector");
    // The labels the Deployment gives the operator's pods.
    let dep: Deployment = read("deployment.yaml", &v);
    let pod_labels = dep
        .spec
        .template
        .metadata
        .and_then(|m| m.labels)
        .expect("pod labels");
    for (k, val) in &peer {
        assert_eq!(pod_labels.get(k), Some(val), "{k}");
    }
    assert!(
        ingress[0].ports.is_none(),
        "any port of the replica, from the operator"
    );

    let mut off = values();
    off["networkPolicy"]["enabled"] = Value::Bool(false);
    assert!(render("networkpolicy.yaml", &off).trim().is_empty());
}
