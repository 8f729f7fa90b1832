//! `charlm-train`: trains the tiny character-level model and writes a
//! checkpoint after every epoch, the way a training job feeds warmgate's
//! checkpoint watcher:
//!
//! ```text
//! OUT/epoch-001/model.safetensors
//! OUT/epoch-001/_COMPLETE        <- written last: the checkpoint is whole
//! ```

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context as _;
use clap::Parser;
use warmgate_examples::charlm::{CharLm, Trainer, corpus};

#[derive(Parser, Debug)]
#[command(about = "Train a tiny character-level LM, one checkpoint per epoch")]
struct Args {
    /// Where the epoch folders go.
    #[arg(long, default_value = "./checkpoints/charlm")]
    out: PathBuf,
    /// Epochs to run.
    #[arg(long, default_value_t = 5)]
    epochs: u32,
    /// The number of the first epoch (to carry on a run).
    #[arg(long, default_value_t = 1)]
    start_epoch: u32,
    /// Optimizer steps per epoch.
    #[arg(long, default_value_t = 60)]
    steps: u32,
    /// Examples per step.
    #[arg(long, default_value_t = 64)]
    batch: usize,
    /// Adam learning rate.
    #[arg(long, default_value_t = 0.01)]
    lr: f64,
    /// Seed of the corpus, the model and the batches.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Lines of generated corpus.
    #[arg(long, default_value_t = 2000)]
    lines: usize,
    /// The marker file written last.
    #[arg(long, default_value = "_COMPLETE")]
    marker: String,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let text = corpus(args.seed, args.lines);
    let mut trainer = Trainer::new(&CharLm::init(args.seed)?, &text, args.lr, args.seed)?;
    println!("epoch 0: loss {:.3} (untrained)", trainer.eval(2048)?);
    for epoch in args.start_epoch..args.start_epoch + args.epochs {
        let t0 = Instant::now();
        for _ in 0..args.steps {
            trainer.step(args.batch)?;
        }
        let loss = trainer.eval(2048)?;
        let dir = args.out.join(format!("epoch-{epoch:03}"));
        std::fs::create_dir_all(&dir).with_context(|| format!("create {}", dir.display()))?;
        let map: std::collections::HashMap<String, candle_core::Tensor> = trainer
            .model()?
            .tensors()
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect();
        candle_core::safetensors::save(&map, dir.join("model.safetensors"))?;
        std::fs::write(dir.join(&args.marker), b"")?;
        let sample = trainer.model()?.complete("the ", 40, 0.0, 1)?;
        println!(
            "epoch {epoch}: loss {loss:.3} in {:.1}s -> {} | the {}",
            t0.elapsed().as_secs_f64(),
            dir.display(),
            sample.replace('\n', " / ")
        );
    }
    Ok(())
}
