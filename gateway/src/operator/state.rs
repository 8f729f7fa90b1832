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
//! by [`MAX_STATE_BYTES`].
//!
//! **Fencing.** Each write applies over the `resourceVersion` last seen. A
//! new leader writes the state back, under its own name
//! ([`LEADER_ANNOTATION`]), as soon as it has read it (its claim), so a
//! deposed leader that still reaches the API server is refused from
//! then on. A write refused or unanswered is checked against the Secret
//! read again: if another leader has claimed it since, or changed its
//! data, this one stops writing; if it holds what was written (the answer
//! was lost), the write counts; if only its other metadata changed (a
//! label, by hand or by Helm), it is tried again over the new version.
//!
//! **Threads.** The store's interface is synchronous (the SQLite one's
//! is), and its callers may hold locks other tasks wait on. So the API
//! calls run on a thread of their own, with a runtime and an API client of
//! their own: a write never needs the gateway's worker threads to finish,
//! whatever they are blocked on. The caller waits for the answer (out of
//! the runtime's way, [`tokio::task::block_in_place`]) for at most
//! [`WRITE_TIMEOUT`]. Reads come from memory (what was read at start and
//! what this process wrote since) and never wait on the API server.

use std::collections::BTreeMap;
use std::sync::mpsc;
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

/// The most one app's state may take, so one app (a huge `env` in every
/// revision, say) cannot crowd out the others' promotions: a quarter of
/// the whole. Past it the app loses its idle revisions and notes; its
/// live revisions alone may take more while the whole fits.
pub const MAX_APP_STATE_BYTES: usize = MAX_STATE_BYTES / 4;

/// The annotation naming the leader that last claimed the state.
pub const LEADER_ANNOTATION: &str = "warmgate.dev/leader";

/// How often a claim or a write is tried over a version that moved.
const ATTEMPTS: usize = 5;

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

/// The Secret's data, by key.
type Data = BTreeMap<String, Vec<u8>>;

/// A call for the API thread.
enum Job {
    Get,
    Apply(Box<Secret>),
}

/// A job, the time after which nobody waits for it, and where its answer
/// goes.
type Queued = (Job, std::time::Instant, mpsc::SyncSender<Reply>);

type Reply = Result<Option<Secret>, kube::Error>;

/// Revision histories and promotions in one Secret in the API server.
pub struct KubeState {
    name: String,
    /// This operator, as its claim names it.
    identity: String,
    jobs: mpsc::Sender<Queued>,
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
    /// The Secret's data as last read or written.
    data: Data,
    /// Its `resourceVersion` then.
    version: Option<String>,
}

impl Held {
    fn from_secret(name: &str, secret: Option<Secret>) -> Held {
        let mut held = Held::default();
        let Some(secret) = secret else {
            return held;
        };
        held.version = secret.metadata.resource_version.clone();
        for (k, v) in secret.data.unwrap_or_default() {
            held.data.insert(k.clone(), v.0.clone());
            let Some(app) = k.strip_suffix(".json") else {
                continue;
            };
            match serde_json::from_slice::<AppState>(&v.0) {
                Ok(state) => {
                    held.apps.insert(app.to_string(), state);
                }
                Err(e) => {
                    let e = format!("Secret {name}'s key {k} is unreadable: {e}");
                    tracing::error!(%app, error = %e, "the app's state in the cluster is unreadable; the app is refused until the key is fixed or removed");
                    held.unreadable.insert(app.to_string(), (e, v.0));
                }
            }
        }
        held
    }
}

