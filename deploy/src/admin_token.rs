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

/// The token of this user's gateway at `url` (`http://HOST:PORT`), from
/// its record; `localhost` is read as `127.0.0.1`. `None` when there is no
/// such record, or it is not a private file of this user's.
pub fn find_for(url: &str) -> Option<String> {
    let dir = runtime_dir()?;
    let rest = url
        .strip_prefix("http://")
        .or_else(|| url.strip_prefix("https://"))
        .unwrap_or(url);
    let hostport = rest.split('/').next()?;
    let (host, port) = match hostport.rsplit_once(':') {
        Some((h, p)) if !h.ends_with(']') || hostport.starts_with('[') => (h, p.parse().ok()?),
        _ => (hostport, if url.starts_with("https://") { 443 } else { 80 }),
    };
    let host = match host {
        "localhost" => "127.0.0.1",
        h => h,
    };
    let ip: std::net::IpAddr = host.trim_matches(['[', ']']).parse().ok()?;
    read_private(&dir.join(record_name(SocketAddr::new(ip, port)))).ok()
}

/// The token in `path`: a regular file of this user's that nobody else
/// may read or write, holding 64 hex digits.
pub fn read_private(path: &Path) -> Result<String, String> {
    let meta = std::fs::symlink_metadata(path).map_err(|e| format!("{}: {e}", path.display()))?;
    check_private(path, &meta)?;
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let token = text.trim();
    if !is_token(token) {
        return Err(format!("{} does not hold an admin token", path.display()));
    }
    Ok(token.to_string())
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
