//! The `kubernetes` backend: each replica is a Pod. warmgate brings no
//! scheduler of its own: it creates pods, Kubernetes places them, and a
//! kube-runtime watcher on the pods it owns reports what became of them
//! (an IP, readiness, eviction, preemption, node loss, an unschedulable
//! pod and the scheduler's reason). Nothing polls the API server.
//!
//! The gateway reaches replicas at their pod IPs directly (no Service in
//! between), and probes their health path itself as for local replicas,
//! so the same readiness and liveness rules hold on both backends. The pod
//! also carries Kubernetes readiness and startup probes on that path, so
//! `kubectl get pods` agrees with `warmgate status`.

mod pod;
mod process;
mod view;

pub use pod::{PodError, pod_for};
pub use view::{PodView, ended_of, view_of};

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::ResourceExt as _;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::watcher;
use parking_lot::Mutex;
use tokio::sync::watch;
use warmgate_deploy::KubeBackendConfig;

use crate::backend::{Adopted, Backend, Launch, Process, interchangeable};
use crate::{Error, Result};

use view::watch_pods;

/// Label on every pod warmgate creates.
pub const MANAGED_BY: &str = "app.kubernetes.io/managed-by";
/// Label naming the warmgate instance (the operator's release), so that
/// two installs in one namespace never touch each other's pods.
pub const INSTANCE: &str = "warmgate.dev/instance";
/// Labels naming what a pod serves.
pub const APP: &str = "warmgate.dev/app";
/// See [`APP`].
pub const POOL: &str = "warmgate.dev/pool";
/// See [`APP`].
pub const REVISION: &str = "warmgate.dev/revision";
/// See [`APP`].
pub const REPLICA: &str = "warmgate.dev/replica";
/// What makes the pod's replica interchangeable with another
/// ([`crate::backend::interchangeable`]): a new leader takes over the pods
/// whose digest its own targets have.
pub const INTERCHANGEABLE: &str = "warmgate.dev/interchangeable";
/// The NVIDIA device plugin's resource.
pub const GPU_RESOURCE: &str = "nvidia.com/gpu";
/// The label NVIDIA's GPU feature discovery puts on nodes.
pub const GPU_PRODUCT: &str = "nvidia.com/gpu.product";
/// Where the worker listens in its pod unless the spec says otherwise.
pub const DEFAULT_PORT: u16 = 8080;

/// How the backend names and places pods.
#[derive(Debug, Clone)]
pub struct KubeSettings {
    /// Namespace of the pods.
    pub namespace: String,
    /// The `warmgate.dev/instance` label value.
    pub instance: String,
    /// Spot selectors and tolerations, pull policy.
    pub config: KubeBackendConfig,
    /// `terminationGracePeriodSeconds`.
    pub stop_grace: Duration,
}

/// Replicas as pods.
pub struct KubeBackend {
    api: Api<Pod>,
    settings: KubeSettings,
    shared: Arc<Shared>,
    _watch: tokio::task::JoinHandle<()>,
}

#[derive(Default)]
struct Shared {
    /// Live views by pod name.
    pods: Mutex<HashMap<String, watch::Sender<PodView>>>,
    /// Owner references by app or pool name (set by the operator).
    owners: Mutex<HashMap<String, OwnerReference>>,
    /// Running pods an earlier leader left, not taken over yet, by name.
    previous: Mutex<BTreeMap<String, Pod>>,
    /// Set when this gateway stops leading: its pods are left running for
    /// the next leader to take over, not deleted.
    leaving: std::sync::atomic::AtomicBool,
}

impl KubeBackend {
    /// A backend that creates pods through `client` and watches them.
    /// Must be called within a tokio runtime.
    pub fn new(client: kube::Client, settings: KubeSettings) -> Self {
        let api: Api<Pod> = Api::namespaced(client, &settings.namespace);
        let shared = Arc::new(Shared::default());
        let selector = format!("{MANAGED_BY}=warmgate,{INSTANCE}={}", settings.instance);
        let stream = watcher(api.clone(), watcher::Config::default().labels(&selector));
        let _watch = tokio::spawn(watch_pods(stream, shared.clone()));
        KubeBackend {
            api,
            settings,
            shared,
            _watch,
        }
    }

    /// From now on, a replica stopped (or dropped) leaves its pod running
    /// instead of deleting it: the operator calls this when it stops
    /// leading (SIGTERM in an upgrade, a lost lease), so the next leader
    /// takes the pods over and nothing cold-starts.
    pub fn leave_pods(&self) {
        self.shared
            .leaving
            .store(true, std::sync::atomic::Ordering::SeqCst);
    }

