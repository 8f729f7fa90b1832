//! `warmgate apply`: make a running gateway serve the apps and pools of a
//! config file.

use std::time::Duration;

use serde_json::Value;
use warmgate_deploy::Config;

use super::client::{CallError, api, block_on_call};
use super::{EXIT_USAGE, Output};

/// `warmgate apply`: the file's apps and pools put, the gateway's others
/// deleted (deletions first, so a name may move from a pool to an app),
/// one line per change (or, with `-o json`, one object listing them, the
/// refused ones with the gateway's status and message). Exit 0 when every
/// change was taken, 1 when one was refused (the others still apply), 64
/// for a bad file.
pub(super) fn apply(gateway: &str, file: &std::path::Path, output: Output) -> i32 {
    let config = match Config::load(file) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("error: {e}");
            return EXIT_USAGE;
        }
    };
    let status = match api(
        gateway,
        http::Method::GET,
        "/v1/status",
        None,
        Duration::from_secs(10),
    ) {
        Ok(v) => v,
        Err(code) => return code,
    };
    let running = |kind: &str| -> Vec<String> {
        status[kind]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|x| x["name"].as_str().map(str::to_string))
            .collect()
    };
    let mut refused = false;
    let mut changes = Vec::new();
    let mut change = |method: http::Method, kind: &str, name: &str, body: Option<Value>| {
        let path = format!("/v1/{kind}s/{name}");
        let mut row = serde_json::json!({"kind": kind, "name": name});
        match block_on_call(gateway, method, &path, body, Duration::from_secs(60)) {
            Ok(v) => {
                row["change"] = v["change"].clone();
                if let Some(rev) = v["revision"].as_str() {
                    row["revision"] = rev.into();
                }
                if output == Output::Table {
                    let what = v["change"].as_str().unwrap_or("?").replace('_', " ");
                    match v["revision"].as_str() {
                        Some(rev) => println!("{kind} {name}: {what} (to {rev})"),
                        None => println!("{kind} {name}: {what}"),
                    }
                }
            }
            Err(e) => {
                refused = true;
                eprintln!("error: {e}");
                row["error"] = match &e {
                    CallError::Answered {
                        status, message, ..
                    } => serde_json::json!({"status": status, "message": message}),
                    other => serde_json::json!({"message": other.to_string()}),
                };
            }
        }
        changes.push(row);
    };
    for name in running("pools") {
        if !config.pools.iter().any(|p| p.name == name) {
            change(http::Method::DELETE, "pool", &name, None);
        }
    }
    for name in running("apps") {
        if !config.apps.iter().any(|a| a.name == name) {
            change(http::Method::DELETE, "app", &name, None);
        }
    }
    for pool in &config.pools {
        change(
            http::Method::PUT,
            "pool",
            &pool.name,
            serde_json::to_value(pool).ok(),
        );
    }
    for app in &config.apps {
        change(
            http::Method::PUT,
            "app",
            &app.name,
            serde_json::to_value(app).ok(),
        );
    }
    if output == Output::Json {
        println!("{:#}", serde_json::json!({ "changes": changes }));
    }
    if refused { 1 } else { 0 }
}
