//! The local backend: replicas as child processes of the gateway, each in
//! its own process group, with a clean environment, logs on disk and a
//! private socket folder.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::net::{Ipv4Addr, SocketAddr, TcpListener};
use std::os::unix::fs::MetadataExt as _;
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};

use async_trait::async_trait;
use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;

use super::{Backend, Launch, Process, expand_command, gpu_list};
use crate::logs::{Copier, Live, LiveLog, LogLimits};
use crate::{Error, Result};

/// The longest path a Unix socket may have (`sun_path` is 108 bytes with
/// its NUL).
const MAX_SOCKET_PATH: usize = 107;

/// Variables of the gateway's environment that every local worker
/// inherits: what a process needs to find programs and libraries, a home,
/// a user name, a locale and a temporary folder. None of them holds a
/// secret. `LD_LIBRARY_PATH` is here because CUDA installs commonly rely
/// on it. Every `LC_*` variable is passed too (see [`inherited`]).
pub const BASE_ENV: &[&str] = &[
    "PATH",
    "HOME",
    "USER",
    "LOGNAME",
    "LANG",
    "LANGUAGE",
    "TZ",
    "TMPDIR",
    "LD_LIBRARY_PATH",
];

/// Runs replicas as child processes on this machine.
///
/// Each replica gets its own process group, so stopping it also stops the
/// processes it started, and its stdout and stderr are appended to
/// `<log_dir>/<replica>.log`. When the replica ends, however it ends (asked
/// to stop, crashed, killed from outside), what is left of its group is
/// killed, so no helper process outlives it.
///
/// A replica starts with a clean environment: [`BASE_ENV`], the
/// `pass_env` names, the launch's `env`, then the worker contract's
/// variables. The gateway's own secrets are never inherited.
#[derive(Debug, Clone)]
pub struct LocalBackend {
    log_dir: PathBuf,
    /// One `<replica>.pid` file per live replica, so that a gateway killed
    /// with `kill -9` finds its orphans when it starts again.
    run_dir: Option<PathBuf>,
    /// Where replicas' Unix sockets are made: a folder only this user may
    /// enter, so no other local user can connect to a replica.
    socket_dir: Option<PathBuf>,
    /// Names of the gateway's variables that workers inherit besides
    /// [`BASE_ENV`] (`backend.pass_env`).
    pass_env: Vec<String>,
    /// How much of the replicas' output is kept on disk.
    logs: LogLimits,
    /// Replicas whose process runs or is starting: their logs are never
    /// pruned.
    live: Live,
}

/// A replica process left behind by a previous run, and stopped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Orphan {
    /// Its replica id.
    pub replica: String,
    /// Its process (group) id.
    pub pid: i32,
}

impl LocalBackend {
    /// A backend that writes replica logs under `log_dir`.
    pub fn new(log_dir: impl Into<PathBuf>) -> Self {
        LocalBackend {
            log_dir: log_dir.into(),
            run_dir: None,
            socket_dir: None,
            pass_env: Vec::new(),
            logs: LogLimits::default(),
            live: Live::default(),
        }
    }

    /// Keeps replicas' output within `limits` (see [`crate::logs`]).
    pub fn with_log_limits(mut self, limits: LogLimits) -> Self {
        self.logs = limits;
        self
    }

    /// Workers also inherit these variables of the gateway's environment
    /// (`backend.pass_env`), when set.
    pub fn with_pass_env(mut self, names: impl IntoIterator<Item = String>) -> Self {
        self.pass_env = names.into_iter().collect();
        self
    }

