//! LoRA adapters as models, on stand-in vLLM engines
//! (`tests/standins/llm_engine.py`, which speaks vLLM's runtime LoRA API):
//! listed with their parent, loaded on demand where a request goes, kept
//! where they are loaded, an idle one unloaded to make room, and a load
//! that fails answered clearly without harming the others.

mod common;

use std::path::{Path, PathBuf};

use common::{Gateway, eventually, kind};
use serde_json::{Value, json};

/// An adapter folder as PEFT writes one; `broken` leaves out its
/// `adapter_config.json`.
fn adapter(root: &Path, name: &str, broken: bool) -> PathBuf {
    common::peft_adapter(root, name, broken)
}

/// `config` with `[weights] allowed_prefixes` set to the folder `dir`.
fn allowing(config: String, dir: &Path) -> String {
    config.replace(
        "[[apps]]",
        &format!(
            "[weights]\nallowed_prefixes = [\"file://{}\"]\n[[apps]]",
            dir.display()
        ),
    )
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
        engine = common::llm_engine()
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
    let config = allowing(config(1, &[("first-lora", &first)]), dir.path());
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

/// Requests answered, and the failures' statuses and messages.
type Tally = (u64, Vec<String>);

/// Requests sent in a loop to one model until told to stop, with the
/// statuses they got.
struct Load {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    tasks: Vec<(String, tokio::task::JoinHandle<Tally>)>,
}

impl Load {
    fn start(gw: &Gateway, models: &[&str]) -> Load {
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let tasks = models
            .iter()
            .map(|m| {
                let (http, url, model, stop) = (
                    gw.http.clone(),
                    gw.at("/v1/chat/completions"),
                    m.to_string(),
                    stop.clone(),
                );
                let task = tokio::spawn(async move {
                    let (mut ok, mut failed) = (0u64, Vec::new());
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        let r = http
                            .post(&url)
                            .json(&json!({
                                "model": model,
                                "messages": [{"role": "user", "content": "hi"}],
                                "max_tokens": 2,
                            }))
                            .send()
                            .await;
                        match r {
                            Ok(r) if r.status().is_success() => ok += 1,
                            Ok(r) => failed.push(format!(
                                "{}: {}",
                                r.status(),
                                r.text().await.unwrap_or_default()
                            )),
                            Err(e) => failed.push(e.to_string()),
                        }
                    }
                    (ok, failed)
                });
                (m.to_string(), task)
            })
            .collect();
        Load { stop, tasks }
    }

    /// Stops it: (model, answered, failures) each.
    async fn stop(self) -> Vec<(String, u64, Vec<String>)> {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let mut out = Vec::new();
        for (m, t) in self.tasks {
            let (ok, failed) = t.await.expect("load task");
            out.push((m, ok, failed));
        }
        out
    }
}

