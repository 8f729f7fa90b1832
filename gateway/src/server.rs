//! The gateway: the services it is made of, and the few answers that take
//! more than one of them (a task queued and its pool woken, an app found).
//! It is put together in `runtime/assemble.rs`.

use std::sync::Arc;
use std::time::Duration;

use warmgate_deploy::Config;
use warmgate_pool::PoolManager;

use crate::change::Changes;
use crate::error::Error;
use crate::host::Host;
use crate::promote::Promotions;
use crate::serving::served::Served;
use crate::upstream::Upstream;

pub(crate) const X_REQUEST_ID: http::HeaderName = http::HeaderName::from_static("x-request-id");
pub(crate) const X_TENANT: &str = "x-warmgate-tenant";
/// The longest timeout a client may ask for: past it, deadline arithmetic
/// could overflow, and no task or sync should wait a month.
pub(crate) const MAX_CLIENT_DURATION: Duration = Duration::from_secs(30 * 24 * 3600);
/// Client-supplied request ids longer than this are replaced.
pub(crate) const MAX_REQUEST_ID_LEN: usize = 128;

/// The gateway: the services it is made of, each holding what it needs.
/// Built in `runtime/assemble.rs`; `report.rs` reads it, `peering.rs`
/// shares it with the other gateways.
pub struct Gateway {
    /// The process: config, clock, where workers reach it, drain flag.
    pub(crate) host: Arc<Host>,
    /// The apps and pools served now, swapped whole on a change.
    pub(crate) registry: crate::registry::Live,
    /// The replicas of every target.
    pub(crate) pool: PoolManager,
    /// Connections to the replicas.
    pub(crate) upstream: Upstream,
    /// A request's way from the traffic split to a replica.
    pub(crate) serving: crate::serving::pipeline::Pipeline,
    /// Checkpoints served to workers.
    pub(crate) weights: Arc<crate::weights::Weights>,
    /// The pools' tasks and their journal.
    pub(crate) tasks: Arc<crate::tasks::store::TaskStore>,
    /// Revision histories and the changes made through the API.
    pub(crate) store: Arc<dyn warmgate_deploy::store::StateStore>,
    /// Promotions, rolls and rollbacks of the apps' revisions.
    pub(crate) promotions: Arc<Promotions>,
    /// Changes to the apps and pools served, and their start.
    pub(crate) changes: Arc<Changes>,
    /// Who may call: the admin token and the tenants' keys.
    pub(crate) access: crate::access::Access,
    /// Request bodies being read, and inference bodies waiting for a
    /// replica, within `limits.max_buffered_body_bytes`.
    pub(crate) buffered: crate::serving::buffered::Buffered,
    /// The other gateway replicas serving with this one.
    pub(crate) peers: crate::peers::Peers,
    /// Tokens used, per tenant, app and model.
    pub(crate) usage: Arc<crate::usage::Ledger>,
}

// === impl Gateway ===

impl Gateway {
    /// Its changes: put or delete an app or a pool, apply a config file.
    pub fn changes(&self) -> &Arc<Changes> {
        &self.changes
    }

    /// The config it runs.
    pub fn config(&self) -> &Config {
        &self.host.config
    }

    /// Time since start: the autoscaler's clock.
    pub(crate) fn now(&self) -> Duration {
        self.host.now()
    }

    /// Stops taking traffic: `/readyz` fails and the autoscaler stops.
    pub fn start_draining(&self) {
        self.host.start_draining();
    }

    /// Stops every replica and waits until they are gone; the usage
    /// counted so far is written.
    pub async fn shutdown(&self) {
        self.start_draining();
        self.pool.shutdown().await;
        crate::usage::flush(&self.usage).await;
    }

    /// Queues a task and wakes its pool at once if it needs more replicas.
    pub(crate) fn enqueue(
        &self,
        pool: &crate::tasks::pool::Pool,
        submit: crate::tasks::pool::Submit,
    ) -> Result<
        (
            String,
            tokio::sync::oneshot::Receiver<crate::tasks::pool::Outcome>,
        ),
        Error,
    > {
        // In a crash loop, while its backoff runs: one answer, at once,
        // rather than a wait that ends in a bare timeout.
        if let Some(h) = self.pool.health(&pool.target())
            && h.retry_in.is_some()
            && let Some(e) =
                crate::serving::crash_loop::crash_loop_error(&format!("pool '{}'", pool.name), &h)
        {
            return Err(e);
        }
        let out = pool.submit(submit)?;
        self.nudge_pool(pool);
        Ok(out)
    }

    /// Asks for more of a pool's replicas at once when more work waits
    /// than its ready replicas have free slots (tasks, or requests of the
    /// app it serves); everything else waits for the autoscaler's tick,
    /// which keeps this path cheap.
    pub(crate) fn nudge_pool(&self, pool: &crate::tasks::pool::Pool) {
        if !pool.queued_beyond_free_slots() {
            return;
        }
        let target = pool.target();
        let desired = pool.desired(self.pool.starting(&target));
        if self.pool.desired(&target).unwrap_or(0) < desired {
            self.pool.scale(&target, desired);
        }
    }

    /// An app's name for any of its aliases; a pool's name as it is.
    pub(crate) fn target_name(&self, name: &str) -> String {
        self.registry
            .load()
            .app(name)
            .map_or_else(|| name.to_string(), |a| a.name.clone())
    }
}

impl Gateway {
    /// An app by name or alias, or 404.
    pub fn app(&self, name: &str) -> Result<Arc<Served>, Error> {
        self.registry.load().find_app(name)
    }
}
