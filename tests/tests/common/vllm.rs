//! Real vLLM for the tests that run it (`real_vllm*.rs`): where it is
//! installed, the tiny model it serves, and its metrics.
//!
//! vLLM is looked for in `$WARMGATE_VLLM_VENV`, else
//! `~/.cache/warmgate/vllm-0.32.0` (where `tests/vllm/install.sh` puts
//! it). Without it the tests say so and pass, except under CI, which
//! installs it first and fails without it.

use std::path::{Path, PathBuf};
use std::process::Command;

/// Environment every real engine here runs with: a 1 GiB KV cache, no
/// thread pinning (the machine is shared), nothing fetched, the CPU build.
pub const ENGINE_ENV: &str = r#"VLLM_CPU_KVCACHE_SPACE = "1", VLLM_CPU_OMP_THREADS_BIND = "nobind", HF_HUB_OFFLINE = "1", VLLM_TARGET_DEVICE = "cpu""#;

/// The vLLM virtual environment, if it is installed.
pub fn venv() -> Option<PathBuf> {
    let dir = std::env::var_os("WARMGATE_VLLM_VENV")
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/warmgate/vllm-0.32.0"))
        })?;
    if dir.join("bin/vllm").exists() {
        return Some(dir);
    }
    assert!(
        std::env::var_os("CI").is_none(),
        "real vLLM is required under CI: tests/vllm/install.sh (.ci/run runs it)"
    );
    eprintln!("SKIPPED: real vLLM is not installed (tests/vllm/install.sh)");
    None
}

/// The repository's root.
pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The tiny model, made once into the build's folder.
pub fn model(venv: &Path) -> PathBuf {
    let out = root().join("target/tmp/vllm-tiny-llama");
    script(venv, "make_model.py", &[out.as_os_str()]);
    out
}

/// Runs `tests/vllm/{name}` with the environment's Python and `args`.
pub fn script(venv: &Path, name: &str, args: &[&std::ffi::OsStr]) {
    let status = Command::new(venv.join("bin/python"))
        .arg(root().join("tests/vllm").join(name))
        .args(args)
        .env("HF_HUB_OFFLINE", "1")
        .status()
        .unwrap_or_else(|e| panic!("run {name}: {e}"));
    assert!(status.success(), "{name} failed");
}

/// The engine's own metric `name` at `addr`, summed over its series.
pub async fn engine_metric(addr: &str, name: &str) -> f64 {
    let (status, text) = super::replica_call(addr, "GET", "/metrics", "").await;
    assert_eq!(status, 200);
    text.lines()
        .filter(|l| l.starts_with(name) && !l.starts_with('#'))
        .filter(|l| l[name.len()..].starts_with(['{', ' ']))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// The `n` ready replicas among those `replicas_of` finds in
/// `/v1/status`, waited for within the engines' slow first start.
pub async fn ready_replicas(
    gw: &super::Gateway,
    n: usize,
    replicas_of: impl Fn(&serde_json::Value) -> serde_json::Value,
) -> Vec<serde_json::Value> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(600);
    loop {
        let s = gw.json("/v1/status").await;
        let ready: Vec<serde_json::Value> = replicas_of(&s)
            .as_array()
            .map(|rs| {
                rs.iter()
                    .filter(|r| r["state"] == "ready")
                    .cloned()
                    .collect()
            })
            .unwrap_or_default();
        if ready.len() == n {
            return ready;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the vLLM engines did not become ready: {s}\n{}",
            gw.log()
        );
        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    }
}
