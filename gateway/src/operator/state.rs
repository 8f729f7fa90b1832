//! The operator's state store: each app's revision history, promotion and
//! notes in the API server, so they outlive every operator pod.
//!
//! All of an instance's state lives in one Secret (`<release>-state`, which
//! the chart creates), a key per app (`<app>.json`). Why a Secret: the
//! history is not status (it cannot be rebuilt by looking at the cluster,
//! which Kubernetes asks of status), it carries the app specs whose `env`
//! may hold credentials, and Helm keeps its release history the same way.
//! Why one: the Role can then name it (`resourceNames`), so the operator
//! reads and writes that Secret and no other. The leader writes it with a
//! server-side apply before it acts on a step; the whole state is bounded
//! by [`MAX_STATE_BYTES`], the oldest idle revisions and notes going first.
//!
//! The store's interface is synchronous (the SQLite one's is), so a write
//! waits for the API server on the calling worker thread
//! ([`tokio::task::block_in_place`]), for at most [`WRITE_TIMEOUT`]. Writes
//! are control-plane steps (a promotion step, a changed spec), never on a
//! request's path. Reads come from memory (what was read at start and what
//! this process wrote since) and never wait on a write. Each write applies
//! over the `resourceVersion` last seen, so a deposed leader that still
//! reaches the API server is refused rather than writing over the next.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, ObjectMeta, Patch, PatchParams};
use warmgate_deploy::revision::History;
use warmgate_deploy::store::{Note, Overlay, SpecKind, StateStore, StoreError, unix_now};

/// How long a write waits for the API server.
pub const WRITE_TIMEOUT: Duration = Duration::from_secs(10);

/// Notes kept per app (the API shows the last 50).
pub const NOTES_KEPT: usize = 100;

/// The most the whole state may take: under the API server's 1 MiB limit
/// on a Secret, with room for its metadata.
pub const MAX_STATE_BYTES: usize = 900 * 1024;

/// What one app's key holds.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
struct AppState {
    history: History,
    #[serde(default)]
    notes: Vec<Note>,
}

/// The key of `app`'s state in the Secret.
fn key(app: &str) -> String {
    format!("{app}.json")
}

/// Revision histories and promotions in one Secret in the API server.
pub struct KubeState {
    api: Api<Secret>,
    name: String,
    /// What was read and written; readers never wait on a write.
    held: parking_lot::RwLock<Held>,
    /// One write at a time, from read to answer.
    writing: parking_lot::Mutex<()>,
}

#[derive(Clone, Default)]
struct Held {
    /// By app, its state.
    apps: BTreeMap<String, AppState>,
    /// By app, a stored state this version cannot read: why, and its
    /// bytes, written back as they were.
    unreadable: BTreeMap<String, (String, Vec<u8>)>,
    /// The Secret's `resourceVersion` as last read or written: a write
    /// applies only over it, so a deposed leader that still reaches the
    /// API server cannot write over its successor.
    version: Option<String>,
}

impl KubeState {
    /// Reads the Secret `name` (none yet: no state).
    pub async fn load(api: Api<Secret>, name: &str) -> Result<KubeState, kube::Error> {
        let mut held = Held::default();
        if let Some(secret) = api.get_opt(name).await? {
            held.version = secret.metadata.resource_version.clone();
            for (k, v) in secret.data.unwrap_or_default() {
                let Some(app) = k.strip_suffix(".json") else {
                    continue;
                };
                match serde_json::from_slice::<AppState>(&v.0) {
                    Ok(state) => {
                        held.apps.insert(app.to_string(), state);
                    }
                    Err(e) => {
                        let e = format!("Secret {name}'s key {k} is unreadable: {e}");
                        tracing::error!(%app, error = %e, "the app's state in the cluster is unreadable; the app will not start until the key is fixed or removed");
                        held.unreadable.insert(app.to_string(), (e, v.0));
                    }
                }
            }
        }
        Ok(KubeState {
            api,
            name: name.to_string(),
            held: parking_lot::RwLock::new(held),
            writing: parking_lot::Mutex::new(()),
        })
    }

    /// The Secret holding `apps`, as this process applies it: its data
    /// only, so the labels and annotations the chart gives it stay the
    /// chart's.
    fn secret(&self, apps: &BTreeMap<String, Vec<u8>>, version: Option<String>) -> Secret {
        Secret {
            metadata: ObjectMeta {
                name: Some(self.name.clone()),
                resource_version: version,
                ..ObjectMeta::default()
            },
            data: Some(
                apps.iter()
                    .map(|(app, body)| (key(app), ByteString(body.clone())))
                    .collect(),
            ),
            ..Secret::default()
        }
    }
}

