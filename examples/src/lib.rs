//! Reference workers for warmgate, and what they share.
//!
//! - `embedder`: a BERT embeddings server (OpenAI `/v1/embeddings`).
//! - `cartpole-worker`: RL rollouts of CartPole on a warm pool, with weights
//!   swapped in place; `cartpole-train`: the REINFORCE trainer that drives
//!   it through the gateway.
//! - `charlm-worker`: the tiny character-level LM, serving OpenAI
//!   completions and sampling rollouts (`/invoke`) with weights swapped in
//!   place; `charlm-train` pretrains it, `charlm-grpo` fine-tunes it by RL
//!   on the pool that serves it.

pub mod cartpole;
pub mod charlm;
pub mod grpo;

pub mod train {
    //! What the example trainers share: Adam over named tensors.

    use candle_core::{Tensor, Var};
    use candle_nn::Optimizer as _;

    /// Trainable copies of `tensors` (in their order), and Adam without
    /// weight decay over them.
    pub fn adam(
        tensors: Vec<(&'static str, Tensor)>,
        lr: f64,
    ) -> candle_core::Result<(Vars, candle_nn::AdamW)> {
        let names: Vec<&'static str> = tensors.iter().map(|(n, _)| *n).collect();
        let vars = tensors
            .into_iter()
            .map(|(_, t)| Var::from_tensor(&t))
            .collect::<candle_core::Result<Vec<_>>>()?;
        let opt = candle_nn::AdamW::new(
            vars.clone(),
            candle_nn::ParamsAdamW {
                lr,
                weight_decay: 0.0,
                ..Default::default()
            },
        )?;
        Ok((Vars { names, vars }, opt))
    }

    /// Trainable tensors by name.
    pub struct Vars {
        names: Vec<&'static str>,
        vars: Vec<Var>,
    }

    impl Vars {
        /// The tensor `name`: `tracked` for a forward pass that gradients
        /// flow through, detached for inference.
        pub fn get(&self, name: &str, tracked: bool) -> candle_core::Result<Tensor> {
            let i = self
                .names
                .iter()
                .position(|n| *n == name)
                .ok_or_else(|| candle_core::Error::Msg(format!("no tensor {name}")))?;
            let t = self.vars[i].as_tensor();
            Ok(if tracked { t.clone() } else { t.detach() })
        }
    }
}

pub mod driver {
    //! What the example trainers share to drive a gateway: the HTTP client,
    //! the object store they write checkpoints to, and the pool's version.

    use std::time::Duration;

    use anyhow::{Context as _, bail};
    use object_store::ObjectStoreExt as _;
    use serde_json::Value;

    /// An HTTP client for the gateway at `gateway`, with its admin token
    /// as the bearer token: `$WARMGATE_ADMIN_TOKEN` when set, else the
    /// token a gateway of this user made for itself and published for
    /// its address (as the CLI finds it).
    pub fn client(gateway: &str) -> anyhow::Result<reqwest::Client> {
        let mut headers = reqwest::header::HeaderMap::new();
        let token = std::env::var("WARMGATE_ADMIN_TOKEN")
            .ok()
            .filter(|t| !t.is_empty())
            .or_else(|| warmgate_deploy::admin_token::find_for(gateway));
        if let Some(token) = token {
            let mut v = reqwest::header::HeaderValue::from_str(&format!("Bearer {token}"))
                .context("WARMGATE_ADMIN_TOKEN is not a valid header value")?;
            v.set_sensitive(true);
            headers.insert(reqwest::header::AUTHORIZATION, v);
        }
        Ok(reqwest::Client::builder()
            .timeout(Duration::from_secs(600))
            .default_headers(headers)
            .build()?)
    }

    /// A store of checkpoints: a folder, or a `file://`, `s3://`, `gs://`
    /// or `az://` URI (credentials from the environment).
    pub struct Store {
        store: Box<dyn object_store::ObjectStore>,
        prefix: object_store::path::Path,
        /// Its URI as the gateway reads it.
        pub uri: String,
    }

