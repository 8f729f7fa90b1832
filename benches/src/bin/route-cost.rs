//! What routing by prefix adds to a request, against what the gateway
//! does to every OpenAI request anyway, in one run.
//!
//! The baseline: reading the body's `model` without building a tree, as
//! the gateway does before any routing. Added by `[apps.routing] policy =
//! "prefix"`: the prompt's key (the text of every message in chained
//! 128-byte chunk hashes), the choice among the replicas by the prefix
//! index under the load bound, and recording the choice. The prompt is a
//! chat of about 8,000 tokens (a long system prompt and a conversation),
//! and the index is warm: it holds this conversation's earlier turns and
//! thousands of other prompts. Prints p50/p90/p99 in microseconds.
//!
//! Usage: `cargo run --release -p warmgate-benches --bin route-cost`

use std::time::Instant;

use clap::Parser;
use hdrhistogram::Histogram;
use serde_json::json;
use warmgate_gateway::serving::route::{
    Bound, Candidate, Costs, PrefixIndex, ReplicaKey, choose, key::prompt_key,
};

#[derive(Parser)]
struct Args {
    /// Words (about tokens) in the prompt.
    #[arg(long, default_value_t = 8000)]
    words: usize,
    /// Replicas to choose among.
    #[arg(long, default_value_t = 8)]
    replicas: usize,
    /// Timed rounds.
    #[arg(long, default_value_t = 20_000)]
    rounds: usize,
}

/// Reads `model` without building a tree, as the gateway's `model_field`.
fn model_of(body: &[u8]) -> usize {
    #[derive(serde::Deserialize)]
    struct Model<'a> {
        #[serde(borrow, default)]
        model: Option<std::borrow::Cow<'a, str>>,
    }
    serde_json::from_slice::<Model>(body)
        .ok()
        .and_then(|m| m.model)
        .map_or(0, |m| m.len())
}

fn main() {
    let args = Args::parse();
    let words = |seed: usize, n: usize| -> String {
        (0..n)
            .map(|i| format!("w{}", (i * 7919 + seed * 104_729) % 5000))
            .collect::<Vec<_>>()
            .join(" ")
    };
    let system = words(1, args.words * 3 / 4);
    let mut messages = vec![json!({"role": "system", "content": system})];
    let turns = 6;
    for t in 0..turns {
        messages
            .push(json!({"role": "user", "content": words(10 + t, args.words / 4 / turns / 2)}));
        messages.push(
            json!({"role": "assistant", "content": words(20 + t, args.words / 4 / turns / 2)}),
        );
    }
    let body = serde_json::to_vec(&json!({"model": "llama", "messages": messages, "stream": true}))
        .expect("json");

    let candidates: Vec<Candidate> = (0..args.replicas)
        .map(|i| Candidate {
            replica: ReplicaKey::of(&format!("llama-00001-{i}")),
            load: (i % 3) as u32,
            cache_permille: 0,
            // The replica that holds half the conversation is full: the
            // decision weighs waiting for it.
            free: i != 1,
            waiting: 0,
            limit: 8,
        })
        .collect();
    let mut index = PrefixIndex::new(8 * 1024 * 1024);
    // Warm: thousands of other prompts, and this conversation's start.
    for p in 0..4000 {
        let other = serde_json::to_vec(&json!({"model": "llama", "prompt": words(1000 + p, 400)}))
            .expect("json");
        if let Some(k) = prompt_key(&other) {
            index.record(&k.chunks, candidates[p % candidates.len()].replica);
        }
    }
    let key = prompt_key(&body).expect("a prompt");
    index.record(&key.chunks[..key.chunks.len() / 2], candidates[1].replica);
    let costs = Costs {
        hold_seconds: 0.1,
        prefill_per_chunk: 0.005,
    };
    let bound = Bound {
        factor: 1.25,
        slack: 4,
    };

    let mut base = Histogram::<u64>::new(3).expect("histogram");
    let mut routed = Histogram::<u64>::new(3).expect("histogram");
    let mut scratch = Vec::new();
    let mut sink = 0usize;
    for round in 0..args.rounds + 1000 {
        let t = Instant::now();
        sink += model_of(&body);
        let b = t.elapsed();
        let t = Instant::now();
        let k = prompt_key(&body).expect("a prompt");
        let c = choose(&candidates, &k, &index, bound, costs, &mut scratch).expect("a choice");
        index.record(&k.chunks, candidates[c.index].replica);
        let r = t.elapsed();
        sink += c.index;
        if round >= 1000 {
            base.record(b.as_nanos() as u64).expect("record");
            routed.record(r.as_nanos() as u64).expect("record");
        }
    }
    let us = |h: &Histogram<u64>, q: f64| h.value_at_quantile(q) as f64 / 1000.0;
    println!(
        "prompt: {} bytes, {} chunks; {} replicas; {} rounds (sink {sink})",
        body.len(),
        key.chunks.len(),
        args.replicas,
        args.rounds
    );
    println!(
        "reading model (every request): p50 {:.1} us, p90 {:.1} us, p99 {:.1} us",
        us(&base, 0.5),
        us(&base, 0.9),
        us(&base, 0.99)
    );
    println!(
        "added by prefix routing (key + choice + record): p50 {:.1} us, p90 {:.1} us, p99 {:.1} us",
        us(&routed, 0.5),
        us(&routed, 0.9),
        us(&routed, 0.99)
    );
}
