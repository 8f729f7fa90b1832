//! The RL example end to end: `cartpole-train` drives a warm pool of real
//! `cartpole-worker` processes through the gateway (weights written to a
//! local object store, synced in place each iteration, rollouts pinned to
//! the new version) and must actually learn CartPole.

mod common;

use std::process::Command;

use common::{Gateway, bin};
use serde_json::Value;

/// A fixed seed learns in 36–66 iterations (seeds 1–7); the bound leaves
/// room without letting a broken learner pass.
const MAX_ITERATIONS: u32 = 150;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reinforce_through_the_gateway_solves_cartpole() {
    let worker = bin("cartpole-worker");
    let gw = Gateway::start(&format!(
        r#"
        [[pools]]
        name = "rollouts"
        command = ["{}"]
        replicas = [2, 2]
        concurrency = 4
        {}
        "#,
        worker.display(),
        common::allow_temp_checkpoints()
    ));
    let store = gw.dir.path().join("store");
    let png = gw.dir.path().join("curve.png");
    let gateway = gw.url.clone();
    let out = tokio::task::spawn_blocking(move || {
        Command::new(bin("cartpole-train"))
            .args(["--gateway", &gateway, "--seed", "1"])
            .args(["--iterations", &MAX_ITERATIONS.to_string()])
            .arg("--store")
            .arg(&store)
            .arg("--png")
            .arg(&png)
            .output()
            .expect("run cartpole-train")
    })
    .await
    .expect("join");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "the trainer failed:\n{stdout}\n{stderr}\n{}",
        gw.log()
    );

    // Keep the curve for people to look at (`make pictures`).
    let keep = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("rl");
    std::fs::create_dir_all(&keep).expect("mkdir");
    std::fs::copy(
        gw.dir.path().join("curve.png"),
        keep.join("cartpole-curve.png"),
    )
    .expect("the trainer saved its return curve");

    // The table: iteration, version, mean return, mean of the last 100.
    let rows: Vec<(u64, f64, f64)> = stdout
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            Some((
                f.get(1)?.parse().ok()?,
                f.get(2)?.parse().ok()?,
                f.get(3)?.parse().ok()?,
            ))
        })
        .collect();
    assert!(rows.len() >= 2, "{stdout}");
    let (_, first, _) = rows[0];
    assert!(
        first < 40.0,
        "the first policy should score like a random one (~22), got {first}"
    );
    let (last_version, _, last100) = *rows.last().expect("rows");
    assert!(last100 >= 195.0, "{stdout}");
    assert!(stdout.contains("solved"), "{stdout}");

    // Every iteration was a new version, synced into the pool in place:
    // the same two processes served all of them.
    let status = gw.json("/v1/status").await;
    let pool = &status["pools"][0];
    assert_eq!(pool["weights_version"], last_version, "{status}");
    let replicas = pool["pool"]["replicas"].as_array().expect("replicas");
    assert_eq!(replicas.len(), 2, "{status}");
    for r in replicas {
        assert_eq!(r["weights_version"], last_version, "{r}");
        assert!(
            r["id"] == "rollouts-1" || r["id"] == "rollouts-2",
            "a replica was restarted: {r}"
        );
    }
    assert_eq!(pool["pool"]["restarts"], Value::from(0));
    // Each version is in the store as safetensors, and the curve was saved.
    let v1 = gw.dir.path().join("store/v1/policy.safetensors");
    assert!(v1.exists(), "{} missing", v1.display());
    let png = std::fs::read(gw.dir.path().join("curve.png")).expect("png");
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
}
