//! Replicas' logs read through the API (`GET /v1/apps/{app}/logs`,
//! `GET /v1/pools/{pool}/logs`, `warmgate logs`): which log files belong
//! to an app or a pool, and a bounded, redacted piece of one, so the cause
//! of a failure reaches a user who cannot log into the gateway's host.

use std::path::Path;
use std::time::SystemTime;

use serde::Serialize;
use warmgate_pool::logs::{read_from, redact};

use crate::error::{Error, ErrorKind};

/// Bytes a read returns by default, and at most.
pub const DEFAULT_BYTES: usize = 64 * 1024;
/// The most a read may ask for.
pub const MAX_BYTES: usize = 1024 * 1024;
/// Lines of a log's end a first read returns by default.
pub const DEFAULT_LINES: usize = 100;

/// Whose replicas' logs: an app's or a pool's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LogOwner {
    /// An app: replicas `<app>-<revision number>-<n>`.
    App(String),
    /// A pool: replicas `<pool>-<n>` and `<pool>-ondemand-<n>`.
    Pool(String),
}

impl LogOwner {
    /// Whether `replica` is one of its replicas' names.
    pub fn owns(&self, replica: &str) -> bool {
        let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
        match self {
            LogOwner::App(app) => replica
                .strip_prefix(app.as_str())
                .and_then(|r| r.strip_prefix('-'))
                .and_then(|r| r.split_once('-'))
                .is_some_and(|(rev, n)| rev.len() >= 5 && digits(rev) && digits(n)),
            LogOwner::Pool(pool) => replica
                .strip_prefix(pool.as_str())
                .and_then(|r| r.strip_prefix('-'))
                .is_some_and(|r| digits(r.strip_prefix("ondemand-").unwrap_or(r))),
        }
    }

    /// `app 'm'` or `pool 'p'`.
    pub fn describe(&self) -> String {
        match self {
            LogOwner::App(n) => format!("app '{n}'"),
            LogOwner::Pool(n) => format!("pool '{n}'"),
        }
    }
}

/// What a read asks for: `?replica=&offset=&max_bytes=&lines=`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LogQuery {
    /// Which replica (default: the one whose log was written last).
    pub replica: Option<String>,
    /// Where to start (default: the last `lines` lines).
    pub offset: Option<u64>,
    /// At most this many bytes.
    pub max_bytes: Option<usize>,
    /// Lines of the end, when no offset is given.
    pub lines: Option<usize>,
}

impl LogQuery {
    /// Reads the query; a value that is not what its key takes is a 400.
    pub fn parse(query: Option<&str>) -> Result<LogQuery, Error> {
        let mut q = LogQuery::default();
        for pair in query.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
            let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
            let value = percent_encoding::percent_decode_str(value)
                .decode_utf8_lossy()
                .into_owned();
            let number = |what: &str| {
                value.parse::<u64>().map_err(|_| {
                    Error::new(
                        ErrorKind::BadRequest,
                        format!("{what} must be a whole number, not {value:?}"),
                    )
                    .param("query")
                })
            };
            match key {
                "replica" => q.replica = Some(value.clone()),
                "offset" => q.offset = Some(number("offset")?),
                "max_bytes" => q.max_bytes = Some(number("max_bytes")? as usize),
                "lines" => q.lines = Some(number("lines")? as usize),
                _ => {}
            }
        }
        Ok(q)
    }
}

/// Its replicas that have a log in `dir`, the most recently written first.
pub fn replicas(dir: &Path, owner: &LogOwner) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut found: Vec<(SystemTime, String)> = entries
        .filter_map(Result::ok)
        .filter_map(|e| {
            let name = e.file_name().into_string().ok()?;
            let replica = name.strip_suffix(".log")?.to_string();
            let modified = e.metadata().ok()?.modified().ok()?;
            owner.owns(&replica).then_some((modified, replica))
        })
        .collect();
    found.sort_by(|a, b| b.0.cmp(&a.0).then_with(|| b.1.cmp(&a.1)));
    found.into_iter().map(|(_, r)| r).collect()
}