/// Runs `job` on the API thread and waits for its answer, out of the
/// runtime's way, until `deadline`; a job not begun by then is dropped
/// there, and one under way is cut off at it.
fn call(
    jobs: &mpsc::Sender<Queued>,
    job: Job,
    deadline: std::time::Instant,
) -> Result<Reply, StoreError> {
    let (tx, rx) = mpsc::sync_channel(1);
    jobs.send((job, deadline, tx))
        .map_err(|_| StoreError::Cluster("the state store's API thread stopped".into()))?;
    let got = out_of_the_way(|| {
        rx.recv_timeout(deadline.saturating_duration_since(std::time::Instant::now()))
    });
    got.map_err(|e| match e {
        mpsc::RecvTimeoutError::Timeout => StoreError::Cluster(format!(
            "the API server did not answer within {}s",
            WRITE_TIMEOUT.as_secs()
        )),
        mpsc::RecvTimeoutError::Disconnected => {
            StoreError::Cluster("the state store's API thread stopped".into())
        }
    })
}

/// Runs `f`, which blocks, out of the runtime's way when on one of its
/// worker threads.
fn out_of_the_way<T>(f: impl FnOnce() -> T) -> T {
    use tokio::runtime::{Handle, RuntimeFlavor};
    match Handle::try_current() {
        Ok(h) if h.runtime_flavor() == RuntimeFlavor::MultiThread => tokio::task::block_in_place(f),
        _ => f(),
    }
}

/// The thread that makes every API call, on a runtime and a client of its
/// own.
fn spawn_api_thread<F>(
    client: F,
    namespace: String,
    name: String,
) -> std::io::Result<mpsc::Sender<Queued>>
where
    F: FnOnce() -> Result<kube::Client, String> + Send + 'static,
{
    let (jobs, rx) = mpsc::channel::<Queued>();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    std::thread::Builder::new()
        .name("warmgate-state".into())
        .spawn(move || {
            // The client's own tasks live on this runtime.
            let api: Result<Api<Secret>, String> =
                rt.block_on(async { client().map(|c| Api::namespaced(c, &namespace)) });
            let params = PatchParams::apply("warmgate").force();
            while let Ok((job, deadline, reply)) = rx.recv() {
                // Nobody waits for it any more: a write left in the queue
                // must not land behind the writer's back.
                let Some(left) = deadline.checked_duration_since(std::time::Instant::now()) else {
                    continue;
                };
                let api = match &api {
                    Ok(api) => api,
                    Err(e) => {
                        tracing::error!(error = %e, "the state store has no API client");
                        drop(reply);
                        continue;
                    }
                };
                let answer = rt.block_on(async {
                    let run = async {
                        match job {
                            Job::Get => api.get_opt(&name).await,
                            Job::Apply(s) => api
                                .patch(&name, &params, &Patch::Apply(&*s))
                                .await
                                .map(Some),
                        }
                    };
                    tokio::time::timeout(left, run).await
                });
                if let Ok(answer) = answer {
                    let _ = reply.send(answer);
                }
            }
        })?;
    Ok(jobs)
}

impl KubeState {
    /// Reads the Secret `name` in `namespace` (none yet: no state) and
    /// claims it for `identity` (the annotation [`LEADER_ANNOTATION`]).
    /// Every API call goes through a client `client` makes on the store's
    /// own thread.
    pub async fn load<F>(
        client: F,
        namespace: &str,
        name: &str,
        identity: &str,
    ) -> Result<KubeState, StoreError>
    where
        F: FnOnce() -> Result<kube::Client, String> + Send + 'static,
    {
        let jobs = spawn_api_thread(client, namespace.to_string(), name.to_string())
            .map_err(|e| StoreError::Cluster(format!("start the state store's thread: {e}")))?;
        let store = KubeState {
            name: name.to_string(),
            // One process, even in a pod of the same name restarted.
            identity: format!("{identity}-{:08x}", fastrand::u32(..)),
            jobs,
            held: parking_lot::RwLock::new(Held::default()),
            writing: parking_lot::Mutex::new(()),
        };
        let jobs = store.jobs.clone();
        let name = store.name.clone();
        let held = tokio::task::spawn_blocking(move || -> Result<Held, StoreError> {
            let deadline = std::time::Instant::now() + WRITE_TIMEOUT;
            let secret = call(&jobs, Job::Get, deadline)?
                .map_err(|e| StoreError::Cluster(format!("read Secret {name}: {e}")))?;
            Ok(Held::from_secret(&name, secret))
        })
        .await
        .map_err(|e| StoreError::Cluster(format!("read the state: {e}")))??;
        *store.held.write() = held;
        // The claim: the data as it is, under this process's name, a
        // change that moves the version past anything a deposed leader
        // saw. A deposed leader's write landing first is taken over.
        store.write(true, |h| Ok(h.clone()))?;
        Ok(store)
    }

