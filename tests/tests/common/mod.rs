//! The end-to-end harness: start the real `warmgate` binary on port 0 with a
//! config written to a temporary folder, talk to it over HTTP, and wait by
//! bounded polling.

#![allow(dead_code)]

pub mod vllm;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

/// How long any single wait in a test may take before it fails.
pub const WAIT: Duration = Duration::from_secs(30);

/// A binary built by `cargo build --workspace` (or nextest) beside the test.
pub fn bin(name: &str) -> PathBuf {
    let var = format!("WARMGATE_E2E_{}", name.to_uppercase().replace('-', "_"));
    if let Some(p) = std::env::var_os(var) {
        return PathBuf::from(p);
    }
    // target/<profile>/deps/<test> -> target/<profile>/<name>
    let exe = std::env::current_exe().expect("the test knows its path");
    let dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("the test runs from target/<profile>/deps");
    let p = dir.join(name);
    assert!(
        p.exists(),
        "{} not found: build the workspace first (cargo build --workspace --bins)",
        p.display()
    );
    p
}

/// The fixture worker.
pub fn test_worker() -> String {
    bin("test-worker").to_string_lossy().into_owned()
}

/// A running `warmgate serve`.
pub struct Gateway {
    child: Option<Child>,
    /// `http://127.0.0.1:PORT`
    pub url: String,
    /// The folder with the config and the state.
    pub dir: tempfile::TempDir,
    /// An HTTP client for tests.
    pub http: reqwest::Client,
    /// The `WARMGATE_ADMIN_TOKEN` the test gave, if any.
    given_token: Option<String>,
}

impl Gateway {
    /// Writes `config` (TOML, without `listen`/`state_dir`) and starts the
    /// gateway on a free port. `{worker}` in the text becomes the
    /// test-worker path.
    pub fn start(config: &str) -> Gateway {
        Gateway::start_with(config, &[], &[])
    }

    /// [`Gateway::start`] with extra `serve` arguments and environment.
    pub fn start_with(config: &str, args: &[&str], env: &[(&str, &str)]) -> Gateway {
        let dir = tempfile::tempdir().expect("temp dir");
        let text = config.replace("{worker}", &test_worker());
        let path = dir.path().join("warmgate.toml");
        std::fs::write(&path, format!("state_dir = \"state\"\n{text}")).expect("write config");
        let (child, url) = spawn(dir.path(), args, env);
        // Without WARMGATE_ADMIN_TOKEN the gateway made a token of its own
        // in its state folder: the test's client carries it, as a user's
        // CLI would (a test that wants none builds its own client).
        let mut headers = reqwest::header::HeaderMap::new();
        if !env.iter().any(|(k, _)| *k == "WARMGATE_ADMIN_TOKEN") {
            let token = admin_token(dir.path());
            headers.insert(
                reqwest::header::AUTHORIZATION,
                format!("Bearer {token}").parse().expect("header value"),
            );
        }
        let given_token = env
            .iter()
            .find(|(k, _)| *k == "WARMGATE_ADMIN_TOKEN")
            .map(|(_, v)| v.to_string());
        Gateway {
            child: Some(child),
            url,
            dir,
            given_token,
            http: reqwest::Client::builder()
                .pool_max_idle_per_host(64)
                .default_headers(headers)
                .build()
                .expect("client"),
        }
    }

    /// The admin token the gateway made for itself (started without
    /// `WARMGATE_ADMIN_TOKEN`).
    pub fn admin_token(&self) -> String {
        self.given_token
            .clone()
            .unwrap_or_else(|| admin_token(self.dir.path()))
    }

