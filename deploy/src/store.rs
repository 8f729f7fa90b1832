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
    ///   A save made elsewhere (a promotion's task) while the batch ends
    ///   waits until it has ended, so it cannot overtake a queued one.
    /// - SQLite would copy the WAL into the database file, and sync it,
    ///   inside the `COMMIT` (an automatic checkpoint). The batch's
    ///   commit skips it, and the copy runs on a thread and a connection
    ///   of its own; until it is done readers find the rows in the WAL,
    ///   and a copy cut short is done again by the next one.
    /// - A panic in `f` ends the writer, rolls back, and goes on.
    fn batch(&self, f: &mut dyn FnMut() -> Result<(), anyhow::Error>) -> Result<(), anyhow::Error> {
        {
            let s = self.store();
            s.conn.execute_batch("BEGIN IMMEDIATE")?;
            let _ = s.conn.pragma_update(None, "wal_autocheckpoint", 0);
        }
        let (tx, rx) = std::sync::mpsc::sync_channel::<Save>(BATCH_QUEUE);
        std::thread::scope(|scope| {
            let writer = scope.spawn(move || -> Result<(), anyhow::Error> {
                for s in rx {
                    lock(&self.store)
                        .save(&s.app, &s.history, &s.note)
                        .map_err(|e| {
                            anyhow::Error::from(e).context(format!("save app '{}'", s.app))
                        })?;
                }
                Ok(())
            });
            *lock(&self.batch) = Some(tx);
            let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(&mut *f));
            // Held until the batch has ended: other saves wait, then go
            // straight to the database after what was queued.
            let mut queue = lock(&self.batch);
            // The last sender gone, the writer ends once it has written
            // what is queued.
            queue.take();
            let written = writer
                .join()
                .unwrap_or_else(|_| Err(StoreError::BatchFailed.into()));
            let ok = matches!(ran, Ok(Ok(()))) && written.is_ok();
            let s = self.store();
            // A failed write may have ended the transaction already
            // (SQLite does on a full disk): the rollback's own error
            // says nothing more.
            let ended = if ok {
                s.conn.execute_batch("COMMIT")
            } else {
                let _ = s.conn.execute_batch("ROLLBACK");
                Ok(())
            };
            let _ = s
                .conn
                .pragma_update(None, "wal_autocheckpoint", WAL_AUTOCHECKPOINT_PAGES);
            if ok
                && ended.is_ok()
                && let Some(path) = s.conn.path().filter(|p| !p.is_empty())
            {
                checkpoint_behind(PathBuf::from(path));
            }
            drop(s);
            drop(queue);
            let result = match ran {
                Ok(result) => result,
                Err(panic) => std::panic::resume_unwind(panic),
            };
            // The writer's error is the cause; `f`'s then only says a
            // save could not be queued.
            written?;
            result?;
            ended?;
            Ok(())
        })
    }
}

/// The store, even after a panic elsewhere held it (each call is one
/// transaction, so nothing is left half done).
fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The mode of `state.db` and its `-wal`/`-shm` files: owner only.
const DB_MODE: u32 = 0o600;

/// Creates the database file at `path` readable by its owner only
/// (`0600`), or narrows the mode of one an older version made wider:
/// whoever opens `state.db` first, the store or the task journal, finds
/// it private, and SQLite gives its `-wal` and `-shm` files its mode.
pub fn create_private(path: &Path) -> Result<(), StoreError> {
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
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(DB_MODE)).map_err(private)
}

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
        use std::os::unix::fs::PermissionsExt as _;
        create_private(path)?;
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
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                    return Err(StoreError::Permissions {
                        path: path.display().to_string(),
                        source: e,
                    });
                }
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
mod tests;
