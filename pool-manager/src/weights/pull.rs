//! Copying a checkpoint to a local folder: `warmgate weights pull`.

use std::path::{Component, Path, PathBuf};

use object_store::ObjectMeta;
use tokio::io::AsyncWriteExt;

use super::cache::{hex, parse_sha256sums};
use super::{Cache, Source, StreamConfig};
use crate::{Error, Result};
use futures_util::StreamExt;
use sha2::{Digest, Sha256};

/// The checksum file a checkpoint may carry, in `sha256sum` format. When it
/// is there, every file it names is verified while it streams, and a
/// mismatch is refused before anything is committed.
pub const SHA256SUMS: &str = "SHA256SUMS";
/// A checksum file larger than this is not read.
const MAX_SUMS_BYTES: u64 = 16 * 1024 * 1024;

/// One object to pull and where it goes.
#[derive(Debug, Clone)]
pub struct PullItem {
    /// The object.
    pub source: Source,
    /// Its size, ETag and version.
    pub meta: ObjectMeta,
    /// Its path relative to the checkpoint prefix.
    pub relative: PathBuf,
}

/// What a pull did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PullReport {
    /// Files written.
    pub files: usize,
    /// Bytes written.
    pub bytes: u64,
    /// Of those, bytes read from the local cache.
    pub from_cache: u64,
}

/// The objects of a checkpoint: every object under the prefix, or the one
/// object the URI names.
///
/// [`LocalTree`]: super::local_tree::LocalTree
pub async fn plan(src: &Source) -> Result<Vec<PullItem>> {
    let objects = match src.list().await {
        Ok(objects) => objects,
        Err(list_err) => match src.head().await {
            Ok(meta) => vec![meta],
            Err(_) => return Err(list_err),
        },
    };
    let base = src.path_str().trim_end_matches('/').to_string();
    // A local checkpoint lists only what lies inside it ([`LocalTree`]).
    objects
        .into_iter()
        .map(|meta| {
            let loc = meta.location.as_ref();
            let rel = loc
                .strip_prefix(&base)
                .map(|r| r.trim_start_matches('/'))
                .filter(|r| !r.is_empty())
                .unwrap_or_else(|| loc.rsplit('/').next().unwrap_or(loc));
            let relative = safe_relative(rel).ok_or_else(|| Error::Weights {
                uri: src.uri().to_string(),
                reason: format!("object {loc:?} would be written outside the target folder"),
            })?;
            Ok(PullItem {
                source: src.child(&meta.location),
                meta,
                relative,
            })
        })
        .collect()
}

/// The expected SHA-256 of each file, from the checkpoint's `SHA256SUMS`
/// (empty when it has none).
pub async fn checksums(
    items: &[PullItem],
    cfg: &StreamConfig,
) -> Result<std::collections::HashMap<String, String>> {
    let Some(item) = items.iter().find(|i| i.relative.as_os_str() == SHA256SUMS) else {
        return Ok(Default::default());
    };
    if item.meta.size > MAX_SUMS_BYTES {
        return Err(Error::Weights {
            uri: item.source.uri().to_string(),
            reason: format!("larger than {MAX_SUMS_BYTES} bytes"),
        });
    }
    let mut text = Vec::with_capacity(item.meta.size as usize);
    let mut parts = item.source.parts(0..item.meta.size, cfg);
    while let Some(part) = parts.next().await {
        text.extend_from_slice(&part?);
    }
    Ok(parse_sha256sums(&String::from_utf8_lossy(&text)))
}

/// Pulls every item into `dest`, through `cache` when given. Safetensors
/// files have their header checked before any data is downloaded, and files
/// named in `sums` are verified. `on_bytes` is told about progress.
pub async fn pull(
    items: &[PullItem],
    dest: &Path,
    cfg: &StreamConfig,
    cache: Option<&Cache>,
    sums: &std::collections::HashMap<String, String>,
    on_bytes: &(dyn Fn(u64) + Sync),
) -> Result<PullReport> {
    let mut report = PullReport::default();
    for item in items {
        let size = item.meta.size;
        let expected = item
            .relative
            .to_str()
            .and_then(|r| sums.get(r))
            .map(String::as_str);
        let target = dest.join(&item.relative);
        if let Some(parent) = target.parent() {
            tokio::fs::create_dir_all(parent)
                .await
                .map_err(|e| io_error(parent, e))?;
        }
        if item
            .relative
            .extension()
            .is_some_and(|e| e == "safetensors")
        {
            item.source.header(size).await?;
        }
        let key = Cache::key(item.source.uri(), &item.meta);
        let fetch = Fetch {
            item,
            target: &target,
            expected,
            cfg,
            on_bytes,
        };
        if let Some(cached) = cached_entry(cache, &key, size, expected).await? {
            place(&cached, &target).await?;
            on_bytes(size);
            report.from_cache += size;
        } else if let Some(cache) = cache.filter(|c| c.fits(size)) {
            fetch.through_cache(cache, &key).await?;
        } else {
            fetch.direct().await?;
        }
        report.files += 1;
        report.bytes += size;
    }
    Ok(report)
}

