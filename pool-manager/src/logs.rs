//! A local replica's output on disk, bounded.
//!
//! The worker's stdout and stderr are one pipe the backend reads; what comes
//! through is appended to `<replica>.log`, which is moved to
//! `<replica>.log.1` (replacing an older one) once it would pass
//! [`LogLimits::per_file`], so a replica never holds more than twice that
//! on disk, however long it runs and however much it prints. The logs of
//! replicas that ended stay for reading after a crash, newest first, up to
//! [`LogLimits::ended`] over the folder; older ones are deleted when a
//! replica starts. This is Docker's `json-file` driver's `max-size` and
//! `max-file = 2`, with a budget for the dead on top, since every replica
//! of a scale-to-zero app has a name (and a log) of its own.

use std::collections::HashMap;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use tokio::io::{AsyncRead, AsyncReadExt as _, AsyncWriteExt as _};
use tokio::task::JoinHandle;

/// How much of replicas' output is kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LogLimits {
    /// Bytes of one log file before it is rotated.
    pub per_file: u64,
    /// Bytes of the logs of replicas that ended, over the folder.
    pub ended: u64,
}

impl Default for LogLimits {
    /// 64 MiB a file (a chatty vLLM prints a few MB a day), 512 MiB of
    /// ended replicas' logs.
    fn default() -> Self {
        LogLimits {
            per_file: 64 * 1024 * 1024,
            ended: 512 * 1024 * 1024,
        }
    }
}

/// Read at most this much from a pipe at a time.
const CHUNK: usize = 64 * 1024;
/// How long a replica's end waits for the rest of its output to be
/// written (the pipes close when its process group is gone).
const DRAIN: Duration = Duration::from_secs(2);

/// The file one replica's output goes to, rotated past its size.
struct Sink {
    path: PathBuf,
    file: tokio::fs::File,
    written: u64,
    per_file: u64,
    /// A write failed (a full disk): said once, and the output is then
    /// read and dropped, so the worker never blocks on a full pipe.
    broken: bool,
}

impl Sink {
    async fn write(&mut self, buf: &[u8]) {
        if self.broken {
            return;
        }
        let result = async {
            if self.written > 0 && self.written + buf.len() as u64 > self.per_file {
                self.rotate().await?;
            }
            self.file.write_all(buf).await?;
            self.written += buf.len() as u64;
            io::Result::Ok(())
        }
        .await;
        if let Err(e) = result {
            tracing::warn!(log = %self.path.display(), error = %e, "cannot write a replica's log; its output is dropped from now on");
            self.broken = true;
        }
    }

    async fn rotate(&mut self) -> io::Result<()> {
        self.file.flush().await?;
        tokio::fs::rename(&self.path, rotated(&self.path)).await?;
        self.file = open(&self.path).await?;
        self.written = 0;
        Ok(())
    }
}

/// `<replica>.log.1`.
fn rotated(path: &Path) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(".1");
    PathBuf::from(name)
}

async fn open(path: &Path) -> io::Result<tokio::fs::File> {
    tokio::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .await
}

/// The replicas whose logs are in use (a process runs, or is being
/// started, under that name): never pruned. Counted per name, since a
/// target made again in the same run may reuse a name still stopping.
#[derive(Debug, Clone, Default)]
pub(crate) struct Live(Arc<parking_lot::Mutex<HashMap<String, usize>>>);

impl Live {
    /// Marks `replica`'s log as in use until the guard is dropped.
    pub(crate) fn hold(&self, replica: &str) -> LiveLog {
        *self.0.lock().entry(replica.to_string()).or_default() += 1;
        LiveLog {
            live: self.clone(),
            replica: replica.to_string(),
        }
    }
}

/// A replica's log in use; see [`Live::hold`].
#[derive(Debug)]
pub(crate) struct LiveLog {
    live: Live,
    replica: String,
}

impl Drop for LiveLog {
    fn drop(&mut self) {
        let mut names = self.live.0.lock();
        if let Some(n) = names.get_mut(&self.replica) {
            *n -= 1;
            if *n == 0 {
                names.remove(&self.replica);
            }
        }
    }
}

