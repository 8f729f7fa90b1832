//! Serving a revision's checkpoint to its workers over local HTTP.
//!
//! Workers get `WARMGATE_WEIGHTS_URL=http://<gateway>/v1/weights/<target>/<revision>`
//! (the revision of an app, or `v<N>` for weights synced into a pool):
//! `GET` on it lists the checkpoint's files, and `GET <url>/<file>` streams
//! one. A file comes from the node-local cache when it is there; otherwise
//! one download from the store feeds every reader of that file, however
//! many replicas start at once, from memory as its parts arrive, and fills
//! the cache beside them ([`warmgate_pool::weights::fanout`]).
//!
//! Only checkpoint URIs under the allowed prefixes are opened
//! ([`Weights::open`]). Reading needs a credential: the admin token, or
//! the token each worker finds in `WARMGATE_WEIGHTS_TOKEN`, its replica's
//! own, which is bound to its target ([`Grant`]), revoked when the replica
//! ends, and revoked too when the target's
//! registration goes. Every body that has a `SHA256SUMS` digest is hashed
//! as it is sent, and its last chunk is held back until the digest
//! matches: a mismatch ends the body with an error, never a clean end.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

use axum::body::Body;
use futures_util::StreamExt;
use parking_lot::Mutex;
use sha2::{Digest, Sha256};
use warmgate_pool::weights::fanout::{Next, Reader, State};
use warmgate_pool::weights::{
    AllowList, Cache, CacheWriter, Fanout, PullItem, Recycler, Source, StreamConfig, checksums,
    plan,
};

use crate::error::{Error, ErrorKind};

/// Bytes read from disk per body chunk: large enough that the per-read
/// hop to tokio's blocking pool is amortised.
const CHUNK: usize = 4 * 1024 * 1024;

/// A checkpoint's files and the checksums its `SHA256SUMS` gives.
pub struct Listing {
    /// The files.
    pub items: Vec<PullItem>,
    /// Expected SHA-256 by file name.
    pub sums: HashMap<String, String>,
}

/// The checkpoint URI prefixes the gateway may open: `[weights]
/// allowed_prefixes` when set, else every checkpoint the config names
/// (apps', their adapters' and pools') and the prefixes watched for new
/// checkpoints (the apps' `promotion.watch` and their adapters' `watch`).
pub fn allowed_prefixes(config: &warmgate_deploy::Config) -> Vec<String> {
    if let Some(list) = &config.weights.allowed_prefixes {
        return list.clone();
    }
    let apps = config.apps.iter().flat_map(|a| {
        let adapters = a
            .adapters
            .models
            .iter()
            .flat_map(|m| std::iter::once(&m.checkpoint).chain(m.watch.iter()));
        a.checkpoint
            .iter()
            .chain(a.promotion.watch.iter())
            .chain(adapters)
            .cloned()
    });
    let pools = config.pools.iter().filter_map(|p| p.checkpoint.clone());
    apps.chain(pools).collect()
}

/// What a worker's weights token lets it read.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Grant {
    /// The checkpoint of one revision of an app.
    Revision {
        /// The app.
        target: String,
        /// The revision id.
        revision: String,
    },
    /// Every weights version of a pool (its replicas swap versions in
    /// place with the token they started with).
    Pool {
        /// The pool.
        target: String,
    },
}

/// A registration: the checkpoint of `target` at `revision`.
type Key = (String, String);

/// Checkpoints of the apps' revisions and of the pools' weight versions,
/// their listings, downloads in flight, and the workers' tokens.
pub struct Weights {
    cache: Cache,
    cfg: StreamConfig,
    allowed: AllowList,
    /// Relative `file://` URIs resolve against it.
    base: PathBuf,
    sources: Mutex<HashMap<Key, Source>>,
    listings: Mutex<HashMap<Key, Arc<Listing>>>,
    /// Downloads in flight, by cache key.
    downloads: Mutex<HashMap<String, Arc<Fanout>>>,
    /// Live weights tokens by replica id: each replica's own, with what it
    /// may read.
    tokens: Mutex<HashMap<String, (Grant, String)>>,
}

// === impl Grant ===

