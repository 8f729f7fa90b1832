//! `embedder`: a real embeddings worker (sentence-transformers
//! all-MiniLM-L6-v2 or any BERT checkpoint) that follows warmgate's worker
//! contract.
//!
//! At start it streams its checkpoint (`config.json`, `tokenizer.json`,
//! `model.safetensors`) from `$WARMGATE_WEIGHTS_URL`, which warmgate serves
//! from its node-local cache, the weights tensor by tensor (each a candle
//! tensor as soon as its bytes are in, so loading overlaps the download and
//! the weights are held once), builds the model, and only then
//! listens on `$PORT`, so `GET /healthz` answering means it is ready. It
//! serves OpenAI-compatible `POST /v1/embeddings`, pooled as
//! sentence-transformers does: mean over the attention mask, then L2
//! normalisation. `input` may be text or token ids in the model's own
//! vocabulary (one array of ids, or an array of them), as OpenAI's API
//! allows; an id outside the vocabulary is a 400.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use anyhow::Context as _;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use base64::Engine as _;
use bytes::Bytes;
use candle_core::safetensors::Load as _;
use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use candle_transformers::models::bert::{BertModel, Config};
use serde::Deserialize;
use serde_json::{Value, json};
use tokenizers::{PaddingParams, Tokenizer, TruncationParams};

/// Longest input in tokens, as all-MiniLM-L6-v2 was trained
/// (`max_seq_length` in its `sentence_bert_config.json`).
const MAX_TOKENS: usize = 256;
/// Most inputs in one request: bounds the memory of one forward pass.
const MAX_INPUTS: usize = 256;

struct Model {
    bert: BertModel,
    tokenizer: Tokenizer,
    name: String,
}

fn main() -> anyhow::Result<()> {
    warmgate_examples::run_worker(setup)
}

/// Streams the checkpoint, builds the model, and the routes.
async fn setup() -> anyhow::Result<Router> {
    let url = std::env::var("WARMGATE_WEIGHTS_URL").context(
        "WARMGATE_WEIGHTS_URL is not set: run the embedder under `warmgate serve` with a \
         `checkpoint` for its app",
    )?;
    let t0 = Instant::now();
    let http = warmgate_examples::Fetcher::default();
    let config = http.get(&format!("{url}/config.json")).await?;
    let tokenizer = http.get(&format!("{url}/tokenizer.json")).await?;
    // Tensor by tensor: each becomes a candle tensor as soon as its bytes
    // are in, while the rest downloads, and its buffer goes at once.
    let mut tensors: HashMap<String, Tensor> = HashMap::new();
    let report = http
        .stream_safetensors(&format!("{url}/model.safetensors"), |t| {
            let view = safetensors::tensor::TensorView::new(t.dtype, t.shape, &t.data)
                .map_err(|e| anyhow::anyhow!("tensor {}: {e}", t.name))?;
            let tensor = view
                .load(&Device::Cpu)
                .with_context(|| format!("tensor {}", t.name))?;
            tensors.insert(t.name, tensor);
            Ok(())
        })
        .await?;
    let streamed = t0.elapsed();
    let model = tokio::task::spawn_blocking(move || build(&config, &tokenizer, tensors))
        .await
        .context("the model build task failed")??;
    eprintln!(
        "embedder: {} tensors ({:.1} MB) streamed in {:.3}s, the first after {:.3}s ({:.1} MB in), model ready in {:.3}s",
        report.tensors,
        report.bytes as f64 / 1e6,
        streamed.as_secs_f64(),
        report.first_tensor.unwrap_or_default().as_secs_f64(),
        report.first_tensor_bytes as f64 / 1e6,
        t0.elapsed().as_secs_f64()
    );
    let state = Arc::new(model);
    Ok(Router::new()
        .route(
            "/healthz",
            get(move || async move {
                Json(json!({"status": "ok", "weights_seconds": streamed.as_secs_f64()}))
            }),
        )
        .route("/v1/embeddings", post(embeddings))
        .with_state(state))
}

