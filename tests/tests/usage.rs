//! Tokens as the unit: usage counted per tenant, app and model from the
//! engines' own `usage`, kept across a restart, and token quotas.

mod common;

use common::{Gateway, kind};
use serde_json::{Value, json};
use sha2::Digest as _;

const KEYS: [(&str, &str); 3] = [
    ("team-a", "team-a-key-0123456789"),
    ("team-b", "team-b-key-0123456789"),
    ("team-c", "team-c-key-0123456789"),
];

/// A key's SHA-256, as `api_key_sha256` takes it.
fn digest(key: &str) -> String {
    sha2::Sha256::digest(key.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// The three tenants by key digest (a restart passes no environment).
fn tenants(extra: &str) -> String {
    KEYS.iter()
        .map(|(name, key)| {
            let digest = digest(key);
            format!("[[tenants]]\nname = \"{name}\"\napi_key_sha256 = \"{digest}\"\n{extra}\n")
        })
        .collect()
}

/// An engine app `llm`, team a with the token quotas `quotas` (TOML
/// lines), team b with none.
fn quota_config(quotas: &str) -> String {
    format!(
        "{app}\n[[tenants]]\nname = \"team-a\"\napi_key_sha256 = \"{a}\"\n{quotas}\n[[tenants]]\nname = \"team-b\"\napi_key_sha256 = \"{b}\"\n",
        app = engine_app("llm", ""),
        a = digest(key_of("team-a")),
        b = digest(key_of("team-b")),
    )
}

/// A stand-in vLLM engine app named `name`, on its socket.
fn engine_app(name: &str, extra: &str) -> String {
    format!(
        r#"
        [[apps]]
        name = "{name}"
        command = ["python3", "{engine}", "--model", "{name}", "--uds", "$WARMGATE_SOCKET",
                   "--prefill-ms-per-token", "0.01", "--decode-ms-per-token", "1"]
        env = {{ VLLM_ALLOW_RUNTIME_LORA_UPDATING = "True" }}
        startup_timeout = "60s"
        [apps.health]
        path = "/health"
        [apps.autoscale]
        min = 1
        max = 1
        {extra}
        "#,
        engine = common::llm_engine()
    )
}

/// Prompt, cached and completion tokens.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct Sum {
    prompt: u64,
    cached: u64,
    completion: u64,
    requests: u64,
}

impl Sum {
    fn add_usage(&mut self, u: &Value) {
        self.prompt += u["prompt_tokens"].as_u64().expect("prompt_tokens");
        self.cached += u["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap_or(0);
        self.completion += u["completion_tokens"].as_u64().expect("completion_tokens");
        self.requests += 1;
    }

    fn of_row(r: &Value) -> Sum {
        Sum {
            prompt: r["prompt_tokens"].as_u64().unwrap_or(0),
            cached: r["cached_tokens"].as_u64().unwrap_or(0),
            completion: r["completion_tokens"].as_u64().unwrap_or(0),
            requests: r["requests"].as_u64().unwrap_or(0),
        }
    }
}

fn key_of(tenant: &str) -> &'static str {
    KEYS.iter().find(|(n, _)| *n == tenant).expect("tenant").1
}

/// One request as `tenant`; returns the usage the client saw (none for a
/// stream that did not ask for it) and checks the stream's shape.
async fn send(gw: &Gateway, tenant: &str, body: Value, path: &str) -> Option<Value> {
    let r = gw
        .http
        .post(gw.at(path))
        .bearer_auth(key_of(tenant))
        .json(&body)
        .send()
        .await
        .expect("send");
    let status = r.status();
    let text = r.text().await.expect("body");
    assert_eq!(status, 200, "{body}: {text}");
    if body["stream"] != json!(true) {
        let v: Value = serde_json::from_str(&text).expect("json");
        return Some(v["usage"].clone());
    }
    assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
    let events: Vec<Value> = text
        .split("\n\n")
        .filter_map(|e| e.strip_prefix("data: "))
        .filter(|e| *e != "[DONE]")
        .map(|e| serde_json::from_str(e).expect("event json"))
        .collect();
    let usage_chunks: Vec<&Value> = events
        .iter()
        .filter(|e| e["choices"] == json!([]))
        .collect();
    let asked = body["stream_options"]["include_usage"] == json!(true);
    if asked {
        assert_eq!(usage_chunks.len(), 1, "the usage chunk asked for: {text}");
        Some(usage_chunks[0]["usage"].clone())
    } else {
        assert!(
            usage_chunks.is_empty() && events.iter().all(|e| !e["usage"].is_object()),
            "a client that did not ask for usage got it: {text}"
        );
        assert!(
            events.iter().any(|e| {
                let c = &e["choices"][0];
                c["delta"]["content"].is_string() || c["text"].is_string()
            }),
            "{text}"
        );
        None
    }
}

/// Every engine's own prompt and generation token counts (vLLM's
/// `vllm:prompt_tokens_total`, `vllm:generation_tokens_total`).
async fn engine_totals(gw: &Gateway, apps: &[&str]) -> (u64, u64) {
    let (mut prompt, mut generated) = (0.0, 0.0);
    for app in apps {
        let s = gw.app_status(app).await;
        for r in s["pool"]["replicas"].as_array().expect("replicas") {
            let addr = r["addr"].as_str().expect("addr");
            prompt += common::vllm::engine_metric(addr, "vllm:prompt_tokens_total").await;
            generated += common::vllm::engine_metric(addr, "vllm:generation_tokens_total").await;
        }
    }
    (prompt as u64, generated as u64)
}

/// A mixed round: team a plain answers (chat, completions, the adapter),
/// team b streams asking for usage, team c streams without asking.
async fn round(gw: &Gateway, sums: &mut [Sum; 3], adapter: &mut Sum, n: usize) {
    let chat = |model: &str, i: usize, extra: Value| {
        let mut body = json!({
            "model": model,
            "messages": [{"role": "user", "content": format!("question {i}: {}", "words ".repeat(i % 7 + 1))}],
            "max_tokens": 3 + i % 5,
        });
        for (k, v) in extra.as_object().expect("object") {
            body[k] = v.clone();
        }
        body
    };
    for i in 0..n {
        let app = if i % 2 == 0 { "llm" } else { "other" };
        let u = send(
            gw,
            "team-a",
            chat(app, i, json!({})),
            "/v1/chat/completions",
        )
        .await;
        sums[0].add_usage(&u.expect("usage"));
        let body = json!({"model": "other", "prompt": format!("complete {i}"), "max_tokens": 4});
        let u = send(gw, "team-a", body, "/v1/completions").await;
        sums[0].add_usage(&u.expect("usage"));
        let u = send(
            gw,
            "team-a",
            chat("sql", i, json!({})),
            "/v1/chat/completions",
        )
        .await;
        let u = u.expect("usage");
        sums[0].add_usage(&u);
        adapter.add_usage(&u);
        let asked = json!({"stream": true, "stream_options": {"include_usage": true}});
        let u = send(gw, "team-b", chat(app, i, asked), "/v1/chat/completions").await;
        sums[1].add_usage(&u.expect("usage"));
        let not_asked = json!({"stream": true});
        assert!(
            send(
                gw,
                "team-c",
                chat(app, i, not_asked),
                "/v1/chat/completions"
            )
            .await
            .is_none()
        );
        sums[2].requests += 1;
        let body =
            json!({"model": app, "prompt": format!("stream {i}"), "max_tokens": 3, "stream": true});
        assert!(send(gw, "team-c", body, "/v1/completions").await.is_none());
        sums[2].requests += 1;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn usage_matches_the_engines_counts_token_for_token_per_tenant_across_a_restart() {
    let dir = tempfile::tempdir().expect("dir");
    let adapter = common::peft_adapter(dir.path(), "sql", false);
    let config = format!(
        "[weights]\nallowed_prefixes = [\"file://{root}\"]\n{llm}\n{other}\n{tenants}",
        root = dir.path().display(),
        llm = engine_app(
            "llm",
            &format!(
                "[[apps.adapters.models]]\nname = \"sql\"\ncheckpoint = \"file://{}\"",
                adapter.display()
            )
        ),
        other = engine_app("other", ""),
        tenants = tenants(""),
    );
    let mut gw = Gateway::start(&config);
    gw.wait_ready("llm", 1).await;
    gw.wait_ready("other", 1).await;

    let mut sums = [Sum::default(); 3];
    let mut adapter_sum = Sum::default();
    round(&gw, &mut sums, &mut adapter_sum, 6).await;
    let (prompt, generated) = engine_totals(&gw, &["llm", "other"]).await;
    let seen = |s: &[Sum; 3]| (s[0].prompt + s[1].prompt, s[0].completion + s[1].completion);
    // Team c's tokens: what the engines counted less what a and b saw.
    sums[2].prompt = prompt - seen(&sums).0;
    sums[2].completion = generated - seen(&sums).1;
    assert!(sums[2].completion > 0);

    // The metric, per tenant and kind, before the restart.
    let a_prompt = gw
        .metric(r#"warmgate_tokens_total{tenant="team-a",app="llm",model="sql",kind="prompt"}"#)
        .await;
    assert_eq!(a_prompt as u64, adapter_sum.prompt);

    gw.restart();
    gw.wait_ready("llm", 1).await;
    gw.wait_ready("other", 1).await;
    let before = sums;
    round(&gw, &mut sums, &mut adapter_sum, 3).await;
    let (prompt, generated) = engine_totals(&gw, &["llm", "other"]).await;
    let seen_after = (
        seen(&sums).0 - seen(&before).0,
        seen(&sums).1 - seen(&before).1,
    );
    sums[2].prompt += prompt - seen_after.0;
    sums[2].completion += generated - seen_after.1;

    let report = gw.json("/v1/usage?bucket=total&group_by=tenant").await;
    let rows = report["data"].as_array().expect("rows");
    assert_eq!(rows.len(), 3, "{report}");
    for (i, (tenant, _)) in KEYS.iter().enumerate() {
        let row = rows
            .iter()
            .find(|r| r["tenant"] == json!(tenant))
            .unwrap_or_else(|| panic!("{tenant} in {report}"));
        let got = Sum::of_row(row);
        let want = sums[i];
        assert_eq!(
            (got.prompt, got.completion, got.requests),
            (want.prompt, want.completion, want.requests),
            "{tenant}: {row}"
        );
        if i < 2 {
            assert_eq!(got.cached, want.cached, "{tenant}: {row}");
        }
        assert_eq!(row["requests_without_usage"], 0, "{row}");
        assert_eq!(row["total_tokens"], json!(want.prompt + want.completion));
    }
    // By model: the adapter apart from its app.
    let by_model = gw
        .json("/v1/usage?bucket=total&group_by=app,model&model=sql")
        .await;
    let sql = &by_model["data"][0];
    assert_eq!(sql["app"], "llm", "{by_model}");
    assert_eq!(Sum::of_row(sql), adapter_sum, "{by_model}");

    // The CLI's table: one line per tenant, then the total.
    let (code, table, err) = gw.warmgate(&["usage", "--by", "tenant"]);
    assert_eq!(code, Some(0), "{err}");
    let a_total = (sums[0].prompt + sums[0].completion).to_string();
    assert!(
        table
            .lines()
            .any(|l| l.starts_with("team-a") && l.ends_with(&a_total)),
        "{table}"
    );
    assert!(
        table.lines().last().is_some_and(|l| l.starts_with("total")),
        "{table}"
    );
    // With a tenant's key, the CLI shows that tenant's alone.
    let out = std::process::Command::new(common::bin("warmgate"))
        .args([
            "usage",
            "--by",
            "tenant",
            "-o",
            "json",
            "--gateway",
            &gw.url,
        ])
        .env("WARMGATE_API_KEY", key_of("team-c"))
        .output()
        .expect("warmgate usage");
    let v: Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(v["data"].as_array().map(Vec::len), Some(1), "{v}");
    assert_eq!(v["data"][0]["tenant"], "team-c", "{v}");

    // A tenant's key reads its own usage only.
    let mine: Value = gw
        .http
        .get(gw.at("/v1/usage?bucket=total"))
        .bearer_auth(key_of("team-b"))
        .send()
        .await
        .expect("usage")
        .json()
        .await
        .expect("json");
    let tenants: Vec<&Value> = mine["data"]
        .as_array()
        .expect("rows")
        .iter()
        .map(|r| &r["tenant"])
        .collect();
    assert!(
        !tenants.is_empty() && tenants.iter().all(|t| **t == json!("team-b")),
        "{mine}"
    );
    let theirs = gw
        .http
        .get(gw.at("/v1/usage?tenant=team-a"))
        .bearer_auth(key_of("team-b"))
        .send()
        .await
        .expect("usage");
    assert_eq!(theirs.status(), 401);
    let body: Value = theirs.json().await.expect("json");
    assert_eq!(kind(&body), "unauthorized", "{body}");
    // A bad parameter is named.
    let r = gw
        .http
        .get(gw.at("/v1/usage?bucket=week"))
        .send()
        .await
        .expect("usage");
    assert_eq!(r.status(), 400);
    let v: Value = r.json().await.expect("json");
    assert_eq!(v["error"]["param"], "bucket", "{v}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_over_its_token_rate_waits_as_told_by_retry_after_and_another_is_unaffected() {
    if !common::has_openai() {
        return;
    }
    // Team a: 600 tokens a minute (10 a second), a burst of 60, and at
    // most 8 tokens of completion a request. Team b: no token quota.
    let gw = Gateway::start(&quota_config(
        "tokens_per_minute = 600\ntoken_burst = 60\nmax_tokens = 8",
    ));
    gw.wait_ready("llm", 1).await;
    let script = r#"
import os, sys, threading, time, openai
from openai import OpenAI
url, key_a, key_b = sys.argv[1], os.environ["KEY_A"], os.environ["KEY_B"]
a = OpenAI(base_url=url + "/v1", api_key=key_a, max_retries=4)
raw = OpenAI(base_url=url + "/v1", api_key=key_a, max_retries=0)
b = OpenAI(base_url=url + "/v1", api_key=key_b, max_retries=0)
prompt = "tell me about tokens " * 24

# A max_tokens past the tenant's is refused, naming the field.
try:
    raw.chat.completions.create(model="llm", max_tokens=9, messages=[{"role": "user", "content": "x"}])
    raise AssertionError("max_tokens 9 let through")
except openai.BadRequestError as e:
    assert e.param == "max_tokens", e.body

# Team b, all along, at a steady pace: never refused.
b_done, b_errors, stop = [0], [], threading.Event()
def team_b():
    while not stop.is_set():
        try:
            b.chat.completions.create(model="llm", max_tokens=8, messages=[{"role": "user", "content": prompt}])
            b_done[0] += 1
        except Exception as e:
            b_errors.append(repr(e))
t = threading.Thread(target=team_b, daemon=True)
t.start()

# Team a without retries: the burst runs out, and the 429 says how long.
refused = None
for i in range(20):
    try:
        raw.chat.completions.create(model="llm", messages=[{"role": "user", "content": prompt}])
    except openai.RateLimitError as e:
        refused = e
        break
assert refused is not None, "never refused"
assert refused.code == "quota_exceeded", refused.body
wait = int(refused.response.headers["retry-after"])
# The last answer left a debt of several seconds at 10 tokens a second.
assert 2 <= wait <= 60, (wait, refused.body)
# Nothing tells the client not to retry (it retries a 429 by default).
assert refused.response.headers.get("x-should-retry") != "false", dict(refused.response.headers)

# Team a with the client's retries: it waits as told, then succeeds.
start = time.monotonic()
chat = a.chat.completions.with_raw_response.create(model="llm", messages=[{"role": "user", "content": prompt}])
took = time.monotonic() - start
assert chat.parse().usage.completion_tokens <= 8, chat.parse().usage
assert took >= wait - 0.5, (took, wait)
# The tenant's max_tokens was given to a request that asked none.
assert chat.parse().usage.completion_tokens == 8, chat.parse().usage

stop.set()
t.join()
assert not b_errors, b_errors
assert b_done[0] >= 3, b_done
print("waited", round(took, 1), "told", wait, "team b", b_done[0])
"#;
    let out = common::python_with(
        script,
        &gw.url,
        &[("KEY_A", key_of("team-a")), ("KEY_B", key_of("team-b"))],
    )
    .await;
    eprintln!("{out}");
    // The refusals counted against team a, none against team b.
    assert!(
        gw.metric(r#"warmgate_tenant_rejected_total{tenant="team-a"}"#)
            .await
            >= 2.0
    );
    assert_eq!(
        gw.metric(r#"warmgate_tenant_rejected_total{tenant="team-b"}"#)
            .await,
        0.0
    );
}

/// The ways around a tenant's token quotas an attacker's read found are
/// closed: the passthrough (however its path is spelled), a `max_tokens`
/// that is not a number, a `stream` that is not a boolean; and a stream
/// whose `stream_options` is `null` is still counted, its usage chunk kept
/// from the client.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_ways_around_token_quotas_are_closed() {
    let gw = Gateway::start(&quota_config("tokens_per_minute = 60000\nmax_tokens = 8"));
    gw.wait_ready("llm", 1).await;
    let post = |key: &'static str, path: &str, body: Value| {
        let (http, url) = (gw.http.clone(), gw.at(path));
        async move {
            let r = http
                .post(url)
                .bearer_auth(key)
                .json(&body)
                .send()
                .await
                .expect("send");
            let status = r.status().as_u16();
            (status, r.text().await.expect("body"))
        }
    };
    let chat = json!({"model": "llm", "messages": [{"role": "user", "content": "hi"}]});
    for path in [
        "/apps/llm/v1/chat/completions",
        "/apps/llm/v1/chat/%63ompletions",
        "/apps/llm/v1/x/../chat/completions",
        "/apps/llm/V1/Completions",
    ] {
        let (status, body) = post(key_of("team-a"), path, chat.clone()).await;
        assert_eq!(status, 400, "{path}: {body}");
        assert!(body.contains("token quotas"), "{path}: {body}");
    }
    // A tenant without token quotas may use the passthrough; it is counted.
    let (status, body) = post(
        key_of("team-b"),
        "/apps/llm/v1/chat/completions",
        chat.clone(),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    for (field, value) in [
        ("max_tokens", json!("100000")),
        ("max_completion_tokens", json!(100000.0)),
        ("max_output_tokens", json!(-1)),
    ] {
        let mut b = chat.clone();
        b[field] = value;
        let (status, body) = post(key_of("team-a"), "/v1/chat/completions", b).await;
        assert_eq!(status, 400, "{field}: {body}");
        let v: Value = serde_json::from_str(&body).expect("json");
        assert_eq!(v["error"]["param"], field, "{body}");
    }
    for stream in [json!("true"), json!(1)] {
        let mut b = chat.clone();
        b["stream"] = stream;
        let (status, body) = post(key_of("team-b"), "/v1/chat/completions", b).await;
        assert_eq!(status, 400, "{body}");
        let v: Value = serde_json::from_str(&body).expect("json");
        assert_eq!(v["error"]["param"], "stream", "{body}");
    }
    // `stream_options: null`: still asked for, counted, kept from the client.
    let mut b = chat.clone();
    b["stream"] = json!(true);
    b["stream_options"] = Value::Null;
    let (status, text) = post(key_of("team-a"), "/v1/chat/completions", b).await;
    assert_eq!(status, 200, "{text}");
    assert!(!text.contains("\"usage\""), "{text}");
    let u = gw
        .json("/v1/usage?bucket=total&group_by=tenant&tenant=team-a")
        .await;
    let row = &u["data"][0];
    assert_eq!(row["requests"], 1, "{u}");
    assert_eq!(row["requests_without_usage"], 0, "{u}");
    assert_eq!(row["completion_tokens"], 8, "the tenant's max_tokens: {u}");
}