impl Grant {
    /// Whether it covers the checkpoint of `target` at `revision`.
    fn covers(&self, t: &str, r: &str) -> bool {
        match self {
            Grant::Revision { target, revision } => target == t && revision == r,
            Grant::Pool { target } => target == t,
        }
    }
}

// === impl Weights ===

impl Weights {
    /// Weights with no checkpoints yet, cached in `cache`, opening only
    /// URIs under `allowed` (relative ones against `base`).
    pub fn new(cache: Cache, cfg: StreamConfig, allowed: AllowList, base: PathBuf) -> Self {
        Weights {
            cache,
            cfg,
            allowed,
            base,
            sources: Mutex::new(HashMap::new()),
            listings: Mutex::new(HashMap::new()),
            downloads: Mutex::new(HashMap::new()),
            tokens: Mutex::new(HashMap::new()),
        }
    }

    /// Opens a checkpoint URI, after checking it against the allowed
    /// prefixes: one outside them is refused (400) before anything is
    /// opened or fetched.
    pub fn open(&self, uri: &str) -> Result<Source, Error> {
        let bad =
            |e: warmgate_pool::Error| Error::new(ErrorKind::BadRequest, format!("checkpoint: {e}"));
        let limit = self.allowed.check(uri, &self.base).map_err(bad)?;
        Source::open_within(uri, &self.base, limit).map_err(bad)
    }

    /// Serves `source` as the checkpoint of `target` at `revision`.
    pub fn register(&self, target: &str, revision: &str, source: Source) {
        let key = (target.to_string(), revision.to_string());
        self.listings.lock().remove(&key);
        self.sources.lock().insert(key, source);
    }

    /// Stops serving the checkpoint of `target` at `revision` (a revision
    /// rolled back, replaced or failed), and revokes its token.
    pub fn unregister(&self, target: &str, revision: &str) {
        let key = (target.to_string(), revision.to_string());
        self.sources.lock().remove(&key);
        self.listings.lock().remove(&key);
        self.revoke(&Grant::Revision {
            target: target.to_string(),
            revision: revision.to_string(),
        });
    }

    /// Stops serving every checkpoint of `target` (a deleted pool).
    pub fn unregister_all(&self, target: &str) {
        self.sources.lock().retain(|k, _| k.0 != target);
        self.listings.lock().retain(|k, _| k.0 != target);
    }

    /// Stops serving every checkpoint of `target` but the one at `revision`
    /// (a pool's older weight versions, once a newer one is synced).
    pub fn retain_only(&self, target: &str, revision: &str) {
        let keep = |k: &Key| k.0 != target || k.1 == revision;
        self.sources.lock().retain(|k, _| keep(k));
        self.listings.lock().retain(|k, _| keep(k));
    }

    /// Checkpoints registered.
    pub fn registered(&self) -> usize {
        self.sources.lock().len()
    }

    /// The URI of a registered checkpoint.
    pub fn uri(&self, target: &str, revision: &str) -> Option<String> {
        let key = (target.to_string(), revision.to_string());
        self.sources.lock().get(&key).map(|s| s.uri().to_string())
    }

    /// A new token for `replica`, to read what `grant` covers: 32 random
    /// bytes from the operating system, in hex. The worker gets it as
    /// `WARMGATE_WEIGHTS_TOKEN`; it dies with the replica
    /// ([`Weights::revoke_replica`]) or with its grant ([`Weights::revoke`]).
    pub fn issue(&self, replica: &str, grant: Grant) -> Result<String, Error> {
        let mut bytes = [0u8; 32];
        getrandom::fill(&mut bytes).map_err(|e| {
            Error::new(
                ErrorKind::Internal,
                format!("cannot make a weights token: {e}"),
            )
        })?;
        let token: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
        self.tokens
            .lock()
            .insert(replica.to_string(), (grant, token.clone()));
        Ok(token)
    }

    /// Honours again the token an earlier run minted for `replica` (taken
    /// over after a failover: its worker holds that token). A token that
    /// is not one this gateway would mint (64 hex digits) is refused.
    pub fn adopt_token(&self, replica: &str, grant: Grant, token: &str) -> bool {
        if token.len() != 64 || !token.bytes().all(|b| b.is_ascii_hexdigit()) {
            return false;
        }
        self.tokens
            .lock()
            .insert(replica.to_string(), (grant, token.to_string()));
        true
    }