    /// `kill -9` of the gateway (its replicas too, as a crash of the
    /// machine would), then a fresh `warmgate serve` on the same config
    /// and state folder, on a new port.
    pub fn kill9_and_restart(&mut self, replica_pids: &[i32]) {
        let mut child = self.child.take().expect("running");
        let _ = child.kill();
        let _ = child.wait();
        for pid in replica_pids {
            let _ = nix::sys::signal::killpg(
                nix::unistd::Pid::from_raw(*pid),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
        let (child, url) = spawn(self.dir.path(), &[], &[]);
        self.child = Some(child);
        self.url = url;
    }

    /// Stops the gateway with SIGTERM (its replicas with it) and starts a
    /// fresh `warmgate serve` on the same config and state folder, on a
    /// new port.
    pub fn restart(&mut self) {
        self.restart_with(&[]);
    }

    /// [`Gateway::restart`] with extra `serve` arguments.
    pub fn restart_with(&mut self, args: &[&str]) {
        let status = self.stop();
        assert!(
            status.success(),
            "warmgate exited with {status}:\n{}",
            self.log()
        );
        let (child, url) = spawn(self.dir.path(), args, &[]);
        self.child = Some(child);
        self.url = url;
    }

    /// `url + path`.
    pub fn at(&self, path: &str) -> String {
        format!("{}{path}", self.url)
    }

    /// POST a JSON body; the status and the JSON answer (`null` if none).
    pub async fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        let r = self
            .http
            .post(self.at(path))
            .json(body)
            .send()
            .await
            .expect("send");
        (r.status().as_u16(), r.json().await.unwrap_or(Value::Null))
    }

    /// PUT a JSON body; (status, JSON answer or null).
    pub async fn put(&self, path: &str, body: &Value) -> (u16, Value) {
        let r = self
            .http
            .put(self.at(path))
            .json(body)
            .send()
            .await
            .expect("send");
        (r.status().as_u16(), r.json().await.unwrap_or(Value::Null))
    }

    /// Runs `warmgate ARGS --gateway URL`: its exit code, stdout, stderr.
    pub fn warmgate(&self, args: &[&str]) -> (Option<i32>, String, String) {
        let out = std::process::Command::new(bin("warmgate"))
            .args(args)
            .args(["--gateway", &self.url])
            .output()
            .expect("run warmgate");
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }

    /// Sends requests to `app` until it is in a crash loop (its answer
    /// says `CrashLoopBackOff`); returns that answer's headers and body.
    pub async fn wait_crash_loop(&self, app: &str) -> (reqwest::header::HeaderMap, Value) {
        eventually(&format!("{app} is in a crash loop"), || async {
            let r = self
                .http
                .get(self.at(&format!("/apps/{app}/x")))
                .send()
                .await
                .ok()?;
            let headers = r.headers().clone();
            let body: Value = r.json().await.ok()?;
            body["error"]["message"]
                .as_str()
                .is_some_and(|m| m.contains("CrashLoopBackOff"))
                .then_some((headers, body))
        })
        .await
    }

    /// GET a JSON document.
    pub async fn json(&self, path: &str) -> Value {
        self.http
            .get(self.at(path))
            .send()
            .await
            .expect("request")
            .json()
            .await
            .expect("json")
    }

    /// The status of one app from `/v1/status`.
    pub async fn app_status(&self, app: &str) -> Value {
        let v = self.json("/v1/status").await;
        v["apps"]
            .as_array()
            .and_then(|a| a.iter().find(|x| x["name"] == app).cloned())
            .unwrap_or_else(|| panic!("app {app} not in status: {v}"))
    }

    /// Waits until `app` has `n` ready replicas; returns its status.
    pub async fn wait_ready(&self, app: &str, n: u64) -> Value {
        eventually(&format!("{n} ready replica(s) of {app}"), || async {
            let s = self.app_status(app).await;
            (s["ready"] == n).then_some(s)
        })
        .await
    }

    /// Sends a slow GET to `path` of `app` in the background and waits until
    /// the gateway counts it in flight; the handle yields its response.
    pub async fn occupy(
        &self,
        app: &str,
        path: &str,
    ) -> tokio::task::JoinHandle<reqwest::Result<reqwest::Response>> {
        let first = tokio::spawn(self.http.get(self.at(path)).send());
        eventually("the first request is in flight", || async {
            (self.app_status(app).await["inflight"] == 1).then_some(())
        })
        .await;
        first
    }

    /// The whole `/metrics` exposition (read with the admin token).
    pub async fn metrics_text(&self) -> String {
        self.http
            .get(self.at("/metrics"))
            .bearer_auth(self.admin_token())
            .send()
            .await
            .expect("GET /metrics")
            .text()
            .await
            .expect("metrics text")
    }

    /// A counter or gauge from `/metrics`, named with its labels as the
    /// exposition writes them (0 when absent).
    pub async fn metric(&self, name: &str) -> f64 {
        let text = self.metrics_text().await;
        text.lines()
            .find(|l| l.split_whitespace().next() == Some(name))
            .and_then(|l| l.split_whitespace().last())
            .and_then(|v| v.parse().ok())
            .unwrap_or(0.0)
    }

    /// Ready replica pids of an app.
    pub async fn replica_pids(&self, app: &str) -> Vec<i32> {
        let s = self.app_status(app).await;
        s["pool"]["replicas"]
            .as_array()
            .map(|rs| {
                rs.iter()
                    .filter_map(|r| r["pid"].as_i64())
                    .map(|p| p as i32)
                    .collect()
            })
            .unwrap_or_default()
    }

    /// The gateway's own log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("gateway.log")).unwrap_or_default()
    }