    /// The Secret holding `data` over `version`, as this process applies
    /// it: its data only, so the labels and annotations the chart gives it
    /// stay the chart's.
    fn secret(&self, data: &Data, version: Option<String>) -> Secret {
        Secret {
            metadata: ObjectMeta {
                name: Some(self.name.clone()),
                resource_version: version,
                annotations: Some(BTreeMap::from([(
                    LEADER_ANNOTATION.to_string(),
                    self.identity.clone(),
                )])),
                ..ObjectMeta::default()
            },
            data: Some(
                data.iter()
                    .map(|(k, v)| (k.clone(), ByteString(v.clone())))
                    .collect(),
            ),
            ..Secret::default()
        }
    }

    /// Writes what `next` makes of the state held (the next state, its
    /// `data` the Secret's), over the version held, with the module's
    /// fencing, and holds it once written. A refused write, or one whose
    /// outcome is unknown, reads the Secret again and holds what it finds:
    /// claimed by another leader, this one stops (unless `claim`: taking
    /// over); holding what was written, it counts; otherwise `next` is
    /// made again over what is there (a hand edit, a write whose answer was
    /// lost) and applied again. All within [`WRITE_TIMEOUT`].
    fn write(
        &self,
        claim: bool,
        next: impl Fn(&Held) -> Result<Held, StoreError>,
    ) -> Result<(), StoreError> {
        let _one = out_of_the_way(|| self.writing.lock());
        let deadline = std::time::Instant::now() + WRITE_TIMEOUT;
        let deposed = || {
            StoreError::Cluster(format!(
                "Secret {} was claimed by another leader since this operator read it; this one must not write over it",
                self.name
            ))
        };
        for _ in 0..ATTEMPTS {
            let held = self.held.read().clone();
            let mut made = next(&held)?;
            let secret = self.secret(&made.data, held.version.clone());
            let refused = match call(&self.jobs, Job::Apply(Box::new(secret)), deadline) {
                Ok(Ok(Some(written))) => {
                    made.version = written.metadata.resource_version;
                    *self.held.write() = made;
                    return Ok(());
                }
                Ok(Ok(None)) => {
                    StoreError::Cluster(format!("write Secret {}: no answer", self.name))
                }
                // Refused for good (forbidden, invalid): say so.
                Ok(Err(kube::Error::Api(a))) if a.code != 409 && a.code < 500 => {
                    return Err(StoreError::Cluster(format!(
                        "write Secret {}: {} ({})",
                        self.name, a.message, a.code
                    )));
                }
                Ok(Err(e)) => StoreError::Cluster(format!("write Secret {}: {e}", self.name)),
                Err(e) => StoreError::Cluster(format!("write Secret {}: {e}", self.name)),
            };
            // What does the Secret hold now?
            let now = match call(&self.jobs, Job::Get, deadline) {
                Ok(Ok(s)) => s,
                _ => return Err(refused),
            };
            let claimed_by = now
                .as_ref()
                .and_then(|s| s.metadata.annotations.as_ref())
                .and_then(|a| a.get(LEADER_ANNOTATION))
                .cloned();
            if !claim && claimed_by.as_ref().is_some_and(|c| *c != self.identity) {
                return Err(deposed());
            }
            let there = Held::from_secret(&self.name, now);
            if there.data == made.data && claimed_by.as_deref() == Some(self.identity.as_str()) {
                // It was written; its answer was lost.
                made.version = there.version;
                *self.held.write() = made;
                return Ok(());
            }
            *self.held.write() = there;
        }
        Err(StoreError::Cluster(format!(
            "write Secret {}: it kept changing under this operator",
            self.name
        )))
    }
}

