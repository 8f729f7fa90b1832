//! `cartpole-train`: a complete RL loop through warmgate.
//!
//! Each iteration:
//! 1. writes the current policy to the object store as safetensors
//!    (`<store>/v<N>/policy.safetensors`);
//! 2. syncs it into the pool's warm workers in place
//!    (`POST /v1/pools/<pool>/weights`);
//! 3. runs a batch of rollouts on the pool (`POST
//!    /v1/pools/<pool>/tasks/batch`), each pinned to that version with
//!    `min_weights_version`, so every episode is on-policy;
//! 4. takes a REINFORCE step.
//!
//! It stops once the mean return of the last 100 episodes reaches the
//! target (195: CartPole-v0 solved), prints the return curve, and can save
//! it as a PNG.

use std::io::Write as _;
use std::time::Instant;

use anyhow::{Context as _, bail};
use clap::Parser;
use serde_json::{Value, json};
use warmgate_examples::cartpole::{Episode, Learner, Policy};
use warmgate_examples::driver;

#[derive(Parser, Debug)]
#[command(about = "Train a CartPole policy with REINFORCE on a warmgate pool")]
struct Args {
    /// The gateway.
    #[arg(
        long,
        env = "WARMGATE_GATEWAY",
        default_value = "http://127.0.0.1:8080"
    )]
    gateway: String,
    /// The pool of `cartpole-worker`s.
    #[arg(long, default_value = "rollouts")]
    pool: String,
    /// Where each policy version is written: a folder, or a `file://`,
    /// `s3://`, `gs://` or `az://` URI (credentials from the environment).
    #[arg(long, default_value = "./checkpoints/cartpole")]
    store: String,
    /// Seed of the initial policy and of every rollout.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Give up after this many iterations.
    #[arg(long, default_value_t = 200)]
    iterations: u64,
    /// Rollout tasks per iteration.
    #[arg(long, default_value_t = 8)]
    tasks: u64,
    /// Episodes per task.
    #[arg(long, default_value_t = 4)]
    episodes: u64,
    /// Adam learning rate.
    #[arg(long, default_value_t = 0.01)]
    lr: f64,
    /// Discount.
    #[arg(long, default_value_t = 0.99)]
    gamma: f32,
    /// Stop when the mean return of the last 100 episodes reaches this.
    #[arg(long, default_value_t = 195.0)]
    target: f32,
    /// Save the return curve here as a PNG.
    #[arg(long)]
    png: Option<std::path::PathBuf>,
}

/// One iteration's figures.
struct Point {
    version: u64,
    mean: f32,
    last100: f32,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?
        .block_on(train(args))
}

