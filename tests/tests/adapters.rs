//! LoRA adapters as models, on stand-in vLLM engines
//! (`tests/standins/llm_engine.py`, which speaks vLLM's runtime LoRA API):
//! listed with their parent, loaded on demand where a request goes, kept
//! where they are loaded, an idle one unloaded to make room, and a load
//! that fails answered clearly without harming the others.

mod common;

use std::path::{Path, PathBuf};

use common::{Gateway, eventually, kind};
use serde_json::{Value, json};

fn engine() -> String {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("standins/llm_engine.py")
        .to_string_lossy()
        .into_owned()
}

/// An adapter folder as PEFT writes one (the engine checks for its
/// `adapter_config.json`); `broken` leaves that file out.
fn adapter(root: &Path, name: &str, broken: bool) -> PathBuf {
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

/// An app `base` of `replicas` stand-in engines with two adapter slots
/// each, serving `adapters` (name, folder).
fn config(replicas: u32, adapters: &[(&str, &Path)]) -> String {
    let models: String = adapters
        .iter()
        .map(|(n, p)| {
            format!(
                "[[apps.adapters.models]]\nname = \"{n}\"\ncheckpoint = \"file://{}\"\n",
                p.display()
            )
        })
        .collect();
    format!(
        r#"
        [[apps]]
        name = "base"
        command = ["python3", "{engine}", "--model", "base", "--slots", "4",
                   "--prefill-ms-per-token", "0.01", "--decode-ms-per-token", "1",
                   "--max-loras", "2", "--lora-load-ms", "50"]
        env = {{ VLLM_ALLOW_RUNTIME_LORA_UPDATING = "True" }}
        concurrency = 16
        startup_timeout = "60s"
        [apps.health]
        path = "/health"
        [apps.autoscale]
        min = {replicas}
        max = {replicas}
        [apps.adapters]
        max_loaded = 2
{models}
        "#,
        engine = engine()
    )
}

async fn chat(gw: &Gateway, model: &str) -> (u16, String, Value) {
    let r = gw
        .http
        .post(gw.at("/v1/chat/completions"))
        .json(&json!({
            "model": model,
            "messages": [{"role": "user", "content": "hello there"}],
            "max_tokens": 2,
        }))
        .send()
        .await
        .expect("send");
    let replica = r
        .headers()
        .get("x-warmgate-replica")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    let status = r.status().as_u16();
    (status, replica, r.json().await.unwrap_or(Value::Null))
}

async fn ready(gw: &Gateway, n: u64) {
    eventually(&format!("{n} replicas of base ready"), || async {
        let s = gw.json("/v1/status").await;
        (s["apps"][0]["ready"].as_u64() == Some(n)).then_some(())
    })
    .await;
}

async fn loads(gw: &Gateway, adapter: &str) -> f64 {
    gw.metric(&format!(
        r#"warmgate_adapter_loads_total{{app="base",adapter="{adapter}"}}"#
    ))
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn adapters_are_listed_loaded_on_demand_and_kept_where_they_are_loaded() {
    let dir = tempfile::tempdir().expect("dir");
    let (a, b) = (
        adapter(dir.path(), "sql", false),
        adapter(dir.path(), "chat", false),
    );
    let gw = Gateway::start(&config(2, &[("org/sql-lora", &a), ("chat-lora", &b)]));
    ready(&gw, 2).await;

    // Listed as vLLM lists them: models whose parent is the base.
    let models = gw.json("/v1/models").await;
    let parents: Vec<(String, Value)> = models["data"]
        .as_array()
        .expect("data")
        .iter()
        .map(|m| {
            (
                m["id"].as_str().unwrap_or("").to_string(),
                m["parent"].clone(),
            )
        })
        .collect();
    assert!(
        parents.contains(&("org/sql-lora".into(), json!("base"))),
        "{models}"
    );
    assert!(
        parents.contains(&("chat-lora".into(), json!("base"))),
        "{models}"
    );
    let one = gw.json("/v1/models/org/sql-lora").await;
    assert_eq!(one["parent"], "base", "{one}");

    // The first request waits for the load, and says so.
    let r = gw
        .http
        .post(gw.at("/v1/chat/completions"))
        .json(&json!({"model": "org/sql-lora", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}))
        .send()
        .await
        .expect("send");
    assert_eq!(r.status(), 200);
    let waited: u64 = r
        .headers()
        .get("x-warmgate-adapter-load-ms")
        .and_then(|v| v.to_str().ok()?.parse().ok())
        .expect("x-warmgate-adapter-load-ms on the request that loaded it");
    assert!(waited >= 50, "the stand-in takes 50 ms to load: {waited}");
    // Ten more in turn: no other load, one replica.
    let mut seen = std::collections::BTreeSet::new();
    for _ in 0..10 {
        let (status, replica, body) = chat(&gw, "org/sql-lora").await;
        assert_eq!(status, 200, "{body}");
        assert_eq!(
            body["model"], "org/sql-lora",
            "the engine served the adapter"
        );
        seen.insert(replica);
    }
    assert_eq!(
        seen.len(),
        1,
        "one replica serves a steady adapter: {seen:?}"
    );
    assert_eq!(loads(&gw, "org/sql-lora").await, 1.0);
    // status says which replica holds it.
    let status = gw.json("/v1/status").await;
    let held = &status["apps"][0]["adapters"];
    let sql = held
        .as_array()
        .and_then(|a| a.iter().find(|x| x["name"] == "org/sql-lora"))
        .unwrap_or_else(|| panic!("{held}"));
    assert_eq!(
        sql["replicas"],
        json!(seen.iter().collect::<Vec<_>>()),
        "{held}"
    );
    // The base model is served as before, on any replica.
    let (status, _, body) = chat(&gw, "base").await;
    assert_eq!(status, 200, "{body}");
    // A name nobody serves is a 404 that lists the adapters too.
    let (status, _, body) = chat(&gw, "nope-lora").await;
    assert_eq!(status, 404);
    let msg = body["error"]["message"].as_str().unwrap_or("");
    assert!(
        msg.contains("chat-lora") && msg.contains("org/sql-lora"),
        "{msg}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_adapter_makes_room_and_a_failed_load_harms_no_other() {
    let dir = tempfile::tempdir().expect("dir");
    let folders: Vec<PathBuf> = ["a", "b", "c"]
        .iter()
        .map(|n| adapter(dir.path(), n, false))
        .collect();
    let broken = adapter(dir.path(), "broken", true);
    let gw = Gateway::start(&config(
        1,
        &[
            ("lora-a", &folders[0]),
            ("lora-b", &folders[1]),
            ("lora-c", &folders[2]),
            ("lora-broken", &broken),
        ],
    ));
    ready(&gw, 1).await;
    for model in ["lora-a", "lora-b", "lora-a"] {
        let (status, _, body) = chat(&gw, model).await;
        assert_eq!(status, 200, "{model}: {body}");
    }
    // Two slots, both full: c pushes out b, the least recently used.
    let (status, _, body) = chat(&gw, "lora-c").await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        gw.metric(r#"warmgate_adapter_evictions_total{app="base",adapter="lora-b"}"#)
            .await,
        1.0
    );
    assert_eq!(loads(&gw, "lora-a").await, 1.0, "a was kept");
    // b loads again, in the place of a (now the least recently used).
    let (status, _, body) = chat(&gw, "lora-b").await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(loads(&gw, "lora-b").await, 2.0);

    // A folder the engine cannot load: a clear 502, and the others serve.
    let (status, _, body) = chat(&gw, "lora-broken").await;
    assert_eq!(status, 502, "{body}");
    assert_eq!(kind(&body), "replica_failed");
    let msg = body["error"]["message"].as_str().unwrap_or("");
    assert!(
        msg.contains("lora-broken") && msg.contains("could not be loaded"),
        "{msg}"
    );
    for model in ["lora-b", "lora-c", "base"] {
        let (status, _, body) = chat(&gw, model).await;
        assert_eq!(status, 200, "{model}: {body}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn adapters_are_added_and_removed_through_the_api_without_a_restart() {
    let dir = tempfile::tempdir().expect("dir");
    let first = adapter(dir.path(), "first", false);
    let added = adapter(dir.path(), "added", false);
    let config = config(1, &[("first-lora", &first)]).replace(
        "[[apps]]",
        &format!(
            "[weights]\nallowed_prefixes = [\"file://{}\"]\n[[apps]]",
            dir.path().display()
        ),
    );
    let gw = Gateway::start(&config);
    ready(&gw, 1).await;
    let pid = gw.replica_pids("base").await;
    let put = async |name: &str, body: Value| {
        let r = gw
            .http
            .put(gw.at(&format!("/v1/apps/base/adapters/{name}")))
            .json(&body)
            .send()
            .await
            .expect("send");
        let status = r.status().as_u16();
        (status, r.json::<Value>().await.unwrap_or(Value::Null))
    };
    let checkpoint = format!("file://{}", added.display());
    let (status, body) = put("team/added-lora", json!({"checkpoint": checkpoint})).await;
    assert_eq!(status, 201, "{body}");
    assert_eq!(body["change"], "created");
    let (status, body) = put("team/added-lora", json!({"checkpoint": checkpoint})).await;
    assert_eq!(
        (status, body["change"].as_str()),
        (200, Some("unchanged")),
        "{body}"
    );
    let (status, _, body) = chat(&gw, "team/added-lora").await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(gw.replica_pids("base").await, pid, "no replica restarted");

    // Refused: a folder outside the allowed prefixes, a store the engine
    // cannot read, a name that is no model name, an unknown app.
    let (status, body) = put("x-lora", json!({"checkpoint": "file:///etc"})).await;
    assert_eq!(status, 400, "{body}");
    let (status, body) = put("x-lora", json!({"checkpoint": "s3://bucket/x"})).await;
    assert_eq!(status, 400, "{body}");
    let (status, body) = put("bad%1Bname", json!({"checkpoint": checkpoint})).await;
    assert_eq!(status, 400, "{body}");
    let r = gw
        .http
        .put(gw.at("/v1/apps/nope/adapters/x"))
        .json(&json!({"checkpoint": checkpoint}))
        .send()
        .await
        .expect("send");
    assert_eq!(r.status(), 404);

    // Deleted: no longer a model.
    let r = gw
        .http
        .delete(gw.at("/v1/apps/base/adapters/team/added-lora"))
        .send()
        .await
        .expect("send");
    assert_eq!(r.status(), 200);
    let (status, _, _) = chat(&gw, "team/added-lora").await;
    assert_eq!(status, 404);
    let (status, _, body) = chat(&gw, "first-lora").await;
    assert_eq!(status, 200, "{body}");
    let r = gw
        .http
        .delete(gw.at("/v1/apps/base/adapters/team/added-lora"))
        .send()
        .await
        .expect("send");
    assert_eq!(r.status(), 404);
}
