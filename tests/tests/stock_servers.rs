//! Stock model servers as workers, unchanged: the example configs for
//! vLLM, TGI, Triton and a FastAPI app run stand-ins that take their flags
//! and answer their health paths as those servers do (the real ones need
//! GPUs), with `$PORT` expanded by warmgate and no wrapper script. Then
//! the probe settings: a slow, blocking worker survives with the right
//! ones and is replaced with the defaults, and a health path that never
//! answers fails the start with the path and its last answer named.

mod common;

use std::path::{Path, PathBuf};

use common::{Gateway, eventually};
use serde_json::{Value, json};

/// The stand-in server, run under the name of the server it plays.
fn standin() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("standins/model_server.py")
}

/// A folder of links named as the stock servers' commands, all to the
/// stand-in, and the `PATH` that finds them first.
fn shims() -> (tempfile::TempDir, String) {
    let dir = tempfile::tempdir().expect("temp dir");
    for name in [
        "vllm",
        "text-generation-launcher",
        "tritonserver",
        "uvicorn",
    ] {
        std::os::unix::fs::symlink(standin(), dir.path().join(name)).expect("link");
    }
    let path = format!(
        "{}:{}",
        dir.path().display(),
        std::env::var("PATH").unwrap_or_default()
    );
    (dir, path)
}

fn example(name: &str) -> String {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("../examples/configs/{name}"));
    std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("read {}: {e}", p.display()))
}