/// Every app's state as JSON, `app` made to fit in `limit` bytes with the
/// others as they are, and in [`MAX_APP_STATE_BYTES`] of its own: its
/// oldest revision that neither takes traffic nor takes part in a
/// promotion goes first, then its oldest note. `None` when even that is
/// not enough; no other app loses anything for it.
fn fit(apps: &mut BTreeMap<String, AppState>, app: &str, limit: usize) -> Option<Data> {
    loop {
        let bodies: Data = apps
            .iter()
            .map(|(a, s)| (key(a), serde_json::to_vec(s).unwrap_or_default()))
            .collect();
        let total: usize = bodies.iter().map(|(k, b)| k.len() + b.len()).sum();
        let mine = bodies
            .iter()
            .find(|(k, _)| **k == key(app))
            .map_or(0, |(k, b)| k.len() + b.len());
        if total <= limit && mine <= MAX_APP_STATE_BYTES {
            return Some(bodies);
        }
        let s = apps.get_mut(app)?;
        let h = &s.history;
        let busy = |id: &str| {
            h.promotion
                .as_ref()
                .is_some_and(|p| p.to == id || p.from.as_deref() == Some(id))
        };
        if let Some(i) = h
            .revisions
            .iter()
            .position(|r| r.traffic == 0 && !busy(&r.id))
        {
            s.history.revisions.remove(i);
        } else if !s.notes.is_empty() {
            s.notes.remove(0);
        } else if total <= limit {
            // Over its part with nothing left to drop (its live revisions
            // alone): kept while the whole fits, so a running app's steps
            // are not refused for it.
            return Some(bodies);
        } else {
            return None;
        }
    }
}

impl KubeState {
    /// Reads the Secret again and holds what it holds, when this process
    /// still holds its claim: a key fixed by hand is seen at the app's
    /// next try.
    fn reread(&self) -> Result<(), StoreError> {
        let _one = out_of_the_way(|| self.writing.lock());
        let deadline = std::time::Instant::now() + WRITE_TIMEOUT;
        let secret = call(&self.jobs, Job::Get, deadline)?
            .map_err(|e| StoreError::Cluster(format!("read Secret {}: {e}", self.name)))?;
        let claimed_by = secret
            .as_ref()
            .and_then(|s| s.metadata.annotations.as_ref())
            .and_then(|a| a.get(LEADER_ANNOTATION))
            .cloned();
        if claimed_by.is_some_and(|c| c != self.identity) {
            return Err(StoreError::Cluster(format!(
                "Secret {} was claimed by another leader since this operator read it",
                self.name
            )));
        }
        *self.held.write() = Held::from_secret(&self.name, secret);
        Ok(())
    }
}

