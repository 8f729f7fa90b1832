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

/// Without a token the control plane is open to programs on loopback, not
/// to the web pages of a browser on the same machine: a rebound name in
/// `Host`, another page's `Origin` or a cross-site fetch is refused, and so
/// is a change sent by a page of the gateway's own origin (an app's page);
/// nothing they asked for happens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn web_pages_cannot_drive_a_tokenless_control_plane() {
    let gw = Gateway::start_with(
        r#"
        [[apps]]
        name = "m"
        command = ["{worker}"]
        "#,
        &[],
        &[],
    );
    let port = gw.url.rsplit(':').next().expect("port").to_string();
    let spec = r#"{"command": ["sh", "-c", "touch /tmp/pwned"], "autoscale": {"min": 1}}"#;
    let forged: [(&str, String); 4] = [
        ("host", format!("rebound.example:{port}")),
        ("origin", "https://evil.example".to_string()),
        ("origin", format!("http://localhost:{}", "8888")),
        ("sec-fetch-site", "cross-site".to_string()),
    ];
    for (name, value) in &forged {
        let r = gw
            .http
            .put(gw.at("/v1/apps/x"))
            .header(*name, value)
            .header("content-type", "text/plain")
            .body(spec)
            .send()
            .await
            .expect("send");
        assert_eq!(r.status(), 401, "{name}: {value}");
        let body: Value = r.json().await.expect("json");
        assert_eq!(kind(&body), "unauthorized", "{body}");
        let message = body["error"]["message"].as_str().unwrap_or("");
        assert!(message.contains("WARMGATE_ADMIN_TOKEN"), "{message}");
        let r = gw
            .http
            .post(gw.at("/v1/apps/m/rollback"))
            .header(*name, value)
            .header("content-type", "text/plain")
            .body("{}")
            .send()
            .await
            .expect("send");
        assert_eq!(r.status(), 401, "rollback with {name}: {value}");
        let r = gw
            .http
            .get(gw.at("/v1/status"))
            .header(*name, value)
            .send()
            .await
            .expect("send");
        assert_eq!(r.status(), 401, "status with {name}: {value}");
    }
    // A page an app serves is of the gateway's own origin; a change its
    // script sends is refused all the same.
    let r = gw
        .http
        .put(gw.at("/v1/apps/x"))
        .header("origin", gw.url.clone())
        .header("sec-fetch-site", "same-origin")
        .header("content-type", "application/json")
        .body(spec)
        .send()
        .await
        .expect("send");
    assert_eq!(r.status(), 401, "a same-origin page's PUT");
    let r = gw.http.get(gw.at("/v1/apps/x")).send().await.expect("send");
    assert_eq!(r.status(), 404, "no forged PUT created the app");

    // Programs, `localhost` and the dashboard's same-origin requests pass.
    for (name, value) in [
        ("host", format!("localhost:{port}")),
        ("origin", gw.url.clone()),
        ("sec-fetch-site", "same-origin".to_string()),
    ] {
        let r = gw
            .http
            .get(gw.at("/v1/status"))
            .header(name, &value)
            .send()
            .await
            .expect("send");
        assert_eq!(r.status(), 200, "{name}: {value}");
    }
    // The data plane is not the control plane's to guard.
    let r = gw
        .http
        .get(gw.at("/healthz"))
        .header("origin", "https://evil.example")
        .send()
        .await
        .expect("send");
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