    /// Keeps a record of each live replica under `dir` (see
    /// [`LocalBackend::reap_orphans`]).
    pub fn with_run_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.run_dir = Some(dir.into());
        self
    }

    /// Makes replicas' Unix sockets in `dir` (made owner-only when
    /// missing); see [`warmgate_deploy::Listen`].
    pub fn with_socket_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.socket_dir = Some(dir.into());
        self
    }

    /// Where `replica`'s socket goes: `<dir>/<replica>.sock`, or a digest
    /// of the name when that path would pass the 107 bytes a socket's path
    /// may have. The folder is made owner-only and checked, and a socket
    /// an earlier replica of the same name left is removed.
    fn socket_path(&self, replica: &str) -> std::result::Result<PathBuf, String> {
        use std::os::unix::fs::DirBuilderExt as _;
        let dir = self
            .socket_dir
            .as_ref()
            .ok_or("this backend has no folder for sockets")?;
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(|e| format!("cannot make {}: {e}", dir.display()))?;
        warmgate_deploy::private_dir::check(dir).map_err(|e| e.to_string())?;
        let mut path = dir.join(format!("{replica}.sock"));
        if path.as_os_str().len() > MAX_SOCKET_PATH {
            use sha2::Digest as _;
            let digest = sha2::Sha256::digest(replica.as_bytes());
            let short: String = digest.iter().take(8).map(|b| format!("{b:02x}")).collect();
            path = dir.join(format!("{short}.sock"));
        }
        if path.as_os_str().len() > MAX_SOCKET_PATH {
            return Err(format!(
                "{} is too long for a Unix socket's path ({MAX_SOCKET_PATH} bytes at most): \
                 give state_dir a shorter path, or set listen = \"port\"",
                path.display()
            ));
        }
        match std::fs::remove_file(&path) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(format!("cannot remove {}: {e}", path.display())),
        }
        Ok(path)
    }

    /// Stops the replicas a previous run of the gateway left running (it
    /// was killed before it could stop them): each recorded process group
    /// whose leader is provably the replica that was recorded gets
    /// SIGKILL. A pid number proves nothing (it is reused, and a record
    /// may have been planted), so the leader must still be the process
    /// that was recorded (its start time), run as this user, and carry
    /// the replica's own name in its environment (`WARMGATE_REPLICA`,
    /// which only its starter sets); a record that is not a file of this
    /// user's is not read. Anything else is left alone. Their state (warm
    /// weights, tasks in flight) cannot be trusted, so they are cleaned up
    /// rather than adopted; the autoscaler starts fresh ones as needed.
    pub fn reap_orphans(&self) -> Vec<Orphan> {
        let Some(dir) = &self.run_dir else {
            return Vec::new();
        };
        let Ok(entries) = std::fs::read_dir(dir) else {
            return Vec::new();
        };
        let me = nix::unistd::geteuid().as_raw();
        let mut reaped = Vec::new();
        for entry in entries.flatten() {
            let path = entry.path();
            let Some(replica) = path
                .file_name()
                .and_then(|n| n.to_str())
                .and_then(|n| n.strip_suffix(".pid"))
                .map(str::to_string)
            else {
                continue;
            };
            let ours = std::fs::symlink_metadata(&path)
                .is_ok_and(|m| m.file_type().is_file() && m.uid() == me);
            let record = if ours {
                std::fs::read_to_string(&path).unwrap_or_default()
            } else {
                tracing::warn!(path = %path.display(), "ignored a replica record that is not a file of this user's");
                String::new()
            };
            let _ = std::fs::remove_file(&path);
            let mut fields = record.split_whitespace();
            let (Some(pid), Some(started)) = (
                fields.next().and_then(|p| p.parse::<i32>().ok()),
                fields.next().and_then(|t| t.parse::<u64>().ok()),
            ) else {
                continue;
            };
            if pid <= 1 {
                continue;
            }
            // The leader is still the replica that was recorded. (If the
            // leader died, Linux keeps its pid out of reuse while the group
            // lives, but then nothing proves the group is ours: its
            // helpers die with their pipes, or at the next boot.)
            if !is_replica_process(pid, &replica, started, me) {
                tracing::warn!(%replica, pid, "left alone a recorded process that is not provably that replica");
                continue;
            }
            if killpg(Pid::from_raw(pid), Signal::SIGKILL).is_ok() {
                tracing::warn!(%replica, pid, "stopped a replica left running by a previous run");
                reaped.push(Orphan { replica, pid });
            }
        }
        reaped
    }

    fn record(&self, replica: &str, pid: u32) -> Option<PathBuf> {
        let dir = self.run_dir.as_ref()?;
        let started = start_time(pid as i32).unwrap_or(0);
        let path = dir.join(format!("{replica}.pid"));
        let written = std::fs::create_dir_all(dir)
            .and_then(|()| std::fs::write(&path, format!("{pid} {started}\n")));
        match written {
            Ok(()) => Some(path),
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "could not record a replica's pid");
                None
            }
        }
    }

    /// The worker's whole environment, later entries winning: what the
    /// gateway passes on, the spec's, then the contract's (where it
    /// listens, which replica of which target it is, its GPUs and
    /// checkpoint).
    fn worker_env(
        &self,
        launch: &Launch,
        port: Option<u16>,
        socket: Option<&Path>,
    ) -> BTreeMap<String, String> {
        let mut vars: BTreeMap<String, String> = inherited(std::env::vars_os(), &self.pass_env)
            .filter_map(|(k, v)| Some((k.into_string().ok()?, v.into_string().ok()?)))
            .collect();
        vars.extend(launch.env.clone());
        if let Some(port) = port {
            vars.insert("PORT".into(), port.to_string());
        }
        if let Some(socket) = socket {
            vars.insert(
                "WARMGATE_SOCKET".into(),
                socket.to_string_lossy().into_owned(),
            );
        }
        vars.insert("WARMGATE_REPLICA".into(), launch.replica.clone());
        vars.insert("WARMGATE_TARGET".into(), launch.target.clone());
        vars.insert("WARMGATE_REVISION".into(), launch.revision.clone());
        vars.insert("CUDA_VISIBLE_DEVICES".into(), gpu_list(&launch.gpus));
        if let Some(c) = &launch.checkpoint {
            vars.insert("WARMGATE_CHECKPOINT".into(), c.clone());
        }
        vars
    }

    /// Makes the log folder and deletes the oldest logs of ended replicas
    /// past their budget; `<replica>.log`'s path.
    async fn prepare_log(&self, replica: &str) -> Result<PathBuf> {
        let path = self.log_dir.join(format!("{replica}.log"));
        std::fs::create_dir_all(&self.log_dir).map_err(|e| Error::LogFile {
            path: path.clone(),
            reason: e.to_string(),
        })?;
        let (dir, live, budget) = (self.log_dir.clone(), self.live.clone(), self.logs.ended);
        let gone = tokio::task::spawn_blocking(move || crate::logs::prune(&dir, &live, budget))
            .await
            .unwrap_or_default();
        if !gone.is_empty() {
            tracing::info!(
                files = gone.len(),
                "deleted the oldest logs of replicas that ended"
            );
        }
        Ok(path)
    }
}

