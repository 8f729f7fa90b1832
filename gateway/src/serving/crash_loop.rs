//! What clients are told about a target in a crash loop (Kubernetes'
//! `CrashLoopBackOff`): one answer, the same every time, that no client
//! retries. It names the failure and the replica, never the worker's last
//! words: those may quote another tenant's request or a secret, so they go
//! to admins only (`/v1/status`, `warmgate logs`).

use warmgate_pool::TargetHealth;

use crate::error::{Error, ErrorKind};

/// The answer for `what` (`app 'm'`, `pool 'p'`) when its target is in a
/// crash loop with nothing ready or starting; `None` otherwise.
pub(crate) fn crash_loop_error(what: &str, h: &TargetHealth) -> Option<Error> {
    if !h.crash_loop || h.ready > 0 || h.starting > 0 {
        return None;
    }
    let next = match h.retry_in {
        Some(d) => format!(
            "it is tried again in {}s if something asks for it",
            d.as_secs_f64().ceil() as u64
        ),
        None => "it is tried again when something asks for it".into(),
    };
    Some(
        Error::new(
            ErrorKind::ReplicaFailed,
            format!(
                "{what} is in a crash loop (CrashLoopBackOff): {} starts failed in a row; {next}. \
                 The last failure: {} (its output: `warmgate logs`, for admins)",
                h.failures,
                h.last_failure.as_deref().unwrap_or("unknown")
            ),
        )
        .no_retry(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn only_a_crash_loop_with_nothing_running_is_refused() {
        let mut h = TargetHealth {
            crash_loop: true,
            failures: 5,
            retry_in: Some(Duration::from_millis(3500)),
            last_error: Some("exited with status 1; its last output:\n  CUDA out of memory".into()),
            last_failure: Some("replica m-00001-5 exited with status 1".into()),
            ..TargetHealth::default()
        };
        let e = crash_loop_error("app 'm'", &h).expect("refused");
        assert_eq!(e.kind, ErrorKind::ReplicaFailed);
        assert!(e.no_retry);
        assert!(e.message.contains("5 starts failed") && e.message.contains("in 4s"));
        assert!(
            e.message.contains("replica m-00001-5 exited with status 1"),
            "{}",
            e.message
        );
        assert!(
            !e.message.contains("CUDA"),
            "no worker output: {}",
            e.message
        );
        h.starting = 1;
        assert_eq!(crash_loop_error("app 'm'", &h), None);
        h.starting = 0;
        h.crash_loop = false;
        assert_eq!(crash_loop_error("app 'm'", &h), None);
    }
}
