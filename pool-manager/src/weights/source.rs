//! Reading objects with parallel ranged GETs.

use std::ops::Range;
use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use futures_util::stream::{self, BoxStream, StreamExt, TryStreamExt};
use object_store::path::Path;
use object_store::{GetOptions, GetResultPayload, ObjectMeta, ObjectStore, ObjectStoreExt};
use safetensors::Dtype;

use super::header::{self, Header, LEN_PREFIX, MAX_HEADER_BYTES};
use super::local_tree::{LocalTree, TreeStore};
use super::recycle::Recycler;
use crate::{Error, Result};

/// How an object is read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamConfig {
    /// Ranged GETs in flight at once. Object stores cap each connection's
    /// throughput, so parallel ranges are what make S3 fast.
    pub concurrency: usize,
    /// Bytes per ranged GET.
    pub part_size: u64,
    /// Bytes of parts held in memory at once; caps `concurrency` so that
    /// `concurrency × part_size` stays under it.
    pub memory_limit: u64,
}

impl Default for StreamConfig {
    fn default() -> Self {
        StreamConfig {
            // 16 × 8 MiB: past the per-connection cap of S3-like stores
            // (~100 MB/s each) without a flood of tiny requests.
            concurrency: 16,
            part_size: 8 * 1024 * 1024,
            // Four times the default in-flight bytes: room for the tensor
            // being assembled.
            memory_limit: 512 * 1024 * 1024,
        }
    }
}

impl StreamConfig {
    /// Parts held at once, downloading or waiting to be consumed: the
    /// memory limit in parts (at least one).
    pub fn window(&self) -> usize {
        ((self.memory_limit / self.part_size.max(1)) as usize).max(1)
    }

    /// Ranged GETs in flight, within the window (at least one).
    pub fn effective_concurrency(&self) -> usize {
        self.concurrency.min(self.window()).max(1)
    }
}

/// One tensor, complete.
#[derive(Debug, Clone)]
pub struct Tensor {
    /// Its name.
    pub name: String,
    /// Element type.
    pub dtype: Dtype,
    /// Shape.
    pub shape: Vec<usize>,
    /// Its bytes, little-endian as in the file.
    pub data: Bytes,
}

/// An object (or a prefix of objects) in a store.
#[derive(Debug, Clone)]
pub struct Source {
    store: Arc<dyn ObjectStore>,
    path: Path,
    uri: String,
    /// The checkpoint on this machine, held open, for a `file://` source.
    tree: Option<Arc<LocalTree>>,
}

/// A checkpoint URI as the store will see it: a relative `file://` path
/// resolved against `base`, then parsed, which removes `.` and `..`
/// segments (percent-encoded ones too).
pub fn resolve(uri: &str, base: &std::path::Path) -> Result<url::Url> {
    let resolved = match uri.strip_prefix("file://") {
        Some(rest) if !rest.starts_with('/') => {
            let base = std::path::absolute(base).unwrap_or_else(|_| base.to_path_buf());
            let abs = base.join(rest.trim_start_matches("./"));
            format!("file://{}", abs.display())
        }
        _ => uri.to_string(),
    };
    url::Url::parse(&resolved).map_err(|e| Error::Weights {
        uri: uri.to_string(),
        reason: format!("not a valid URI: {e}"),
    })
}

impl Source {
    /// Opens a URI with object_store's own builders; credentials and
    /// endpoints come from the environment (`AWS_*`, `GOOGLE_*`, `AZURE_*`).
    /// A relative `file://` path is resolved against `base`.
    pub fn open(uri: &str, base: &std::path::Path) -> Result<Source> {
        Source::open_within(uri, base, None)
    }

    /// Opens a URI that [`AllowList::check`](super::AllowList::check)
    /// passed: a `file://` checkpoint's root is opened now (or at first
    /// read when it does not exist yet) and must then really lie under
    /// `limit`, the allowed prefix's path; every file is then read from
    /// that open root ([`LocalTree`]).
    pub fn open_within(
        uri: &str,
        base: &std::path::Path,
        limit: Option<std::path::PathBuf>,
    ) -> Result<Source> {
        let bad = |reason: String| Error::Weights {
            uri: uri.to_string(),
            reason,
        };
        let url = resolve(uri, base)?;
        if url.scheme() == "file" {
            // A missing checkpoint is reported on first read.
            let path = url
                .to_file_path()
                .map_err(|_| bad("not a valid local path".into()))?;
            let location = Path::parse(path.to_string_lossy().trim_start_matches('/'))
                .map_err(|e| bad(e.to_string()))?;
            let tree = Arc::new(LocalTree::new(uri, path, limit));
            let mut src = Source::new(Arc::new(TreeStore(tree.clone())), location, uri);
            src.tree = Some(tree);
            return Ok(src);
        }
        let mut options: Vec<(String, String)> = std::env::vars()
            .map(|(k, v)| (k.to_ascii_lowercase(), v))
            .collect();
        if url.scheme() == "http" {
            // A plain-HTTP checkpoint URI says so itself.
            options.push(("allow_http".into(), "true".into()));
        }
        let env = options;
        let (store, path) =
            object_store::parse_url_opts(&url, env).map_err(|e| bad(e.to_string()))?;
        Ok(Source::new(Arc::from(store), path, uri))
    }