/// One pipe for a worker's stdout and stderr both (so their lines stay in
/// the order it wrote them, as with one file), and its reading end.
pub(crate) fn output_pipe() -> io::Result<(
    std::process::Stdio,
    std::process::Stdio,
    tokio::net::unix::pipe::Receiver,
)> {
    let (tx, rx) = tokio::net::unix::pipe::pipe()?;
    let out = tx.into_blocking_fd()?;
    let err = out.try_clone()?;
    Ok((out.into(), err.into(), rx))
}

/// The task copying one replica's output pipe into its log.
pub(crate) struct Copier {
    task: Option<JoinHandle<()>>,
}

impl Copier {
    /// Starts copying `pipe` into `path` (appended to, as it was).
    pub(crate) async fn start(
        path: &Path,
        per_file: u64,
        mut pipe: impl AsyncRead + Send + Unpin + 'static,
    ) -> io::Result<Copier> {
        let file = open(path).await?;
        let written = file.metadata().await?.len();
        let mut sink = Sink {
            path: path.to_path_buf(),
            file,
            written,
            per_file,
            broken: false,
        };
        let task = tokio::spawn(async move {
            let mut buf = vec![0u8; CHUNK];
            loop {
                match pipe.read(&mut buf).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => sink.write(&buf[..n]).await,
                }
            }
            let _ = sink.file.flush().await;
        });
        Ok(Copier { task: Some(task) })
    }

    /// Waits (a little) for the output still in the pipe to be written,
    /// so a crash's last lines are in the file when it is read. A pipe
    /// still held open after that (a helper that left the process group)
    /// is no longer read.
    pub(crate) async fn finish(&mut self) {
        // Cancel-safe: the task stays here until it has ended, so a wait
        // cut short (a select that took another branch) is taken up again
        // by the next call, and the last lines are never read before they
        // are written.
        let Some(task) = self.task.as_mut() else {
            return;
        };
        let ended = tokio::time::timeout(DRAIN, task).await.is_ok();
        if let Some(task) = self.task.take()
            && !ended
        {
            task.abort();
            tracing::warn!(
                "a replica's output pipe stayed open after its process group ended; no longer read"
            );
        }
    }
}

/// Waits up to [`DRAIN`] for `task` to end, then aborts it; whether it
/// ended by itself.
async fn drain(task: JoinHandle<()>) -> bool {
    let abort = task.abort_handle();
    let ended = tokio::time::timeout(DRAIN, task).await.is_ok();
    if !ended {
        abort.abort();
    }
    ended
}

impl Drop for Copier {
    /// Dropped without [`Copier::finish`] (the replica was never waited
    /// on): the pipe closes with the process group, and the task ends by
    /// itself; it is not left reading a pipe someone else holds.
    fn drop(&mut self) {
        if let Some(task) = self.task.take()
            && let Ok(rt) = tokio::runtime::Handle::try_current()
        {
            rt.spawn(drain(task));
        }
    }
}

/// How much of a failed replica's output travels with its error.
pub const TAIL_BYTES: usize = 2048;
/// Lines of it, at most.
pub const TAIL_LINES: usize = 20;
/// A line longer than this is cut (a progress bar, a JSON dump).
const TAIL_LINE_CHARS: usize = 300;

/// The last lines of `<replica>.log` (with the end of `<replica>.log.1`
/// when the file was just rotated), at most `max_bytes` and `max_lines`,
/// each cut at a few hundred characters, with `secrets` and anything that
/// looks like a token redacted. `None` when there is no output.
pub fn tail(path: &Path, max_bytes: usize, max_lines: usize, secrets: &[String]) -> Option<String> {
    let older = rotated(path);
    let mut bytes = last_bytes(&older, max_bytes);
    bytes.extend(last_bytes(path, max_bytes));
    let start = bytes.len().saturating_sub(max_bytes);
    let whole: u64 = [&older, path]
        .iter()
        .map(|p| std::fs::metadata(p).map_or(0, |m| m.len()))
        .sum();
    let text = String::from_utf8_lossy(&bytes[start..]).into_owned();
    // A first line cut in the middle is dropped, unless it is the only one.
    let cut = whole > (bytes.len() - start) as u64;
    let text = match (cut, text.split_once('\n')) {
        (true, Some((_, rest))) if !rest.trim().is_empty() => rest.to_string(),
        _ => text,
    };
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    let lines = &lines[lines.len().saturating_sub(max_lines)..];
    if lines.is_empty() {
        return None;
    }
    // Redacted whole, then cut: a cut first would leave a secret's start.
    let cut: Vec<String> = lines
        .iter()
        .map(|l| {
            let l = redact(l, secrets);
            match l.char_indices().nth(TAIL_LINE_CHARS) {
                Some((i, _)) => format!("{}…", &l[..i]),
                None => l,
            }
        })
        .collect();
    Some(cut.join("\n"))
}