    impl Store {
        /// Opens `store`, creating a local folder when it is one.
        pub fn open(store: &str) -> anyhow::Result<Store> {
            let uri = if store.contains("://") {
                store.trim_end_matches('/').to_string()
            } else {
                std::fs::create_dir_all(store).with_context(|| format!("create {store}"))?;
                let abs =
                    std::fs::canonicalize(store).with_context(|| format!("resolve {store}"))?;
                format!("file://{}", abs.display())
            };
            let url = url::Url::parse(&uri).with_context(|| format!("bad store URI {uri}"))?;
            let opts = std::env::vars()
                .filter(|(k, _)| {
                    ["AWS_", "GOOGLE_", "AZURE_"]
                        .iter()
                        .any(|p| k.starts_with(p))
                })
                .map(|(k, v)| (k.to_ascii_lowercase(), v));
            let (store, prefix) = object_store::parse_url_opts(&url, opts)
                .with_context(|| format!("open the store {uri}"))?;
            Ok(Store { store, prefix, uri })
        }

        /// Writes `bytes` as `<dir>/<file>`; returns the URI of `<dir>`,
        /// the checkpoint the gateway is given.
        pub async fn put(
            &self,
            dir: &str,
            file: &str,
            bytes: bytes::Bytes,
        ) -> anyhow::Result<String> {
            let path = self.prefix.clone().join(dir).join(file);
            self.store
                .put(&path, bytes.into())
                .await
                .with_context(|| format!("write {}/{dir}/{file}", self.uri))?;
            Ok(format!("{}/{dir}", self.uri))
        }
    }

    /// A pool's weights version now, so a second run carries on from it.
    pub async fn current_version(
        http: &reqwest::Client,
        gw: &str,
        pool: &str,
    ) -> anyhow::Result<u64> {
        let status: Value = http
            .get(format!("{gw}/v1/status"))
            .send()
            .await
            .with_context(|| {
                format!("cannot reach the gateway at {gw} (is `warmgate serve` running?)")
            })?
            .json()
            .await?;
        status["pools"]
            .as_array()
            .and_then(|ps| ps.iter().find(|p| p["name"] == pool))
            .map(|p| p["weights_version"].as_u64().unwrap_or(0))
            .with_context(|| format!("the gateway has no pool '{pool}'"))
    }

    /// POSTs `body`; the JSON answer, or the gateway's error message.
    pub async fn post_json(
        http: &reqwest::Client,
        url: &str,
        body: &Value,
    ) -> anyhow::Result<Value> {
        let resp = http.post(url).json(body).send().await?;
        let status = resp.status();
        let body: Value = resp.json().await.unwrap_or(Value::Null);
        if !status.is_success() {
            bail!("{url}: {status}: {}", body["error"]["message"]);
        }
        Ok(body)
    }

    /// Runs `inputs` as one batch of pool tasks pinned to weights
    /// `version` (`POST /v1/pools/{pool}/tasks/batch`); the outputs in
    /// input order. Fails on any task's error, or on an output from other
    /// weights.
    pub async fn batch(
        http: &reqwest::Client,
        gw: &str,
        pool: &str,
        inputs: &[Value],
        version: u64,
    ) -> anyhow::Result<Vec<Value>> {
        let resp = http
            .post(format!("{gw}/v1/pools/{pool}/tasks/batch"))
            .json(&serde_json::json!({"inputs": inputs, "min_weights_version": version}))
            .send()
            .await?;
        let status = resp.status();
        let text = resp.text().await?;
        if !status.is_success() {
            bail!("rollout batch: {status}: {text}");
        }
        let mut outputs = vec![Value::Null; inputs.len()];
        for line in text.lines().filter(|l| !l.trim().is_empty()) {
            let mut v: Value = serde_json::from_str(line).context("a batch line is not JSON")?;
            if let Some(e) = v.get("error") {
                bail!("rollout task {} failed: {}", v["index"], e["message"]);
            }
            let out = v["output"].take();
            anyhow::ensure!(
                out["weights_version"].as_u64() == Some(version),
                "a rollout ran on weights version {} instead of {version}",
                out["weights_version"]
            );
            let slot = v["index"]
                .as_u64()
                .and_then(|i| outputs.get_mut(i as usize))
                .context("a batch line's index is missing or out of range")?;
            *slot = out;
        }
        anyhow::ensure!(
            outputs.iter().all(|o| !o.is_null()),
            "the batch answered {} of {} tasks",
            outputs.iter().filter(|o| !o.is_null()).count(),
            inputs.len()
        );
        Ok(outputs)
    }

