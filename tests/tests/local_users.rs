//! Another user on the same machine, tried as an attacker would: the
//! tests run as root (as CI does) and act as `nobody` where it matters.
//! Run as another user, the parts that need a second user say so and
//! check what they can without one.

mod common;

use std::os::unix::fs::PermissionsExt as _;
use std::os::unix::process::CommandExt as _;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;

/// `nobody`'s uid and gid on Debian.
const NOBODY: u32 = 65534;

fn is_root() -> bool {
    nix::unistd::geteuid().is_root()
}

fn chmod(path: &Path, mode: u32) {
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).expect("chmod");
}

/// Runs `sh -c script` as `nobody`; fails the test when it fails.
fn as_nobody(script: &str) {
    let out = Command::new("setpriv")
        .args([
            &format!("--reuid={NOBODY}"),
            &format!("--regid={NOBODY}"),
            "--clear-groups",
            "sh",
            "-c",
            script,
        ])
        .output()
        .expect("run as nobody");
    assert!(
        out.status.success(),
        "as nobody: {script}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `warmgate serve` on `config`, expected to refuse to start: its exit
/// code and what it wrote.
fn serve_refused(config: &Path) -> (Option<i32>, String) {
    let mut child = Command::new(bin("warmgate"))
        .args(["serve", "--config"])
        .arg(config)
        .args(["--listen", "127.0.0.1:0"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start warmgate");
    let deadline = Instant::now() + WAIT;
    loop {
        if child.try_wait().expect("wait").is_some() {
            break;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("warmgate did not exit on a state folder it cannot trust");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = child.wait_with_output().expect("output");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.code(), text)
}

/// When process `pid` started, in clock ticks since boot.
fn start_time(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("stat");
    let rest = &stat[stat.rfind(')').expect("comm") + 1..];
    rest.split_whitespace()
        .nth(19)
        .and_then(|t| t.parse().ok())
        .expect("start time")
}

#[test]
fn a_state_folder_another_user_planted_is_refused_and_signals_nothing() {
    let dir = tempfile::tempdir().expect("dir");
    chmod(dir.path(), 0o755);
    // A shared folder everyone may write to, as /tmp.
    let open = dir.path().join("open");
    std::fs::create_dir(&open).expect("mkdir");
    chmod(&open, 0o1777);
    let state = open.join("state");
    // An unrelated process of the user who runs `serve`, in a group of its
    // own: what a planted record names, with its true start time.
    let mut victim = Command::new("sleep")
        .arg("60")
        .process_group(0)
        .spawn()
        .expect("sleep");
    let pid = victim.id();
    let record = format!("{pid} {}", start_time(pid));
    let planted = format!(
        "mkdir -m 755 {s} {s}/run && echo '{record}' > {s}/run/w-1.pid",
        s = state.display()
    );
    if is_root() {
        as_nobody(&planted);
    } else {
        eprintln!("not root: the state folder is planted by this user and left writable by all");
        let out = Command::new("sh")
            .args(["-c", &planted])
            .status()
            .expect("sh");
        assert!(out.success());
        chmod(&state, 0o777);
    }
    let config = dir.path().join("warmgate.toml");
    std::fs::write(&config, format!("state_dir = \"{}\"\n", state.display())).expect("config");
    let (code, text) = serve_refused(&config);
    assert_ne!(code, Some(0), "refused: {text}");
    assert!(
        text.contains("cannot be trusted") && text.contains(&state.display().to_string()),
        "names the folder and why: {text}"
    );
    if is_root() {
        assert!(text.contains("another user"), "{text}");
    }
    assert!(
        victim.try_wait().expect("wait").is_none(),
        "the process the planted record names still runs"
    );
    assert!(
        !state.join("state.db").exists(),
        "nothing was written in the planted folder"
    );
    victim.kill().expect("kill");
    let _ = victim.wait();
}

/// Whether `nobody` can open a connection to `addr` (`127.0.0.1:P` or
/// `unix:/path`, as `/v1/status` shows a replica's).
fn nobody_connects(addr: &str) -> (bool, String) {
    let script = match addr.strip_prefix("unix:") {
        Some(path) => format!(
            "import socket; s = socket.socket(socket.AF_UNIX); s.settimeout(5); s.connect({path:?})"
        ),
        None => {
            let (host, port) = addr.rsplit_once(':').expect("host:port");
            format!("import socket; socket.create_connection(({host:?}, {port}), timeout=5)")
        }
    };
    let out = Command::new("setpriv")
        .args([
            &format!("--reuid={NOBODY}"),
            &format!("--regid={NOBODY}"),
            "--clear-groups",
            "python3",
            "-c",
            &script,
        ])
        .output()
        .expect("run as nobody");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// One HTTP/1.1 request on the Unix socket at `path`: the status code and
/// the body.
async fn over_socket(path: &str, method: &str, target: &str, body: &str) -> (u16, String) {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let mut s = tokio::net::UnixStream::connect(path)
        .await
        .expect("connect to the replica's socket");
    let req = format!(
        "{method} {target} HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\n\
         content-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).await.expect("write");
    let mut raw = Vec::new();
    tokio::time::timeout(WAIT, s.read_to_end(&mut raw))
        .await
        .expect("an answer in time")
        .expect("read");
    let text = String::from_utf8_lossy(&raw).into_owned();
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .expect("a status line");
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    (status, body)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_user_cannot_reach_a_replica_nor_make_a_worker_send_its_token_elsewhere() {
    let gw = Gateway::start(
        r#"
        [[apps]]
        name = "m"
        command = ["{worker}"]
        [apps.autoscale]
        min = 1
        "#,
    );
    let status = gw.wait_ready("m", 1).await;
    let replicas = &status["pool"]["replicas"];
    let addr = replicas[0]["addr"]
        .as_str()
        .expect("an address")
        .to_string();
    assert!(
        addr.starts_with("unix:"),
        "a worker offered a socket listens on it: {replicas}"
    );
    if is_root() {
        let (connected, why) = nobody_connects(&addr);
        assert!(!connected, "nobody reached the replica at {addr}");
        assert!(why.contains("Permission denied"), "{why}");
    } else {
        eprintln!("not root: no second user to try the replica's socket as");
    }
    // The gateway still reaches it.
    let r = gw
        .http
        .get(gw.at("/apps/m/hello"))
        .send()
        .await
        .expect("request");
    assert_eq!(r.status(), 200);

    // A weights URL that is not the gateway's: the worker sends its token
    // nowhere, and says why.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    listener.set_nonblocking(true).expect("nonblocking");
    let foreign = format!(
        "http://{}/v1/weights/m/m-00001",
        listener.local_addr().expect("addr")
    );
    let path = addr.trim_start_matches("unix:");
    let (code, body) = over_socket(
        path,
        "POST",
        "/weights",
        &format!(r#"{{"url": "{foreign}", "version": 9}}"#),
    )
    .await;
    assert_eq!(code, 400, "{body}");
    assert!(body.contains("not on the gateway"), "{body}");
    assert!(
        listener.accept().is_err(),
        "the worker connected to the foreign URL"
    );
}

#[test]
fn serve_prints_its_token_only_to_a_terminal() {
    use std::io::{BufRead as _, BufReader};
    let dir = tempfile::tempdir().expect("dir");
    let config = dir.path().join("warmgate.toml");
    std::fs::write(&config, "state_dir = \"state\"\n").expect("config");
    let mut child = Command::new(bin("warmgate"))
        .args(["serve", "--listen", "127.0.0.1:0", "--config"])
        .arg(&config)
        .env_remove("WARMGATE_ADMIN_TOKEN")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("serve");
    let stdout = child.stdout.take().expect("stdout");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let mut lines = Vec::new();
    while lines.len() < 2 {
        match rx.recv_timeout(WAIT) {
            Ok(l) => lines.push(l),
            Err(_) => break,
        }
    }
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    );
    let _ = child.wait();
    let token = std::fs::read_to_string(dir.path().join("state/admin-token")).expect("token");
    let token = token.trim();
    assert_eq!(lines.len(), 2, "{lines:?}");
    assert!(lines[1].starts_with("dashboard: "), "{lines:?}");
    assert!(
        lines.iter().all(|l| !l.contains(token)),
        "stdout is a pipe, not a terminal: {lines:?}"
    );
}
