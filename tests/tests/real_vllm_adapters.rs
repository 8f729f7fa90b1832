//! Real vLLM's prefix caching and runtime LoRA adapters behind the
//! gateway, on two engines: repeats of a prompt land on the engine that
//! cached it (vLLM's own `cached_tokens` and `vllm:prefix_cache_hits_total`
//! say so, not the gateway); adapters are loaded on demand and each engine
//! holds at most `[apps.adapters] max_loaded` of them; an adapter trained
//! here on a text the repository ships (`tests/vllm/train_adapter.py`) is
//! promoted onto the running engines through a gate that reads its loss
//! through the gateway (`tests/vllm/gate_loss.py`), and a checkpoint the
//! engines cannot load is rolled back while no request for the base model
//! fails. Where vLLM is looked for: `common::vllm`.

mod common;

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use common::Gateway;
use common::vllm::{ENGINE_ENV, engine_metric, model, root, script, venv};
use serde_json::{Value, json};

/// The adapter's text: a document the repository ships.
const TEXT: &str = "docs/pools.md";

/// Trains an adapter on `TEXT` into `dir/name` (`steps` 0: a LoRA that
/// changes nothing yet); `rank` above 8 makes one the engines refuse.
fn adapter(venv: &Path, model: &Path, dir: &Path, name: &str, steps: u32, rank: u32) -> String {
    let out = dir.join(name);
    script(
        venv,
        "train_adapter.py",
        &[
            model.as_os_str(),
            root().join(TEXT).as_os_str(),
            out.as_os_str(),
            "--steps".as_ref(),
            steps.to_string().as_ref(),
            "--rank".as_ref(),
            rank.to_string().as_ref(),
        ],
    );
    format!("file://{}", out.display())
}