    /// Named tensors as a safetensors file's bytes.
    pub fn safetensors_bytes(
        tensors: Vec<(&'static str, candle_core::Tensor)>,
    ) -> anyhow::Result<bytes::Bytes> {
        let map: std::collections::HashMap<String, candle_core::Tensor> = tensors
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect();
        Ok(safetensors::serialize(&map, None)?.into())
    }
}

use anyhow::{Context as _, bail};
use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

/// A plain HTTP client for the gateway's weights URL.
#[derive(Clone)]
pub struct Fetcher {
    client: Client<HttpConnector, Empty<Bytes>>,
    /// `WARMGATE_WEIGHTS_TOKEN`: the gateway serves weights only to
    /// callers that present it.
    token: Option<String>,
}

impl Default for Fetcher {
    fn default() -> Self {
        Fetcher {
            client: Client::builder(TokioExecutor::new()).build_http(),
            token: std::env::var("WARMGATE_WEIGHTS_TOKEN")
                .ok()
                .filter(|t| !t.is_empty()),
        }
    }
}

impl Fetcher {
    /// `GET url` with the worker's token; a non-2xx answer is an error
    /// naming the URL and quoting the answer.
    async fn send(&self, url: &str) -> anyhow::Result<hyper::Response<hyper::body::Incoming>> {
        let uri: hyper::Uri = url.parse().with_context(|| format!("bad URL {url}"))?;
        if self.token.is_some() && !is_gateway_url(&uri) {
            bail!(
                "{url} is not on the gateway this worker was started by \
                 (WARMGATE_GATEWAY_URL); its weights token is sent nowhere else"
            );
        }
        let mut req = hyper::Request::get(uri);
        if let Some(token) = &self.token {
            req = req.header(hyper::header::AUTHORIZATION, format!("Bearer {token}"));
        }
        let req = req
            .body(Empty::new())
            .with_context(|| format!("GET {url}"))?;
        let resp = self
            .client
            .request(req)
            .await
            .with_context(|| format!("GET {url}"))?;
        let status = resp.status();
        if !status.is_success() {
            let body = resp.into_body().collect().await.map(|b| b.to_bytes());
            let text = body
                .as_deref()
                .map(String::from_utf8_lossy)
                .unwrap_or_default();
            bail!("GET {url}: {status}: {text}");
        }
        Ok(resp)
    }

