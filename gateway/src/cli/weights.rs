//! `warmgate weights pull`: stream a checkpoint to a local folder, with
//! progress and the final throughput.

use std::path::PathBuf;

pub(super) fn weights_pull(
    uri: &str,
    dir: &std::path::Path,
    cfg: warmgate_pool::weights::StreamConfig,
    cache_dir: Option<PathBuf>,
) -> i32 {
    use warmgate_pool::weights::{Cache, Source, checksums, plan, pull};
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: {e}");
            return 1;
        }
    };
    let result = rt.block_on(async {
        let cwd = std::env::current_dir().unwrap_or_else(|_| PathBuf::from("."));
        let src = Source::open(uri, &cwd)?;
        let items = plan(&src).await?;
        let sums = checksums(&items, &cfg).await?;
        let total: u64 = items.iter().map(|i| i.meta.size).sum();
        let cache = cache_dir
            .map(|d| Cache::open(d, u64::MAX))
            .transpose()?;
        let bar = indicatif::ProgressBar::new(total);
        bar.set_style(
            indicatif::ProgressStyle::with_template(
                "{spinner} [{elapsed_precise}] {wide_bar} {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
            )
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        let start = std::time::Instant::now();
        let report = pull(&items, dir, &cfg, cache.as_ref(), &sums, &|n| bar.inc(n)).await;
        bar.finish_and_clear();
        report.map(|r| (r, start.elapsed()))
    });
    match result {
        Ok((r, took)) => {
            let secs = took.as_secs_f64().max(1e-9);
            println!(
                "pulled {} file{} ({}) from {uri} to {} in {:.2}s: {}/s ({} from the cache)",
                r.files,
                if r.files == 1 { "" } else { "s" },
                human_bytes(r.bytes),
                dir.display(),
                secs,
                human_bytes((r.bytes as f64 / secs) as u64),
                human_bytes(r.from_cache),
            );
            0
        }
        Err(e) => {
            eprintln!("error: {e}");
            1
        }
    }
}

fn human_bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut i = 0;
    while v >= 1024.0 && i + 1 < UNITS.len() {
        v /= 1024.0;
        i += 1;
    }
    if i == 0 {
        format!("{n} B")
    } else {
        format!("{v:.2} {}", UNITS[i])
    }
}
