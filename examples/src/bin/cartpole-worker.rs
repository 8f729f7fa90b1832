//! `cartpole-worker`: a warm RL rollout worker for warmgate pools.
//!
//! It keeps its policy network in memory across tasks and follows the
//! worker contract:
//! - `POST /invoke {"seed", "episodes"?}` runs that many CartPole episodes
//!   with the current policy (sampling every random draw from `seed`) and
//!   answers `{"episodes": [{"obs", "actions", "ret"}], "weights_version"}`;
//! - `POST /weights {"url", "version"}` loads a new policy from the
//!   gateway's weights URL and swaps it in place, between tasks;
//! - `GET /healthz` reports `weights_version`.
//!
//! With no weights (`$WARMGATE_WEIGHTS_URL` unset) it acts uniformly at
//! random, as version 0.

use std::sync::Arc;

use anyhow::Context as _;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use bytes::Bytes;
use serde_json::{Value, json};
use warmgate_examples::cartpole::{Policy, rollout};
use warmgate_examples::{SwapError, Swappable};

/// Most episodes one task may ask for: bounds a task's time and answer.
const MAX_EPISODES: u64 = 256;

struct Worker {
    /// The current policy (`None`: random) and its weights version.
    policy: Swappable<Policy>,
    /// How long the weights took to load at start, for `/healthz`.
    weights_seconds: std::sync::OnceLock<f64>,
}

fn main() -> anyhow::Result<()> {
    warmgate_examples::run_worker(setup)
}

/// Loads the weights (when there are any) and builds the routes.
async fn setup() -> anyhow::Result<Router> {
    let worker = Arc::new(Worker {
        policy: Swappable::default(),
        weights_seconds: std::sync::OnceLock::new(),
    });
    if let Ok(url) = std::env::var("WARMGATE_WEIGHTS_URL") {
        let version = std::env::var("WARMGATE_WEIGHTS_VERSION")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        let t0 = std::time::Instant::now();
        let policy = worker
            .policy
            .load(&url, Policy::from_safetensors)
            .await
            .with_context(|| format!("load the policy from {url}"))?;
        worker.policy.current.set(policy, version);
        let _ = worker.weights_seconds.set(t0.elapsed().as_secs_f64());
        eprintln!("cartpole-worker: loaded weights version {version}");
    }
    Ok(Router::new()
        .route("/healthz", get(healthz))
        .route("/invoke", post(invoke))
        .route("/weights", post(weights))
        .with_state(worker))
}

fn error(status: StatusCode, message: impl Into<String>) -> Response {
    let kind = if status.is_client_error() {
        "bad_request"
    } else {
        "internal"
    };
    (
        status,
        Json(json!({"error": {"kind": kind, "message": message.into()}})),
    )
        .into_response()
}

async fn healthz(State(w): State<Arc<Worker>>) -> Json<Value> {
    Json(json!({
        "status": "ok",
        "weights_version": w.policy.current.get().1,
        "weights_seconds": w.weights_seconds.get(),
    }))
}

async fn invoke(State(w): State<Arc<Worker>>, body: Bytes) -> Response {
    let input: Value = match serde_json::from_slice(&body) {
        Ok(v) => v,
        Err(e) => return error(StatusCode::BAD_REQUEST, format!("input is not JSON: {e}")),
    };
    let Some(seed) = input["seed"].as_u64() else {
        return error(
            StatusCode::BAD_REQUEST,
            "input must be {\"seed\": <unsigned integer>, \"episodes\"?: 1..=256}",
        );
    };
    let episodes = match input.get("episodes") {
        None => 1,
        Some(v) => match v.as_u64() {
            Some(n @ 1..=MAX_EPISODES) => n,
            _ => {
                return error(
                    StatusCode::BAD_REQUEST,
                    format!("episodes must be 1..={MAX_EPISODES}"),
                );
            }
        },
    };
    let (policy, version) = w.policy.current.get();
    let run =
        tokio::task::spawn_blocking(move || rollout(policy.as_deref(), seed, episodes as usize))
            .await;
    match run {
        Ok(Ok(eps)) => Json(json!({"episodes": eps, "weights_version": version})).into_response(),
        Ok(Err(e)) => error(StatusCode::INTERNAL_SERVER_ERROR, format!("{e:#}")),
        Err(e) => error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
    }
}

async fn weights(State(w): State<Arc<Worker>>, body: Bytes) -> Response {
    match w.policy.swap(&body, Policy::from_safetensors).await {
        Ok(version) => Json(json!({"weights_version": version})).into_response(),
        Err(SwapError::BadBody(e)) => error(StatusCode::BAD_REQUEST, e),
        Err(SwapError::Load(e)) => error(StatusCode::INTERNAL_SERVER_ERROR, e),
    }
}