    /// `GET url`, whole.
    pub async fn get(&self, url: &str) -> anyhow::Result<Bytes> {
        Ok(self
            .send(url)
            .await?
            .into_body()
            .collect()
            .await
            .with_context(|| format!("read {url}"))?
            .to_bytes())
    }
}

/// Whether `uri` is on the gateway that started this worker: the origin
/// (scheme, host, port) of `WARMGATE_GATEWAY_URL`, else of
/// `WARMGATE_WEIGHTS_URL`. The worker's weights token goes there only.
pub fn is_gateway_url(uri: &hyper::Uri) -> bool {
    let base = std::env::var("WARMGATE_GATEWAY_URL")
        .or_else(|_| std::env::var("WARMGATE_WEIGHTS_URL"))
        .ok()
        .and_then(|b| b.parse::<hyper::Uri>().ok());
    let origin = |u: &hyper::Uri| {
        let scheme = u.scheme_str().unwrap_or("").to_ascii_lowercase();
        let port = u.port_u16().or(match scheme.as_str() {
            "http" => Some(80),
            "https" => Some(443),
            _ => None,
        });
        (scheme, u.host().map(str::to_ascii_lowercase), port)
    };
    base.is_some_and(|b| origin(&b) == origin(uri))
}

/// One tensor of a streamed safetensors file, whole.
pub struct StreamedTensor {
    /// Its name.
    pub name: String,
    /// Element type.
    pub dtype: safetensors::Dtype,
    /// Shape.
    pub shape: Vec<usize>,
    /// Its bytes, in a buffer of exactly its size.
    pub data: Vec<u8>,
}

/// How a streamed file arrived.
#[derive(Debug, Clone, Default)]
pub struct StreamReport {
    /// Tensors handed on.
    pub tensors: usize,
    /// The file's size.
    pub bytes: u64,
    /// From the request to the first tensor handed on.
    pub first_tensor: Option<std::time::Duration>,
    /// Bytes received when the first tensor was handed on.
    pub first_tensor_bytes: u64,
    /// From the request to the last byte.
    pub total: std::time::Duration,
}

impl Fetcher {
    /// Streams a safetensors file tensor by tensor: the header is read and
    /// checked first, then each tensor's bytes go from the socket into one
    /// buffer of its size, and `on_tensor` gets it as soon as it is whole,
    /// while the rest still downloads. A short, long or malformed body is
    /// an error; the caller keeps nothing of a failed stream.
    pub async fn stream_safetensors(
        &self,
        url: &str,
        mut on_tensor: impl FnMut(StreamedTensor) -> anyhow::Result<()>,
    ) -> anyhow::Result<StreamReport> {
        use warmgate_pool::weights::header;
        let t0 = std::time::Instant::now();
        let resp = self.send(url).await?;
        let size: u64 = resp
            .headers()
            .get(hyper::header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok()?.parse().ok())
            .with_context(|| format!("GET {url}: no Content-Length"))?;
        let mut body = resp.into_body();
        let mut report = StreamReport {
            bytes: size,
            ..StreamReport::default()
        };
        // The prefix and the JSON header, then each tensor in file order.
        let mut head: Vec<u8> = Vec::new();
        let mut want_head = header::LEN_PREFIX as usize;
        let mut plan: Option<std::vec::IntoIter<warmgate_pool::weights::TensorEntry>> = None;
        let mut current: Option<(warmgate_pool::weights::TensorEntry, Vec<u8>)> = None;
        let mut received = 0u64;
        while let Some(frame) = body.frame().await {
            let frame = frame.with_context(|| format!("read {url}"))?;
            let Ok(mut chunk) = frame.into_data() else {
                continue;
            };
            received += chunk.len() as u64;
            if received > size {
                bail!("{url}: the body is longer than its Content-Length");
            }
            while !chunk.is_empty() {
                if plan.is_none() {
                    let take = (want_head - head.len()).min(chunk.len());
                    head.extend_from_slice(&chunk.split_to(take));
                    if head.len() < want_head {
                        continue;
                    }
                    if want_head == header::LEN_PREFIX as usize {
                        let n = header::json_len(&head, size, header::MAX_HEADER_BYTES)
                            .map_err(|e| anyhow::anyhow!("{url}: {e}"))?;
                        want_head += n as usize;
                        head.reserve_exact(n as usize);
                        continue;
                    }
                    let parsed = header::parse(&head[header::LEN_PREFIX as usize..], size)
                        .map_err(|e| anyhow::anyhow!("{url}: {e}"))?;
                    plan = Some(parsed.tensors.into_iter());
                    continue;
                }
                if current.is_none() {
                    let Some(next) = plan.as_mut().and_then(Iterator::next) else {
                        bail!("{url}: bytes follow the last tensor");
                    };
                    let len = (next.end - next.start) as usize;
                    current = Some((next, Vec::with_capacity(len)));
                }
                if let Some((entry, buf)) = current.as_mut() {
                    let want = (entry.end - entry.start) as usize - buf.len();
                    buf.extend_from_slice(&chunk.split_to(want.min(chunk.len())));
                }
                if let Some((entry, buf)) =
                    current.take_if(|(e, b)| b.len() as u64 == e.end - e.start)
                {
                    if report.first_tensor.is_none() {
                        report.first_tensor = Some(t0.elapsed());
                        report.first_tensor_bytes = received - chunk.len() as u64;
                    }
                    report.tensors += 1;
                    on_tensor(StreamedTensor {
                        name: entry.name,
                        dtype: entry.dtype,
                        shape: entry.shape,
                        data: buf,
                    })?;
                }
            }
        }
        if received != size {
            bail!("{url}: the stream ended after {received} of {size} bytes");
        }
        // Zero-sized tensors at the end take no bytes.
        for entry in plan.into_iter().flatten() {
            if entry.end != entry.start {
                bail!("{url}: tensor {} never arrived", entry.name);
            }
            report.tensors += 1;
            on_tensor(StreamedTensor {
                name: entry.name,
                dtype: entry.dtype,
                shape: entry.shape,
                data: Vec::new(),
            })?;
        }
        report.total = t0.elapsed();
        Ok(report)
    }
}

/// Resolves on SIGTERM or Ctrl-C: the worker contract's stop signal.
pub async fn shutdown_signal() {
    let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(s) => s,
        Err(_) => return std::future::pending().await,
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
}

/// Runs a worker as the contract asks: it reads `$WARMGATE_SOCKET` (a Unix
/// socket the gateway offers, which no other local user can reach) or
/// else `$PORT`, builds its router with `setup` (which may load weights
/// first: it listens only after, so a `/healthz` answer means ready),
/// serves there, and finishes its requests in flight on SIGTERM.
pub fn run_worker<F, Fut>(setup: F) -> anyhow::Result<()>
where
    F: FnOnce() -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<axum::Router>>,
{
    let socket = std::env::var_os("WARMGATE_SOCKET").filter(|s| !s.is_empty());
    let port = match socket {
        Some(_) => None,
        None => Some(port()?),
    };
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?
        .block_on(async move {
            let app = setup().await?;
            match (socket, port) {
                (Some(path), _) => {
                    let path = std::path::PathBuf::from(path);
                    let _ = std::fs::remove_file(&path);
                    let listener = tokio::net::UnixListener::bind(&path)
                        .with_context(|| format!("listen on {}", path.display()))?;
                    axum::serve(listener, app)
                        .with_graceful_shutdown(shutdown_signal())
                        .await?;
                }
                (None, port) => {
                    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port.unwrap_or(0)));
                    let listener = tokio::net::TcpListener::bind(addr)
                        .await
                        .with_context(|| format!("listen on {addr}"))?;
                    axum::serve(listener, app)
                        .with_graceful_shutdown(shutdown_signal())
                        .await?;
                }
            }
            Ok(())
        })
}

