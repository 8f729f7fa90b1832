//! Durable revision history behind one trait, [`StateStore`]: on one
//! machine an embedded SQLite database (WAL) under `state_dir` ([`Store`]);
//! on Kubernetes the API server (the operator's store, one Secret per
//! app), so a new leader reads what the last one wrote.
//!
//! Every promotion step is written in one transaction before the gateway
//! acts on it, so a `kill -9` at any point leaves the last step whole: the
//! restarted gateway serves the split it had and resumes (or fails) the
//! promotion it was in. WAL with `synchronous = NORMAL` survives a crash of
//! the process; only a power loss can take the last commits.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use rusqlite::{Connection, OptionalExtension, params};

use crate::config::{AppSpec, Config, PoolSpec};
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
    /// The cluster's API server did not take or give the state.
    #[error("state in the cluster: {0}")]
    Cluster(String),
    /// A batch's writer stopped (its own error is the batch's).
    #[error("state database: the batch's writes stopped")]
    BatchFailed,
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
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Note {
    /// Unix seconds.
    pub at_unix: f64,
    /// What happened, e.g. `promote m-00002 (canary 10%)`.
    pub what: String,
}

/// Where the gateway keeps what must outlive it: each app's revision
/// history and promotion, its notes, and the changes made through the API
/// over the config file.
///
/// Every write is whole before it returns, and the gateway acts on a step
/// only after it is written: a gateway lost at any point leaves the last
/// step whole for the next one.
pub trait StateStore: Send + Sync {
    /// An app's revisions and last promotion (empty for a new app).
    fn load(&self, app: &str) -> Result<History, StoreError>;
    /// Every stored app's history at once, for a start that restores
    /// thousands of apps: a few reads rather than a few per app. `None`
    /// where the store reads one app at a time (an app not in the map is
    /// new: its history is empty).
    fn load_all(&self) -> Result<Option<HashMap<String, History>>, StoreError> {
        Ok(None)
    }
    /// Writes an app's whole history, and a note, at once.
    fn save(&self, app: &str, h: &History, note: &str) -> Result<(), StoreError>;
    /// An app's notes, oldest first, at most the last `limit`.
    fn notes(&self, app: &str, limit: usize) -> Result<Vec<Note>, StoreError>;
    /// Records that the API put (`Some`, the spec as JSON) or deleted
    /// (`None`) an app or pool, with a note.
    fn record_spec(
        &self,
        kind: SpecKind,
        name: &str,
        body: Option<&str>,
        note: &str,
    ) -> Result<(), StoreError>;
    /// Forgets the API's change to one app or pool.
    fn forget_spec(&self, kind: SpecKind, name: &str) -> Result<(), StoreError>;
    /// Every change the API made, to apply over the config file.
    fn overlay(&self) -> Result<Overlay, StoreError>;
    /// Forgets every change the API made.
    fn clear_overlay(&self) -> Result<(), StoreError>;
    /// Drops the state of an app that was deleted and whose replicas have
    /// stopped, where the store is bounded (the operator's, shared by all
    /// apps). By default it is kept: on one machine an app put again under
    /// the same name continues its revision numbering.
    fn forget(&self, _app: &str) -> Result<(), StoreError> {
        Ok(())
    }
    /// Runs `f` with its writes made as one: a start that restores
    /// thousands of apps writes them in one transaction, not one each.
    /// Nothing `f` writes is kept if it fails (or the gateway dies before
    /// it returns); what it wrote is derived again from the config and
    /// the last state on the next start. By default, each write stays
    /// its own.
    fn batch(&self, f: &mut dyn FnMut() -> Result<(), anyhow::Error>) -> Result<(), anyhow::Error> {
        f()
    }
}

/// The SQLite database as the gateway holds it: one call at a time, and a
/// batch's saves written by a thread of their own.
pub struct SqliteState {
    store: std::sync::Mutex<Store>,
    /// While a batch runs: where its saves go.
    batch: std::sync::Mutex<Option<std::sync::mpsc::SyncSender<Save>>>,
}

