//! Open-loop HTTP load generator.
//!
//! Requests are released at a fixed rate, and each one's latency is
//! measured from the moment it was *released*, not from when a connection
//! was free to send it (as wrk2 does). A server that stalls therefore shows
//! its full queueing delay: no coordinated omission. The release time is
//! read after the timer fires, so the timer's millisecond granularity is not
//! counted against the server. Prints one JSON line with the percentiles.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use bytes::Bytes;
use clap::Parser;
use hdrhistogram::Histogram;
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1;
use hyper_util::rt::TokioIo;
use tokio::sync::{Mutex, mpsc};

#[derive(Parser, Debug)]
struct Args {
    /// Target URL (http only), e.g. http://127.0.0.1:8080/apps/echo/
    #[arg(long)]
    url: String,
    /// Requests per second.
    #[arg(long, default_value_t = 2000)]
    rate: u64,
    /// Seconds of measured load.
    #[arg(long, default_value_t = 10.0)]
    duration: f64,
    /// Seconds of unmeasured warm-up at the same rate.
    #[arg(long, default_value_t = 2.0)]
    warmup: f64,
    /// Keep-alive connections (requests beyond them wait, and that wait counts).
    #[arg(long, default_value_t = 64)]
    connections: usize,
    /// A label for the output.
    #[arg(long, default_value = "")]
    label: String,
    /// Send `POST`s with this JSON body instead of `GET`s.
    #[arg(long)]
    body: Option<String>,
    /// Extra request headers, `name: value` (repeatable).
    #[arg(long = "header")]
    headers: Vec<String>,
}

/// What every request carries.
#[derive(Clone)]
struct Shape {
    authority: hyper::http::uri::Authority,
    path: String,
    body: Option<Bytes>,
    headers: Vec<(String, String)>,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(run(args))
}

async fn run(args: Args) -> anyhow::Result<()> {
    let uri: hyper::Uri = args.url.parse().context("parse --url")?;
    let headers = args
        .headers
        .iter()
        .map(|h| {
            h.split_once(':')
                .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
                .with_context(|| format!("--header {h:?} is not `name: value`"))
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    let shape = Shape {
        authority: uri.authority().context("--url needs a host:port")?.clone(),
        path: uri.path_and_query().map_or("/", |p| p.as_str()).to_string(),
        body: args.body.clone().map(Bytes::from),
        headers,
    };
    let total = ((args.warmup + args.duration) * args.rate as f64) as u64;
    let warmup_n = (args.warmup * args.rate as f64) as u64;
    let (tx, rx) = mpsc::channel::<(u64, Instant)>(total.max(1) as usize);
    let rx = Arc::new(Mutex::new(rx));

    let mut workers = Vec::new();
    for _ in 0..args.connections {
        let rx = rx.clone();
        let shape = shape.clone();
        workers.push(tokio::spawn(async move {
            let mut hist = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3).expect("bounds");
            let mut errors = 0u64;
            let mut sender = None;
            loop {
                let Some((i, scheduled)) = rx.lock().await.recv().await else {
                    break;
                };
                if sender.is_none() {
                    sender = connect(shape.authority.as_str()).await.ok();
                }
                let ok = match sender.as_mut() {
                    Some(s) => send(s, &shape).await,
                    None => false,
                };
                if !ok {
                    errors += 1;
                    sender = None;
                    continue;
                }
                if i >= warmup_n {
                    let us = scheduled.elapsed().as_micros() as u64;
                    let _ = hist.record(us.max(1));
                }
            }
            (hist, errors)
        }));
    }

    let start = Instant::now() + Duration::from_millis(50);
    let period = Duration::from_secs_f64(1.0 / args.rate as f64);
    for i in 0..total {
        let at = start + period.mul_f64(i as f64);
        let now = Instant::now();
        if at > now {
            tokio::time::sleep(at - now).await;
        }
        if tx.send((i, Instant::now())).await.is_err() {
            break;
        }
    }
    drop(tx);
    let measured_start = start + period.mul_f64(warmup_n as f64);
    let mut hist = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3)?;
    let mut errors = 0;
    for w in workers {
        let (h, e) = w.await?;
        hist.add(h)?;
        errors += e;
    }
    let elapsed = measured_start.elapsed().as_secs_f64();
    let ms = |q: f64| hist.value_at_quantile(q) as f64 / 1000.0;
    println!(
        "{{\"label\":\"{}\",\"rate\":{},\"count\":{},\"errors\":{},\"achieved_rps\":{:.0},\"p50_ms\":{:.3},\"p90_ms\":{:.3},\"p99_ms\":{:.3},\"p999_ms\":{:.3},\"max_ms\":{:.3}}}",
        args.label,
        args.rate,
        hist.len(),
        errors,
        hist.len() as f64 / elapsed,
        ms(0.5),
        ms(0.9),
        ms(0.99),
        ms(0.999),
        hist.max() as f64 / 1000.0
    );
    Ok(())
}

async fn connect(authority: &str) -> anyhow::Result<http1::SendRequest<Full<Bytes>>> {
    let stream = tokio::net::TcpStream::connect(authority).await?;
    stream.set_nodelay(true)?;
    let (sender, conn) = http1::handshake(TokioIo::new(stream)).await?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    Ok(sender)
}

async fn send(sender: &mut http1::SendRequest<Full<Bytes>>, shape: &Shape) -> bool {
    if sender.ready().await.is_err() {
        return false;
    }
    let method = if shape.body.is_some() {
        hyper::Method::POST
    } else {
        hyper::Method::GET
    };
    let mut req = hyper::Request::builder()
        .method(method)
        .uri(shape.path.as_str())
        .header("host", shape.authority.as_str());
    if shape.body.is_some() {
        req = req.header("content-type", "application/json");
    }
    for (k, v) in &shape.headers {
        req = req.header(k.as_str(), v.as_str());
    }
    let req = match req.body(Full::new(shape.body.clone().unwrap_or_default())) {
        Ok(r) => r,
        Err(_) => return false,
    };
    match sender.send_request(req).await {
        Ok(resp) => {
            let ok = resp.status().is_success();
            ok && resp.into_body().collect().await.is_ok()
        }
        Err(_) => false,
    }
}
