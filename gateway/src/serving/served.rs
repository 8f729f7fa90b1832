//! An app as users see it: a name, its revisions, and the traffic split
//! between them. Each revision is a [`dispatch::App`](crate::serving::dispatch::App)
//! with its own replicas, hold queue and autoscaler, as Knative gives each
//! revision its own KPA.

use std::collections::HashMap;
use std::sync::Arc;

use parking_lot::{Mutex, RwLock};
use warmgate_deploy::AppSpec;
use warmgate_deploy::revision::History;

use super::adapter_split::{self, AdapterCanary, RequestedAdapter};
use super::dispatch::App;
use crate::error::{Error, ErrorKind};

/// One app: its revisions and their traffic.
pub struct Served {
    /// The app's name.
    pub name: String,
    /// Its spec as put (a revision may run another checkpoint); swapped
    /// when the app is changed.
    spec: arc_swap::ArcSwap<AppSpec>,
    routing: RwLock<Routing>,
    /// Revisions and the last promotion, as persisted.
    pub history: Mutex<History>,
    /// Set by an operator's rollback while a promotion runs; the promotion
    /// picks it up on its next step.
    pub rollback: Mutex<Option<String>>,
    /// Times the checkpoint watcher has listed its prefix.
    pub watch_scans: std::sync::atomic::AtomicU64,
    /// Deleted: its watcher stops and nothing new starts for it.
    removed: std::sync::atomic::AtomicBool,
    /// Which checkpoint watcher may run: one that started under an older
    /// generation stops.
    watcher: std::sync::atomic::AtomicU64,
    /// Its adapters' promotions, by adapter name: the running one, else
    /// the last that ended (one each at most).
    adapter_promotions: Mutex<HashMap<String, Arc<AdapterCanary>>>,
    /// The highest revision each adapter name has been given, kept when
    /// the adapter is deleted: a revision is never given twice, since an
    /// engine may still hold the old one under its name. One entry per
    /// name the app ever served, gone with the app.
    adapter_revisions: Mutex<HashMap<String, (u32, String)>>,
    /// Requests routed to each adapter it serves, by adapter name.
    adapter_requests: Mutex<HashMap<String, u64>>,
    /// Whether the watcher of its adapters' training runs is running.
    pub adapter_watcher: std::sync::atomic::AtomicBool,
}

#[derive(Default)]
struct Routing {
    /// Revisions taking traffic, with their cumulative share (0..=100).
    split: Vec<(Arc<App>, u32)>,
    /// Every revision with replicas or starting ones, by id.
    live: HashMap<String, Arc<App>>,
}