fn build(
    config: &[u8],
    tokenizer: &[u8],
    tensors: HashMap<String, Tensor>,
) -> anyhow::Result<Model> {
    let config: Config = serde_json::from_slice(config).context("parse config.json")?;
    let mut tokenizer = Tokenizer::from_bytes(tokenizer)
        .map_err(|e| anyhow::anyhow!("parse tokenizer.json: {e}"))?;
    tokenizer.with_padding(Some(PaddingParams::default()));
    tokenizer
        .with_truncation(Some(TruncationParams {
            max_length: MAX_TOKENS,
            ..Default::default()
        }))
        .map_err(|e| anyhow::anyhow!("set truncation: {e}"))?;
    let vb = VarBuilder::from_tensors(tensors, DType::F32, &Device::Cpu);
    let bert = BertModel::load(vb, &config).context("build the BERT model")?;
    let name = std::env::var("WARMGATE_TARGET").unwrap_or_else(|_| "embedder".into());
    Ok(Model {
        bert,
        tokenizer,
        name,
    })
}

#[derive(Deserialize)]
struct Request {
    model: Option<String>,
    input: Value,
    encoding_format: Option<String>,
}

fn error(status: StatusCode, message: impl Into<String>) -> Response {
    let kind = if status == StatusCode::BAD_REQUEST {
        "bad_request"
    } else {
        "replica_failed"
    };
    (
        status,
        Json(json!({"error": {"kind": kind, "message": message.into()}})),
    )
        .into_response()
}

async fn embeddings(State(model): State<Arc<Model>>, body: Bytes) -> Response {
    let req: Request = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => return error(StatusCode::BAD_REQUEST, format!("bad request body: {e}")),
    };
    let inputs = match parse_inputs(req.input, model.tokenizer.get_vocab_size(true)) {
        Ok(i) => i,
        Err(why) => return error(StatusCode::BAD_REQUEST, why),
    };
    let base64 = match req.encoding_format.as_deref() {
        None | Some("float") => false,
        Some("base64") => true,
        Some(other) => {
            return error(
                StatusCode::BAD_REQUEST,
                format!("encoding_format {other:?} is not supported (float, base64)"),
            );
        }
    };
    let m = model.clone();
    let result = tokio::task::spawn_blocking(move || embed(&m, &inputs)).await;
    let (vectors, tokens) = match result {
        Ok(Ok(v)) => v,
        Ok(Err(e)) => return error(StatusCode::INTERNAL_SERVER_ERROR, format!("{e:#}")),
        Err(e) => return error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
    };
    let data: Vec<Value> = vectors
        .iter()
        .enumerate()
        .map(|(i, v)| {
            let embedding = if base64 {
                let raw: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
                Value::String(base64::engine::general_purpose::STANDARD.encode(raw))
            } else {
                json!(v)
            };
            json!({"object": "embedding", "index": i, "embedding": embedding})
        })
        .collect();
    Json(json!({
        "object": "list",
        "model": req.model.unwrap_or_else(|| model.name.clone()),
        "data": data,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }))
    .into_response()
}

/// One input: text, or token ids in the model's own vocabulary (as
/// OpenAI's API allows: `[101, 7592, 102]` is one input, `[[...], [...]]`
/// several).
enum Input {
    Text(String),
    Tokens(Vec<u32>),
}