/// The cache entry for `key`, when there is one of `size` bytes; an entry
/// whose SHA-256 is not the `expected` one is removed, not used.
async fn cached_entry(
    cache: Option<&Cache>,
    key: &str,
    size: u64,
    expected: Option<&str>,
) -> Result<Option<PathBuf>> {
    Ok(match cache.and_then(|c| c.lookup(key, size)) {
        Some(path) => match expected {
            Some(want) if !super::cache::matches(&path, want).await? => {
                tracing::warn!(path = %path.display(), "removing a cache entry whose SHA-256 does not match the checkpoint's SHA256SUMS");
                let _ = tokio::fs::remove_file(&path).await;
                None
            }
            _ => Some(path),
        },
        None => None,
    })
}

/// One item to download into `target`, verified against `expected`
/// when the checkpoint's SHA256SUMS names it.
struct Fetch<'a> {
    item: &'a PullItem,
    target: &'a Path,
    expected: Option<&'a str>,
    cfg: &'a StreamConfig,
    on_bytes: &'a (dyn Fn(u64) + Sync),
}

impl Fetch<'_> {
    /// Streams the object into a new cache entry under `key` (verified
    /// on commit), then places the entry at the target.
    async fn through_cache(&self, cache: &Cache, key: &str) -> Result<()> {
        let (item, size) = (self.item, self.item.meta.size);
        let mismatch = |e: Error| match e {
            Error::Cache { reason, .. } if reason.starts_with("sha256 mismatch") => {
                Error::Weights {
                    uri: item.source.uri().to_string(),
                    reason,
                }
            }
            other => other,
        };
        let mut w = cache.writer(key).await?;
        if self.expected.is_none() {
            w = w.without_digest();
        }
        let mut parts = item.source.parts(0..size, self.cfg);
        while let Some(part) = parts.next().await {
            let part = part?;
            w.write(&part).await?;
            (self.on_bytes)(part.len() as u64);
        }
        let entry = w.commit(size, self.expected).await.map_err(mismatch)?;
        place(&entry, self.target).await
    }

    /// Streams the object straight to a partial file beside the target,
    /// hashing it on the way, and renames it into place once verified; the
    /// partial file is removed when the stream fails or the hash differs.
    async fn direct(&self) -> Result<()> {
        let (item, size, target) = (self.item, self.item.meta.size, self.target);
        let tmp = target.with_extension("warmgate-partial");
        let mut f = tokio::fs::File::create(&tmp)
            .await
            .map_err(|e| io_error(&tmp, e))?;
        let mut hasher = Sha256::new();
        let mut parts = item.source.parts(0..size, self.cfg);
        while let Some(part) = parts.next().await {
            let part = match part {
                Ok(p) => p,
                Err(e) => {
                    let _ = tokio::fs::remove_file(&tmp).await;
                    return Err(e);
                }
            };
            f.write_all(&part).await.map_err(|e| io_error(&tmp, e))?;
            hasher.update(&part);
            (self.on_bytes)(part.len() as u64);
        }
        if let Some(want) = self.expected {
            let got = hex(&hasher.finalize());
            if !got.eq_ignore_ascii_case(want) {
                let _ = tokio::fs::remove_file(&tmp).await;
                return Err(Error::Weights {
                    uri: item.source.uri().to_string(),
                    reason: format!(
                        "sha256 mismatch: the checkpoint's SHA256SUMS says {want}, the bytes hash to {got}"
                    ),
                });
            }
        }
        f.sync_all().await.map_err(|e| io_error(&tmp, e))?;
        tokio::fs::rename(&tmp, target)
            .await
            .map_err(|e| io_error(target, e))
    }
}

/// Hard-links a cache entry into place (no second copy on disk), copying
/// when the folders are on different file systems.
async fn place(entry: &Path, target: &Path) -> Result<()> {
    let _ = tokio::fs::remove_file(target).await;
    if tokio::fs::hard_link(entry, target).await.is_ok() {
        return Ok(());
    }
    let tmp = target.with_extension("warmgate-partial");
    tokio::fs::copy(entry, &tmp)
        .await
        .map_err(|e| io_error(&tmp, e))?;
    tokio::fs::rename(&tmp, target)
        .await
        .map_err(|e| io_error(target, e))
}

/// A relative path with no `..`, root or prefix components.
fn safe_relative(rel: &str) -> Option<PathBuf> {
    let p = PathBuf::from(rel);
    p.components()
        .all(|c| matches!(c, Component::Normal(_)))
        .then_some(p)
}

fn io_error(path: &Path, e: std::io::Error) -> Error {
    Error::Cache {
        path: path.to_owned(),
        reason: e.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn relative_paths_cannot_escape() {
        assert!(safe_relative("model.safetensors").is_some());
        assert!(safe_relative("sub/tokenizer.json").is_some());
        assert!(safe_relative("../etc/passwd").is_none());
        assert!(safe_relative("/etc/passwd").is_none());
        assert!(safe_relative("a/../../b").is_none());
    }
}
