//! The admin token a gateway makes for itself when none is given, as
//! Jupyter does: no control plane runs without a credential.
//!
//! `warmgate serve` without `WARMGATE_ADMIN_TOKEN` keeps a random token in
//! `state_dir/admin-token` (made once, owner-only, kept across restarts so
//! scripts that read it keep working) and publishes it for the CLI of the
//! same user in a record under the user's runtime folder, named by the
//! address the gateway listens on. `warmgate status`, `apply`, `promote`
//! and the Python client find it there; another local user can read
//! neither file, so cannot change (or read) the gateway's apps.

use std::io::Write as _;
use std::net::SocketAddr;
use std::os::unix::fs::{DirBuilderExt as _, OpenOptionsExt as _};
use std::path::{Path, PathBuf};

use anyhow::Context as _;
pub use warmgate_deploy::admin_token::{FILE_NAME, find_for, runtime_dir};
use warmgate_deploy::admin_token::{
    Record, TOKEN_BYTES, check_private_dir, read_private, record_name,
};

/// The token kept in `state_dir`, made (owner-only) when missing. A file
/// another user owns, that others may read, or that does not hold a token
/// is refused rather than trusted or silently replaced.
pub fn ensure(state_dir: &Path) -> anyhow::Result<String> {
    let path = state_dir.join(FILE_NAME);
    match std::fs::symlink_metadata(&path) {
        // Read without following a link, and checked on the open file.
        Ok(_) => read_private(&path).map_err(|e| {
            anyhow::anyhow!(
                "{e}: remove it, and a new token is made at the next start (or set WARMGATE_ADMIN_TOKEN)"
            )
        }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let token = make()?;
            write_private(&path, &format!("{token}\n"))?;
            Ok(token)
        }
        Err(e) => Err(e).with_context(|| format!("read {}", path.display())),
    }
}

/// A published record, removed when dropped (a gateway that is killed
/// leaves it; the next one on the same address replaces it).
#[derive(Debug)]
pub struct Published {
    path: PathBuf,
}

impl Drop for Published {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Writes `token` for the CLI of this user as the record of the gateway
/// on `addr`. `None` (with a warning) when there is no runtime folder or
/// it cannot be written: the token is still in `state_dir`.
pub fn publish(addr: SocketAddr, token: &str) -> Option<Published> {
    let dir = runtime_dir()?;
    let result = (|| -> anyhow::Result<PathBuf> {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&dir)
            .with_context(|| format!("create {}", dir.display()))?;
        check_private_dir(&dir).map_err(anyhow::Error::msg)?;
        let path = dir.join(record_name(addr));
        let _ = std::fs::remove_file(&path);
        // With this process's id and start time: a client sends the token
        // only while this very gateway runs (after a crash, another
        // user's program could listen on the address).
        let record =
            Record::of_this_process(token).context("read this process's start time from /proc")?;
        write_private(&path, &record.text())?;
        Ok(path)
    })();
    match result {
        Ok(path) => Some(Published { path }),
        Err(e) => {
            tracing::warn!(error = %format!("{e:#}"), "cannot publish the admin token for the CLI; it is in the state folder");
            None
        }
    }
}

fn make() -> anyhow::Result<String> {
    let mut bytes = [0u8; TOKEN_BYTES];
    getrandom::fill(&mut bytes).map_err(|e| anyhow::anyhow!("no randomness for a token: {e}"))?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

/// Writes `text` as a new owner-only file (never through a link, never
/// over one).
fn write_private(path: &Path, text: &str) -> anyhow::Result<()> {
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(nix::libc::O_NOFOLLOW)
        .open(path)
        .with_context(|| format!("create {}", path.display()))?;
    f.write_all(text.as_bytes())
        .with_context(|| format!("write {}", path.display()))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::MetadataExt as _;

    use super::*;

    #[test]
    fn a_token_is_made_once_private_and_kept() {
        let dir = tempfile::tempdir().expect("dir");
        let first = ensure(dir.path()).expect("made");
        assert!(warmgate_deploy::admin_token::is_token(&first));
        let meta = std::fs::metadata(dir.path().join(FILE_NAME)).expect("file");
        assert_eq!(meta.mode() & 0o777, 0o600);
        assert_eq!(ensure(dir.path()).expect("kept"), first);
    }

    #[test]
    fn a_token_file_others_may_read_or_that_holds_no_token_is_refused() {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = tempfile::tempdir().expect("dir");
        let path = dir.path().join(FILE_NAME);
        std::fs::write(&path, "0".repeat(64)).expect("write");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).expect("chmod");
        let e = ensure(dir.path()).expect_err("readable by others");
        assert!(format!("{e:#}").contains("other users"), "{e:#}");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).expect("chmod");
        std::fs::write(&path, "short").expect("write");
        assert!(ensure(dir.path()).is_err());
    }

    #[test]
    fn a_link_in_place_of_the_token_file_is_refused() {
        let dir = tempfile::tempdir().expect("dir");
        std::os::unix::fs::symlink("/etc/passwd", dir.path().join(FILE_NAME)).expect("link");
        assert!(ensure(dir.path()).is_err());
    }
}
