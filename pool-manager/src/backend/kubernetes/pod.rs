//! The Pod object for one replica, built from its launch: container,
//! environment, volumes, GPUs, placement, tolerations, probes and the
//! security context.

use std::collections::BTreeMap;

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
use warmgate_deploy::Toleration;

use super::{
    APP, GPU_PRODUCT, GPU_RESOURCE, INSTANCE, INTERCHANGEABLE, KubeSettings, MANAGED_BY, POOL,
    REPLICA, REVISION, port_of,
};
use crate::backend::{Launch, interchangeable};

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
) -> std::result::Result<Pod, PodError> {
    let image = launch
        .image
        .clone()
        .filter(|i| !i.is_empty())
        .ok_or(PodError::NoImage)?;
    let spec = &launch.pod;
    check_allowed(spec, settings)?;
    let port = port_of(launch);
    let (command, env, env_from) = environment(launch, port)?;
    let (volumes, mounts) = volumes_of(spec, shm_of(launch));
    let (node_selector, tolerations) = placement(launch, settings);
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
        resources: resources_of(launch),
        env_from: (!env_from.is_empty()).then_some(env_from),
        volume_mounts: (!mounts.is_empty()).then_some(mounts),
        ..locked_down(probes(launch, port))
    };
    let affinity = affinity_of(spec);
    let labels = labels_of(launch, settings);
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

/// Why a replica's pod cannot be made.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PodError {
    /// The launch names no image.
    #[error("the kubernetes backend needs an `image`")]
    NoImage,
    /// A resource the pod would use is not on the operator's list.
    #[error("the {what} {name:?} is not in backend.kubernetes.{list}")]
    NotAllowed {
        /// `secret`, `claim`, `config map`, `service account`.
        what: &'static str,
        /// Its name.
        name: String,
        /// The list it must be on (`allowed_secrets`).
        list: &'static str,
    },
    /// The command does not expand.
    #[error("{0}")]
    Command(String),
}

/// Every service account, secret, claim and config map the pod would use
/// must be on the operator's lists: whoever may create a resource must
/// not reach the namespace's others through the operator.
fn check_allowed(
    spec: &warmgate_deploy::PodSpec,
    settings: &KubeSettings,
) -> std::result::Result<(), PodError> {
    let c = &settings.config;
    let refused = |what, name: &String, list| PodError::NotAllowed {
        what,
        name: name.clone(),
        list,
    };
    if let Some(sa) = &spec.service_account
        && !c.allowed_service_accounts.contains(sa)
    {
        return Err(refused("service account", sa, "allowed_service_accounts"));
    }
    let secrets = spec
        .secret_env
        .values()
        .map(|k| &k.secret)
        .chain(&spec.env_from_secrets)
        .chain(&spec.image_pull_secrets);
    for secret in secrets {
        if !c.allowed_secrets.contains(secret) {
            return Err(refused("secret", secret, "allowed_secrets"));
        }
    }
    for v in spec.volumes.values() {
        if let Some(claim) = v.claim.as_ref().filter(|x| !c.allowed_claims.contains(x)) {
            return Err(refused("claim", claim, "allowed_claims"));
        }
        if let Some(map) = v
            .config_map
            .as_ref()
            .filter(|x| !c.allowed_config_maps.contains(x))
        {
            return Err(refused("config map", map, "allowed_config_maps"));
        }
    }
    Ok(())
}

/// The pod's labels: who manages it, the gateway instance, the target,
/// revision and replica, and what makes two launches interchangeable.
fn labels_of(launch: &Launch, settings: &KubeSettings) -> BTreeMap<String, String> {
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
    labels
}

/// A container's command, its variables and the secrets read whole into
/// its environment.
type Environment = (Vec<String>, Vec<EnvVar>, Vec<EnvFromSource>);

/// The command expanded from the pod's own variables, the worker
/// contract's environment with the secrets' variables, and the secrets
/// read whole into it.
fn environment(launch: &Launch, port: u16) -> std::result::Result<Environment, PodError> {
    let spec = &launch.pod;
    let mut vars = launch.env.clone();
    vars.insert("PORT".into(), port.to_string());
    vars.insert("WARMGATE_REPLICA".into(), launch.replica.clone());
    vars.insert("WARMGATE_TARGET".into(), launch.target.clone());
    vars.insert("WARMGATE_REVISION".into(), launch.revision.clone());
    if let Some(c) = &launch.checkpoint {
        vars.insert("WARMGATE_CHECKPOINT".into(), c.clone());
    }
    let command =
        crate::backend::expand_command(&launch.command, &vars).map_err(PodError::Command)?;
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
    Ok((command, env, env_from))
}

/// A memory-backed /dev/shm's size limit, when the pod gets one.
fn shm_of(launch: &Launch) -> Option<Option<Quantity>> {
    let spec = &launch.pod;
    // A memory-backed /dev/shm: GPU workers (NCCL, data loaders) need more
    // than the container runtime's 64 MiB.
    match spec.shm_size.as_deref() {
        Some("0") => None,
        Some(size) => Some(Some(Quantity(size.to_string()))),
        None if launch.gpu_count > 0 => Some(None),
        None => None,
    }
}

/// Required node-affinity terms, all of which must hold.
fn affinity_of(spec: &warmgate_deploy::PodSpec) -> Option<Affinity> {
    (!spec.node_affinity.is_empty()).then(|| Affinity {
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
    })
}

/// GPUs, CPU and memory, requested as much as limited.
fn resources_of(launch: &Launch) -> Option<ResourceRequirements> {
    let spec = &launch.pod;
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
    (!limits.is_empty()).then(|| ResourceRequirements {
        requests: Some(limits.clone()),
        limits: Some(limits),
        ..ResourceRequirements::default()
    })
}

/// Where the pod may run: its node selector (the GPU model, spot nodes
/// for an interruptible replica) and its tolerations (spot and GPU taints).
fn placement(
    launch: &Launch,
    settings: &KubeSettings,
) -> (BTreeMap<String, String>, Vec<KubeToleration>) {
    let spec = &launch.pod;
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
    (node_selector, tolerations)
}

/// The readiness probe on the health path, and the startup probe that
/// gives the worker its `startup_timeout` to load first.
fn probes(launch: &Launch, port: u16) -> (Probe, Probe) {
    let readiness = Probe {
        period_seconds: Some(whole_seconds(launch.health.period)),
        timeout_seconds: Some(whole_seconds(launch.health.timeout)),
        failure_threshold: Some(launch.health.failure_threshold as i32),
        ..health_get(&launch.health.path, port)
    };
    let startup = Probe {
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
    };
    (readiness, startup)
}

/// A container with its probes that cannot gain privileges and holds no
/// Linux capability.
fn locked_down((readiness, startup): (Probe, Probe)) -> Container {
    Container {
        readiness_probe: Some(readiness),
        startup_probe: Some(startup),
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
    }
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
