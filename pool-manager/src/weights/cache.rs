//! A node-local, content-addressed cache of objects under `state_dir`.
//!
//! An entry's name is a hash of the object's URI and of what the store says
//! identifies its content (ETag or version, plus size), so a second replica, a restart or a
//! rollback reads the same bytes locally. Entries are written to a temporary
//! file and renamed into place only after their size is checked, so a crash
//! never leaves a partial entry that a later read would trust. Least
//! recently used entries are evicted past the size limit.

use std::path::{Path, PathBuf};
use std::time::SystemTime;

use bytes::Bytes;
use object_store::ObjectMeta;
use sha2::{Digest, Sha256};

use crate::{Error, Result};

const TMP_SUFFIX: &str = ".tmp";

/// The cache folder and its size limit.
#[derive(Debug, Clone)]
pub struct Cache {
    dir: PathBuf,
    max_bytes: u64,
    /// A folder whose files share the budget (the adapters pulled for the
    /// engines): counted, never evicted by the cache.
    shared: Option<PathBuf>,
}

/// A cache entry being written. Dropped without [`CacheWriter::commit`], it
/// removes its temporary file.
#[derive(Debug)]
pub struct CacheWriter {
    /// Written on tokio's blocking pool, from the caller's buffers as
    /// they are (no copy into an async file's own buffer).
    file: Option<std::fs::File>,
    tmp: PathBuf,
    target: PathBuf,
    written: u64,
    /// The digest of what was written, unless the caller expects none.
    hasher: Option<Sha256>,
    /// Renamed into place: nothing to remove when dropped.
    committed: bool,
    cache: Cache,
}

impl Cache {
    /// Opens (creating) the cache folder and removes temporary files that a
    /// crash left behind.
    pub fn open(dir: impl Into<PathBuf>, max_bytes: u64) -> Result<Cache> {
        let dir = dir.into();
        let err = |e: std::io::Error| Error::Cache {
            path: dir.clone(),
            reason: e.to_string(),
        };
        std::fs::create_dir_all(&dir).map_err(err)?;
        for entry in std::fs::read_dir(&dir).map_err(err)?.flatten() {
            if entry.file_name().to_string_lossy().ends_with(TMP_SUFFIX) {
                let _ = std::fs::remove_file(entry.path());
            }
        }
        Ok(Cache {
            dir,
            max_bytes,
            shared: None,
        })
    }

    /// The same cache, its budget shared with the files under `dir` (and
    /// its folders): they count toward `max_bytes`, and the cache's own
    /// entries go first when the two pass it.
    pub fn sharing_with(mut self, dir: impl Into<PathBuf>) -> Cache {
        self.shared = Some(dir.into());
        self
    }

    /// The budget, in bytes.
    pub fn max_bytes(&self) -> u64 {
        self.max_bytes
    }

    /// Evicts the cache's own least recently used entries until they, the
    /// shared folder's files and `extra` bytes fit the budget (or nothing
    /// of the cache's is left).
    pub fn make_room(&self, extra: u64) {
        let mut entries = self.entries();
        let mut total: u64 = entries.iter().map(|e| e.1).sum::<u64>() + self.shared_bytes() + extra;
        entries.sort_by_key(|e| e.2);
        for (path, len, _) in entries {
            if total <= self.max_bytes {
                break;
            }
            if std::fs::remove_file(&path).is_ok() {
                total -= len;
                tracing::info!(path = %path.display(), bytes = len, "evicted from the weight cache");
            }
        }
    }

    /// Bytes of the files under the shared folder.
    pub fn shared_bytes(&self) -> u64 {
        self.shared.as_deref().map_or(0, folder_bytes)
    }

    /// The entry name for an object: a hash of its identity (its URI) and
    /// of what the store says about its content (ETag or version, else
    /// modification time) and size. Two objects that share an ETag and a
    /// size (nginx's ETag is mtime plus size; an in-memory store counts
    /// from zero) never share an entry.
    pub fn key(uri: &str, meta: &ObjectMeta) -> String {
        let mut h = Sha256::new();
        h.update(format!("uri:{uri}|size:{}|", meta.size));
        match (&meta.e_tag, &meta.version) {
            (Some(etag), v) => h.update(format!(
                "etag:{etag}|version:{}",
                v.as_deref().unwrap_or("")
            )),
            (None, Some(v)) => h.update(format!("version:{v}")),
            (None, None) => h.update(format!(
                "modified:{}",
                meta.last_modified.timestamp_nanos_opt().unwrap_or_default()
            )),
        }
        hex(&h.finalize())
    }