    /// Makes the live token of `replica` cover `grant` instead of what it
    /// covered: a replica whose weights are swapped in place reads the new
    /// revision's checkpoint with the token it started with. False when
    /// it has no token.
    pub fn regrant(&self, replica: &str, grant: Grant) -> bool {
        match self.tokens.lock().get_mut(replica) {
            Some((g, _)) => {
                *g = grant;
                true
            }
            None => false,
        }
    }

    /// Revokes the token of a replica that has ended.
    pub fn revoke_replica(&self, replica: &str) {
        self.tokens.lock().remove(replica);
    }

    /// Revokes every token of `grant` (a revision retired).
    pub fn revoke(&self, grant: &Grant) {
        self.tokens.lock().retain(|_, (g, _)| g != grant);
    }

    /// Live tokens.
    pub fn tokens(&self) -> usize {
        self.tokens.lock().len()
    }

    /// Whether `presented` is a live token whose grant covers the
    /// checkpoint of `target` at `revision`. Every token is compared in
    /// constant time.
    pub fn authorized(&self, target: &str, revision: &str, presented: &str) -> bool {
        use subtle::ConstantTimeEq as _;
        let tokens = self.tokens.lock();
        let mut ok = subtle::Choice::from(0);
        for (grant, token) in tokens.values() {
            let same = presented.as_bytes().ct_eq(token.as_bytes());
            ok |= same & subtle::Choice::from(u8::from(grant.covers(target, revision)));
        }
        bool::from(ok)
    }

    /// The files of a revision's checkpoint (listed once; a revision's
    /// checkpoint does not change).
    pub async fn files(&self, target: &str, revision: &str) -> Result<Arc<Listing>, Error> {
        let key = (target.to_string(), revision.to_string());
        if let Some(l) = self.listings.lock().get(&key) {
            return Ok(l.clone());
        }
        let src = self.sources.lock().get(&key).cloned().ok_or_else(|| {
            Error::new(
                ErrorKind::NotFound,
                format!("'{target}' has no checkpoint for revision '{revision}'"),
            )
        })?;
        let items = plan(&src).await.map_err(|e| weights_error(&e))?;
        let sums = checksums(&items, &self.cfg)
            .await
            .map_err(|e| weights_error(&e))?;
        let listing = Arc::new(Listing { items, sums });
        // Not kept when the registration went meanwhile.
        if self.sources.lock().contains_key(&key) {
            self.listings.lock().insert(key, listing.clone());
        }
        Ok(listing)
    }

    /// Where a worker on this machine can read `item` itself: the cache's
    /// verified copy when it holds one, else the checkpoint's own file
    /// when it is on this machine (`file://`). `None`: only over HTTP.
    pub fn local_path(&self, item: &PullItem) -> Option<std::path::PathBuf> {
        let key = Cache::key(item.source.uri(), &item.meta);
        self.cache
            .lookup(&key, item.meta.size)
            .or_else(|| item.source.local_path())
    }