/// A save a batch's writer carries out.
struct Save {
    app: String,
    history: History,
    note: String,
}

/// Saves a batch may have queued for its writer.
const BATCH_QUEUE: usize = 256;

impl SqliteState {
    /// Opens (or creates) the database at `path` (see [`Store::open`]).
    pub fn open(path: &Path) -> Result<SqliteState, StoreError> {
        Ok(SqliteState {
            store: std::sync::Mutex::new(Store::open(path)?),
            batch: std::sync::Mutex::new(None),
        })
    }

    fn store(&self) -> std::sync::MutexGuard<'_, Store> {
        lock(&self.store)
    }
}

impl StateStore for SqliteState {
    fn load(&self, app: &str) -> Result<History, StoreError> {
        self.store().load(app)
    }
    fn load_all(&self) -> Result<Option<HashMap<String, History>>, StoreError> {
        self.store().load_all().map(Some)
    }
    fn save(&self, app: &str, h: &History, note: &str) -> Result<(), StoreError> {
        let queue = lock(&self.batch).clone();
        match queue {
            Some(tx) => tx
                .send(Save {
                    app: app.to_string(),
                    history: h.clone(),
                    note: note.to_string(),
                })
                // The writer stopped at an error, which the batch returns.
                .map_err(|_| StoreError::BatchFailed),
            None => self.store().save(app, h, note),
        }
    }
    fn notes(&self, app: &str, limit: usize) -> Result<Vec<Note>, StoreError> {
        self.store().notes(app, limit)
    }
    fn record_spec(
        &self,
        kind: SpecKind,
        name: &str,
        body: Option<&str>,
        note: &str,
    ) -> Result<(), StoreError> {
        self.store().record_spec(kind, name, body, note)
    }
    fn forget_spec(&self, kind: SpecKind, name: &str) -> Result<(), StoreError> {
        self.store().forget_spec(kind, name)
    }
    fn overlay(&self) -> Result<Overlay, StoreError> {
        self.store().overlay()
    }
    fn clear_overlay(&self) -> Result<(), StoreError> {
        self.store().clear_overlay()
    }
    /// A start's batch writes every app's history at once: tens of
    /// megabytes with thousands of apps.
    /// - Its saves are written (their JSON and their rows) by a thread of
    ///   their own while `f` goes on: they were half of a 10,000-app
    ///   start. `save` returns once the history is queued; the first
    ///   error stops the writer and is the batch's, and nothing is kept.
    /// - SQLite would copy the WAL into the database file, and sync it,
    ///   inside the `COMMIT` (an automatic checkpoint). The batch's
    ///   commit skips it, and the copy runs on a thread and a connection
    ///   of its own; until it is done readers find the rows in the WAL,
    ///   and a copy cut short is done again by the next one.
    fn batch(&self, f: &mut dyn FnMut() -> Result<(), anyhow::Error>) -> Result<(), anyhow::Error> {
        {
            let s = self.store();
            s.conn.pragma_update(None, "wal_autocheckpoint", 0)?;
            s.conn.execute_batch("BEGIN IMMEDIATE")?;
        }
        let (tx, rx) = std::sync::mpsc::sync_channel::<Save>(BATCH_QUEUE);
        let (result, written) = std::thread::scope(|scope| {
            let writer = scope.spawn(move || -> Result<(), StoreError> {
                for s in rx {
                    lock(&self.store).save(&s.app, &s.history, &s.note)?;
                }
                Ok(())
            });
            *lock(&self.batch) = Some(tx);
            let result = f();
            // The last sender gone, the writer ends once it has written
            // what is queued.
            *lock(&self.batch) = None;
            let written = writer.join().unwrap_or(Err(StoreError::BatchFailed));
            (result, written)
        });
        let ok = result.is_ok() && written.is_ok();
        {
            let s = self.store();
            let ended = s.conn.execute_batch(if ok { "COMMIT" } else { "ROLLBACK" });
            s.conn
                .pragma_update(None, "wal_autocheckpoint", WAL_AUTOCHECKPOINT_PAGES)?;
            ended?;
            if ok && let Some(path) = s.conn.path().filter(|p| !p.is_empty()) {
                checkpoint_behind(PathBuf::from(path));
            }
        }
        // The writer's error is the cause; `f`'s then only says a save
        // could not be queued.
        written?;
        result
    }
}

