//! Durable revision history: an embedded SQLite database (WAL) under
//! `state_dir`.
//!
//! Every promotion step is written in one transaction before the gateway
//! acts on it, so a `kill -9` at any point leaves the last step whole: the
//! restarted gateway serves the split it had and resumes (or fails) the
//! promotion it was in. WAL with `synchronous = NORMAL` survives a crash of
//! the process; only a power loss can take the last commits.

use std::path::Path;

use rusqlite::{Connection, OptionalExtension, params};

use crate::revision::{History, Promotion, Revision};

/// Why the store failed.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// SQLite said no.
    #[error("state database: {0}")]
    Sqlite(#[from] rusqlite::Error),
    /// The database file's mode could not be set to owner-only.
    #[error("state database: cannot make {path} private: {source}")]
    Permissions {
        /// The file.
        path: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// A stored row is not what this version writes.
    #[error("state database: a stored {what} is unreadable: {source}")]
    Corrupt {
        /// Which kind of row.
        what: &'static str,
        /// The parse error.
        source: serde_json::Error,
    },
}

/// One event in an app's history, as `warmgate revisions` shows it.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Note {
    /// Unix seconds.
    pub at_unix: f64,
    /// What happened, e.g. `promote m-00002 (canary 10%)`.
    pub what: String,
}

/// The mode of `state.db` and its `-wal`/`-shm` files: owner only.
const DB_MODE: u32 = 0o600;

