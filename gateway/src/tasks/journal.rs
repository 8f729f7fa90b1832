//! The async-task journal: every task accepted with `?async=true` is on
//! disk before its `202` goes out, and its end is written when it ends. A
//! gateway that crashes therefore forgets nothing it promised: on restart,
//! tasks that had not ended are marked failed with `gateway_restarted`, and
//! `GET /v1/tasks/{id}` reads ended tasks back from the journal.
//!
//! The journal is bounded in rows and in bytes (`limits.max_journal_bytes`):
//! the oldest rows are pruned past the row bound, and past the byte bound
//! the bytes are shared fairly between owners (tenants): the rows pruned
//! are the oldest of the owners that hold the most, so one tenant's flood
//! does not push out another's results.
//!
//! One writer thread owns the write connection and commits whatever is
//! waiting in one transaction (group commit), so a burst of submissions
//! costs one fsync-free WAL append per batch, not per task. The channel to
//! it is bounded.

use std::path::Path;
use std::sync::Arc;
use std::sync::mpsc::{Receiver, SyncSender, TrySendError, sync_channel};
use std::time::{SystemTime, UNIX_EPOCH};

use parking_lot::Mutex;
use rusqlite::{Connection, OptionalExtension, params};
use serde_json::Value;
use tokio::sync::oneshot;

use super::record::TaskRecord;

/// Ended tasks kept in the journal; older rows are pruned.
const KEEP: i64 = 100_000;
/// Operations waiting for the writer.
const CAPACITY: usize = 65_536;
/// Operations committed in one transaction at most.
const BATCH: usize = 1024;
/// An output larger than this is not kept across restarts (the record says
/// so); the in-memory record still has it.
const MAX_KEPT_OUTPUT: usize = 1024 * 1024;

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS tasks (
    id TEXT PRIMARY KEY,
    owner TEXT,
    state TEXT NOT NULL,
    at REAL NOT NULL,
    body TEXT NOT NULL,
    run TEXT
);
CREATE INDEX IF NOT EXISTS tasks_by_time ON tasks (at);
";

enum Op {
    Accept {
        record: TaskRecord,
        ack: oneshot::Sender<Result<(), String>>,
    },
    End(TaskRecord),
    /// A task accepted here and then refused by its queue: it never ran.
    Forget(String),
}

/// The journal: a writer thread and a read connection.
pub struct Journal {
    tx: SyncSender<Op>,
    /// This run of the gateway: a row written by another run was read
    /// back after a restart.
    run: Arc<str>,
    read: Arc<Mutex<Connection>>,
    /// Reads waiting for the one read connection: a flood of lookups of
    /// unknown ids waits here, not in the blocking pool that replica logs
    /// and other file work share.
    readers: tokio::sync::Semaphore,
}

/// What opening the journal found of the previous run.
#[derive(Debug, Default)]
pub struct Recovered {
    /// Tasks accepted before a crash and now marked failed.
    pub failed: u64,
}

/// Journal reads on the blocking pool at once (they take turns on one
/// connection anyway).
const READERS: usize = 2;

impl Journal {
    /// Opens the journal in the SQLite file at `path`, marks every task
    /// the previous run left unfinished as failed, and starts the writer,
    /// which keeps the rows within `max_bytes` (of their bodies).
    pub fn open(path: &Path, max_bytes: u64) -> rusqlite::Result<(Journal, Recovered)> {
        let write = connect(path)?;
        write.execute_batch(SCHEMA)?;
        add_run_column(&write)?;
        let run: Arc<str> = Arc::from(run_id().as_str());
        let writer_run = run.clone();
        let failed = fail_unfinished(&write)?;
        prune(&write, max_bytes)?;
        let read = connect(path)?;
        let (tx, rx) = sync_channel(CAPACITY);
        std::thread::Builder::new()
            .name("task-journal".into())
            .spawn(move || writer(write, rx, max_bytes, &writer_run))
            .map_err(|e| rusqlite::Error::ToSqlConversionFailure(Box::new(e)))?;
        Ok((
            Journal {
                tx,
                run,
                read: Arc::new(Mutex::new(read)),
                readers: tokio::sync::Semaphore::new(READERS),
            },
            Recovered { failed },
        ))
    }