impl Served {
    /// An app with no revision yet.
    pub fn new(spec: AppSpec, history: History) -> Self {
        Served {
            name: spec.name.clone(),
            spec: arc_swap::ArcSwap::from_pointee(spec),
            routing: RwLock::new(Routing::default()),
            history: Mutex::new(history),
            rollback: Mutex::new(None),
            watch_scans: std::sync::atomic::AtomicU64::new(0),
            removed: std::sync::atomic::AtomicBool::new(false),
            watcher: std::sync::atomic::AtomicU64::new(0),
            adapter_promotions: Mutex::new(HashMap::new()),
            adapter_revisions: Mutex::new(HashMap::new()),
            adapter_requests: Mutex::new(HashMap::new()),
            adapter_watcher: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// The adapter revision a request whose `model` is `model` goes to
    /// (see [`adapter_split::route`]).
    pub fn adapter_request(&self, model: &str) -> Option<RequestedAdapter> {
        let spec = self.spec();
        let promotions = &self.adapter_promotions;
        let routed = adapter_split::route(&spec.adapters, model, |name| {
            promotions.lock().get(name).cloned()
        })?;
        let name = adapter_split::parse_model(&routed.engine).0;
        *self
            .adapter_requests
            .lock()
            .entry(name.to_string())
            .or_default() += 1;
        metrics::counter!("warmgate_adapter_requests_total", "app" => self.name.clone(), "adapter" => name.to_string())
            .increment(1);
        Some(routed)
    }

    /// Requests routed to adapter `name` so far.
    pub fn adapter_requests(&self, name: &str) -> u64 {
        self.adapter_requests.lock().get(name).copied().unwrap_or(0)
    }

    /// The promotion of adapter `name`: the running one, else the last.
    pub fn adapter_promotion(&self, name: &str) -> Option<Arc<AdapterCanary>> {
        self.adapter_promotions.lock().get(name).cloned()
    }

    /// Starts a promotion of adapter `name` (serving `serving`), made by
    /// `make` for the revision it is given (past every revision the
    /// adapter was ever given), unless one runs: then that one is
    /// returned.
    pub fn begin_adapter_promotion(
        &self,
        name: &str,
        serving: u32,
        make: impl FnOnce(u32) -> AdapterCanary,
    ) -> Result<Arc<AdapterCanary>, Arc<AdapterCanary>> {
        let mut all = self.adapter_promotions.lock();
        if let Some(running) = all.get(name).filter(|c| c.running()) {
            return Err(running.clone());
        }
        let to = serving.max(self.adapter_revision_floor(name, None)) + 1;
        let canary = Arc::new(make(to));
        self.use_adapter_revision(name, to, &canary.checkpoint);
        all.insert(name.to_string(), canary.clone());
        Ok(canary)
    }

    /// The revision an incoming revision of adapter `name` must be past:
    /// the highest it was ever given (served, or tried by a promotion),
    /// unless `incoming` (revision, checkpoint) is that very one (a
    /// promotion's commit).
    pub fn adapter_revision_floor(&self, name: &str, incoming: Option<(u32, &str)>) -> u32 {
        match self.adapter_revisions.lock().get(name) {
            Some((r, c)) if incoming == Some((*r, c.as_str())) => r - 1,
            Some((r, _)) => *r,
            None => 0,
        }
    }

    /// Records that adapter `name` was given `revision` at `checkpoint`.
    pub fn use_adapter_revision(&self, name: &str, revision: u32, checkpoint: &str) {
        let mut used = self.adapter_revisions.lock();
        let r = used.entry(name.to_string()).or_insert((0, String::new()));
        if revision > r.0 {
            *r = (revision, checkpoint.to_string());
        }
    }

    /// The current watcher generation.
    pub fn watcher(&self) -> u64 {
        self.watcher.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Retires the running watcher (its settings changed); returns the
    /// generation of the next one.
    pub fn next_watcher(&self) -> u64 {
        self.watcher
            .fetch_add(1, std::sync::atomic::Ordering::AcqRel)
            + 1
    }

    /// Marks it deleted.
    pub fn mark_removed(&self) {
        self.removed
            .store(true, std::sync::atomic::Ordering::Release);
    }

    /// Whether it was deleted.
    pub fn is_removed(&self) -> bool {
        self.removed.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Its spec as last put.
    pub fn spec(&self) -> Arc<AppSpec> {
        self.spec.load_full()
    }

    /// Replaces its spec (the revisions it starts from now on use it).
    pub fn set_spec(&self, spec: AppSpec) {
        for a in &spec.adapters.models {
            self.use_adapter_revision(&a.name, a.revision, &a.checkpoint);
        }
        self.adapter_requests
            .lock()
            .retain(|name, _| spec.adapters.get(name).is_some());
        // A promotion of an adapter changed or deleted meanwhile ends.
        for (name, c) in self.adapter_promotions.lock().iter() {
            let mut p = c.promotion.lock();
            let kept = spec.adapters.get(name).is_some_and(|a| {
                a.revision == p.from_revision
                    || (a.revision == p.to_revision && a.checkpoint == p.checkpoint)
            });
            if !kept {
                p.roll_back("the adapter was changed or deleted during its promotion".into());
            }
        }
        self.spec.store(Arc::new(spec));
    }

    /// The revision for one request: the one named by
    /// `X-Warmgate-Revision` when given (for evaluation traffic), else one
    /// drawn by the traffic split.
    pub fn pick(&self, pinned: Option<&str>) -> Result<Arc<App>, Error> {
        let r = self.routing.read();
        if let Some(id) = pinned {
            return r.live.get(id).cloned().ok_or_else(|| {
                let mut ids: Vec<&str> = r.live.keys().map(String::as_str).collect();
                ids.sort_unstable();
                Error::new(
                    ErrorKind::NotFound,
                    format!(
                        "app '{}' has no live revision '{id}' (live: {})",
                        self.name,
                        ids.join(", ")
                    ),
                )
            });
        }
        match r.split.as_slice() {
            [] => Err(Error::new(
                ErrorKind::NoCapacity,
                format!("app '{}' has no revision taking traffic", self.name),
            )
            .retry_after(1)),
            [(only, _)] => Ok(only.clone()),
            split => {
                let draw = fastrand::u32(0..100);
                Ok(split
                    .iter()
                    .find(|(_, upto)| draw < *upto)
                    .unwrap_or(&split[split.len() - 1])
                    .0
                    .clone())
            }
        }
    }

    /// Makes `app` routable by pinning (it has, or will have, replicas).
    pub fn add_live(&self, app: Arc<App>) {
        self.routing.write().live.insert(app.revision.clone(), app);
    }

    /// Takes a revision out of routing altogether.
    pub fn remove_live(&self, id: &str) {
        let mut r = self.routing.write();
        r.live.remove(id);
        r.split.retain(|(a, _)| a.revision != id);
    }

    /// Routes traffic by `split` (revision id, percent); ids must be live.
    pub fn set_split(&self, split: &[(String, u8)]) {
        let mut r = self.routing.write();
        let mut upto = 0u32;
        let mut out = Vec::new();
        for (id, pct) in split {
            if *pct == 0 {
                continue;
            }
            if let Some(app) = r.live.get(id) {
                upto += u32::from(*pct);
                out.push((app.clone(), upto));
            }
        }
        r.split = out;
    }

    /// Every live revision.
    pub fn live(&self) -> Vec<Arc<App>> {
        let mut v: Vec<Arc<App>> = self.routing.read().live.values().cloned().collect();
        v.sort_by(|a, b| a.revision.cmp(&b.revision));
        v
    }

    /// A live revision by id.
    pub fn revision(&self, id: &str) -> Option<Arc<App>> {
        self.routing.read().live.get(id).cloned()
    }

    /// The revision with the largest share (the newer one on a tie).
    pub fn serving(&self) -> Option<Arc<App>> {
        let r = self.routing.read();
        let mut prev = 0;
        let mut best: Option<(u32, &Arc<App>)> = None;
        for (app, upto) in &r.split {
            let share = upto - prev;
            prev = *upto;
            if best.is_none_or(|(b, a)| share > b || (share == b && app.revision > a.revision)) {
                best = Some((share, app));
            }
        }
        best.map(|(_, a)| a.clone())
    }

    /// Each routed revision's share in percent.
    pub fn shares(&self) -> Vec<(String, u8)> {
        let r = self.routing.read();
        let mut prev = 0;
        r.split
            .iter()
            .map(|(app, upto)| {
                let share = (upto - prev) as u8;
                prev = *upto;
                (app.revision.clone(), share)
            })
            .collect()
    }
}
