//! The reason a replica failed travels to the user: its failure, in brief,
//! in the error clients get; its last output, with its secrets redacted, in
//! the status and its whole log through the API and `warmgate logs` (admin
//! only), never only a path on the gateway's disk.

mod common;

use std::io::{BufRead as _, BufReader};
use std::process::{Command, Stdio};
use std::time::Duration;

use common::{Gateway, eventually, kind};
use serde_json::Value;

const SECRET: &str = "hf_do_not_print_me_42";

fn config() -> String {
    format!(
        r#"
        [backend]
        stop_grace = "1s"

        [[apps]]
        name = "oom"
        command = ["sh", "-c", "echo loading with token $HF_TOKEN; echo 'torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 GiB' >&2; exit 1"]
        env = {{ HF_TOKEN = "{SECRET}" }}

        [[apps]]
        name = "ticker"
        command = ["sh", "-c", "i=0; while true; do echo tick $$i; i=$$((i+1)); sleep 0.1; done"]
        startup_timeout = "5m"

        [[pools]]
        name = "rollouts"
        command = ["{{worker}}"]
        replicas = [1, 1]
        "#
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_start_says_why_in_the_error_and_the_log_is_read_through_the_api() {
    let gw = Gateway::start(&config());

    // The client's error names the failure and the replica, never the
    // worker's words (they may quote another tenant's request or a secret).
    let r = gw
        .http
        .get(gw.at("/apps/oom/x"))
        .send()
        .await
        .expect("send");
    assert_eq!(r.status().as_u16(), 502);
    let body: Value = r.json().await.expect("json");
    assert_eq!(kind(&body), "replica_failed", "{body}");
    let msg = body["error"]["message"].as_str().unwrap_or_default();
    assert!(
        msg.contains("exited with status 1") && msg.contains("replica oom-00001-"),
        "{msg}"
    );
    assert!(
        !msg.contains("CUDA") && !msg.contains("loading with token"),
        "{msg}"
    );
    assert!(!msg.contains(SECRET) && !msg.contains("/logs/"), "{msg}");

    // The worker's last words, redacted, are the admins': the app's status
    // and the CLI's table.
    let s = gw.app_status("oom").await;
    let last = s["pool"]["health"]["last_error"]
        .as_str()
        .unwrap_or_default();
    assert!(
        last.contains("CUDA out of memory") && !last.contains(SECRET),
        "{s}"
    );
    let (code, out, err) = gw.warmgate(&["status"]);
    assert_eq!(code, Some(0), "{err}");
    assert!(out.contains("CUDA out of memory"), "{out}");

    // The whole log through `warmgate logs`, redacted too.
    let (code, out, err) = gw.warmgate(&["logs", "oom"]);
    assert_eq!(code, Some(0), "{err}");
    assert!(
        out.contains("loading with token [redacted]") && out.contains("CUDA out of memory"),
        "{out}"
    );
    assert!(!out.contains(SECRET), "{out}");
    // A pool's too, and a replica by name.
    eventually("the pool's replica is ready", || async {
        let s = gw.json("/v1/pools/rollouts").await;
        (s["ready"] == 1).then_some(())
    })
    .await;
    let v = gw.json("/v1/pools/rollouts/logs").await;
    assert_eq!(v["replica"], "rollouts-1", "{v}");
    let (code, _, err) = gw.warmgate(&["logs", "rollouts", "rollouts-1"]);
    assert_eq!(code, Some(0), "{err}");
    // Another app's replica is not one of this pool's; unknown names are 404.
    let (code, _, err) = gw.warmgate(&["logs", "rollouts", "oom-00001-1"]);
    assert_eq!(code, Some(66), "{err}");
    let (code, _, err) = gw.warmgate(&["logs", "nope"]);
    assert_eq!(code, Some(66), "{err}");

    // Admin only.
    let anonymous = reqwest::Client::new();
    let r = anonymous
        .get(gw.at("/v1/apps/oom/logs"))
        .send()
        .await
        .expect("send");
    assert_eq!(r.status().as_u16(), 401);
}

/// `warmgate logs -f` keeps printing what a running replica writes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logs_follow_a_running_replica() {
    let gw = Gateway::start(&config());
    // A request wakes the app; its worker prints and never becomes ready.
    let client = gw.http.clone();
    let wake = gw.at("/apps/ticker/x");
    tokio::spawn(async move {
        let _ = client
            .get(wake)
            .timeout(Duration::from_secs(60))
            .send()
            .await;
    });
    eventually("the ticker has a log", || async {
        let r = gw
            .http
            .get(gw.at("/v1/apps/ticker/logs"))
            .send()
            .await
            .ok()?;
        let v: Value = r.json().await.ok()?;
        v["text"]
            .as_str()
            .is_some_and(|t| t.contains("tick 1"))
            .then_some(())
    })
    .await;
    let mut child = Command::new(common::bin("warmgate"))
        .args(["logs", "ticker", "-f", "--tail", "1", "--gateway", &gw.url])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("warmgate logs -f");
    let stdout = child.stdout.take().expect("stdout");
    let ticks = tokio::task::spawn_blocking(move || {
        // Reads until the ticks seen span more than one read of the API.
        let mut seen = Vec::new();
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if let Some(n) = line
                .strip_prefix("tick ")
                .and_then(|n| n.parse::<u64>().ok())
            {
                seen.push(n);
            }
            if seen.len() >= 25 {
                break;
            }
        }
        seen
    });
    let ticks = tokio::time::timeout(Duration::from_secs(120), ticks)
        .await
        .expect("ticks within two minutes")
        .expect("join");
    let _ = child.kill();
    let _ = child.wait();
    assert_eq!(ticks.len(), 25, "{ticks:?}");
    assert!(
        ticks.windows(2).all(|w| w[1] == w[0] + 1),
        "every line once, in order: {ticks:?}"
    );
}

