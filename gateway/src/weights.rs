//! Serving a revision's checkpoint to its workers over local HTTP.
//!
//! Workers get `WARMGATE_WEIGHTS_URL=http://<gateway>/v1/weights/<target>/<revision>`
//! (the revision of an app, or `v<N>` for weights synced into a pool):
//! `GET` on it lists the checkpoint's files, and `GET <url>/<file>` streams
//! one. A file comes from the node-local cache when it is there; otherwise
//! one download from the store fills the cache, and every reader of that
//! file, however many replicas start at once, follows the same download as
//! it grows.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

use axum::body::Body;
use futures_util::StreamExt;
use parking_lot::Mutex;
use tokio::io::{AsyncReadExt, AsyncSeekExt};
use tokio::sync::watch;
use warmgate_pool::weights::{Cache, PullItem, Source, StreamConfig, checksums, plan};

use crate::error::{ApiError, ErrorKind};

/// Bytes read from disk per body chunk: large enough that the per-read
/// hop to tokio's blocking pool is amortised.
const CHUNK: usize = 4 * 1024 * 1024;

/// How far a download has got.
#[derive(Debug, Clone)]
enum Progress {
    /// Bytes written to `tmp` so far.
    Writing { tmp: PathBuf, written: u64 },
    /// Done: the cache entry.
    Done(PathBuf),
    /// Failed, with the reason.
    Failed(String),
}

/// A checkpoint's files and the checksums its `SHA256SUMS` gives.
pub struct Listing {
    /// The files.
    pub items: Vec<PullItem>,
    /// Expected SHA-256 by file name.
    pub sums: HashMap<String, String>,
}

/// Checkpoints of the apps' revisions and of the pools' weight versions,
/// their listings, and downloads in flight.
pub struct Weights {
    cache: Cache,
    cfg: StreamConfig,
    /// By `<target>/<revision>`.
    sources: Mutex<HashMap<String, Source>>,
    listings: Mutex<HashMap<String, Arc<Listing>>>,
    downloads: Mutex<HashMap<String, watch::Receiver<Progress>>>,
}

impl Weights {
    /// Weights with no checkpoints yet, cached in `cache`.
    pub fn new(cache: Cache, cfg: StreamConfig) -> Self {
        Weights {
            cache,
            cfg,
            sources: Mutex::new(HashMap::new()),
            listings: Mutex::new(HashMap::new()),
            downloads: Mutex::new(HashMap::new()),
        }
    }

    /// Serves `source` as the checkpoint of `target` at `revision`.
    pub fn register(&self, target: &str, revision: &str, source: Source) {
        let key = format!("{target}/{revision}");
        self.listings.lock().remove(&key);
        self.sources.lock().insert(key, source);
    }

    /// The URI of a registered checkpoint.
    pub fn uri(&self, target: &str, revision: &str) -> Option<String> {
        let key = format!("{target}/{revision}");
        self.sources.lock().get(&key).map(|s| s.uri().to_string())
    }

    /// The files of a revision's checkpoint (listed once; a revision's
    /// checkpoint does not change).
    pub async fn files(&self, target: &str, revision: &str) -> Result<Arc<Listing>, ApiError> {
        let key = format!("{target}/{revision}");
        if let Some(l) = self.listings.lock().get(&key) {
            return Ok(l.clone());
        }
        let src = self.sources.lock().get(&key).cloned().ok_or_else(|| {
            ApiError::new(
                ErrorKind::NotFound,
                format!("'{target}' has no checkpoint for revision '{revision}'"),
            )
        })?;
        let items = plan(&src).await.map_err(|e| weights_error(&e))?;
        let sums = checksums(&items, &self.cfg)
            .await
            .map_err(|e| weights_error(&e))?;
        let listing = Arc::new(Listing { items, sums });
        self.listings.lock().insert(key, listing.clone());
        Ok(listing)
    }

    /// One file of a revision's checkpoint, as a streamed body, and its size.
    pub async fn file(
        self: &Arc<Self>,
        target: &str,
        revision: &str,
        name: &str,
    ) -> Result<(Body, u64), ApiError> {
        let files = self.files(target, revision).await?;
        let expected = files.sums.get(name).cloned();
        let item = files
            .items
            .iter()
            .find(|i| i.relative.to_str() == Some(name))
            .ok_or_else(|| {
                ApiError::new(
                    ErrorKind::NotFound,
                    format!(
                        "the checkpoint of '{target}' revision '{revision}' has no file '{name}'"
                    ),
                )
            })?
            .clone();
        let size = item.meta.size;
        let key = Cache::key(item.source.uri(), &item.meta);
        if let Some(path) = self.cache.lookup(&key, size) {
            metrics::counter!("warmgate_weights_cache_bytes_total").increment(size);
            return Ok((follow(watch::channel(Progress::Done(path)).1, size), size));
        }
        let rx = self.download(key, item, expected).await?;
        Ok((follow(rx, size), size))
    }