/// The database.
pub struct Store {
    conn: Connection,
}

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS revisions (
    id TEXT PRIMARY KEY,
    app TEXT NOT NULL,
    seq INTEGER NOT NULL,
    body TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS revisions_by_app ON revisions (app, seq);
CREATE TABLE IF NOT EXISTS promotions (
    app TEXT PRIMARY KEY,
    body TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS configs (
    app TEXT PRIMARY KEY,
    body TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS notes (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    app TEXT NOT NULL,
    at REAL NOT NULL,
    what TEXT NOT NULL
);
";

impl Store {
    /// Opens (or creates) the database at `path`.
    ///
    /// The file is made readable by its owner only (`0600`), and SQLite
    /// gives its `-wal` and `-shm` files the same mode: they hold the app
    /// specs, whose `env` may carry secrets. A database made by an older
    /// version with a wider mode is narrowed.
    pub fn open(path: &Path) -> Result<Store, StoreError> {
        use std::os::unix::fs::{OpenOptionsExt as _, PermissionsExt as _};
        let private = |e: std::io::Error| StoreError::Permissions {
            path: path.display().to_string(),
            source: e,
        };
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .mode(DB_MODE)
            .open(path)
            .map_err(private)?;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(DB_MODE))
            .map_err(private)?;
        let conn = Connection::open(path)?;
        conn.pragma_update(None, "journal_mode", "WAL")?;
        conn.pragma_update(None, "synchronous", "NORMAL")?;
        conn.busy_timeout(std::time::Duration::from_secs(5))?;
        conn.execute_batch(SCHEMA)?;
        for suffix in ["-wal", "-shm"] {
            let mut side = path.as_os_str().to_owned();
            side.push(suffix);
            match std::fs::set_permissions(&side, std::fs::Permissions::from_mode(DB_MODE)) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(private(e)),
                _ => {}
            }
        }
        Ok(Store { conn })
    }

    /// An app's revisions and last promotion (empty for a new app).
    pub fn load(&self, app: &str) -> Result<History, StoreError> {
        let mut stmt = self
            .conn
            .prepare("SELECT body FROM revisions WHERE app = ?1 ORDER BY seq")?;
        let revisions = stmt
            .query_map(params![app], |row| row.get::<_, String>(0))?
            .map(|body| {
                let body = body?;
                serde_json::from_str::<Revision>(&body).map_err(|source| StoreError::Corrupt {
                    what: "revision",
                    source,
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        let promotion = self
            .conn
            .query_row(
                "SELECT body FROM promotions WHERE app = ?1",
                params![app],
                |row| row.get::<_, String>(0),
            )
            .optional()?
            .map(|body| {
                serde_json::from_str::<Promotion>(&body).map_err(|source| StoreError::Corrupt {
                    what: "promotion",
                    source,
                })
            })
            .transpose()?;
        let config = self
            .conn
            .query_row(
                "SELECT body FROM configs WHERE app = ?1",
                params![app],
                |row| row.get::<_, String>(0),
            )
            .optional()?;
        Ok(History {
            revisions,
            promotion,
            config,
        })
    }

    /// Writes an app's whole history, and a note, in one transaction.
    pub fn save(&mut self, app: &str, h: &History, note: &str) -> Result<(), StoreError> {
        let tx = self.conn.transaction()?;
        for r in &h.revisions {
            let body = serde_json::to_string(r).map_err(|source| StoreError::Corrupt {
                what: "revision",
                source,
            })?;
            tx.execute(
                "INSERT INTO revisions (id, app, seq, body) VALUES (?1, ?2, ?3, ?4)
                 ON CONFLICT (id) DO UPDATE SET body = excluded.body",
                params![r.id, app, r.seq, body],
            )?;
        }
        match &h.promotion {
            Some(p) => {
                let body = serde_json::to_string(p).map_err(|source| StoreError::Corrupt {
                    what: "promotion",
                    source,
                })?;
                tx.execute(
                    "INSERT INTO promotions (app, body) VALUES (?1, ?2)
                     ON CONFLICT (app) DO UPDATE SET body = excluded.body",
                    params![app, body],
                )?;
            }
            None => {
                tx.execute("DELETE FROM promotions WHERE app = ?1", params![app])?;
            }
        }
        if let Some(c) = &h.config {
            tx.execute(
                "INSERT INTO configs (app, body) VALUES (?1, ?2)
                 ON CONFLICT (app) DO UPDATE SET body = excluded.body",
                params![app, c],
            )?;
        }
        if !note.is_empty() {
            tx.execute(
                "INSERT INTO notes (app, at, what) VALUES (?1, ?2, ?3)",
                params![app, unix_now(), note],
            )?;
        }
        tx.commit()?;
        Ok(())
    }

    /// An app's notes, oldest first, at most the last `limit`.
    pub fn notes(&self, app: &str, limit: usize) -> Result<Vec<Note>, StoreError> {
        let mut stmt = self.conn.prepare(
            "SELECT at, what FROM (SELECT id, at, what FROM notes WHERE app = ?1
             ORDER BY id DESC LIMIT ?2) ORDER BY id",
        )?;
        let notes = stmt
            .query_map(params![app, limit as i64], |row| {
                Ok(Note {
                    at_unix: row.get(0)?,
                    what: row.get(1)?,
                })
            })?
            .collect::<Result<Vec<_>, _>>()?;
        Ok(notes)
    }
}

/// Unix seconds now.
pub fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::revision::{Event, Plan, Promotion, RevisionState, revision_id};

    fn rev(seq: u32, traffic: u8) -> Revision {
        Revision {
            id: revision_id("m", seq),
            app: "m".into(),
            seq,
            checkpoint: Some(format!("s3://b/ckpt/{seq}")),
            checkpoint_version: Some(format!("\"etag-{seq}\"")),
            spec: r#"{"name":"m"}"#.into(),
            created_unix: 1.0,
            state: if traffic > 0 {
                RevisionState::Serving
            } else {
                RevisionState::Pending
            },
            traffic,
            served: traffic > 0,
        }
    }

    #[test]
    fn history_survives_a_reopen_step_by_step() {
        let dir = tempfile::tempdir().expect("dir");
        let path = dir.path().join("state.db");
        let mut h = History {
            revisions: vec![rev(1, 100), rev(2, 0)],
            promotion: None,
            config: Some("{}".into()),
        };
        {
            let mut s = Store::open(&path).expect("open");
            assert_eq!(s.load("m").expect("load"), History::default());
            s.save("m", &h, "created m-00002").expect("save");
            let (p, fx) = Promotion::begin(
                "m",
                Some("m-00001"),
                "m-00002",
                Plan {
                    canary: Some(20),
                    bake: Duration::from_secs(30),
                    at_zero: false,
                },
            );
            h.apply(&p, &fx);
            s.save("m", &h, "promote m-00002").expect("save");
            let (p, fx) = p.on(Event::Ready).expect("ready");
            h.apply(&p, &fx);
            s.save("m", &h, "canary 20%").expect("save");
            // Dropped without any shutdown: what a kill leaves.
        }
        let s = Store::open(&path).expect("reopen");
        let back = s.load("m").expect("load");
        assert_eq!(back, h);
        assert!(back.promoting());
        let notes: Vec<String> = s
            .notes("m", 10)
            .expect("notes")
            .into_iter()
            .map(|n| n.what)
            .collect();
        assert_eq!(notes, ["created m-00002", "promote m-00002", "canary 20%"]);
        assert_eq!(s.notes("m", 1).expect("notes").len(), 1);
        assert_eq!(s.load("other").expect("load"), History::default());
    }

    #[test]
    fn the_database_and_its_wal_files_are_private() {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = tempfile::tempdir().expect("dir");
        let path = dir.path().join("state.db");
        // A file an older version left world-readable is narrowed too.
        std::fs::write(&path, b"").expect("create");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).expect("chmod");
        let mut s = Store::open(&path).expect("open");
        s.save("m", &History::default(), "a note").expect("save");
        for name in ["state.db", "state.db-wal", "state.db-shm"] {
            let mode = std::fs::metadata(dir.path().join(name))
                .unwrap_or_else(|e| panic!("{name}: {e}"))
                .permissions()
                .mode();
            assert_eq!(mode & 0o777, 0o600, "{name} has mode {:o}", mode & 0o777);
        }
    }

    #[test]
    fn a_corrupt_row_is_an_error_not_a_panic() {
        let dir = tempfile::tempdir().expect("dir");
        let path = dir.path().join("state.db");
        let s = Store::open(&path).expect("open");
        s.conn
            .execute(
                "INSERT INTO revisions (id, app, seq, body) VALUES ('m-00001', 'm', 1, 'nope')",
                [],
            )
            .expect("insert");
        let err = s.load("m").expect_err("corrupt");
        assert!(err.to_string().contains("revision"), "{err}");
    }
}