/// Redaction holds however the log is read and however the worker prints
/// its secrets: JSON-escaped, in a URL's password, past a long line's cut,
/// or read back a few bytes at a time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn secrets_stay_redacted_escaped_in_urls_and_read_in_small_pieces() {
    let long = "x".repeat(400);
    let gw = Gateway::start(&format!(
        r#"
        [[apps]]
        name = "leaky"
        command = ["sh", "-c", "echo {long} $HF_TOKEN; echo '{{\"token\": \"'$HF_TOKEN'\"}}'; echo db at $DATABASE_URL; exit 1"]
        env = {{ HF_TOKEN = "{SECRET}", DATABASE_URL = "postgres://app:pw-hunter2-db@db:5432/prod" }}
        "#
    ));
    // Started and failed: its log is written.
    let r = gw
        .http
        .get(gw.at("/apps/leaky/x"))
        .send()
        .await
        .expect("send");
    assert_eq!(r.status().as_u16(), 502);
    let status = gw.app_status("leaky").await;
    let last = status["pool"]["health"]["last_error"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(
        !last.contains("hf_do_not") && !last.contains("hunter2"),
        "{last}"
    );
    assert!(last.contains("postgres://app:[redacted]@db"), "{last}");
    // Read from the start, eight bytes at a time.
    let mut offset = 0u64;
    let mut seen = String::new();
    for _ in 0..400 {
        let v = gw
            .json(&format!(
                "/v1/apps/leaky/logs?replica=leaky-00001-1&offset={offset}&max_bytes=8"
            ))
            .await;
        seen.push_str(v["text"].as_str().unwrap_or_default());
        let next = v["next_offset"].as_u64().expect("next_offset");
        if next >= v["size"].as_u64().expect("size") {
            break;
        }
        assert!(next > offset, "a read moves on: {v}");
        offset = next;
    }
    for piece in ["hf_do_not", "print_me", "hunter2"] {
        assert!(!seen.contains(piece), "{piece} in {seen}");
    }
    assert!(seen.contains("db at"), "{seen}");
}
