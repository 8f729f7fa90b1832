//! The docs' configs work as written: every TOML snippet in the README and
//! `docs/` passes `warmgate serve --check`, with the programs, folders and
//! environment variables it names made by the test, as a user following
//! the page would have them. A snippet that shows some tables of an app
//! (`[apps.engine]`) is checked inside one app.

mod common;

use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// One ```toml block of a page.
struct Snippet {
    /// `docs/routing.md:17`
    at: String,
    text: String,
}

/// The ```toml blocks of `page`, their indentation (a block in a list)
/// taken off.
fn snippets_of(page: &Path) -> Vec<Snippet> {
    let text = std::fs::read_to_string(page).expect("read a page");
    let name = page
        .strip_prefix(root())
        .unwrap_or(page)
        .display()
        .to_string();
    let mut out = Vec::new();
    let mut lines = text.lines().enumerate();
    while let Some((n, line)) = lines.next() {
        if line.trim_start() != "```toml" {
            continue;
        }
        let indent = line.len() - line.trim_start().len();
        let body: Vec<&str> = lines
            .by_ref()
            .map(|(_, l)| l)
            .take_while(|l| l.trim() != "```")
            .map(|l| l.get(indent..).unwrap_or(l.trim_start()))
            .collect();
        out.push(Snippet {
            at: format!("{name}:{}", n + 1),
            text: body.join("\n") + "\n",
        });
    }
    out
}

/// Every snippet of the README and `docs/`.
fn snippets() -> Vec<Snippet> {
    let mut pages = vec![root().join("README.md")];
    let mut stack = vec![root().join("docs")];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).expect("read docs/") {
            let path = entry.expect("entry").path();
            if path.is_dir() {
                stack.push(path);
            } else if path.extension().is_some_and(|e| e == "md") {
                pages.push(path);
            }
        }
    }
    pages.sort();
    pages.iter().flat_map(|p| snippets_of(p)).collect()
}

/// The snippet as a config file: a fragment of an app's tables is put in
/// an app of its own (a pod's on Kubernetes).
fn as_config(snippet: &str) -> String {
    let first = snippet
        .lines()
        .map(str::trim)
        .find(|l| l.starts_with('['))
        .unwrap_or_default();
    if first.starts_with("[apps.kubernetes") {
        format!(
            "[backend]\nkind = \"kubernetes\"\n[[apps]]\nname = \"snippet\"\nimage = \"engine:1\"\n{snippet}"
        )
    } else if first.starts_with("[apps.") {
        format!(
            "[[apps]]\nname = \"snippet\"\ncommand = [\"engine\", \"--uds\", \"$WARMGATE_SOCKET\"]\n{snippet}"
        )
    } else {
        snippet.to_string()
    }
}

/// What a user following the page has: the programs the config runs (on
/// `bin/`, or at their relative path), its local checkpoints and watched
/// folders, its tenants' keys. Returns the environment to run with.
fn make_what_it_names(config: &str, dir: &Path) -> Result<Vec<(String, String)>, String> {
    let file = dir.join("config.toml");
    let parsed = warmgate_deploy::Config::parse(config, &file, dir).map_err(|e| e.to_string())?;
    let bin = dir.join("bin");
    std::fs::create_dir_all(&bin).expect("bin/");
    let on_path = |program: &str| {
        std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default())
            .any(|d| d.join(program).is_file())
    };
    let commands = parsed
        .apps
        .iter()
        .flat_map(|a| [&a.command, &a.promotion.gate_command])
        .chain(parsed.pools.iter().map(|p| &p.command));
    for program in commands.filter_map(|c| c.first()) {
        let at = if program.contains('/') {
            PathBuf::from(program)
        } else if on_path(program) {
            continue;
        } else {
            bin.join(program)
        };
        if at.starts_with(dir) && !at.exists() {
            std::fs::create_dir_all(at.parent().expect("a folder")).expect("mkdir");
            std::fs::write(&at, "#!/bin/sh\nexit 0\n").expect("write a program");
            std::fs::set_permissions(&at, std::os::unix::fs::PermissionsExt::from_mode(0o755))
                .expect("chmod");
        }
    }
    // Every checkpoint and watched prefix it names (what the gateway
    // allows when `[weights] allowed_prefixes` is unset), and that list.
    let named = warmgate_deploy::Config {
        weights: warmgate_deploy::WeightsConfig {
            allowed_prefixes: None,
            ..parsed.weights.clone()
        },
        ..parsed.clone()
    };
    let folders = warmgate_gateway::weights::allowed_prefixes(&named)
        .into_iter()
        .chain(parsed.weights.allowed_prefixes.iter().flatten().cloned());
    for uri in folders {
        if let Some(path) = uri.strip_prefix("file://")
            && Path::new(path).starts_with(dir)
        {
            std::fs::create_dir_all(path).expect("a checkpoint folder");
        }
    }
    let path = std::env::join_paths(std::iter::once(bin).chain(std::env::split_paths(
        &std::env::var_os("PATH").unwrap_or_default(),
    )))
    .expect("PATH");
    let mut env = vec![("PATH".to_string(), path.to_string_lossy().into_owned())];
    for t in &parsed.tenants {
        if let Some(var) = &t.api_key_env {
            env.push((var.clone(), "a-key-of-the-test".to_string()));
        }
    }
    Ok(env)
}

/// Warnings about this machine rather than the config.
fn about_the_machine(line: &str) -> bool {
    line.contains("backend.gpus[")
}

#[test]
fn every_toml_snippet_in_the_readme_and_docs_passes_serve_check() {
    let warmgate = common::bin("warmgate");
    let all = snippets();
    assert!(
        all.len() >= 15,
        "the docs show their configs: {}",
        all.len()
    );
    let mut failures = Vec::new();
    for snippet in &all {
        let dir = tempfile::tempdir().expect("a folder");
        let config = as_config(&snippet.text);
        let env = match make_what_it_names(&config, dir.path()) {
            Ok(env) => env,
            Err(e) => {
                failures.push(format!("{}:\n{config}\n{e}\n", snippet.at));
                continue;
            }
        };
        std::fs::write(dir.path().join("config.toml"), &config).expect("write the config");
        let out = std::process::Command::new(&warmgate)
            .args(["serve", "--check", "--listen", "127.0.0.1:0", "--config"])
            .arg(dir.path().join("config.toml"))
            .current_dir(dir.path())
            .env_clear()
            .envs(env)
            .output()
            .expect("run warmgate serve --check");
        let stderr = String::from_utf8_lossy(&out.stderr);
        let warnings: Vec<&str> = stderr
            .lines()
            .filter(|l| l.starts_with("warning:") && !about_the_machine(l))
            .collect();
        if !out.status.success() || !warnings.is_empty() {
            failures.push(format!("{}:\n{config}\n{stderr}", snippet.at));
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} snippets do not pass `serve --check` as written:\n\n{}",
        failures.len(),
        all.len(),
        failures.join("\n")
    );
}

#[test]
fn a_fragment_of_an_app_is_checked_inside_one() {
    let whole = as_config("[apps.routing]\npolicy = \"session\"\n");
    assert!(whole.starts_with("[[apps]]\nname = \"snippet\""), "{whole}");
    let pod = as_config("[apps.kubernetes.volumes]\nx = { mount = \"/x\", claim = \"c\" }\n");
    assert!(pod.contains("kind = \"kubernetes\""), "{pod}");
    assert_eq!(
        as_config("[[tenants]]\nname = \"t\"\n"),
        "[[tenants]]\nname = \"t\"\n"
    );
}
