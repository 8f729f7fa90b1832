//! A rollout pool of stock engines taking new weights in place
//! (`[[pools]] weight_sync = "vllm"`), against the stand-in engine
//! (`tests/standins/llm_engine.py`), which serves vLLM's dev-mode routes
//! (`/collective_rpc` `reload_weights`, `/update_weight_version`,
//! `/weight_info`) as vLLM 0.32 does; `real_vllm.rs` runs the same on the
//! real engine.

mod common;

use std::path::{Path, PathBuf};

use common::{Gateway, eventually};
use serde_json::{Value, json};

/// A checkpoint folder `root/name` with one small safetensors file whose
/// tensor holds `fill`.
fn weights(root: &Path, name: &str, fill: u8) -> PathBuf {
    let dir = root.join(name);
    std::fs::create_dir_all(&dir).expect("mkdir");
    let header = br#"{"w":{"dtype":"U8","shape":[16],"data_offsets":[0,16]}}"#;
    let mut file = (header.len() as u64).to_le_bytes().to_vec();
    file.extend_from_slice(header);
    file.extend_from_slice(&[fill; 16]);
    std::fs::write(dir.join("model.safetensors"), file).expect("write");
    dir
}

/// A pool of two stand-in engines, `dev_mode` or not, and the app it
/// serves.
fn config(root: &Path, dev_mode: bool) -> String {
    format!(
        r#"
        [weights]
        allowed_prefixes = ["file://{root}"]
        [[pools]]
        name = "policy"
        command = ["python3", "{engine}", "--model", "policy-chat", "--uds", "$WARMGATE_SOCKET",
                   "--prefill-ms-per-token", "0.01", "--decode-ms-per-token", "1"]
        env = {{ VLLM_SERVER_DEV_MODE = "{dev}" }}
        replicas = [2, 2]
        concurrency = 4
        weight_sync = "vllm"
        startup_timeout = "60s"
        [pools.health]
        path = "/health"
        [[apps]]
        name = "policy-chat"
        pool = "policy"
        "#,
        root = root.display(),
        engine = common::llm_engine(),
        dev = if dev_mode { "1" } else { "0" },
    )
}

/// A ready replica: its id, weights version and address.
type Ready = (String, u64, String);

/// The pool's `n` ready replicas.
async fn replicas(gw: &Gateway, n: usize) -> Vec<Ready> {
    eventually(&format!("{n} ready replicas"), || async {
        let s = gw.json("/v1/status").await;
        let rs: Vec<Ready> = s["pools"][0]["pool"]["replicas"]
            .as_array()?
            .iter()
            .filter(|r| r["state"] == "ready")
            .map(|r| {
                let text = |k: &str| r[k].as_str().unwrap_or_default().to_string();
                (
                    text("id"),
                    r["weights_version"].as_u64().unwrap_or(0),
                    text("addr"),
                )
            })
            .collect();
        (rs.len() == n).then_some(rs)
    })
    .await
}

/// A completion of `prompt`: its text and `cached_tokens`.
async fn complete(gw: &Gateway, prompt: &str) -> (String, u64) {
    let r = gw
        .http
        .post(gw.at("/v1/completions"))
        .json(&json!({"model": "policy-chat", "prompt": prompt, "max_tokens": 8}))
        .send()
        .await
        .expect("send");
    let status = r.status();
    let v: Value = r.json().await.expect("json");
    assert_eq!(status, 200, "{v}");
    (
        v["choices"][0]["text"]
            .as_str()
            .unwrap_or_default()
            .to_string(),
        v["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap_or(0),
    )
}

/// A sync puts the new weights into the same engine processes: each
/// replica reports the version, the answers change with the weights, and
/// a prompt cached before the sync is not served from the old weights'
/// cache after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sync_reloads_the_engines_in_place_and_drops_their_stale_cache() {
    let root = tempfile::tempdir().expect("tempdir");
    let v1 = weights(root.path(), "step-1", 1);
    let gw = Gateway::start(&config(root.path(), true));
    let before = replicas(&gw, 2).await;
    let prompt = (0..64)
        .map(|i| format!("w{i}"))
        .collect::<Vec<_>>()
        .join(" ");
    let (old_text, _) = complete(&gw, &prompt).await;
    // Both engines hold the prompt now (or soon): its next run is cached.
    eventually("the prompt is cached", || async {
        let (_, cached) = complete(&gw, &prompt).await;
        (cached > 0).then_some(())
    })
    .await;

    let (status, body) = gw
        .post(
            "/v1/pools/policy/weights",
            &json!({"checkpoint": format!("file://{}", v1.display()), "version": 1}),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["synced"], 2, "{body}");
    let after = replicas(&gw, 2).await;
    let ids = |rs: &[Ready]| {
        let mut ids: Vec<String> = rs.iter().map(|(id, ..)| id.clone()).collect();
        ids.sort();
        ids
    };
    assert_eq!(ids(&after), ids(&before), "the same engines: {after:?}");
    assert!(after.iter().all(|(_, v, _)| *v == 1), "{after:?}");
    for (id, _, addr) in &after {
        let info = common::replica_json(addr, "/weight_info").await;
        assert_eq!(info["weight_version"], "1", "{id}: {info}");
    }
    let (new_text, cached) = complete(&gw, &prompt).await;
    assert_eq!(cached, 0, "nothing computed with the old weights is reused");
    assert_ne!(new_text, old_text, "the answers come from the new weights");
}

/// Engines started without their dev routes cannot take weights in place:
/// the sync is rolled back with the reason, and the pool keeps serving on
/// its old weights.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_vllm_s_dev_mode_the_sync_is_rolled_back_and_says_why() {
    let root = tempfile::tempdir().expect("tempdir");
    let v1 = weights(root.path(), "step-1", 1);
    let gw = Gateway::start(&config(root.path(), false));
    replicas(&gw, 2).await;
    let (status, body) = gw
        .post(
            "/v1/pools/policy/weights",
            &json!({"checkpoint": format!("file://{}", v1.display()), "version": 1}),
        )
        .await;
    assert_eq!(status, 502, "{body}");
    let message = body["error"]["message"].as_str().unwrap_or_default();
    assert!(message.contains("VLLM_SERVER_DEV_MODE=1"), "{body}");
    let (_, _) = complete(&gw, "still served").await;
}