    /// The entry's path if it is present and has the expected size; marks
    /// it as recently used. An entry of the wrong size is removed.
    pub fn lookup(&self, key: &str, size: u64) -> Option<PathBuf> {
        let path = self.entry_path(key);
        let meta = std::fs::metadata(&path).ok()?;
        if meta.len() != size {
            tracing::warn!(path = %path.display(), expected = size, found = meta.len(), "removing a cache entry of the wrong size");
            let _ = std::fs::remove_file(&path);
            return None;
        }
        if let Ok(f) = std::fs::File::options().write(true).open(&path) {
            let _ = f.set_modified(SystemTime::now());
        }
        Some(path)
    }

    /// Where the entry of `key` is once committed.
    pub fn entry_path(&self, key: &str) -> PathBuf {
        self.dir.join(key)
    }

    /// Whether an object of `size` bytes may be cached at all: one larger
    /// than the whole cache would only evict everything else and still
    /// pass the limit, so it is read through without a cache entry.
    pub fn fits(&self, size: u64) -> bool {
        size <= self.max_bytes
    }

    /// Starts writing an entry.
    pub async fn writer(&self, key: &str) -> Result<CacheWriter> {
        let tmp = self.dir.join(format!(
            "{key}.{}.{:x}{TMP_SUFFIX}",
            std::process::id(),
            rand_u64()
        ));
        let file = tokio::fs::File::create(&tmp)
            .await
            .map_err(|e| Error::Cache {
                path: tmp.clone(),
                reason: e.to_string(),
            })?;
        Ok(CacheWriter {
            file: Some(file.into_std().await),
            target: self.entry_path(key),
            tmp,
            written: 0,
            hasher: Some(Sha256::new()),
            committed: false,
            cache: self.clone(),
        })
    }

    /// Total bytes of committed entries.
    pub fn size(&self) -> u64 {
        self.entries().iter().map(|e| e.1).sum()
    }

    fn entries(&self) -> Vec<(PathBuf, u64, SystemTime)> {
        let Ok(rd) = std::fs::read_dir(&self.dir) else {
            return Vec::new();
        };
        rd.flatten()
            .filter(|e| !e.file_name().to_string_lossy().ends_with(TMP_SUFFIX))
            .filter_map(|e| {
                let m = e.metadata().ok()?;
                m.is_file().then(|| {
                    (
                        e.path(),
                        m.len(),
                        m.modified().unwrap_or(SystemTime::UNIX_EPOCH),
                    )
                })
            })
            .collect()
    }

    /// Removes least recently used entries until the cache fits, never
    /// `keep`.
    fn evict(&self, keep: &Path) {
        let mut entries = self.entries();
        let mut total: u64 = entries.iter().map(|e| e.1).sum::<u64>() + self.shared_bytes();
        if total <= self.max_bytes {
            return;
        }
        entries.sort_by_key(|e| e.2);
        for (path, len, _) in entries {
            if total <= self.max_bytes {
                break;
            }
            if path == keep {
                continue;
            }
            if std::fs::remove_file(&path).is_ok() {
                total -= len;
                tracing::info!(path = %path.display(), bytes = len, "evicted from the weight cache");
            }
        }
    }
}

/// Bytes of the files in `dir` and in its folders, one level down.
pub fn folder_bytes(dir: &Path) -> u64 {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return 0;
    };
    rd.flatten()
        .filter_map(|e| {
            let m = e.metadata().ok()?;
            if m.is_dir() {
                let inner = std::fs::read_dir(e.path()).ok()?;
                Some(
                    inner
                        .flatten()
                        .filter_map(|f| f.metadata().ok().filter(|m| m.is_file()))
                        .map(|m| m.len())
                        .sum(),
                )
            } else {
                Some(m.len())
            }
        })
        .sum()
}

impl CacheWriter {
    /// The temporary file being written; readers may follow it as it grows.
    pub fn path(&self) -> &Path {
        &self.tmp
    }

    /// Bytes written so far.
    pub fn written(&self) -> u64 {
        self.written
    }

    /// Hashes nothing: the caller will commit without an expected digest
    /// (one given anyway is then checked by reading the file back).
    pub fn without_digest(mut self) -> Self {
        self.hasher = None;
        self
    }

