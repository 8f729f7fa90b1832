//! What the pool manager tells the gateway about replicas, carried out:
//! a ready replica joins its revision's dispatcher (or its pool), a
//! removed one leaves it, a failed start answers what waits for it, and
//! each replica gets (and loses) its weights token.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use warmgate_deploy::TargetId;
use warmgate_pool::{ReplicaHandle, ReplicaSink, TargetHealth, TargetSpec};

use crate::error::{Error, ErrorKind};
use crate::serving::dispatch::App;

/// Each revision's dispatcher, by its pool-manager target.
pub(crate) type Revisions = Arc<parking_lot::RwLock<HashMap<TargetId, Arc<App>>>>;

/// Tells apps and pools about replicas as the pool manager starts and
/// stops them.
pub(crate) struct Sink {
    pub(crate) revisions: Revisions,
    pub(crate) guests: Revisions,
    pub(crate) registry: crate::registry::Live,
    /// Mints and revokes each replica's weights token.
    pub(crate) weights: Arc<crate::weights::Weights>,
    /// Where the worker reaches this gateway (`http://host:port`), its
    /// `WARMGATE_GATEWAY_URL`: the one origin its kit sends the token to.
    pub(crate) gateway_url: String,
}

impl Sink {
    /// Another revision of `app`'s app with replicas ready, the one with
    /// the most.
    fn serving_sibling(&self, app: &Arc<App>) -> Option<Arc<App>> {
        self.revisions
            .read()
            .values()
            .filter(|a| a.name == app.name && !Arc::ptr_eq(a, app) && !a.is_retired())
            .filter(|a| a.ready_replicas() > 0)
            .max_by_key(|a| a.ready_replicas())
            .cloned()
    }
}

impl ReplicaSink for Sink {
    /// A pool replica may read every weight version of its pool (it syncs
    /// in place); an app replica, its revision's (an app started without
    /// a checkpoint gets a token too, which an in-place promotion to one
    /// regrants).
    fn replica_env(&self, spec: &TargetSpec, replica: &str) -> BTreeMap<String, String> {
        match self.weights.issue(replica, grant_for(spec)) {
            Ok(token) => BTreeMap::from([
                ("WARMGATE_WEIGHTS_TOKEN".to_string(), token),
                ("WARMGATE_GATEWAY_URL".to_string(), self.gateway_url.clone()),
            ]),
            Err(e) => {
                // The worker then gets 401 for its weights and fails to
                // start, which its target reports.
                tracing::error!(%replica, error = %e.message, "could not mint a weights token");
                BTreeMap::new()
            }
        }
    }

    fn replica_ended(&self, replica: &str) {
        self.weights.revoke_replica(replica);
    }

    /// Taken over after a failover: the token its worker holds reads its
    /// revision's checkpoint (or its pool's) again.
    fn replica_adopted(&self, spec: &TargetSpec, replica: &str, env: &BTreeMap<String, String>) {
        let Some(token) = env.get("WARMGATE_WEIGHTS_TOKEN") else {
            return;
        };
        if !self.weights.adopt_token(replica, grant_for(spec), token) {
            tracing::warn!(%replica, "the replica taken over holds no token of this gateway's; its weight reads will be refused");
        }
    }

    /// A replica started for the revision promoted in place on its target
    /// (after the promotion's canary passed, the target starts the new
    /// weights) joins that revision; any other joins the target's own.
    fn replica_ready(&self, replica: Arc<ReplicaHandle>) {
        let guest = self
            .guests
            .read()
            .get(&replica.target)
            .filter(|g| g.revision == replica.revision)
            .cloned();
        if let Some(guest) = guest {
            guest.add_replica(replica);
            return;
        }
        let app = self.revisions.read().get(&replica.target).cloned();
        if let Some(app) = app {
            if !app.spec().adapters.is_empty() {
                tokio::spawn(crate::serving::adapter_load::reconcile(
                    app.clone(),
                    replica.clone(),
                ));
            }
            app.add_replica(replica);
        } else if let Some(pool) = self.registry.load().pool_of_target(&replica.target) {
            pool.add_replica(replica);
        }
    }

    /// Gone from its target's revision, or from the revision that
    /// borrowed it for an in-place promotion.
    fn replica_removed(&self, replica: &Arc<ReplicaHandle>) {
        if let Some(guest) = self.guests.read().get(&replica.target).cloned()
            && guest.remove_replica(replica)
            && guest.ready_replicas() == 0
            && let Some(host) = self.revisions.read().get(&replica.target).cloned()
        {
            // Its share of the traffic must not wait for a replica the
            // guest will not get back: the host serves it.
            guest.redirect_to(&host);
        }
        let app = self.revisions.read().get(&replica.target).cloned();
        if let Some(app) = app {
            app.remove_replica(replica);
        } else if let Some(pool) = self.registry.load().pool_of_target(&replica.target) {
            pool.remove_replica(replica);
        }
    }

    fn start_failed(&self, target: &TargetId, error: &warmgate_pool::Error, health: &TargetHealth) {
        let app = self.revisions.read().get(target).cloned();
        if let Some(app) = &app {
            // Nothing is kept started for a start that failed: with no
            // demand, the app scales to zero and stops trying.
            app.start_failed();
        }
        if health.ready > 0 || health.starting > 0 {
            return;
        }
        // A revision that cannot start while another of the app serves (a
        // promotion's new revision, a checkpoint superseded as it
        // started): what it holds, and what the split sends it, is served
        // by the serving revision rather than failed. The promotion sees
        // the failed start and rolls back on its own.
        if let Some(app) = &app
            && app.ready_replicas() == 0
            && let Some(serving) = self.serving_sibling(app)
        {
            tracing::warn!(app = %app.name, revision = %app.revision, to = %serving.revision, "revision failed to start; its requests go to the serving revision");
            app.redirect_to(&serving);
            return;
        }
        if let Some(app) = app {
            let what = format!("app '{}'", app.name);
            app.fail_waiters(
                &crate::serving::crash_loop::crash_loop_error(&what, health).unwrap_or_else(|| {
                    Error::new(
                        ErrorKind::ReplicaFailed,
                        format!("{what} failed to start: {}", brief(health, error)),
                    )
                }),
            );
        } else if let Some(pool) = self.registry.load().pool_of_target(target).cloned() {
            let what = format!("pool '{}'", pool.name);
            let err =
                crate::serving::crash_loop::crash_loop_error(&what, health).unwrap_or_else(|| {
                    Error::new(
                        ErrorKind::ReplicaFailed,
                        format!("{what} failed to start a replica: {}", brief(health, error)),
                    )
                });
            if matches!(target, TargetId::OnDemand(_)) {
                pool.fail_fallback(&err);
            } else {
                pool.fail_pending(&err);
            }
        }
    }
}

/// A failed start as the data plane is told of it: the failure and the
/// replica, not the worker's output (which goes to admins).
fn brief(health: &TargetHealth, error: &warmgate_pool::Error) -> String {
    health
        .last_failure
        .clone()
        .unwrap_or_else(|| error.summary())
}

/// What a replica of `spec` may read: every weight version of its pool
/// (it syncs in place), or its revision's checkpoint.
fn grant_for(spec: &TargetSpec) -> crate::weights::Grant {
    if spec.id.is_pool() {
        crate::weights::Grant::Pool {
            target: spec.id.owner().to_string(),
        }
    } else {
        crate::weights::Grant::Revision {
            target: spec.id.owner().to_string(),
            revision: spec.revision.clone(),
        }
    }
}