    /// A source over an existing store (tests, `memory://`).
    pub fn new(store: Arc<dyn ObjectStore>, path: Path, uri: impl Into<String>) -> Source {
        Source {
            store,
            path,
            uri: uri.into(),
            tree: None,
        }
    }

    /// Where the object is on this machine's file system, for a file of a
    /// `file://` checkpoint whose name still leads to the file that was
    /// listed there.
    pub fn local_path(&self) -> Option<std::path::PathBuf> {
        self.tree.as_ref()?.verified_path(&self.path)
    }

    /// Whether it is a checkpoint on this machine (`file://`).
    pub fn is_local(&self) -> bool {
        self.tree.is_some()
    }

    /// The URI, for messages.
    pub fn uri(&self) -> &str {
        &self.uri
    }

    /// The path inside the store.
    pub fn path_str(&self) -> &str {
        self.path.as_ref()
    }

    /// The object at `location` in the same store.
    pub fn child(&self, location: &Path) -> Source {
        let rel = location.as_ref();
        let base = self.path.as_ref();
        let suffix = rel
            .strip_prefix(base)
            .unwrap_or(rel)
            .trim_start_matches('/');
        let uri = if suffix.is_empty() {
            self.uri.clone()
        } else {
            format!("{}/{}", self.uri.trim_end_matches('/'), suffix)
        };
        Source {
            store: self.store.clone(),
            path: location.clone(),
            uri,
            tree: self.tree.clone(),
        }
    }

    /// The object's size, ETag and version.
    pub async fn head(&self) -> Result<ObjectMeta> {
        self.store
            .head(&self.path)
            .await
            .map_err(|e| store_error(&self.uri, e))
    }

    /// Every object under this prefix, sorted by path.
    pub async fn list(&self) -> Result<Vec<ObjectMeta>> {
        let mut objects: Vec<ObjectMeta> = self
            .store
            .list(Some(&self.path))
            .try_collect()
            .await
            .map_err(|e| store_error(&self.uri, e))?;
        objects.sort_by(|a, b| a.location.cmp(&b.location));
        if objects.is_empty() {
            return Err(Error::Weights {
                uri: self.uri.clone(),
                reason: "no objects under this prefix".into(),
            });
        }
        Ok(objects)
    }

