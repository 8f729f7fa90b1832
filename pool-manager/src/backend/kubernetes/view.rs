//! What the pod watch makes of pods: a [`PodView`] of each (its IP,
//! readiness, why it waits, how it ended), and the task that feeds the
//! views from the watch events.

use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt as _;
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::watcher;

use super::Shared;

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

/// Feeds watch events to the pods' views.
pub(super) async fn watch_pods(
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