async fn adapter_status(gw: &Gateway, name: &str) -> Value {
    let s = gw.json("/v1/status").await;
    s["apps"][0]["adapters"]
        .as_array()
        .and_then(|a| a.iter().find(|x| x["name"] == name).cloned())
        .unwrap_or(Value::Null)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_adapter_promoted_under_load_rolls_back_on_a_failing_gate_or_canary_and_harms_no_other()
{
    let dir = tempfile::tempdir().expect("dir");
    let v1 = adapter(dir.path(), "sql-v1", false);
    let chat_dir = adapter(dir.path(), "chat", false);
    let broken = adapter(dir.path(), "sql-broken", true);
    let v2 = adapter(dir.path(), "sql-v2", false);
    let fail = dir.path().join("gate-fails");
    std::fs::write(&fail, b"").expect("write");
    let blind = dir.path().join("gate-looks-away");
    // The gate asks the new revision by the name that pins it; it fails
    // while the file `gate-fails` exists, and passes without asking while
    // `gate-looks-away` does (so that the canary is what catches a bad one).
    let gate = dir.path().join("gate.py");
    std::fs::write(
        &gate,
        format!(
            r#"import json, os, sys, urllib.request
if os.path.exists({fail:?}):
    sys.exit("the evaluation found regressions")
if os.path.exists({blind:?}):
    sys.exit(0)
req = urllib.request.Request(os.environ["WARMGATE_EVAL_OPENAI_BASE"] + "/chat/completions",
    data=json.dumps({{"model": os.environ["WARMGATE_EVAL_MODEL"], "max_tokens": 2,
                      "messages": [{{"role": "user", "content": "eval"}}]}}).encode(),
    headers={{"content-type": "application/json"}})
answer = json.load(urllib.request.urlopen(req, timeout=30))
assert answer["model"] == os.environ["WARMGATE_EVAL_MODEL"], answer
"#,
            fail = fail.display().to_string(),
            blind = blind.display().to_string()
        ),
    )
    .expect("write gate");
    let config = allowing(
        config(2, &[("sql-lora", &v1), ("chat-lora", &chat_dir)]),
        dir.path(),
    )
    .replace(
        "[apps.adapters]",
        &format!(
            "[apps.promotion]\nmin_requests = 5\nmax_error_rate = 0.2\nbake = \"2s\"\n\
                 gate_command = [\"python3\", \"{}\"]\ngate_timeout = \"60s\"\n[apps.adapters]",
            gate.display()
        ),
    )
    .replacen(
        "name = \"sql-lora\"\n",
        "name = \"sql-lora\"\naliases = [\"sql\"]\n",
        1,
    );
    let gw = Gateway::start(&config);
    ready(&gw, 2).await;
    let models = gw.json("/v1/models").await;
    assert!(
        models["data"]
            .as_array()
            .is_some_and(|d| d.iter().any(|m| m["id"] == "sql" && m["parent"] == "base")),
        "the alias is a model of base: {models}"
    );
    let (status, _, body) = chat(&gw, "sql").await;
    assert_eq!(
        (status, body["model"].as_str()),
        (200, Some("sql-lora")),
        "{body}"
    );

    let pids = gw.replica_pids("base").await;
    let load = Load::start(&gw, &["base", "chat-lora", "sql", "sql-lora"]);
    let promote = async |checkpoint: &Path, canary: u8| {
        let (status, body) = gw
            .post(
                "/v1/apps/base/promote",
                &json!({"adapter": "sql-lora", "checkpoint": format!("file://{}", checkpoint.display()),
                        "canary": canary, "wait": true}),
            )
            .await;
        assert_eq!(status, 200, "{body}");
        body
    };

    // 1. Through the CLI: the gate fails, exit 1, nothing moved.
    let out = tokio::process::Command::new(common::bin("warmgate"))
        .args(["promote", "base", &format!("file://{}", v2.display())])
        .args(["--adapter", "sql-lora", "--canary", "50", "--wait"])
        .args(["--gateway", &gw.url])
        .output()
        .await
        .expect("run warmgate promote");
    let said = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{said}");
    assert!(said.contains("regressions"), "the gate's words: {said}");
    assert!(said.contains("sql-lora@2"), "{said}");
    assert_eq!(adapter_status(&gw, "sql-lora").await["revision"], 1);

    // 2. A checkpoint the engine cannot load: the canary's requests fail,
    // it rolls back on the error rate.
    std::fs::remove_file(&fail).expect("rm");
    std::fs::write(&blind, b"").expect("write");
    let body = promote(&broken, 50).await;
    assert_eq!(
        body["revision"], "sql-lora@3",
        "revision 2 is not given twice"
    );
    assert_eq!(body["promotion"]["phase"], "rolled_back", "{body}");
    assert!(
        body["promotion"]["reason"]
            .as_str()
            .is_some_and(|r| r.contains("error rate")),
        "{body}"
    );
    let s = adapter_status(&gw, "sql-lora").await;
    assert_eq!(
        (s["revision"].as_u64(), &s["promotion"]["phase"]),
        (Some(1), &json!("rolled_back")),
        "{s}"
    );

    // 3. A good one: the gate reaches it by name, the canary is healthy,
    // it becomes the adapter's, and both names now reach it.
    std::fs::remove_file(&blind).expect("rm");
    let body = promote(&v2, 50).await;
    assert_eq!(body["promotion"]["phase"], "done", "{body}");
    assert_eq!(body["revision"], "sql-lora@4");
    assert!(body["promotion"]["answered"].as_u64() > Some(0), "{body}");
    let (status, _, body) = chat(&gw, "sql").await;
    assert_eq!(
        (status, body["model"].as_str()),
        (200, Some("sql-lora@4")),
        "{body}"
    );
    let s = adapter_status(&gw, "sql-lora").await;
    assert_eq!(s["revision"], 4, "{s}");
    assert!(s["requests"].as_u64() > Some(100), "requests counted: {s}");
    assert!(
        gw.metric(r#"warmgate_adapter_requests_total{app="base",adapter="sql-lora"}"#)
            .await
            > 100.0
    );
    assert!(
        s["checkpoint"]
            .as_str()
            .is_some_and(|c| c.ends_with("sql-v2")),
        "{s}"
    );

    // One at a time; an unknown adapter, a store the engine cannot read.
    let slow = promote_started(&gw, &v1).await;
    assert_eq!(slow.0, 202, "{}", slow.1);
    let again = promote_started(&gw, &v1).await;
    assert_eq!(again.0, 409, "{}", again.1);
    let (status, body) = gw
        .post(
            "/v1/apps/base/promote",
            &json!({"adapter": "nope", "checkpoint": format!("file://{}", v1.display())}),
        )
        .await;
    assert_eq!(status, 404, "{body}");
    let (status, body) = gw
        .post(
            "/v1/apps/base/promote",
            &json!({"adapter": "chat-lora", "checkpoint": "s3://bucket/x"}),
        )
        .await;
    assert_eq!(status, 400, "{body}");

    let results = load.stop().await;
    for (model, ok, failed) in &results {
        assert!(*ok > 0, "{model} was served");
        if model != "sql" && model != "sql-lora" {
            assert!(
                failed.is_empty(),
                "{model}: {} failed: {:?}",
                failed.len(),
                &failed[..failed.len().min(3)]
            );
        }
    }
    assert_eq!(gw.replica_pids("base").await, pids, "no replica restarted");
    // The promoted adapter lost only its broken canary's requests.
    for (model, _, failed) in &results {
        for f in failed {
            assert!(f.contains("sql-lora@3"), "{model}: {f}");
        }
    }
}

/// Starts a promotion of `sql-lora` to `checkpoint` with a long bake.
async fn promote_started(gw: &Gateway, checkpoint: &Path) -> (u16, Value) {
    gw.post(
        "/v1/apps/base/promote",
        &json!({"adapter": "sql-lora", "checkpoint": format!("file://{}", checkpoint.display()),
                "bake": "10m"}),
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_an_engine_holds_when_it_joins_is_checked_against_the_record() {
    let dir = tempfile::tempdir().expect("dir");
    let sql = adapter(dir.path(), "sql", false);
    let chat_dir = adapter(dir.path(), "chat", false);
    let elsewhere = adapter(dir.path(), "elsewhere", false);
    let stale = adapter(dir.path(), "stale", false);
    // The engine starts with three adapters (vLLM's --lora-modules): one
    // the app serves from that folder, one it serves from another folder,
    // and one it does not serve.
    let config = config(1, &[("sql-lora", &sql), ("chat-lora", &chat_dir)]).replace(
        r#""--lora-load-ms", "50"]"#,
        &format!(
            r#""--lora-load-ms", "50", "--lora-modules", "sql-lora={}", "chat-lora={}", "stale-lora={}"]"#,
            sql.display(),
            elsewhere.display(),
            stale.display()
        ),
    );
    assert!(config.contains("--lora-modules"));
    let gw = Gateway::start(&config);
    ready(&gw, 1).await;
    let engine_models = async || -> Vec<String> {
        let v = gw.json("/apps/base/v1/models").await;
        let mut ids: Vec<String> = v["data"]
            .as_array()
            .map(|d| {
                d.iter()
                    .filter(|m| !m["parent"].is_null())
                    .filter_map(|m| m["id"].as_str().map(str::to_string))
                    .collect()
            })
            .unwrap_or_default();
        ids.sort();
        ids
    };
    eventually(
        "the engine holds only what the gateway serves there",
        || async { (engine_models().await == ["sql-lora"]).then_some(()) },
    )
    .await;
    let held = eventually("sql-lora is recorded as loaded", || async {
        let s = gw.json("/v1/status").await;
        let a = &s["apps"][0]["adapters"];
        let sql = a.as_array()?.iter().find(|x| x["name"] == "sql-lora")?;
        (!sql["replicas"].as_array()?.is_empty()).then(|| a.clone())
    })
    .await;
    let chat_status = held
        .as_array()
        .and_then(|a| a.iter().find(|x| x["name"] == "chat-lora").cloned())
        .expect("chat-lora listed");
    assert_eq!(
        chat_status["replicas"],
        json!([]),
        "loaded from another folder: not adopted"
    );

    // Served without a load; chat-lora is loaded from its own folder.
    let r = gw
        .http
        .post(gw.at("/v1/chat/completions"))
        .json(&json!({"model": "sql-lora", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}))
        .send()
        .await
        .expect("send");
    assert_eq!(r.status(), 200);
    assert!(
        r.headers().get("x-warmgate-adapter-load-ms").is_none(),
        "no load"
    );
    assert_eq!(loads(&gw, "sql-lora").await, 0.0);
    let (status, _, body) = chat(&gw, "chat-lora").await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(loads(&gw, "chat-lora").await, 1.0);

    // A client cannot load or unload adapters behind the record's back
    // through the passthrough (it could plant its own folder as a future
    // revision's name).
    for path in [
        "/apps/base/v1/load_lora_adapter",
        "/apps/base/V1/./unload_lora_adapter",
        "/apps/base/x/../v1/%6Coad_lora_adapter",
    ] {
        let r = gw
            .http
            .post(gw.at(path))
            .json(&json!({"lora_name": "sql-lora@9", "lora_path": stale.display().to_string()}))
            .send()
            .await
            .expect("send");
        let status = r.status().as_u16();
        let body: Value = r.json().await.unwrap_or(Value::Null);
        assert_eq!(status, 404, "{path}: {body}");
        assert!(
            body["error"]["message"]
                .as_str()
                .is_some_and(|m| m.contains("/v1/apps/{app}/adapters")),
            "{body}"
        );
    }
    assert_eq!(engine_models().await, ["chat-lora", "sql-lora"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_adapter_in_an_object_store_is_pulled_once_into_a_folder_the_engine_loads() {
    let Some(moto) = common::Moto::start(&[]) else {
        return;
    };
    let http = reqwest::Client::new();
    let put = async |path: &str, body: &'static [u8]| {
        let r = http
            .put(format!("{}/{path}", moto.endpoint))
            .body(body)
            .send()
            .await
            .expect("put");
        assert!(r.status().is_success(), "{path}: {}", r.status());
    };
    put("adapters", b"").await;
    put(
        "adapters/sql/adapter_config.json",
        br#"{"peft_type": "LORA", "r": 8}"#,
    )
    .await;
    // An empty safetensors file: its 8-byte header length, then `{}`.
    let empty: &'static [u8] = b"\x02\0\0\0\0\0\0\0{}";
    put("adapters/sql/adapter_model.safetensors", empty).await;
    put("adapters/broken/adapter_model.safetensors", empty).await;
    let env = moto.env("test");
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let config = config(1, &[])
        .replace(
            "[[apps]]",
            "[weights]\nallowed_prefixes = [\"s3://adapters/\"]\n[[apps]]",
        )
        .replace(
        "max_loaded = 2",
        "max_loaded = 2\n[[apps.adapters.models]]\nname = \"sql-lora\"\ncheckpoint = \"s3://adapters/sql\"\n\
         [[apps.adapters.models]]\nname = \"broken-lora\"\ncheckpoint = \"s3://adapters/broken\"\n",
    );
    let gw = Gateway::start_with(&config, &[], &env);
    ready(&gw, 1).await;

    let (status, _, body) = chat(&gw, "sql-lora").await;
    assert_eq!(status, 200, "{body}");
    let (status, _, _) = chat(&gw, "sql-lora").await;
    assert_eq!(status, 200);
    assert_eq!(loads(&gw, "sql-lora").await, 1.0, "loaded once");
    // The engine read a folder of the gateway's state, holding the files.
    let v = gw.json("/apps/base/v1/models").await;
    let root = v["data"]
        .as_array()
        .and_then(|d| d.iter().find(|m| m["id"] == "sql-lora"))
        .and_then(|m| m["root"].as_str())
        .expect("the engine lists sql-lora")
        .to_string();
    assert!(root.contains("/state/adapters/"), "{root}");
    let config_file = std::path::Path::new(&root).join("adapter_config.json");
    assert!(
        std::fs::read_to_string(&config_file).is_ok_and(|t| t.contains("LORA")),
        "{}",
        config_file.display()
    );

    // Files the engine refuses: a clear error, and the others unharmed.
    let (status, _, body) = chat(&gw, "broken-lora").await;
    assert_eq!(status, 502, "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("broken-lora") && m.contains("No adapter found")),
        "{body}"
    );
    let (status, _, _) = chat(&gw, "sql-lora").await;
    assert_eq!(status, 200);

    // A prefix with nothing in it, through the API: the load names it.
    let r = gw
        .http
        .put(gw.at("/v1/apps/base/adapters/empty-lora"))
        .json(&json!({"checkpoint": "s3://adapters/nothing-here"}))
        .send()
        .await
        .expect("send");
    assert_eq!(r.status(), 201);
    let (status, _, body) = chat(&gw, "empty-lora").await;
    assert_eq!(status, 502, "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("s3://adapters/nothing-here")),
        "{body}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_adapters_training_run_is_followed_and_each_complete_checkpoint_promoted() {
    let dir = tempfile::tempdir().expect("dir");
    let first = adapter(dir.path(), "first", false);
    let runs = dir.path().join("runs");
    std::fs::create_dir_all(&runs).expect("mkdir");
    let config = allowing(config(1, &[("sql-lora", &first)]), dir.path())
        .replace(
            "[apps.adapters]",
            "[apps.promotion]\nbake = \"500ms\"\nwatch_interval = \"200ms\"\n[apps.adapters]",
        )
        .replacen(
            "name = \"sql-lora\"\n",
            &format!(
                "name = \"sql-lora\"\nwatch = \"file://{}\"\n",
                runs.display()
            ),
            1,
        );
    let gw = Gateway::start(&config);
    ready(&gw, 1).await;
    let pids = gw.replica_pids("base").await;

    // A step being written (no marker yet) is left alone.
    adapter(&runs, "step-100", false);
    let (status, _, body) = chat(&gw, "sql-lora").await;
    assert_eq!((status, body["model"].as_str()), (200, Some("sql-lora")));
    // Whole: promoted, and served by its new revision.
    complete(&runs, "step-100");
    let s = serving_step(&gw, "step-100").await;
    assert_eq!(s["revision"], 2, "{s}");
    assert_eq!(s["promotion"]["phase"], "done", "{s}");
    let (status, _, body) = chat(&gw, "sql-lora").await;
    assert_eq!(
        (status, body["model"].as_str()),
        (200, Some("sql-lora@2")),
        "{body}"
    );

    // A broken one is rolled back on its canary and not tried again; the
    // next good one is promoted past it.
    adapter(&runs, "step-200", true);
    complete(&runs, "step-200");
    let s = eventually("step-200 rolled back", || async {
        // Traffic for the canary to judge.
        let _ = chat(&gw, "sql-lora").await;
        let s = adapter_status(&gw, "sql-lora").await;
        (s["promotion"]["phase"] == "rolled_back").then_some(s)
    })
    .await;
    assert!(
        s["promotion"]["checkpoint"]
            .as_str()
            .is_some_and(|c| c.ends_with("step-200")),
        "{s}"
    );
    assert_eq!(s["revision"], 2, "{s}");
    adapter(&runs, "step-300", false);
    complete(&runs, "step-300");
    let s = serving_step(&gw, "step-300").await;
    assert_eq!(s["revision"], 4, "revision 3 went to step-200: {s}");
    assert_eq!(gw.replica_pids("base").await, pids, "no replica restarted");
}

/// Training marks the checkpoint `step` of `runs` whole.
fn complete(runs: &Path, step: &str) {
    std::fs::write(runs.join(step).join("_COMPLETE"), b"").expect("marker");
}

/// Waits until `sql-lora` serves the checkpoint `runs/step`; its status.
async fn serving_step(gw: &Gateway, step: &str) -> Value {
    let suffix = format!("runs/{step}");
    eventually(&format!("{step} is the adapter's"), || async {
        let s = adapter_status(gw, "sql-lora").await;
        s["checkpoint"]
            .as_str()
            .is_some_and(|c| c.ends_with(&suffix))
            .then_some(s)
    })
    .await
}

/// An adapter folder that did not exist when it was put, and is later
/// made a link out of the allowed prefixes, is refused at its load (as a
/// checkpoint is at every open); a `watch` outside them, at the put.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_adapter_is_held_to_the_allow_list_at_every_load_and_watch_at_the_put() {
    let dir = tempfile::tempdir().expect("dir");
    let allowed = dir.path().join("allowed");
    std::fs::create_dir_all(&allowed).expect("mkdir");
    let outside = adapter(dir.path(), "outside", false);
    let config = allowing(config(1, &[]), &allowed);
    let gw = Gateway::start(&config);
    ready(&gw, 1).await;
    // Put while the folder does not exist yet: it is under the prefix.
    let later = allowed.join("later");
    let r = gw
        .http
        .put(gw.at("/v1/apps/base/adapters/later-lora"))
        .json(&json!({"checkpoint": format!("file://{}", later.display())}))
        .send()
        .await
        .expect("send");
    assert_eq!(r.status().as_u16(), 201, "under the prefix");
    // Then made a link to a folder outside the prefixes.
    std::os::unix::fs::symlink(&outside, &later).expect("link");
    let (status, _, body) = chat(&gw, "later-lora").await;
    assert_ne!(
        status, 200,
        "loaded through a link out of the prefixes: {body}"
    );
    assert!(
        body.to_string().contains("outside the allowed prefix"),
        "{body}"
    );
    // A watch prefix outside the allowed ones is refused at the put.
    let mut spec: Value = gw.json("/v1/apps/base").await["spec"].clone();
    if spec.is_null() {
        spec = json!({"command": ["true"]});
    }
    spec["promotion"] = json!({"watch": "file:///etc"});
    let r = gw
        .http
        .put(gw.at("/v1/apps/watcher"))
        .json(&spec)
        .send()
        .await
        .expect("send");
    let status = r.status().as_u16();
    let body: Value = r.json().await.unwrap_or(Value::Null);
    assert_eq!(status, 400, "{body}");
    assert!(
        body.to_string()
            .contains("outside the allowed checkpoint prefixes"),
        "refused for the watch prefix: {body}"
    );
}

/// Adapters pulled from an object store share the weight cache's byte
/// budget and are pulled once while they are kept; one larger than the
/// whole budget is refused, not held past it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pulled_adapters_share_the_cache_budget_and_are_pulled_once_while_kept() {
    let Some(moto) = common::Moto::start(&[]) else {
        return;
    };
    let http = reqwest::Client::new();
    let put = async |path: &str, body: Vec<u8>| {
        let r = http
            .put(format!("{}/{path}", moto.endpoint))
            .body(body)
            .send()
            .await
            .expect("put");
        assert!(r.status().is_success(), "{path}: {}", r.status());
    };
    put("adapters", Vec::new()).await;
    // A safetensors file of `size` bytes: its header, then padding data.
    let tensor = |size: usize| {
        let header =
            format!(r#"{{"w":{{"dtype":"U8","shape":[{size}],"data_offsets":[0,{size}]}}}}"#);
        let mut b = (header.len() as u64).to_le_bytes().to_vec();
        b.extend_from_slice(header.as_bytes());
        b.extend(std::iter::repeat_n(7u8, size));
        b
    };
    // Five of 150 KB (they fit the 1 MiB budget together), three of
    // 300 KB (they do not, with the five).
    let small = ["a0", "a1", "a2", "a3", "a4"];
    let large = ["b0", "b1", "b2"];
    for (name, size) in small
        .iter()
        .map(|n| (n, 150_000))
        .chain(large.iter().map(|n| (n, 300_000)))
    {
        put(
            &format!("adapters/{name}/adapter_config.json"),
            br#"{"peft_type": "LORA", "r": 8}"#.to_vec(),
        )
        .await;
        put(
            &format!("adapters/{name}/adapter_model.safetensors"),
            tensor(size),
        )
        .await;
    }
    put(
        "adapters/big/adapter_config.json",
        br#"{"peft_type": "LORA", "r": 8}"#.to_vec(),
    )
    .await;
    put("adapters/big/adapter_model.safetensors", tensor(2_000_000)).await;
    let env = moto.env("test");
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let mut models = String::new();
    for name in small.iter().chain(&large).chain(&["big"]) {
        models.push_str(&format!(
            "[[apps.adapters.models]]\nname = \"{name}\"\ncheckpoint = \"s3://adapters/{name}\"\n"
        ));
    }
    let config = config(1, &[])
        .replace(
            "[[apps]]",
            "[weights]\nallowed_prefixes = [\"s3://adapters/\"]\ncache_max_bytes = \"1MiB\"\n[[apps]]",
        )
        .replace("max_loaded = 2", &format!("max_loaded = 2\n{models}"));
    let gw = Gateway::start_with(&config, &[], &env);
    ready(&gw, 1).await;
    let state = gw.dir.path().join("state");
    let held = || {
        warmgate_pool::weights::folder_bytes(&state.join("adapters"))
            + warmgate_pool::weights::folder_bytes(&state.join("cache"))
    };
    // Three rounds over the five small ones, two loaded at a time in the
    // engine: each is pulled once, and loaded again from its folder.
    for _ in 0..3 {
        for name in small {
            let (status, _, body) = chat(&gw, name).await;
            assert_eq!(status, 200, "{name}: {body}");
        }
    }
    assert_eq!(
        gw.log().matches("adapter pulled").count(),
        5,
        "pulled once each"
    );
    // The large ones push the least recently used out: within the budget.
    for name in large.iter().chain(&small) {
        let (status, _, body) = chat(&gw, name).await;
        assert_eq!(status, 200, "{name}: {body}");
        assert!(
            held() <= 1 << 20,
            "{} bytes held past the 1 MiB budget",
            held()
        );
    }
    // One larger than the whole budget: refused, nothing held for it.
    let (status, _, body) = chat(&gw, "big").await;
    assert_eq!(status, 502, "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("cache_max_bytes")),
        "{body}"
    );
    assert!(held() <= 1 << 20, "{}", held());
}
