//! Weight streaming throughput: the streamer against one sequential GET and
//! against raw parallel ranged reads of the same object, from the same
//! server, in one run. `benches/weights.sh` starts nginx with a
//! per-connection rate limit in front of a synthetic checkpoint.
//!
//! `weights-bench gen --out FILE --size-mib N` writes the checkpoint;
//! `weights-bench run --url URL` measures and prints a markdown table.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use anyhow::Context as _;
use bytes::Bytes;
use clap::{Parser, Subcommand};
use futures_util::StreamExt;
use http_body_util::{BodyExt, Empty};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use object_store::ObjectStoreExt;
use object_store::http::{HttpBuilder, HttpStore};
use object_store::path::Path;
use warmgate_pool::weights::{Source, StreamConfig};

#[derive(Parser)]
struct Args {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Write a synthetic safetensors checkpoint of 64 MiB tensors.
    Gen {
        #[arg(long)]
        out: std::path::PathBuf,
        #[arg(long, default_value_t = 2048)]
        size_mib: u64,
    },
    /// Measure reads of `--url` (a file served over HTTP with Range support).
    Run {
        #[arg(long)]
        url: String,
        #[arg(long, value_delimiter = ',', default_value = "1,4,8,16,32")]
        concurrency: Vec<usize>,
        #[arg(long, value_delimiter = ',', default_value = "2,8,16")]
        part_mib: Vec<u64>,
        /// A warmgate weights URL for the same file, read twice (cold, then
        /// from the cache).
        #[arg(long)]
        gateway_url: Option<String>,
        /// The cache folder; its largest file is read directly for the
        /// disk baseline.
        #[arg(long)]
        cache_dir: Option<std::path::PathBuf>,
    },
    /// Stream `--url` (a gateway weights file) tensor by tensor as the
    /// embedder does, keeping every tensor, and print one JSON line: time
    /// and bytes at the first tensor, and the total.
    Stream {
        #[arg(long)]
        url: String,
    },
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    match args.cmd {
        Cmd::Gen { out, size_mib } => gen_checkpoint(&out, size_mib),
        Cmd::Run {
            url,
            concurrency,
            part_mib,
            gateway_url,
            cache_dir,
        } => rt.block_on(run(url, concurrency, part_mib, gateway_url, cache_dir)),
        Cmd::Stream { url } => rt.block_on(stream_tensors(&url)),
    }
}

/// The embedder's loader (`Fetcher::stream_safetensors`) on one file.
async fn stream_tensors(url: &str) -> anyhow::Result<()> {
    let mut held = Vec::new();
    let report = warmgate_examples::Fetcher::default()
        .stream_safetensors(url, |t| {
            held.push(t.data);
            Ok(())
        })
        .await?;
    println!(
        "{}",
        serde_json::json!({
            "tensors": report.tensors,
            "bytes": report.bytes,
            "first_tensor_s": report.first_tensor.map(|d| d.as_secs_f64()),
            "first_tensor_bytes": report.first_tensor_bytes,
            "seconds": report.total.as_secs_f64(),
            "held": held.iter().map(Vec::len).sum::<usize>(),
        })
    );
    Ok(())
}

fn gen_checkpoint(out: &std::path::Path, size_mib: u64) -> anyhow::Result<()> {
    use std::io::Write;
    const TENSOR: u64 = 64 << 20;
    let n = (size_mib << 20).div_ceil(TENSOR);
    let mut entries = Vec::new();
    for i in 0..n {
        entries.push(format!(
            "\"layers.{i}.weight\":{{\"dtype\":\"F32\",\"shape\":[{},1024],\"data_offsets\":[{},{}]}}",
            TENSOR / 4096,
            i * TENSOR,
            (i + 1) * TENSOR
        ));
    }
    let json = format!("{{{}}}", entries.join(","));
    let mut f = std::io::BufWriter::new(std::fs::File::create(out)?);
    f.write_all(&(json.len() as u64).to_le_bytes())?;
    f.write_all(json.as_bytes())?;
    let block: Vec<u8> = (0..(1 << 20)).map(|i| (i * 7 % 251) as u8).collect();
    for _ in 0..n * (TENSOR >> 20) {
        f.write_all(&block)?;
    }
    f.flush()?;
    Ok(())
}

