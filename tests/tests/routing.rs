//! LLM-aware routing against real engine processes: the stand-in vLLM
//! engine (`tests/standins/llm_engine.py`: a prefix cache of chained
//! blocks with LRU eviction, running slots, vLLM's usage and metrics) as
//! the replicas of apps routed by prefix, by session and by load, in one
//! gateway. What is asserted is what a user would notice: the cached
//! tokens the engines report, the replica each answer names, and the
//! engines' own load in `status` and `/metrics`.

mod common;

use std::collections::{BTreeMap, BTreeSet};

use common::{Gateway, eventually};
use serde_json::{Value, json};

/// An app of `replicas` stand-in engines routed by `policy`; each engine
/// caches `cache_tokens` tokens and prefills 0.01 ms a token.
fn app(name: &str, policy: &str, replicas: u32, cache_tokens: u32, extra: &str) -> String {
    format!(
        r#"
        [[apps]]
        name = "{name}"
        command = ["python3", "{engine}", "--model", "{name}", "--slots", "4",
                   "--prefill-ms-per-token", "0.01", "--decode-ms-per-token", "1",
                   "--cache-tokens", "{cache_tokens}"]
        concurrency = 64
        startup_timeout = "60s"
        [apps.health]
        path = "/health"
        [apps.autoscale]
        min = {replicas}
        max = {replicas}
        [apps.routing]
        policy = "{policy}"
        {extra}
        "#,
        engine = common::llm_engine()
    )
}

/// What one answer said: the replica, and the usage's prompt and cached
/// tokens.
struct Answer {
    replica: String,
    prompt: u64,
    cached: u64,
}

async fn chat(gw: &Gateway, model: &str, messages: Value, session: Option<&str>) -> Answer {
    let mut req = gw.http.post(gw.at("/v1/chat/completions")).json(&json!({
        "model": model,
        "messages": messages,
        "max_tokens": 2,
    }));
    if let Some(s) = session {
        req = req.header("x-session-id", s);
    }
    let r = req.send().await.expect("send");
    let replica = r
        .headers()
        .get("x-warmgate-replica")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    let status = r.status();
    let body: Value = r.json().await.expect("json");
    assert_eq!(status, 200, "{body}");
    Answer {
        replica,
        prompt: body["usage"]["prompt_tokens"]
            .as_u64()
            .expect("prompt_tokens"),
        cached: body["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .expect("cached_tokens"),
    }
}

/// The system prompt of group `g`: 600 words of its own.
fn system_prompt(g: usize) -> String {
    (0..600)
        .map(|i| format!("g{g}w{}", (i * 7919 + g * 31) % 1000))
        .collect::<Vec<_>>()
        .join(" ")
}

/// The replicas of `app`'s revisions in a status document.
fn replicas(status: &Value, app: &str) -> Vec<Value> {
    status["apps"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|a| a["name"] == app)
        .flat_map(|a| a["revisions"].as_array().cloned().unwrap_or_default())
        .flat_map(|r| r["replicas"].as_array().cloned().unwrap_or_default())
        .collect()
}

/// Waits until every replica of `app` is ready.
async fn ready(gw: &Gateway, app: &str, n: usize) {
    eventually(&format!("{n} replicas of {app} ready"), || async {
        let s = gw.json("/v1/status").await;
        let ready = replicas(&s, app)
            .iter()
            .filter(|r| r["state"] == "ready")
            .count();
        (ready == n).then_some(())
    })
    .await;
}

/// Twelve groups that each share a 600-token system prompt, asked eight
/// times each in a shuffled order, on three engines whose caches hold
/// about six groups each: routed by prefix, each group stays where its
/// prompt is cached; balanced by load, every engine sees every group and
/// evicts half of them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shared_prefix_goes_back_to_the_engine_that_cached_it() {
    let config = format!(
        "{}{}",
        app(
            "llm",
            "prefix",
            3,
            4000,
            "[apps.engine]\nmetrics_path = \"/metrics\"\nperiod = \"200ms\"\nmax_age = \"2s\""
        ),
        app("llm-lb", "least_loaded", 3, 4000, "")
    );
    let gw = Gateway::start(&config);
    ready(&gw, "llm", 3).await;
    ready(&gw, "llm-lb", 3).await;
    let mut order: Vec<(usize, usize)> =
        (0..12).flat_map(|g| (0..8).map(move |q| (g, q))).collect();
    fastrand::Rng::with_seed(5).shuffle(&mut order);
    let mut ratio = BTreeMap::new();
    for model in ["llm", "llm-lb"] {
        let (mut prompt, mut cached) = (0u64, 0u64);
        let mut groups_on: BTreeMap<usize, BTreeSet<String>> = BTreeMap::new();
        for (g, q) in &order {
            let messages = json!([
                {"role": "system", "content": system_prompt(*g)},
                {"role": "user", "content": format!("question {q} of group {g}: what follows?")},
            ]);
            let a = chat(&gw, model, messages, None).await;
            prompt += a.prompt;
            cached += a.cached;
            groups_on.entry(*g).or_default().insert(a.replica);
        }
        let r = cached as f64 / prompt as f64;
        let spread: f64 =
            groups_on.values().map(|s| s.len() as f64).sum::<f64>() / groups_on.len() as f64;
        eprintln!("{model}: cached-token ratio {r:.3}, replicas per group {spread:.2}");
        ratio.insert(model, (r, spread));
    }
    let (prefix, spread) = ratio["llm"];
    let (balanced, _) = ratio["llm-lb"];
    // The ideal: every request but each group's first finds its system
    // prompt cached: 7/8 of about 96% of the tokens.
    assert!(
        prefix > 0.75,
        "prefix routing cached {prefix:.3} of the tokens"
    );
    assert!(
        prefix > balanced + 0.2,
        "prefix {prefix:.3} against least loaded {balanced:.3}"
    );
    assert!(
        spread < 1.2,
        "a group went to {spread:.2} replicas on average"
    );

    // The engines' own load reached status and /metrics.
    let readings = eventually("the engines' readings in status", || async {
        let s = gw.json("/v1/status").await;
        let read: Vec<Value> = replicas(&s, "llm")
            .iter()
            .filter_map(|r| r.get("engine").cloned())
            .collect();
        (read.len() == 3).then_some(read)
    })
    .await;
    for r in &readings {
        assert!(r["running"].is_u64() && r["waiting"].is_u64(), "{r}");
        assert!(r["age_seconds"].as_f64().is_some_and(|a| a < 2.0), "{r}");
    }
    let metrics = gw.metrics_text().await;
    for name in [
        "warmgate_engine_requests_waiting{app=\"llm\"}",
        "warmgate_engine_replicas_read{app=\"llm\"} 3",
        "warmgate_route_decisions_total{reason=\"affinity\"}",
    ] {
        assert!(metrics.contains(name), "no {name} in /metrics");
    }
}