/// A piece of a replica's log.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Chunk {
    /// The replica.
    pub replica: String,
    /// Where in the file the text starts.
    pub offset: u64,
    /// Where the next read starts (`?offset=` to follow it).
    pub next_offset: u64,
    /// The file's size now.
    pub size: u64,
    /// Whole lines, secrets redacted.
    pub text: String,
}

/// Reads `replica`'s log in `dir`: from `offset` (a file rotated since
/// starts over), at most `max_bytes`, cut back to whole lines; or, with no
/// offset, its last `lines` lines. `secrets` and token-like runs of hex
/// are redacted.
pub fn read(
    dir: &Path,
    replica: &str,
    offset: Option<u64>,
    max_bytes: usize,
    lines: usize,
    secrets: &[String],
) -> Result<Chunk, Error> {
    let path = dir.join(format!("{replica}.log"));
    let size = std::fs::metadata(&path)
        .map_err(|_| {
            Error::new(
                ErrorKind::NotFound,
                format!(
                    "replica '{replica}' has no log (the oldest logs are deleted past their budget)"
                ),
            )
        })?
        .len();
    let max_bytes = max_bytes.clamp(1, MAX_BYTES);
    let start = offset.unwrap_or_else(|| size.saturating_sub(max_bytes as u64));
    let (bytes, from) = read_from(&path, start, max_bytes).map_err(|e| {
        Error::new(
            ErrorKind::Internal,
            format!("cannot read the log of '{replica}': {e}"),
        )
    })?;
    let mut begin = 0usize;
    let mut end = bytes.len();
    if offset.is_none() {
        // The last lines: a line cut at the front is dropped.
        if from > 0
            && let Some(nl) = bytes.iter().position(|&b| b == b'\n')
        {
            begin = nl + 1;
        }
        let mut newlines = bytes[begin..end]
            .iter()
            .enumerate()
            .rev()
            .filter(|(i, b)| **b == b'\n' && begin + i + 1 < end);
        if let Some((i, _)) = newlines.nth(lines.saturating_sub(1)) {
            begin += i + 1;
        }
    } else {
        // Whole lines only, so a secret is never split across two reads
        // (and left unredacted).
        match bytes.iter().rposition(|&b| b == b'\n') {
            Some(nl) => end = nl + 1,
            None if bytes.len() < max_bytes => end = 0,
            None => return long_line(&path, replica, from, max_bytes, size, secrets),
        }
    }
    let text = redact(&String::from_utf8_lossy(&bytes[begin..end]), secrets);
    Ok(Chunk {
        replica: replica.to_string(),
        offset: from + begin as u64,
        next_offset: from + end as u64,
        size,
        text,
    })
}

