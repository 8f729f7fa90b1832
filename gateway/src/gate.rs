//! An evaluation gate's command, run as a worker is, not as the gateway:
//! a clean environment (the base variables and what the gate is given),
//! a process group of its own that ends with it, and its output kept
//! within a byte bound.
//!
//! Before, a gate ran with the gateway's whole environment (its admin
//! token, tenant keys, cloud credentials), in the gateway's process group,
//! with all it printed kept in memory; and a child it left in the
//! background held the promotion until it ended, since the gate's output
//! was read to its end.

use std::path::Path;
use std::time::Duration;

use tokio::io::AsyncReadExt as _;

/// The end of a gate's standard error kept for its failure message; the
/// rest is read and dropped.
pub const MAX_GATE_OUTPUT: usize = 64 * 1024;
/// Characters of that end shown in the promotion's reason.
const SHOWN_CHARS: usize = 300;
/// How long the output is still read once the gate has exited and its
/// group has been ended.
const OUTPUT_GRACE: Duration = Duration::from_secs(1);

/// Ends a process group when dropped: the gate's, whatever it left
/// running, also when the gate's time runs out and its future is dropped.
struct Group(Option<nix::unistd::Pid>);

impl Group {
    fn end(&mut self) {
        if let Some(pgid) = self.0.take() {
            let _ = nix::sys::signal::killpg(pgid, nix::sys::signal::Signal::SIGKILL);
        }
    }
}

impl Drop for Group {
    fn drop(&mut self) {
        self.end();
    }
}

/// Runs `program` with `args` and only the base environment plus `vars`;
/// `Ok` when it exits 0, else why, with the end of what it printed on
/// standard error (control characters escaped, so it cannot forge a log
/// line). Its process group is ended when it exits, or when this future is
/// dropped.
pub async fn run(
    program: &str,
    args: &[String],
    vars: &[(&str, String)],
    workdir: Option<&Path>,
) -> Result<(), String> {
    let mut cmd = tokio::process::Command::new(program);
    cmd.args(args).env_clear();
    for name in warmgate_pool::backend::BASE_ENV {
        if let Some(v) = std::env::var_os(name) {
            cmd.env(name, v);
        }
    }
    cmd.envs(vars.iter().map(|(k, v)| (*k, v)))
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .process_group(0)
        .kill_on_drop(true);
    if let Some(dir) = workdir {
        cmd.current_dir(dir);
    }
    let mut child = cmd
        .spawn()
        .map_err(|e| format!("cannot run {program}: {e}"))?;
    let mut group = Group(
        child
            .id()
            .and_then(|id| i32::try_from(id).ok())
            .map(nix::unistd::Pid::from_raw),
    );
    let mut stderr = child.stderr.take();
    let reader = tokio::spawn(async move {
        let mut tail: Vec<u8> = Vec::new();
        let mut buf = [0u8; 8192];
        if let Some(err) = stderr.as_mut() {
            while let Ok(n) = err.read(&mut buf).await {
                if n == 0 {
                    break;
                }
                tail.extend_from_slice(&buf[..n]);
                if tail.len() > MAX_GATE_OUTPUT {
                    tail.drain(..tail.len() - MAX_GATE_OUTPUT);
                }
            }
        }
        tail
    });
    let status = child.wait().await;
    // What it left running goes with it, and so do its ends of the pipe.
    group.end();
    let tail = match tokio::time::timeout(OUTPUT_GRACE, reader).await {
        Ok(Ok(tail)) => tail,
        _ => Vec::new(),
    };
    let status = status.map_err(|e| format!("cannot wait for {program}: {e}"))?;
    if status.success() {
        return Ok(());
    }
    Err(format!("{program} {status}: {}", shown(&tail)))
}

/// The last [`SHOWN_CHARS`] characters of `bytes`, trimmed, with control
/// characters (newlines among them) escaped.
fn shown(bytes: &[u8]) -> String {
    let text = String::from_utf8_lossy(bytes);
    let text = text.trim();
    let start = text
        .char_indices()
        .rev()
        .nth(SHOWN_CHARS - 1)
        .map_or(0, |(i, _)| i);
    text[start..]
        .chars()
        .flat_map(|c| {
            let escaped: Vec<char> = if c.is_control() {
                c.escape_default().collect()
            } else {
                vec![c]
            };
            escaped
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_gate_sees_no_secret_and_leaves_nothing_running() {
        let dir = tempfile::tempdir().expect("dir");
        let env = dir.path().join("env");
        let pid = dir.path().join("pid");
        // It prints its environment, leaves a child in the background
        // holding its output, and fails with a line that tries to forge a
        // log line.
        let script = format!(
            "env > {env}; sleep 30 & echo $! > {pid}; printf 'bad model\\nINFO forged' >&2; exit 3",
            env = env.display(),
            pid = pid.display()
        );
        let t0 = std::time::Instant::now();
        let why = run(
            "sh",
            &["-c".into(), script],
            &[("WARMGATE_EVAL_URL", "http://127.0.0.1:1/apps/m".into())],
            None,
        )
        .await
        .expect_err("it failed");
        // Not held by the background child.
        assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
        assert!(why.contains("bad model\\nINFO forged"), "{why}");
        assert!(!why.contains('\n'), "{why}");
        let seen = std::fs::read_to_string(&env).expect("env");
        assert!(seen.contains("WARMGATE_EVAL_URL="), "{seen}");
        // What the shell sets for itself is its own.
        let own = ["PWD", "OLDPWD", "SHLVL", "_"];
        for name in std::env::vars().map(|(k, _)| k) {
            if !warmgate_pool::backend::BASE_ENV.contains(&name.as_str())
                && !own.contains(&name.as_str())
            {
                assert!(
                    !seen.contains(&format!("\n{name}=")),
                    "{name} leaked:\n{seen}"
                );
            }
        }
        // Its background child was ended with its group.
        let child: i32 = std::fs::read_to_string(&pid)
            .expect("pid")
            .trim()
            .parse()
            .expect("a pid");
        let gone = (0..100).any(|_| {
            std::thread::sleep(Duration::from_millis(20));
            nix::sys::signal::kill(nix::unistd::Pid::from_raw(child), None).is_err()
        });
        assert!(gone, "the gate's background child {child} still runs");
    }

    #[tokio::test]
    async fn a_gate_that_passes_is_ok_and_its_output_is_bounded() {
        run(
            "sh",
            &[
                "-c".into(),
                "head -c 1000000 /dev/zero | tr '\\0' x >&2; exit 0".into(),
            ],
            &[],
            None,
        )
        .await
        .expect("passes");
        let why = run(
            "sh",
            &[
                "-c".into(),
                "head -c 1000000 /dev/zero | tr '\\0' y >&2; exit 1".into(),
            ],
            &[],
            None,
        )
        .await
        .expect_err("fails");
        assert!(why.len() < 400, "{} bytes", why.len());
    }
}
