//! `warmgate promote`, `rollback` and `revisions`: moving an app's traffic
//! between revisions, and listing them.

use std::time::Duration;

use serde_json::Value;

use super::Output;
use super::client::api;

/// What `warmgate promote` asks for.
pub(super) struct Promotion {
    pub(super) canary: Option<u8>,
    pub(super) bake: Option<humantime::Duration>,
    pub(super) wait: bool,
    pub(super) in_place: bool,
    pub(super) adapter: Option<String>,
}

/// `warmgate promote`.
pub(super) fn promote(
    gateway: &str,
    app: &str,
    checkpoint: &str,
    p: Promotion,
    output: Output,
) -> i32 {
    let Promotion {
        canary,
        bake,
        wait,
        in_place,
        adapter,
    } = p;
    let mut body = serde_json::json!({"checkpoint": checkpoint, "wait": wait});
    if in_place {
        body["in_place"] = true.into();
    }
    let what = match &adapter {
        Some(a) => {
            body["adapter"] = a.clone().into();
            format!("{app}: adapter {a}")
        }
        None => app.to_string(),
    };
    if let Some(c) = canary {
        body["canary"] = c.into();
    }
    if let Some(b) = bake {
        body["bake"] = b.to_string().into();
    }
    let timeout = if wait {
        Duration::from_secs(24 * 3600)
    } else {
        Duration::from_secs(600)
    };
    let v = match api(
        gateway,
        http::Method::POST,
        &format!("/v1/apps/{app}/promote"),
        Some(body),
        timeout,
    ) {
        Ok(v) => v,
        Err(code) => return code,
    };
    let rev = v["revision"].as_str().unwrap_or("?");
    if output == Output::Json {
        println!("{v:#}");
    }
    if !wait {
        if output == Output::Table {
            let follow = match &adapter {
                Some(_) => "`warmgate status`".to_string(),
                None => format!("`warmgate revisions {app}`"),
            };
            println!("{what}: promoting {rev} (follow it with {follow})");
        }
        return 0;
    }
    let p = &v["promotion"];
    match p["phase"].as_str() {
        Some("done") => {
            if output == Output::Table {
                println!("{what}: {rev} serves 100%");
            }
            0
        }
        Some(phase) => {
            eprintln!(
                "{what}: {rev} did not take over ({phase}): {}",
                p["reason"].as_str().unwrap_or("no reason given")
            );
            1
        }
        None => {
            eprintln!("{app}: unexpected answer {v}");
            1
        }
    }
}

/// `warmgate rollback`.
pub(super) fn rollback(gateway: &str, app: &str, output: Output) -> i32 {
    match api(
        gateway,
        http::Method::POST,
        &format!("/v1/apps/{app}/rollback"),
        None,
        Duration::from_secs(30),
    ) {
        Ok(v) => {
            match output {
                Output::Json => println!("{v:#}"),
                Output::Table => println!(
                    "{app}: rolling back to {}",
                    v["revision"].as_str().unwrap_or("?")
                ),
            }
            0
        }
        Err(code) => code,
    }
}

/// `warmgate revisions`: the history as a table, then the recent notes.
pub(super) fn revisions(gateway: &str, app: &str, output: Output) -> i32 {
    match api(
        gateway,
        http::Method::GET,
        &format!("/v1/apps/{app}/revisions"),
        None,
        Duration::from_secs(10),
    ) {
        Ok(v) => {
            match output {
                Output::Json => println!("{v:#}"),
                Output::Table => print!("{}", render_revisions(&v)),
            }
            0
        }
        Err(code) => code,
    }
}

/// Unix seconds as an RFC 3339 time, to the second.
fn rfc3339(t: f64) -> String {
    humantime::format_rfc3339_seconds(std::time::UNIX_EPOCH + Duration::from_secs_f64(t.max(0.0)))
        .to_string()
}

/// The `revisions` table.
pub fn render_revisions(v: &Value) -> String {
    use std::fmt::Write as _;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<16} {:<9} {:>7} {:<20} {:<22} CHECKPOINT",
        "REVISION", "STATE", "TRAFFIC", "CREATED", "VERSION"
    );
    for r in v["revisions"].as_array().cloned().unwrap_or_default() {
        let created = r["created_unix"].as_f64().map(rfc3339).unwrap_or_default();
        let _ = writeln!(
            out,
            "{:<16} {:<9} {:>6}% {:<20} {:<22} {}",
            r["id"].as_str().unwrap_or("?"),
            r["state"].as_str().unwrap_or("?"),
            r["traffic"],
            created,
            r["checkpoint_version"].as_str().unwrap_or("-"),
            r["checkpoint"].as_str().unwrap_or("-"),
        );
        if let Some(reason) = r["reason"].as_str() {
            let _ = writeln!(out, "  ! {reason}");
        }
    }
    let notes = v["notes"].as_array().cloned().unwrap_or_default();
    if !notes.is_empty() {
        out.push_str("\nhistory:\n");
        for n in notes.iter().rev().take(10).rev() {
            let at = n["at_unix"].as_f64().map(rfc3339).unwrap_or_default();
            let _ = writeln!(out, "  {at}  {}", n["what"].as_str().unwrap_or(""));
        }
    }
    out
}
