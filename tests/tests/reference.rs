//! The reference in `docs/reference/` is what the binary says, not a copy
//! kept by hand: the CLI page is every command's `--help`, and the HTTP
//! API's OpenAPI document is the gateway's `/openapi.json`. When either
//! changes, this test fails and prints how to write the pages anew
//! (`WARMGATE_WRITE_REFERENCE=1 cargo nextest run -p warmgate-e2e --test
//! reference`).

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::{Gateway, bin};

fn reference(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../docs/reference")
        .join(name)
}

/// Commands documented, in the order `warmgate --help` lists them.
const COMMANDS: &[&[&str]] = &[
    &[],
    &["serve"],
    &["status"],
    &["apply"],
    &["promote"],
    &["rollback"],
    &["logs"],
    &["revisions"],
    &["weights"],
    &["weights", "pull"],
    &["simulate"],
    &["crds"],
    &["operator"],
    &["completions"],
];

/// The page `docs/reference/cli.md` should be.
fn cli_page() -> String {
    let mut page = String::from(
        "# `warmgate` command line\n\n\
         Every command's `--help`, as the binary prints it (checked by\n\
         `tests/tests/reference.rs`). Client commands reach the gateway at\n\
         `$WARMGATE_GATEWAY` (default `http://127.0.0.1:8080`) with\n\
         `$WARMGATE_ADMIN_TOKEN`, or the token a `warmgate serve` of the same\n\
         user made for itself (see `docs/reliability.md`).\n",
    );
    for args in COMMANDS {
        let out = Command::new(bin("warmgate"))
            .args(*args)
            .arg("--help")
            // Options read from the environment show its value: none.
            .env_clear()
            .env("NO_COLOR", "1")
            .output()
            .expect("run warmgate");
        assert!(out.status.success(), "warmgate {args:?} --help");
        let title = if args.is_empty() {
            "warmgate".to_string()
        } else {
            format!("warmgate {}", args.join(" "))
        };
        page.push_str(&format!(
            "\n## `{title}`\n\n```text\n{}```\n",
            String::from_utf8_lossy(&out.stdout)
        ));
    }
    page
}

/// Compares `generated` with the committed page, or writes it when asked.
fn check(name: &str, generated: &str) {
    let path = reference(name);
    if std::env::var_os("WARMGATE_WRITE_REFERENCE").is_some() {
        std::fs::create_dir_all(path.parent().expect("parent")).expect("mkdir");
        std::fs::write(&path, generated).expect("write");
        return;
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        committed == generated,
        "docs/reference/{name} is not what the binary says: write it anew with \
         WARMGATE_WRITE_REFERENCE=1 cargo nextest run -p warmgate-e2e --test reference"
    );
}

#[test]
fn the_cli_reference_is_every_command_s_help() {
    check("cli.md", &cli_page());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_http_reference_is_the_gateway_s_openapi_document() {
    let gw = Gateway::start("");
    let doc = gw.json("/openapi.json").await;
    // The bodies of PUT apps and pools are the config's own tables, typed.
    for (path, schema, key) in [
        ("/v1/apps/{app}", "AppSpec", "autoscale"),
        ("/v1/pools/{pool}", "PoolSpec", "queue"),
    ] {
        let body = &doc["paths"][path]["put"]["requestBody"]["content"]["application/json"];
        assert_eq!(
            body["schema"]["$ref"],
            format!("#/components/schemas/{schema}"),
            "{path}: {body}"
        );
        let props = &doc["components"]["schemas"][schema]["properties"];
        assert!(props[key]["$ref"].is_string(), "{schema}.{key}: {props}");
    }
    let text = serde_json::to_string_pretty(&doc).expect("json") + "\n";
    check("openapi.json", &text);
}