/// Reads at most the last `n` bytes of `path`; empty when it cannot.
pub(crate) fn last_bytes(path: &Path, n: usize) -> Vec<u8> {
    use std::io::{Read as _, Seek as _, SeekFrom};
    let Ok(mut file) = std::fs::File::open(path) else {
        return Vec::new();
    };
    let len = file.metadata().map_or(0, |m| m.len());
    let from = len.saturating_sub(n as u64);
    let mut buf = Vec::with_capacity((len - from) as usize);
    if file.seek(SeekFrom::Start(from)).is_err() {
        return Vec::new();
    }
    let _ = file.take(n as u64).read_to_end(&mut buf);
    buf
}

/// Reads up to `max` bytes of `path` from `offset`: the bytes and the
/// file's length. Reading from past the end (a rotated file) starts over.
pub fn read_from(path: &Path, offset: u64, max: usize) -> io::Result<(Vec<u8>, u64)> {
    use std::io::{Read as _, Seek as _, SeekFrom};
    let mut file = std::fs::File::open(path)?;
    let len = file.metadata()?.len();
    let from = if offset > len { 0 } else { offset };
    file.seek(SeekFrom::Start(from))?;
    let mut buf = Vec::with_capacity(max.min((len - from) as usize));
    file.take(max as u64).read_to_end(&mut buf)?;
    Ok((buf, from))
}

/// `text` with each of `secrets` (values of six characters or more, as
/// they are and as JSON or a URL escapes them), the password of every URL
/// (`postgres://user:PASSWORD@host`) and each run of 32 or more hex digits
/// (the gateway's tokens, a key's digest) replaced by `[redacted]`: a
/// worker that prints its environment does not hand its credentials to
/// whoever reads its error or its log.
pub fn redact(text: &str, secrets: &[String]) -> String {
    let mut out = text.to_string();
    for s in secrets.iter().filter(|s| s.len() >= 6) {
        for form in escaped_forms(s) {
            if out.contains(form.as_str()) {
                out = out.replace(form.as_str(), "[redacted]");
            }
        }
    }
    let out = redact_url_passwords(&out);
    let mut clean = String::with_capacity(out.len());
    let mut run = String::new();
    for c in out.chars() {
        if c.is_ascii_hexdigit() {
            run.push(c);
            continue;
        }
        flush_hex(&mut clean, &mut run);
        clean.push(c);
    }
    flush_hex(&mut clean, &mut run);
    clean
}

/// A secret as it is, and as a JSON string or a URL escapes it.
fn escaped_forms(secret: &str) -> Vec<String> {
    let mut forms = vec![secret.to_string()];
    let mut add = |f: String| {
        if !forms.contains(&f) {
            forms.push(f);
        }
    };
    if let Ok(json) = serde_json::to_string(secret) {
        let inner = &json[1..json.len() - 1];
        add(inner.to_string());
        add(inner.replace('/', "\\/"));
        // Every character as `\uXXXX`, as some encoders write them.
        add(secret
            .encode_utf16()
            .map(|u| format!("\\u{u:04x}"))
            .collect());
    }
    add(
        percent_encoding::utf8_percent_encode(secret, percent_encoding::NON_ALPHANUMERIC)
            .to_string(),
    );
    forms
}

