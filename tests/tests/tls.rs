//! HTTPS on the listener and in the CLI: `apply` and `status` to a gateway
//! whose certificate a private CA signed, trusted with `--cacert`; refused
//! without it; a renewed certificate served after SIGHUP.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use common::{Gateway, bin, eventually};
use serde_json::Value;

const TOKEN: &str = "admin-token-for-tls-71c3";

/// A CA and a certificate for `127.0.0.1` it signed, written to `dir`:
/// the CA's PEM file.
fn issue(dir: &Path, tag: &str, cert: &Path, key: &Path) -> PathBuf {
    let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).expect("params");
    ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    ca_params
        .distinguished_name
        .push(rcgen::DnType::CommonName, format!("warmgate test CA {tag}"));
    let ca_key = rcgen::KeyPair::generate().expect("key");
    let ca = ca_params.self_signed(&ca_key).expect("ca");
    let issuer = rcgen::Issuer::new(ca_params, ca_key);
    let leaf_key = rcgen::KeyPair::generate().expect("key");
    let leaf = rcgen::CertificateParams::new(vec!["127.0.0.1".to_string()])
        .expect("params")
        .signed_by(&leaf_key, &issuer)
        .expect("leaf");
    let ca_path = dir.join(format!("ca-{tag}.pem"));
    std::fs::write(&ca_path, ca.pem()).expect("write");
    // Written whole, then renamed: the gateway never reads half a file.
    let tmp = dir.join("tmp.pem");
    std::fs::write(&tmp, leaf.pem()).expect("write");
    std::fs::rename(&tmp, cert).expect("mv");
    std::fs::write(&tmp, leaf_key.serialize_pem()).expect("write");
    std::fs::rename(&tmp, key).expect("mv");
    ca_path
}

