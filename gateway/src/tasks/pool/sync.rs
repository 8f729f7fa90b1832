//! A pool's weight sync: the latest version rolled out to its replicas in
//! place, `max_unavailable` at a time, each after its tasks in flight end;
//! a replica that fails to load is replaced.

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use serde::Serialize;
use warmgate_pool::ReplicaHandle;

use super::{Pool, PoolState};
use crate::error::{ApiError, ErrorKind};

/// How one replica's weight sync went.
#[derive(Debug, Clone, Serialize)]
pub struct ReplicaSync {
    /// Replica id.
    pub replica: String,
    /// Whether it now runs the new weights.
    pub ok: bool,
    /// Its version before.
    pub from_version: u64,
    /// Its version after, when it loaded.
    pub version: Option<u64>,
    /// Seconds from the start of its turn (draining included).
    pub seconds: f64,
    /// Why it failed.
    pub error: Option<String>,
    /// `synced`, or `replaced` when it failed.
    pub action: &'static str,
}

impl Pool {
    /// Starts a weight sync to `version`, whose files workers fetch from
    /// `url`: from now on it is the pool's latest version (so
    /// `max_staleness` counts from it) and new replicas start with it.
    /// Refused while another sync runs, or for a version older than the
    /// latest; the latest itself may be synced again, to finish a sync that
    /// failed part way.
    pub fn begin_sync(&self, version: u64, url: String) -> Result<(), ApiError> {
        let mut st = self.state.lock();
        self.refuse_sync(&st, version)?;
        st.latest_version = version;
        st.latest_url = Some(url);
        st.syncing_to = Some(version);
        Ok(())
    }

    /// Whether a sync to `version` would be refused now, and why.
    pub fn check_sync(&self, version: u64) -> Result<(), ApiError> {
        self.refuse_sync(&self.state.lock(), version)
    }

    fn refuse_sync(&self, st: &PoolState, version: u64) -> Result<(), ApiError> {
        if let Some(v) = st.syncing_to {
            return Err(ApiError::new(
                ErrorKind::Conflict,
                format!(
                    "pool '{}' is already syncing weights version {v}; wait for it to finish",
                    self.name
                ),
            ));
        }
        if version < st.latest_version {
            return Err(ApiError::new(
                ErrorKind::Conflict,
                format!(
                    "pool '{}' already has weights version {}; a sync must name that version or a newer one, not {version}",
                    self.name, st.latest_version
                ),
            ));
        }
        Ok(())
    }

    /// Rolls the latest weights out to every ready replica behind it, at
    /// most `max_unavailable` at a time so the rest keep taking tasks. Each
    /// replica finishes its tasks in flight, then loads the weights through
    /// its `POST /weights`. One that fails, or has not finished by
    /// `deadline`, is replaced: its successor starts with the new weights.
    pub async fn sync_weights(
        self: &Arc<Self>,
        max_unavailable: usize,
        deadline: Instant,
    ) -> Vec<ReplicaSync> {
        let (version, url) = {
            let st = self.state.lock();
            (st.latest_version, st.latest_url.clone().unwrap_or_default())
        };
        let mut results: Vec<ReplicaSync> = Vec::new();
        let mut tried: HashSet<String> = HashSet::new();
        loop {
            let batch: Vec<Arc<ReplicaHandle>> = {
                let mut st = self.state.lock();
                let picked: Vec<_> = st
                    .replicas
                    .iter()
                    .filter(|r| {
                        r.is_routable()
                            && !tried.contains(&r.id)
                            && !st.syncing.contains(&r.id)
                            && r.weights_version.load(Ordering::Relaxed) < version
                    })
                    .take(max_unavailable.max(1))
                    .cloned()
                    .collect();
                for r in &picked {
                    st.syncing.insert(r.id.clone());
                }
                picked
            };
            if batch.is_empty() {
                break;
            }
            let round = futures_util::future::join_all(batch.iter().map(|r| {
                tried.insert(r.id.clone());
                self.sync_replica(r, &url, version, deadline)
            }))
            .await;
            {
                let mut st = self.state.lock();
                for r in &batch {
                    st.syncing.remove(&r.id);
                }
            }
            self.notify();
            results.extend(round);
        }
        self.state.lock().syncing_to = None;
        self.notify();
        let ok = results.iter().filter(|r| r.ok).count();
        metrics::counter!("warmgate_weight_syncs_total", "pool" => self.name.clone()).increment(1);
        metrics::counter!("warmgate_weight_sync_replicas_total", "pool" => self.name.clone(), "outcome" => "synced")
            .increment(ok as u64);
        metrics::counter!("warmgate_weight_sync_replicas_total", "pool" => self.name.clone(), "outcome" => "replaced")
            .increment((results.len() - ok) as u64);
        results
    }

    /// Swaps one replica's weights in place: waits for its tasks in flight
    /// (it takes no new ones meanwhile), then asks it to load `version` from
    /// `url`. Replaces it when that fails or runs past `deadline`.
    pub(super) async fn sync_replica(
        &self,
        r: &Arc<ReplicaHandle>,
        url: &str,
        version: u64,
        deadline: Instant,
    ) -> ReplicaSync {
        let started = Instant::now();
        let from = r.weights_version.load(Ordering::Relaxed);
        let outcome = if started >= deadline {
            Err("the sync's deadline passed before this replica's turn".to_string())
        } else {
            self.load_within(r, url, version, started, deadline).await
        };
        let seconds = started.elapsed().as_secs_f64();
        match outcome {
            Ok(()) => {
                r.weights_version.fetch_max(version, Ordering::Relaxed);
                metrics::histogram!("warmgate_weight_sync_seconds", "pool" => self.name.clone())
                    .record(seconds);
                ReplicaSync {
                    replica: r.id.clone(),
                    ok: true,
                    from_version: from,
                    version: Some(version),
                    seconds,
                    error: None,
                    action: "synced",
                }
            }
            Err(why) => {
                tracing::warn!(pool = %self.name, replica = %r.id, version, error = %why, "weight sync failed; replacing the replica");
                r.set_unroutable();
                if let Some(replace) = self.replacer.get() {
                    replace(
                        r,
                        &format!("weight sync to version {version} failed: {why}"),
                    );
                }
                ReplicaSync {
                    replica: r.id.clone(),
                    ok: false,
                    from_version: from,
                    version: None,
                    seconds,
                    error: Some(why),
                    action: "replaced",
                }
            }
        }
    }

    /// Waits for the replica's tasks in flight, then loads; by `deadline`.
    async fn load_within(
        &self,
        r: &ReplicaHandle,
        url: &str,
        version: u64,
        started: Instant,
        deadline: Instant,
    ) -> Result<(), String> {
        tokio::time::timeout_at(deadline.into(), async {
            r.wait_idle(deadline.into()).await;
            self.load_weights(r, url, version).await
        })
        .await
        .unwrap_or_else(|_| {
            Err(format!(
                "did not load the weights before the sync's deadline ({:.1}s after its turn began)",
                deadline.saturating_duration_since(started).as_secs_f64()
            ))
        })
    }

    /// `POST /weights {"url", "version"}` to a worker.
    async fn load_weights(&self, r: &ReplicaHandle, url: &str, version: u64) -> Result<(), String> {
        self.client
            .load_weights(r.addr, url, version)
            .await
            .map_err(|e| e.to_string())
    }
}
