//! The admin token: the control plane needs it, the data plane does not,
//! it never leaks, and a gateway will not listen beyond loopback without
//! one unless told to.

mod common;

use std::process::{Command, Stdio};

use common::{Gateway, bin, kind};
use serde_json::Value;

const TOKEN: &str = "s3cret-admin-token-9f2c";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_control_plane_needs_the_admin_token() {
    let gw = Gateway::start_with(
        r#"
        [[apps]]
        name = "m"
        command = ["{worker}"]
        [apps.autoscale]
        min = 1
        [[pools]]
        name = "p"
        command = ["{worker}"]
        replicas = [0, 1]
        "#,
        &[],
        &[("WARMGATE_ADMIN_TOKEN", TOKEN)],
    );
    let get = |path: &'static str, auth: Option<&'static str>| {
        let (http, url) = (gw.http.clone(), gw.at(path));
        async move {
            let mut r = http.get(url);
            if let Some(a) = auth {
                r = r.header("authorization", a);
            }
            let r = r.send().await.expect("send");
            (
                r.status().as_u16(),
                r.json::<Value>().await.unwrap_or(Value::Null),
            )
        }
    };
    for path in [
        "/v1/status",
        "/v1/apps",
        "/v1/apps/m",
        "/v1/apps/m/revisions",
    ] {
        let (status, body) = get(path, None).await;
        assert_eq!(status, 401, "{path}: {body}");
        assert_eq!(kind(&body), "unauthorized");
        let (status, _) = get(path, Some("Bearer wrong")).await;
        assert_eq!(status, 401, "{path}");
        let (status, _) = get(path, Some("Bearer s3cret-admin-token-9f2")).await;
        assert_eq!(status, 401, "{path}: a prefix is not the token");
    }
    let auth = format!("Bearer {TOKEN}");
    let r = gw
        .http
        .get(gw.at("/v1/status"))
        .header("authorization", &auth)
        .send()
        .await
        .expect("send");
    assert_eq!(r.status(), 200);
    for (path, body) in [
        ("/v1/apps/m/rollback", "{}"),
        ("/v1/apps/m/promote", r#"{"checkpoint": "file:///x"}"#),
        (
            "/v1/pools/p/weights",
            r#"{"checkpoint": "file:///x", "version": 1}"#,
        ),
    ] {
        let r = gw
            .http
            .post(gw.at(path))
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await
            .expect("send");
        assert_eq!(
            r.status(),
            401,
            "{path} changes deployments: it needs the token"
        );
    }

    // The data plane does not need it.
    let r = gw
        .http
        .get(gw.at("/apps/m/hello"))
        .send()
        .await
        .expect("send");
    assert_eq!(r.status(), 200);
    let r = gw.http.get(gw.at("/healthz")).send().await.expect("send");
    assert_eq!(r.status(), 200);

    // The CLI sends it from the environment.
    let out = Command::new(bin("warmgate"))
        .args(["status", "--gateway", &gw.url])
        .env("WARMGATE_ADMIN_TOKEN", TOKEN)
        .output()
        .expect("status");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = Command::new(bin("warmgate"))
        .args(["status", "--gateway", &gw.url])
        .env_remove("WARMGATE_ADMIN_TOKEN")
        .output()
        .expect("status");
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("401"));

    // The token appears nowhere it could leak from.
    let status = gw
        .http
        .get(gw.at("/v1/status"))
        .header("authorization", &auth)
        .send()
        .await
        .expect("send")
        .text()
        .await
        .expect("text");
    let metrics = gw
        .http
        .get(gw.at("/metrics"))
        .bearer_auth(gw.admin_token())
        .send()
        .await
        .expect("m")
        .text()
        .await
        .expect("t");
    for (what, text) in [("status", status), ("metrics", metrics), ("log", gw.log())] {
        assert!(!text.contains(TOKEN), "the token leaked into the {what}");
    }
}