/// CPU seconds (user + system) of this process so far.
fn cpu_seconds() -> f64 {
    use nix::sys::resource::{UsageWho, getrusage};
    getrusage(UsageWho::RUSAGE_SELF)
        .map(|u| {
            let t = |tv: nix::sys::time::TimeVal| tv.tv_sec() as f64 + tv.tv_usec() as f64 / 1e6;
            t(u.user_time()) + t(u.system_time())
        })
        .unwrap_or(0.0)
}

struct Row {
    what: String,
    gbps: f64,
    cpu_per_gb: f64,
}

async fn measure<F, Fut>(what: String, f: F) -> anyhow::Result<Row>
where
    F: FnOnce() -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<u64>>,
{
    let (t, c) = (Instant::now(), cpu_seconds());
    let bytes = f().await?;
    let secs = t.elapsed().as_secs_f64();
    let cpu = cpu_seconds() - c;
    let gb = bytes as f64 / 1e9;
    let row = Row {
        what,
        gbps: gb / secs,
        cpu_per_gb: cpu / gb,
    };
    eprintln!(
        "{}: {:.3} GB/s, {:.2} CPU-s/GB",
        row.what, row.gbps, row.cpu_per_gb
    );
    Ok(row)
}

async fn http_get_all(url: &str) -> anyhow::Result<u64> {
    let client: Client<_, Empty<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
    // `/v1/weights` needs a credential: the gateway's admin token, which the
    // bench script sets for both.
    let mut req = hyper::Request::get(url).body(Empty::<Bytes>::new())?;
    if let Ok(token) = std::env::var("WARMGATE_ADMIN_TOKEN") {
        req.headers_mut().insert(
            hyper::header::AUTHORIZATION,
            format!("Bearer {token}").parse()?,
        );
    }
    let resp = client.request(req).await.context("GET")?;
    anyhow::ensure!(resp.status().is_success(), "GET {url}: {}", resp.status());
    let mut body = resp.into_body();
    let mut n = 0u64;
    while let Some(frame) = body.frame().await {
        if let Ok(data) = frame?.into_data() {
            n += data.len() as u64;
        }
    }
    Ok(n)
}

async fn run(
    url: String,
    concurrency: Vec<usize>,
    part_mib: Vec<u64>,
    gateway_url: Option<String>,
    cache_dir: Option<std::path::PathBuf>,
) -> anyhow::Result<()> {
    let (base, name) = url.rsplit_once('/').context("URL has no file name")?;
    let store = Arc::new(
        HttpBuilder::new()
            .with_url(base)
            .with_client_options(object_store::ClientOptions::new().with_allow_http(true))
            .build()?,
    );
    let path = Path::from(name);
    let size = store.head(&path).await?.size;
    let src = Source::new(store.clone(), path.clone(), url.clone());
    let mut rows = Vec::new();

    rows.push(measure("one sequential GET".into(), || http_get_all(&url)).await?);
    let raw_by_conc = raw_ranges(&store, &path, size, &concurrency, &mut rows).await?;
    let (best, ratios) =
        streamer(&src, size, &concurrency, &part_mib, &raw_by_conc, &mut rows).await?;
    if let Some(g) = &gateway_url {
        rows.push(
            measure(
                "warmgate /v1/weights, cold (store -> cache -> client)".into(),
                || http_get_all(g),
            )
            .await?,
        );
        rows.push(
            measure(
                "warmgate /v1/weights, warm (cache -> client)".into(),
                || http_get_all(g),
            )
            .await?,
        );
    }
    disk_baselines(cache_dir, size, &mut rows).await?;
    print_table(&rows, size, best, ratios);
    Ok(())
}

/// Raw parallel ranged reads of 8 MiB parts at each concurrency, pushed
/// to `rows`; the GB/s of each concurrency.
async fn raw_ranges(
    store: &Arc<HttpStore>,
    path: &Path,
    size: u64,
    concurrency: &[usize],
    rows: &mut Vec<Row>,
) -> anyhow::Result<HashMap<usize, f64>> {
    let mut raw_by_conc = HashMap::new();
    for &c in concurrency {
        let (store, path) = (store.clone(), path.clone());
        let part = 8u64 << 20;
        let row = measure(format!("raw ranges c={c} part=8MiB"), || async move {
            let starts: Vec<u64> = (0..size).step_by(part as usize).collect();
            let mut n = 0u64;
            let mut s = futures_util::stream::iter(starts)
                .map(|s| {
                    let (store, path) = (store.clone(), path.clone());
                    async move { store.get_range(&path, s..(s + part).min(size)).await }
                })
                .buffer_unordered(c);
            while let Some(b) = s.next().await {
                n += b?.len() as u64;
            }
            Ok(n)
        })
        .await?;
        raw_by_conc.insert(c, row.gbps);
        rows.push(row);
    }
    Ok(raw_by_conc)
}

