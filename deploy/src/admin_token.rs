//! Where a gateway's own admin token is kept and published, and how a
//! client of the same user finds it.
//!
//! `warmgate serve` without `WARMGATE_ADMIN_TOKEN` keeps a random token in
//! `state_dir/admin-token` and publishes it, owner-only, as a record named
//! by its listening address in the user's runtime folder. The CLI, the
//! example trainers and the Python client read it from there by the
//! gateway's URL. Making and publishing are the gateway's; this module is
//! the part every client shares.

use std::net::SocketAddr;
use std::os::unix::fs::MetadataExt as _;
use std::path::{Path, PathBuf};

/// The token's file in the state folder.
pub const FILE_NAME: &str = "admin-token";
/// Random bytes in a token: 256 bits, written as 64 hex digits.
pub const TOKEN_BYTES: usize = 32;

/// The folder of the records of this user's running gateways:
/// `$WARMGATE_RUNTIME_DIR`, else `$XDG_RUNTIME_DIR/warmgate`, else
/// `$HOME/.warmgate/run`.
pub fn runtime_dir() -> Option<PathBuf> {
    if let Some(d) = std::env::var_os("WARMGATE_RUNTIME_DIR").filter(|d| !d.is_empty()) {
        return Some(PathBuf::from(d));
    }
    if let Some(d) = std::env::var_os("XDG_RUNTIME_DIR").filter(|d| !d.is_empty()) {
        return Some(PathBuf::from(d).join("warmgate"));
    }
    std::env::var_os("HOME")
        .filter(|d| !d.is_empty())
        .map(|h| PathBuf::from(h).join(".warmgate").join("run"))
}

/// The record's name for a gateway listening on `addr`.
pub fn record_name(addr: SocketAddr) -> String {
    match addr {
        SocketAddr::V4(a) => format!("gateway-{}-{}.token", a.ip(), a.port()),
        SocketAddr::V6(a) => format!("gateway-[{}]-{}.token", a.ip(), a.port()),
    }
}

/// What a published record says: the token, and the gateway process that
/// wrote it (its pid and its start time in clock ticks since boot, so a
/// reused pid is told apart).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    /// The admin token.
    pub token: String,
    /// The gateway's process id.
    pub pid: u32,
    /// When that process started (`/proc/<pid>/stat`, field 22).
    pub start: u64,
}

impl Record {
    /// The record of this process, for `token`.
    pub fn of_this_process(token: &str) -> Option<Record> {
        let pid = std::process::id();
        Some(Record {
            token: token.to_string(),
            pid,
            start: process_start(pid)?,
        })
    }

    /// The record's text: the token, then the pid and start time.
    pub fn text(&self) -> String {
        format!("{}\n{} {}\n", self.token, self.pid, self.start)
    }

    fn parse(text: &str) -> Option<Record> {
        let mut lines = text.lines();
        let token = lines.next()?.trim();
        let mut ids = lines.next()?.split_ascii_whitespace();
        let pid = ids.next()?.parse().ok()?;
        let start = ids.next()?.parse().ok()?;
        is_token(token).then(|| Record {
            token: token.to_string(),
            pid,
            start,
        })
    }

    /// Whether the process that wrote it still runs: the same pid, started
    /// at the same time, of this user.
    pub fn is_live(&self) -> bool {
        let proc = PathBuf::from(format!("/proc/{}", self.pid));
        std::fs::metadata(&proc).is_ok_and(|m| m.uid() == nix::unistd::geteuid().as_raw())
            && process_start(self.pid) == Some(self.start)
    }
}

/// When process `pid` started, in clock ticks since boot (Linux).
pub fn process_start(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name, in parentheses, may hold spaces: count fields
    // from the last ')'. The start time is field 22, the 20th after it.
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_ascii_whitespace().nth(19)?.parse().ok()
}

/// The token of this user's gateway at `url` (`http://IP:PORT`), from its
/// record, when the gateway that wrote it still runs. Only an IP address
/// is looked up, never a name: `localhost` may resolve to another address
/// than the one the gateway listens on, where another user's program
/// could listen and be sent the token. A record whose gateway is gone is
/// removed, and nothing is sent: another user may have taken its port.
pub fn find_for(url: &str) -> Option<String> {
    find_in(&runtime_dir()?, url)
}

/// [`find_for`] in the runtime folder `dir`.
pub fn find_in(dir: &Path, url: &str) -> Option<String> {
    check_private_dir(dir).ok()?;
    let rest = url
        .strip_prefix("http://")
        .or_else(|| url.strip_prefix("https://"))
        .unwrap_or(url);
    let hostport = rest.split('/').next()?;
    let default_port = if url.starts_with("https://") { 443 } else { 80 };
    let addr: SocketAddr = match hostport.parse() {
        Ok(a) => a,
        Err(_) => SocketAddr::new(
            hostport.trim_matches(['[', ']']).parse().ok()?,
            default_port,
        ),
    };
    let path = dir.join(record_name(addr));
    let record = Record::parse(&read_private_text(&path).ok()?)?;
    if !record.is_live() {
        let _ = std::fs::remove_file(&path);
        return None;
    }
    Some(record.token)
}

