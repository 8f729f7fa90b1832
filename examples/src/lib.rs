//! Reference workers for warmgate, and what they share.
//!
//! - `embedder`: a BERT embeddings server (OpenAI `/v1/embeddings`).
//! - `cartpole-worker`: RL rollouts of CartPole on a warm pool, with weights
//!   swapped in place; `cartpole-train`: the REINFORCE trainer that drives
//!   it through the gateway.

pub mod cartpole;
pub mod charlm;

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
    /// `GET url`, whole; a non-2xx answer is an error naming the URL.
    pub async fn get(&self, url: &str) -> anyhow::Result<Bytes> {
        let uri: hyper::Uri = url.parse().with_context(|| format!("bad URL {url}"))?;
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
        let body = resp
            .into_body()
            .collect()
            .await
            .with_context(|| format!("read {url}"))?
            .to_bytes();
        if !status.is_success() {
            bail!("GET {url}: {status}: {}", String::from_utf8_lossy(&body));
        }
        Ok(body)
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

/// Runs a worker as the contract asks: it reads `$PORT`, builds its router
/// with `setup` (which may load weights first: the port is bound only after,
/// so a `/healthz` answer means ready), serves on `127.0.0.1:$PORT`, and
/// finishes its requests in flight on SIGTERM.
pub fn run_worker<F, Fut>(setup: F) -> anyhow::Result<()>
where
    F: FnOnce() -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<axum::Router>>,
{
    let port = port()?;
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?
        .block_on(async move {
            let app = setup().await?;
            let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
            let listener = tokio::net::TcpListener::bind(addr)
                .await
                .with_context(|| format!("listen on port {port}"))?;
            axum::serve(listener, app)
                .with_graceful_shutdown(shutdown_signal())
                .await?;
            Ok(())
        })
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
