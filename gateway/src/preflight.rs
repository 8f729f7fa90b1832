//! What `warmgate serve --check` checks beyond the config's schema: what
//! `serve` would trip on at once on this machine. Errors: a worker or gate
//! program that is neither on `PATH` nor an executable file, a tenant's
//! key in an environment variable that is not set. Warnings: a local
//! checkpoint that does not exist (yet), a listen address in use, GPUs
//! that this machine does not show, a `{placeholder}` in a command that
//! nothing expands, replicas on a TCP port every local user can reach.

use std::net::SocketAddr;
use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};

use warmgate_deploy::{BackendKind, Config};

/// How bad a finding is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Level {
    /// `serve` would fail, or a replica could never start.
    Error,
    /// Worth a look; `serve` may still work (a checkpoint written later,
    /// a gateway already running on the port).
    Warning,
}

/// One finding, at a config key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Finding {
    /// How bad it is.
    pub level: Level,
    /// The key it is about (`apps[0].command[0]`).
    pub key: String,
    /// What is wrong.
    pub message: String,
}

/// What `check` reads of the machine it runs on.
pub struct Machine<'a> {
    /// The `PATH` to search programs on.
    pub path: Option<&'a str>,
    /// An environment variable's value.
    pub env: &'a dyn Fn(&str) -> Option<String>,
    /// Whether GPU `n` exists.
    pub gpu_present: &'a dyn Fn(u32) -> bool,
}

/// What `config` would trip on on `machine`: errors first, then warnings.
pub fn check(config: &Config, machine: &Machine<'_>) -> Vec<Finding> {
    let local = config.backend.kind == BackendKind::Local;
    let mut out = Vec::new();
    if local {
        out.extend(open_ports(config));
    }
    out.extend(placeholders(config));
    out.extend(programs(config, local, machine.path));
    out.extend(checkpoints(config));
    if let Some(why) = untrusted_state_dir(&config.state_dir) {
        out.push(Finding::error("state_dir".into(), why));
    }
    if let Err((key, message)) = crate::tenants::Tenants::from_config(&config.tenants, machine.env)
    {
        out.push(Finding::error(key, message));
    }
    if local {
        for (i, g) in config.backend.gpus.iter().enumerate() {
            if !(machine.gpu_present)(*g) {
                out.push(Finding::warning(
                    format!("backend.gpus[{i}]"),
                    format!("GPU {g} is not on this machine (no /dev/nvidia{g})"),
                ));
            }
        }
    }
    // Errors first: they are why `--check` fails.
    out.sort_by_key(|f| f.level != Level::Error);
    out
}

impl Finding {
    fn error(key: String, message: String) -> Finding {
        Finding {
            level: Level::Error,
            key,
            message,
        }
    }

    fn warning(key: String, message: String) -> Finding {
        Finding {
            level: Level::Warning,
            key,
            message,
        }
    }
}

/// The commands of the config's own replicas (an app on a pool runs on
/// the pool's), by key.
fn commands(config: &Config) -> impl Iterator<Item = (String, &[String])> {
    let apps = config
        .apps
        .iter()
        .enumerate()
        .filter(|(_, a)| a.pool.is_none())
        .map(|(i, a)| (format!("apps[{i}].command"), a.command.as_slice()));
    let pools = config
        .pools
        .iter()
        .enumerate()
        .map(|(i, p)| (format!("pools[{i}].command"), p.command.as_slice()));
    apps.chain(pools)
}

/// Replicas that listen on a TCP port any local user can reach.
fn open_ports(config: &Config) -> Vec<Finding> {
    let listens = config
        .apps
        .iter()
        .filter(|a| a.pool.is_none())
        .map(|a| a.listen)
        .chain(config.pools.iter().map(|p| p.listen));
    commands(config)
        .zip(listens)
        .filter(|((_, command), listen)| listen.resolve(command) == warmgate_deploy::Listen::Port)
        .map(|((key, _), _)| Finding::warning(key, reachable_by_all()))
        .collect()
}

/// A `{name}` in a command: warmgate expands `$PORT`, `$WARMGATE_SOCKET`
/// and the environment's `$VAR`, never braces, so the program gets the
/// braces as they are (`--port {port}` makes the engine exit).
fn placeholders(config: &Config) -> Vec<Finding> {
    let gates = config.apps.iter().enumerate().map(|(i, a)| {
        (
            format!("apps[{i}].promotion.gate_command"),
            a.promotion.gate_command.as_slice(),
        )
    });
    let mut out = Vec::new();
    for (key, command) in commands(config).chain(gates) {
        for (j, word) in command.iter().enumerate() {
            if let Some(name) = brace_placeholder(word) {
                out.push(Finding::warning(
                    format!("{key}[{j}]"),
                    format!(
                        "{{{name}}} is passed as it is written: warmgate expands $PORT, \
                         $WARMGATE_SOCKET and $VARIABLES, not braces"
                    ),
                ));
            }
        }
    }
    out
}