/// A gateway started without `WARMGATE_ADMIN_TOKEN` makes a token of its
/// own (the third security review: before, every local user could `PUT`
/// an app whose command ran as the gateway's user). Nobody without the
/// token can change or read the control plane, a web page of its own
/// origin included; the token is in files only its user can read; its
/// user's CLI finds it with nothing set; and another local user (run as
/// `nobody` where the test may) can neither read it nor change anything.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_without_a_token_makes_one_that_only_its_user_can_use() {
    let runtime = tempfile::tempdir().expect("runtime dir");
    let runtime_dir = runtime.path().join("run");
    let gw = Gateway::start_with(
        r#"
        [[apps]]
        name = "m"
        command = ["{worker}"]
        "#,
        &[],
        &[("WARMGATE_RUNTIME_DIR", runtime_dir.to_str().expect("utf-8"))],
    );
    let token = gw.admin_token();
    assert_eq!(token.len(), 64, "{token}");
    let plain = reqwest::Client::new();
    let pwned = gw.dir.path().join("pwned");
    let spec = serde_json::json!({
        "command": ["sh", "-c", format!("touch {}", pwned.display())],
        "autoscale": {"min": 1}
    })
    .to_string();
    // Without the token: no change, no read, whatever the headers say.
    for (name, value) in [
        ("x-nothing", String::new()),
        ("origin", gw.url.clone()),
        ("sec-fetch-site", "same-origin".to_string()),
    ] {
        let r = plain
            .put(gw.at("/v1/apps/x"))
            .header(name, &value)
            .header("content-type", "application/json")
            .body(spec.clone())
            .send()
            .await
            .expect("send");
        assert_eq!(r.status(), 401, "PUT with {name}: {value}");
        let body: Value = r.json().await.expect("json");
        assert_eq!(kind(&body), "unauthorized", "{body}");
        for path in ["/v1/status", "/v1/apps/m", "/v1/apps"] {
            let r = plain
                .get(gw.at(path))
                .header(name, &value)
                .send()
                .await
                .expect("send");
            assert_eq!(r.status(), 401, "GET {path} with {name}: {value}");
        }
    }
    // The token in the state folder and its published copy: owner-only.
    use std::os::unix::fs::PermissionsExt as _;
    let kept = gw.dir.path().join("state/admin-token");
    let port = gw.url.rsplit(':').next().expect("port");
    let published = runtime_dir.join(format!("gateway-127.0.0.1-{port}.token"));
    for file in [&kept, &published] {
        let mode = std::fs::metadata(file)
            .expect("token file")
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600, "{}", file.display());
        let text = std::fs::read_to_string(file).expect("read");
        assert_eq!(
            text.lines().next().unwrap_or("").trim(),
            token,
            "{}",
            file.display()
        );
    }
    let mode = std::fs::metadata(&runtime_dir)
        .expect("dir")
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o700);
    // With it, as the harness's client sends it: allowed.
    let r = gw.http.get(gw.at("/v1/status")).send().await.expect("send");
    assert_eq!(r.status(), 200);
    // The user's CLI finds it with nothing set.
    let out = Command::new(bin("warmgate"))
        .args(["status", "-o", "json"])
        .env("WARMGATE_GATEWAY", &gw.url)
        .env("WARMGATE_RUNTIME_DIR", &runtime_dir)
        .env_remove("WARMGATE_ADMIN_TOKEN")
        .stdin(Stdio::null())
        .output()
        .expect("status");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let status: Value = serde_json::from_slice(&out.stdout).expect("json");
    assert!(status["apps"].is_array(), "{status}");
    // Another user: the files are out of reach, and so is every change.
    if nix::unistd::geteuid().is_root() {
        use std::os::unix::process::CommandExt as _;
        let nobody = 65534;
        for file in [&kept, &published] {
            let out = Command::new("cat")
                .arg(file)
                .uid(nobody)
                .gid(nobody)
                .stdin(Stdio::null())
                .output()
                .expect("cat as nobody");
            assert!(!out.status.success(), "nobody read {}", file.display());
            assert!(!String::from_utf8_lossy(&out.stdout).contains(&token));
        }
        let out = Command::new("curl")
            .args(["-s", "-o", "/dev/null", "-w", "%{http_code}", "-X", "PUT"])
            .args(["-H", "content-type: application/json", "--data", &spec])
            .arg(gw.at("/v1/apps/x"))
            .uid(nobody)
            .gid(nobody)
            .stdin(Stdio::null())
            .output()
            .expect("curl as nobody");
        assert_eq!(String::from_utf8_lossy(&out.stdout), "401");
    } else {
        eprintln!("SKIPPED: the part as another user needs root");
    }
    let r = gw.http.get(gw.at("/v1/apps/x")).send().await.expect("send");
    assert_eq!(r.status(), 404, "no refused PUT created the app");
    assert!(!pwned.exists(), "a refused app ran its command");
    // The data plane is not the control plane's to guard.
    let r = plain.get(gw.at("/healthz")).send().await.expect("send");
    assert_eq!(r.status(), 200);
}