/// A worker's current model and its weights version, read and swapped as
/// one (a task or request takes the pair it started with).
pub struct Versioned<T>(std::sync::RwLock<(Option<std::sync::Arc<T>>, u64)>);

impl<T> Default for Versioned<T> {
    fn default() -> Self {
        Versioned(std::sync::RwLock::new((None, 0)))
    }
}

impl<T> Versioned<T> {
    /// The model (`None` before any load) and its version.
    pub fn get(&self) -> (Option<std::sync::Arc<T>>, u64) {
        self.0.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Swaps in `model` as `version`.
    pub fn set(&self, model: T, version: u64) {
        *self.0.write().unwrap_or_else(|e| e.into_inner()) =
            (Some(std::sync::Arc::new(model)), version);
    }
}

/// The body of the worker contract's `POST /weights`.
#[derive(Debug, serde::Deserialize)]
pub struct WeightsSwap {
    /// The gateway's weights URL of the new checkpoint.
    pub url: String,
    /// Its version.
    pub version: u64,
}

/// Why a `POST /weights` failed: the body (400) or the load (500).
#[derive(Debug)]
pub enum SwapError {
    /// The body is not `{"url", "version"}`.
    BadBody(String),
    /// The weights could not be fetched or read; the old ones stay.
    Load(String),
}

/// A worker's swappable model: the current one, and the loads that
/// replace it one at a time.
pub struct Swappable<T> {
    /// The model and its version.
    pub current: Versioned<T>,
    loading: tokio::sync::Mutex<()>,
    http: Fetcher,
}

impl<T> Default for Swappable<T> {
    fn default() -> Self {
        Swappable {
            current: Versioned::default(),
            loading: tokio::sync::Mutex::new(()),
            http: Fetcher::default(),
        }
    }
}

impl<T> Swappable<T> {
    /// Loads the model from a weights URL's first `.safetensors` file with
    /// `read`, without swapping it in.
    pub async fn load(
        &self,
        url: &str,
        read: impl Fn(&[u8]) -> anyhow::Result<T>,
    ) -> anyhow::Result<T> {
        let (name, bytes) = fetch_safetensors(&self.http, url).await?;
        read(&bytes).with_context(|| format!("read {name}"))
    }

