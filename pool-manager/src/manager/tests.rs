//! Unit tests of `manager`.

use super::*;

#[test]
fn crash_backoff_grows_and_caps() {
    assert_eq!(crash_backoff(0), Duration::ZERO);
    assert_eq!(crash_backoff(1), Duration::ZERO);
    assert_eq!(crash_backoff(2), Duration::from_millis(500));
    assert_eq!(crash_backoff(3), Duration::from_secs(1));
    assert_eq!(crash_backoff(8), Duration::from_secs(32));
    assert_eq!(crash_backoff(12), BACKOFF_CAP);
    assert_eq!(crash_backoff(u32::MAX), BACKOFF_CAP);
}

/// A backend that counts its starts and fails each one (no process).
#[derive(Default)]
struct CountingBackend(std::sync::atomic::AtomicUsize);

#[async_trait::async_trait]
impl Backend for CountingBackend {
    async fn spawn(&self, launch: &crate::Launch) -> crate::Result<Box<dyn crate::Process>> {
        self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Err(Error::SpawnFailed {
            program: launch.command.first().cloned().unwrap_or_default(),
            reason: "a test backend starts nothing".into(),
        })
    }
}

struct Quiet;

impl ReplicaSink for Quiet {
    fn replica_ready(&self, _: Arc<crate::ReplicaHandle>) {}
    fn replica_removed(&self, _: &Arc<crate::ReplicaHandle>) {}
    fn start_failed(&self, _: &TargetId, _: &Error, _: &TargetHealth) {}
}

fn spec(id: &TargetId) -> TargetSpec {
    TargetSpec {
        id: id.clone(),
        health: warmgate_deploy::HealthSpec::default(),
        listen: Default::default(),
        engine: warmgate_deploy::EngineSpec::default(),
        revision: "r1".into(),
        command: vec!["worker".into()],
        env: BTreeMap::new(),
        checkpoint: None,
        workdir: None,
        concurrency: 1,
        gpus: 0,
        startup_timeout: Duration::from_secs(5),
        stop_grace: Duration::from_secs(1),
        image: None,
        pod: warmgate_deploy::PodSpec::default(),
    }
}

/// A target's actor runs from the first replica asked for, on the runtime
/// it was added in, even when asked from a thread outside any runtime;
/// a target never asked for one starts nothing and is removed at once.
#[test]
fn a_target_starts_replicas_only_once_asked_from_any_thread() {
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let backend = Arc::new(CountingBackend::default());
    let (idle, asked) = (
        TargetId::Pool("idle".into()),
        TargetId::Pool("asked".into()),
    );
    let pm = rt.block_on(async {
        let pm = PoolManager::new(backend.clone(), Vec::new(), Arc::new(Quiet));
        pm.add_target(spec(&idle));
        pm.add_target(spec(&asked));
        pm
    });
    assert!(pm.scale(&asked, 1), "from this thread, outside the runtime");
    let deadline = Instant::now() + Duration::from_secs(10);
    while backend.0.load(std::sync::atomic::Ordering::SeqCst) == 0 {
        assert!(
            Instant::now() < deadline,
            "the asked-for replica was never started"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(pm.health(&idle).map(|h| h.starting + h.pending), Some(0));
    rt.block_on(async {
        assert!(pm.remove_target(&idle).await);
        pm.scale(&asked, 0);
        assert!(pm.remove_target(&asked).await);
    });
}