#[test]
fn serve_refuses_a_public_address_without_a_token() {
    let dir = tempfile::tempdir().expect("dir");
    let config = dir.path().join("warmgate.toml");
    std::fs::write(&config, "state_dir = \"state\"\n").expect("write");
    let out = Command::new(bin("warmgate"))
        .args(["serve", "--config"])
        .arg(&config)
        .args(["--listen", "0.0.0.0:0"])
        .env_remove("WARMGATE_ADMIN_TOKEN")
        .stdin(Stdio::null())
        .output()
        .expect("serve");
    assert_eq!(out.status.code(), Some(64));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("WARMGATE_ADMIN_TOKEN") && err.contains("--insecure"),
        "{err}"
    );

    // With --insecure it starts (and is stopped here).
    let mut child = Command::new(bin("warmgate"))
        .args(["serve", "--insecure", "--config"])
        .arg(&config)
        .args(["--listen", "0.0.0.0:0"])
        .env_remove("WARMGATE_ADMIN_TOKEN")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("serve");
    let mut line = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(child.stdout.take().expect("stdout")),
        &mut line,
    )
    .expect("read");
    assert!(line.starts_with("warmgate listening on"), "{line}");
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    );
    let _ = child.wait();
}

#[test]
fn operator_refuses_a_public_address_without_a_token() {
    let home = tempfile::tempdir().expect("dir");
    let operator = |token: Option<&str>| {
        let mut cmd = Command::new(bin("warmgate"));
        cmd.args(["operator", "--listen", "0.0.0.0:0"])
            .env_remove("WARMGATE_ADMIN_TOKEN")
            .env_remove("KUBECONFIG")
            .env_remove("KUBERNETES_SERVICE_HOST")
            .env("HOME", home.path())
            .stdin(Stdio::null());
        if let Some(t) = token {
            cmd.env("WARMGATE_ADMIN_TOKEN", t);
        }
        cmd.output().expect("operator")
    };
    let out = operator(None);
    assert_eq!(out.status.code(), Some(64));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("refusing to listen") && err.contains("WARMGATE_ADMIN_TOKEN"),
        "{err}"
    );
    // With a token it gets past the check, to the Kubernetes API (none here).
    let out = operator(Some(TOKEN));
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("Kubernetes API"), "{err}");
}

/// DNS rebinding (issue 40): a page that rebinds its own name to the
/// gateway's address sends that name as `Host`. With `allowed_hosts` set,
/// only the listed names are served; probes and credentialed routes pass.
/// And `/metrics` and `/openapi.json` need the token unless
/// `public_metrics` lets scrapers in.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_allowed_hosts_are_served_and_metrics_need_the_token() {
    const ADMIN: &str = "admin-token-for-hosts-2e7a";
    let gw = Gateway::start_with(
        r#"
        [access]
        allowed_hosts = ["gw.example.test", "127.0.0.1"]
        "#,
        &[],
        &[("WARMGATE_ADMIN_TOKEN", ADMIN)],
    );
    let port = gw.url.rsplit(':').next().expect("port").to_string();
    let get = async |path: &str, host: &str, token: Option<&str>| {
        let mut r = gw
            .http
            .get(gw.at(path))
            .header("host", format!("{host}:{port}"));
        if let Some(t) = token {
            r = r.bearer_auth(t);
        }
        let r = r.send().await.expect("send");
        let status = r.status().as_u16();
        (status, r.json::<Value>().await.unwrap_or(Value::Null))
    };
    let (status, body) = get("/v1/models", "rebound.attacker.example", None).await;
    assert_eq!(status, 421, "{body}");
    assert_eq!(kind(&body), "misdirected_request");
    let (status, _) = get("/v1/status", "rebound.attacker.example", Some(ADMIN)).await;
    assert_eq!(status, 421, "the token does not make another host this one");
    for host in ["gw.example.test", "GW.EXAMPLE.TEST.", "127.0.0.1"] {
        let (status, body) = get("/v1/models", host, None).await;
        assert_eq!(status, 200, "{host}: {body}");
    }
    let (status, _) = get("/healthz", "10.1.2.3", None).await;
    assert_eq!(status, 200, "probes come by the pod's IP");
    assert!(gw.metric("warmgate_host_refused_total").await >= 2.0);

    // /metrics and /openapi.json: the token, or 401.
    for path in ["/metrics", "/openapi.json"] {
        let (status, body) = get(path, "127.0.0.1", None).await;
        assert_eq!(status, 401, "{path}: {body}");
        let r = gw
            .http
            .get(gw.at(path))
            .bearer_auth(ADMIN)
            .send()
            .await
            .expect("send");
        assert_eq!(r.status(), 200, "{path}");
    }
    let open = Gateway::start_with(
        r#"
        [access]
        public_metrics = true
        "#,
        &[],
        &[("WARMGATE_ADMIN_TOKEN", ADMIN)],
    );
    let r = open
        .http
        .get(open.at("/metrics"))
        .send()
        .await
        .expect("send");
    assert_eq!(r.status(), 200, "public_metrics lets a scraper in");
    let r = open
        .http
        .get(open.at("/v1/status"))
        .send()
        .await
        .expect("send");
    assert_eq!(r.status(), 401, "and nothing else");
}