/// A completion of `prompt` by `model`: the replica that answered and the
/// answer.
async fn complete(gw: &Gateway, model: &str, prompt: &str) -> (String, Value) {
    let r = gw
        .http
        .post(gw.at("/v1/completions"))
        .json(&json!({"model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0}))
        .send()
        .await
        .expect("send");
    let status = r.status();
    let replica = r
        .headers()
        .get("x-warmgate-replica")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_string();
    let body: Value = r.json().await.expect("json");
    assert_eq!(status, 200, "{model}: {body}");
    (replica, body)
}

/// The app's ready replicas: id and address each.
async fn ready(gw: &Gateway, n: usize) -> Vec<(String, String)> {
    common::vllm::ready_replicas(gw, n, |s| s["apps"][0]["pool"]["replicas"].clone())
        .await
        .iter()
        .map(|r| {
            let text = |k: &str| r[k].as_str().unwrap_or_default().to_string();
            (text("id"), text("addr"))
        })
        .collect()
}

async fn adapter_status(gw: &Gateway, name: &str) -> Value {
    let s = gw.app_status("tiny").await;
    s["adapters"]
        .as_array()
        .and_then(|a| a.iter().find(|x| x["name"] == name).cloned())
        .unwrap_or(Value::Null)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_vllm_routes_repeats_home_and_loads_promotes_and_rolls_back_adapters() {
    let Some(venv) = venv() else { return };
    let model = model(&venv);
    let dir = tempfile::tempdir().expect("tempdir");
    let sql = adapter(&venv, &model, dir.path(), "sql-1", 0, 8);
    let poem = adapter(&venv, &model, dir.path(), "poem", 0, 8);
    let math = adapter(&venv, &model, dir.path(), "math", 0, 8);
    let python = venv.join("bin/python");
    // One sequence at a time per engine: vLLM 0.32's CPU build kills its
    // engine when a LoRA request asking for `prompt_logprobs` (the loss
    // gate's) is batched with another request (`einsum(): subscript b has
    // size 2 for operand 1 which does not broadcast with previously seen
    // size 255` in `sample_tokens`, then `EngineDeadError`), as a
    // fresh-clone CI run showed in the engine's own log.
    let gw = Gateway::start(&format!(
        r#"
        [limits]
        idle_timeout = "300s"
        request_timeout = "600s"
        [[apps]]
        name = "tiny"
        command = ["{vllm}", "serve", "{model}", "--served-model-name", "tiny",
                   "--uds", "$WARMGATE_SOCKET", "--max-model-len", "1024",
                   "--enable-prefix-caching", "--enable-prompt-tokens-details",
                   "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8",
                   "--max-num-seqs", "1"]
        env = {{ VLLM_ALLOW_RUNTIME_LORA_UPDATING = "True", {ENGINE_ENV} }}
        startup_timeout = "600s"
        concurrency = 8
        [apps.health]
        path = "/health"
        timeout = "10s"
        [apps.engine]
        metrics_path = "/metrics"
        [apps.queue]
        timeout = "600s"
        [apps.autoscale]
        min = 2
        max = 2
        [apps.promotion]
        gate_command = ["{python}", "{gate}", "tiny", "{text}"]
        gate_timeout = "5m"
        bake = "2s"
        [apps.adapters]
        max_loaded = 2
        load_timeout = "5m"
        [[apps.adapters.models]]
        name = "sql"
        checkpoint = "{sql}"
        [[apps.adapters.models]]
        name = "poem"
        checkpoint = "{poem}"
        [[apps.adapters.models]]
        name = "math"
        checkpoint = "{math}"
        {allow}
        "#,
        vllm = venv.join("bin/vllm").display(),
        model = model.display(),
        python = python.display(),
        gate = root().join("tests/vllm/gate_loss.py").display(),
        text = root().join(TEXT).display(),
        allow = common::allow_temp_checkpoints(),
    ));
    let replicas = ready(&gw, 2).await;

    // Prefix routing: each prompt's repeats go home, to the engine that
    // cached it, and vLLM serves them from its cache.
    let text = std::fs::read_to_string(root().join(TEXT)).expect("text");
    let part = |i: usize| text.chars().skip(i * 1500).take(1500).collect::<String>();
    let prompts = [part(0), part(1), part(2)];
    let mut homes = Vec::new();
    for p in &prompts {
        let (home, _) = complete(&gw, "tiny", p).await;
        for _ in 0..3 {
            let (replica, body) = complete(&gw, "tiny", p).await;
            assert_eq!(replica, home, "a repeat goes home");
            let cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap_or(0);
            assert!(cached > 0, "vLLM served it from its cache: {body}");
        }
        homes.push(home);
    }
    let mut hits = 0.0;
    for (_, addr) in &replicas {
        hits += engine_metric(addr, "vllm:prefix_cache_hits_total").await;
    }
    assert!(hits > 0.0, "vLLM counts the hits");

    // Adapters on demand: each engine holds at most max_loaded of the
    // three, whatever the order they are asked in.
    for name in ["sql", "poem", "math", "sql", "math", "poem", "sql"] {
        complete(&gw, name, "select the rows").await;
    }
    for (id, addr) in &replicas {
        let models = common::replica_json(addr, "/v1/models").await;
        let adapters: Vec<&Value> = models["data"]
            .as_array()
            .expect("data")
            .iter()
            .filter(|m| !m["parent"].is_null())
            .collect();
        assert!(adapters.len() <= 2, "{id} holds {adapters:?}");
    }

    // Base-model traffic through both promotions: none of it may fail.
    let failed = Arc::new(AtomicU64::new(0));
    let sent = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let load = {
        let (http, url) = (gw.http.clone(), gw.at("/v1/completions"));
        let (failed, sent, stop) = (failed.clone(), sent.clone(), stop.clone());
        tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                let r = http
                    .post(&url)
                    .json(&json!({"model": "tiny", "prompt": "the base model", "max_tokens": 2}))
                    .send()
                    .await;
                sent.fetch_add(1, Ordering::Relaxed);
                if !r.is_ok_and(|r| r.status() == 200) {
                    failed.fetch_add(1, Ordering::Relaxed);
                }
            }
        })
    };

    // A fine-tune trained here on the text is promoted through the gate,
    // which reads its loss through the gateway.
    let trained = adapter(&venv, &model, dir.path(), "sql-2", 40, 8);
    let (status, body) = gw
        .post(
            "/v1/apps/tiny/promote",
            &json!({"adapter": "sql", "checkpoint": trained, "wait": true}),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["promotion"]["phase"], "done", "{body}\n{}", gw.log());
    assert_eq!(adapter_status(&gw, "sql").await["revision"], 2);
    let eval = tokio::process::Command::new(&python)
        .arg(root().join("tests/vllm/gate_loss.py"))
        .args(["tiny", &root().join(TEXT).to_string_lossy()])
        .env("WARMGATE_EVAL_OPENAI_BASE", gw.at("/v1"))
        .env("WARMGATE_EVAL_MODEL", "sql")
        .output()
        .await
        .expect("gate_loss.py");
    let said = String::from_utf8_lossy(&eval.stdout).into_owned();
    assert!(
        eval.status.success(),
        "the promoted adapter's loss is lower: {said}"
    );
    eprintln!("through the gateway, on {TEXT}: {said}");

    // A checkpoint the engines cannot load (rank 64 past --max-lora-rank):
    // the gate fails on it, and the promotion rolls back.
    let broken = adapter(&venv, &model, dir.path(), "sql-3", 1, 64);
    let (status, body) = gw
        .post(
            "/v1/apps/tiny/promote",
            &json!({"adapter": "sql", "checkpoint": broken, "wait": true}),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["promotion"]["phase"], "rolled_back", "{body}");
    assert_eq!(adapter_status(&gw, "sql").await["revision"], 2);
    complete(&gw, "sql", "select the rows").await;

    stop.store(true, Ordering::Relaxed);
    load.await.expect("load");
    let (failed, sent) = (failed.load(Ordering::Relaxed), sent.load(Ordering::Relaxed));
    assert!(sent > 0);
    assert_eq!(failed, 0, "no base-model request failed of {sent}");
    eprintln!("base-model requests during the promotions: {sent}, none failed; homes {homes:?}");
}