impl StateStore for KubeState {
    fn load(&self, app: &str) -> Result<History, StoreError> {
        // An unreadable key may have been fixed by hand since: read again.
        if self.held.read().unreadable.contains_key(app) {
            self.reread()?;
        }
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
        let note = (!note.is_empty()).then(|| Note {
            at_unix: unix_now(),
            what: note.to_string(),
        });
        self.write(false, |held| {
            if let Some((e, _)) = held.unreadable.get(app) {
                return Err(StoreError::Cluster(e.clone()));
            }
            let mut state = held.apps.get(app).cloned().unwrap_or_default();
            state.history = h.clone();
            if let Some(n) = &note {
                state.notes.push(n.clone());
                let extra = state.notes.len().saturating_sub(NOTES_KEPT);
                state.notes.drain(..extra);
            }
            // The Secret is written whole: every app's state with this
            // one's next, and the keys this version cannot read as they
            // were.
            let mut apps = held.apps.clone();
            apps.insert(app.to_string(), state);
            let kept: usize = held
                .unreadable
                .iter()
                .map(|(a, (_, raw))| key(a).len() + raw.len())
                .sum();
            let mut data = fit(&mut apps, app, MAX_STATE_BYTES.saturating_sub(kept)).ok_or_else(|| {
                StoreError::Cluster(format!(
                    "{app}'s live revisions and promotion do not fit in the {MAX_STATE_BYTES} bytes the state Secret may hold beside the other apps'"
                ))
            })?;
            for (a, (_, raw)) in &held.unreadable {
                data.insert(key(a), raw.clone());
            }
            // Keys that are no app's, as they were.
            for (k, v) in held.data.iter().filter(|(k, _)| !k.ends_with(".json")) {
                data.insert(k.clone(), v.clone());
            }
            Ok(Held {
                apps,
                unreadable: held.unreadable.clone(),
                data,
                version: None,
            })
        })
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

    /// Nothing to record: under the operator the resources are the whole
    /// truth, and the API's own changes are refused before they get here.
    fn record_spec(
        &self,
        _kind: SpecKind,
        _name: &str,
        _body: Option<&str>,
        _note: &str,
    ) -> Result<(), StoreError> {
        Ok(())
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

    /// Its key goes: the Secret is shared by every app and bounded, and on
    /// Kubernetes a deleted resource takes its revisions with it (an app
    /// made again numbers them from 1).
    fn forget(&self, app: &str) -> Result<(), StoreError> {
        if !self.held.read().data.contains_key(&key(app)) {
            return Ok(());
        }
        self.write(false, |held| {
            let mut next = held.clone();
            next.apps.remove(app);
            next.unreadable.remove(app);
            next.data.remove(&key(app));
            Ok(next)
        })
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
    fn a_state_too_big_for_a_secret_loses_the_saving_app_s_oldest_idle_revisions_first() {
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
        let bodies = fit(&mut apps, "a", MAX_STATE_BYTES).expect("it fits");
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

        // One app within the whole but over its own part: cut to its part,
        // however much room is left.
        let mut apps = BTreeMap::new();
        let mut big = AppState::default();
        big.history.revisions.push(rev("d", 1, 100, 1_000));
        for seq in 2..=8 {
            big.history.revisions.push(rev("d", seq, 0, 50_000));
        }
        apps.insert("d".to_string(), big);
        let bodies = fit(&mut apps, "d", MAX_STATE_BYTES).expect("it fits");
        let mine: usize = bodies.iter().map(|(k, v)| k.len() + v.len()).sum();
        assert!(mine <= MAX_APP_STATE_BYTES, "{mine}");
        assert!(apps["d"].history.revisions.len() < 8);
        assert_eq!(
            apps["d"].history.revisions[0].seq, 1,
            "the serving one stays"
        );

        // Live revisions alone over its part, the whole within bounds:
        // kept, so a running app's canary goes on.
        let mut live = AppState::default();
        live.history.revisions.push(rev("e", 1, 50, 150_000));
        live.history.revisions.push(rev("e", 2, 50, 150_000));
        let mut apps = BTreeMap::from([("e".to_string(), live)]);
        assert!(fit(&mut apps, "e", MAX_STATE_BYTES).is_some());
        assert_eq!(apps["e"].history.revisions.len(), 2);

        // Live revisions alone too big: refused, not cut.
        let mut live = AppState::default();
        live.history.revisions.push(rev("c", 1, 50, 600_000));
        live.history.revisions.push(rev("c", 2, 50, 600_000));
        let mut apps = BTreeMap::from([("c".to_string(), live)]);
        assert!(fit(&mut apps, "c", MAX_STATE_BYTES).is_none());
    }
}
