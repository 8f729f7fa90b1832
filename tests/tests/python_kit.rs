//! The Python worker kit (`examples/python/warmgate_worker.py`) against a
//! real gateway: a 1 GiB checkpoint streams tensor by tensor with one copy
//! in memory, the first tensor in hand while most of the file is still to
//! come, every byte as written; a corrupted checkpoint is refused and the
//! worker keeps its old weights, saying why.

mod common;

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use common::{Gateway, eventually};
use serde_json::{Value, json};

const TOKEN: &str = "kit-admin-token";

fn kit(file: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("../examples/python/{file}"))
}

/// How a checkpoint's `SHA256SUMS` is written.
#[derive(Clone, Copy, PartialEq)]
enum Sums {
    /// None: only sizes are checked.
    Without,
    /// The file's digest.
    Right,
    /// A digest of other bytes.
    Wrong,
}

/// Writes `dir/model.safetensors`: `count` F32 tensors of `each` bytes,
/// each filled with its own pattern, and its `SHA256SUMS`. Returns the
/// file's size and the digest of its tensor bytes in file order (hashed by
/// `sha256sum`, so a debug build of this test does not spend a minute on
/// a gigabyte).
fn checkpoint(dir: &Path, count: usize, each: usize, sums: Sums) -> (u64, String) {
    std::fs::create_dir_all(dir).expect("dir");
    let mut header = serde_json::Map::new();
    for i in 0..count {
        header.insert(
            format!("layer.{i:03}.weight"),
            json!({"dtype": "F32", "shape": [each / 4], "data_offsets": [i * each, (i + 1) * each]}),
        );
    }
    let mut head = serde_json::to_vec(&Value::Object(header)).expect("header");
    while !head.len().is_multiple_of(8) {
        head.push(b' ');
    }
    let path = dir.join("model.safetensors");
    let mut out = std::io::BufWriter::new(std::fs::File::create(&path).expect("create"));
    out.write_all(&(head.len() as u64).to_le_bytes())
        .expect("write");
    out.write_all(&head).expect("write");
    let mut block = vec![0u8; 1 << 20];
    for i in 0..count {
        let seed = (i * 31 % 251) as u8;
        for (j, b) in block.iter_mut().enumerate() {
            *b = seed.wrapping_add(j as u8);
        }
        let mut left = each;
        while left > 0 {
            let n = left.min(block.len());
            out.write_all(&block[..n]).expect("write");
            left -= n;
        }
    }
    out.flush().expect("flush");
    drop(out);
    let sha = |script: String| {
        let out = Command::new("sh")
            .args(["-c", &script])
            .output()
            .expect("sha256sum");
        assert!(out.status.success());
        String::from_utf8_lossy(&out.stdout)[..64].to_string()
    };
    let file = path.display();
    let data = sha(format!(
        "tail -c +{} '{file}' | sha256sum",
        8 + head.len() + 1
    ));
    if sums != Sums::Without {
        let mut sum = sha(format!("sha256sum '{file}'"));
        if sums == Sums::Wrong {
            let flipped = if sum.starts_with('0') { "1" } else { "0" };
            sum.replace_range(..1, flipped);
        }
        std::fs::write(
            dir.join("SHA256SUMS"),
            format!("{sum}  model.safetensors\n"),
        )
        .expect("sums");
    }
    (std::fs::metadata(&path).expect("size").len(), data)
}