/// Every app's state as JSON, made to fit in `limit` bytes: from the
/// biggest app, its oldest revision that neither takes traffic nor takes
/// part in a promotion goes first, then its oldest note. `None` when even
/// that is not enough.
fn fit(apps: &mut BTreeMap<String, AppState>, limit: usize) -> Option<BTreeMap<String, Vec<u8>>> {
    loop {
        let bodies: BTreeMap<String, Vec<u8>> = apps
            .iter()
            .map(|(a, s)| (a.clone(), serde_json::to_vec(s).unwrap_or_default()))
            .collect();
        let total: usize = bodies.iter().map(|(a, b)| a.len() + b.len()).sum();
        if total <= limit {
            return Some(bodies);
        }
        let mut by_size: Vec<(&String, usize)> = bodies.iter().map(|(a, b)| (a, b.len())).collect();
        by_size.sort_by_key(|&(_, n)| std::cmp::Reverse(n));
        let cut = by_size.iter().find_map(|&(app, _)| {
            let s = &apps[app];
            let busy = |id: &str| {
                s.history
                    .promotion
                    .as_ref()
                    .is_some_and(|p| p.to == id || p.from.as_deref() == Some(id))
            };
            if let Some(i) = s
                .history
                .revisions
                .iter()
                .position(|r| r.traffic == 0 && !busy(&r.id))
            {
                Some((app.clone(), Some(i)))
            } else if !s.notes.is_empty() {
                Some((app.clone(), None))
            } else {
                None
            }
        })?;
        let s = apps.get_mut(&cut.0).expect("listed");
        match cut.1 {
            Some(i) => {
                s.history.revisions.remove(i);
            }
            None => {
                s.notes.remove(0);
            }
        }
    }
}

/// Runs `f` to its end on this thread, for at most [`WRITE_TIMEOUT`].
fn wait<F: std::future::Future>(f: F) -> Result<F::Output, StoreError> {
    use tokio::runtime::{Handle, RuntimeFlavor};
    let handle = Handle::try_current()
        .map_err(|_| StoreError::Cluster("no runtime to reach the API server on".into()))?;
    if handle.runtime_flavor() != RuntimeFlavor::MultiThread {
        return Err(StoreError::Cluster(
            "the state store in the cluster needs the multi-threaded runtime".into(),
        ));
    }
    tokio::task::block_in_place(|| handle.block_on(tokio::time::timeout(WRITE_TIMEOUT, f))).map_err(
        |_| {
            StoreError::Cluster(format!(
                "the API server did not answer within {}s",
                WRITE_TIMEOUT.as_secs()
            ))
        },
    )
}

impl StateStore for KubeState {
    fn load(&self, app: &str) -> Result<History, StoreError> {
        let held = self.held.read();
        if let Some((e, _)) = held.unreadable.get(app) {
            return Err(StoreError::Cluster(e.clone()));
        }
        Ok(held
            .apps
            .get(app)
            .map(|s| s.history.clone())
            .unwrap_or_default())
    }

    fn save(&self, app: &str, h: &History, note: &str) -> Result<(), StoreError> {
        let _one = self.writing.lock();
        let held = self.held.read().clone();
        if let Some((e, _)) = held.unreadable.get(app) {
            return Err(StoreError::Cluster(e.clone()));
        }
        let mut next = held.apps.get(app).cloned().unwrap_or_default();
        next.history = h.clone();
        if !note.is_empty() {
            next.notes.push(Note {
                at_unix: unix_now(),
                what: note.to_string(),
            });
            let extra = next.notes.len().saturating_sub(NOTES_KEPT);
            next.notes.drain(..extra);
        }
        // The Secret is written whole: every app's state with this one's
        // next, and the keys this version cannot read as they were.
        let mut all = held.apps.clone();
        all.insert(app.to_string(), next);
        let kept: usize = held
            .unreadable
            .iter()
            .map(|(a, (_, raw))| a.len() + raw.len())
            .sum();
        let mut bodies = fit(&mut all, MAX_STATE_BYTES.saturating_sub(kept)).ok_or_else(|| {
            StoreError::Cluster(format!(
                "the apps' live revisions and promotions alone exceed {MAX_STATE_BYTES} bytes, more than a Secret holds"
            ))
        })?;
        for (a, (_, raw)) in &held.unreadable {
            bodies.insert(a.clone(), raw.clone());
        }
        let secret = self.secret(&bodies, held.version.clone());
        let params = PatchParams::apply("warmgate").force();
        let written = wait(self.api.patch(&self.name, &params, &Patch::Apply(&secret)))?
            .map_err(|e| match e {
                kube::Error::Api(a) if a.code == 409 => StoreError::Cluster(format!(
                    "Secret {} changed since this operator read it (another leader wrote it); this one must not write over it",
                    self.name
                )),
                e => StoreError::Cluster(format!("write Secret {}: {e}", self.name)),
            })?;
        let mut held = self.held.write();
        held.apps = all;
        held.version = written.metadata.resource_version;
        Ok(())
    }

