//! An adapter's files where the engine can read them: a `file://`
//! checkpoint is its own folder; an object-store one (`s3://`, `gs://`,
//! `az://`) is pulled once into `state_dir/adapters/` (checked against its
//! `SHA256SUMS` when it has one, safetensors headers read before their
//! data) and that folder is the `lora_path`. Opened under `[weights]
//! allowed_prefixes`, as every checkpoint is.
//!
//! A folder is named by the checkpoint's URI and the size, ETag and
//! version of each object, so a checkpoint rewritten in place is pulled
//! again, and one pulled whole is pulled once while it is kept. The
//! folders share the weight cache's byte budget (`[weights]
//! cache_max_bytes`): to make room for a pull, the least recently used
//! folders go first (an engine reads an adapter's files when it loads it,
//! not after), then the cache's own least recently used entries; an
//! adapter larger than the whole budget is refused.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use parking_lot::Mutex;
use warmgate_pool::weights::{PullItem, StreamConfig};

use crate::weights::Weights;

/// The marker of a folder pulled whole.
const COMPLETE: &str = ".warmgate-complete";

/// Pulls adapters from object stores for the engines on this machine.
pub struct AdapterFiles {
    weights: Arc<Weights>,
    /// The weight cache, whose budget the folders share.
    cache: warmgate_pool::weights::Cache,
    cfg: StreamConfig,
    dir: PathBuf,
    /// One pull per folder at a time.
    pulling: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
}

impl AdapterFiles {
    /// Pulls into `dir`, opening checkpoints through `weights`.
    pub fn new(
        weights: Arc<Weights>,
        cache: warmgate_pool::weights::Cache,
        cfg: StreamConfig,
        dir: PathBuf,
    ) -> Self {
        // Pulls a stop cut short left these behind.
        if let Ok(entries) = std::fs::read_dir(&dir) {
            for e in entries.filter_map(Result::ok) {
                if e.file_name().to_string_lossy().ends_with(".partial") {
                    let _ = std::fs::remove_dir_all(e.path());
                }
            }
        }
        AdapterFiles {
            weights,
            cache,
            cfg,
            dir,
            pulling: Mutex::new(HashMap::new()),
        }
    }

    /// The folder the engine reads the adapter at `checkpoint` from,
    /// pulled first if it lives in an object store.
    pub async fn local_path(&self, checkpoint: &str) -> Result<String, String> {
        if let Some(path) = checkpoint.strip_prefix("file://") {
            // Checked at every load, as a checkpoint is at every open: a
            // folder that did not exist when the app was put, or has since
            // become a link out of the allowed prefixes, is refused.
            self.weights
                .open(checkpoint)
                .map_err(|e| e.message.to_string())?;
            return Ok(path.to_string());
        }
        let src = self
            .weights
            .open(checkpoint)
            .map_err(|e| e.message.to_string())?;
        let items = warmgate_pool::weights::plan(&src)
            .await
            .map_err(|e| format!("listing {checkpoint}: {e}"))?;
        if items.is_empty() {
            return Err(format!("{checkpoint} holds no file"));
        }
        let key = folder_key(checkpoint, &items);
        let dest = self.dir.join(&key);
        let lock = self.pulling.lock().entry(key.clone()).or_default().clone();
        let _one = lock.lock().await;
        if !dest.join(COMPLETE).exists() {
            let need: u64 = items.iter().map(|i| i.meta.size).sum();
            let budget = self.cache.max_bytes();
            if need > budget {
                self.pulling.lock().remove(&key);
                return Err(format!(
                    "{checkpoint} holds {need} bytes, more than [weights] cache_max_bytes \
                     ({budget}), which pulled adapters share"
                ));
            }
            self.make_room(&key, need);
            let pulled = self.pull(&items, &key, &dest).await;
            if let Err(e) = pulled {
                self.pulling.lock().remove(&key);
                return Err(format!("pulling {checkpoint}: {e}"));
            }
            tracing::info!(checkpoint, folder = %dest.display(), files = items.len(), "adapter pulled");
        }
        // Its use keeps it: the least recently used folders go first.
        let _ = std::fs::File::open(dest.join(COMPLETE))
            .and_then(|f| f.set_modified(std::time::SystemTime::now()));
        self.pulling.lock().remove(&key);
        Ok(dest.to_string_lossy().into_owned())
    }

    async fn pull(&self, items: &[PullItem], key: &str, dest: &Path) -> Result<(), String> {
        let partial = self.dir.join(format!("{key}.partial"));
        let _ = tokio::fs::remove_dir_all(&partial).await;
        let made = async {
            tokio::fs::create_dir_all(&partial)
                .await
                .map_err(|e| format!("create {}: {e}", partial.display()))?;
            let sums = warmgate_pool::weights::checksums(items, &self.cfg)
                .await
                .map_err(|e| e.to_string())?;
            warmgate_pool::weights::pull(items, &partial, &self.cfg, None, &sums, &|_| {})
                .await
                .map_err(|e| e.to_string())?;
            tokio::fs::write(partial.join(COMPLETE), b"")
                .await
                .map_err(|e| e.to_string())?;
            let _ = tokio::fs::remove_dir_all(dest).await;
            tokio::fs::rename(&partial, dest)
                .await
                .map_err(|e| format!("rename into {}: {e}", dest.display()))
        };
        let outcome = made.await;
        if outcome.is_err() {
            let _ = tokio::fs::remove_dir_all(&partial).await;
        }
        outcome
    }

    /// Makes room for `need` bytes under the shared budget: the least
    /// recently used folders (never `keep`) go first, then the weight
    /// cache's own least recently used entries.
    fn make_room(&self, keep: &str, need: u64) {
        let budget = self.cache.max_bytes();
        let used =
            |this: &Self| this.cache.size() + warmgate_pool::weights::folder_bytes(&this.dir);
        if used(self) + need > budget
            && let Ok(entries) = std::fs::read_dir(&self.dir)
        {
            let mut folders: Vec<(std::time::SystemTime, PathBuf)> = entries
                .filter_map(Result::ok)
                .filter(|e| {
                    e.file_name() != keep && !e.file_name().to_string_lossy().ends_with(".partial")
                })
                .filter_map(|e| {
                    let used = e.path().join(COMPLETE).metadata().ok()?.modified().ok()?;
                    Some((used, e.path()))
                })
                .collect();
            folders.sort();
            for (_, path) in folders {
                if used(self) + need <= budget {
                    break;
                }
                if std::fs::remove_dir_all(&path).is_ok() {
                    tracing::info!(folder = %path.display(), "removed a pulled adapter to make room");
                }
            }
        }
        self.cache.make_room(need);
    }
}

/// A folder's name: the URI and each object's identity, hashed.
fn folder_key(checkpoint: &str, items: &[PullItem]) -> String {
    use sha2::Digest as _;
    let mut h = sha2::Sha256::new();
    h.update(checkpoint.as_bytes());
    for i in items {
        h.update([0]);
        h.update(i.relative.to_string_lossy().as_bytes());
        h.update(i.meta.size.to_le_bytes());
        h.update(i.meta.e_tag.as_deref().unwrap_or("").as_bytes());
        h.update(i.meta.version.as_deref().unwrap_or("").as_bytes());
    }
    let hex = format!("{:x}", h.finalize());
    hex[..24].to_string()
}