    /// Writes an accepted task; resolves once it is committed.
    pub async fn accept(&self, record: &TaskRecord) -> Result<(), String> {
        let (ack, done) = oneshot::channel();
        self.tx
            .try_send(Op::Accept {
                record: record.clone(),
                ack,
            })
            .map_err(|e| match e {
                TrySendError::Full(_) => "the task journal is falling behind".to_string(),
                TrySendError::Disconnected(_) => "the task journal has stopped".to_string(),
            })?;
        done.await
            .map_err(|_| "the task journal has stopped".to_string())?
    }

    /// Records a task's end (never waits).
    pub fn end(&self, record: &TaskRecord) {
        if let Err(e) = self.tx.try_send(Op::End(record.clone())) {
            metrics::counter!("warmgate_task_journal_dropped_total").increment(1);
            tracing::warn!(task = %record.id, error = %e, "could not journal a task's end");
        }
    }

    /// Removes an accepted task that its queue then refused (never waits):
    /// it never ran, so it must not read back as failed after a restart.
    pub fn forget(&self, id: &str) {
        if let Err(e) = self.tx.try_send(Op::Forget(id.to_string())) {
            metrics::counter!("warmgate_task_journal_dropped_total").increment(1);
            tracing::warn!(task = %id, error = %e, "could not remove a refused task from the journal");
        }
    }

    /// A journaled task, as `GET /v1/tasks/{id}` shows it, and its owner.
    pub fn get(&self, id: &str) -> Option<(Value, Option<String>)> {
        read_task(&self.read, id, &self.run)
    }

    /// [`Journal::get`] on the blocking pool: a read that waits on the
    /// disk (or on a checkpoint of the WAL) never stalls a runtime thread
    /// and the requests on it.
    pub async fn find(&self, id: &str) -> Option<(Value, Option<String>)> {
        let _turn = self.readers.acquire().await.ok()?;
        let (read, id, run) = (self.read.clone(), id.to_string(), self.run.clone());
        tokio::task::spawn_blocking(move || read_task(&read, &id, &run))
            .await
            .ok()
            .flatten()
    }
}

fn read_task(read: &Mutex<Connection>, id: &str, run: &str) -> Option<(Value, Option<String>)> {
    let conn = read.lock();
    let row: Option<(String, Option<String>, Option<String>)> = conn
        .query_row(
            "SELECT body, owner, run FROM tasks WHERE id = ?1",
            params![id],
            |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
        )
        .optional()
        .ok()
        .flatten();
    let (body, owner, written_by) = row?;
    let mut v: Value = serde_json::from_str(&body).ok()?;
    if v.get("output_dropped").is_some() {
        // Say truthfully why the output is not here: the same run dropped
        // its copy in memory to keep within the result budget; another
        // run means the gateway restarted.
        let restarted = written_by.as_deref() != Some(run);
        let (cause, why) = if restarted {
            (
                "gateway_restarted",
                format!(
                    "the output was larger than {MAX_KEPT_OUTPUT} bytes, which the journal does not keep, and the gateway restarted since the task ended"
                ),
            )
        } else {
            (
                "result_budget",
                format!(
                    "the output was larger than {MAX_KEPT_OUTPUT} bytes, which the journal does not keep, and its copy in memory was dropped to keep finished results within limits.max_task_results_bytes (the owner's fair share of it)"
                ),
            )
        };
        v["output_dropped"] = Value::String(why);
        v["output_dropped_cause"] = Value::String(cause.into());
    }
    Some((v, owner))
}

/// Adds the `run` column to a journal made before it existed.
fn add_run_column(conn: &Connection) -> rusqlite::Result<()> {
    let has: bool = conn
        .prepare("SELECT 1 FROM pragma_table_info('tasks') WHERE name = 'run'")?
        .exists([])?;
    if !has {
        conn.execute_batch("ALTER TABLE tasks ADD COLUMN run TEXT")?;
    }
    Ok(())
}

