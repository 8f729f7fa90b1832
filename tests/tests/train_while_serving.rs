//! Train while serving: `charlm-grpo` fine-tunes the tiny char LM by GRPO
//! on a warm pool of real `charlm-worker` processes (rollouts as pool
//! tasks, each step's weights synced in place), while the same processes
//! answer `/v1/completions` for clients of the app the pool serves, some
//! of them pinning the newest version they have seen. The reward must
//! rise past the trainer's target, and no completion may fail.

mod common;

use std::collections::BTreeSet;
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use common::{Gateway, bin};
use serde_json::{Value, json};

/// The reward level the trainer must reach (its default).
const TARGET: &str = "0.4";

/// What the clients saw.
#[derive(Default, Debug)]
struct Seen {
    ok: u64,
    failed: Vec<String>,
    versions: BTreeSet<u64>,
    pinned: u64,
}

/// Sends completions until `stop`; every third one pins the newest
/// version seen so far, and every other one streams.
async fn client(gw_url: String, http: reqwest::Client, stop: Arc<AtomicBool>) -> Seen {
    let mut seen = Seen::default();
    let mut newest = 0u64;
    let mut i = 0u64;
    while !stop.load(Ordering::Relaxed) {
        i += 1;
        let stream = i.is_multiple_of(2);
        let mut req = http.post(format!("{gw_url}/v1/completions")).json(&json!({
            "model": "charlm",
            "prompt": "the cat ",
            "max_tokens": 24,
            "stream": stream,
        }));
        let pin = i.is_multiple_of(3) && newest > 0;
        if pin {
            req = req.header("x-warmgate-min-weights-version", newest.to_string());
        }
        let resp = match req.send().await {
            Ok(r) => r,
            Err(e) => {
                seen.failed.push(format!("send: {e}"));
                continue;
            }
        };
        let status = resp.status();
        let version: Option<u64> = resp
            .headers()
            .get("x-warmgate-weights-version")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse().ok());
        let body = resp.text().await.unwrap_or_default();
        let whole = if stream {
            body.contains("data: [DONE]")
        } else {
            serde_json::from_str::<Value>(&body)
                .ok()
                .and_then(|v| v["choices"][0]["text"].as_str().map(str::len))
                == Some(24)
        };
        match version {
            Some(v) if status.is_success() && whole => {
                if pin && v < newest {
                    seen.failed
                        .push(format!("pinned to {newest}, served by version {v}"));
                }
                seen.ok += 1;
                seen.pinned += u64::from(pin);
                seen.versions.insert(v);
                newest = newest.max(v);
            }
            _ => seen.failed.push(format!("{status}: {body}")),
        }
    }
    seen
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpo_fine_tunes_the_model_the_same_pool_serves() {
    let gw = Gateway::start(&format!(
        r#"
        [[pools]]
        name = "policy"
        command = ["{}"]
        replicas = [2, 2]
        concurrency = 4

        [[apps]]
        name = "charlm"
        pool = "policy"
        {}
        "#,
        bin("charlm-worker").display(),
        common::allow_temp_checkpoints()
    ));
    common::eventually("two ready replicas", || async {
        let s = gw.json("/v1/status").await;
        (s["pools"][0]["ready"] == 2).then_some(())
    })
    .await;
    let stop = Arc::new(AtomicBool::new(false));
    let clients: Vec<_> = (0..2)
        .map(|_| tokio::spawn(client(gw.url.clone(), gw.http.clone(), stop.clone())))
        .collect();

    let store = gw.dir.path().join("store");
    let png = gw.dir.path().join("reward.png");
    let gateway = gw.url.clone();
    let out = {
        let png = png.clone();
        tokio::task::spawn_blocking(move || {
            Command::new(bin("charlm-grpo"))
                .args(["--gateway", &gateway, "--seed", "1", "--target", TARGET])
                .arg("--store")
                .arg(&store)
                .arg("--png")
                .arg(&png)
                .output()
                .expect("run charlm-grpo")
        })
        .await
        .expect("join")
    };
    stop.store(true, Ordering::Relaxed);
    let mut seen = Seen::default();
    for c in clients {
        let s = c.await.expect("client");
        seen.ok += s.ok;
        seen.pinned += s.pinned;
        seen.failed.extend(s.failed);
        seen.versions.extend(s.versions);
    }
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "the trainer did not reach the target:\n{stdout}\n{stderr}\n{}",
        gw.log()
    );
    eprintln!("{stdout}");
    eprintln!(
        "TRAIN-WHILE-SERVING: {} completions served during training ({} pinned), versions {:?}, {} failed",
        seen.ok,
        seen.pinned,
        seen.versions,
        seen.failed.len()
    );
    assert!(
        seen.failed.is_empty(),
        "completions failed while training: {:?}",
        seen.failed
    );
    // Clients were served on the weights as they moved, not on one version.
    assert!(seen.versions.len() >= 3, "{:?}", seen.versions);
    assert!(seen.pinned > 0, "no client pinned a version");

    // The reward table: it started low and rose past the target.
    let rewards: Vec<f64> = stdout
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f.len() == 6 && f[0].parse::<u64>().is_ok())
                .then(|| f[2].parse().ok())
                .flatten()
        })
        .collect();
    assert!(rewards.len() >= 3, "{stdout}");
    let target: f64 = TARGET.parse().expect("target");
    assert!(rewards[0] < target / 2.0, "it started high: {rewards:?}");
    let last3 = rewards[rewards.len() - 3..].iter().sum::<f64>() / 3.0;
    assert!(last3 >= target, "{rewards:?}");

    // The pool now serves the final version to everyone.
    let final_version = gw.json("/v1/status").await["pools"][0]["weights_version"]
        .as_u64()
        .expect("version");
    let r = gw
        .http
        .post(gw.at("/v1/completions"))
        .header("x-warmgate-min-weights-version", final_version.to_string())
        .json(&json!({"model": "charlm", "prompt": "the cat ", "max_tokens": 8}))
        .send()
        .await
        .expect("send");
    assert_eq!(r.status(), 200);
    assert_eq!(
        r.headers()["x-warmgate-weights-version"],
        final_version.to_string().as_str()
    );

    // Keep the curve for people to look at (`make pictures`).
    let keep = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("rl");
    std::fs::create_dir_all(&keep).expect("mkdir");
    std::fs::copy(&png, keep.join("charlm-grpo-curve.png")).expect("the trainer saved its curve");
}
