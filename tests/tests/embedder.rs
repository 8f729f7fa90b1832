//! The real embeddings worker behind the gateway: all-MiniLM-L6-v2 weights
//! streamed through warmgate's cache, OpenAI-compatible answers, and the
//! official `openai` Python client.

mod common;

use std::path::PathBuf;

use common::{Gateway, bin, eventually};
use serde_json::{Value, json};

/// The checkpoint fetched by `examples/fetch-minilm.sh` (run by `.ci/run`).
fn minilm() -> Option<PathBuf> {
    let dir = std::env::var_os("WARMGATE_MINILM").map_or_else(
        || PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../checkpoints/minilm"),
        PathBuf::from,
    );
    if dir.join("model.safetensors").exists() {
        return Some(std::path::absolute(dir).expect("absolute path"));
    }
    assert!(
        std::env::var_os("CI").is_none(),
        "{} is missing under CI; .ci/run fetches it with examples/fetch-minilm.sh",
        dir.display()
    );
    eprintln!(
        "SKIPPED: no MiniLM checkpoint at {}; run examples/fetch-minilm.sh",
        dir.display()
    );
    None
}

fn config(ckpt: &std::path::Path) -> String {
    format!(
        r#"
        [[apps]]
        name = "minilm"
        aliases = ["all-MiniLM-L6-v2"]
        command = ["{}"]
        checkpoint = "file://{}"
        concurrency = 4
        [apps.autoscale]
        scale_to_zero_after = "1s"
        stable_window = "2s"
        panic_window = "1s"
        "#,
        bin("embedder").display(),
        ckpt.display()
    )
}

