//! What a local worker can reach, and what it leaves behind, end to end
//! with the real binary and real processes:
//! - a worker's environment holds the worker contract, the app's `env`
//!   and `backend.pass_env`, never the gateway's secrets;
//! - a worker's helper processes (its process group) end with it, however
//!   it ends: `kill -9` from outside, a crash loop, or `serve` stopping.

mod common;

use common::{Gateway, eventually};
use serde_json::Value;

const TOKEN: &str = "isolation-admin-token-5d1e0c7a";
const TEAM_KEY: &str = "isolation-team-key-0b9f3a2c41";
const AWS_SECRET: &str = "isolation-aws-secret-7c2d99e1";

/// `GET /v1/status` with the admin token.
async fn status(gw: &Gateway) -> Value {
    gw.http
        .get(gw.at("/v1/status"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .expect("GET /v1/status")
        .json()
        .await
        .expect("json")
}

/// The initial environment of a process, as `/proc/PID/environ` holds it.
fn environ(pid: i32) -> Vec<String> {
    let raw = std::fs::read(format!("/proc/{pid}/environ")).expect("read environ");
    raw.split(|b| *b == 0)
        .filter(|v| !v.is_empty())
        .map(|v| String::from_utf8_lossy(v).into_owned())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_get_the_contract_and_the_listed_variables_but_no_secret() {
    let gw = Gateway::start_with(
        r#"
        [backend]
        pass_env = ["ISOLATION_PASSED"]

        [[tenants]]
        name = "team"
        api_key_env = "ISOLATION_TEAM_KEY"

        [[apps]]
        name = "env"
        command = ["{worker}"]
        env = { FROM_APP = "app-value" }
        [apps.autoscale]
        min = 1
        "#,
        &[],
        &[
            ("WARMGATE_ADMIN_TOKEN", TOKEN),
            ("ISOLATION_TEAM_KEY", TEAM_KEY),
            ("AWS_SECRET_ACCESS_KEY", AWS_SECRET),
            ("ISOLATION_PASSED", "passed-value"),
            ("ISOLATION_NOT_LISTED", "not-listed-value"),
        ],
    );
    let pid = eventually("a ready replica of env", || async {
        let s = status(&gw).await;
        let app = s["apps"].as_array()?.iter().find(|a| a["name"] == "env")?;
        (app["ready"] == 1)
            .then(|| app["pool"]["replicas"][0]["pid"].as_i64())
            .flatten()
    })
    .await as i32;
    let env = environ(pid);
    let all = env.join("\n");
    for secret in [TOKEN, TEAM_KEY, AWS_SECRET, "not-listed-value"] {
        assert!(
            !all.contains(secret),
            "the worker's environment holds {secret}:\n{all}"
        );
    }
    for name in ["WARMGATE_ADMIN_TOKEN", "AWS_SECRET_ACCESS_KEY"] {
        assert!(
            !env.iter().any(|v| v.starts_with(&format!("{name}="))),
            "{name} is set:\n{all}"
        );
    }
    for want in ["ISOLATION_PASSED=passed-value", "FROM_APP=app-value"] {
        assert!(env.iter().any(|v| v == want), "{want} is missing:\n{all}");
    }
    for name in ["PATH", "PORT", "WARMGATE_REPLICA", "WARMGATE_TARGET"] {
        assert!(
            env.iter().any(|v| v.starts_with(&format!("{name}="))),
            "{name} is missing:\n{all}"
        );
    }
}

/// A `sleep` whose argument is unique to this test process, so that
/// parallel tests and other runs never see each other's helpers.
struct Marker(String);

impl Marker {
    fn new(base: u32) -> Marker {
        Marker(format!("{base}.{}", std::process::id()))
    }

    /// `(pid, process group)` of every live `sleep <marker>`.
    fn helpers(&self) -> Vec<(i32, i32)> {
        let Ok(dir) = std::fs::read_dir("/proc") else {
            return Vec::new();
        };
        dir.flatten()
            .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
            .filter(|pid| {
                std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|c| {
                    let args: Vec<&[u8]> = c.split(|b| *b == 0).collect();
                    args.len() >= 2 && args[0].ends_with(b"sleep") && args[1] == self.0.as_bytes()
                })
            })
            .filter_map(|pid| {
                let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
                let rest = &stat[stat.rfind(')')? + 1..];
                let mut fields = rest.split_whitespace();
                let state = fields.next()?;
                if state == "Z" || state == "X" {
                    return None;
                }
                let pgid = fields.nth(1)?.parse().ok()?;
                Some((pid, pgid))
            })
            .collect()
    }
}

impl Drop for Marker {
    /// A failed run must not leave its helpers sleeping for hours.
    fn drop(&mut self) {
        for (pid, _) in self.helpers() {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_killed_from_outside_leaves_no_helper_behind() {
    let marker = Marker::new(31123);
    let mut gw = Gateway::start(&format!(
        r#"
        [[apps]]
        name = "helper"
        command = ["sh", "-c", "sleep {} & exec {{worker}}"]
        [apps.autoscale]
        min = 1
        "#,
        marker.0
    ));
    gw.wait_ready("helper", 1).await;
    let old = gw.replica_pids("helper").await[0];
    eventually("the worker's helper runs in its group", || async {
        marker
            .helpers()
            .iter()
            .any(|(_, g)| *g == old)
            .then_some(())
    })
    .await;

    // `kill -9` of the worker alone, as an OOM kill would.
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(old),
        nix::sys::signal::Signal::SIGKILL,
    )
    .expect("kill the worker");
    eventually("a replacement is ready", || async {
        let pids = gw.replica_pids("helper").await;
        let s = gw.app_status("helper").await;
        (s["ready"] == 1 && !pids.contains(&old) && !pids.is_empty()).then_some(())
    })
    .await;
    eventually("the killed worker's helper is gone", || async {
        let left: Vec<_> = marker
            .helpers()
            .into_iter()
            .filter(|(_, g)| *g == old)
            .collect();
        left.is_empty().then_some(())
    })
    .await;

    // And the replacement's helper goes with `serve`.
    assert!(gw.stop().success(), "{}", gw.log());
    eventually("no helper outlives serve", || async {
        marker.helpers().is_empty().then_some(())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_loop_leaves_no_helper_behind() {
    let marker = Marker::new(31124);
    let mut gw = Gateway::start(&format!(
        r#"
        [[apps]]
        name = "crashing"
        command = ["sh", "-c", "sleep {} & exit 1"]
        [apps.autoscale]
        min = 1
        "#,
        marker.0
    ));
    eventually("three crashes", || async {
        let s = gw.app_status("crashing").await;
        (s["pool"]["restarts"].as_u64().unwrap_or(0) >= 3).then_some(())
    })
    .await;
    assert!(gw.stop().success(), "{}", gw.log());
    eventually("no helper of a crashed worker is left", || async {
        marker.helpers().is_empty().then_some(())
    })
    .await;
}