fn config(pools: &[(&str, &Path)]) -> String {
    pools
        .iter()
        .map(|(name, dir)| {
            format!(
                "[[pools]]\nname = \"{name}\"\ncommand = [\"{{worker}}\"]\nreplicas = [0, 1]\ncheckpoint = \"file://{}\"\n",
                dir.display()
            )
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_one_gib_checkpoint_streams_tensor_by_tensor_with_one_copy_in_memory() {
    let tmp = tempfile::tempdir().expect("tmp");
    let dir = tmp.path().join("big");
    let (size, data_sha) = checkpoint(&dir, 64, 16 << 20, Sums::Without);
    assert!(size >= 1 << 30, "{size}");
    let gw = Gateway::start_with(
        &config(&[("big", &dir)]),
        &[],
        &[("WARMGATE_ADMIN_TOKEN", TOKEN)],
    );
    let url = gw.at("/v1/weights/big/big-00001");
    // Over HTTP (a worker on another machine), not from the local path
    // the manifest offers.
    let out = tokio::task::spawn_blocking(move || {
        Command::new("python3")
            .arg(kit("stream_probe.py"))
            .args([url.as_str(), TOKEN])
            .env("STREAM_PROBE_LOCAL", "0")
            .stdin(Stdio::null())
            .output()
            .expect("run python3")
    })
    .await
    .expect("join");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stats: Value = serde_json::from_slice(&out.stdout).expect("json");
    eprintln!("kit: {stats}");
    assert_eq!(stats["tensors"], 64, "{stats}");
    assert_eq!(stats["bytes"].as_u64(), Some(64 << 24), "{stats}");
    // Every byte as written, in order.
    assert_eq!(stats["sha256"].as_str(), Some(data_sha.as_str()), "{stats}");
    // One copy: the tensors it holds plus the interpreter, under 1.3×.
    let peak = stats["peak_rss_bytes"].as_u64().expect("rss");
    assert!(
        (peak as f64) < 1.3 * size as f64,
        "peak RSS {peak} for a {size}-byte checkpoint"
    );
    // The first tensor was whole when a few percent of the file had
    // arrived: loading overlaps the rest of the download.
    let first = stats["first_tensor_bytes"].as_u64().expect("first");
    assert!(first < size / 20, "first tensor at byte {first} of {size}");
    assert_eq!(stats["local_files"], 0, "{stats}");
}

/// The probe run on `url`, reading local paths where offered.
async fn run_probe(url: String) -> std::process::Output {
    tokio::task::spawn_blocking(move || {
        Command::new("python3")
            .arg(kit("stream_probe.py"))
            .args([url.as_str(), TOKEN])
            .stdin(Stdio::null())
            .output()
            .expect("run python3")
    })
    .await
    .expect("join")
}

/// The probe's stats for `url`, reading local paths where offered.
async fn probe(url: String) -> Value {
    let out = run_probe(url).await;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("json")
}

/// On the local backend the manifest offers each file's path on this
/// machine (the checkpoint's own `file://` file, then the cache's verified
/// copy once there is one), and the kit reads it there, checked as a
/// download is; a path that does not match the manifest is not trusted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_on_the_gateway_s_machine_reads_the_weights_where_they_lie() {
    let tmp = tempfile::tempdir().expect("tmp");
    let dir = tmp.path().join("ck");
    let (size, data_sha) = checkpoint(&dir, 8, 1 << 20, Sums::Right);
    let gw = Gateway::start_with(
        &config(&[("ck", &dir)]),
        &[],
        &[("WARMGATE_ADMIN_TOKEN", TOKEN)],
    );
    let http = reqwest::Client::new();
    let manifest: Value = http
        .get(gw.at("/v1/weights/ck/ck-00001"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .expect("manifest")
        .json()
        .await
        .expect("json");
    let file = manifest["files"]
        .as_array()
        .and_then(|f| f.iter().find(|f| f["name"] == "model.safetensors"))
        .expect("listed")
        .clone();
    assert_eq!(file["size"].as_u64(), Some(size));
    let path = file["path"]
        .as_str()
        .unwrap_or_else(|| panic!("no local path: {manifest}"))
        .to_string();
    assert_eq!(
        std::fs::metadata(&path).expect("the path exists").len(),
        size
    );

    let stats = probe(gw.at("/v1/weights/ck/ck-00001")).await;
    assert_eq!(stats["local_files"], 1, "{stats}");
    assert_eq!(stats["tensors"], 8, "{stats}");
    assert_eq!(stats["sha256"].as_str(), Some(data_sha.as_str()), "{stats}");

    // A local file that is not what the manifest says (grown under the
    // gateway after it listed it) is not read there: the kit downloads
    // instead, and that download is what any check then judges.
    let f = std::fs::OpenOptions::new()
        .append(true)
        .open(dir.join("model.safetensors"))
        .expect("open");
    f.set_len(size + 8).expect("grow");
    let out = run_probe(gw.at("/v1/weights/ck/ck-00001")).await;
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !err.contains("reading "),
        "the grown local file was read: {err}"
    );
    if out.status.success() {
        let stats: Value = serde_json::from_slice(&out.stdout).expect("json");
        assert_eq!(stats["local_files"], 0, "{stats}");
    }
}

/// `POST url` with a JSON body: the status and the JSON answer.
async fn post(http: &reqwest::Client, url: String, body: Value) -> (u16, Value) {
    let r = http.post(url).json(&body).send().await.expect("post");
    (r.status().as_u16(), r.json().await.unwrap_or(Value::Null))
}

/// `GET url` as JSON.
async fn get(http: &reqwest::Client, url: String) -> Value {
    let r = http.get(url).send().await.expect("get");
    r.json().await.expect("json")
}

/// A free loopback port for a worker run outside the gateway.
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupted_checkpoint_is_refused_and_the_worker_keeps_its_weights() {
    let tmp = tempfile::tempdir().expect("tmp");
    let good = tmp.path().join("good");
    let bad = tmp.path().join("bad");
    let (_, good_sha) = checkpoint(&good, 4, 1 << 20, Sums::Right);
    checkpoint(&bad, 4, 1 << 20, Sums::Wrong);
    let gw = Gateway::start_with(
        &config(&[("good", &good), ("bad", &bad)]),
        &[],
        &[("WARMGATE_ADMIN_TOKEN", TOKEN)],
    );
    // The kit refuses bytes that do not match SHA256SUMS.
    let bad_url = gw.at("/v1/weights/bad/bad-00001");
    let probe = {
        let url = bad_url.clone();
        tokio::task::spawn_blocking(move || {
            Command::new("python3")
                .arg(kit("stream_probe.py"))
                .args([url.as_str(), TOKEN])
                .output()
                .expect("run python3")
        })
        .await
        .expect("join")
    };
    assert!(!probe.status.success());
    let err = String::from_utf8_lossy(&probe.stderr);
    assert!(err.contains("WeightsError"), "{err}");

    // A worker built on the kit starts on the good weights...
    let port = free_port();
    let mut worker = Command::new("python3")
        .arg(kit("warmgate_worker.py"))
        .env("PORT", port.to_string())
        .env("WARMGATE_WEIGHTS_URL", gw.at("/v1/weights/good/good-00001"))
        .env("WARMGATE_WEIGHTS_VERSION", "1")
        .env("WARMGATE_WEIGHTS_TOKEN", TOKEN)
        .stdin(Stdio::null())
        .spawn()
        .expect("start the kit's demo worker");
    let at = |p: &str| format!("http://127.0.0.1:{port}{p}");
    let http = reqwest::Client::new();
    let health = eventually("the worker loads its weights and listens", || async {
        let r = http.get(at("/healthz")).send().await.ok()?;
        r.json::<Value>().await.ok()
    })
    .await;
    assert_eq!(health["weights_version"], 1, "{health}");
    let (_, answer) = post(&http, at("/invoke"), json!({"x": 1})).await;
    assert_eq!(
        answer["model"]["sha256"].as_str(),
        Some(good_sha.as_str()),
        "{answer}"
    );
    // ...refuses the corrupted ones, keeping its own and saying why...
    let (status, _) = post(&http, at("/weights"), json!({"url": bad_url, "version": 2})).await;
    assert_eq!(status, 500);
    let health = get(&http, at("/healthz")).await;
    assert_eq!(health["weights_version"], 1, "{health}");
    assert!(
        health["last_error"]
            .as_str()
            .is_some_and(|e| e.contains("version 2")),
        "{health}"
    );
    let (_, answer) = post(&http, at("/invoke"), json!({})).await;
    assert_eq!(answer["model"]["sha256"].as_str(), Some(good_sha.as_str()));
    // ...and takes good ones in place.
    let (status, _) = post(
        &http,
        at("/weights"),
        json!({"url": gw.at("/v1/weights/good/good-00001"), "version": 3}),
    )
    .await;
    assert_eq!(status, 200);
    let health = get(&http, at("/healthz")).await;
    assert_eq!(health["weights_version"], 3, "{health}");
    // SIGTERM: it stops.
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(worker.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .expect("signal");
    let status = tokio::task::spawn_blocking(move || worker.wait().expect("wait"))
        .await
        .expect("join");
    assert!(status.success(), "{status}");
}