#[async_trait]
impl Backend for LocalBackend {
    async fn spawn(&self, launch: &Launch) -> Result<Box<dyn Process>> {
        use warmgate_deploy::Listen;
        let spawn_failed = |reason: String| Error::SpawnFailed {
            program: launch.command.first().cloned().unwrap_or_default(),
            reason,
        };
        let listen = launch.listen.resolve(&launch.command);
        let socket = match listen {
            Listen::Port => None,
            Listen::Socket => Some(self.socket_path(&launch.replica).map_err(spawn_failed)?),
            // Offered when it can be: without one the replica has its port.
            Listen::Auto => self.socket_path(&launch.replica).ok(),
        };
        let port = match listen {
            Listen::Socket => None,
            Listen::Port | Listen::Auto => Some(free_port()?),
        };
        // In use from now: no other start prunes it, even before it opens.
        let live = self.live.hold(&launch.replica);
        let log_path = self.prepare_log(&launch.replica).await?;
        let vars = self.worker_env(launch, port, socket.as_deref());
        let command =
            expand_command(&launch.command, &vars).map_err(|reason| Error::SpawnFailed {
                program: launch.command.first().cloned().unwrap_or_default(),
                reason,
            })?;
        let program = command.first().ok_or_else(|| Error::SpawnFailed {
            program: String::new(),
            reason: "the command is empty".into(),
        })?;
        let (out, err, output) = crate::logs::output_pipe().map_err(|e| Error::LogFile {
            path: log_path.clone(),
            reason: format!("cannot make the output pipe: {e}"),
        })?;
        let mut cmd = tokio::process::Command::new(program);
        cmd.args(&command[1..])
            .env_clear()
            .envs(&vars)
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .process_group(0)
            .kill_on_drop(true);
        if let Some(dir) = &launch.workdir {
            cmd.current_dir(dir);
        }
        give_back_transparent_huge_pages(&mut cmd);
        let child = cmd.spawn().map_err(|e| Error::SpawnFailed {
            program: program.clone(),
            reason: e.to_string(),
        })?;
        let pid = child.id();
        let record = pid.and_then(|p| self.record(&launch.replica, p));
        // The writing ends are the child's alone from here.
        drop(cmd);
        let mut process = LocalProcess {
            child,
            pid,
            group_ended: false,
            record,
            listening: match (port, socket) {
                (Some(p), None) => Offered::Port(SocketAddr::from((Ipv4Addr::LOCALHOST, p))),
                (None, Some(s)) => Offered::Socket(s),
                (Some(p), Some(s)) => Offered::Both(SocketAddr::from((Ipv4Addr::LOCALHOST, p)), s),
                (None, None) => return Err(spawn_failed("neither a port nor a socket".into())),
            },
            log: log_path.clone(),
            secrets: vars
                .iter()
                .filter(|(k, _)| crate::logs::is_secret_name(k))
                .map(|(_, v)| v.clone())
                .collect(),
            copier: None,
            _live: live,
        };
        // Dropped on failure, the process is stopped with its group.
        let copier = Copier::start(&log_path, self.logs.per_file, output)
            .await
            .map_err(|e| Error::LogFile {
                path: log_path,
                reason: e.to_string(),
            })?;
        process.copier = Some(copier);
        Ok(Box::new(process))
    }
}