    /// Serves `POST /weights`: loads the new model aside (one load at a
    /// time), then swaps it in whole. Returns the new version.
    pub async fn swap(
        &self,
        body: &[u8],
        read: impl Fn(&[u8]) -> anyhow::Result<T>,
    ) -> Result<u64, SwapError> {
        let swap: WeightsSwap = serde_json::from_slice(body).map_err(|e| {
            SwapError::BadBody(format!("the body must be {{\"url\", \"version\"}}: {e}"))
        })?;
        let _one_at_a_time = self.loading.lock().await;
        let model = self
            .load(&swap.url, read)
            .await
            .map_err(|e| SwapError::Load(format!("{e:#}")))?;
        self.current.set(model, swap.version);
        Ok(swap.version)
    }
}

/// The first `.safetensors` file a weights URL's manifest lists: its name
/// and bytes.
pub async fn fetch_safetensors(http: &Fetcher, url: &str) -> anyhow::Result<(String, Bytes)> {
    let manifest: serde_json::Value =
        serde_json::from_slice(&http.get(url).await?).context("the manifest is not JSON")?;
    let name = manifest["files"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|f| f["name"].as_str())
        .find(|n| n.ends_with(".safetensors"))
        .context("the checkpoint has no .safetensors file")?
        .to_string();
    let bytes = http.get(&format!("{url}/{name}")).await?;
    Ok((name, bytes))
}

/// `$PORT`, as the worker contract sets it.
pub fn port() -> anyhow::Result<u16> {
    std::env::var("PORT")
        .context("PORT must be set (the worker contract)")?
        .parse()
        .context("PORT must be a port number")
}

pub mod plot {
    //! Curves saved as PNG images.

    use plotters::prelude::*;

    /// Draws `series` (one value per iteration each) as lines on a white
    /// background, with `goal` as a dashed horizontal line, y from 0 to
    /// `top`. No text: the bitmap backend is built without fonts.
    pub fn line_chart(
        path: &std::path::Path,
        series: &[Vec<f32>],
        goal: Option<f32>,
        top: f32,
    ) -> anyhow::Result<()> {
        let n = series.iter().map(Vec::len).max().unwrap_or(0).max(2);
        let root = BitMapBackend::new(path, (800, 480)).into_drawing_area();
        root.fill(&WHITE)?;
        let mut chart = ChartBuilder::on(&root)
            .margin(20)
            .build_cartesian_2d(0f32..(n - 1) as f32, 0f32..top * 1.05)?;
        let grid = RGBColor(225, 225, 225);
        for k in 0..=10 {
            let y = top * k as f32 / 10.0;
            chart.draw_series(LineSeries::new([(0.0, y), ((n - 1) as f32, y)], grid))?;
        }
        if let Some(g) = goal {
            chart.draw_series(DashedLineSeries::new(
                [(0.0, g), ((n - 1) as f32, g)],
                8,
                6,
                RED.stroke_width(2),
            ))?;
        }
        let colours = [BLUE, GREEN, MAGENTA, BLACK];
        for (i, s) in series.iter().enumerate() {
            chart.draw_series(LineSeries::new(
                s.iter().enumerate().map(|(x, y)| (x as f32, *y)),
                colours[i % colours.len()].stroke_width(2),
            ))?;
        }
        root.present()?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A safetensors file of three tensors (one empty) and the tensors'
    /// bytes in file order.
    fn file() -> (Vec<u8>, Vec<(String, Vec<u8>)>) {
        let a: Vec<u8> = (0..=255u8).cycle().take(4 * 1000).collect();
        let b: Vec<u8> = (0..=250u8).rev().cycle().take(2 * 333).collect();
        let views = [
            (
                "a",
                safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![1000], &a),
            ),
            (
                "b",
                safetensors::tensor::TensorView::new(safetensors::Dtype::F16, vec![333], &b),
            ),
            (
                "c",
                safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![0], &[]),
            ),
        ];
        let views: Vec<(&str, safetensors::tensor::TensorView<'_>)> = views
            .into_iter()
            .map(|(n, v)| (n, v.expect("view")))
            .collect();
        let bytes = safetensors::serialize(views, None).expect("serialize");
        (
            bytes,
            vec![("a".into(), a), ("b".into(), b), ("c".into(), Vec::new())],
        )
    }

