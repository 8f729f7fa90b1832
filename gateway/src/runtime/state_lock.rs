//! One gateway per state folder: an exclusive lock on `state_dir/lock`,
//! held for the gateway's life.
//!
//! Everything in the folder assumes one owner: a starting gateway stops
//! the process groups its `run/` records (a crashed run's orphans), drops
//! the weight cache's unfinished downloads, and marks the journal's
//! unfinished tasks as lost to a restart. A second gateway given the same
//! folder would do all of that to a live one. The lock is `flock`'s, so it
//! ends with the process however it ends, and a crashed run never leaves
//! it behind.

use std::fs::{File, OpenOptions, TryLockError};
use std::io::{Read as _, Seek as _, Write as _};
use std::path::Path;

/// The held lock; dropping it lets another gateway take the folder.
#[derive(Debug)]
pub struct StateLock {
    _file: File,
}

/// Takes the lock on `dir` (created, owner only, when missing), or says
/// which process holds it. A folder another user owns or may write to,
/// or reaches through a folder or link of theirs, is refused before
/// anything in it is read: its `state.db` names the commands a gateway
/// runs, and its `run/` records the process groups it stops
/// (`warmgate_deploy::private_dir`).
pub fn lock(dir: &Path) -> anyhow::Result<StateLock> {
    use anyhow::Context as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    warmgate_deploy::private_dir::ensure(dir).map_err(|e| {
        anyhow::anyhow!(
            "the state folder {} cannot be trusted: {e}; give `state_dir` a folder of this user's",
            dir.display()
        )
    })?;
    let path = dir.join("lock");
    let mut file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .custom_flags(nix::libc::O_NOFOLLOW)
        .open(&path)
        .with_context(|| format!("open {}", path.display()))?;
    match file.try_lock() {
        Ok(()) => {}
        Err(TryLockError::WouldBlock) => {
            let mut holder = String::new();
            let _ = file.read_to_string(&mut holder);
            let holder = holder.trim();
            let who = if holder.is_empty() {
                "another process".to_string()
            } else {
                format!("process {holder}")
            };
            anyhow::bail!(
                "the state folder {} is in use by another warmgate ({who}): give each gateway \
                 its own state_dir, or stop that one first",
                dir.display()
            );
        }
        Err(TryLockError::Error(e)) => {
            return Err(e).with_context(|| format!("lock {}", path.display()));
        }
    }
    // The holder's pid, for the message above; the lock is what counts.
    file.set_len(0)
        .and_then(|()| file.rewind())
        .and_then(|()| write!(file, "{}", std::process::id()))
        .with_context(|| format!("write {}", path.display()))?;
    Ok(StateLock { _file: file })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_folder_has_one_owner_at_a_time() {
        let dir = tempfile::tempdir().expect("temp dir");
        let state = dir.path().join("state");
        let held = lock(&state).expect("first");
        let err = lock(&state).expect_err("second").to_string();
        assert!(err.contains("in use by another warmgate"), "{err}");
        assert!(err.contains(&std::process::id().to_string()), "{err}");
        drop(held);
        lock(&state).expect("free again once dropped");
    }
}
