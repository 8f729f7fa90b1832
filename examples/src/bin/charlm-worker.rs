//! `charlm-worker`: serves the tiny character-level model as OpenAI
//! `POST /v1/completions`, streamed (`"stream": true`, server-sent events)
//! or whole. It loads `model.safetensors` from `$WARMGATE_WEIGHTS_URL` at
//! start; with no weights it serves an untrained model.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::Context as _;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use bytes::Bytes;
use serde_json::{Value, json};
use warmgate_examples::charlm::CharLm;

/// Longest completion, in characters.
const MAX_TOKENS: u64 = 512;

struct Worker {
    model: CharLm,
    name: String,
    revision: String,
}

fn main() -> anyhow::Result<()> {
    warmgate_examples::run_worker(setup)
}

/// Loads the weights (when there are any) and builds the routes.
async fn setup() -> anyhow::Result<Router> {
    let t0 = std::time::Instant::now();
    let model = match std::env::var("WARMGATE_WEIGHTS_URL") {
        Ok(url) => {
            let bytes = warmgate_examples::Fetcher::default()
                .get(&format!("{url}/model.safetensors"))
                .await?;
            CharLm::from_safetensors(&bytes).context("read model.safetensors")?
        }
        Err(_) => CharLm::init(0)?,
    };
    let weights_seconds = t0.elapsed().as_secs_f64();
    let worker = Arc::new(Worker {
        model,
        name: std::env::var("WARMGATE_TARGET").unwrap_or_else(|_| "charlm".into()),
        revision: std::env::var("WARMGATE_REVISION").unwrap_or_default(),
    });
    Ok(Router::new()
        .route(
            "/healthz",
            get(move || async move {
                Json(json!({"status": "ok", "weights_seconds": weights_seconds}))
            }),
        )
        .route("/v1/completions", post(completions))
        .with_state(worker))
}

fn error(status: StatusCode, message: impl Into<String>) -> Response {
    (
        status,
        Json(json!({"error": {"kind": "bad_request", "message": message.into()}})),
    )
        .into_response()
}

async fn completions(State(w): State<Arc<Worker>>, body: Bytes) -> Response {
    let req: Value = match serde_json::from_slice(&body) {
        Ok(v) => v,
        Err(e) => {
            return error(
                StatusCode::BAD_REQUEST,
                format!("the body is not JSON: {e}"),
            );
        }
    };
    let Some(prompt) = req["prompt"].as_str().map(str::to_string) else {
        return error(StatusCode::BAD_REQUEST, "prompt must be a string");
    };
    let n = match req.get("max_tokens") {
        None => 16,
        Some(v) => match v.as_u64() {
            Some(n @ 1..=MAX_TOKENS) => n,
            _ => {
                return error(
                    StatusCode::BAD_REQUEST,
                    format!("max_tokens must be 1..={MAX_TOKENS}"),
                );
            }
        },
    } as usize;
    let temperature = req["temperature"].as_f64().unwrap_or(0.8) as f32;
    let seed = req["seed"].as_u64().unwrap_or_else(|| fastrand::u64(..));
    let text = match w.model.complete(&prompt, n, temperature, seed) {
        Ok(t) => t,
        Err(e) => return error(StatusCode::INTERNAL_SERVER_ERROR, format!("{e:#}")),
    };
    let id = format!("cmpl-{:x}", fastrand::u64(..));
    let created = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    if req["stream"].as_bool() == Some(true) {
        let mut events: Vec<Result<Event, Infallible>> = text
            .chars()
            .map(|c| {
                Ok(Event::default().data(
                    json!({"id": id, "object": "text_completion", "created": created,
                           "model": w.name,
                           "choices": [{"text": c.to_string(), "index": 0, "finish_reason": null}]})
                    .to_string(),
                ))
            })
            .collect();
        events.push(Ok(Event::default().data(
            json!({"id": id, "object": "text_completion", "created": created, "model": w.name,
                   "choices": [{"text": "", "index": 0, "finish_reason": "length"}]})
            .to_string(),
        )));
        events.push(Ok(Event::default().data("[DONE]")));
        return Sse::new(futures_util::stream::iter(events)).into_response();
    }
    Json(json!({
        "id": id,
        "object": "text_completion",
        "created": created,
        "model": w.name,
        "system_fingerprint": w.revision,
        "choices": [{"text": text, "index": 0, "finish_reason": "length", "logprobs": null}],
        "usage": {"prompt_tokens": prompt.chars().count(), "completion_tokens": n,
                  "total_tokens": prompt.chars().count() + n},
    }))
    .into_response()
}