/// The streamer at each concurrency and part size, pushed to `rows`;
/// the best GB/s, and at 8 MiB parts the ratio to the raw ranges at the
/// same concurrency.
async fn streamer(
    src: &Source,
    size: u64,
    concurrency: &[usize],
    part_mib: &[u64],
    raw_by_conc: &HashMap<usize, f64>,
    rows: &mut Vec<Row>,
) -> anyhow::Result<(f64, Vec<(usize, f64)>)> {
    let mut best = 0.0f64;
    let mut ratios = Vec::new();
    for &c in concurrency {
        for &p in part_mib {
            let cfg = StreamConfig {
                concurrency: c,
                part_size: p << 20,
                memory_limit: 4 << 30,
            };
            let src = src.clone();
            let row = measure(format!("streamer c={c} part={p}MiB"), || async move {
                let header = src.header(size).await?;
                let mut tensors = src.tensors(header, &cfg);
                let mut n = 0u64;
                while let Some(t) = tensors.next().await {
                    n += t?.data.len() as u64;
                }
                Ok(n)
            })
            .await?;
            if p == 8 {
                ratios.push((c, row.gbps / raw_by_conc[&c]));
            }
            best = best.max(row.gbps);
            rows.push(row);
        }
    }
    Ok((best, ratios))
}

/// The disk baselines, pushed to `rows`, when a cache folder is given:
/// writing a new file of the object's size next to the cache's largest
/// file, then reading that file.
async fn disk_baselines(
    cache_dir: Option<std::path::PathBuf>,
    size: u64,
    rows: &mut Vec<Row>,
) -> anyhow::Result<()> {
    let largest = cache_dir.and_then(|d| {
        std::fs::read_dir(d)
            .ok()?
            .flatten()
            .filter_map(|e| Some((e.metadata().ok()?.len(), e.path())))
            .max()
            .map(|(_, p)| p)
    });
    if let Some(f) = &largest {
        // Writing a new file of the object's size: what filling the cache
        // costs at best on this disk.
        let target = f.with_extension("write-baseline");
        rows.push(
            measure(
                "disk write of a new file (baseline)".into(),
                || async move {
                    tokio::task::spawn_blocking(move || -> anyhow::Result<u64> {
                        use std::io::Write;
                        let block = vec![7u8; 8 << 20];
                        let mut file = std::fs::File::create(&target)?;
                        let mut n = 0u64;
                        while n < size {
                            let k = ((size - n) as usize).min(block.len());
                            file.write_all(&block[..k])?;
                            n += k as u64;
                        }
                        drop(file);
                        std::fs::remove_file(&target)?;
                        Ok(n)
                    })
                    .await?
                },
            )
            .await?,
        );
    }
    // The cache may have replaced or evicted the file meanwhile.
    if let Some(f) = largest.filter(|f| f.exists()) {
        rows.push(
            measure(
                "disk read of the cache file (baseline)".into(),
                || async move {
                    tokio::task::spawn_blocking(move || -> anyhow::Result<u64> {
                        use std::io::Read;
                        let mut file = std::fs::File::open(&f)?;
                        let mut buf = vec![0u8; 1 << 20];
                        let mut n = 0u64;
                        loop {
                            let k = file.read(&mut buf)?;
                            if k == 0 {
                                return Ok(n);
                            }
                            n += k as u64;
                        }
                    })
                    .await?
                },
            )
            .await?,
        );
    }
    Ok(())
}

/// Prints the markdown table of `rows` and the ratios against the goals.
fn print_table(rows: &[Row], size: u64, best: f64, ratios: Vec<(usize, f64)>) {
    println!("| read | GB/s | CPU-s per GB |");
    println!("|---|---:|---:|");
    for r in rows {
        println!("| {} | {:.3} | {:.2} |", r.what, r.gbps, r.cpu_per_gb);
    }
    println!();
    let seq = rows[0].gbps;
    println!(
        "object: {:.2} GB; best streamer / sequential GET: **{:.1}x** (goal >= 3x)",
        size as f64 / 1e9,
        best / seq
    );
    for (c, r) in ratios {
        println!(
            "- streamer / raw ranges at c={c}, 8 MiB parts: {:.2} (goal >= 0.90)",
            r
        );
    }
}