    /// The last `lines` lines of each replica's log in the state folder,
    /// printed when a test fails so that its output carries the workers'
    /// (and real engines') own account of what happened.
    pub fn replica_log_tails(&self, lines: usize) -> String {
        let mut out = String::new();
        let Ok(entries) = std::fs::read_dir(self.dir.path().join("state/logs")) else {
            return out;
        };
        let mut paths: Vec<_> = entries.flatten().map(|e| e.path()).collect();
        paths.sort();
        for path in paths {
            let text = std::fs::read_to_string(&path).unwrap_or_default();
            let all: Vec<&str> = text.lines().collect();
            let tail = &all[all.len().saturating_sub(lines)..];
            out.push_str(&format!(
                "--- last {} lines of {} ---\n{}\n",
                tail.len(),
                path.display(),
                tail.join("\n")
            ));
        }
        out
    }

    /// The gateway's pid.
    pub fn pid(&self) -> i32 {
        self.child.as_ref().map_or(0, |c| c.id() as i32)
    }

    /// Sends SIGTERM and waits for the exit.
    pub fn stop(&mut self) -> ExitStatus {
        let mut child = self.child.take().expect("running");
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(child.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        );
        let deadline = Instant::now() + WAIT;
        loop {
            if let Some(status) = child.try_wait().expect("wait") {
                return status;
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                // Already failing: say so, kill it, and let the first
                // failure be the one reported (a second panic would
                // abort the test and hide it).
                if std::thread::panicking() {
                    eprintln!("warmgate did not exit within {WAIT:?} of SIGTERM; killed");
                    return child.wait().expect("wait");
                }
                panic!(
                    "warmgate did not exit within {WAIT:?} of SIGTERM:\n{}",
                    self.log()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Gateway {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("{}", self.replica_log_tails(60));
        }
        if self.child.is_some() {
            let status = self.stop();
            if !std::thread::panicking() {
                assert!(
                    status.success(),
                    "warmgate exited with {status}:\n{}",
                    self.log()
                );
            }
        }
    }
}

/// Runs a Python script with `url` as its first argument; returns what it
/// printed, failing the test (with its output) when it exits non-zero.
pub async fn python(script: &str, url: &str) -> String {
    python_with(script, url, &[]).await
}

/// [`python`] with more environment.
pub async fn python_with(script: &str, url: &str, env: &[(&str, &str)]) -> String {
    let out = tokio::process::Command::new("python3")
        .args(["-c", script, url])
        .envs(env.iter().copied())
        .output()
        .await
        .expect("python3");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    text
}

/// Whether the official `openai` Python client is installed; under CI it
/// must be (`.ci/run` installs it), elsewhere the caller skips.
pub fn has_openai() -> bool {
    let ok = Command::new("python3")
        .args(["-c", "import openai"])
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        assert!(
            std::env::var_os("CI").is_none(),
            "the openai package is required under CI"
        );
        eprintln!("SKIPPED: pip install openai");
    }
    ok
}

/// The token a gateway started in `dir` without `WARMGATE_ADMIN_TOKEN`
/// keeps in its state folder.
fn admin_token(dir: &Path) -> String {
    std::fs::read_to_string(dir.join("state/admin-token"))
        .expect("the gateway keeps its admin token in state/admin-token")
        .trim()
        .to_string()
}

/// Starts `warmgate serve` on `dir/warmgate.toml`; returns it and its URL.
fn spawn(dir: &Path, args: &[&str], env: &[(&str, &str)]) -> (Child, String) {
    let mut child = Command::new(bin("warmgate"))
        .args(["serve", "--config"])
        .arg(dir.join("warmgate.toml"))
        .args(["--listen", "127.0.0.1:0"])
        .args(args)
        .env("WARMGATE_LOG", "info,warmgate_pool=debug")
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::from(
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(dir.join("gateway.log"))
                .expect("log file"),
        ))
        .spawn()
        .expect("start warmgate");
    let stdout = child.stdout.take().expect("piped stdout");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut lines = BufReader::new(stdout).lines();
        if let Some(Ok(line)) = lines.next() {
            let _ = tx.send(line);
        }
        // Keep draining so the gateway never blocks on a full pipe.
        for _ in lines {}
    });
    let line = rx.recv_timeout(WAIT).unwrap_or_else(|_| {
        let log = std::fs::read_to_string(dir.join("gateway.log")).unwrap_or_default();
        panic!("warmgate did not start listening:\n{log}")
    });
    let url = line
        .strip_prefix("warmgate listening on ")
        .unwrap_or_else(|| panic!("unexpected first line: {line}"))
        .to_string();
    (child, url)
}

