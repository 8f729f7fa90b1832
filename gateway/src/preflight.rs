//! What `warmgate serve --check` checks beyond the config's schema: what
//! `serve` would trip on at once on this machine. Errors: a worker or gate
//! program that is neither on `PATH` nor an executable file. Warnings: a
//! local checkpoint that does not exist (yet), a listen address in use,
//! GPUs that this machine does not show.

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

/// What `config` would trip on here. `path` is the `PATH` to search
/// programs on; `gpu_present` tells whether GPU `n` exists.
pub fn check(
    config: &Config,
    path: Option<&str>,
    gpu_present: impl Fn(u32) -> bool,
) -> Vec<Finding> {
    let mut out = Vec::new();
    let error = |key: String, message: String| Finding {
        level: Level::Error,
        key,
        message,
    };
    let warning = |key: String, message: String| Finding {
        level: Level::Warning,
        key,
        message,
    };
    let local = config.backend.kind == BackendKind::Local;
    if local {
        let port_only = |command: &[String], listen: warmgate_deploy::Listen| {
            listen.resolve(command) == warmgate_deploy::Listen::Port
        };
        let apps = config
            .apps
            .iter()
            .enumerate()
            .filter(|(_, a)| a.pool.is_none());
        for (i, app) in apps {
            if port_only(&app.command, app.listen) {
                out.push(warning(format!("apps[{i}].command"), reachable_by_all()));
            }
        }
        for (i, pool) in config.pools.iter().enumerate() {
            if port_only(&pool.command, pool.listen) {
                out.push(warning(format!("pools[{i}].command"), reachable_by_all()));
            }
        }
    }
    let mut program = |key: String, command: &[String]| {
        if let Some(p) = command.first()
            && let Err(why) = find_program(p, path)
        {
            out.push(error(key, why));
        }
    };
    for (i, app) in config.apps.iter().enumerate() {
        if local && app.pool.is_none() {
            program(format!("apps[{i}].command[0]"), &app.command);
        }
        program(
            format!("apps[{i}].promotion.gate_command[0]"),
            &app.promotion.gate_command,
        );
    }
    if local {
        for (i, pool) in config.pools.iter().enumerate() {
            program(format!("pools[{i}].command[0]"), &pool.command);
        }
    }
    let checkpoints = config
        .apps
        .iter()
        .enumerate()
        .flat_map(|(i, a)| {
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
        })
        .chain(config.pools.iter().enumerate().flat_map(|(i, p)| {
            p.checkpoint
                .iter()
                .map(move |c| (format!("pools[{i}].checkpoint"), c.as_str()))
        }));
    for (key, uri) in checkpoints {
        if let Some(p) = uri.strip_prefix("file://")
            && !Path::new(p).exists()
        {
            out.push(warning(
                key,
                format!(
                    "{uri} does not exist (yet): replicas that read it will fail until it does"
                ),
            ));
        }
    }
    if let Some(why) = untrusted_state_dir(&config.state_dir) {
        out.push(error("state_dir".into(), why));
    }
    if local {
        for (i, g) in config.backend.gpus.iter().enumerate() {
            if !gpu_present(*g) {
                out.push(warning(
                    format!("backend.gpus[{i}]"),
                    format!("GPU {g} is not on this machine (no /dev/nvidia{g})"),
                ));
            }
        }
    }
    out
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
        let found = check(&c, Some(&path), |_| false);
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
        assert!(check(&c, Some(&path), |_| true).len() == 3);
    }
}