fn cli(args: &[&str], cacert: Option<&Path>) -> Output {
    let mut c = Command::new(bin("warmgate"));
    c.args(args)
        .env("WARMGATE_ADMIN_TOKEN", TOKEN)
        .env_remove("WARMGATE_CACERT")
        .env_remove("WARMGATE_GATEWAY");
    if let Some(ca) = cacert {
        c.arg("--cacert").arg(ca);
    }
    c.output().expect("run warmgate")
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn apply_over_tls_works_with_a_private_ca_and_a_renewed_certificate_after_sighup() {
    let certs = tempfile::tempdir().expect("dir");
    let (cert, key) = (certs.path().join("cert.pem"), certs.path().join("key.pem"));
    let ca_a = issue(certs.path(), "a", &cert, &key);
    // A replica that reads its checkpoint from the gateway: workers hold no
    // CA, so they read from a plain listener on loopback.
    let ck = certs.path().join("ck");
    std::fs::create_dir_all(&ck).expect("mkdir");
    std::fs::write(ck.join("model.bin"), "weights").expect("write");
    let gw = Gateway::start_with(
        &format!(
            r#"
            [[apps]]
            name = "m"
            command = ["{{worker}}"]
            checkpoint = "file://{}"
            [apps.autoscale]
            min = 1
            [tls]
            cert = "{}"
            key = "{}"
            "#,
            ck.display(),
            cert.display(),
            key.display()
        ),
        &[],
        &[("WARMGATE_ADMIN_TOKEN", TOKEN)],
    );
    assert!(gw.url.starts_with("https://127.0.0.1:"), "{}", gw.url);
    let url = gw.url.clone();

    // Trusted with --cacert: status answers, and apply adds an app.
    let o = cli(&["status", "--gateway", &url, "-o", "json"], Some(&ca_a));
    assert!(o.status.success(), "{}", text(&o));
    eventually("the replica read its weights and is ready", || async {
        let o = cli(&["status", "--gateway", &url, "-o", "json"], Some(&ca_a));
        let status: Value = serde_json::from_slice(&o.stdout).ok()?;
        (status["apps"][0]["ready"] == 1).then_some(())
    })
    .await;
    let apps = certs.path().join("apps.toml");
    std::fs::write(
        &apps,
        format!(
            "[[apps]]\nname = \"over-tls\"\ncommand = [\"{}\"]\n",
            common::test_worker()
        ),
    )
    .expect("write");
    let o = cli(
        &["apply", "-c", &apps.to_string_lossy(), "--gateway", &url],
        Some(&ca_a),
    );
    assert!(o.status.success(), "{}", text(&o));
    let o = cli(&["status", "--gateway", &url, "-o", "json"], Some(&ca_a));
    let status: Value = serde_json::from_slice(&o.stdout).expect("json");
    // apply makes the file's apps the set: "m" went, "over-tls" came.
    assert_eq!(status["apps"][0]["name"], "over-tls", "{status}");

    // Not trusted without it, and plain HTTP to the TLS port gets nothing.
    let o = cli(&["status", "--gateway", &url], None);
    assert!(!o.status.success());
    assert!(
        text(&o).to_lowercase().contains("certificate"),
        "{}",
        text(&o)
    );
    let plain = url.replacen("https://", "http://", 1);
    let o = cli(&["status", "--gateway", &plain], None);
    assert!(!o.status.success(), "{}", text(&o));
    // A --cacert that is not a certificate is a clear error.
    let o = cli(&["status", "--gateway", &url], Some(&apps));
    assert!(!o.status.success());
    assert!(text(&o).contains("--cacert"), "{}", text(&o));

    // A renewed certificate from another CA, read again on SIGHUP.
    let ca_b = issue(certs.path(), "b", &cert, &key);
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(gw.pid()),
        nix::sys::signal::Signal::SIGHUP,
    )
    .expect("SIGHUP");
    eventually("the renewed certificate is served", || async {
        let o = cli(&["status", "--gateway", &url], Some(&ca_b));
        o.status.success().then_some(())
    })
    .await;
    let o = cli(&["status", "--gateway", &url], Some(&ca_a));
    assert!(
        !o.status.success(),
        "the old CA is still trusted: {}",
        text(&o)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_workers_listener_serves_weights_only_and_is_public_only_with_a_token() {
    let certs = tempfile::tempdir().expect("dir");
    let (cert, key) = (certs.path().join("cert.pem"), certs.path().join("key.pem"));
    issue(certs.path(), "a", &cert, &key);
    let free = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let worker_at = free.local_addr().expect("addr");
    drop(free);
    let tls = format!(
        "[tls]\ncert = \"{}\"\nkey = \"{}\"\nworker_listen = \"{worker_at}\"\n",
        cert.display(),
        key.display()
    );
    let gw = Gateway::start_with(&tls, &[], &[("WARMGATE_ADMIN_TOKEN", TOKEN)]);
    let plain = reqwest::Client::new();
    // The whole API was served there, in plain HTTP, even with a token.
    let r = plain
        .get(format!("http://{worker_at}/v1/status"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .expect("send");
    assert_eq!(r.status(), 404);
    let body: Value = r.json().await.expect("json");
    assert!(
        body["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("workers' listener")),
        "{body}"
    );
    let r = plain
        .get(format!("http://{worker_at}/healthz"))
        .send()
        .await
        .expect("send");
    assert_eq!(r.status(), 200);
    // Weights are still there for a worker (401 without its token).
    let r = plain
        .get(format!("http://{worker_at}/v1/weights/m/m-00001"))
        .send()
        .await
        .expect("send");
    assert_eq!(r.status(), 401);
    drop(gw);

    // A public workers' listener needs the admin token, as a public listen.
    let dir = tempfile::tempdir().expect("dir");
    let config = dir.path().join("warmgate.toml");
    std::fs::write(
        &config,
        format!(
            "state_dir = \"state\"\n[tls]\ncert = \"{}\"\nkey = \"{}\"\nworker_listen = \"0.0.0.0:0\"\n",
            cert.display(),
            key.display()
        ),
    )
    .expect("write");
    let out = Command::new(bin("warmgate"))
        .args(["serve", "--listen", "127.0.0.1:0", "--config"])
        .arg(&config)
        .env_remove("WARMGATE_ADMIN_TOKEN")
        .stdin(Stdio::null())
        .output()
        .expect("serve");
    assert_eq!(out.status.code(), Some(64), "{}", text(&out));
    assert!(
        text(&out).contains("refusing to listen on 0.0.0.0"),
        "{}",
        text(&out)
    );
}