    /// Serves `body` in chunks of `chunk` bytes, claiming `length`.
    async fn serve(body: Vec<u8>, chunk: usize, length: usize) -> String {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let app = axum::Router::new().route(
            "/model.safetensors",
            axum::routing::get(move || {
                let parts: Vec<Result<Bytes, std::io::Error>> = body
                    .chunks(chunk)
                    .map(|c| Ok(Bytes::copy_from_slice(c)))
                    .collect();
                async move {
                    axum::response::Response::builder()
                        .header("content-length", length)
                        .body(axum::body::Body::from_stream(futures_util::stream::iter(
                            parts,
                        )))
                        .expect("response")
                }
            }),
        );
        tokio::spawn(async move { axum::serve(listener, app).await });
        format!("http://{addr}/model.safetensors")
    }

    async fn stream(url: &str) -> anyhow::Result<Vec<(String, Vec<u8>)>> {
        let mut got = Vec::new();
        Fetcher::default()
            .stream_safetensors(url, |t| {
                assert_eq!(t.data.capacity(), t.data.len(), "one buffer of its size");
                got.push((t.name, t.data));
                Ok(())
            })
            .await?;
        Ok(got)
    }

    #[tokio::test]
    async fn tensors_arrive_whole_in_order_whatever_the_chunking() {
        let (bytes, want) = file();
        // Compared by name (the empty tensor's place among equal offsets is
        // the header's), without printing megabytes on a failure.
        let brief = |mut v: Vec<(String, Vec<u8>)>| {
            v.sort();
            v.into_iter()
                .map(|(n, d)| (n, d.len(), d.iter().map(|b| u64::from(*b)).sum::<u64>()))
                .collect::<Vec<_>>()
        };
        for chunk in [1, 7, 64, 4096, bytes.len()] {
            let url = serve(bytes.clone(), chunk, bytes.len()).await;
            let got = stream(&url).await.expect("stream");
            let same = {
                let (mut g, mut w) = (got.clone(), want.clone());
                g.sort();
                w.sort();
                g == w
            };
            assert!(
                same,
                "chunk {chunk}: {:?} != {:?}",
                brief(got),
                brief(want.clone())
            );
        }
    }

    #[tokio::test]
    async fn short_long_and_malformed_bodies_fail() {
        let (bytes, _) = file();
        // Truncated: the server claims the full length and sends less.
        let url = serve(bytes[..bytes.len() - 10].to_vec(), 100, bytes.len()).await;
        assert!(stream(&url).await.is_err());
        // A header that claims more than the file holds.
        let mut lying = bytes.clone();
        lying[..8].copy_from_slice(&(1u64 << 40).to_le_bytes());
        let url = serve(lying, 100, bytes.len()).await;
        let err = stream(&url).await.expect_err("lying header").to_string();
        assert!(err.contains("header"), "{err}");
        // Not JSON.
        let mut garbled = bytes.clone();
        garbled[8] = b'#';
        let url = serve(garbled, 100, bytes.len()).await;
        assert!(stream(&url).await.is_err());
    }
}