/// The store, even after a panic elsewhere held it (each call is one
/// transaction, so nothing is left half done).
fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
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
CREATE TABLE IF NOT EXISTS spec_changes (
    kind TEXT NOT NULL,
    name TEXT NOT NULL,
    body TEXT,
    PRIMARY KEY (kind, name)
);
CREATE TABLE IF NOT EXISTS notes (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    app TEXT NOT NULL,
    at REAL NOT NULL,
    what TEXT NOT NULL
);
";

/// SQLite's default: a checkpoint once the WAL holds this many pages.
const WAL_AUTOCHECKPOINT_PAGES: i64 = 1000;

/// Copies the WAL into the database file on a thread of its own, without
/// blocking readers or writers (`PASSIVE`). It may fail (the database
/// busy, the folder gone in a test): the next automatic checkpoint does
/// the same work, so nothing is lost by leaving it.
fn checkpoint_behind(path: PathBuf) {
    let copy = move || {
        if let Ok(conn) = Connection::open(&path) {
            let _ = conn.busy_timeout(std::time::Duration::from_secs(5));
            let _ = conn.query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |_| Ok(()));
        }
    };
    let _ = std::thread::Builder::new()
        .name("state-checkpoint".into())
        .spawn(copy);
}

fn parse_promotion(body: &str) -> Result<Promotion, StoreError> {
    serde_json::from_str::<Promotion>(body).map_err(|source| StoreError::Corrupt {
        what: "promotion",
        source,
    })
}

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
        // A save inside a batch is a savepoint: its statement journal in
        // memory, not one write to a temporary file per page it touches.
        conn.pragma_update(None, "temp_store", "MEMORY")?;
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
            .prepare_cached("SELECT body FROM revisions WHERE app = ?1 ORDER BY seq")?;
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
            .prepare_cached("SELECT body FROM promotions WHERE app = ?1")?
            .query_row(params![app], |row| row.get::<_, String>(0))
            .optional()?
            .map(|body| parse_promotion(&body))
            .transpose()?;
        let config = self
            .conn
            .prepare_cached("SELECT body FROM configs WHERE app = ?1")?
            .query_row(params![app], |row| row.get::<_, String>(0))
            .optional()?;
        Ok(History {
            revisions,
            promotion,
            config,
        })
    }

    /// Every stored app's history, in three reads whatever the number of
    /// apps.
    pub fn load_all(&self) -> Result<HashMap<String, History>, StoreError> {
        let mut all: HashMap<String, History> = HashMap::new();
        let mut stmt = self
            .conn
            .prepare("SELECT app, body FROM revisions ORDER BY app, seq")?;
        let mut rows = stmt.query([])?;
        while let Some(row) = rows.next()? {
            let (app, body): (String, String) = (row.get(0)?, row.get(1)?);
            let revision =
                serde_json::from_str::<Revision>(&body).map_err(|source| StoreError::Corrupt {
                    what: "revision",
                    source,
                })?;
            all.entry(app).or_default().revisions.push(revision);
        }
        let mut stmt = self.conn.prepare("SELECT app, body FROM promotions")?;
        let mut rows = stmt.query([])?;
        while let Some(row) = rows.next()? {
            let (app, body): (String, String) = (row.get(0)?, row.get(1)?);
            all.entry(app).or_default().promotion = Some(parse_promotion(&body)?);
        }
        let mut stmt = self.conn.prepare("SELECT app, body FROM configs")?;
        let mut rows = stmt.query([])?;
        while let Some(row) = rows.next()? {
            let (app, body): (String, String) = (row.get(0)?, row.get(1)?);
            all.entry(app).or_default().config = Some(body);
        }
        Ok(all)
    }

    /// Writes an app's whole history, and a note, in one transaction.
    pub fn save(&mut self, app: &str, h: &History, note: &str) -> Result<(), StoreError> {
        // A savepoint: its own transaction, or a part of a batch's.
        let tx = self.conn.savepoint()?;
        for r in &h.revisions {
            let body = serde_json::to_string(r).map_err(|source| StoreError::Corrupt {
                what: "revision",
                source,
            })?;
            tx.prepare_cached(
                "INSERT INTO revisions (id, app, seq, body) VALUES (?1, ?2, ?3, ?4)
                 ON CONFLICT (id) DO UPDATE SET body = excluded.body",
            )?
            .execute(params![r.id, app, r.seq, body])?;
        }
        match &h.promotion {
            Some(p) => {
                let body = serde_json::to_string(p).map_err(|source| StoreError::Corrupt {
                    what: "promotion",
                    source,
                })?;
                tx.prepare_cached(
                    "INSERT INTO promotions (app, body) VALUES (?1, ?2)
                     ON CONFLICT (app) DO UPDATE SET body = excluded.body",
                )?
                .execute(params![app, body])?;
            }
            None => {
                tx.prepare_cached("DELETE FROM promotions WHERE app = ?1")?
                    .execute(params![app])?;
            }
        }
        match &h.config {
            Some(c) => {
                tx.prepare_cached(
                    "INSERT INTO configs (app, body) VALUES (?1, ?2)
                     ON CONFLICT (app) DO UPDATE SET body = excluded.body",
                )?
                .execute(params![app, c])?;
            }
            None => {
                tx.prepare_cached("DELETE FROM configs WHERE app = ?1")?
                    .execute(params![app])?;
            }
        }
        if !note.is_empty() {
            tx.prepare_cached("INSERT INTO notes (app, at, what) VALUES (?1, ?2, ?3)")?
                .execute(params![app, unix_now(), note])?;
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

/// What the control API changed over the config file: apps and pools put
/// (`Some`) or deleted (`None`), by name. Applied over the file at every
/// start, so a change made through the API survives a restart.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Overlay {
    /// Apps put or deleted.
    pub apps: std::collections::BTreeMap<String, Option<AppSpec>>,
    /// Pools put or deleted.
    pub pools: std::collections::BTreeMap<String, Option<PoolSpec>>,
}

impl Overlay {
    /// `config` with these changes: a put spec replaces the file's entry of
    /// that name in place or comes after the file's entries; a deleted
    /// one is gone.
    pub fn apply_to(&self, config: &mut Config) {
        fn merge<S: Clone>(
            list: &mut Vec<S>,
            changes: &std::collections::BTreeMap<String, Option<S>>,
            name: impl Fn(&S) -> &str,
        ) {
            list.retain(|s| !matches!(changes.get(name(s)), Some(None)));
            for (n, spec) in changes {
                let Some(spec) = spec else { continue };
                match list.iter_mut().find(|s| name(s) == n) {
                    Some(slot) => *slot = spec.clone(),
                    None => list.push(spec.clone()),
                }
            }
        }
        merge(&mut config.apps, &self.apps, |a| &a.name);
        merge(&mut config.pools, &self.pools, |p| &p.name);
    }

    /// True when it changes nothing.
    pub fn is_empty(&self) -> bool {
        self.apps.is_empty() && self.pools.is_empty()
    }
}

/// Which kind of spec a change is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SpecKind {
    /// An `[[apps]]` entry.
    App,
    /// A `[[pools]]` entry.
    Pool,
}