/// Every `scheme://user:password@host` with its password redacted.
fn redact_url_passwords(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(i) = rest.find("://") {
        let (before, after) = rest.split_at(i + 3);
        out.push_str(before);
        // The authority ends at the path, query, fragment or the text's
        // own end of the word.
        let end = after
            .find(|c: char| {
                matches!(c, '/' | '?' | '#' | '"' | '\'' | '<' | '>' | '`') || c.is_whitespace()
            })
            .unwrap_or(after.len());
        let authority = &after[..end];
        match authority.rfind('@') {
            Some(at) => {
                let userinfo = &authority[..at];
                match userinfo.find(':') {
                    Some(colon) if colon + 1 < userinfo.len() => {
                        out.push_str(&userinfo[..=colon]);
                        out.push_str("[redacted]");
                        out.push_str(&authority[at..]);
                    }
                    _ => out.push_str(authority),
                }
            }
            None => out.push_str(authority),
        }
        rest = &after[end..];
    }
    out.push_str(rest);
    out
}

fn flush_hex(out: &mut String, run: &mut String) {
    if run.len() >= 32 {
        out.push_str("[redacted]");
    } else {
        out.push_str(run);
    }
    run.clear();
}

/// Whether an environment variable's name says it holds a credential.
pub fn is_secret_name(name: &str) -> bool {
    let upper = name.to_ascii_uppercase();
    [
        "TOKEN",
        "KEY",
        "SECRET",
        "PASSWORD",
        "PASSWD",
        "CREDENTIAL",
        "AUTH",
    ]
    .iter()
    .any(|w| upper.contains(w))
}