/// The request's `input`: a string, strings, token ids or arrays of them,
/// each id below `vocab`.
fn parse_inputs(input: Value, vocab: usize) -> Result<Vec<Input>, String> {
    const SHAPE: &str = "`input` must be a string, an array of strings, an array of token ids, or an array of arrays of token ids";
    let ids = |items: &[Value]| -> Result<Vec<u32>, String> {
        if items.is_empty() {
            return Err("a token-id input must not be empty".into());
        }
        if items.len() > MAX_TOKENS {
            return Err(format!(
                "a token-id input has {} ids; at most {MAX_TOKENS}",
                items.len()
            ));
        }
        items
            .iter()
            .map(|v| match v.as_u64() {
                Some(id) if (id as usize) < vocab => Ok(id as u32),
                Some(id) => Err(format!(
                    "token id {id} is outside this model's vocabulary (0 to {})",
                    vocab - 1
                )),
                None => Err(SHAPE.to_string()),
            })
            .collect()
    };
    let inputs = match input {
        Value::String(s) => vec![Input::Text(s)],
        Value::Array(items) if items.iter().all(Value::is_string) => items
            .into_iter()
            .filter_map(|v| v.as_str().map(|s| Input::Text(s.to_string())))
            .collect(),
        Value::Array(items) if !items.is_empty() && items.iter().all(Value::is_number) => {
            vec![Input::Tokens(ids(&items)?)]
        }
        Value::Array(items) if items.iter().all(Value::is_array) => items
            .iter()
            .map(|v| ids(v.as_array().map_or(&[][..], Vec::as_slice)).map(Input::Tokens))
            .collect::<Result<_, _>>()?,
        _ => return Err(SHAPE.to_string()),
    };
    if inputs.is_empty() || inputs.len() > MAX_INPUTS {
        return Err(format!("`input` must have 1 to {MAX_INPUTS} items"));
    }
    Ok(inputs)
}

/// Embeds a batch: BERT, mean pooling over real tokens, L2 normalisation.
/// Text is tokenized (with `[CLS]` and `[SEP]`); token ids are used as
/// given, so a client that tokenized the same text gets the same vector.
fn embed(model: &Model, inputs: &[Input]) -> anyhow::Result<(Vec<Vec<f32>>, usize)> {
    let texts: Vec<String> = inputs
        .iter()
        .filter_map(|i| match i {
            Input::Text(t) => Some(t.clone()),
            Input::Tokens(_) => None,
        })
        .collect();
    let enc = model
        .tokenizer
        .encode_batch(texts, true)
        .map_err(|e| anyhow::anyhow!("tokenize: {e}"))?;
    let mut encoded = enc.iter().map(|e| {
        e.get_ids()
            .iter()
            .zip(e.get_attention_mask())
            .filter(|(_, m)| **m == 1)
            .map(|(id, _)| *id)
            .collect::<Vec<u32>>()
    });
    let seqs: Vec<Vec<u32>> = inputs
        .iter()
        .map(|i| match i {
            Input::Text(_) => encoded.next().unwrap_or_default(),
            Input::Tokens(t) => t.clone(),
        })
        .collect();
    let width = seqs.iter().map(Vec::len).max().unwrap_or(1).max(1);
    let tokens: usize = seqs.iter().map(Vec::len).sum();
    let dev = &model.bert.device;
    let mut ids = Vec::with_capacity(seqs.len());
    let mut masks = Vec::with_capacity(seqs.len());
    for s in &seqs {
        let mut row = s.clone();
        let mut mask = vec![1u32; s.len()];
        row.resize(width, 0);
        mask.resize(width, 0);
        ids.push(Tensor::new(row, dev)?);
        masks.push(Tensor::new(mask, dev)?);
    }
    let ids = Tensor::stack(&ids, 0)?;
    let mask = Tensor::stack(&masks, 0)?;
    let types = ids.zeros_like()?;
    let hidden = model.bert.forward(&ids, &types, Some(&mask))?;
    let mask_f = mask.to_dtype(DType::F32)?.unsqueeze(2)?;
    let summed = hidden.broadcast_mul(&mask_f)?.sum(1)?;
    let counts = mask_f.sum(1)?;
    let mean = summed.broadcast_div(&counts)?;
    let norm = mean.sqr()?.sum_keepdim(1)?.sqrt()?;
    let normed = mean.broadcast_div(&norm)?;
    Ok((normed.to_vec2::<f32>()?, tokens))
}
