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

use std::collections::{BTreeMap, HashMap};
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use futures_util::StreamExt as _;
use k8s_openapi::api::core::v1::{
    Affinity, Capabilities, ConfigMapVolumeSource, Container, ContainerPort, EmptyDirVolumeSource,
    EnvFromSource, EnvVar, EnvVarSource, HTTPGetAction, LocalObjectReference, NodeAffinity,
    NodeSelector, NodeSelectorRequirement, NodeSelectorTerm, PersistentVolumeClaimVolumeSource,
    Pod, PodSecurityContext, PodSpec as KubePodSpec, Probe, ResourceRequirements, SeccompProfile,
    SecretEnvSource, SecretKeySelector, SecurityContext, Toleration as KubeToleration, Volume,
    VolumeMount,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::ResourceExt as _;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::watcher;
use parking_lot::Mutex;
use tokio::sync::watch;
use warmgate_deploy::{KubeBackendConfig, Toleration};

use crate::backend::{Adopted, Backend, Launch, Process, interchangeable};
use crate::{Error, Result};

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

/// What the watcher has seen of one pod.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PodView {
    /// The pod IP, once assigned.
    pub ip: Option<IpAddr>,
    /// Its `Ready` condition.
    pub ready: bool,
    /// Why the scheduler cannot place it, while it cannot.
    pub unschedulable: Option<String>,
    /// Why a container of it has not started, while it has not
    /// (`ImagePullBackOff`, a missing secret): the kubelet's reason and
    /// message, so a start that waits on it says so.
    pub waiting: Option<String>,
    /// How it ended, once it has (deleted, evicted, preempted, failed).
    pub ended: Option<String>,
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

/// How a replica ends when its gateway stops leading.
const LEFT: &str = "was left running for the next leader";

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

    /// The replica of pod `name`, reached at `addr`, watched through `rx`.
    fn process(&self, name: String, addr: SocketAddr, rx: watch::Receiver<PodView>) -> KubeProcess {
        KubeProcess {
            name,
            namespace: self.settings.namespace.clone(),
            addr,
            api: self.api.clone(),
            rx,
            grace: self.settings.stop_grace,
            shared: self.shared.clone(),
        }
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
            reason,
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

/// Feeds watch events to the pods' views.
async fn watch_pods(
    stream: impl futures_util::Stream<Item = std::result::Result<watcher::Event<Pod>, watcher::Error>>,
    shared: Arc<Shared>,
) {
    let mut stream = std::pin::pin!(stream);
    while let Some(ev) = stream.next().await {
        let (pod, deleted) = match ev {
            Ok(watcher::Event::Apply(p) | watcher::Event::InitApply(p)) => (p, false),
            Ok(watcher::Event::Delete(p)) => (p, true),
            Ok(watcher::Event::Init | watcher::Event::InitDone) => continue,
            Err(e) => {
                tracing::warn!(error = %e, "the pod watch failed; it restarts with backoff");
                tokio::time::sleep(Duration::from_secs(1)).await;
                continue;
            }
        };
        let Some(name) = pod.metadata.name.clone() else {
            continue;
        };
        let view = if deleted {
            PodView {
                ended: Some(ended_of(&pod).unwrap_or_else(|| "was deleted".to_string())),
                ..view_of(&pod)
            }
        } else {
            view_of(&pod)
        };
        if let Some(reason) = &view.ended
            && is_disruption(reason)
        {
            metrics::counter!("warmgate_replica_disruptions_total", "cause" => disruption_cause(reason))
                .increment(1);
        }
        if let Some(tx) = shared.pods.lock().get(&name) {
            tx.send_if_modified(|v| {
                if *v == view {
                    false
                } else {
                    *v = view;
                    true
                }
            });
        }
    }
}

/// A replica pod.
struct KubeProcess {
    name: String,
    namespace: String,
    addr: SocketAddr,
    api: Api<Pod>,
    rx: watch::Receiver<PodView>,
    grace: Duration,
    shared: Arc<Shared>,
}

#[async_trait]
impl Process for KubeProcess {
    fn addr(&self) -> SocketAddr {
        self.addr
    }

    fn pid(&self) -> Option<u32> {
        None
    }

    fn log(&self) -> String {
        format!("kubectl logs -n {} pod/{}", self.namespace, self.name)
    }

    async fn wait(&mut self) -> String {
        loop {
            if let Some(how) = self.rx.borrow_and_update().ended.clone() {
                return how;
            }
            if self.rx.changed().await.is_err() {
                return "was lost with the pod watch".to_string();
            }
        }
    }

    fn terminate(&self) {
        if self.leave() {
            return;
        }
        delete(
            self.api.clone(),
            self.name.clone(),
            self.grace.as_secs().try_into().unwrap_or(u32::MAX),
        );
    }

    fn kill(&self) {
        if self.leave() {
            return;
        }
        delete(self.api.clone(), self.name.clone(), 0);
    }
}

impl KubeProcess {
    /// When the gateway stops leading: ends this replica here, with its pod
    /// left running. Returns whether it did.
    fn leave(&self) -> bool {
        if !self
            .shared
            .leaving
            .load(std::sync::atomic::Ordering::SeqCst)
        {
            return false;
        }
        if let Some(tx) = self.shared.pods.lock().get(&self.name) {
            tx.send_modify(|v| v.ended = Some(LEFT.to_string()));
        }
        true
    }
}

impl Drop for KubeProcess {
    fn drop(&mut self) {
        self.shared.pods.lock().remove(&self.name);
        if self
            .shared
            .leaving
            .load(std::sync::atomic::Ordering::SeqCst)
        {
            return;
        }
        // A pod that ended by itself (evicted, failed) stays as an object
        // until deleted; a replica that is gone must not leave it behind.
        if self.rx.borrow().ended.as_deref() != Some("was deleted") {
            delete(self.api.clone(), self.name.clone(), 0);
        }
    }
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

/// The pod for one replica: image and command, the worker contract's
/// environment, GPUs as `nvidia.com/gpu` with the GPU model as a node
/// selector, spot placement for interruptible replicas, tolerations, a
/// readiness and startup probes on the health path, labels, and the owner
/// reference. `$PORT` and `${VAR}` in the command are expanded from the
/// pod's own variables.
///
/// A worker runs code from its image and serves clients, so its pod gets
/// no Kubernetes API token (`automountServiceAccountToken: false`), runs
/// under the runtime's default seccomp profile, cannot gain privileges and
/// holds no Linux capability. It runs as a non-root user only when
/// `backend.kubernetes.run_as_non_root` says so: common model-server
/// images (vLLM, TGI, Triton) run as root, and the kubelet would refuse to
/// start them. Its service account must be one of
/// `backend.kubernetes.allowed_service_accounts`.
pub fn pod_for(
    launch: &Launch,
    settings: &KubeSettings,
    owner: Option<OwnerReference>,
) -> std::result::Result<Pod, String> {
    let image = launch
        .image
        .clone()
        .filter(|i| !i.is_empty())
        .ok_or("the kubernetes backend needs an `image`")?;
    let spec = &launch.pod;
    if let Some(sa) = &spec.service_account
        && !settings.config.allowed_service_accounts.contains(sa)
    {
        return Err(format!(
            "the service account {sa:?} is not in backend.kubernetes.allowed_service_accounts"
        ));
    }
    for secret in spec
        .secret_env
        .values()
        .map(|k| &k.secret)
        .chain(&spec.env_from_secrets)
        .chain(&spec.image_pull_secrets)
    {
        if !settings.config.allowed_secrets.contains(secret) {
            return Err(format!(
                "the secret {secret:?} is not in backend.kubernetes.allowed_secrets"
            ));
        }
    }
    for v in spec.volumes.values() {
        if let Some(c) = &v.claim
            && !settings.config.allowed_claims.contains(c)
        {
            return Err(format!(
                "the claim {c:?} is not in backend.kubernetes.allowed_claims"
            ));
        }
        if let Some(c) = &v.config_map
            && !settings.config.allowed_config_maps.contains(c)
        {
            return Err(format!(
                "the config map {c:?} is not in backend.kubernetes.allowed_config_maps"
            ));
        }
    }
    let port = port_of(launch);
    let mut labels = BTreeMap::from([
        (MANAGED_BY.to_string(), "warmgate".to_string()),
        (INSTANCE.to_string(), settings.instance.clone()),
        (REVISION.to_string(), launch.revision.clone()),
        (REPLICA.to_string(), launch.replica.clone()),
        (INTERCHANGEABLE.to_string(), interchangeable(launch)),
    ]);
    labels.insert(
        if launch.pool { POOL } else { APP }.to_string(),
        launch.target.clone(),
    );
    let mut vars = launch.env.clone();
    vars.insert("PORT".into(), port.to_string());
    vars.insert("WARMGATE_REPLICA".into(), launch.replica.clone());
    vars.insert("WARMGATE_TARGET".into(), launch.target.clone());
    vars.insert("WARMGATE_REVISION".into(), launch.revision.clone());
    if let Some(c) = &launch.checkpoint {
        vars.insert("WARMGATE_CHECKPOINT".into(), c.clone());
    }
    let command = crate::backend::expand_command(&launch.command, &vars)?;
    let mut env: Vec<EnvVar> = launch.env.iter().map(|(k, v)| env_var(k, v)).collect();
    env.push(env_var("PORT", &port.to_string()));
    env.push(env_var("WARMGATE_REPLICA", &launch.replica));
    env.push(env_var("WARMGATE_TARGET", &launch.target));
    env.push(env_var("WARMGATE_REVISION", &launch.revision));
    if let Some(c) = &launch.checkpoint {
        env.push(env_var("WARMGATE_CHECKPOINT", c));
    }
    for (name, k) in &spec.secret_env {
        env.push(EnvVar {
            name: name.clone(),
            value_from: Some(EnvVarSource {
                secret_key_ref: Some(SecretKeySelector {
                    name: k.secret.clone(),
                    key: k.key.clone(),
                    optional: Some(false),
                }),
                ..EnvVarSource::default()
            }),
            ..EnvVar::default()
        });
    }
    let env_from: Vec<EnvFromSource> = spec
        .env_from_secrets
        .iter()
        .map(|name| EnvFromSource {
            secret_ref: Some(SecretEnvSource {
                name: name.clone(),
                optional: Some(false),
            }),
            ..EnvFromSource::default()
        })
        .collect();
    // A memory-backed /dev/shm: GPU workers (NCCL, data loaders) need more
    // than the container runtime's 64 MiB.
    let shm = match spec.shm_size.as_deref() {
        Some("0") => None,
        Some(size) => Some(Some(Quantity(size.to_string()))),
        None if launch.gpu_count > 0 => Some(None),
        None => None,
    };
    let (volumes, mounts) = volumes_of(spec, shm);
    let affinity = (!spec.node_affinity.is_empty()).then(|| Affinity {
        node_affinity: Some(NodeAffinity {
            required_during_scheduling_ignored_during_execution: Some(NodeSelector {
                node_selector_terms: vec![NodeSelectorTerm {
                    match_expressions: Some(
                        spec.node_affinity
                            .iter()
                            .map(|n| NodeSelectorRequirement {
                                key: n.key.clone(),
                                operator: n.operator.clone(),
                                values: (!n.values.is_empty()).then(|| n.values.clone()),
                            })
                            .collect(),
                    ),
                    ..NodeSelectorTerm::default()
                }],
            }),
            ..NodeAffinity::default()
        }),
        ..Affinity::default()
    });
    let mut limits = BTreeMap::new();
    if launch.gpu_count > 0 {
        limits.insert(
            GPU_RESOURCE.to_string(),
            Quantity(launch.gpu_count.to_string()),
        );
    }
    if let Some(cpu) = &spec.cpu {
        limits.insert("cpu".to_string(), Quantity(cpu.clone()));
    }
    if let Some(mem) = &spec.memory {
        limits.insert("memory".to_string(), Quantity(mem.clone()));
    }
    // Requests equal limits: a replica's latency must not depend on its
    // neighbours (the Guaranteed QoS class).
    let resources = (!limits.is_empty()).then(|| ResourceRequirements {
        requests: Some(limits.clone()),
        limits: Some(limits),
        ..ResourceRequirements::default()
    });
    let mut node_selector = spec.node_selector.clone();
    if let Some(t) = &spec.gpu_type {
        node_selector.insert(GPU_PRODUCT.to_string(), t.clone());
    }
    let mut tolerations: Vec<KubeToleration> = spec.tolerations.iter().map(toleration).collect();
    if spec.interruptible {
        node_selector.extend(settings.config.spot_node_selector.clone());
        tolerations.extend(settings.config.spot_tolerations.iter().map(toleration));
    }
    if launch.gpu_count > 0 {
        // GPU node pools are commonly tainted so that only GPU pods land.
        tolerations.push(KubeToleration {
            key: Some(GPU_RESOURCE.to_string()),
            operator: Some("Exists".to_string()),
            effect: Some("NoSchedule".to_string()),
            ..KubeToleration::default()
        });
    }
    let container = Container {
        name: "worker".to_string(),
        image: Some(image),
        image_pull_policy: settings.config.image_pull_policy.clone(),
        command: (!command.is_empty()).then_some(command),
        env: Some(env),
        ports: Some(vec![ContainerPort {
            container_port: i32::from(port),
            name: Some("http".to_string()),
            ..ContainerPort::default()
        }]),
        resources,
        readiness_probe: Some(Probe {
            period_seconds: Some(whole_seconds(launch.health.period)),
            timeout_seconds: Some(whole_seconds(launch.health.timeout)),
            failure_threshold: Some(launch.health.failure_threshold as i32),
            ..health_get(&launch.health.path, port)
        }),
        // Readiness is not judged until the worker has had its
        // startup_timeout to load: the startup grace.
        startup_probe: Some(Probe {
            period_seconds: Some(STARTUP_PROBE_PERIOD_SECONDS),
            timeout_seconds: Some(whole_seconds(launch.health.timeout)),
            failure_threshold: Some(
                (launch
                    .startup_timeout
                    .as_secs()
                    .div_ceil(STARTUP_PROBE_PERIOD_SECONDS as u64))
                .clamp(1, i32::MAX as u64) as i32,
            ),
            ..health_get(&launch.health.path, port)
        }),
        env_from: (!env_from.is_empty()).then_some(env_from),
        volume_mounts: (!mounts.is_empty()).then_some(mounts),
        security_context: Some(SecurityContext {
            allow_privilege_escalation: Some(false),
            privileged: Some(false),
            capabilities: Some(Capabilities {
                drop: Some(vec!["ALL".to_string()]),
                add: None,
            }),
            ..SecurityContext::default()
        }),
        ..Container::default()
    };
    Ok(Pod {
        metadata: ObjectMeta {
            name: Some(launch.replica.clone()),
            namespace: Some(settings.namespace.clone()),
            labels: Some(labels),
            owner_references: owner.map(|o| vec![o]),
            ..ObjectMeta::default()
        },
        spec: Some(KubePodSpec {
            containers: vec![container],
            // The pool manager replaces a failed replica; a kubelet restart
            // in place would hide the failure from it.
            restart_policy: Some("Never".to_string()),
            termination_grace_period_seconds: Some(
                settings.stop_grace.as_secs().try_into().unwrap_or(i64::MAX),
            ),
            node_selector: (!node_selector.is_empty()).then_some(node_selector),
            tolerations: (!tolerations.is_empty()).then_some(tolerations),
            service_account_name: spec.service_account.clone(),
            image_pull_secrets: (!spec.image_pull_secrets.is_empty()).then(|| {
                spec.image_pull_secrets
                    .iter()
                    .map(|name| LocalObjectReference { name: name.clone() })
                    .collect()
            }),
            volumes: (!volumes.is_empty()).then_some(volumes),
            affinity,
            automount_service_account_token: Some(false),
            security_context: Some(PodSecurityContext {
                run_as_non_root: settings.config.run_as_non_root.then_some(true),
                seccomp_profile: Some(SeccompProfile {
                    type_: "RuntimeDefault".to_string(),
                    localhost_profile: None,
                }),
                ..PodSecurityContext::default()
            }),
            ..KubePodSpec::default()
        }),
        status: None,
    })
}

/// The pod's volumes and the worker's mounts: the memory-backed
/// `/dev/shm` when it has one, then the spec's, by name.
fn volumes_of(
    spec: &warmgate_deploy::PodSpec,
    shm: Option<Option<Quantity>>,
) -> (Vec<Volume>, Vec<VolumeMount>) {
    let mut volumes = Vec::new();
    let mut mounts = Vec::new();
    if let Some(size_limit) = shm {
        volumes.push(Volume {
            name: "dshm".to_string(),
            empty_dir: Some(EmptyDirVolumeSource {
                medium: Some("Memory".to_string()),
                size_limit,
                ..EmptyDirVolumeSource::default()
            }),
            ..Volume::default()
        });
        mounts.push(VolumeMount {
            name: "dshm".to_string(),
            mount_path: "/dev/shm".to_string(),
            ..VolumeMount::default()
        });
    }
    for (name, v) in &spec.volumes {
        let mut volume = Volume {
            name: name.clone(),
            ..Volume::default()
        };
        if let Some(claim) = &v.claim {
            volume.persistent_volume_claim = Some(PersistentVolumeClaimVolumeSource {
                claim_name: claim.clone(),
                read_only: v.read_only.then_some(true),
            });
        } else if let Some(cm) = &v.config_map {
            volume.config_map = Some(ConfigMapVolumeSource {
                name: cm.clone(),
                ..ConfigMapVolumeSource::default()
            });
        } else {
            volume.empty_dir = Some(EmptyDirVolumeSource {
                size_limit: v.empty_dir.clone().map(Quantity),
                ..EmptyDirVolumeSource::default()
            });
        }
        volumes.push(volume);
        mounts.push(VolumeMount {
            name: name.clone(),
            mount_path: v.mount.clone(),
            read_only: v.read_only.then_some(true),
            ..VolumeMount::default()
        });
    }
    (volumes, mounts)
}

/// The startup probe's period: a worker is seen ready within a second or
/// two of answering.
const STARTUP_PROBE_PERIOD_SECONDS: i32 = 2;

/// A probe that gets the health path on the worker's port.
fn health_get(path: &str, port: u16) -> Probe {
    Probe {
        http_get: Some(HTTPGetAction {
            path: Some(path.to_string()),
            port: IntOrString::Int(i32::from(port)),
            ..HTTPGetAction::default()
        }),
        ..Probe::default()
    }
}

/// Seconds for a probe field (Kubernetes counts whole seconds, at least 1).
fn whole_seconds(d: std::time::Duration) -> i32 {
    d.as_secs_f64().ceil().clamp(1.0, f64::from(i32::MAX)) as i32
}

fn env_var(name: &str, value: &str) -> EnvVar {
    EnvVar {
        name: name.to_string(),
        value: Some(value.to_string()),
        ..EnvVar::default()
    }
}

fn toleration(t: &Toleration) -> KubeToleration {
    KubeToleration {
        key: t.key.clone(),
        operator: t.operator.clone(),
        value: t.value.clone(),
        effect: t.effect.clone(),
        ..KubeToleration::default()
    }
}

/// What a watch event says of a pod.
pub fn view_of(pod: &Pod) -> PodView {
    let status = pod.status.as_ref();
    let conditions = status.and_then(|s| s.conditions.as_deref()).unwrap_or(&[]);
    let cond = |t: &str| conditions.iter().find(|c| c.type_ == t);
    let ready = cond("Ready").is_some_and(|c| c.status == "True");
    let unschedulable = cond("PodScheduled")
        .filter(|c| c.status == "False" && c.reason.as_deref() == Some("Unschedulable"))
        .map(|c| {
            c.message
                .clone()
                .unwrap_or_else(|| "the scheduler found no node".to_string())
        });
    let ip = status
        .and_then(|s| s.pod_ip.as_deref())
        .and_then(|ip| ip.parse().ok());
    PodView {
        ip,
        ready,
        unschedulable,
        waiting: status.and_then(waiting_of),
        ended: ended_of(pod),
    }
}

/// The first container (init containers first) held back by something
/// other than its ordinary start: its name, the kubelet's reason and
/// message.
fn waiting_of(status: &k8s_openapi::api::core::v1::PodStatus) -> Option<String> {
    let all = status
        .init_container_statuses
        .as_deref()
        .unwrap_or(&[])
        .iter()
        .chain(status.container_statuses.as_deref().unwrap_or(&[]));
    all.filter_map(|c| {
        let w = c.state.as_ref()?.waiting.as_ref()?;
        let reason = w.reason.as_deref()?;
        if matches!(reason, "ContainerCreating" | "PodInitializing") {
            return None;
        }
        Some(match w.message.as_deref() {
            Some(m) if !m.is_empty() => format!("container {} is waiting: {reason}: {m}", c.name),
            _ => format!("container {} is waiting: {reason}", c.name),
        })
    })
    .next()
}

/// How a pod ended, if it has: eviction, preemption and node loss are
/// named as such (they are the cluster's doing, not the worker's).
pub fn ended_of(pod: &Pod) -> Option<String> {
    let status = pod.status.as_ref()?;
    let conditions = status.conditions.as_deref().unwrap_or(&[]);
    if let Some(c) = conditions
        .iter()
        .find(|c| c.type_ == "DisruptionTarget" && c.status == "True")
    {
        let what = match c.reason.as_deref() {
            Some("PreemptionByScheduler") => "was preempted by the scheduler",
            Some("DeletionByTaintManager") => "lost its node (taint eviction)",
            Some("EvictionByEvictionAPI") => "was evicted (eviction API)",
            Some("TerminationByKubelet") => "was evicted by the kubelet",
            _ => "was disrupted",
        };
        return Some(match &c.message {
            Some(m) if !m.is_empty() => format!("{what}: {m}"),
            _ => what.to_string(),
        });
    }
    match status.reason.as_deref() {
        Some("Evicted") => {
            return Some(format!(
                "was evicted: {}",
                status.message.as_deref().unwrap_or("by the kubelet")
            ));
        }
        Some("NodeLost") => return Some("lost its node".to_string()),
        Some("Preempting") => return Some("was preempted".to_string()),
        _ => {}
    }
    match status.phase.as_deref() {
        Some("Failed") | Some("Succeeded") => {
            let term = status
                .container_statuses
                .as_deref()
                .unwrap_or(&[])
                .iter()
                .find_map(|c| c.state.as_ref()?.terminated.clone());
            Some(match term {
                Some(t) => match t.reason.as_deref() {
                    Some(r) if r != "Completed" && r != "Error" => {
                        format!("exited with status {} ({r})", t.exit_code)
                    }
                    _ => format!("exited with status {}", t.exit_code),
                },
                None if status.phase.as_deref() == Some("Succeeded") => {
                    "exited with status 0".to_string()
                }
                None => "failed".to_string(),
            })
        }
        _ => None,
    }
}

fn is_disruption(how: &str) -> bool {
    how.starts_with("was evicted")
        || how.starts_with("was preempted")
        || how.starts_with("lost its node")
        || how.starts_with("was disrupted")
}

fn disruption_cause(how: &str) -> &'static str {
    if how.starts_with("was preempted") {
        "preemption"
    } else if how.starts_with("lost its node") {
        "node_lost"
    } else if how.starts_with("was evicted") {
        "eviction"
    } else {
        "other"
    }
}