/// The variables of `env` (the gateway's environment) a worker inherits:
/// [`BASE_ENV`], every `LC_*`, and those named in `pass_env`.
pub fn inherited<'a>(
    env: impl IntoIterator<Item = (OsString, OsString)> + 'a,
    pass_env: &'a [String],
) -> impl Iterator<Item = (OsString, OsString)> + 'a {
    env.into_iter().filter(move |(name, _)| {
        let Some(name) = name.to_str() else {
            return false;
        };
        BASE_ENV.contains(&name) || name.starts_with("LC_") || pass_env.iter().any(|p| p == name)
    })
}

/// Where a local replica was told to listen.
enum Offered {
    /// `$PORT` only.
    Port(SocketAddr),
    /// `$WARMGATE_SOCKET` only.
    Socket(PathBuf),
    /// Both; it is reached on the socket once it has made it.
    Both(SocketAddr, PathBuf),
}

struct LocalProcess {
    child: tokio::process::Child,
    pid: Option<u32>,
    /// The leader has been reaped and the rest of its group killed: its
    /// pid is no longer ours to signal.
    group_ended: bool,
    /// Its `<replica>.pid` record, removed when the process is dropped.
    record: Option<PathBuf>,
    /// Where it was told to listen.
    listening: Offered,
    log: PathBuf,
    /// The values of its environment whose names say they are secrets,
    /// kept out of its output's tail.
    secrets: Vec<String>,
    /// Copies its output into its log.
    copier: Option<Copier>,
    /// Its log counted as in use (never pruned) while it lives.
    _live: LiveLog,
}

#[async_trait]
impl Process for LocalProcess {
    /// The socket when it was given only that, or has made it (given
    /// both, a replica that binds the socket is reached there: only it can
    /// make a file in the gateway's private folder); else the port.
    fn addr(&self) -> crate::Endpoint {
        match &self.listening {
            Offered::Socket(s) => crate::Endpoint::unix(s),
            Offered::Both(_, s) if s.exists() => crate::Endpoint::unix(s),
            Offered::Port(p) | Offered::Both(p, _) => crate::Endpoint::Tcp(*p),
        }
    }

    fn pid(&self) -> Option<u32> {
        self.pid
    }

    fn log(&self) -> String {
        display_path(&self.log)
    }

    fn tail(&self) -> Option<String> {
        crate::logs::tail(
            &self.log,
            crate::logs::TAIL_BYTES,
            crate::logs::TAIL_LINES,
            &self.secrets,
        )
    }

    async fn wait(&mut self) -> String {
        let how = match self.child.wait().await {
            Ok(status) => describe_exit(status),
            Err(e) => format!("could not be waited on ({e})"),
        };
        self.end_group();
        // Its group is gone, so its pipes close: the last lines (a crash's
        // reason) are in the log before anyone reads it.
        if let Some(copier) = &mut self.copier {
            copier.finish().await;
        }
        how
    }

    fn terminate(&self) {
        self.signal(Signal::SIGTERM);
    }

    fn kill(&self) {
        self.signal(Signal::SIGKILL);
    }
}

impl LocalProcess {
    /// Once the leader has exited, kills what is left of its group (a
    /// worker's helpers, a `sh -c "helper & exec worker"` background job):
    /// the replica is over, its replacement may be given the same GPUs, and
    /// a helper outliving it would hold them and leak. SIGKILL at once, not
    /// SIGTERM and a grace period: when the replica was asked to stop, the
    /// group had its SIGTERM with the leader; when the leader crashed, no
    /// one is left to wait for. A leader's pid is not reused while its
    /// group has members, so the group id is still this replica's.
    fn end_group(&mut self) {
        if !self.group_ended {
            self.signal(Signal::SIGKILL);
            self.group_ended = true;
        }
    }

