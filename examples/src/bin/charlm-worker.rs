//! `charlm-worker`: serves the tiny character-level model as OpenAI
//! `POST /v1/completions`, streamed (`"stream": true`, server-sent events)
//! or whole, and follows the pool-worker contract so one process can also
//! sample RL rollouts:
//! - `POST /invoke {"prompt", "samples"?, "max_tokens"?, "temperature"?,
//!   "seed"?}` answers `{"completions": [...], "weights_version"}`;
//! - `POST /weights {"url", "version"}` loads new weights and swaps them in
//!   place (requests and rollouts already running finish on the old ones);
//! - `GET /healthz` reports `weights_version`.
//!
//! It loads the first `.safetensors` file of `$WARMGATE_WEIGHTS_URL` at
//! start; with no weights it serves an untrained model, as version 0.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use bytes::Bytes;
use serde_json::{Value, json};
use warmgate_examples::charlm::CharLm;
use warmgate_examples::{SwapError, Swappable};

/// Longest completion, in characters.
const MAX_TOKENS: u64 = 512;
/// Most completions one rollout task may sample.
const MAX_SAMPLES: u64 = 64;

struct Worker {
    model: Swappable<CharLm>,
    weights_seconds: f64,
    name: String,
    revision: String,
}

impl Worker {
    /// The model and its version, as one (`setup` sets one before the
    /// worker serves).
    fn model(&self) -> Result<(Arc<CharLm>, u64), Box<Response>> {
        match self.model.current.get() {
            (Some(m), v) => Ok((m, v)),
            (None, _) => Err(Box::new(error(
                StatusCode::SERVICE_UNAVAILABLE,
                "no model loaded",
            ))),
        }
    }
}

fn main() -> anyhow::Result<()> {
    warmgate_examples::run_worker(setup)
}

/// Loads the weights (when there are any) and builds the routes.
async fn setup() -> anyhow::Result<Router> {
    let t0 = std::time::Instant::now();
    let model = Swappable::default();
    match std::env::var("WARMGATE_WEIGHTS_URL") {
        Ok(url) => {
            let version = std::env::var("WARMGATE_WEIGHTS_VERSION")
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(0);
            let m = model.load(&url, CharLm::from_safetensors).await?;
            model.current.set(m, version);
        }
        Err(_) => model.current.set(CharLm::init(0)?, 0),
    }
    let worker = Arc::new(Worker {
        model,
        weights_seconds: t0.elapsed().as_secs_f64(),
        name: std::env::var("WARMGATE_TARGET").unwrap_or_else(|_| "charlm".into()),
        revision: std::env::var("WARMGATE_REVISION").unwrap_or_default(),
    });
    Ok(Router::new()
        .route("/healthz", get(healthz))
        .route("/v1/completions", post(completions))
        .route("/invoke", post(invoke))
        .route("/weights", post(weights))
        .with_state(worker))
}

async fn healthz(State(w): State<Arc<Worker>>) -> Json<Value> {
    Json(json!({
        "status": "ok",
        "weights_version": w.model.current.get().1,
        "weights_seconds": w.weights_seconds,
    }))
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
    let (model, version) = match w.model() {
        Ok(m) => m,
        Err(resp) => return *resp,
    };
    let text = match model.complete(&prompt, n, temperature, seed) {
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
        "system_fingerprint": format!("{}-v{version}", w.revision),
        "choices": [{"text": text, "index": 0, "finish_reason": "length", "logprobs": null}],
        "usage": {"prompt_tokens": prompt.chars().count(), "completion_tokens": n,
                  "total_tokens": prompt.chars().count() + n},
    }))
    .into_response()
}

/// `POST /invoke`: `samples` completions of one prompt, for a rollout.
async fn invoke(State(w): State<Arc<Worker>>, body: Bytes) -> Response {
    let input: Value = match serde_json::from_slice(&body) {
        Ok(v) => v,
        Err(e) => return error(StatusCode::BAD_REQUEST, format!("input is not JSON: {e}")),
    };
    let Some(prompt) = input["prompt"].as_str().map(str::to_string) else {
        return error(
            StatusCode::BAD_REQUEST,
            "input must be {\"prompt\": <string>, \"samples\"?, \"max_tokens\"?, \"temperature\"?, \"seed\"?}",
        );
    };
    let bounded = |key: &str, default: u64, max: u64| match input.get(key) {
        None => Ok(default),
        Some(v) => v
            .as_u64()
            .filter(|n| (1..=max).contains(n))
            .ok_or_else(|| format!("{key} must be 1..={max}")),
    };
    let (samples, max_tokens) = match (
        bounded("samples", 1, MAX_SAMPLES),
        bounded("max_tokens", 16, MAX_TOKENS),
    ) {
        (Ok(s), Ok(t)) => (s, t as usize),
        (Err(e), _) | (_, Err(e)) => return error(StatusCode::BAD_REQUEST, e),
    };
    let temperature = input["temperature"].as_f64().unwrap_or(1.0) as f32;
    let seed = input["seed"].as_u64().unwrap_or_else(|| fastrand::u64(..));
    let (model, version) = match w.model() {
        Ok(m) => m,
        Err(resp) => return *resp,
    };
    let run = tokio::task::spawn_blocking(move || {
        (0..samples)
            .map(|i| model.complete(&prompt, max_tokens, temperature, seed.wrapping_add(i)))
            .collect::<anyhow::Result<Vec<String>>>()
    })
    .await;
    match run {
        Ok(Ok(completions)) => {
            Json(json!({"completions": completions, "weights_version": version})).into_response()
        }
        Ok(Err(e)) => error(StatusCode::INTERNAL_SERVER_ERROR, format!("{e:#}")),
        Err(e) => error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
    }
}

/// `POST /weights`: loads the new weights aside, then swaps them in.
async fn weights(State(w): State<Arc<Worker>>, body: Bytes) -> Response {
    match w.model.swap(&body, CharLm::from_safetensors).await {
        Ok(version) => Json(json!({"weights_version": version})).into_response(),
        Err(SwapError::BadBody(e)) => error(StatusCode::BAD_REQUEST, e),
        Err(SwapError::Load(e)) => error(StatusCode::INTERNAL_SERVER_ERROR, e),
    }
}
