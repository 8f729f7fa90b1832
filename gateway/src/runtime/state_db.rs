//! `state_dir/state.db`, the one SQLite file of a gateway's state, and its
//! one owner: made private before anything opens it, then handed out to
//! its users, the revision store, the task journal and the usage ledger,
//! each on
//! connections of its own (SQLite's WAL lets them write in turn).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::Context as _;
use warmgate_deploy::store::{SqliteState, StateStore};

use crate::tasks::journal::{Journal, Recovered};

/// The state database of one gateway.
pub(crate) struct StateDb {
    path: PathBuf,
}

impl StateDb {
    /// `state.db` in `state_dir`, created owner-only (`0600`) or narrowed
    /// to it, before the store or the journal opens it: under the operator
    /// only the journal opens it, and its tasks' bodies are no less
    /// private than the specs.
    pub(crate) fn open(state_dir: &Path) -> anyhow::Result<StateDb> {
        let path = state_dir.join("state.db");
        warmgate_deploy::store::create_private(&path)
            .with_context(|| format!("open {}", path.display()))?;
        Ok(StateDb { path })
    }

    /// The revision store in it.
    pub(crate) fn store(&self) -> anyhow::Result<Arc<dyn StateStore>> {
        let store = SqliteState::open(&self.path)
            .with_context(|| format!("open {}", self.path.display()))?;
        Ok(Arc::new(store))
    }

    /// The usage ledger in it, kept within `max_bytes`.
    pub(crate) fn usage(&self, max_bytes: u64) -> anyhow::Result<crate::usage::Ledger> {
        crate::usage::Ledger::open(&self.path, max_bytes)
            .with_context(|| format!("open the usage ledger in {}", self.path.display()))
    }

    /// The task journal in it, kept within `max_bytes` of bodies, and what
    /// it found of the last run.
    pub(crate) fn journal(&self, max_bytes: u64) -> anyhow::Result<(Journal, Recovered)> {
        Journal::open(&self.path, max_bytes)
            .with_context(|| format!("open the task journal in {}", self.path.display()))
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt as _;

    use super::*;

    #[test]
    fn the_journal_alone_finds_the_file_private() {
        let dir = tempfile::tempdir().unwrap();
        let db = StateDb::open(dir.path()).unwrap();
        let (_journal, recovered) = db.journal(1 << 20).unwrap();
        assert_eq!(recovered.failed, 0);
        for name in ["state.db", "state.db-wal"] {
            let mode = std::fs::metadata(dir.path().join(name))
                .unwrap()
                .permissions()
                .mode();
            assert_eq!(mode & 0o777, 0o600, "{name}: {mode:o}");
        }
    }

    #[test]
    fn a_wider_file_is_narrowed() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state.db");
        std::fs::write(&path, b"").unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        StateDb::open(dir.path()).unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
    }
}
