//! A weight sync as a caller asks for it (`POST /v1/pools/{pool}/weights`,
//! `Pool.sync_weights`): the version the checkpoint becomes, the
//! checkpoint opened and listed before any replica is touched (and pulled
//! into a folder for engines that read one), the pool's sync run in a task
//! of its own so a caller that leaves does not cut it short, and, once a
//! replica has loaded it, the pool's target pointed at it so replicas that
//! start from then on read it.

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;
use warmgate_deploy::WeightSync;
use warmgate_pool::PoolManager;

use super::pool::{Pool, ReplicaSync, WeightsAt};
use crate::error::{Error, ErrorKind};
use crate::host::Host;
use crate::serving::adapter_files::AdapterFiles;
use crate::weights::Weights;

/// What a weight sync reads and changes besides the pool.
pub struct Services<'a> {
    /// Where checkpoints are registered, listed and served to workers.
    pub weights: &'a Arc<Weights>,
    /// Folders on this machine for engines that read one (vLLM).
    pub folders: &'a AdapterFiles,
    /// The replicas' targets: what a replica that starts runs.
    pub manager: &'a PoolManager,
    /// The workers' URL for a revision's weights, and the config's folder.
    pub host: &'a Host,
}

/// A sync as asked.
pub struct SyncRequest {
    /// The checkpoint's URI; a relative `file://` is the config folder's.
    pub checkpoint: String,
    /// The version asked for.
    pub version: u64,
    /// The deadline for every replica to have it or be replaced.
    pub timeout: Duration,
    /// Replicas out of service at once.
    pub max_unavailable: usize,
}

/// What the sync did, as `POST /v1/pools/{pool}/weights` answers it.
#[derive(Debug, Serialize)]
pub struct SyncReport {
    /// The pool.
    pub pool: String,
    /// The version the pool now has: the one asked for, or the next one
    /// when that would go back (an older number, or the latest's number
    /// for another checkpoint).
    pub version: u64,
    /// The version asked for.
    pub asked_version: u64,
    /// The checkpoint, as resolved.
    pub checkpoint: String,
    /// How long the sync took.
    pub seconds: f64,
    /// Replicas that swapped in place.
    pub synced: usize,
    /// Replicas replaced by one that starts with the new weights.
    pub replaced: usize,
    /// Each replica's result.
    pub replicas: Vec<ReplicaSync>,
}

/// Syncs `asked` into `pool`'s warm replicas: the report, or why not (the
/// checkpoint cannot be opened or is empty, a sync is running, or no
/// replica could load it, in which case the pool keeps its version).
pub async fn sync_weights(
    s: &Services<'_>,
    pool: &Arc<Pool>,
    mut asked: SyncRequest,
) -> Result<SyncReport, Error> {
    if let Some(dir) = &s.host.workdir {
        warmgate_deploy::resolve_checkpoint(&mut asked.checkpoint, dir);
    }
    // Going back to an earlier checkpoint is a new version.
    let version = pool.version_for(asked.version, &asked.checkpoint);
    pool.check_sync(version)?;
    let revision = format!("v{version}");
    let fresh = s.weights.uri(&pool.name, &revision).is_none();
    s.weights
        .register(&pool.name, &revision, s.weights.open(&asked.checkpoint)?);
    let url = s.host.weights_url(&pool.name, &revision);
    let begun = match where_replicas_read(s, pool, &revision, &asked.checkpoint, url.clone()).await
    {
        Ok(at) => pool.begin_sync(version, at),
        Err(e) => Err(e),
    };
    if let Err(e) = begun {
        if fresh {
            s.weights.unregister(&pool.name, &revision);
        }
        return Err(e);
    }
    let commit = commit(s, pool, &revision, &asked.checkpoint, url, version);
    let started = Instant::now();
    let deadline = started + asked.timeout;
    let max_unavailable = asked.max_unavailable;
    let job = {
        let pool = pool.clone();
        tokio::spawn(async move { pool.sync_weights(max_unavailable, deadline, commit).await })
    };
    let outcome = job.await.map_err(|e| {
        Error::new(
            ErrorKind::ReplicaFailed,
            format!("the weight sync failed: {e}"),
        )
        .caused_by(e)
    })?;
    let results = outcome.replicas;
    if outcome.rolled_back {
        if fresh {
            s.weights.unregister(&pool.name, &revision);
        }
        return Err(rolled_back(pool, version, &asked.checkpoint, &results));
    }
    let synced = results.iter().filter(|r| r.ok).count();
    tracing::info!(pool = %pool.name, version, synced, replaced = results.len() - synced, "weight sync done");
    Ok(SyncReport {
        pool: pool.name.clone(),
        version,
        asked_version: asked.version,
        checkpoint: asked.checkpoint,
        seconds: started.elapsed().as_secs_f64(),
        synced,
        replaced: results.len() - synced,
        replicas: results,
    })
}

