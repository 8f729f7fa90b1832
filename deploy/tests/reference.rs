//! `docs/reference/config.md` is the page the config's schema renders:
//! a key added without the page, or a key on the page the file no longer
//! takes, fails here.

use std::collections::BTreeSet;
use std::path::Path;

use warmgate_deploy::reference::{config_keys, config_markdown, config_schema};

fn page_path() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/reference/config.md")
}

#[test]
fn the_config_reference_is_the_schema_s_page() {
    let generated = config_markdown(&config_schema());
    let path = page_path();
    if std::env::var_os("WARMGATE_WRITE_REFERENCE").is_some() {
        std::fs::write(&path, &generated).expect("write the reference");
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        committed == generated,
        "docs/reference/config.md is out of date: run \
         `WARMGATE_WRITE_REFERENCE=1 cargo nextest run -p warmgate-deploy --test reference`"
    );
}

/// Read independently of the renderer: every key the page's tables list,
/// under its section's header, is one the file takes, and the reverse.
#[test]
fn the_page_documents_every_key_and_no_other() {
    let page = std::fs::read_to_string(page_path()).expect("docs/reference/config.md");
    let mut section = String::new();
    let mut documented = BTreeSet::new();
    for line in page.lines() {
        if let Some(title) = line.strip_prefix("## ") {
            section = title
                .trim_matches('`')
                .trim_start_matches('[')
                .trim_start_matches('[')
                .trim_end_matches(']')
                .trim_end_matches(']')
                .to_string();
            if section == "Top level" {
                section.clear();
            }
        } else if let Some(row) = line.strip_prefix("| `") {
            let key = row.split('`').next().unwrap_or_default();
            documented.insert(if section.is_empty() {
                key.to_string()
            } else {
                format!("{section}.{key}")
            });
        }
    }
    let keys = config_keys(&config_schema());
    let undocumented: Vec<_> = keys.difference(&documented).collect();
    let unknown: Vec<_> = documented.difference(&keys).collect();
    assert!(
        undocumented.is_empty() && unknown.is_empty(),
        "keys the reference does not document: {undocumented:?}; \
         keys it documents that the config does not take: {unknown:?}"
    );
}