/// The token in `path`: a regular file of this user's that nobody else
/// may read or write, holding 64 hex digits (and maybe more lines).
pub fn read_private(path: &Path) -> Result<String, String> {
    let text = read_private_text(path)?;
    let token = text.lines().next().unwrap_or("").trim();
    if !is_token(token) {
        return Err(format!("{} does not hold an admin token", path.display()));
    }
    Ok(token.to_string())
}

/// The text of `path`, opened without following a link and checked on
/// the open file (so it cannot be swapped between the check and the
/// read): a regular file of this user's, private, at most 4 KiB.
fn read_private_text(path: &Path) -> Result<String, String> {
    use std::io::Read as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(nix::libc::O_NOFOLLOW | nix::libc::O_NONBLOCK)
        .open(path)
        .map_err(|e| format!("{}: {e}", path.display()))?;
    let meta = f
        .metadata()
        .map_err(|e| format!("{}: {e}", path.display()))?;
    check_private(path, &meta)?;
    let mut text = String::new();
    f.take(4096)
        .read_to_string(&mut text)
        .map_err(|e| format!("{}: {e}", path.display()))?;
    Ok(text)
}

/// A folder of this user's that nobody else may write to.
pub fn check_private_dir(dir: &Path) -> Result<(), String> {
    // The whole way to it, not only the folder: a folder of another
    // user's on the way could swap it for theirs.
    crate::private_dir::check(dir).map_err(|e| e.to_string())
}

/// 64 hex digits.
pub fn is_token(s: &str) -> bool {
    s.len() == TOKEN_BYTES * 2 && s.bytes().all(|b| b.is_ascii_hexdigit())
}

/// A regular file of this user's that nobody else may read or write.
pub fn check_private(path: &Path, meta: &std::fs::Metadata) -> Result<(), String> {
    if !meta.file_type().is_file() {
        return Err(format!("{} is not a regular file", path.display()));
    }
    if meta.uid() != nix::unistd::geteuid().as_raw() {
        return Err(format!("{} belongs to another user", path.display()));
    }
    if meta.mode() & 0o077 != 0 {
        return Err(format!(
            "{} may be read by other users (mode {:o}): chmod 600 it",
            path.display(),
            meta.mode() & 0o777
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_names_its_live_gateway_and_a_dead_one_is_not_trusted() {
        let me = Record::of_this_process(&"ab".repeat(32)).expect("this process");
        assert_eq!(Record::parse(&me.text()), Some(me.clone()));
        assert!(me.is_live());
        let reused = Record {
            start: me.start + 1,
            ..me.clone()
        };
        assert!(
            !reused.is_live(),
            "a pid started at another time is another process"
        );
        let gone = Record {
            pid: u32::MAX - 1,
            ..me
        };
        assert!(!gone.is_live());
        assert_eq!(Record::parse("ab\n1 2\n"), None);
    }

    #[test]
    fn a_record_is_used_for_its_ip_while_its_gateway_runs_and_removed_after() {
        use std::os::unix::fs::{OpenOptionsExt as _, PermissionsExt as _};
        let dir = std::env::temp_dir().join(format!("wg-run-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).expect("chmod");
        let write = |addr: &str, record: &Record| {
            let path = dir.join(record_name(addr.parse().expect("addr")));
            let _ = std::fs::remove_file(&path);
            let mut f = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(&path)
                .expect("create");
            std::io::Write::write_all(&mut f, record.text().as_bytes()).expect("write");
            path
        };
        let live = Record::of_this_process(&"cd".repeat(32)).expect("this process");
        write("127.0.0.1:18080", &live);
        assert_eq!(
            find_in(&dir, "http://127.0.0.1:18080"),
            Some("cd".repeat(32))
        );
        // A name is never looked up: it may resolve elsewhere.
        assert_eq!(find_in(&dir, "http://localhost:18080"), None);
        // A gateway that is gone: nothing sent, and its record removed.
        let dead = Record {
            pid: u32::MAX - 1,
            ..live
        };
        let path = write("127.0.0.1:18081", &dead);
        assert_eq!(find_in(&dir, "http://127.0.0.1:18081/v1/status"), None);
        assert!(!path.exists(), "a dead gateway's record is removed");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn record_names_are_per_address() {
        let v4: SocketAddr = "127.0.0.1:8080".parse().expect("addr");
        let v6: SocketAddr = "[::1]:9000".parse().expect("addr");
        assert_eq!(record_name(v4), "gateway-127.0.0.1-8080.token");
        assert_eq!(record_name(v6), "gateway-[::1]-9000.token");
    }

    #[test]
    fn a_file_others_may_read_a_link_or_junk_is_not_a_token() {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = std::env::temp_dir().join(format!("wg-token-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let path = dir.join("t");
        std::fs::write(&path, "ab".repeat(32)).expect("write");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).expect("chmod");
        assert_eq!(read_private(&path).expect("token"), "ab".repeat(32));
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).expect("chmod");
        assert!(read_private(&path).unwrap_err().contains("other users"));
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).expect("chmod");
        std::fs::write(&path, "short").expect("write");
        assert!(read_private(&path).is_err());
        let link = dir.join("l");
        std::os::unix::fs::symlink(&path, &link).expect("link");
        assert!(read_private(&link).is_err());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
