//! `warmgate serve`, and the process setup it shares with `operator`: the
//! runtime, the open-listen check, and the process limits and hardening.

use std::net::SocketAddr;
use std::path::PathBuf;

use warmgate_deploy::Config;

use super::EXIT_USAGE;
use crate::telemetry::LogFormat;

pub(super) fn runtime(threads: Option<usize>) -> std::io::Result<tokio::runtime::Runtime> {
    match threads {
        // One thread: the current-thread scheduler skips the work-stealing
        // machinery, about 20% more requests per second on one core.
        Some(1) => tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build(),
        n => {
            let mut b = tokio::runtime::Builder::new_multi_thread();
            if let Some(n) = n {
                b.worker_threads(n.max(1));
            }
            b.enable_all().thread_name("warmgate").build()
        }
    }
}

/// A listen address beyond loopback needs `WARMGATE_ADMIN_TOKEN`, unless
/// the user says `--insecure`: the control plane would be open to anyone
/// who can reach the port.
pub(super) fn refuse_open_listen(listen: SocketAddr, insecure: bool) -> Result<(), String> {
    if listen.ip().is_loopback() || crate::access::admin_token().is_some() || insecure {
        return Ok(());
    }
    Err(format!(
        "refusing to listen on {listen} without WARMGATE_ADMIN_TOKEN: anyone who can reach it \
         could change deployments. Set a token, listen on loopback, or pass --insecure."
    ))
}

/// How `serve` starts, beyond its config.
pub(super) struct Start {
    /// `--insecure`.
    pub(super) insecure: bool,
    /// `--config-wins`.
    pub(super) config_wins: bool,
}

pub(super) fn serve(
    path: PathBuf,
    listen: Option<SocketAddr>,
    check: bool,
    threads: Option<usize>,
    log_format: LogFormat,
    start: Start,
) -> i32 {
    let Start {
        insecure,
        config_wins,
    } = start;
    let mut config = match Config::load(&path) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("error: {e}");
            return EXIT_USAGE;
        }
    };
    if let Some(l) = listen {
        config.listen = l;
    }
    if check {
        // Beyond the schema: what `serve` would trip on on this machine.
        let search = std::env::var("PATH").ok();
        let env = |v: &str| std::env::var(v).ok();
        let machine = crate::preflight::Machine {
            path: search.as_deref(),
            env: &env,
            gpu_present: &crate::preflight::nvidia_gpu_present,
        };
        let mut found = crate::preflight::check(&config, &machine);
        found.extend(crate::preflight::check_listen(config.listen));
        let errors = found
            .iter()
            .filter(|f| f.level == crate::preflight::Level::Error)
            .count();
        for f in &found {
            let level = match f.level {
                crate::preflight::Level::Error => "error",
                crate::preflight::Level::Warning => "warning",
            };
            eprintln!("{level}: {}: {}: {}", path.display(), f.key, f.message);
        }
        if errors > 0 {
            eprintln!(
                "{}: {errors} error{} ({} warning{})",
                path.display(),
                if errors == 1 { "" } else { "s" },
                found.len() - errors,
                if found.len() - errors == 1 { "" } else { "s" }
            );
            return EXIT_USAGE;
        }
        println!(
            "{}: ok ({} app{}{})",
            path.display(),
            config.apps.len(),
            if config.apps.len() == 1 { "" } else { "s" },
            match found.len() {
                0 => String::new(),
                1 => ", 1 warning".into(),
                n => format!(", {n} warnings"),
            }
        );
        return 0;
    }
    let worker_listen = config.tls.as_ref().and_then(|t| t.worker_listen);
    for listen in std::iter::once(config.listen).chain(worker_listen) {
        if let Err(e) = refuse_open_listen(listen, insecure) {
            eprintln!("error: {e}");
            return EXIT_USAGE;
        }
    }
    let _telemetry = crate::telemetry::init(log_format);
    raise_open_file_limit();
    keep_environment_private();
    let rt = match runtime(threads) {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: could not start the runtime: {e}");
            return 1;
        }
    };
    match rt.block_on(crate::runtime::serve_async(config, path, config_wins)) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("error: {e:#}");
            1
        }
    }
}

/// Makes the gateway's process non-dumpable, so a worker running as the
/// same (non-root) user cannot read its environment (the admin token,
/// tenant keys, cloud credentials) from `/proc/<gateway>/environ`, nor
/// attach to it. Workers are dumpable again after their `exec`. A worker
/// running as root can still read it: run workers as another user for that.
pub fn keep_environment_private() {
    if let Err(e) = nix::sys::prctl::set_dumpable(false) {
        tracing::warn!(error = %e, "cannot make the gateway non-dumpable");
    }
}

/// Raises the soft limit on open files to the hard limit. Every client
/// connection, replica connection and checkpoint file takes a descriptor;
/// the usual soft default of 1024 lets about a thousand idle sockets lock
/// out clients and the workers' weight fetches, while the hard limit is
/// what the administrator actually allows.
pub(super) fn raise_open_file_limit() {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    match getrlimit(Resource::RLIMIT_NOFILE) {
        Ok((soft, hard)) if soft < hard => match setrlimit(Resource::RLIMIT_NOFILE, hard, hard) {
            Ok(()) => tracing::debug!(from = soft, to = hard, "raised the open-file limit"),
            Err(e) => {
                tracing::warn!(soft, hard, error = %e, "cannot raise the open-file limit")
            }
        },
        Ok(_) => {}
        Err(e) => tracing::warn!(error = %e, "cannot read the open-file limit"),
    }
}