impl SpecKind {
    fn as_str(self) -> &'static str {
        match self {
            SpecKind::App => "app",
            SpecKind::Pool => "pool",
        }
    }
}

impl Store {
    /// Records that the API put (`Some`, the spec as JSON) or deleted
    /// (`None`) an app or pool, with a note, in one transaction.
    pub fn record_spec(
        &mut self,
        kind: SpecKind,
        name: &str,
        body: Option<&str>,
        note: &str,
    ) -> Result<(), StoreError> {
        let tx = self.conn.transaction()?;
        tx.execute(
            "INSERT INTO spec_changes (kind, name, body) VALUES (?1, ?2, ?3)
             ON CONFLICT (kind, name) DO UPDATE SET body = excluded.body",
            params![kind.as_str(), name, body],
        )?;
        if !note.is_empty() {
            tx.execute(
                "INSERT INTO notes (app, at, what) VALUES (?1, ?2, ?3)",
                params![name, unix_now(), note],
            )?;
        }
        tx.commit()?;
        Ok(())
    }

    /// Forgets the API's change to one app or pool (a change recorded but
    /// then not carried out).
    pub fn forget_spec(&mut self, kind: SpecKind, name: &str) -> Result<(), StoreError> {
        self.conn.execute(
            "DELETE FROM spec_changes WHERE kind = ?1 AND name = ?2",
            params![kind.as_str(), name],
        )?;
        Ok(())
    }

