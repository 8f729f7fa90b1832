//! A pool's weight sync: the latest version rolled out to its replicas in
//! place, `max_unavailable` at a time, each after its tasks in flight end;
//! a replica that fails to load is replaced.

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use serde::Serialize;
use warmgate_deploy::WeightSync;
use warmgate_pool::ReplicaHandle;

use super::{Pool, PoolState};
use crate::error::{Error, ErrorKind};

/// Replicas that failed to load a version before any loaded it, after
/// which the sync is rolled back: one can be the replica's own fault (a
/// hang, an out-of-memory on a busy GPU), two are the checkpoint's.
const FAILURES_BEFORE_ROLLBACK: usize = 2;

/// Where a version's weights are: the URL workers fetch them from, and,
/// for an engine that reads a folder (`weight_sync = "vllm"`), that folder
/// on this machine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WeightsAt {
    /// `…/v1/weights/{pool}/v{N}` on the gateway.
    pub url: String,
    /// The checkpoint's folder, for vLLM's `reload_weights`.
    pub folder: Option<String>,
}

impl WeightsAt {
    /// Weights workers fetch from `url`.
    pub fn url(url: impl Into<String>) -> Self {
        WeightsAt {
            url: url.into(),
            folder: None,
        }
    }
}

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

/// How a weight sync ended.
#[derive(Debug, Clone)]
pub struct SyncOutcome {
    /// Each replica's turn.
    pub replicas: Vec<ReplicaSync>,
    /// No replica could load the new version: the pool keeps the one it
    /// had, and the failed replicas were replaced on it.
    pub rolled_back: bool,
}

impl Pool {
    /// The version a sync of `checkpoint` asked as `asked` becomes: the
    /// number asked, unless it would go back (an older number) or reuse
    /// the latest's number for another checkpoint; then the next one. A
    /// trainer that syncs an earlier checkpoint back moves forward to it;
    /// the latest's own checkpoint under an older number is the latest.
    pub fn version_for(&self, asked: u64, checkpoint: &str) -> u64 {
        let st = self.state.lock();
        let same = st.latest_checkpoint.as_deref() == Some(checkpoint);
        if same && asked <= st.latest_version {
            // The latest again, under an older number: nothing new.
            st.latest_version
        } else if asked < st.latest_version || (asked == st.latest_version && asked > 0) {
            st.latest_version + 1
        } else {
            asked
        }
    }

    /// Starts a weight sync to `version`, whose files workers fetch from
    /// `url`. The pool keeps its latest version (status, `max_staleness`,
    /// the replicas it starts) until a replica has loaded the new one.
    /// Refused while another sync runs, or for a version older than the
    /// latest ([`Pool::version_for`] picks one that is not); the latest
    /// itself may be synced again, to finish a sync that failed part way.
    pub fn begin_sync(&self, version: u64, url: WeightsAt) -> Result<(), Error> {
        let mut st = self.state.lock();
        self.refuse_sync(&st, version)?;
        st.syncing_to = Some(version);
        st.syncing_url = Some(url);
        Ok(())
    }

    /// Whether a sync to `version` would be refused now, and why.
    pub fn check_sync(&self, version: u64) -> Result<(), Error> {
        self.refuse_sync(&self.state.lock(), version)
    }

    fn refuse_sync(&self, st: &PoolState, version: u64) -> Result<(), Error> {
        if let Some(v) = st.syncing_to {
            return Err(Error::new(
                ErrorKind::Conflict,
                format!(
                    "pool '{}' is already syncing weights version {v}; wait for it to finish",
                    self.name
                ),
            ));
        }
        if version < st.latest_version {
            return Err(Error::new(
                ErrorKind::Conflict,
                format!(
                    "pool '{}' already has weights version {}; a sync must name that version or a newer one, not {version}",
                    self.name, st.latest_version
                ),
            ));
        }
        Ok(())
    }