/// Polls `check` until it returns `Some`, at most `WAIT`; panics with
/// `what` otherwise.
pub async fn eventually<T, F, Fut>(what: &str, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + WAIT;
    let mut delay = Duration::from_millis(10);
    loop {
        if let Some(v) = check().await {
            return v;
        }
        if tokio::time::Instant::now() > deadline {
            panic!("timed out after {WAIT:?} waiting for: {what}");
        }
        tokio::time::sleep(delay).await;
        delay = (delay * 2).min(Duration::from_millis(200));
    }
}

/// Whether a process exists.
pub fn alive(pid: i32) -> bool {
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), None).is_ok()
}

/// The `error.kind` of an error response body.
pub fn kind(v: &Value) -> &str {
    v["error"]["kind"].as_str().unwrap_or("<no kind>")
}

/// `[weights] allowed_prefixes` for tests whose checkpoints live in
/// temporary folders that the config does not name.
pub fn allow_temp_checkpoints() -> String {
    allow_checkpoints_under(&[])
}

/// `[weights] allowed_prefixes`: the temporary folder and `dirs`.
pub fn allow_checkpoints_under(dirs: &[&Path]) -> String {
    let list: Vec<String> = std::iter::once(std::env::temp_dir().as_path())
        .chain(dirs.iter().copied())
        .map(|d| format!("\"file://{}\"", d.display()))
        .collect();
    format!("\n[weights]\nallowed_prefixes = [{}]\n", list.join(", "))
}

/// Writes a one-file checkpoint with distinct contents under `root/name`;
/// returns its `file://` URI and the SHA-256 a worker computes over it.
pub fn checkpoint(root: &Path, name: &str, size: usize) -> (String, String) {
    use sha2::Digest as _;
    let dir = root.join(name);
    std::fs::create_dir_all(&dir).expect("mkdir");
    let data: Vec<u8> = (0..size)
        .map(|i| (i as u8) ^ name.len() as u8 ^ name.as_bytes()[name.len() - 1])
        .collect();
    std::fs::write(dir.join("model.bin"), &data).expect("write");
    let sha = format!("{:x}", sha2::Sha256::digest(&data));
    (format!("file://{}", dir.display()), sha)
}

/// A moto S3 server on a free loopback port, stopped on drop.
pub struct Moto {
    child: Child,
    /// `http://127.0.0.1:PORT`.
    pub endpoint: String,
}

impl Moto {
    /// Starts moto, or returns `None` (with a notice) where it is not
    /// installed; under CI it must be (`.ci/run` installs it).
    pub fn start(extra_env: &[(&str, &str)]) -> Option<Moto> {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("free port")
            .port();
        let child = Command::new("python3")
            .args([
                "-m",
                "moto.server",
                "-H",
                "127.0.0.1",
                "-p",
                &port.to_string(),
            ])
            .envs(extra_env.iter().copied())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn();
        let mut child = match child {
            Ok(c) => c,
            Err(e) => return Moto::missing(&e.to_string()),
        };
        let endpoint = format!("http://127.0.0.1:{port}");
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
                return Some(Moto { child, endpoint });
            }
            if let Ok(Some(status)) = child.try_wait() {
                return Moto::missing(&format!("moto exited with {status}"));
            }
            assert!(Instant::now() < deadline, "moto did not start within 30s");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn missing(why: &str) -> Option<Moto> {
        assert!(
            std::env::var_os("CI").is_none(),
            "moto is required under CI ({why}); .ci/run installs it"
        );
        eprintln!("SKIPPED: moto is not installed ({why}); pip install 'moto[server]'");
        None
    }

