//! Two tenants on one gateway, tried as one of them would attack the
//! other: what one learns of, or breaks for, the other.

mod common;

use common::{Gateway, eventually, kind};
use serde_json::{Value, json};

const KEY_A: &str = "team-a-key-0123456789";
const KEY_B: &str = "team-b-key-0123456789";

const TENANTS: &str = r#"
        [[tenants]]
        name = "team-a"
        api_key_env = "TEST_KEY_A"
        [[tenants]]
        name = "team-b"
        api_key_env = "TEST_KEY_B"
"#;

fn start(apps: &str) -> Gateway {
    Gateway::start_with(
        &format!("{apps}\n{TENANTS}"),
        &[],
        &[("TEST_KEY_A", KEY_A), ("TEST_KEY_B", KEY_B)],
    )
}

/// A stand-in vLLM engine app on its socket, its metrics read.
fn llm_app() -> String {
    format!(
        r#"
        [[apps]]
        name = "llm"
        command = ["python3", "{engine}", "--model", "llm", "--uds", "$WARMGATE_SOCKET",
                   "--prefill-ms-per-token", "0.01", "--decode-ms-per-token", "1"]
        startup_timeout = "60s"
        [apps.health]
        path = "/health"
        [apps.engine]
        metrics_path = "/metrics"
        [apps.autoscale]
        min = 1
        "#,
        engine = common::llm_engine()
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_cannot_call_the_engine_s_admin_routes_through_the_passthrough() {
    let gw = start(&llm_app());
    gw.wait_ready("llm", 1).await;
    let post = |path: &str, key: Option<&str>| {
        let mut r = gw.http.post(gw.at(path)).json(&json!({}));
        if let Some(k) = key {
            r = r.bearer_auth(k);
        }
        r.send()
    };
    // Emptying every tenant's prefix cache is the admin's.
    for path in [
        "/apps/llm/reset_prefix_cache",
        "/apps/llm/%72eset_prefix_cache",
        "/apps/llm/v1/../reset_prefix_cache",
        "/apps/llm/metrics",
        "/apps/llm/debug/anything",
    ] {
        let r = post(path, Some(KEY_A)).await.expect("send");
        let status = r.status().as_u16();
        let body: Value = r.json().await.expect("json");
        assert_eq!(status, 401, "{path}: {body}");
        assert_eq!(kind(&body), "unauthorized", "{path}");
        assert!(
            body["error"]["message"]
                .as_str()
                .is_some_and(|m| m.contains("admin token")),
            "{body}"
        );
    }
    // The clients' routes pass for a tenant.
    let r = post("/apps/llm/tokenize", Some(KEY_A)).await.expect("send");
    assert_ne!(r.status().as_u16(), 401, "a client route");
    let r = gw
        .http
        .post(gw.at("/apps/llm/v1/completions"))
        .bearer_auth(KEY_B)
        .json(&json!({"model": "llm", "prompt": "hi", "max_tokens": 2}))
        .send()
        .await
        .expect("send");
    assert_eq!(r.status(), 200);
    // The admin reaches the admin route (the client carries its token).
    let r = post("/apps/llm/reset_prefix_cache", None)
        .await
        .expect("send");
    assert_eq!(r.status(), 200, "{:?}", r.text().await);
    eventually("the gateway is still serving", || async {
        let r = gw.http.get(gw.at("/healthz")).send().await.ok()?;
        (r.status() == 200).then_some(())
    })
    .await;
}

/// A web server that answers every GET with `Service-Worker-Allowed: /`.
const WIDENING_SERVER: &str = r#"
import os
from http.server import BaseHTTPRequestHandler, HTTPServer
class H(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.send_header("content-type", "text/javascript")
        self.send_header("service-worker-allowed", "/")
        self.send_header("x-kept", "yes")
        self.send_header("content-length", "2")
        self.end_headers()
        self.wfile.write(b"//")
    def log_message(self, *a):
        pass
HTTPServer(("127.0.0.1", int(os.environ["PORT"])), H).serve_forever()
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_app_cannot_widen_a_service_worker_to_the_dashboard_s_origin() {
    let gw = Gateway::start(&format!(
        r#"
        [[apps]]
        name = "sw"
        command = ["python3", "-c", {script:?}]
        listen = "port"
        [apps.autoscale]
        min = 1
        "#,
        script = WIDENING_SERVER
    ));
    gw.wait_ready("sw", 1).await;
    let r = gw
        .http
        .get(gw.at("/apps/sw/sw.js"))
        .send()
        .await
        .expect("send");
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["x-kept"], "yes", "the app's other headers pass");
    assert!(
        r.headers().get("service-worker-allowed").is_none(),
        "{:?}",
        r.headers()
    );
}

/// `usage.prompt_tokens_details.cached_tokens` of a completion of `prompt`.
async fn cached_tokens(gw: &Gateway, key: &str, prompt: &str) -> u64 {
    let r = gw
        .http
        .post(gw.at("/v1/completions"))
        .bearer_auth(key)
        .json(&json!({"model": "llm", "prompt": prompt, "max_tokens": 2}))
        .send()
        .await
        .expect("send");
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.expect("json");
    v["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or_else(|| panic!("cached_tokens in {v}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_tenant_cannot_learn_from_the_cache_what_another_sent() {
    let secret: String = (0..300).map(|i| format!("secret{i} ")).collect();
    for share in [false, true] {
        let gw = start(&llm_app().replace(
            "[apps.autoscale]",
            &format!("[apps.routing]\nshare_cache_across_tenants = {share}\n[apps.autoscale]"),
        ));
        gw.wait_ready("llm", 1).await;
        assert_eq!(cached_tokens(&gw, KEY_A, &secret).await, 0, "first time");
        assert!(
            cached_tokens(&gw, KEY_A, &secret).await > 200,
            "a tenant's own repeat is cached"
        );
        let other = cached_tokens(&gw, KEY_B, &secret).await;
        if share {
            assert!(other > 200, "shared on purpose: {other}");
        } else {
            assert_eq!(other, 0, "team-b learnt that team-a sent it");
        }
    }
}

/// One chat with `model` as `key`; whether it waited for its adapter's load.
async fn chat_loaded(gw: &Gateway, key: &str, model: &str) -> bool {
    let r = gw
        .http
        .post(gw.at("/v1/chat/completions"))
        .bearer_auth(key)
        .json(&json!({"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}))
        .send()
        .await
        .expect("send");
    let loaded = r.headers().contains_key("x-warmgate-adapter-load-ms");
    let status = r.status();
    let body = r.text().await.unwrap_or_default();
    assert_eq!(status, 200, "{model}: {body}");
    loaded
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_tenant_cycling_adapters_does_not_push_out_another_s() {
    let dir = tempfile::tempdir().expect("dir");
    let mut models = String::new();
    for name in ["hot", "a0", "a1", "a2", "a3", "a4", "a5"] {
        let p = common::peft_adapter(dir.path(), name, false);
        models.push_str(&format!(
            "[[apps.adapters.models]]\nname = \"{name}\"\ncheckpoint = \"file://{}\"\n",
            p.display()
        ));
    }
    let gw = start(&format!(
        r#"
        [weights]
        allowed_prefixes = ["file://{root}"]
        [[apps]]
        name = "llm"
        command = ["python3", "{engine}", "--model", "llm", "--uds", "$WARMGATE_SOCKET",
                   "--prefill-ms-per-token", "0.01", "--decode-ms-per-token", "1",
                   "--max-loras", "2", "--lora-load-ms", "20"]
        env = {{ VLLM_ALLOW_RUNTIME_LORA_UPDATING = "True" }}
        concurrency = 16
        startup_timeout = "60s"
        [apps.health]
        path = "/health"
        [apps.autoscale]
        min = 2
        max = 2
        [apps.adapters]
        max_loaded = 2
{models}
        "#,
        root = dir.path().display(),
        engine = common::llm_engine()
    ));
    gw.wait_ready("llm", 2).await;
    assert!(
        chat_loaded(&gw, KEY_B, "hot").await,
        "the first request loads it"
    );
    // Team a: four clients cycling six adapters, a bounded number each.
    use std::sync::atomic::Ordering::Relaxed;
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let total = std::sync::Arc::new(std::sync::atomic::AtomicU32::new(0));
    let cyclers: Vec<_> = (0..4)
        .map(|c| {
            let (http, url, stop) = (gw.http.clone(), gw.at("/v1/chat/completions"), stop.clone());
            let total = total.clone();
            tokio::spawn(async move {
                let mut sent = 0u32;
                let mut i = c;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) && sent < 400 {
                    let model = format!("a{}", i % 6);
                    i += 1;
                    sent += 1;
                    total.fetch_add(1, Relaxed);
                    let _ = http
                        .post(&url)
                        .bearer_auth(KEY_A)
                        .json(&json!({"model": model, "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}))
                        .send()
                        .await
                        .map(|r| r.status());
                }
                sent
            })
        })
        .collect();
    // Team b: its hot adapter, one request each time team a has sent six
    // more (one round of its adapters), meanwhile.
    let mut reloads = 0u32;
    const REQUESTS: u32 = 30;
    for k in 1..=REQUESTS {
        eventually("team a sends its next round", || async {
            (total.load(Relaxed) >= k * 6).then_some(())
        })
        .await;
        if chat_loaded(&gw, KEY_B, "hot").await {
            reloads += 1;
        }
    }
    stop.store(true, Relaxed);
    let mut churn = 0;
    for c in cyclers {
        churn += c.await.expect("cycler");
    }
    eprintln!(
        "team b's adapter reloaded for {reloads} of its {REQUESTS} requests while team a sent {churn}"
    );
    assert!(churn >= REQUESTS * 6, "team a's cycling ran: {churn}");
    assert!(
        reloads * 10 <= REQUESTS,
        "team b's adapter reloaded for {reloads} of {REQUESTS} requests"
    );
    let _ = eventually("the gateway still serves", || async {
        (gw.http.get(gw.at("/healthz")).send().await.ok()?.status() == 200).then_some(())
    })
    .await;
}
