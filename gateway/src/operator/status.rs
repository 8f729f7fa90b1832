//! The resources' status: what `/v1/status` says of each app and pool,
//! as a `ServingApp`'s or `WarmPool`'s status (replicas by state,
//! revisions with their traffic, conditions), written only where it
//! changed, with each condition's `lastTransitionTime` kept while its
//! status stays the same (the meta/v1 condition conventions).

use kube::Resource;
use kube::api::{Api, Patch, PatchParams};
use serde_json::json;
use warmgate_deploy::crd::{
    Condition, PromotionState, ReplicaCounts, RevisionTraffic, ServingApp, ServingAppStatus,
    WarmPool, WarmPoolStatus,
};
use warmgate_pool::{ReplicaState, TargetStatus};

use super::{Refusal, ResourceKind, Resources, events};
use crate::status::{AppStatus, PoolStatus};

/// The status of a refused resource: not ready, with the reason.
pub(super) fn refused_conditions(r: &Refusal, now: &str) -> Vec<Condition> {
    vec![Condition {
        type_: "Ready".into(),
        status: "False".into(),
        reason: "Refused".into(),
        message: format!("{}: {}", r.key, r.message),
        last_transition_time: now.into(),
    }]
}

/// The status of an app, from the gateway's `/v1/status` entry for it.
pub fn app_status(app: &AppStatus, generation: Option<i64>, now: &str) -> ServingAppStatus {
    let target = app.pool.as_ref();
    let counts = counts(target);
    let revisions: Vec<RevisionTraffic> = app
        .revisions
        .iter()
        .map(|r| RevisionTraffic {
            id: r.id.clone(),
            checkpoint: None,
            traffic: r.traffic.min(100),
            ready: r.ready as u32,
        })
        .collect();
    let promotion = app.promotion.as_ref().map(|p| {
        use warmgate_deploy::revision::Phase;
        let (phase, reason) = match &p.phase {
            Phase::Warming => ("warming", None),
            Phase::Canary => ("canary", None),
            Phase::Done => ("done", None),
            Phase::RolledBack { reason } => ("rolled_back", Some(reason.clone())),
            Phase::Failed { reason } => ("failed", Some(reason.clone())),
        };
        PromotionState {
            revision: p.to.clone(),
            phase: phase.into(),
            reason,
            in_place: p.plan.in_place,
        }
    });
    ServingAppStatus {
        conditions: conditions(&counts, target, now),
        replicas: counts,
        revision: Some(app.revision.clone()).filter(|r| !r.is_empty()),
        revisions,
        promotion,
        observed_generation: generation,
    }
}

/// The status of a pool, from the gateway's `/v1/status` entry for it.
pub fn pool_status(pool: &PoolStatus, generation: Option<i64>, now: &str) -> WarmPoolStatus {
    let target = pool.pool.as_ref();
    let counts = counts(target);
    WarmPoolStatus {
        conditions: conditions(&counts, target, now),
        replicas: counts,
        weights_version: pool.weights_version,
        pending_tasks: pool.pending as u64,
        observed_generation: generation,
    }
}

fn counts(target: Option<&TargetStatus>) -> ReplicaCounts {
    let mut c = ReplicaCounts {
        desired: target.map_or(0, |t| t.desired),
        ..ReplicaCounts::default()
    };
    for r in target.iter().flat_map(|t| &t.replicas) {
        match r.state {
            ReplicaState::Ready => c.ready += 1,
            ReplicaState::Starting => c.starting += 1,
            ReplicaState::Pending { .. } => c.pending += 1,
            ReplicaState::Draining | ReplicaState::Stopped => {}
        }
    }
    c
}

/// `Ready`, and `Unschedulable` while the scheduler cannot place a
/// replica (with its reason): an app waiting for GPUs is not failed.
pub(super) fn conditions(
    c: &ReplicaCounts,
    target: Option<&TargetStatus>,
    now: &str,
) -> Vec<Condition> {
    let cond = |type_: &str, ok: bool, reason: &str, message: String| Condition {
        type_: type_.to_string(),
        status: if ok { "True" } else { "False" }.to_string(),
        reason: reason.to_string(),
        message,
        last_transition_time: now.to_string(),
    };
    let ready = if c.desired == 0 {
        cond(
            "Ready",
            true,
            "ScaledToZero",
            "no traffic: no replicas".into(),
        )
    } else if c.ready > 0 {
        cond(
            "Ready",
            true,
            "Serving",
            format!("{} of {} replicas ready", c.ready, c.desired),
        )
    } else {
        cond("Ready", false, "Starting", "no replica is ready yet".into())
    };
    let reasons: Vec<&str> = target
        .iter()
        .flat_map(|t| &t.replicas)
        .filter_map(|r| match &r.state {
            ReplicaState::Pending { reason } => Some(reason.as_str()),
            _ => None,
        })
        .collect();
    let mut out = vec![ready];
    if let Some(first) = reasons.first() {
        out.push(Condition {
            status: "True".to_string(),
            ..cond(
                "Unschedulable",
                true,
                "Unschedulable",
                format!("{} replica(s) cannot be scheduled: {first}", reasons.len()),
            )
        });
    }
    out
}

/// Writes a resource's status through the status subresource (a merge
/// patch: the spec is never touched).
pub async fn patch_status<K>(
    api: &Api<K>,
    name: &str,
    status: &impl serde::Serialize,
) -> kube::Result<()>
where
    K: Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    let patch = json!({ "status": status });
    api.patch_status(name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .map(|_| ())
}