    /// The bytes of `range`, as parts in order. Each ranged GET runs as a
    /// task of its own, so downloads go on while the consumer is busy; at
    /// most [`StreamConfig::effective_concurrency`] are in flight, and at
    /// most [`StreamConfig::window`] parts are held, so a slow part holds
    /// back delivery but not the downloads behind it, within the memory
    /// limit. Dropping the stream cancels what is still running.
    pub fn parts(
        &self,
        range: Range<u64>,
        cfg: &StreamConfig,
    ) -> BoxStream<'static, Result<Bytes>> {
        let part = cfg.part_size.max(1);
        let end = range.end;
        let store = self.store.clone();
        let path = self.path.clone();
        let uri = self.uri.clone();
        let permits = Arc::new(tokio::sync::Semaphore::new(cfg.effective_concurrency()));
        // As many buffers as the window holds: a part's buffer is filled
        // again once its readers are done with it.
        let recycler = Arc::new(Recycler::new(cfg.window()));
        stream::iter((range.start..range.end).step_by(part as usize))
            .map(move |s| {
                let e = (s + part).min(end);
                let (store, path) = (store.clone(), path.clone());
                let (uri, task_uri) = (uri.clone(), uri.clone());
                let (permits, recycler) = (permits.clone(), recycler.clone());
                let task = AbortOnDrop(tokio::spawn(async move {
                    let _permit = permits.acquire_owned().await.ok();
                    read_part(store.as_ref(), &path, &task_uri, s..e, &recycler).await
                }));
                async move {
                    let mut task = task;
                    match (&mut task.0).await {
                        Ok(r) => r,
                        Err(e) => Err(Error::Weights {
                            uri,
                            reason: format!("the download task failed: {e}"),
                        }),
                    }
                }
            })
            .buffered(cfg.window())
            .boxed()
    }

    /// Reads and checks the safetensors header of an object of `size` bytes.
    pub async fn header(&self, size: u64) -> Result<Header> {
        let bad = |reason: String| Error::Weights {
            uri: self.uri.clone(),
            reason,
        };
        if size < LEN_PREFIX {
            return Err(bad(format!(
                "the object is {size} bytes, too short for a safetensors header"
            )));
        }
        let prefix = self.range(0..LEN_PREFIX).await?;
        let n = header::json_len(&prefix, size, MAX_HEADER_BYTES).map_err(bad)?;
        let json = self.range(LEN_PREFIX..LEN_PREFIX + n).await?;
        header::parse(&json, size).map_err(bad)
    }

    async fn range(&self, range: Range<u64>) -> Result<Bytes> {
        let want = range.end - range.start;
        let b = self
            .store
            .get_range(&self.path, range)
            .await
            .map_err(|e| store_error(&self.uri, e))?;
        if b.len() as u64 != want {
            return Err(Error::Weights {
                uri: self.uri.clone(),
                reason: "the object is shorter than its size says".into(),
            });
        }
        Ok(b)
    }

    /// Each tensor, in file order, as soon as its bytes are complete.
    ///
    /// Parts are planned within tensors, and each part's response body is
    /// copied straight into its slice of the tensor's final buffer, so every
    /// byte is copied once on its way from the socket to the consumer.
    pub fn tensors(
        &self,
        header: Header,
        cfg: &StreamConfig,
    ) -> BoxStream<'static, Result<Tensor>> {
        let part = cfg.part_size.max(1);
        let permits = Arc::new(tokio::sync::Semaphore::new(cfg.effective_concurrency()));
        let (store, path, uri) = (self.store.clone(), self.path.clone(), self.uri.clone());
        let entries = Arc::new(header.tensors);
        // Jobs are made lazily, tensor by tensor, as the window pulls them,
        // so a tensor's buffer is allocated only when its first part starts.
        let plan = entries.clone();
        let jobs = (0..plan.len()).flat_map(move |ti| {
            let t = &plan[ti];
            // Zeroed pages from the allocator cost no extra pass.
            let mut buf = BytesMut::zeroed((t.end - t.start) as usize);
            let mut jobs = Vec::new();
            let mut s = t.start;
            loop {
                let e = (s + part).min(t.end);
                let slice = buf.split_to((e - s) as usize);
                jobs.push(PartJob {
                    tensor: ti,
                    range: s..e,
                    slice,
                    last: e == t.end,
                });
                if e == t.end {
                    break;
                }
                s = e;
            }
            jobs
        });
        let parts = stream::iter(jobs)
            .map(move |job| {
                let (store, path, uri) = (store.clone(), path.clone(), uri.clone());
                let permits = permits.clone();
                let err_uri = uri.clone();
                let task = AbortOnDrop(tokio::spawn(async move {
                    let _permit = permits.acquire_owned().await.ok();
                    fill(store.as_ref(), &path, &uri, job).await
                }));
                async move {
                    let mut task = task;
                    match (&mut task.0).await {
                        Ok(r) => r,
                        Err(e) => Err(Error::Weights {
                            uri: err_uri,
                            reason: format!("the download task failed: {e}"),
                        }),
                    }
                }
            })
            .buffered(cfg.window());
        stream::try_unfold(
            (parts.boxed(), None::<BytesMut>, entries),
            |(mut parts, mut acc, entries)| async move {
                while let Some(job) = parts.next().await {
                    let job = job?;
                    match acc.as_mut() {
                        Some(a) => a.unsplit(job.slice),
                        None => acc = Some(job.slice),
                    }
                    if job.last {
                        let t = &entries[job.tensor];
                        let tensor = Tensor {
                            name: t.name.clone(),
                            dtype: t.dtype,
                            shape: t.shape.clone(),
                            data: acc.take().map(BytesMut::freeze).unwrap_or_default(),
                        };
                        return Ok(Some((tensor, (parts, acc, entries))));
                    }
                }
                Ok(None)
            },
        )
        .boxed()
    }
}

/// One ranged GET into its slice of a tensor's buffer.
struct PartJob {
    tensor: usize,
    range: Range<u64>,
    slice: BytesMut,
    last: bool,
}