/// Sessions stick to a replica (by `X-Session-Id`, else the OpenAI `user`
/// field) while different sessions spread over the replicas.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_sticks_to_one_replica_and_sessions_spread() {
    let gw = Gateway::start(&app("chat", "session", 3, 64000, ""));
    ready(&gw, "chat", 3).await;
    let mut used = BTreeSet::new();
    for s in 0..8 {
        let mut seen = BTreeSet::new();
        let mut history =
            vec![json!({"role": "user", "content": format!("hello from session {s}")})];
        for turn in 0..4 {
            let a = if s % 2 == 0 {
                chat(
                    &gw,
                    "chat",
                    Value::Array(history.clone()),
                    Some(&format!("s-{s}")),
                )
                .await
            } else {
                // The OpenAI `user` field names the session instead.
                let r = gw
                    .http
                    .post(gw.at("/v1/chat/completions"))
                    .json(&json!({"model": "chat", "messages": history, "max_tokens": 2, "user": format!("u-{s}")}))
                    .send()
                    .await
                    .expect("send");
                let replica = r.headers()["x-warmgate-replica"]
                    .to_str()
                    .expect("id")
                    .to_string();
                assert_eq!(r.status(), 200);
                Answer {
                    replica,
                    prompt: 0,
                    cached: 0,
                }
            };
            seen.insert(a.replica.clone());
            used.insert(a.replica);
            history.push(json!({"role": "assistant", "content": "an answer"}));
            history.push(json!({"role": "user", "content": format!("turn {turn}")}));
        }
        assert_eq!(seen.len(), 1, "session {s} went to {seen:?}");
    }
    assert!(used.len() >= 2, "eight sessions all went to {used:?}");
}

/// One prefix with all the traffic, many requests at once: the load bound
/// spreads it over more than one replica, and every request is answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hot_prefix_spreads_over_replicas_under_the_load_bound() {
    let gw = Gateway::start(&app("hot", "prefix", 3, 64000, "load_bound = 1.25"));
    ready(&gw, "hot", 3).await;
    let messages = json!([
        {"role": "system", "content": system_prompt(0)},
        {"role": "user", "content": "the one question everybody asks"},
    ]);
    let answers = futures_util::future::join_all((0..48).map(|_| {
        let gw = &gw;
        let messages = messages.clone();
        async move {
            let r = gw
                .http
                .post(gw.at("/v1/chat/completions"))
                .json(&json!({"model": "hot", "messages": messages, "max_tokens": 40}))
                .send()
                .await
                .expect("send");
            assert_eq!(r.status(), 200);
            r.headers()["x-warmgate-replica"]
                .to_str()
                .expect("id")
                .to_string()
        }
    }))
    .await;
    let mut per: BTreeMap<String, u32> = BTreeMap::new();
    for a in answers {
        *per.entry(a).or_default() += 1;
    }
    eprintln!("hot prefix per replica: {per:?}");
    assert!(per.len() >= 2, "the hot prefix stayed on {per:?}");
}