/// Writes each resource's status, only where it changed from the status
/// the resource holds (as last seen by the watch, which sees the operator's
/// own writes), with each condition's `lastTransitionTime` kept while its
/// status stays the same: the meta/v1 condition conventions, and no write
/// every tick.
pub(super) async fn write_statuses(
    gw: &crate::Gateway,
    apps: &Api<ServingApp>,
    pools: &Api<WarmPool>,
    seen: &Resources,
    events: &events::Events,
) {
    let now = now_rfc3339();
    let generations = seen.generations();
    let generation = |kind: &str, name: &str| {
        generations
            .get(&format!("{kind}/{name}"))
            .copied()
            .flatten()
    };
    let app_was = |name: &str| {
        let a = seen.apps.get(name);
        Was {
            status: a.and_then(|a| a.status.clone()),
            regarding: a.map(|a| a.object_ref(&())),
            events,
        }
    };
    let pool_was = |name: &str| {
        let p = seen.pools.get(name);
        Was {
            status: p.and_then(|p| p.status.clone()),
            regarding: p.map(|p| p.object_ref(&())),
            events,
        }
    };
    for r in &seen.refused {
        let result = match r.kind {
            ResourceKind::App => {
                let status = ServingAppStatus {
                    conditions: refused_conditions(r, &now),
                    observed_generation: generation("app", &r.name),
                    ..ServingAppStatus::default()
                };
                write_if_changed(apps, &r.name, app_was(&r.name), status, &now).await
            }
            ResourceKind::Pool => {
                let status = WarmPoolStatus {
                    conditions: refused_conditions(r, &now),
                    observed_generation: generation("pool", &r.name),
                    ..WarmPoolStatus::default()
                };
                write_if_changed(pools, &r.name, pool_was(&r.name), status, &now).await
            }
        };
        if let Err(e) = result {
            tracing::warn!(name = %r.name, error = %e, "could not write a refused resource's status");
        }
    }
    let status = gw.status_report();
    for a in &status.apps {
        let name = a.name.as_str();
        let g = generation("app", name);
        let next = app_status(a, g, &now);
        if let Err(e) = write_if_changed(apps, name, app_was(name), next, &now).await {
            tracing::warn!(app = %name, error = %e, "could not write the ServingApp status");
        }
    }
    for p in &status.pools {
        let name = p.name.as_str();
        let g = generation("pool", name);
        let next = pool_status(p, g, &now);
        if let Err(e) = write_if_changed(pools, name, pool_was(name), next, &now).await {
            tracing::warn!(pool = %name, error = %e, "could not write the WarmPool status");
        }
    }
}

/// A resource status with conditions.
pub(super) trait Conditioned: PartialEq + serde::Serialize {
    fn conditions(&self) -> &Vec<Condition>;
    fn conditions_mut(&mut self) -> &mut Vec<Condition>;
    /// What events are read from.
    fn observed(&self) -> events::Observed;
}

impl Conditioned for ServingAppStatus {
    fn conditions(&self) -> &Vec<Condition> {
        &self.conditions
    }
    fn conditions_mut(&mut self) -> &mut Vec<Condition> {
        &mut self.conditions
    }
    fn observed(&self) -> events::Observed {
        self.into()
    }
}

impl Conditioned for WarmPoolStatus {
    fn conditions(&self) -> &Vec<Condition> {
        &self.conditions
    }
    fn conditions_mut(&mut self) -> &mut Vec<Condition> {
        &mut self.conditions
    }
    fn observed(&self) -> events::Observed {
        self.into()
    }
}

/// The status a resource holds, and where its events go.
pub(super) struct Was<'a, S> {
    pub(super) status: Option<S>,
    /// The resource, for its events (`None`: not seen yet, no events).
    pub(super) regarding: Option<k8s_openapi::api::core::v1::ObjectReference>,
    pub(super) events: &'a events::Events,
}

/// Settles `next` against the status the resource holds (`was`) and
/// patches it only when they differ; what changed is published as events
/// about the resource.
pub(super) async fn write_if_changed<K, S>(
    api: &Api<K>,
    name: &str,
    was: Was<'_, S>,
    mut next: S,
    now: &str,
) -> kube::Result<()>
where
    K: Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
    S: Conditioned,
{
    settle(
        was.status.as_ref().map(Conditioned::conditions),
        next.conditions_mut(),
        now,
    );
    if was.status.as_ref() == Some(&next) {
        return Ok(());
    }
    patch_status(api, name, &next).await?;
    if let Some(regarding) = &was.regarding {
        let before = was.status.as_ref().map(Conditioned::observed);
        let notices = events::transitions(before.as_ref(), &next.observed());
        was.events.publish(regarding, notices).await;
    }
    Ok(())
}

/// Keeps each condition's `lastTransitionTime` from `was` while its
/// `status` is the same (a changed reason or message is not a
/// transition), and turns a condition `was` had and `next` lacks to
/// `False` (at `now`) rather than dropping it.
pub(super) fn settle(was: Option<&Vec<Condition>>, next: &mut Vec<Condition>, now: &str) {
    let Some(was) = was else {
        return;
    };
    for c in next.iter_mut() {
        if let Some(old) = was.iter().find(|o| o.type_ == c.type_)
            && old.status == c.status
        {
            c.last_transition_time = old.last_transition_time.clone();
        }
    }
    for old in was {
        if !next.iter().any(|c| c.type_ == old.type_) {
            let turned_off = old.status != "False";
            next.push(Condition {
                status: "False".into(),
                reason: if turned_off {
                    format!("No{}", old.type_)
                } else {
                    old.reason.clone()
                },
                message: if turned_off {
                    String::new()
                } else {
                    old.message.clone()
                },
                last_transition_time: if turned_off {
                    now.to_string()
                } else {
                    old.last_transition_time.clone()
                },
                ..old.clone()
            });
        }
    }
}

fn now_rfc3339() -> String {
    humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string()
}