    /// Every change the API made, to apply over the config file.
    pub fn overlay(&self) -> Result<Overlay, StoreError> {
        let mut stmt = self
            .conn
            .prepare("SELECT kind, name, body FROM spec_changes ORDER BY kind, name")?;
        let rows = stmt
            .query_map([], |row| {
                Ok((
                    row.get::<_, String>(0)?,
                    row.get::<_, String>(1)?,
                    row.get::<_, Option<String>>(2)?,
                ))
            })?
            .collect::<Result<Vec<_>, _>>()?;
        let mut out = Overlay::default();
        for (kind, name, body) in rows {
            let corrupt = |source| StoreError::Corrupt {
                what: "spec change",
                source,
            };
            match kind.as_str() {
                "app" => {
                    let spec = body
                        .map(|b| serde_json::from_str(&b))
                        .transpose()
                        .map_err(corrupt)?;
                    out.apps.insert(name, spec);
                }
                "pool" => {
                    let spec = body
                        .map(|b| serde_json::from_str(&b))
                        .transpose()
                        .map_err(corrupt)?;
                    out.pools.insert(name, spec);
                }
                _ => {}
            }
        }
        Ok(out)
    }

    /// Forgets every change the API made (the config file is the whole
    /// truth again, as after `warmgate apply`).
    pub fn clear_overlay(&mut self) -> Result<(), StoreError> {
        self.conn.execute("DELETE FROM spec_changes", [])?;
        Ok(())
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
                    in_place: false,
                    canary_asked: None,
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
    fn every_history_read_at_once_is_what_each_read_alone_gives() {
        let dir = tempfile::tempdir().expect("dir");
        let path = dir.path().join("state.db");
        let mut s = Store::open(&path).expect("open");
        let mut promoted = History {
            revisions: vec![rev(1, 100), rev(2, 0)],
            promotion: None,
            config: Some("{\"a\":1}".into()),
        };
        let (p, fx) = Promotion::switch(
            "m",
            Some("m-00001"),
            "m-00002",
            Plan {
                canary: None,
                bake: Duration::ZERO,
                at_zero: true,
                in_place: false,
                canary_asked: None,
            },
        );
        promoted.apply(&p, &fx);
        let mut only = rev(1, 100);
        only.id = "n-00001".into();
        let plain = History {
            revisions: vec![only],
            promotion: None,
            config: None,
        };
        s.save("m", &promoted, "created").expect("save");
        s.save("n", &plain, "created").expect("save");
        let all = s.load_all().expect("load all");
        assert_eq!(all.len(), 2);
        assert_eq!(all["m"], s.load("m").expect("load"));
        assert_eq!(all["m"], promoted);
        assert_eq!(all["n"], plain);
        assert!(!all.contains_key("other"));
        // A corrupt row fails the whole read, as it fails the app's own.
        s.conn
            .execute(
                "INSERT INTO revisions (id, app, seq, body) VALUES ('o-00001', 'o', 1, 'nope')",
                [],
            )
            .expect("insert");
        assert!(s.load_all().is_err());
    }

    #[test]
    fn a_batch_keeps_all_its_saves_or_none() {
        let dir = tempfile::tempdir().expect("dir");
        let state = SqliteState::open(&dir.path().join("state.db")).expect("open");
        let h = History {
            revisions: vec![rev(1, 100)],
            promotion: None,
            config: Some("{}".into()),
        };
        state
            .batch(&mut || {
                state.save("m", &h, "created m-00001")?;
                Ok(())
            })
            .expect("batch");
        assert_eq!(state.load("m").expect("load"), h);
        // A batch that fails keeps nothing it queued.
        let mut later = h.clone();
        later.revisions.push(rev(2, 0));
        let err = state
            .batch(&mut || {
                state.save("m", &later, "created m-00002")?;
                anyhow::bail!("the start stopped")
            })
            .expect_err("fails");
        assert!(err.to_string().contains("the start stopped"), "{err}");
        assert_eq!(state.load("m").expect("load"), h);
        // A save that cannot be written fails the batch with its own error.
        state
            .store()
            .conn
            .execute_batch("DROP TABLE notes")
            .expect("drop");
        let err = state
            .batch(&mut || {
                for _ in 0..1000 {
                    state.save("m", &later, "created m-00002")?;
                }
                Ok(())
            })
            .expect_err("fails");
        assert!(err.to_string().contains("notes"), "{err}");
        assert_eq!(state.load("m").expect("load"), h);
        // Outside a batch, a save is written at once.
        state.save("m", &later, "").expect("save");
        assert_eq!(state.load("m").expect("load"), later);
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

    #[test]
    fn changes_made_through_the_api_are_kept_and_laid_over_the_file() {
        let text = r#"
            [[apps]]
            name = "a"
            command = ["w"]
            [[apps]]
            name = "b"
            command = ["w"]
            [[pools]]
            name = "p"
            command = ["w"]
        "#;
        let file = Config::parse(text, Path::new("t.toml"), Path::new("/")).expect("config");
        let dir = tempfile::tempdir().expect("dir");
        let path = dir.path().join("state.db");
        let mut b = file.apps[1].clone();
        b.autoscale.max = 7;
        let mut c = file.apps[0].clone();
        c.name = "c".into();
        {
            let mut store = Store::open(&path).expect("open");
            assert!(store.overlay().expect("overlay").is_empty());
            let json = |s: &AppSpec| serde_json::to_string(s).expect("json");
            store
                .record_spec(SpecKind::App, "b", Some(&json(&b)), "put b")
                .expect("b");
            store
                .record_spec(SpecKind::App, "c", Some(&json(&c)), "put c")
                .expect("c");
            store
                .record_spec(SpecKind::App, "a", None, "delete a")
                .expect("a");
            store
                .record_spec(SpecKind::Pool, "p", None, "delete p")
                .expect("p");
        }
        // Reopened, as after a restart.
        let store = Store::open(&path).expect("reopen");
        let overlay = store.overlay().expect("overlay");
        let mut config = file.clone();
        overlay.apply_to(&mut config);
        let names: Vec<&str> = config.apps.iter().map(|a| a.name.as_str()).collect();
        assert_eq!(names, ["b", "c"]);
        assert_eq!(config.apps[0].autoscale.max, 7);
        assert!(config.pools.is_empty());
        let mut store = store;
        store.forget_spec(SpecKind::App, "c").expect("forget c");
        assert!(!store.overlay().expect("overlay").apps.contains_key("c"));
        store.clear_overlay().expect("clear");
        assert!(store.overlay().expect("overlay").is_empty());
    }
}