    /// Appends bytes. Once it returns they are in the file, visible to
    /// readers that follow it as it grows.
    pub async fn write(&mut self, data: &Bytes) -> Result<()> {
        let err = |reason: String| Error::Cache {
            path: self.tmp.clone(),
            reason,
        };
        let mut file = self
            .file
            .take()
            .ok_or_else(|| err("written after commit".into()))?;
        let mut hasher = self.hasher.take();
        let data = data.clone();
        let (file, hasher, outcome) = tokio::task::spawn_blocking(move || {
            use std::io::Write as _;
            let outcome = file.write_all(&data);
            if let Some(h) = hasher.as_mut() {
                h.update(&data);
            }
            (file, hasher, outcome.map(|()| data.len() as u64))
        })
        .await
        .map_err(|e| err(format!("the write's thread failed: {e}")))?;
        self.file = Some(file);
        self.hasher = hasher;
        self.written += outcome.map_err(|e| err(e.to_string()))?;
        Ok(())
    }

    /// Checks the size (and the SHA-256, when one is expected), syncs,
    /// and renames the entry into place; then evicts old entries past the
    /// limit. Returns the entry's path. On a mismatch nothing is committed.
    pub async fn commit(mut self, expected: u64, sha256: Option<&str>) -> Result<PathBuf> {
        let err = |path: &Path, reason: String| Error::Cache {
            path: path.to_owned(),
            reason,
        };
        if self.written != expected {
            return Err(err(
                &self.tmp,
                format!("wrote {} bytes but the object has {expected}", self.written),
            ));
        }
        if let Some(want) = sha256 {
            let got = match self.hasher.take() {
                Some(h) => hex(&h.finalize()),
                None => sha256_file(&self.tmp).await?,
            };
            if !got.eq_ignore_ascii_case(want) {
                return Err(err(
                    &self.tmp,
                    format!(
                        "sha256 mismatch: the checkpoint's SHA256SUMS says {want}, the bytes hash to {got}"
                    ),
                ));
            }
        }
        let file = self.file.take().expect("committed once");
        tokio::task::spawn_blocking(move || file.sync_all())
            .await
            .map_err(|e| err(&self.tmp, e.to_string()))?
            .map_err(|e| err(&self.tmp, e.to_string()))?;
        if let Err(e) = tokio::fs::rename(&self.tmp, &self.target).await {
            return Err(err(&self.target, e.to_string()));
        }
        self.committed = true;
        let cache = self.cache.clone();
        let target = self.target.clone();
        let keep = target.clone();
        let _ = tokio::task::spawn_blocking(move || cache.evict(&keep)).await;
        Ok(target)
    }
}

impl Drop for CacheWriter {
    fn drop(&mut self) {
        if !self.committed {
            let _ = std::fs::remove_file(&self.tmp);
        }
    }
}

/// The SHA-256 of a file, in lower-case hex, read on the blocking pool.
pub async fn sha256_file(path: &Path) -> Result<String> {
    let p = path.to_owned();
    let err = |reason: String| Error::Cache {
        path: path.to_owned(),
        reason,
    };
    tokio::task::spawn_blocking(move || {
        let mut f = std::fs::File::open(&p)?;
        let mut h = Sha256::new();
        std::io::copy(&mut f, &mut h)?;
        Ok::<_, std::io::Error>(hex(&h.finalize()))
    })
    .await
    .map_err(|e| err(e.to_string()))?
    .map_err(|e| err(e.to_string()))
}

/// Whether a cached file hashes to `sha256`.
pub(crate) async fn matches(path: &Path, sha256: &str) -> Result<bool> {
    Ok(sha256_file(path).await?.eq_ignore_ascii_case(sha256))
}

/// Lower-case hex of a digest.
pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A `SHA256SUMS` file (`sha256sum` output: `<hex>  <name>` per line),
/// by file name. Lines that are not of that form are ignored.
pub fn parse_sha256sums(text: &str) -> std::collections::HashMap<String, String> {
    text.lines()
        .filter_map(|line| {
            let (hash, name) = line.split_once(char::is_whitespace)?;
            let name = name.trim_start().trim_start_matches('*').trim();
            (hash.len() == 64 && hash.bytes().all(|b| b.is_ascii_hexdigit()) && !name.is_empty())
                .then(|| {
                    (
                        name.trim_start_matches("./").to_string(),
                        hash.to_ascii_lowercase(),
                    )
                })
        })
        .collect()
}

fn rand_u64() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(
        SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or_default(),
    );
    h.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sha256sums_lines_are_parsed_like_sha256sum_writes_them() {
        let h = "a".repeat(64);
        let text =
            format!("{h}  model.safetensors\n{h} *bin/x.json\n{h}  ./tok.json\nnot a line\n");
        let sums = parse_sha256sums(&text);
        assert_eq!(sums.len(), 3);
        assert_eq!(sums["model.safetensors"], h);
        assert_eq!(sums["bin/x.json"], h);
        assert_eq!(sums["tok.json"], h);
    }
}