/// The name in the first `{name}` of `word` (letters, digits, `_`), as a
/// template would write it; `${NAME}` and JSON (`{"a": 1}`) are not.
fn brace_placeholder(word: &str) -> Option<&str> {
    let mut rest = word;
    while let Some(open) = rest.find('{') {
        let after = &rest[open + 1..];
        let dollar = rest[..open].ends_with('$');
        if let Some(close) = after.find('}') {
            let name = &after[..close];
            let plain =
                !name.is_empty() && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
            if plain && !dollar {
                return Some(name);
            }
        }
        rest = after;
    }
    None
}

/// Programs that `exec` would not find.
fn programs(config: &Config, local: bool, path: Option<&str>) -> Vec<Finding> {
    let gates = config.apps.iter().enumerate().map(|(i, a)| {
        (
            format!("apps[{i}].promotion.gate_command[0]"),
            a.promotion.gate_command.as_slice(),
        )
    });
    let own = commands(config)
        .filter(|_| local)
        .map(|(key, command)| (format!("{key}[0]"), command));
    let mut out = Vec::new();
    for (key, command) in own.chain(gates) {
        if let Some(p) = command.first()
            && let Err(why) = find_program(p, path)
        {
            out.push(Finding::error(key, why));
        }
    }
    out
}

/// Local checkpoints that do not exist (yet).
fn checkpoints(config: &Config) -> Vec<Finding> {
    let apps = config.apps.iter().enumerate().flat_map(|(i, a)| {
        let own = a
            .checkpoint
            .iter()
            .map(move |c| (format!("apps[{i}].checkpoint"), c.as_str()));
        let adapters = a.adapters.models.iter().enumerate().map(move |(j, m)| {
            (
                format!("apps[{i}].adapters.models[{j}].checkpoint"),
                m.checkpoint.as_str(),
            )
        });
        own.chain(adapters)
    });
    let pools = config.pools.iter().enumerate().flat_map(|(i, p)| {
        p.checkpoint
            .iter()
            .map(move |c| (format!("pools[{i}].checkpoint"), c.as_str()))
    });
    apps.chain(pools)
        .filter_map(|(key, uri)| {
            let p = uri.strip_prefix("file://")?;
            (!Path::new(p).exists()).then(|| {
                Finding::warning(
                    key,
                    format!(
                        "{uri} does not exist (yet): replicas that read it will fail until it does"
                    ),
                )
            })
        })
        .collect()
}

/// The warning for replicas that listen on a TCP port.
fn reachable_by_all() -> String {
    "its replicas listen on 127.0.0.1:$PORT, which every user of this machine can connect to \
     (send requests past the tenants' keys, call the engine's admin routes); a worker that \
     takes a Unix socket listens where only the gateway reaches it: `--uds $WARMGATE_SOCKET` \
     for vLLM, or `listen = \"socket\"` for a worker that reads WARMGATE_SOCKET"
        .to_string()
}

/// Why `serve` would refuse `state_dir` (see
/// `warmgate_deploy::private_dir`): the folder when it exists, else the
/// nearest folder on the way that does (the rest is made owner-only).
fn untrusted_state_dir(state_dir: &Path) -> Option<String> {
    let mut at = state_dir;
    while !at.exists() {
        at = at.parent()?;
        if at.as_os_str().is_empty() {
            at = Path::new(".");
            break;
        }
    }
    let result = if at == state_dir {
        warmgate_deploy::private_dir::check(at)
    } else {
        // A missing folder is made inside `at`: `at` must not be open to
        // others' changes (its owner may be root).
        warmgate_deploy::private_dir::check_on_the_way_to(at)
    };
    result
        .err()
        .map(|e| format!("the state folder cannot be trusted: {e}"))
}

/// Whether `listen` can be bound now: a warning when it cannot (another
/// gateway may be running there, which is fine while checking a config
/// for it).
pub fn check_listen(listen: SocketAddr) -> Option<Finding> {
    std::net::TcpListener::bind(listen).err().map(|e| Finding {
        level: Level::Warning,
        key: "listen".into(),
        message: format!("{listen} cannot be bound now ({e})"),
    })
}

/// Whether GPU `n` shows on this machine (its NVIDIA device node).
pub fn nvidia_gpu_present(n: u32) -> bool {
    Path::new(&format!("/dev/nvidia{n}")).exists()
}