/// 16 random bytes in hex, naming this run.
fn run_id() -> String {
    let mut bytes = [0u8; 16];
    if getrandom::fill(&mut bytes).is_err() {
        // Distinct enough from any earlier run.
        return format!("t{}", now());
    }
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn connect(path: &Path) -> rusqlite::Result<Connection> {
    let conn = Connection::open(path)?;
    conn.pragma_update(None, "journal_mode", "WAL")?;
    conn.pragma_update(None, "synchronous", "NORMAL")?;
    conn.busy_timeout(std::time::Duration::from_secs(5))?;
    Ok(conn)
}

fn now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// The record as it is kept: the output dropped when too large. The
/// output's text is copied as it is, never parsed.
fn body_of(record: &TaskRecord) -> String {
    let big = record
        .output
        .as_ref()
        .is_some_and(|o| o.get().len() > MAX_KEPT_OUTPUT);
    if !big {
        return serde_json::to_string(record).unwrap_or_else(|_| "null".into());
    }
    let mut small = record.clone();
    small.output = None;
    let mut v = serde_json::to_value(&small).unwrap_or(Value::Null);
    // Read back, this says why the output is missing (`read_task`).
    v["output_dropped"] = Value::String(format!(
        "the output was larger than {MAX_KEPT_OUTPUT} bytes and is not journaled"
    ));
    v.to_string()
}

/// Marks the tasks a crashed run left pending or running as failed.
fn fail_unfinished(conn: &Connection) -> rusqlite::Result<u64> {
    let mut stmt =
        conn.prepare("SELECT id, body FROM tasks WHERE state IN ('pending', 'running')")?;
    let rows: Vec<(String, String)> = stmt
        .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))?
        .collect::<rusqlite::Result<_>>()?;
    let tx = conn.unchecked_transaction()?;
    for (id, body) in &rows {
        let mut v: Value = serde_json::from_str(body).unwrap_or(Value::Null);
        v["state"] = Value::String("failed".into());
        v["error"] = serde_json::json!({
            "kind": "gateway_restarted",
            "message": "the gateway stopped before this task finished; submit it again",
        });
        tx.execute(
            "UPDATE tasks SET state = 'failed', at = ?2, body = ?3 WHERE id = ?1",
            params![id, now(), v.to_string()],
        )?;
    }
    tx.commit()?;
    Ok(rows.len() as u64)
}

/// Drops the oldest rows past [`KEEP`] rows, and rows past `max_bytes` of
/// bodies shared fairly: each row is ranked by the bytes its owner's
/// newer rows and itself hold (`k`), rows are kept in order of that rank
/// while they fit, so the rows dropped are the oldest of whichever owners
/// hold the most (with one owner: its oldest, as before).
fn prune(conn: &Connection, max_bytes: u64) -> rusqlite::Result<()> {
    conn.execute(
        "DELETE FROM tasks WHERE id IN (SELECT id FROM tasks ORDER BY at DESC LIMIT -1 OFFSET ?1)",
        params![KEEP],
    )?;
    conn.execute(
        "DELETE FROM tasks WHERE id IN (SELECT id FROM ( \
           SELECT id, SUM(n) OVER (ORDER BY k, at DESC, r DESC ROWS UNBOUNDED PRECEDING) AS kept FROM ( \
             SELECT id, at, rowid AS r, length(body) AS n, SUM(length(body)) OVER ( \
               PARTITION BY owner ORDER BY at DESC, rowid DESC ROWS UNBOUNDED PRECEDING) AS k \
             FROM tasks)) \
         WHERE kept > ?1)",
        params![i64::try_from(max_bytes).unwrap_or(i64::MAX)],
    )?;
    Ok(())
}

/// Bytes an operation adds to the journal, about.
fn op_bytes(op: &Op) -> u64 {
    match op {
        Op::Accept { record, .. } | Op::End(record) => {
            record.output.as_ref().map_or(0, |o| o.get().len()) as u64 + 256
        }
        Op::Forget(_) => 0,
    }
}