/// A line longer than a read, from `from`: read whole (up to
/// [`MAX_BYTES`]) and redacted whole, then cut to `max_bytes`; the next
/// read starts after it, so a read always moves on and no piece of a
/// secret is ever returned on its own.
fn long_line(
    path: &Path,
    replica: &str,
    from: u64,
    max_bytes: usize,
    size: u64,
    secrets: &[String],
) -> Result<Chunk, Error> {
    let (whole, from) = read_from(path, from, MAX_BYTES).map_err(|e| {
        Error::new(
            ErrorKind::Internal,
            format!("cannot read the log of '{replica}': {e}"),
        )
    })?;
    let end = whole
        .iter()
        .position(|&b| b == b'\n')
        .map_or(whole.len(), |i| i + 1);
    let mut text = redact(&String::from_utf8_lossy(&whole[..end]), secrets);
    if text.len() > max_bytes {
        let mut cut = max_bytes;
        while !text.is_char_boundary(cut) {
            cut -= 1;
        }
        text.truncate(cut);
        text.push_str("…\n");
    }
    Ok(Chunk {
        replica: replica.to_string(),
        offset: from,
        next_offset: from + end as u64,
        size,
        text,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_query_reads_its_keys_and_refuses_bad_numbers() {
        let q = LogQuery::parse(Some("replica=p-1&offset=10&lines=5&x=y")).unwrap();
        assert_eq!(q.replica.as_deref(), Some("p-1"));
        assert_eq!((q.offset, q.lines, q.max_bytes), (Some(10), Some(5), None));
        assert_eq!(LogQuery::parse(None).unwrap(), LogQuery::default());
        let e = LogQuery::parse(Some("offset=-1")).unwrap_err();
        assert_eq!(e.kind, ErrorKind::BadRequest);
    }

    #[test]
    fn an_owner_owns_its_replicas_names_only() {
        let app = LogOwner::App("chat".into());
        assert!(app.owns("chat-00001-3") && app.owns("chat-00012-1"));
        assert!(!app.owns("chat-2-00001-1") && !app.owns("chat-001-1") && !app.owns("chat"));
        assert!(!app.owns("chat-00001-1/../x"));
        let pool = LogOwner::Pool("roll".into());
        assert!(pool.owns("roll-1") && pool.owns("roll-ondemand-2"));
        assert!(!pool.owns("roll-x") && !pool.owns("rollouts-1") && !pool.owns("roll-00001-1"));
    }

    #[test]
    fn reads_the_last_lines_then_follows_whole_lines() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("p-1.log");
        let text: String = (0..10).map(|i| format!("line {i}\n")).collect();
        std::fs::write(&path, &text).unwrap();
        std::fs::write(dir.path().join("p-2.log"), "x\n").unwrap();
        std::fs::write(dir.path().join("q-1.log"), "x\n").unwrap();
        let mut names = replicas(dir.path(), &LogOwner::Pool("p".into()));
        names.sort();
        assert_eq!(names, ["p-1", "p-2"]);

        let last = read(dir.path(), "p-1", None, 4096, 3, &[]).unwrap();
        assert_eq!(last.text, "line 7\nline 8\nline 9\n");
        assert_eq!(last.next_offset, text.len() as u64);
        // Following: only what was added, in whole lines.
        std::fs::write(&path, format!("{text}line 10 secret-value-1\nline 1")).unwrap();
        let next = read(
            dir.path(),
            "p-1",
            Some(last.next_offset),
            4096,
            0,
            &["secret-value-1".into()],
        )
        .unwrap();
        assert_eq!(next.text, "line 10 [redacted]\n");
        // From the start, bounded by bytes and cut at a line.
        let head = read(dir.path(), "p-1", Some(0), 10, 0, &[]).unwrap();
        assert_eq!((head.text.as_str(), head.next_offset), ("line 0\n", 7));
        let e = read(dir.path(), "p-9", None, 10, 1, &[]).unwrap_err();
        assert_eq!(e.kind, ErrorKind::NotFound);
    }

    #[test]
    fn a_secret_read_in_small_pieces_is_never_returned() {
        let dir = tempfile::tempdir().unwrap();
        let secret = "hf_abcdefghijklmnop";
        std::fs::write(
            dir.path().join("p-1.log"),
            format!("token {secret} loaded\nnext\n"),
        )
        .unwrap();
        let secrets = [secret.to_string()];
        let mut offset = 0;
        let mut seen = String::new();
        for _ in 0..10 {
            let c = read(dir.path(), "p-1", Some(offset), 8, 0, &secrets).unwrap();
            assert!(
                c.next_offset > offset || c.next_offset == c.size,
                "moves on"
            );
            seen.push_str(&c.text);
            if c.next_offset == c.size {
                break;
            }
            offset = c.next_offset;
        }
        for piece in ["hf_a", "abcdefgh", "ijklmnop", "mnop"] {
            assert!(!seen.contains(piece), "{piece} in {seen:?}");
        }
        assert!(
            seen.contains("token [r") && seen.ends_with("next\n"),
            "{seen:?}"
        );
    }
}