/// A program as `exec` finds it: a path (with a `/`) must be an
/// executable file; a bare name must be one on `path`.
fn find_program(program: &str, path: Option<&str>) -> Result<PathBuf, String> {
    let executable = |p: &Path| {
        p.metadata()
            .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
    };
    if program.contains('/') {
        let p = PathBuf::from(program);
        return if executable(&p) {
            Ok(p)
        } else if p.exists() {
            Err(format!("{program} is not an executable file"))
        } else {
            Err(format!("{program} does not exist"))
        };
    }
    std::env::split_paths(path.unwrap_or(""))
        .map(|dir| dir.join(program))
        .find(|p| executable(p))
        .ok_or_else(|| format!("{program:?} is not a program on PATH"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn unset(_: &str) -> Option<String> {
        None
    }

    fn every_gpu(_: u32) -> bool {
        true
    }

    fn no_gpu(_: u32) -> bool {
        false
    }

    fn config(text: &str) -> Config {
        Config::parse(text, Path::new("w.toml"), Path::new("/base")).expect("valid")
    }

    #[test]
    fn missing_programs_are_errors_and_missing_checkpoints_warnings() {
        let dir = tempfile::tempdir().expect("dir");
        let tool = dir.path().join("tool");
        std::fs::write(&tool, "#!/bin/sh\n").expect("write");
        std::fs::set_permissions(&tool, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        let plain = dir.path().join("plain");
        std::fs::write(&plain, "").expect("write");
        let path = dir.path().to_string_lossy().into_owned();
        let c = config(&format!(
            "[backend]\ngpus = [0]\n\
             [[apps]]\nname = \"ok\"\ncommand = [\"tool\"]\ncheckpoint = \"file:///nowhere/ckpt\"\n\
             [[apps]]\nname = \"gone\"\ncommand = [\"no-such-tool\"]\n\
             [[apps]]\nname = \"flat\"\ncommand = [\"{}\"]\n\
             [[apps]]\nname = \"abs\"\ncommand = [\"{}\"]\n",
            plain.display(),
            tool.display()
        ));
        let machine = |gpu: bool| Machine {
            path: Some(&path),
            env: &unset,
            gpu_present: if gpu { &every_gpu } else { &no_gpu },
        };
        let found = check(&c, &machine(false));
        let keys: Vec<(&str, Level)> = found.iter().map(|f| (f.key.as_str(), f.level)).collect();
        assert_eq!(
            keys,
            [
                ("apps[1].command[0]", Level::Error),
                ("apps[2].command[0]", Level::Error),
                ("apps[0].checkpoint", Level::Warning),
                ("backend.gpus[0]", Level::Warning),
            ],
            "{found:?}"
        );
        assert!(found[1].message.contains("not an executable"), "{found:?}");
        assert!(check(&c, &machine(true)).len() == 3);
    }

    #[test]
    fn unset_tenant_keys_are_errors_and_brace_placeholders_warnings() {
        let c = config(
            "[[apps]]\nname = \"a\"\n\
             command = [\"/bin/sh\", \"--port\", \"{port}\", \"${PORT}\", \"{\\\"k\\\": 1}\"]\n\
             [[tenants]]\nname = \"t\"\napi_key_env = \"TEAM_T_KEY\"\n",
        );
        fn set(v: &str) -> Option<String> {
            (v == "TEAM_T_KEY").then(|| "k".to_string())
        }
        fn machine(env: &'static dyn Fn(&str) -> Option<String>) -> Machine<'static> {
            Machine {
                path: None,
                env,
                gpu_present: &every_gpu,
            }
        }
        let found = check(&c, &machine(&unset));
        let keys: Vec<(&str, Level)> = found.iter().map(|f| (f.key.as_str(), f.level)).collect();
        assert_eq!(
            keys,
            [
                ("tenants[0].api_key_env", Level::Error),
                ("apps[0].command", Level::Warning),
                ("apps[0].command[2]", Level::Warning),
            ],
            "{found:?}"
        );
        assert!(found[0].message.contains("TEAM_T_KEY"), "{found:?}");
        assert!(found[2].message.contains("{port}"), "{found:?}");
        assert_eq!(check(&c, &machine(&set)).len(), 2);
    }

    #[test]
    fn only_plain_names_in_braces_are_placeholders() {
        assert_eq!(brace_placeholder("{port}"), Some("port"));
        assert_eq!(brace_placeholder("--x={model_dir}/a"), Some("model_dir"));
        assert_eq!(brace_placeholder("${PORT}"), None);
        assert_eq!(brace_placeholder("{\"a\": {}}"), None);
        assert_eq!(brace_placeholder("{}"), None);
        assert_eq!(brace_placeholder("}{"), None);
    }
}