    /// Pods of `target` (an app or pool name) are owned by this object, so
    /// that deleting the custom resource deletes them.
    pub fn set_owner(&self, target: &str, owner: OwnerReference) {
        self.shared.owners.lock().insert(target.to_string(), owner);
    }

    /// Lists the pods an earlier leader of this instance left. Those that
    /// run and are ready are kept to be taken over by the targets that
    /// want the same replicas ([`Backend::adopt`]); the rest are deleted.
    /// Returns how many are kept. Call it before any target starts.
    pub async fn find_previous(&self) -> std::result::Result<usize, kube::Error> {
        let selector = format!(
            "{MANAGED_BY}=warmgate,{INSTANCE}={}",
            self.settings.instance
        );
        let pods = self
            .api
            .list(&ListParams::default().labels(&selector))
            .await?;
        let mut kept = BTreeMap::new();
        for pod in pods.items {
            let name = pod.name_any();
            let v = view_of(&pod);
            let alive = pod.metadata.deletion_timestamp.is_none()
                && v.ended.is_none()
                && v.ready
                && v.ip.is_some();
            if alive && pod.labels().contains_key(INTERCHANGEABLE) {
                kept.insert(name, pod);
            } else {
                tracing::info!(pod = %name, "deleting a pod an earlier leader left that cannot be taken over");
                delete(self.api.clone(), name, 0);
            }
        }
        let n = kept.len();
        *self.shared.previous.lock() = kept;
        Ok(n)
    }

    /// Deletes the pods an earlier leader left that no target took over
    /// (their app or pool is gone, or changed). Returns their names.
    pub fn delete_unadopted(&self) -> Vec<String> {
        self.delete_unadopted_except(|_| false)
    }

    /// [`KubeBackend::delete_unadopted`], but keeps the pods whose app or
    /// pool (by its label) `keep` names, for a later try: one that could
    /// not start yet may take them over once it does.
    pub fn delete_unadopted_except(&self, keep: impl Fn(&str) -> bool) -> Vec<String> {
        let left: Vec<(String, Pod)> = {
            let mut previous = self.shared.previous.lock();
            let gone: Vec<String> = previous
                .iter()
                .filter(|(_, p)| {
                    let labels = p.labels();
                    let owner = labels.get(APP).or_else(|| labels.get(POOL));
                    !owner.is_some_and(|o| keep(o))
                })
                .map(|(n, _)| n.clone())
                .collect();
            gone.into_iter()
                .filter_map(|n| previous.remove(&n).map(|p| (n, p)))
                .collect()
        };
        for (name, _) in &left {
            tracing::info!(pod = %name, "deleting a pod an earlier leader left that no app or pool took over");
            delete(
                self.api.clone(),
                name.clone(),
                self.settings
                    .stop_grace
                    .as_secs()
                    .try_into()
                    .unwrap_or(u32::MAX),
            );
        }
        left.into_iter().map(|(n, _)| n).collect()
    }

    /// How many pods an earlier leader left are still kept, not taken
    /// over.
    pub fn previous_left(&self) -> usize {
        self.shared.previous.lock().len()
    }

    /// What the watcher knows of a pod.
    pub fn view(&self, pod: &str) -> Option<PodView> {
        self.shared
            .pods
            .lock()
            .get(pod)
            .map(|tx| tx.borrow().clone())
    }
}