/// Deletes the logs of replicas not in `live`, oldest first, until those
/// left take at most `budget` bytes. Returns the files deleted. `live` is
/// asked again just before each file goes, so a replica that starts
/// meanwhile keeps its log.
pub(crate) fn prune(dir: &Path, live: &Live, budget: u64) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut ended: Vec<(SystemTime, u64, PathBuf, String)> = entries
        .filter_map(Result::ok)
        .filter_map(|e| {
            let name = e.file_name().into_string().ok()?;
            let replica = name
                .strip_suffix(".log")
                .or_else(|| name.strip_suffix(".log.1"))?
                .to_string();
            let meta = e.metadata().ok().filter(std::fs::Metadata::is_file)?;
            Some((meta.modified().ok()?, meta.len(), e.path(), replica))
        })
        .collect();
    // Newest first: those are kept.
    ended.sort_by_key(|e| std::cmp::Reverse(e.0));
    let mut kept = 0u64;
    let mut full = false;
    let mut gone = Vec::new();
    for (_, len, path, replica) in ended {
        let names = live.0.lock();
        if names.contains_key(&replica) {
            continue;
        }
        full = full || kept.saturating_add(len) > budget;
        if !full {
            kept += len;
        } else if std::fs::remove_file(&path).is_ok() {
            gone.push(path);
        }
    }
    gone
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn output_is_rotated_past_its_size_and_the_last_lines_are_written() {
        let dir = tempfile::tempdir().expect("tmp");
        let path = dir.path().join("w-1.log");
        let (out, err, rx) = output_pipe().expect("pipe");
        let mut child = tokio::process::Command::new("sh")
            .args([
                "-c",
                "head -c 250000 /dev/zero | tr '\\0' x; echo; echo 'on stderr' >&2; echo 'the end'",
            ])
            .stdout(out)
            .stderr(err)
            .spawn()
            .expect("sh");
        let mut copier = Copier::start(&path, 100_000, rx).await.expect("start");
        child.wait().await.expect("wait");
        copier.finish().await;

        let now = std::fs::read_to_string(&path).expect("log");
        let old = std::fs::read_to_string(rotated(&path)).expect("log.1");
        assert!(now.len() as u64 <= 100_000, "{} bytes", now.len());
        assert!(old.len() as u64 <= 100_000, "{} bytes", old.len());
        // In the order written, stderr and stdout alike.
        assert!(
            now.ends_with("on stderr\nthe end\n"),
            "{:?}",
            &now[now.len().saturating_sub(40)..]
        );
    }

    #[test]
    fn a_tail_is_the_last_lines_bounded_and_redacted() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("r-1.log");
        let mut text = String::new();
        for i in 0..100 {
            text.push_str(&format!("line {i}\n"));
        }
        text.push_str(&format!("token hf_secret_value and {}\n", "ab".repeat(32)));
        text.push_str(&"x".repeat(1000));
        text.push_str("\nRuntimeError: CUDA out of memory\n");
        std::fs::write(&path, &text).unwrap();
        let tail = tail(&path, 2048, 5, &["hf_secret_value".into()]).unwrap();
        let lines: Vec<&str> = tail.lines().collect();
        assert_eq!(lines.len(), 5, "{tail}");
        assert_eq!(lines[0], "line 98");
        assert_eq!(lines[2], "token [redacted] and [redacted]");
        assert!(lines[3].ends_with('…') && lines[3].chars().count() == 301);
        assert_eq!(lines[4], "RuntimeError: CUDA out of memory");
        // Bounded by bytes too, and a line cut at the front is dropped.
        let short = super::tail(&path, 40, 50, &[]).unwrap();
        assert_eq!(short, "RuntimeError: CUDA out of memory");
        assert_eq!(
            super::tail(&dir.path().join("none.log"), 2048, 5, &[]),
            None
        );
    }

    #[test]
    fn escaped_secrets_url_passwords_and_long_lines_are_redacted() {
        let secret = "s3cr3t/pa\"ss+word";
        let json = serde_json::to_string(&serde_json::json!({"k": secret})).expect("json");
        let text = format!(
            "raw {secret} | json {json} | url {} | db postgres://app:hunter2x@db:5432/prod",
            percent_encoding::utf8_percent_encode(secret, percent_encoding::NON_ALPHANUMERIC)
        );
        let out = redact(&text, &[secret.to_string()]);
        assert!(
            !out.contains("s3cr3t") && !out.contains("hunter2x"),
            "{out}"
        );
        assert!(
            out.contains("postgres://app:[redacted]@db:5432/prod"),
            "{out}"
        );
        assert_eq!(out.matches("[redacted]").count(), 4, "{out}");
        // A URL without a password, and text with no URL, are left alone.
        assert_eq!(
            redact("see https://example.org/a@b", &[]),
            "see https://example.org/a@b"
        );
        assert_eq!(redact("git@host:repo", &[]), "git@host:repo");

        // A secret past a long line's cut is still redacted, not cut in two.
        let dir = tempfile::tempdir().expect("dir");
        let log = dir.path().join("r.log");
        let line = format!("{}{secret}\n", "x".repeat(TAIL_LINE_CHARS - 10));
        std::fs::write(&log, line).expect("write");
        let tail = tail(&log, TAIL_BYTES, TAIL_LINES, &[secret.to_string()]).expect("tail");
        assert!(!tail.contains("s3cr"), "{tail}");
    }

    #[test]
    fn short_hex_and_short_secrets_are_kept() {
        assert_eq!(redact("pid 1234 abc", &["abc".into()]), "pid 1234 abc");
        assert!(is_secret_name("HF_TOKEN") && is_secret_name("aws_secret_access_key"));
        assert!(!is_secret_name("PORT"));
    }

    #[test]
    fn ended_logs_are_pruned_oldest_first_and_live_ones_kept() {
        let dir = tempfile::tempdir().expect("tmp");
        let write = |name: &str, age_s: u64| {
            let p = dir.path().join(name);
            std::fs::write(&p, vec![b'x'; 1000]).expect("write");
            let t = SystemTime::now() - Duration::from_secs(age_s);
            std::fs::File::options()
                .write(true)
                .open(&p)
                .and_then(|f| f.set_modified(t))
                .expect("mtime");
        };
        write("a-1.log", 400);
        write("a-1.log.1", 500);
        write("a-2.log", 300);
        write("a-3.log", 200);
        write("live-1.log", 900);
        write("notes.txt", 900);
        let live = Live::default();
        let held = live.hold("live-1");
        // Held twice (a name reused while its first process stops): the
        // first end does not free it.
        drop(live.hold("live-1"));
        let mut gone = prune(dir.path(), &live, 2500);
        gone.sort();
        let names: Vec<String> = gone
            .iter()
            .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names, ["a-1.log", "a-1.log.1"]);
        for kept in ["a-2.log", "a-3.log", "live-1.log", "notes.txt"] {
            assert!(dir.path().join(kept).exists(), "{kept}");
        }
        // Once it ended, it is the oldest, and over the budget.
        drop(held);
        let gone = prune(dir.path(), &live, 2500);
        assert_eq!(gone, [dir.path().join("live-1.log")]);
    }
}