    /// The download of `item`: the one in flight, or a new one.
    async fn download(
        self: &Arc<Self>,
        key: String,
        item: PullItem,
        sha256: Option<String>,
    ) -> Result<watch::Receiver<Progress>, ApiError> {
        if let Some(rx) = self.downloads.lock().get(&key) {
            return Ok(rx.clone());
        }
        let mut writer = self
            .cache
            .writer(&key)
            .await
            .map_err(|e| weights_error(&e))?;
        let (tx, rx) = watch::channel(Progress::Writing {
            tmp: writer.path().to_owned(),
            written: 0,
        });
        {
            let mut downloads = self.downloads.lock();
            if let Some(existing) = downloads.get(&key) {
                // Another reader started the same download meanwhile.
                return Ok(existing.clone());
            }
            downloads.insert(key.clone(), rx.clone());
        }
        let this = self.clone();
        let cfg = self.cfg.clone();
        tokio::spawn(async move {
            let size = item.meta.size;
            let tmp = writer.path().to_owned();
            let mut parts = item.source.parts(0..size, &cfg);
            let mut outcome = Ok(());
            while let Some(part) = parts.next().await {
                let part = match part {
                    Ok(p) => p,
                    Err(e) => {
                        outcome = Err(e.to_string());
                        break;
                    }
                };
                if let Err(e) = writer.write(&part).await {
                    outcome = Err(e.to_string());
                    break;
                }
                metrics::counter!("warmgate_weights_store_bytes_total")
                    .increment(part.len() as u64);
                let written = writer.written();
                let _ = tx.send(Progress::Writing {
                    tmp: tmp.clone(),
                    written,
                });
            }
            let done = match outcome {
                Ok(()) => match writer.commit(size, sha256.as_deref()).await {
                    Ok(path) => Progress::Done(path),
                    Err(e) => Progress::Failed(e.to_string()),
                },
                Err(e) => {
                    drop(writer);
                    Progress::Failed(e)
                }
            };
            if let Progress::Failed(e) = &done {
                tracing::warn!(uri = %item.source.uri(), error = %e, "checkpoint download failed");
            }
            let _ = tx.send(done);
            this.downloads.lock().remove(&key);
        });
        Ok(rx)
    }
}

/// A body that reads a file as a download writes it: from the temporary
/// file while it grows, from the cache entry once it is done.
fn follow(rx: watch::Receiver<Progress>, size: u64) -> Body {
    struct St {
        rx: watch::Receiver<Progress>,
        file: Option<tokio::fs::File>,
        offset: u64,
        size: u64,
    }
    let st = St {
        rx,
        file: None,
        offset: 0,
        size,
    };
    let stream = futures_util::stream::try_unfold(st, |mut st| async move {
        loop {
            if st.offset >= st.size {
                return Ok::<_, std::io::Error>(None);
            }
            let progress = st.rx.borrow_and_update().clone();
            let (path, available) = match &progress {
                Progress::Writing { tmp, written } => (tmp.clone(), *written),
                Progress::Done(path) => (path.clone(), st.size),
                Progress::Failed(e) => return Err(std::io::Error::other(e.clone())),
            };
            if st.offset < available {
                if st.file.is_none() {
                    // The temporary file may have been renamed a moment ago;
                    // the next progress then names the entry.
                    match tokio::fs::File::open(&path).await {
                        Ok(mut f) => {
                            f.seek(std::io::SeekFrom::Start(st.offset)).await?;
                            st.file = Some(f);
                        }
                        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                            if st.rx.changed().await.is_err() {
                                return Err(std::io::Error::other("the download stopped"));
                            }
                            continue;
                        }
                        Err(e) => return Err(e),
                    }
                }
                let want = ((available - st.offset) as usize).min(CHUNK);
                let mut buf = bytes::BytesMut::with_capacity(want);
                let file = st.file.as_mut().expect("opened above");
                let mut limited = file.take(want as u64);
                while buf.len() < want {
                    if limited.read_buf(&mut buf).await? == 0 {
                        return Err(std::io::ErrorKind::UnexpectedEof.into());
                    }
                }
                st.offset += want as u64;
                return Ok(Some((buf.freeze(), st)));
            }
            if st.rx.changed().await.is_err() {
                // The sender is gone: look at its last word once more.
                if matches!(&*st.rx.borrow(), Progress::Writing { .. }) {
                    return Err(std::io::Error::other("the download stopped"));
                }
            }
        }
    });
    Body::from_stream(stream)
}

fn weights_error(e: &warmgate_pool::Error) -> ApiError {
    let kind = match e {
        warmgate_pool::Error::Weights { reason, .. }
            if reason == "not found" || reason == "no objects under this prefix" =>
        {
            ErrorKind::NotFound
        }
        _ => ErrorKind::ReplicaFailed,
    };
    ApiError::new(kind, e.to_string())
}
