//! What counting tokens adds to a streamed LLM answer, against passing the
//! same answer through untouched, in one run.
//!
//! The answer is what vLLM streams for a chat: `--tokens` chunks of one
//! token each, one server-sent event a frame, then the usage chunk the
//! gateway asked for and `data: [DONE]`. The baseline reads that body to
//! its end as the proxy does. Counting adds, per request: the body's
//! `stream_options.include_usage` set (the client did not ask for it, the
//! costly case), every frame read for `usage` and the usage chunk taken out
//! of the stream, and the tokens added to the ledger's counters (with the
//! Prometheus recorder installed, as in `serve`). Prints p50/p90/p99 in
//! microseconds, each path timed on its own in alternating rounds.
//!
//! Usage: `cargo run --release -p warmgate-benches --bin usage-cost`

use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};
use std::time::Instant;

use axum::body::Body;
use bytes::Bytes;
use clap::Parser;
use hdrhistogram::Histogram;
use http_body::Body as HttpBody;
use warmgate_gateway::serving::json_body;
use warmgate_gateway::usage::tap::{Meter, Metered};
use warmgate_gateway::usage::{Ledger, UsageKey};

#[derive(Parser)]
struct Args {
    /// Completion tokens streamed, one event each.
    #[arg(long, default_value_t = 64)]
    tokens: usize,
    /// Timed rounds.
    #[arg(long, default_value_t = 20_000)]
    rounds: usize,
}

fn body_of(frames: Vec<Bytes>) -> Body {
    Body::from_stream(futures_util::stream::iter(
        frames.into_iter().map(Ok::<_, Infallible>),
    ))
}

/// Reads a body whose frames are all ready to its end; its bytes.
fn drain(mut body: impl HttpBody<Data = Bytes> + Unpin) -> usize {
    let mut cx = Context::from_waker(Waker::noop());
    let mut n = 0;
    loop {
        match Pin::new(&mut body).poll_frame(&mut cx) {
            Poll::Ready(Some(Ok(f))) => n += f.data_ref().map_or(0, Bytes::len),
            Poll::Ready(_) => return n,
            Poll::Pending => panic!("a ready stream waited"),
        }
    }
}

fn main() {
    let args = Args::parse();
    let _recorder = metrics_exporter_prometheus::PrometheusBuilder::new()
        .install_recorder()
        .expect("a recorder");
    let dir = std::env::temp_dir().join(format!("warmgate-usage-cost-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let ledger = Ledger::open(&dir.join("state.db"), 1 << 20).expect("ledger");
    let key = UsageKey {
        tenant: "team-a".into(),
        app: "tiny".into(),
        model: "tiny".into(),
    };
    let request = Bytes::from(format!(
        r#"{{"model":"tiny","stream":true,"max_tokens":{},"messages":[{{"role":"system","content":"{}"}},{{"role":"user","content":"what is a gateway?"}}]}}"#,
        args.tokens,
        "You are a helpful assistant. ".repeat(100)
    ));
    let frames = warmgate_benches::chat_stream_frames(args.tokens, true);
    let total: usize = frames.iter().map(Bytes::len).sum();
    let mut base = Histogram::<u64>::new(3).expect("histogram");
    let mut metered = Histogram::<u64>::new(3).expect("histogram");
    let mut sink = 0usize;
    for round in 0..args.rounds + args.rounds / 10 {
        let warm = round < args.rounds / 10;
        let t = Instant::now();
        sink += drain(body_of(frames.clone()));
        let b = t.elapsed().as_nanos() as u64;
        let t = Instant::now();
        let options = json_body::include_usage(None).expect("options");
        let asked =
            json_body::prepend(&request, &[("stream_options", options, true)]).expect("prepended");
        let meter = Meter {
            cell: ledger.cell(&key),
            charge: None,
        };
        let out = drain(Metered::new(body_of(frames.clone()), meter, true));
        let m = t.elapsed().as_nanos() as u64;
        sink += out + asked.len();
        assert!(out < total, "the usage chunk was taken out");
        if !warm {
            base.record(b.max(1)).expect("record");
            metered.record(m.max(1)).expect("record");
        }
    }
    let us = |h: &Histogram<u64>, q: f64| h.value_at_quantile(q) as f64 / 1000.0;
    println!(
        "streamed chat of {} tokens ({} frames, {} bytes), {} rounds:",
        args.tokens,
        frames.len(),
        total,
        args.rounds
    );
    println!("| path | p50 µs | p90 µs | p99 µs |");
    println!("|---|---:|---:|---:|");
    for (name, h) in [
        ("answer passed through", &base),
        ("counted (usage read, chunk taken out, ledger)", &metered),
    ] {
        println!(
            "| {name} | {:.2} | {:.2} | {:.2} |",
            us(h, 0.5),
            us(h, 0.9),
            us(h, 0.99)
        );
    }
    println!(
        "added by counting: p50 {:.2} µs, p90 {:.2} µs",
        us(&metered, 0.5) - us(&base, 0.5),
        us(&metered, 0.9) - us(&base, 0.9)
    );
    let _ = std::fs::remove_dir_all(&dir);
    std::hint::black_box(sink);
}
