//! The operator's leader taking over the replica pods an earlier leader of
//! the same instance left in the cluster: those its apps and pools want as
//! they are run on, the rest are deleted, so no pod is left behind and no
//! new pod's name collides with an old one's. Only a gateway holding the
//! instance's lease may do this: one without it (`warmgate serve`) cannot
//! tell a dead run's pods from a live gateway's.

use std::sync::Arc;
use std::time::Duration;

use warmgate_pool::kubernetes::KubeBackend;

use crate::server::Gateway;

/// How long a gateway leaves the pods an earlier one left for its apps and
/// pools to take over, before it deletes the rest: every target is made
/// at start, so a few seconds would do; this leaves room for a slow API
/// server.
pub(crate) const ADOPTION_GRACE: Duration = Duration::from_secs(30);
/// Rounds of [`ADOPTION_GRACE`] the pods of an app that has not started
/// are kept for it (5 minutes), before they are deleted all the same.
pub(crate) const ADOPTION_ROUNDS: u32 = 10;

/// Lists the pods an earlier gateway left, before any target starts:
/// the ready ones are kept to be taken over, the rest deleted at once.
pub(crate) async fn find_left(backend: &KubeBackend) {
    match backend.find_previous().await {
        Ok(0) => {}
        Ok(n) => tracing::info!(
            pods = n,
            "found replica pods an earlier gateway left; taking over those the apps and pools still want"
        ),
        Err(e) => {
            tracing::warn!(error = %e, "could not list the pods an earlier gateway left; they are not taken over")
        }
    }
}

/// Once every app and pool has been made, deletes the pods nothing took
/// over: at once those whose app or pool does not run, and after
/// [`ADOPTION_ROUNDS`] the rest (an app that could not start yet may
/// still take its pods over in between).
pub(crate) fn sweep_left(gw: Arc<Gateway>, backend: Arc<KubeBackend>) {
    tokio::spawn(async move {
        for round in 1..=ADOPTION_ROUNDS {
            if backend.previous_left() == 0 {
                break;
            }
            tokio::time::sleep(ADOPTION_GRACE).await;
            let running = gw.changes.desired_config();
            let runs = |owner: &str| {
                running.apps.iter().any(|a| a.name == owner)
                    || running.pools.iter().any(|p| p.name == owner)
            };
            let gone = if round == ADOPTION_ROUNDS {
                backend.delete_unadopted()
            } else {
                backend.delete_unadopted_except(|owner| !runs(owner))
            };
            if !gone.is_empty() {
                tracing::info!(pods = ?gone, "deleted the pods an earlier gateway left that nothing took over");
            }
        }
    });
}
