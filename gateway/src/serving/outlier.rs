//! A replica whose connection failed: ejected from rotation until it
//! answers its health probe again (Envoy's outlier detection, on
//! connection failures, with a threshold of one).
//!
//! A connection refused, or one that broke before its answer ended, means
//! almost always that the replica's process is gone (killed a moment ago,
//! its exit not yet seen: a large process such as vLLM takes a while to
//! be torn down, and its sockets close before the pool manager can reap
//! it) or no longer listening. Routing more requests to it would fail each
//! of them in turn, so the first failure ejects it: the requests after it
//! wait in the hold queue for another replica, or for this one to come
//! back. It comes back as soon as it answers its probe, checked at once
//! and then every `health.period`, so a connection that broke for a reason
//! of its own (a keep-alive closed as a request went out) costs a probe.
//! The pool manager's liveness probes and exit watch replace a replica
//! that is really gone. The check gives up after [`recheck_window`], by
//! when the pool manager has replaced a replica that kept failing.

use std::sync::Arc;
use std::time::{Duration, Instant};

use warmgate_deploy::HealthSpec;
use warmgate_pool::ReplicaHandle;
use warmgate_pool::probe::{ProbeResult, Prober};

use super::dispatch::App;

/// Why a replica was ejected.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cause {
    /// It refused a connection: nothing was sent.
    Refused,
    /// Its connection broke before the answer ended.
    Broke,
}

impl Cause {
    /// The `cause` label of `warmgate_replica_ejections_total`.
    pub fn as_str(self) -> &'static str {
        match self {
            Cause::Refused => "refused",
            Cause::Broke => "broke",
        }
    }
}

/// How long an ejected replica is probed before it is left out: twice the
/// time its liveness probes take to call it failed, and one probe more.
pub(crate) fn recheck_window(health: &HealthSpec) -> Duration {
    health.period * health.failure_threshold.max(1).saturating_mul(2) + health.timeout
}

/// `replica` of `app` failed a connection: see the module's text.
pub(crate) fn eject_from_app(app: &Arc<App>, replica: &Arc<ReplicaHandle>, cause: Cause) {
    let health = app.spec().health.clone();
    let (held, back) = (app.clone(), app.clone());
    let r = replica.clone();
    eject(
        replica,
        health,
        cause,
        move || held.holds(&r),
        move || back.redispatch(),
    );
    // Requests waiting for its next slot choose again.
    app.redispatch();
}

/// `replica` failed a connection: no request goes to it until it answers
/// a probe as `health` says, while `still_held` (its dispatcher still has
/// it); then `back` hands its slots to what waits.
pub(crate) fn eject(
    replica: &Arc<ReplicaHandle>,
    health: HealthSpec,
    cause: Cause,
    still_held: impl Fn() -> bool + Send + 'static,
    back: impl FnOnce() + Send + 'static,
) {
    if !replica.eject() {
        // Already out, and being checked.
        return;
    }
    metrics::counter!("warmgate_replica_ejections_total", "cause" => cause.as_str()).increment(1);
    tracing::warn!(replica = %replica.id, cause = cause.as_str(), "replica's connection failed: out of rotation until it answers its probe");
    let replica = replica.clone();
    tokio::spawn(async move {
        let prober = Prober::new();
        let until = Instant::now() + recheck_window(&health);
        loop {
            if !still_held() {
                // Removed by the pool manager: its exit was seen.
                return;
            }
            if let ProbeResult::Healthy { .. } = prober.probe(&replica.addr, &health).await {
                replica.readmit();
                tracing::info!(replica = %replica.id, "replica answers its probe again: back in rotation");
                back();
                return;
            }
            if Instant::now() >= until {
                tracing::warn!(replica = %replica.id, "replica still fails its probe; left out of rotation for the pool manager to replace");
                return;
            }
            tokio::time::sleep(health.period).await;
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_window_covers_the_liveness_verdict_twice() {
        let health = HealthSpec {
            period: Duration::from_secs(2),
            failure_threshold: 3,
            timeout: Duration::from_secs(1),
            ..HealthSpec::default()
        };
        assert_eq!(recheck_window(&health), Duration::from_secs(13));
        let never = HealthSpec {
            failure_threshold: 0,
            ..health
        };
        assert_eq!(recheck_window(&never), Duration::from_secs(5));
    }
}