fn cosine(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

async fn embed(gw: &Gateway, inputs: &[&str]) -> Vec<Vec<f64>> {
    let resp = gw
        .http
        .post(gw.at("/v1/embeddings"))
        .json(&json!({"model": "minilm", "input": inputs}))
        .send()
        .await
        .expect("send");
    assert_eq!(resp.status(), 200);
    let body: Value = resp.json().await.expect("json");
    body["data"]
        .as_array()
        .expect("data")
        .iter()
        .map(|d| {
            d["embedding"]
                .as_array()
                .expect("floats")
                .iter()
                .map(|x| x.as_f64().expect("float"))
                .collect()
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn minilm_embeddings_rank_sentences_as_a_person_would() {
    let Some(ckpt) = minilm() else { return };
    let gw = Gateway::start(&config(&ckpt));
    let v = embed(
        &gw,
        &[
            "A man is eating food.",
            "A man is eating a piece of bread.",
            "The girl is carrying a baby.",
            "A man is riding a horse.",
            "A man is riding a white horse on an enclosed ground.",
        ],
    )
    .await;
    assert_eq!(v.len(), 5);
    for e in &v {
        assert_eq!(e.len(), 384, "MiniLM-L6 has 384 dimensions");
        assert!((cosine(e, e) - 1.0).abs() < 1e-4, "L2-normalised");
    }
    // sentence-transformers' documentation gives 0.7553 for this pair with
    // this model (mean pooling, normalised): the reference value.
    let food_bread = cosine(&v[0], &v[1]);
    assert!((food_bread - 0.7553).abs() < 1e-3, "cos = {food_bread}");
    assert!(
        food_bread > cosine(&v[0], &v[2]) + 0.5,
        "eating ≉ carrying a baby"
    );
    assert!(
        cosine(&v[3], &v[4]) > cosine(&v[3], &v[2]),
        "horse riding pairs up"
    );
    assert!(cosine(&v[3], &v[4]) > cosine(&v[3], &v[1]));

    // Bad input is a clear 400 from the worker, passed through.
    let resp = gw
        .http
        .post(gw.at("/v1/embeddings"))
        .json(&json!({"model": "minilm", "input": 42}))
        .send()
        .await
        .expect("send");
    assert_eq!(resp.status(), 400);

    // Token ids in the model's own vocabulary, as OpenAI's API allows:
    // "hello world" is [CLS] hello world [SEP] = 101 7592 2088 102 in
    // bert-base-uncased's vocabulary, which MiniLM uses. One array is one
    // input, an array of arrays several; either gives the text's vector.
    let text = embed(&gw, &["hello world"]).await;
    for input in [
        json!([101, 7592, 2088, 102]),
        json!([[101, 7592, 2088, 102], [101, 102]]),
    ] {
        let resp = gw
            .http
            .post(gw.at("/v1/embeddings"))
            .json(&json!({"model": "minilm", "input": input}))
            .send()
            .await
            .expect("send");
        assert_eq!(resp.status(), 200);
        let body: serde_json::Value = resp.json().await.expect("json");
        let v: Vec<f64> = body["data"][0]["embedding"]
            .as_array()
            .expect("vector")
            .iter()
            .filter_map(serde_json::Value::as_f64)
            .collect();
        assert!(
            cosine(&v, &text[0]) > 0.9999,
            "{input}: the ids embed as the text"
        );
    }
    for (input, says) in [
        (json!([101, 40000, 102]), "outside this model's vocabulary"),
        (json!([]), "must"),
        (json!([[101], "text"]), "must be"),
        (json!([-1]), "must be"),
    ] {
        let resp = gw
            .http
            .post(gw.at("/v1/embeddings"))
            .json(&json!({"model": "minilm", "input": input}))
            .send()
            .await
            .expect("send");
        assert_eq!(resp.status(), 400, "{input}");
        let body: serde_json::Value = resp.json().await.expect("json");
        assert!(
            body["error"]["message"]
                .as_str()
                .is_some_and(|m| m.contains(says)),
            "{input}: {body}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_cold_start_reads_the_weights_from_the_cache() {
    let Some(ckpt) = minilm() else { return };
    let gw = Gateway::start(&config(&ckpt));
    let first = embed(&gw, &["warm pools"]).await;
    let from_store = gw.metric("warmgate_weights_store_bytes_total").await;
    assert!(
        from_store > 90e6,
        "the first start streamed the model from the store: {from_store}"
    );

    eventually("the app scales to zero", || async {
        let s = gw.app_status("minilm").await;
        (s["pool"]["replicas"].as_array().is_some_and(Vec::is_empty) && s["desired"] == 0)
            .then_some(())
    })
    .await;
    let second = embed(&gw, &["warm pools"]).await;
    assert!(
        (cosine(&first[0], &second[0]) - 1.0).abs() < 1e-6,
        "same weights, same vector"
    );
    assert_eq!(
        gw.metric("warmgate_weights_store_bytes_total").await,
        from_store,
        "the second start did not go back to the store"
    );
    assert!(
        gw.metric("warmgate_weights_cache_bytes_total").await > 90e6,
        "it read the cache"
    );

    // The worker's URL serves the worker (with its token) and no one else
    // (a client without a token: the harness's carries the admin token).
    let s = gw.app_status("minilm").await;
    assert_eq!(s["revision"], "minilm-00001");
    let plain = reqwest::Client::new();
    for path in [
        "/v1/weights/minilm/minilm-00001",
        "/v1/weights/minilm/minilm-00001/config.json",
    ] {
        let resp = plain.get(gw.at(path)).send().await.expect("send");
        assert_eq!(resp.status(), 401, "{path}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openai_python_client_gets_real_vectors() {
    let Some(ckpt) = minilm() else { return };
    if !common::has_openai() {
        return;
    }
    let gw = Gateway::start(&config(&ckpt));
    let script = r#"
import sys
from openai import OpenAI
client = OpenAI(base_url=sys.argv[1] + "/v1", api_key="unused")
r = client.embeddings.create(model="minilm", input=["A man is eating food.", "A man is eating a piece of bread."])
a, b = r.data[0].embedding, r.data[1].embedding
# The client asks for base64 unless told otherwise and decodes it; floats
# asked for plainly are the same vector, and a raw base64 answer is a string.
f = client.embeddings.create(model="minilm", input="A man is eating food.", encoding_format="float")
assert max(abs(x - y) for x, y in zip(f.data[0].embedding, a)) < 1e-6
raw = client.post("/embeddings", cast_to=object, body={
    "model": "minilm", "input": "A man is eating food.", "encoding_format": "base64"})
assert isinstance(raw["data"][0]["embedding"], str), raw
print(len(a), round(sum(x * y for x, y in zip(a, b)), 4), r.usage.prompt_tokens)
"#;
    let text = common::python(script, &gw.url).await;
    let fields: Vec<&str> = text.split_whitespace().collect();
    assert_eq!(fields[0], "384", "{text}");
    let cos: f64 = fields[1].parse().expect("cosine");
    assert!((cos - 0.7553).abs() < 1e-3, "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_starting_together_share_one_download() {
    let Some(ckpt) = minilm() else { return };
    // Two replicas from the start: both stream the checkpoint at once.
    let config = format!(
        r#"
        [[apps]]
        name = "minilm"
        command = ["{}"]
        checkpoint = "file://{}"
        [apps.autoscale]
        min = 2
        max = 2
        "#,
        bin("embedder").display(),
        ckpt.display()
    );
    let gw = Gateway::start(&config);
    gw.wait_ready("minilm", 2).await;
    let from_store = gw.metric("warmgate_weights_store_bytes_total").await;
    let on_disk: u64 = ["config.json", "tokenizer.json", "model.safetensors"]
        .iter()
        .map(|f| std::fs::metadata(ckpt.join(f)).expect("file").len())
        .sum();
    assert_eq!(
        from_store as u64, on_disk,
        "each file came from the store exactly once"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_minilm_checkpoint_is_promoted_and_serves() {
    let Some(ckpt) = minilm() else { return };
    let gw = Gateway::start(&format!(
        r#"
        [[apps]]
        name = "minilm"
        command = ["{}"]
        checkpoint = "file://{}"
        concurrency = 4
        [apps.autoscale]
        min = 1
        {}
        "#,
        bin("embedder").display(),
        ckpt.display(),
        common::allow_checkpoints_under(&[&ckpt])
    ));
    gw.wait_ready("minilm", 1).await;
    // A "new" checkpoint: the same files in another folder, so its
    // weights stream through the cache again.
    let next = gw.dir.path().join("minilm-v2");
    std::fs::create_dir_all(&next).expect("mkdir");
    for f in ["config.json", "tokenizer.json", "model.safetensors"] {
        std::fs::copy(ckpt.join(f), next.join(f)).expect("copy");
    }
    let t0 = std::time::Instant::now();
    let r = gw
        .http
        .post(gw.at("/v1/apps/minilm/promote"))
        .json(&json!({"checkpoint": format!("file://{}", next.display()), "wait": true}))
        .send()
        .await
        .expect("promote");
    let took = t0.elapsed();
    let body: Value = r.json().await.expect("json");
    assert_eq!(body["promotion"]["phase"], "done", "{body}");
    eprintln!("MiniLM: promote -> serving 100% in {took:?} (debug build)");
    let r = gw
        .http
        .post(gw.at("/v1/embeddings"))
        .json(&json!({"model": "minilm", "input": "hello"}))
        .send()
        .await
        .expect("embed");
    assert_eq!(r.headers()["x-warmgate-revision"], "minilm-00002");
    let v: Value = r.json().await.expect("json");
    assert_eq!(
        v["data"][0]["embedding"].as_array().map(Vec::len),
        Some(384)
    );

    // Rolling back to the first revision reads its weights from the cache:
    // nothing more comes from the store.
    let from_store = gw.metric("warmgate_weights_store_bytes_total").await;
    let r = gw
        .http
        .post(gw.at("/v1/apps/minilm/rollback"))
        .send()
        .await
        .expect("rollback");
    assert_eq!(r.status(), 200);
    eventually("minilm-00001 serves again", || async {
        let s = gw.app_status("minilm").await;
        (s["revision"] == "minilm-00001" && s["promotion"]["phase"] == "done" && s["ready"] == 1)
            .then_some(())
    })
    .await;
    assert_eq!(
        gw.metric("warmgate_weights_store_bytes_total").await,
        from_store,
        "the rollback started from the cache"
    );
}