    /// One file of a revision's checkpoint, as a streamed body, and its size.
    pub async fn file(
        self: &Arc<Self>,
        target: &str,
        revision: &str,
        name: &str,
    ) -> Result<(Body, u64), Error> {
        let files = self.files(target, revision).await?;
        let expected = files.sums.get(name).cloned();
        let item = files
            .items
            .iter()
            .find(|i| i.relative.to_str() == Some(name))
            .ok_or_else(|| {
                Error::new(
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
            let hit = Origin {
                reader: Fanout::committed(size, path.clone()).reader(0, true),
                entry: path,
                hit: true,
            };
            return Ok((follow(hit, size, expected), size));
        }
        if item.source.is_local() {
            // A local file replaced since it was listed is refused before
            // an answer starts (one open and stat beneath the held root).
            item.source.head().await.map_err(|e| {
                Error::new(
                    ErrorKind::Conflict,
                    format!(
                        "the checkpoint of '{target}' revision '{revision}' cannot serve '{name}': {e}"
                    ),
                )
            })?;
        }
        let entry = self.cache.entry_path(&key);
        let (reader, hit) = self.download(key, item, expected.clone()).await?;
        let origin = Origin { reader, entry, hit };
        Ok((follow(origin, size, expected), size))
    }

    /// The download of `item`: the one in flight, or a new one. It feeds
    /// its readers from memory as the parts arrive, and a cache writer of
    /// its own beside them (see [`warmgate_pool::weights::fanout`]). When
    /// the cache file cannot be created, the readers are served from
    /// memory alone. Returns the caller's reader of it, joined before the
    /// download starts, and whether it reads a committed cache file
    /// instead (a download that ended meanwhile).
    async fn download(
        self: &Arc<Self>,
        key: String,
        item: PullItem,
        sha256: Option<String>,
    ) -> Result<(Reader, bool), Error> {
        let size = item.meta.size;
        // A file larger than the whole cache gets no cache file, and so no
        // file for readers that fall behind the download's memory window:
        // each reader has a download of its own, paced by it alone.
        let shared = self.cache.fits(size);
        if shared && let Some(joined) = self.join(&self.downloads.lock(), &key, size) {
            return Ok(joined);
        }
        let writer = if !shared {
            tracing::info!(uri = %item.source.uri(), bytes = size, "a checkpoint file larger than the whole weight cache; streamed to this reader without caching it");
            None
        } else {
            match self.cache.writer(&key).await {
                Ok(w) if sha256.is_none() => Some(w.without_digest()),
                Ok(w) => Some(w),
                Err(e) => {
                    tracing::warn!(uri = %item.source.uri(), error = %e, "cannot write the checkpoint's cache file; serving it from memory alone");
                    None
                }
            }
        };
        let fanout = Fanout::new(
            size,
            self.window_bytes(),
            writer.as_ref().map(|w| w.path().to_owned()),
        );
        if shared {
            let mut downloads = self.downloads.lock();
            // Another reader started the same download meanwhile, or one
            // ended and committed its file: its writer is dropped unused.
            if let Some(joined) = self.join(&downloads, &key, size) {
                return Ok(joined);
            }
            downloads.insert(key.clone(), fanout.clone());
        }
        let caller = fanout.reader(0, true);
        // The writer joins before the download starts, so it runs for it.
        let from_window = writer.as_ref().map(|_| fanout.reader(0, false));
        let (this, feed) = (self.clone(), fanout.clone());
        let (source, cfg, key2) = (item.source.clone(), self.share_of_memory(2), key.clone());
        tokio::spawn(async move {
            let mut parts = source.parts(0..size, &cfg);
            let outcome = loop {
                if feed.read(State::received) >= size || !feed.room().await {
                    break Ok(());
                }
                match parts.next().await {
                    None => break Ok(()),
                    Some(Ok(part)) => {
                        metrics::counter!("warmgate_weights_store_bytes_total")
                            .increment(part.len() as u64);
                        feed.update(|s| s.push(part));
                    }
                    Some(Err(e)) => break Err(e.to_string()),
                }
            };
            if let Err(e) = &outcome {
                tracing::warn!(uri = %source.uri(), error = %e, "checkpoint download failed");
            }
            feed.update(|s| s.end(outcome));
            this.retire(&key2, &feed);
        });
        if let (Some(writer), Some(from_window)) = (writer, from_window) {
            let this = self.clone();
            let (fill, cfg) = (fanout.clone(), self.share_of_memory(4));
            tokio::spawn(async move {
                let outcome = fill_cache(writer, from_window, &fill, &item, &cfg, sha256).await;
                if let Err(e) = &outcome {
                    tracing::warn!(uri = %item.source.uri(), error = %e, "the checkpoint's cache file was not kept");
                }
                fill.update(|s| s.filled(outcome.ok()));
                this.retire(&key, &fill);
            });
        }
        Ok((caller, false))
    }

    /// A reader of `key` without a download of its own: the download in
    /// flight, or else the cache file one committed. Called with the
    /// downloads held: a download leaves them only once its file is
    /// committed (or it failed), so a reader whose cache lookup missed
    /// just before that commit finds the file here instead of fetching
    /// the object from the store a second time.
    fn join(
        &self,
        downloads: &HashMap<String, Arc<Fanout>>,
        key: &str,
        size: u64,
    ) -> Option<(Reader, bool)> {
        if let Some(fanout) = downloads.get(key) {
            return Some((fanout.reader(0, true), false));
        }
        let path = self.cache.lookup(key, size)?;
        metrics::counter!("warmgate_weights_cache_bytes_total").increment(size);
        Some((Fanout::committed(size, path).reader(0, true), true))
    }

    /// Forgets the download of `key` if it is `fanout` and new readers
    /// should no longer join it.
    fn retire(&self, key: &str, fanout: &Arc<Fanout>) {
        if fanout.read(State::retired) {
            let mut downloads = self.downloads.lock();
            if downloads.get(key).is_some_and(|f| Arc::ptr_eq(f, fanout)) {
                downloads.remove(key);
            }
        }
    }

    /// Bytes each download holds for its readers in memory: a quarter of
    /// the memory limit per object. The parts in flight take half, and the
    /// cache writer's own reads, when it falls behind, the last quarter.
    fn window_bytes(&self) -> u64 {
        (self.cfg.memory_limit / 4).max(self.cfg.part_size)
    }

    /// The streamer's settings within `1/part` of the memory limit.
    fn share_of_memory(&self, part: u64) -> StreamConfig {
        StreamConfig {
            memory_limit: (self.cfg.memory_limit / part).max(self.cfg.part_size),
            ..self.cfg.clone()
        }
    }
}

/// Writes the cache file of a download from its window, and from the store
/// once it falls behind the window; then commits it. Returns the entry.
async fn fill_cache(
    mut writer: CacheWriter,
    mut from_window: Reader,
    fill: &Fanout,
    item: &PullItem,
    cfg: &StreamConfig,
    sha256: Option<String>,
) -> Result<PathBuf, String> {
    let size = item.meta.size;
    loop {
        // A whole part at a time: one write for each.
        match from_window.next(usize::MAX).await {
            Next::Memory(b) => {
                writer.write(&b).await.map_err(|e| e.to_string())?;
                from_window.consumed(b.len() as u64);
                let written = writer.written();
                fill.update(|s| s.written(written));
            }
            Next::Store => {
                // The disk is slower than the store: read the rest again, at
                // the disk's pace, and leave the readers the window.
                from_window.leave();
                let from = from_window.offset();
                tracing::info!(uri = %item.source.uri(), from, size, "the cache file fell behind the download; reading the rest for it from the store");
                let mut rest = item.source.parts(from..size, cfg);
                while let Some(part) = rest.next().await {
                    let part = part.map_err(|e| e.to_string())?;
                    metrics::counter!("warmgate_weights_store_bytes_total")
                        .increment(part.len() as u64);
                    writer.write(&part).await.map_err(|e| e.to_string())?;
                    let written = writer.written();
                    fill.update(|s| s.written(written));
                }
                break;
            }
            Next::End => break,
            Next::Failed(e) => return Err(e),
            Next::File { .. } | Next::Wait => {
                unreachable!("the writer never reads the file, and next() waits")
            }
        }
    }
    drop(from_window);
    writer
        .commit(size, sha256.as_deref())
        .await
        .map_err(|e| e.to_string())
}

/// Where a body reads the object from: its download (or a cache hit).
struct Origin {
    reader: Reader,
    /// Where the cache entry is, or will be once committed: a reader
    /// whose temporary file was renamed a moment ago opens it there.
    entry: PathBuf,
    /// Whether it is a cache hit, whose entry is removed if its bytes fail
    /// their digest.
    hit: bool,
}

/// A body that reads an object as its download brings it: from memory
/// while the bytes are in the download's window, from the cache file
/// behind it. With an expected SHA-256 it hashes what it sends and holds
/// the last chunk back until the digest matches; on a mismatch the body
/// ends with an error (and a cache entry that was read is removed), so no
/// reader sees a clean end of bad bytes.
fn follow(origin: Origin, size: u64, sha256: Option<String>) -> Body {
    Body::from_stream(follow_stream(origin, size, sha256))
}

fn follow_stream(
    origin: Origin,
    size: u64,
    sha256: Option<String>,
) -> impl futures_util::Stream<Item = std::io::Result<bytes::Bytes>> {
    struct St {
        origin: Origin,
        /// The cache file, once this reader has read from it.
        file: Option<Arc<std::fs::File>>,
        /// The buffers of chunks read from it, filled again once sent.
        buffers: Recycler,
        offset: u64,
        size: u64,
        sha256: Option<(String, Sha256)>,
    }
    let st = St {
        origin,
        file: None,
        // A chunk being read, one being sent, and one in the socket's queue.
        buffers: Recycler::new(3),
        offset: 0,
        size,
        sha256: sha256.map(|s| (s, Sha256::new())),
    };
    futures_util::stream::try_unfold(st, |mut st| async move {
        if st.offset >= st.size {
            return Ok::<_, std::io::Error>(None);
        }
        let chunk = match st.origin.reader.next(CHUNK).await {
            Next::Memory(b) => b,
            Next::File { path, until } => {
                if st.file.is_none() {
                    let file = open_following(&path, &st.origin.entry).await?;
                    st.file = Some(Arc::new(file.into_std().await));
                }
                let file = st.file.clone().expect("opened above");
                let want = ((until - st.offset) as usize).min(CHUNK);
                let (mut buf, at) = (st.buffers.take(want), st.offset);
                // One positioned read of the whole chunk, straight into a
                // buffer this reader used before: no copy through an
                // async file's own buffer, and no fresh pages to fault in.
                let buf = tokio::task::spawn_blocking(move || {
                    use std::os::unix::fs::FileExt as _;
                    buf.resize(want, 0);
                    file.read_exact_at(&mut buf, at).map(|()| buf)
                })
                .await
                .map_err(std::io::Error::other)??;
                st.buffers.seal(buf)
            }
            Next::End => return Ok(None),
            Next::Failed(e) => return Err(std::io::Error::other(e)),
            Next::Store | Next::Wait => {
                unreachable!("readers of the file are never sent to the store, and next() waits")
            }
        };
        let chunk = chunk.slice(..chunk.len().min((st.size - st.offset) as usize));
        st.offset += chunk.len() as u64;
        st.origin.reader.consumed(chunk.len() as u64);
        if let Some((expected, hasher)) = st.sha256.as_mut() {
            hasher.update(&chunk);
            if st.offset == st.size {
                let got: String = std::mem::take(hasher)
                    .finalize()
                    .iter()
                    .map(|b| format!("{b:02x}"))
                    .collect();
                if !got.eq_ignore_ascii_case(expected) {
                    if st.origin.hit {
                        let entry = &st.origin.entry;
                        tracing::warn!(path = %entry.display(), "removing a cache entry whose SHA-256 does not match the checkpoint's SHA256SUMS");
                        let _ = std::fs::remove_file(entry);
                    }
                    return Err(std::io::Error::other(format!(
                        "sha256 mismatch: the checkpoint's SHA256SUMS says {expected}, the bytes hash to {got}"
                    )));
                }
            }
        }
        Ok(Some((chunk, st)))
    })
}

/// Opens the cache file a reader is told to read: the temporary file, or
/// the entry it was renamed to a moment ago. (An open file outlives the
/// rename.)
async fn open_following(
    path: &std::path::Path,
    entry: &std::path::Path,
) -> std::io::Result<tokio::fs::File> {
    match tokio::fs::File::open(path).await {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound && entry != path => {
            tokio::fs::File::open(entry).await
        }
        other => other,
    }
}

fn weights_error(e: &warmgate_pool::Error) -> Error {
    let kind = match e {
        warmgate_pool::Error::Weights { reason, .. }
            if reason == "not found" || reason == "no objects under this prefix" =>
        {
            ErrorKind::NotFound
        }
        _ => ErrorKind::ReplicaFailed,
    };
    Error::new(kind, e.to_string())
}

#[cfg(test)]
mod tests;