async fn train(args: Args) -> anyhow::Result<()> {
    let gw = args.gateway.trim_end_matches('/').to_string();
    let http = driver::client(&gw)?;
    let store = driver::Store::open(&args.store)?;
    let mut version = driver::current_version(&http, &gw, &args.pool).await?;
    let mut learner = Learner::new(&Policy::init(args.seed)?, args.lr, args.gamma)?;
    let mut returns: Vec<f32> = Vec::new();
    let mut curve: Vec<Point> = Vec::new();
    println!(
        "{:>4} {:>7} {:>8} {:>8} {:>8} {:>9} {:>8}",
        "iter", "version", "mean", "last100", "sync_ms", "rollout_ms", "learn_ms"
    );
    for iter in 0..args.iterations {
        version += 1;
        // 1. The policy, as safetensors, into the object store.
        let bytes = driver::safetensors_bytes(learner.policy()?.tensors())?;
        let checkpoint = store
            .put(&format!("v{version}"), "policy.safetensors", bytes)
            .await?;
        // 2. Into the warm workers, in place.
        let t = Instant::now();
        let sync = driver::post_json(
            &http,
            &format!("{gw}/v1/pools/{}/weights", args.pool),
            &json!({"checkpoint": checkpoint, "version": version}),
        )
        .await
        .context("weight sync")?;
        if sync["replaced"].as_u64().unwrap_or(0) > 0 {
            eprintln!("warning: the sync replaced replicas: {}", sync["replicas"]);
        }
        let sync_ms = t.elapsed().as_millis();
        // 3. Rollouts on that version.
        let t = Instant::now();
        let episodes = rollouts(&http, &gw, &args, iter, version).await?;
        let rollout_ms = t.elapsed().as_millis();
        let mean = episodes.iter().map(|e| e.ret).sum::<f32>() / episodes.len() as f32;
        returns.extend(episodes.iter().map(|e| e.ret));
        let window = &returns[returns.len().saturating_sub(100)..];
        let last100 = window.iter().sum::<f32>() / window.len() as f32;
        curve.push(Point {
            version,
            mean,
            last100,
        });
        // 4. A policy-gradient step.
        let t = Instant::now();
        let solved = window.len() == 100 && last100 >= args.target;
        if !solved {
            learner.update(&episodes)?;
        }
        println!(
            "{iter:>4} {version:>7} {mean:>8.1} {last100:>8.1} {sync_ms:>8} {rollout_ms:>9} {:>8}",
            t.elapsed().as_millis()
        );
        std::io::stdout().flush()?;
        if solved {
            print_curve(&curve);
            if let Some(png) = &args.png {
                save_png(&curve, png, args.target)?;
                println!("return curve saved to {}", png.display());
            }
            println!(
                "solved: mean return {last100:.1} over the last 100 episodes after {} iterations ({} episodes)",
                iter + 1,
                returns.len()
            );
            return Ok(());
        }
    }
    print_curve(&curve);
    bail!(
        "not solved after {} iterations: the last 100 episodes averaged {:.1} (target {})",
        args.iterations,
        curve.last().map_or(0.0, |p| p.last100),
        args.target
    )
}

/// One batch of rollout tasks, each on `version`.
async fn rollouts(
    http: &reqwest::Client,
    gw: &str,
    args: &Args,
    iter: u64,
    version: u64,
) -> anyhow::Result<Vec<Episode>> {
    let inputs: Vec<Value> = (0..args.tasks)
        .map(
            |t| json!({"seed": args.seed * 1_000_000 + iter * 1000 + t, "episodes": args.episodes}),
        )
        .collect();
    let mut episodes = Vec::new();
    for out in driver::batch(http, gw, &args.pool, &inputs, version).await? {
        let eps: Vec<Episode> = serde_json::from_value(out["episodes"].clone())
            .context("a rollout's episodes are malformed")?;
        episodes.extend(eps);
    }
    anyhow::ensure!(
        episodes.len() as u64 == args.tasks * args.episodes,
        "expected {} episodes, got {}",
        args.tasks * args.episodes,
        episodes.len()
    );
    Ok(episodes)
}

/// The curve of the mean return per iteration, as text.
fn print_curve(curve: &[Point]) {
    const ROWS: usize = 10;
    const TOP: f32 = 200.0;
    println!("\nmean return per iteration (top = {TOP}):");
    for row in (0..ROWS).rev() {
        let level = TOP * row as f32 / ROWS as f32;
        let line: String = curve
            .iter()
            .map(|p| if p.mean > level { '█' } else { ' ' })
            .collect();
        println!("{level:>5.0} |{line}");
    }
    println!(
        "      +{} (versions {}..{})",
        "-".repeat(curve.len()),
        curve.first().map_or(0, |p| p.version),
        curve.last().map_or(0, |p| p.version)
    );
}

fn save_png(curve: &[Point], path: &std::path::Path, target: f32) -> anyhow::Result<()> {
    warmgate_examples::plot::line_chart(
        path,
        &[
            curve.iter().map(|p| p.mean).collect::<Vec<_>>(),
            curve.iter().map(|p| p.last100).collect::<Vec<_>>(),
        ],
        Some(target),
        200.0,
    )
}