fn writer(mut conn: Connection, rx: Receiver<Op>, max_bytes: u64, run: &str) {
    let mut since_prune = 0usize;
    let mut bytes_since_prune = 0u64;
    while let Ok(first) = rx.recv() {
        let mut ops = vec![first];
        while ops.len() < BATCH {
            match rx.try_recv() {
                Ok(op) => ops.push(op),
                Err(_) => break,
            }
        }
        since_prune += ops.len();
        bytes_since_prune += ops.iter().map(op_bytes).sum::<u64>();
        let result = commit(&mut conn, &ops, run);
        if let Err(e) = &result {
            tracing::error!(error = %e, "the task journal could not commit");
        }
        for op in ops {
            if let Op::Accept { ack, .. } = op {
                let _ = ack.send(result.clone().map_err(|e| e.to_string()));
            }
        }
        if since_prune >= KEEP as usize / 10 || bytes_since_prune >= max_bytes / 10 {
            since_prune = 0;
            bytes_since_prune = 0;
            if let Err(e) = prune(&conn, max_bytes) {
                tracing::warn!(error = %e, "could not prune the task journal");
            }
        }
    }
}

fn commit(conn: &mut Connection, ops: &[Op], run: &str) -> Result<(), String> {
    let tx = conn.transaction().map_err(|e| e.to_string())?;
    for op in ops {
        // An end may overtake its accept (a task can end before the
        // submitter's write is queued): the accept then leaves it alone.
        if let Op::Forget(id) = op {
            tx.execute("DELETE FROM tasks WHERE id = ?1", params![id])
                .map_err(|e| e.to_string())?;
            continue;
        }
        let (sql, record) = match op {
            Op::Accept { record, .. } => (
                "INSERT OR IGNORE INTO tasks (id, owner, state, at, body, run) VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
                record,
            ),
            Op::End(record) => (
                "INSERT OR REPLACE INTO tasks (id, owner, state, at, body, run) VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
                record,
            ),
            Op::Forget(_) => continue,
        };
        tx.execute(
            sql,
            params![
                record.id,
                record.owner,
                record.state.as_str(),
                now(),
                body_of(record),
                run
            ],
        )
        .map_err(|e| e.to_string())?;
    }
    tx.commit().map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tasks::record::TaskState;

    fn record(id: &str, state: TaskState) -> TaskRecord {
        TaskRecord {
            id: id.into(),
            pool: "p".into(),
            state,
            output: (state == TaskState::Succeeded)
                .then(|| crate::tasks::record::Output::parse(br#"{"x": 1}"#).expect("json")),
            error: None,
            attempts: 1,
            replica: None,
            weights_version: None,
            owner: Some("alpha".into()),
            durable: true,
        }
    }

    #[tokio::test]
    async fn unfinished_tasks_fail_on_reopen_and_ended_ones_read_back() {
        let dir = tempfile::tempdir().expect("dir");
        let path = dir.path().join("state.db");
        {
            let (j, rec) = Journal::open(&path, u64::MAX).expect("open");
            assert_eq!(rec.failed, 0);
            j.accept(&record("a", TaskState::Pending))
                .await
                .expect("accept a");
            // b ends before its accept is written: the accept must not undo it.
            j.end(&record("b", TaskState::Succeeded));
            j.accept(&record("b", TaskState::Pending))
                .await
                .expect("accept b");
            let (b, owner) = j.get("b").expect("b");
            assert_eq!(b["state"], "succeeded");
            assert_eq!(owner.as_deref(), Some("alpha"));
        }
        let (j, rec) = Journal::open(&path, u64::MAX).expect("reopen");
        assert_eq!(rec.failed, 1, "a was never finished");
        let (a, _) = j.get("a").expect("a");
        assert_eq!(a["state"], "failed");
        assert_eq!(a["error"]["kind"], "gateway_restarted");
        assert_eq!(j.get("b").expect("b").0["output"]["x"], 1);
        assert!(j.get("c").is_none());
    }

    #[tokio::test]
    async fn the_journal_is_kept_within_its_bytes_oldest_first() {
        const MAX: u64 = 20_000;
        let dir = tempfile::tempdir().expect("dir");
        let path = dir.path().join("state.db");
        let (j, _) = Journal::open(&path, MAX).expect("open");
        let big = format!("\"{}\"", "x".repeat(1000));
        for i in 0..100 {
            let mut r = record(&format!("t{i}"), TaskState::Succeeded);
            r.output = Some(crate::tasks::record::Output::parse(big.as_bytes()).expect("json"));
            j.end(&r);
        }
        // The writer works in order: once two later accepts are committed,
        // the prune after the ends' batch has run.
        for id in ["sync-1", "sync-2"] {
            j.accept(&record(id, TaskState::Pending))
                .await
                .expect("accept");
        }
        let conn = connect(&path).expect("connect");
        let (rows, bytes): (i64, i64) = conn
            .query_row(
                "SELECT COUNT(*), COALESCE(SUM(length(body)), 0) FROM tasks",
                [],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .expect("count");
        assert!(bytes as u64 <= MAX + 2_000, "{rows} rows, {bytes} bytes");
        assert!(rows < 100, "{rows} rows, {bytes} bytes");
        assert!(j.get("t99").is_some(), "the newest is kept");
        assert!(j.get("t0").is_none(), "the oldest went first");
    }

    #[tokio::test]
    async fn one_owner_s_flood_prunes_its_own_rows_before_another_s() {
        const MAX: u64 = 40_000;
        let dir = tempfile::tempdir().expect("dir");
        let path = dir.path().join("state.db");
        let (j, _) = Journal::open(&path, MAX).expect("open");
        let out = |n: usize| {
            crate::tasks::record::Output::parse(format!("\"{}\"", "x".repeat(n)).as_bytes())
                .expect("json")
        };
        let mut a = record("a-1", TaskState::Succeeded);
        a.output = Some(out(2_000));
        j.end(&a);
        for i in 0..200 {
            let mut r = record(&format!("b-{i}"), TaskState::Succeeded);
            r.owner = Some("beta".into());
            r.output = Some(out(1_000));
            j.end(&r);
        }
        for id in ["sync-1", "sync-2"] {
            j.accept(&record(id, TaskState::Pending))
                .await
                .expect("accept");
        }
        assert!(
            j.get("a-1").is_some(),
            "alpha's one result survived beta's flood"
        );
        assert!(j.get("b-199").is_some() && j.get("b-0").is_none());
    }

    #[tokio::test]
    async fn a_dropped_output_says_whether_the_budget_or_a_restart_dropped_it() {
        let dir = tempfile::tempdir().expect("dir");
        let path = dir.path().join("state.db");
        let big = format!("\"{}\"", "x".repeat(MAX_KEPT_OUTPUT + 1));
        {
            let (j, _) = Journal::open(&path, u64::MAX).expect("open");
            let mut r = record("big", TaskState::Succeeded);
            r.output = Some(crate::tasks::record::Output::parse(big.as_bytes()).expect("json"));
            j.end(&r);
            j.accept(&record("sync", TaskState::Pending))
                .await
                .expect("accept");
            let (v, _) = j.get("big").expect("big");
            assert!(v["output"].is_null());
            assert_eq!(v["output_dropped_cause"], "result_budget", "{v}");
            assert!(
                !v["output_dropped"]
                    .as_str()
                    .unwrap_or("")
                    .contains("restarted")
            );
        }
        let (j, _) = Journal::open(&path, u64::MAX).expect("reopen");
        let (v, _) = j.get("big").expect("big");
        assert_eq!(v["output_dropped_cause"], "gateway_restarted", "{v}");
    }

    #[test]
    fn a_journal_made_before_the_run_column_gains_it() {
        let dir = tempfile::tempdir().expect("dir");
        let path = dir.path().join("state.db");
        let conn = connect(&path).expect("connect");
        conn.execute_batch(
            "CREATE TABLE tasks (id TEXT PRIMARY KEY, owner TEXT, state TEXT NOT NULL, at REAL NOT NULL, body TEXT NOT NULL);
             INSERT INTO tasks VALUES ('old', NULL, 'succeeded', 1.0, '{\"id\":\"old\",\"state\":\"succeeded\"}');",
        )
        .expect("old schema");
        drop(conn);
        let (j, _) = Journal::open(&path, u64::MAX).expect("open");
        assert_eq!(j.get("old").expect("old").0["state"], "succeeded");
    }
}