    fn notes(&self, app: &str, limit: usize) -> Result<Vec<Note>, StoreError> {
        let held = self.held.read();
        if let Some((e, _)) = held.unreadable.get(app) {
            return Err(StoreError::Cluster(e.clone()));
        }
        Ok(held.apps.get(app).map_or_else(Vec::new, |s| {
            let skip = s.notes.len().saturating_sub(limit);
            s.notes[skip..].to_vec()
        }))
    }

    fn record_spec(
        &self,
        _kind: SpecKind,
        _name: &str,
        _body: Option<&str>,
        _note: &str,
    ) -> Result<(), StoreError> {
        Err(StoreError::Unsupported(
            "under the operator, apps and pools change through their ServingApp and WarmPool resources",
        ))
    }

    fn forget_spec(&self, _kind: SpecKind, _name: &str) -> Result<(), StoreError> {
        Ok(())
    }

    fn overlay(&self) -> Result<Overlay, StoreError> {
        // The resources are the whole truth.
        Ok(Overlay::default())
    }

    fn clear_overlay(&self) -> Result<(), StoreError> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use warmgate_deploy::revision::{Revision, RevisionState};

    fn rev(app: &str, seq: u32, traffic: u8, spec_bytes: usize) -> Revision {
        Revision {
            id: format!("{app}-{seq:05}"),
            app: app.into(),
            seq,
            checkpoint: None,
            checkpoint_version: None,
            spec: "x".repeat(spec_bytes),
            created_unix: 0.0,
            state: RevisionState::Retired,
            traffic,
            served: true,
        }
    }

    #[test]
    fn a_state_too_big_for_a_secret_loses_the_biggest_app_s_oldest_idle_revisions_first() {
        let mut apps = BTreeMap::new();
        // a: 30 revisions of 50 KB (1.5 MB), the serving one the oldest;
        // b: one small one.
        let mut a = AppState::default();
        a.history.revisions.push(rev("a", 1, 100, 50_000));
        for seq in 2..=30 {
            a.history.revisions.push(rev("a", seq, 0, 50_000));
        }
        a.notes.push(Note {
            at_unix: 0.0,
            what: "n".into(),
        });
        apps.insert("a".to_string(), a);
        let mut b = AppState::default();
        b.history.revisions.push(rev("b", 1, 100, 100));
        b.history.revisions.push(rev("b", 2, 0, 100));
        apps.insert("b".to_string(), b.clone());
        let bodies = fit(&mut apps, MAX_STATE_BYTES).expect("it fits");
        let total: usize = bodies.iter().map(|(k, v)| k.len() + v.len()).sum();
        assert!(total <= MAX_STATE_BYTES);
        let ids: Vec<u32> = apps["a"].history.revisions.iter().map(|r| r.seq).collect();
        assert_eq!(ids[0], 1, "the serving revision is kept");
        assert_eq!(*ids.last().expect("some"), 30, "the newest are kept");
        assert!(ids.len() < 30);
        assert_eq!(
            apps["a"].notes.len(),
            1,
            "notes go only when no revision can"
        );
        assert_eq!(apps["b"], b, "the small app is not touched");

        // Live revisions alone too big: refused, not cut.
        let mut live = AppState::default();
        live.history.revisions.push(rev("c", 1, 50, 600_000));
        live.history.revisions.push(rev("c", 2, 50, 600_000));
        let mut apps = BTreeMap::from([("c".to_string(), live)]);
        assert!(fit(&mut apps, MAX_STATE_BYTES).is_none());
    }
}
