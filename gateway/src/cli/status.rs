//! `warmgate status`: the apps, pools and replicas table, printed once or
//! refreshed in place.

use std::io::Write as _;
use std::time::Duration;

use serde_json::Value;

use super::Output;
use super::client::{client_runtime, get_json};

pub(super) fn status(gateway: &str, watch: bool, interval: Duration, output: Output) -> i32 {
    let rt = match client_runtime() {
        Ok(rt) => rt,
        Err(code) => return code,
    };
    rt.block_on(async {
        loop {
            let table = match get_json(gateway, "/v1/status").await {
                Ok(v) if output == Output::Json => format!("{v:#}\n"),
                Ok(v) => render_status(&v),
                Err(e) => {
                    eprintln!("error: {e}");
                    return e.exit_code();
                }
            };
            if watch {
                // Home the cursor and clear the screen: a table refreshed in place.
                print!("\x1b[H\x1b[2J{table}");
            } else {
                print!("{table}");
            }
            let _ = std::io::stdout().flush();
            if !watch {
                return 0;
            }
            tokio::select! {
                _ = tokio::time::sleep(interval) => {}
                _ = tokio::signal::ctrl_c() => return 0,
            }
        }
    })
}

/// The `! ...` lines under an app or pool that keeps failing: its state
/// (`CrashLoopBackOff` past the bound) and its last error, output included.
fn health_line(out: &mut String, health: &Value) {
    use std::fmt::Write as _;
    let failing = health["failing_to_start"].as_bool() == Some(true);
    let looping = health["crash_loop"].as_bool() == Some(true);
    let Some(err) = health["last_error"].as_str().filter(|_| failing || looping) else {
        return;
    };
    if looping {
        let retry = health["retry_in"]
            .as_f64()
            .map_or(String::new(), |s| format!(", next try in {}s", s.ceil()));
        let _ = writeln!(
            out,
            "  ! CrashLoopBackOff: {} failures in a row{retry}",
            health["failures"]
        );
    }
    let mut lines = err.lines();
    if let Some(first) = lines.next() {
        let _ = writeln!(out, "  ! {first}");
    }
    for l in lines {
        let _ = writeln!(out, "  ! {l}");
    }
}

/// The `status` table: one line per app, then its replicas.
pub fn render_status(v: &Value) -> String {
    use std::fmt::Write as _;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<20} {:<22} {:>9} {:>11} {:>7} {:>10}",
        "APP", "REVISION", "READY/DES", "INFLIGHT", "QUEUED", "COLD START"
    );
    let apps = v["apps"].as_array().cloned().unwrap_or_default();
    for app in &apps {
        let pool = &app["pool"];
        let cold = pool["last_cold_start"]["ready_seconds"]
            .as_f64()
            .map(|s| format!("{s:.2}s"))
            .unwrap_or_else(|| "-".into());
        let _ = writeln!(
            out,
            "{:<20} {:<22} {:>9} {:>11} {:>7} {:>10}",
            app["name"].as_str().unwrap_or("?"),
            app["revision"].as_str().unwrap_or("?"),
            format!("{}/{}", app["ready"], app["desired"]),
            format!("{}/{}", app["inflight"], app["capacity"]),
            app["queued"],
            cold,
        );
        health_line(&mut out, &pool["health"]);
        replica_lines(&mut out, pool);
    }
    let pools = v["pools"].as_array().cloned().unwrap_or_default();
    if !pools.is_empty() {
        let _ = writeln!(
            out,
            "\n{:<20} {:>9} {:>11} {:>9} {:>9}",
            "POOL", "READY/DES", "INFLIGHT", "PENDING", "WEIGHTS"
        );
        for p in &pools {
            let weights = match p["syncing_to"].as_u64() {
                Some(to) => format!("v{}>v{to}", p["weights_version"]),
                None => format!("v{}", p["weights_version"]),
            };
            let _ = writeln!(
                out,
                "{:<20} {:>9} {:>11} {:>9} {:>9}",
                p["name"].as_str().unwrap_or("?"),
                format!("{}/{}", p["ready"], p["pool"]["desired"]),
                format!(
                    "{}/{}",
                    p["inflight"],
                    p["ready"].as_u64().unwrap_or(0) * p["concurrency"].as_u64().unwrap_or(0)
                ),
                p["pending"],
                weights,
            );
            health_line(&mut out, &p["pool"]["health"]);
            replica_lines(&mut out, &p["pool"]);
        }
    }
    if apps.is_empty() && pools.is_empty() {
        out.push_str("(no apps or pools configured)\n");
    }
    let changed: Vec<&str> = v["api_changes"]
        .as_array()
        .map(|a| a.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    if !changed.is_empty() {
        let _ = writeln!(
            out,
            "\nchanged through the API, kept over the config file: {} \
             (`warmgate apply FILE`, SIGHUP or `serve --config-wins` makes the file win)",
            changed.join(", ")
        );
    }
    out
}

/// One line per replica of a pool-manager target: id, state, slots in
/// use, idle time, weights version, GPUs, pid and any pending reason.
fn replica_lines(out: &mut String, target: &Value) {
    use std::fmt::Write as _;
    for r in target["replicas"].as_array().cloned().unwrap_or_default() {
        let state = r["state"].as_str().unwrap_or("?");
        let detail = r["reason"].as_str().unwrap_or("");
        let idle = r["idle_seconds"]
            .as_f64()
            .map(|s| format!("idle {}", human_secs(s)))
            .unwrap_or_default();
        let weights = r["weights_version"]
            .as_u64()
            .map(|v| format!("v{v}"))
            .unwrap_or_default();
        let gpus = r["gpus"]
            .as_array()
            .filter(|g| !g.is_empty())
            .map(|g| {
                format!(
                    "gpu {}",
                    g.iter()
                        .map(|x| x.to_string())
                        .collect::<Vec<_>>()
                        .join(",")
                )
            })
            .unwrap_or_default();
        let _ = writeln!(
            out,
            "  {:<18} {:<9} {:>5} {:<10} {:<5} {:<10} {} {}",
            r["id"].as_str().unwrap_or("?"),
            state,
            format!("{}/{}", r["inflight"], r["concurrency"]),
            idle,
            weights,
            gpus,
            r["pid"]
                .as_u64()
                .map(|p| format!("pid {p}"))
                .unwrap_or_default(),
            detail,
        );
    }
}

fn human_secs(s: f64) -> String {
    if s < 60.0 {
        format!("{s:.0}s")
    } else if s < 3600.0 {
        format!("{:.0}m", s / 60.0)
    } else {
        format!("{:.1}h", s / 3600.0)
    }
}