/// The stand-in's own account of who answered.
fn served_by(body: &Value) -> &str {
    body["standin"]["server"].as_str().unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_example_configs_serve_stock_servers_without_a_wrapper() {
    let (_shims, path) = shims();
    // vLLM: health on /health, its port from `--port $PORT`, OpenAI routes.
    let gw = Gateway::start_with(&example("vllm.toml"), &[], &[("PATH", &path)]);
    let (status, body) = gw
        .post(
            "/v1/chat/completions",
            &json!({"model": "qwen", "messages": [{"role": "user", "content": "hi"}]}),
        )
        .await;
    assert_eq!((status, served_by(&body)), (200, "vllm"), "{body}");
    assert_eq!(body["choices"][0]["message"]["content"], "echo: hi");
    let (status, body) = gw
        .post("/v1/completions", &json!({"model": "qwen", "prompt": "x"}))
        .await;
    assert_eq!((status, served_by(&body)), (200, "vllm"), "{body}");
    drop(gw);

    // TGI: /health, its chat API and its own /generate.
    let gw = Gateway::start_with(&example("tgi.toml"), &[], &[("PATH", &path)]);
    let (status, body) = gw
        .post(
            "/v1/chat/completions",
            &json!({"model": "smollm", "messages": [{"role": "user", "content": "yo"}]}),
        )
        .await;
    assert_eq!(
        (status, served_by(&body)),
        (200, "text-generation-launcher"),
        "{body}"
    );
    let (status, body) = gw
        .post("/apps/smollm/generate", &json!({"inputs": "yo"}))
        .await;
    assert_eq!(
        (status, body["generated_text"].as_str()),
        (200, Some("echo: yo")),
        "{body}"
    );
    drop(gw);

    // Triton: /v2/health/ready, `--http-port=$PORT`, a variable from env.
    let gw = Gateway::start_with(&example("triton.toml"), &[], &[("PATH", &path)]);
    let (status, body) = gw
        .post(
            "/apps/triton/v2/models/simple/infer",
            &json!({"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [2], "data": [1.0, 2.0]}]}),
        )
        .await;
    assert_eq!((status, served_by(&body)), (200, "tritonserver"), "{body}");
    assert_eq!(body["outputs"][0]["data"], json!([1.0, 2.0]));
    drop(gw);

    // A plain FastAPI app under uvicorn.
    let gw = Gateway::start_with(&example("fastapi.toml"), &[], &[("PATH", &path)]);
    let (status, body) = gw
        .post("/apps/classifier/predict", &json!({"text": "hi"}))
        .await;
    assert_eq!((status, served_by(&body)), (200, "uvicorn"), "{body}");
    assert_eq!(body["prediction"]["text"], "hi");
}

/// Two apps on the same slow, blocking worker: it loads for
/// `load` seconds, then each request holds its one event loop for `block`
/// seconds, health probes included. One app has probe settings for it,
/// the other the defaults.
fn blocking_config(load: u32, block: u32) -> String {
    let app = |name: &str, health: &str| {
        format!(
            r#"
[[apps]]
name = "{name}"
command = ["text-generation-launcher", "--model-id", "m", "--port", "$PORT"]
env = {{ STANDIN_LOAD_SECONDS = "{load}", STANDIN_BLOCK_SECONDS = "{block}" }}
concurrency = 2
{health}
[apps.autoscale]
min = 1
max = 1
[apps.queue]
timeout = "60s"
"#
        )
    };
    format!(
        "{}{}",
        app(
            "patient",
            "[apps.health]\npath = \"/health\"\nperiod = \"5s\"\ntimeout = \"15s\"\nfailure_threshold = 3\n"
        ),
        app("hasty", "[apps.health]\npath = \"/health\"\n")
    )
}

/// The pid of an app's ready replica and its target's restart count.
async fn replica(gw: &Gateway, app: &str) -> (Option<i64>, u64) {
    let s = gw.app_status(app).await;
    let pid = s["pool"]["replicas"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|r| r["state"] == "ready")
        .and_then(|r| r["pid"].as_i64());
    (pid, s["pool"]["restarts"].as_u64().unwrap_or(0))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_blocking_worker_lives_with_the_right_probes_and_is_replaced_with_the_defaults() {
    let (_shims, path) = shims();
    let gw = Gateway::start_with(&blocking_config(20, 5), &[], &[("PATH", &path)]);
    let ready = |app: &'static str| {
        let gw = &gw;
        async move {
            eventually(&format!("{app} is ready after its 20 s load"), || async {
                replica(gw, app).await.0
            })
            .await
        }
    };
    let patient = ready("patient").await;
    ready("hasty").await;
    // Load: two clients per app, each request holding the loop 5 s, so a
    // probe waits behind up to two of them.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut clients = Vec::new();
    for app in ["patient", "patient", "hasty", "hasty"] {
        let (http, url, stop) = (gw.http.clone(), gw.at("/v1/chat/completions"), stop.clone());
        clients.push(tokio::spawn(async move {
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let _ = http
                    .post(&url)
                    .json(&json!({"model": app, "messages": [{"role": "user", "content": "x"}]}))
                    .send()
                    .await;
            }
        }));
    }
    // With the defaults (2 s timeout, 3 failures) the busy worker fails its
    // liveness probes and is replaced.
    eventually("hasty's blocked replica is replaced", || async {
        let (_, restarts) = replica(&gw, "hasty").await;
        (restarts > 0).then_some(())
    })
    .await;
    let s = gw.app_status("hasty").await;
    let why = s["pool"]["health"]["last_error"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(
        why.contains("unhealthy") && why.contains("GET /health took over"),
        "{why}"
    );
    // The patient app saw the same load for as long, on the same worker.
    let (pid, restarts) = replica(&gw, "patient").await;
    assert_eq!(
        (pid, restarts),
        (Some(patient), 0),
        "{}",
        gw.app_status("patient").await
    );
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for c in clients {
        c.abort();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_health_path_that_never_answers_fails_the_start_naming_it() {
    let (_shims, path) = shims();
    let config = r#"
[[apps]]
name = "wrongpath"
command = ["vllm", "serve", "m", "--port", "$PORT"]
startup_timeout = "3s"
[apps.health]
path = "/healthz/ready"
[apps.autoscale]
min = 1
max = 1
"#;
    let gw = Gateway::start_with(config, &[], &[("PATH", &path)]);
    let why = eventually("the start fails", || async {
        let s = gw.app_status("wrongpath").await;
        s["pool"]["health"]["last_error"]
            .as_str()
            .filter(|e| e.contains("ready within"))
            .map(str::to_string)
    })
    .await;
    assert!(
        why.contains("GET /healthz/ready answered 404"),
        "the path and its last answer are named: {why}"
    );
    // And a command naming a variable nobody set fails with its name.
    let config = r#"
[[apps]]
name = "typo"
command = ["vllm", "serve", "m", "--port", "$PROT"]
[apps.autoscale]
min = 1
max = 1
"#;
    let gw = Gateway::start_with(config, &[], &[("PATH", &path)]);
    let why = eventually("the start fails", || async {
        let s = gw.app_status("typo").await;
        s["pool"]["health"]["last_error"]
            .as_str()
            .map(str::to_string)
    })
    .await;
    assert!(why.contains("$PROT") && why.contains("not set"), "{why}");
}