/// Where the replicas read the new weights: the workers' URL, and for
/// vLLM engines (which read a folder on this machine) a `file://`
/// checkpoint as it is or an object-store one pulled first. The
/// checkpoint must list, with files, before any replica is touched.
async fn where_replicas_read(
    s: &Services<'_>,
    pool: &Pool,
    revision: &str,
    checkpoint: &str,
    url: String,
) -> Result<WeightsAt, Error> {
    let files = s.weights.files(&pool.name, revision).await?;
    if files.items.is_empty() {
        return Err(Error::new(
            ErrorKind::BadRequest,
            format!("checkpoint {checkpoint} has no files"),
        ));
    }
    if pool.spec().weight_sync != WeightSync::Vllm {
        return Ok(WeightsAt::url(url));
    }
    let folder = s
        .folders
        .local_path(checkpoint)
        .await
        .map_err(|e| Error::new(ErrorKind::BadRequest, e))?;
    Ok(WeightsAt {
        url,
        folder: Some(folder),
    })
}

/// What happens once a replica has loaded the new version: older versions
/// are no longer served, and replicas that start from then on (on the
/// pool's target and its on-demand fallback's) read this one.
fn commit(
    s: &Services<'_>,
    pool: &Arc<Pool>,
    revision: &str,
    checkpoint: &str,
    url: String,
    version: u64,
) -> impl FnOnce() + Send + 'static {
    let (weights, manager, pool) = (s.weights.clone(), s.manager.clone(), pool.clone());
    let (revision, checkpoint) = (revision.to_string(), checkpoint.to_string());
    move || {
        weights.retain_only(&pool.name, &revision);
        pool.set_latest_checkpoint(&checkpoint);
        for target in std::iter::once(pool.target()).chain(pool.ondemand_target()) {
            manager.update_target(&target, |t| {
                t.env.insert("WARMGATE_WEIGHTS_URL".into(), url.clone());
                t.env
                    .insert("WARMGATE_WEIGHTS_VERSION".into(), version.to_string());
                t.checkpoint = Some(checkpoint.clone());
            });
        }
    }
}

/// The error of a sync no replica could load: the pool keeps its version.
fn rolled_back(pool: &Pool, version: u64, checkpoint: &str, results: &[ReplicaSync]) -> Error {
    let why: Vec<String> = results
        .iter()
        .map(|r| format!("{}: {}", r.replica, r.error.as_deref().unwrap_or("failed")))
        .collect();
    tracing::warn!(pool = %pool.name, version, "weight sync rolled back: no replica could load it");
    Error::new(
        ErrorKind::ReplicaFailed,
        format!(
            "no replica could load weights version {version} ({checkpoint}), so the sync was \
             rolled back: pool '{}' keeps version {} and the replicas that failed were replaced \
             on it. {}",
            pool.name,
            pool.status().weights_version,
            why.join("; ")
        ),
    )
    .no_retry()
}
