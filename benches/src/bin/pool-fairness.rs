//! How long a light tenant waits while another floods the pool.
//!
//! Submits `--flood` async tasks as tenant `bulk`, then, while that backlog
//! drains, `--light` synchronous tasks one after another as tenant `light`.
//! A light task's wait is its round trip minus the worker's `sleep_ms`.
//! Prints one JSON line with the light tenant's wait percentiles and the
//! backlog left when the last light task finished (which shows the flood
//! was still there to compete with).

use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use clap::Parser;
use futures_util::StreamExt as _;
use hdrhistogram::Histogram;
use serde_json::{Value, json};

#[derive(Parser, Debug)]
struct Args {
    /// The gateway, e.g. http://127.0.0.1:8080
    #[arg(long)]
    gateway: String,
    /// The pool (of test-workers: tasks are `{"sleep_ms": N}`).
    #[arg(long)]
    pool: String,
    /// Tasks the bulk tenant queues up front.
    #[arg(long, default_value_t = 5000)]
    flood: usize,
    /// Tasks the light tenant sends, one at a time.
    #[arg(long, default_value_t = 100)]
    light: usize,
    /// Worker time per task.
    #[arg(long, default_value_t = 20)]
    sleep_ms: u64,
    /// A label for the output.
    #[arg(long, default_value = "")]
    label: String,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?
        .block_on(run(args))
}

async fn run(args: Args) -> anyhow::Result<()> {
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(64)
        .timeout(Duration::from_secs(600))
        .build()?;
    let gw = args.gateway.trim_end_matches('/');
    let tasks = format!("{gw}/v1/pools/{}/tasks", args.pool);
    let body = json!({"input": {"sleep_ms": args.sleep_ms}});

    // The flood, 32 submitters at a time.
    let flood_url = format!("{tasks}?async=true");
    let submitted = futures_util::stream::iter(0..args.flood)
        .map(|_| {
            let (http, url, body) = (http.clone(), flood_url.clone(), body.clone());
            async move {
                let r = http
                    .post(url)
                    .header("x-warmgate-tenant", "bulk")
                    .json(&body)
                    .send()
                    .await?;
                anyhow::ensure!(r.status() == 202, "flood task refused: {}", r.status());
                Ok::<_, anyhow::Error>(())
            }
        })
        .buffer_unordered(32);
    futures_util::pin_mut!(submitted);
    while let Some(r) = submitted.next().await {
        r?;
    }

    let mut hist = Histogram::<u64>::new_with_bounds(1, 600_000_000, 3)?;
    let mut first = None;
    for _ in 0..args.light {
        let t = Instant::now();
        let r = http
            .post(&tasks)
            .header("x-warmgate-tenant", "light")
            .json(&body)
            .send()
            .await
            .context("light task")?;
        if !r.status().is_success() {
            bail!("light task failed: {}", r.text().await.unwrap_or_default());
        }
        let _: Value = r.json().await?;
        let us = t.elapsed().as_micros() as u64;
        let wait = us.saturating_sub(args.sleep_ms * 1000).max(1);
        first.get_or_insert(wait);
        hist.record(wait)?;
    }
    let mut status = http.get(format!("{gw}/v1/status"));
    if let Ok(token) = std::env::var("WARMGATE_ADMIN_TOKEN") {
        status = status.bearer_auth(token);
    }
    let status: Value = status.send().await?.json().await?;
    let backlog = status["pools"]
        .as_array()
        .and_then(|ps| ps.iter().find(|p| p["name"] == args.pool.as_str()))
        .map_or(0, |p| p["pending"].as_u64().unwrap_or(0));
    let ms = |q: f64| hist.value_at_quantile(q) as f64 / 1000.0;
    println!(
        "{}",
        json!({
            "label": args.label,
            "flood": args.flood,
            "light": args.light,
            "light_first_wait_ms": first.unwrap_or(0) as f64 / 1000.0,
            "light_wait_p50_ms": ms(0.5),
            "light_wait_p99_ms": ms(0.99),
            "light_wait_max_ms": hist.max() as f64 / 1000.0,
            "bulk_backlog_at_end": backlog,
        })
    );
    Ok(())
}