    /// Rolls the version being synced out to every ready replica behind
    /// it, at most `max_unavailable` at a time so the rest keep taking
    /// tasks. Each replica finishes its tasks in flight, then loads the
    /// weights through its `POST /weights`.
    ///
    /// The new version is proven by the first replica that loads it: only
    /// then does it become the pool's latest, and `commit` runs (new
    /// replicas start with it, the old one is no longer served). If
    /// [`FAILURES_BEFORE_ROLLBACK`] replicas (or every one tried) fail
    /// before that, the sync stops and rolls back: the pool keeps its
    /// version, and the failed replicas are replaced on it. A replica that fails after the proof, or has not
    /// finished by `deadline`, is replaced by one that starts with the
    /// new weights. With no replica ready there is nothing to prove it
    /// on: it is committed at once, and replicas start with it.
    pub async fn sync_weights(
        self: &Arc<Self>,
        max_unavailable: usize,
        deadline: Instant,
        commit: impl FnOnce() + Send,
    ) -> SyncOutcome {
        let (version, url, mut proven) = {
            let st = self.state.lock();
            let version = st.syncing_to.unwrap_or(st.latest_version);
            (
                version,
                st.syncing_url
                    .clone()
                    .unwrap_or_else(|| WeightsAt::url(String::new())),
                version <= st.latest_version,
            )
        };
        // The replicas the sync is for: ones that become ready meanwhile
        // (a failed replica's successor) are caught up after it, on a
        // deadline of their own.
        let members: HashSet<String> = self
            .state
            .lock()
            .replicas
            .iter()
            .map(|r| r.id.clone())
            .collect();
        let mut commit = Some(commit);
        let mut results: Vec<ReplicaSync> = Vec::new();
        let mut tried: HashSet<String> = HashSet::new();
        let mut rolled_back = false;
        loop {
            if !proven && !results.is_empty() && Instant::now() >= deadline {
                // Out of time before any replica loaded it: the rest are
                // left as they are, on the version the pool keeps.
                rolled_back = true;
                break;
            }
            let batch = self.next_round(&members, &tried, version, max_unavailable);
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
            let any_ok = round.iter().any(|r| r.ok);
            results.extend(round);
            if !proven {
                if !any_ok {
                    // One replica failing may be the replica's fault (a
                    // hang, a busy GPU); two say it is the checkpoint's.
                    if self.checkpoint_at_fault(results.len(), &members, &tried) {
                        rolled_back = true;
                        self.notify();
                        break;
                    }
                    self.notify();
                    continue;
                }
                proven = true;
                self.make_latest(version, &url);
                if let Some(commit) = commit.take() {
                    commit();
                }
            }
            self.notify();
        }
        if !proven && !rolled_back {
            // Nothing ready to prove it on: replicas start with it.
            self.make_latest(version, &url);
            if let Some(commit) = commit.take() {
                commit();
            }
        }
        self.end_sync(&results);
        SyncOutcome {
            replicas: results,
            rolled_back,
        }
    }

    /// The next round of the sync: up to `max_unavailable` ready members
    /// not tried yet, not syncing, and behind `version`, marked syncing.
    fn next_round(
        &self,
        members: &HashSet<String>,
        tried: &HashSet<String>,
        version: u64,
        max_unavailable: usize,
    ) -> Vec<Arc<ReplicaHandle>> {
        let mut st = self.state.lock();
        let picked: Vec<_> = st
            .replicas
            .iter()
            .filter(|r| {
                r.is_routable()
                    && members.contains(&r.id)
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
    }

    /// Whether `failed` replicas failing before any loaded the version say
    /// it is the checkpoint's fault: one may be the replica's (a hang, a
    /// busy GPU), [`FAILURES_BEFORE_ROLLBACK`] are not, nor is every
    /// member failing.
    fn checkpoint_at_fault(
        &self,
        failed: usize,
        members: &HashSet<String>,
        tried: &HashSet<String>,
    ) -> bool {
        let untried = self
            .state
            .lock()
            .replicas
            .iter()
            .any(|r| members.contains(&r.id) && !tried.contains(&r.id));
        failed >= FAILURES_BEFORE_ROLLBACK || !untried
    }

    /// The sync is over: replicas that became ready during it (a failed
    /// replica's successor, started before the proof on the old weights)
    /// were in no round and are caught up now; the counters are told.
    fn end_sync(self: &Arc<Self>, results: &[ReplicaSync]) {
        let behind: Vec<Arc<ReplicaHandle>> = {
            let mut st = self.state.lock();
            st.syncing_to = None;
            st.syncing_url = None;
            st.replicas.clone()
        };
        for r in &behind {
            self.catch_up(r);
        }
        self.notify();
        let ok = results.iter().filter(|r| r.ok).count();
        metrics::counter!("warmgate_weight_syncs_total", "pool" => self.name.clone()).increment(1);
        metrics::counter!("warmgate_weight_sync_replicas_total", "pool" => self.name.clone(), "outcome" => "synced")
            .increment(ok as u64);
        metrics::counter!("warmgate_weight_sync_replicas_total", "pool" => self.name.clone(), "outcome" => "replaced")
            .increment((results.len() - ok) as u64);
    }

    /// `version` is the pool's latest from now on.
    pub(super) fn make_latest(&self, version: u64, url: &WeightsAt) {
        let mut st = self.state.lock();
        st.latest_version = st.latest_version.max(version);
        st.latest_url = Some(url.clone());
    }

    /// The checkpoint the latest version came from.
    pub fn set_latest_checkpoint(&self, checkpoint: &str) {
        self.state.lock().latest_checkpoint = Some(checkpoint.to_string());
    }

    /// Swaps one replica's weights in place: waits for its tasks in flight
    /// (it takes no new ones meanwhile), then asks it to load `version` from
    /// `url`. Replaces it when that fails or runs past `deadline`.
    pub(super) async fn sync_replica(
        &self,
        r: &Arc<ReplicaHandle>,
        url: &WeightsAt,
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
        url: &WeightsAt,
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
    /// Loads `version` into `r` in place, the way its pool's replicas take
    /// weights (`weight_sync`).
    async fn load_weights(
        &self,
        r: &ReplicaHandle,
        at: &WeightsAt,
        version: u64,
    ) -> Result<(), String> {
        let loaded = match self.spec().weight_sync {
            WeightSync::Worker => self.client.load_weights(&r.addr, &at.url, version).await,
            WeightSync::Vllm => {
                let Some(folder) = &at.folder else {
                    return Err("no folder of this version for vLLM to read".into());
                };
                self.client.vllm_reload(&r.addr, folder, version).await
            }
        };
        loaded.map_err(|e| e.to_string())
    }
}