    fn signal(&self, sig: Signal) {
        if self.group_ended {
            return;
        }
        let Some(pid) = self.pid.and_then(|p| i32::try_from(p).ok()) else {
            return;
        };
        // The child leads its own process group (`process_group(0)`), so the
        // group id is its pid. ESRCH only means it has exited already.
        if let Err(e) = killpg(Pid::from_raw(pid), sig)
            && e != nix::errno::Errno::ESRCH
        {
            tracing::warn!(pid, ?sig, error = %e, "could not signal replica");
        }
    }
}

impl Drop for LocalProcess {
    fn drop(&mut self) {
        // Dropped without being waited on (the gateway is shutting down,
        // or its task was cancelled): `kill_on_drop` stops only the leader,
        // and it has not been reaped, so its pid is still the group's id.
        self.end_group();
        if let Some(path) = &self.record {
            let _ = std::fs::remove_file(path);
        }
        if let Offered::Socket(path) | Offered::Both(_, path) = &self.listening {
            let _ = std::fs::remove_file(path);
        }
    }
}

/// Whether process `pid` is the replica `replica` started at `started`
/// (clock ticks since boot) by user `uid`: same start time, same owner,
/// and `WARMGATE_REPLICA=<replica>` in the environment it was started with.
pub fn is_replica_process(pid: i32, replica: &str, started: u64, uid: u32) -> bool {
    if start_time(pid) != Some(started) {
        return false;
    }
    let owner = std::fs::metadata(format!("/proc/{pid}")).map(|m| m.uid());
    if owner.ok() != Some(uid) {
        return false;
    }
    let Ok(environ) = std::fs::read(format!("/proc/{pid}/environ")) else {
        return false;
    };
    let wanted = format!("WARMGATE_REPLICA={replica}");
    environ.split(|b| *b == 0).any(|v| v == wanted.as_bytes())
}

/// Whether process `pid` has exited: it is gone, or a zombie waiting to be
/// reaped (which `kill(pid, 0)` would still find). Linux only.
pub fn exited(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        Ok(stat) => stat
            .rfind(')')
            .map(|i| &stat[i + 1..])
            .and_then(|rest| rest.split_whitespace().next())
            .is_some_and(|state| state == "Z" || state == "X"),
    }
}

/// A process's start time, in clock ticks since boot (`/proc/PID/stat`
/// field 22), to tell it from a later process with the same pid.
fn start_time(pid: i32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may hold spaces and parentheses; the
    // fields after its closing parenthesis start at field 3.
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(19)?.parse().ok()
}

fn describe_exit(status: ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("exited with status {code}"),
        (None, Some(sig)) => match Signal::try_from(sig) {
            Ok(s) => format!("was killed by {s}"),
            Err(_) => format!("was killed by signal {sig}"),
        },
        _ => "exited".to_string(),
    }
}

fn display_path(p: &Path) -> String {
    p.to_string_lossy().into_owned()
}

/// Asks the OS for a free loopback port. Another process could take it
/// before the worker binds it; the worker then fails to start and is retried.
fn free_port() -> Result<u16> {
    let l = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .map_err(|e| Error::NoFreePort(e.to_string()))?;
    l.local_addr()
        .map(|a| a.port())
        .map_err(|e| Error::NoFreePort(e.to_string()))
}

/// The gateway turns transparent huge pages off for itself
/// (`PR_SET_THP_DISABLE`, in `warmgate`'s `main`), and the setting is
/// inherited across `fork` and `exec`: a worker is given them back, so an
/// engine runs as it would without warmgate.
#[allow(unsafe_code)]
fn give_back_transparent_huge_pages(cmd: &mut tokio::process::Command) {
    // SAFETY: the closure runs in the child between fork and exec, where
    // only async-signal-safe calls are allowed; it makes one `prctl`
    // system call, allocates nothing and takes no lock. A failure (an old
    // kernel) leaves the setting as it was and is not an error.
    unsafe {
        cmd.pre_exec(|| {
            let _ = nix::sys::prctl::set_thp_disable(false);
            Ok(())
        });
    }
}

#[cfg(test)]
mod tests;