    /// The environment an S3 client of the object_store crate needs to
    /// reach it with access key `key`.
    pub fn env(&self, key: &str) -> Vec<(&'static str, String)> {
        vec![
            ("AWS_ENDPOINT", self.endpoint.clone()),
            ("AWS_ALLOW_HTTP", "true".into()),
            ("AWS_ACCESS_KEY_ID", key.into()),
            ("AWS_SECRET_ACCESS_KEY", "test-secret".into()),
            ("AWS_REGION", "us-east-1".into()),
        ]
    }
}

impl Drop for Moto {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One request straight to a replica at `addr` as `/v1/status` shows it
/// (`127.0.0.1:P`, or `unix:/path` for a worker on the gateway's socket),
/// bypassing the gateway: its status and body.
pub async fn replica_call(addr: &str, method: &str, path: &str, body: &str) -> (u16, String) {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let req = format!(
        "{method} {path} HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\n\
         content-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    let mut raw = Vec::new();
    let read = async {
        match addr.strip_prefix("unix:") {
            Some(p) => {
                let mut s = tokio::net::UnixStream::connect(p).await?;
                s.write_all(req.as_bytes()).await?;
                s.read_to_end(&mut raw).await
            }
            None => {
                let mut s = tokio::net::TcpStream::connect(addr).await?;
                s.write_all(req.as_bytes()).await?;
                s.read_to_end(&mut raw).await
            }
        }
    };
    tokio::time::timeout(WAIT, read)
        .await
        .unwrap_or_else(|_| panic!("{addr} did not answer {method} {path} in time"))
        .unwrap_or_else(|e| panic!("{method} {path} at {addr}: {e}"));
    let text = String::from_utf8_lossy(&raw).into_owned();
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("no status line from {addr}: {text}"));
    let (head, rest) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    // The fixture workers answer with a length or chunks; undo chunking.
    let body = if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        let mut out = String::new();
        let mut rest = rest;
        while let Some((size, after)) = rest.split_once("\r\n") {
            let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
            if n == 0 || after.len() < n {
                break;
            }
            out.push_str(&after[..n]);
            rest = after[n..].trim_start_matches("\r\n");
        }
        out
    } else {
        rest.to_string()
    };
    (status, body)
}

/// A replica's `GET path` as JSON, straight from the replica.
pub async fn replica_json(addr: &str, path: &str) -> Value {
    let (status, body) = replica_call(addr, "GET", path, "").await;
    assert_eq!(status, 200, "GET {path} at {addr}: {body}");
    serde_json::from_str(&body).unwrap_or_else(|e| panic!("GET {path} at {addr}: {e}: {body}"))
}

/// The stand-in vLLM engine's script (`tests/standins/llm_engine.py`).
pub fn llm_engine() -> String {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("standins/llm_engine.py")
        .to_string_lossy()
        .into_owned()
}

/// Whether a connection to a replica at `addr` (as [`replica_call`]) is
/// refused now.
pub async fn replica_refuses(addr: &str) -> bool {
    match addr.strip_prefix("unix:") {
        Some(p) => tokio::net::UnixStream::connect(p).await.is_err(),
        None => tokio::net::TcpStream::connect(addr).await.is_err(),
    }
}

/// An adapter folder as PEFT writes one (the engine checks for its
/// `adapter_config.json`); `broken` leaves that file out.
pub fn peft_adapter(root: &Path, name: &str, broken: bool) -> PathBuf {
    let dir = root.join(name);
    std::fs::create_dir_all(&dir).expect("mkdir");
    if !broken {
        std::fs::write(
            dir.join("adapter_config.json"),
            r#"{"peft_type": "LORA", "r": 8}"#,
        )
        .expect("write");
    }
    std::fs::write(dir.join("adapter_model.safetensors"), b"weights").expect("write");
    dir
}