/// Streams one range into the job's slice; checks it got exactly the bytes
/// it asked for.
async fn fill(
    store: &dyn ObjectStore,
    path: &Path,
    uri: &str,
    mut job: PartJob,
) -> Result<PartJob> {
    if job.range.is_empty() {
        return Ok(job);
    }
    let (s, e) = (job.range.start, job.range.end);
    let short = |got: u64| Error::Weights {
        uri: uri.to_string(),
        reason: format!(
            "asked for bytes {s}..{e} and got {got} bytes (object changed or truncated)"
        ),
    };
    let result = store
        .get_opts(path, GetOptions::new().with_range(Some(s..e)))
        .await
        .map_err(|err| store_error(uri, err))?;
    let mut body = result.into_stream();
    let mut filled = 0usize;
    while let Some(chunk) = body.next().await {
        let chunk = chunk.map_err(|err| store_error(uri, err))?;
        let end = filled + chunk.len();
        let Some(dst) = job.slice.get_mut(filled..end) else {
            return Err(short(end as u64));
        };
        dst.copy_from_slice(&chunk);
        filled = end;
    }
    if filled != job.slice.len() {
        return Err(short(filled as u64));
    }
    Ok(job)
}

/// One ranged GET of `range`, whole, into a buffer from `recycler`: a
/// streamed body is copied into it, a local file read into it.
/// Fails unless it got exactly the bytes it asked for, and stops reading
/// at the first byte past them.
async fn read_part(
    store: &dyn ObjectStore,
    path: &Path,
    uri: &str,
    range: Range<u64>,
    recycler: &Recycler,
) -> Result<Bytes> {
    let (s, e) = (range.start, range.end);
    let want = (e - s) as usize;
    let short = |got: usize| Error::Weights {
        uri: uri.to_string(),
        reason: format!(
            "asked for bytes {s}..{e} and got {got} bytes (object changed or truncated)"
        ),
    };
    let result = store
        .get_opts(path, GetOptions::new().with_range(Some(s..e)))
        .await
        .map_err(|err| store_error(uri, err))?;
    let bytes = match result.payload {
        GetResultPayload::Stream(mut body) => {
            let mut buf = recycler.take(want);
            buf.clear();
            while let Some(chunk) = body.next().await {
                let chunk = chunk.map_err(|err| store_error(uri, err))?;
                if buf.len() + chunk.len() > want {
                    return Err(short(buf.len() + chunk.len()));
                }
                buf.extend_from_slice(&chunk);
            }
            recycler.seal(buf)
        }
        GetResultPayload::File(file, _) => {
            // One positioned read straight into a kept buffer (object_store
            // would read into a new one each time).
            let mut buf = recycler.take(want);
            let read = tokio::task::spawn_blocking(move || {
                use std::os::unix::fs::FileExt as _;
                buf.resize(want, 0);
                file.read_exact_at(&mut buf, s).map(|()| buf)
            })
            .await;
            match read {
                Ok(Ok(buf)) => recycler.seal(buf),
                Ok(Err(err)) if err.kind() == std::io::ErrorKind::UnexpectedEof => {
                    return Err(Error::Weights {
                        uri: uri.to_string(),
                        reason: format!(
                            "asked for bytes {s}..{e} and the file ended first (object changed or truncated)"
                        ),
                    });
                }
                Ok(Err(err)) => {
                    return Err(Error::Weights {
                        uri: uri.to_string(),
                        reason: format!("reading bytes {s}..{e}: {err}"),
                    });
                }
                Err(err) => {
                    return Err(Error::Weights {
                        uri: uri.to_string(),
                        reason: format!("the read task failed: {err}"),
                    });
                }
            }
        }
    };
    if bytes.len() != want {
        return Err(short(bytes.len()));
    }
    Ok(bytes)
}

/// A task that is aborted when its handle is dropped.
struct AbortOnDrop<T>(tokio::task::JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// An object-store error as a message that names the URI and the problem.
pub(crate) fn store_error(uri: &str, e: object_store::Error) -> Error {
    use object_store::Error as E;
    let text = e.to_string();
    // S3-style error bodies carry a short code (`InvalidAccessKeyId`).
    let code = text
        .split_once("<Code>")
        .and_then(|(_, rest)| rest.split_once("</Code>"))
        .map(|(c, _)| c.to_string());
    let refused = matches!(e, E::PermissionDenied { .. } | E::Unauthenticated { .. })
        || text.contains("403 Forbidden")
        || text.contains("401 Unauthorized");
    let reason = match &e {
        E::NotFound { .. } => "not found".to_string(),
        _ if refused => match code {
            Some(c) => format!("credentials refused ({c})"),
            None => "credentials refused".to_string(),
        },
        _ => text,
    };
    Error::Weights {
        uri: uri.to_string(),
        reason,
    }
}