#[async_trait]
impl Backend for KubeBackend {
    async fn spawn(&self, launch: &Launch) -> Result<Box<dyn Process>> {
        let owner = self.shared.owners.lock().get(&launch.target).cloned();
        let pod = pod_for(launch, &self.settings, owner).map_err(|reason| Error::SpawnFailed {
            program: launch.image.clone().unwrap_or_default(),
            reason: reason.to_string(),
        })?;
        let name = launch.replica.clone();
        // Register before creating, so no watch event can be missed.
        let (tx, mut rx) = watch::channel(PodView::default());
        self.shared.pods.lock().insert(name.clone(), tx);
        let created = self.api.create(&PostParams::default(), &pod).await;
        if let Err(e) = created {
            self.shared.pods.lock().remove(&name);
            return Err(Error::SpawnFailed {
                program: launch.image.clone().unwrap_or_default(),
                reason: format!("the API server refused pod {name}: {e}"),
            });
        }
        let port = port_of(launch);
        // The pod has no address until it is scheduled and started; while
        // it cannot be scheduled it waits here (the caller may stop it),
        // with the scheduler's reason in its view.
        let ip = loop {
            {
                let v = rx.borrow_and_update();
                if let Some(ip) = v.ip {
                    break ip;
                }
                if let Some(how) = &v.ended {
                    let how = how.clone();
                    drop(v);
                    self.shared.pods.lock().remove(&name);
                    delete(self.api.clone(), name.clone(), 0);
                    return Err(Error::SpawnFailed {
                        program: launch.image.clone().unwrap_or_default(),
                        reason: format!("pod {name} {how} before it started"),
                    });
                }
            }
            if rx.changed().await.is_err() {
                return Err(Error::SpawnFailed {
                    program: launch.image.clone().unwrap_or_default(),
                    reason: "the pod watch stopped".into(),
                });
            }
        };
        Ok(Box::new(self.process(name, SocketAddr::new(ip, port), rx)))
    }

    fn pending_reason(&self, replica: &str) -> Option<String> {
        self.view(replica)
            .and_then(|v| v.unschedulable.or(v.waiting))
    }

    /// The pod asks for `nvidia.com/gpu`; the scheduler finds them.
    fn places_gpus(&self) -> bool {
        true
    }

    /// Takes the pod's interchangeable label off (a merge patch), so a
    /// new leader does not take it over as a replica of what it was
    /// started with.
    async fn weights_swapped(&self, replica: &str) -> std::result::Result<(), String> {
        let patch = serde_json::json!({"metadata": {"labels": {INTERCHANGEABLE: null}}});
        self.api
            .patch(replica, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .map(|_| ())
            .map_err(|e| format!("the API server refused to relabel pod {replica}: {e}"))
    }

    fn adoptable(&self, launch: &Launch) -> usize {
        let key = interchangeable(launch);
        self.shared
            .previous
            .lock()
            .values()
            .filter(|p| same_replicas(p, launch, &key))
            .count()
    }

    fn adopt(&self, launch: &Launch) -> Option<Adopted> {
        let key = interchangeable(launch);
        let pod = {
            let mut previous = self.shared.previous.lock();
            let name = previous
                .iter()
                .find(|(_, p)| same_replicas(p, launch, &key))
                .map(|(n, _)| n.clone())?;
            previous.remove(&name)?
        };
        let name = pod.name_any();
        let view = view_of(&pod);
        let ip = view.ip?;
        let env: BTreeMap<String, String> = pod
            .spec
            .as_ref()
            .and_then(|s| s.containers.first())
            .and_then(|c| c.env.as_ref())
            .into_iter()
            .flatten()
            .filter_map(|e| e.value.clone().map(|v| (e.name.clone(), v)))
            .collect();
        let port = env
            .get("PORT")
            .and_then(|p| p.parse().ok())
            .unwrap_or_else(|| port_of(launch));
        // Watched from now on, as a pod it created would be.
        let (tx, rx) = watch::channel(view);
        self.shared.pods.lock().insert(name.clone(), tx);
        Some(Adopted {
            replica: name.clone(),
            env,
            process: Box::new(self.process(name, SocketAddr::new(ip, port), rx)),
        })
    }
}

/// Whether `pod` runs a replica `launch` could be: the same app or pool,
/// and the same [`interchangeable`] digest.
fn same_replicas(pod: &Pod, launch: &Launch, key: &str) -> bool {
    let labels = pod.labels();
    let owner = if launch.pool { POOL } else { APP };
    labels.get(owner) == Some(&launch.target)
        && labels.get(INTERCHANGEABLE).map(String::as_str) == Some(key)
}

/// Deletes a pod in the background (Process' stop calls are not async).
fn delete(api: Api<Pod>, name: String, grace_seconds: u32) {
    let Ok(handle) = tokio::runtime::Handle::try_current() else {
        return;
    };
    handle.spawn(async move {
        let dp = DeleteParams {
            grace_period_seconds: Some(grace_seconds),
            ..DeleteParams::default()
        };
        match api.delete(&name, &dp).await {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.code == 404 => {}
            Err(e) => tracing::warn!(pod = %name, error = %e, "could not delete a replica pod"),
        }
    });
}

fn port_of(launch: &Launch) -> u16 {
    match launch.pod.port {
        0 => DEFAULT_PORT,
        p => p,
    }
}
