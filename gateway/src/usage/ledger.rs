//! The usage ledger: tokens per tenant, app and model, in hour buckets,
//! kept in `state.db` within a byte budget.
//!
//! The request path adds to in-memory counters only; they are written to
//! the database every [`FLUSH_EVERY`], before each query, and at an
//! orderly stop (a `kill -9` loses at most the last interval's counts).
//! The oldest hours go first when the table passes its budget.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use parking_lot::{Mutex, RwLock};
use rusqlite::{Connection, params};
use serde::Serialize;

use super::scan::Tokens;

/// How often the counters are written to the database.
pub const FLUSH_EVERY: Duration = Duration::from_secs(2);

/// The length of a bucket in the database: an hour.
pub const BUCKET_SECS: i64 = 3600;

/// What a row costs in the budget besides its three names: the bucket,
/// five counts and SQLite's row and index overhead.
const ROW_OVERHEAD_BYTES: i64 = 96;

/// The most rows one query returns.
pub const MAX_ROWS: usize = 10_000;

/// Who used the tokens: a tenant (`-` without one), an app, and the model
/// the request named (the app, or one of its adapters).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct UsageKey {
    /// The tenant's name, `-` for a request without one.
    pub tenant: Arc<str>,
    /// The app's name.
    pub app: Arc<str>,
    /// The app's name, or the adapter's.
    pub model: Arc<str>,
}

/// Counts one key gathered since the last flush.
#[derive(Debug, Default)]
struct Pending {
    requests: AtomicU64,
    without_usage: AtomicU64,
    prompt: AtomicU64,
    cached: AtomicU64,
    completion: AtomicU64,
}

/// A key's live counters: what to write next, and its metric series.
#[derive(Debug)]
pub struct Cell {
    pending: Pending,
    metrics: [metrics::Counter; 4],
}

impl Cell {
    fn new(key: &UsageKey) -> Self {
        let series = |kind: &'static str| {
            metrics::counter!(
                "warmgate_tokens_total",
                "tenant" => key.tenant.to_string(),
                "app" => key.app.to_string(),
                "model" => key.model.to_string(),
                "kind" => kind
            )
        };
        Cell {
            pending: Pending::default(),
            metrics: [
                series("prompt"),
                series("cached"),
                series("completion"),
                metrics::counter!(
                    "warmgate_answers_without_usage_total",
                    "tenant" => key.tenant.to_string(),
                    "app" => key.app.to_string(),
                    "model" => key.model.to_string()
                ),
            ],
        }
    }

    /// One answer's usage, or its absence.
    pub fn add(&self, tokens: Option<Tokens>) {
        let p = &self.pending;
        p.requests.fetch_add(1, Ordering::Relaxed);
        match tokens {
            Some(t) => {
                p.prompt.fetch_add(t.prompt, Ordering::Relaxed);
                p.cached.fetch_add(t.cached, Ordering::Relaxed);
                p.completion.fetch_add(t.completion, Ordering::Relaxed);
                self.metrics[0].increment(t.prompt);
                self.metrics[1].increment(t.cached);
                self.metrics[2].increment(t.completion);
            }
            None => {
                p.without_usage.fetch_add(1, Ordering::Relaxed);
                self.metrics[3].increment(1);
            }
        }
    }

    fn take(&self) -> [u64; 5] {
        let p = &self.pending;
        [
            p.requests.swap(0, Ordering::Relaxed),
            p.without_usage.swap(0, Ordering::Relaxed),
            p.prompt.swap(0, Ordering::Relaxed),
            p.cached.swap(0, Ordering::Relaxed),
            p.completion.swap(0, Ordering::Relaxed),
        ]
    }

    fn give_back(&self, counts: [u64; 5]) {
        let p = &self.pending;
        for (a, n) in [
            &p.requests,
            &p.without_usage,
            &p.prompt,
            &p.cached,
            &p.completion,
        ]
        .into_iter()
        .zip(counts)
        {
            a.fetch_add(n, Ordering::Relaxed);
        }
    }
}

/// The ledger: live counters by key, and the table they are written to.
pub struct Ledger {
    cells: RwLock<HashMap<UsageKey, Arc<Cell>>>,
    db: Mutex<Connection>,
    max_bytes: u64,
}

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS usage (
    bucket INTEGER NOT NULL,
    tenant TEXT NOT NULL,
    app TEXT NOT NULL,
    model TEXT NOT NULL,
    requests INTEGER NOT NULL,
    without_usage INTEGER NOT NULL,
    prompt INTEGER NOT NULL,
    cached INTEGER NOT NULL,
    completion INTEGER NOT NULL,
    PRIMARY KEY (bucket, tenant, app, model)
) WITHOUT ROWID;
";

impl Ledger {
    /// The ledger in the SQLite file at `path`, kept within `max_bytes`.
    pub fn open(path: &Path, max_bytes: u64) -> rusqlite::Result<Ledger> {
        let conn = Connection::open(path)?;
        conn.pragma_update(None, "journal_mode", "WAL")?;
        conn.pragma_update(None, "synchronous", "NORMAL")?;
        conn.busy_timeout(Duration::from_secs(5))?;
        conn.execute_batch(SCHEMA)?;
        Ok(Ledger {
            cells: RwLock::default(),
            db: Mutex::new(conn),
            max_bytes,
        })
    }

    /// The live counters of `key`, made on its first use.
    pub fn cell(&self, key: &UsageKey) -> Arc<Cell> {
        if let Some(c) = self.cells.read().get(key) {
            return c.clone();
        }
        self.cells
            .write()
            .entry(key.clone())
            .or_insert_with(|| Arc::new(Cell::new(key)))
            .clone()
    }

    /// Writes what the counters gathered into the bucket of `now` (seconds
    /// since the epoch), then drops the oldest hours past the budget. On a
    /// failed write the counts stay to be written next time.
    pub fn flush_at(&self, now: i64) -> rusqlite::Result<()> {
        let bucket = now - now.rem_euclid(BUCKET_SECS);
        let cells: Vec<(UsageKey, Arc<Cell>)> = self
            .cells
            .read()
            .iter()
            .map(|(k, c)| (k.clone(), c.clone()))
            .collect();
        let mut db = self.db.lock();
        let taken: Vec<(UsageKey, Arc<Cell>, [u64; 5])> = cells
            .into_iter()
            .map(|(k, c)| {
                let counts = c.take();
                (k, c, counts)
            })
            .filter(|(_, _, n)| n[0] > 0)
            .collect();
        if taken.is_empty() {
            return Ok(());
        }
        let written = (|| {
            let tx = db.transaction()?;
            {
                let mut up = tx.prepare_cached(
                    "INSERT INTO usage (bucket, tenant, app, model, requests, without_usage, prompt, cached, completion)
                     VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)
                     ON CONFLICT (bucket, tenant, app, model) DO UPDATE SET
                       requests = requests + excluded.requests,
                       without_usage = without_usage + excluded.without_usage,
                       prompt = prompt + excluded.prompt,
                       cached = cached + excluded.cached,
                       completion = completion + excluded.completion",
                )?;
                for (k, _, n) in &taken {
                    up.execute(params![
                        bucket,
                        &*k.tenant,
                        &*k.app,
                        &*k.model,
                        n[0] as i64,
                        n[1] as i64,
                        n[2] as i64,
                        n[3] as i64,
                        n[4] as i64
                    ])?;
                }
            }
            prune(&tx, self.max_bytes)?;
            tx.commit()
        })();
        if written.is_err() {
            for (_, c, n) in &taken {
                c.give_back(*n);
            }
        }
        written
    }

    /// [`Ledger::flush_at`] now.
    pub fn flush(&self) -> rusqlite::Result<()> {
        self.flush_at(unix_now())
    }

    /// The rows `q` asks for, after a flush.
    pub fn query(&self, q: &Query) -> rusqlite::Result<Report> {
        self.flush()?;
        let db = self.db.lock();
        let span = q.bucket.secs();
        let mut cols = vec![match span {
            Some(s) => format!("(bucket / {s}) * {s}"),
            None => "NULL".to_string(),
        }];
        for d in Dim::ALL {
            cols.push(if q.group_by.contains(&d) {
                d.column().to_string()
            } else {
                "NULL".to_string()
            });
        }
        let group: Vec<String> = (1..=cols.len()).map(|i| i.to_string()).collect();
        let sql = format!(
            "SELECT {}, SUM(requests), SUM(without_usage), SUM(prompt), SUM(cached), SUM(completion)
             FROM usage
             WHERE bucket >= ?1 AND bucket < ?2
               AND (?3 IS NULL OR tenant = ?3) AND (?4 IS NULL OR app = ?4) AND (?5 IS NULL OR model = ?5)
             GROUP BY {} ORDER BY {} LIMIT {}",
            cols.join(", "),
            group.join(", "),
            group.join(", "),
            MAX_ROWS + 1
        );
        let mut stmt = db.prepare(&sql)?;
        let since = q.since - q.since.rem_euclid(BUCKET_SECS);
        let mut rows: Vec<Row> = stmt
            .query_map(params![since, q.until, q.tenant, q.app, q.model], |r| {
                Ok(Row {
                    start: r.get::<_, Option<i64>>(0)?.map(rfc3339),
                    tenant: r.get(1)?,
                    app: r.get(2)?,
                    model: r.get(3)?,
                    requests: r.get::<_, i64>(4)? as u64,
                    requests_without_usage: r.get::<_, i64>(5)? as u64,
                    prompt_tokens: r.get::<_, i64>(6)? as u64,
                    cached_tokens: r.get::<_, i64>(7)? as u64,
                    completion_tokens: r.get::<_, i64>(8)? as u64,
                    total_tokens: (r.get::<_, i64>(6)? + r.get::<_, i64>(8)?) as u64,
                })
            })?
            .collect::<rusqlite::Result<_>>()?;
        let truncated = rows.len() > MAX_ROWS;
        rows.truncate(MAX_ROWS);
        Ok(Report {
            since: rfc3339(since),
            until: rfc3339(q.until),
            bucket: q.bucket,
            data: rows,
            truncated,
        })
    }
}

/// Drops the oldest hours while the table's estimated size is over
/// `max_bytes`.
fn prune(tx: &rusqlite::Transaction<'_>, max_bytes: u64) -> rusqlite::Result<()> {
    let size = |tx: &rusqlite::Transaction<'_>| -> rusqlite::Result<i64> {
        tx.query_row(
            "SELECT COALESCE(SUM(length(tenant) + length(app) + length(model) + ?1), 0) FROM usage",
            [ROW_OVERHEAD_BYTES],
            |r| r.get(0),
        )
    };
    let max = i64::try_from(max_bytes).unwrap_or(i64::MAX);
    while size(tx)? > max {
        let dropped = tx.execute(
            "DELETE FROM usage WHERE bucket = (SELECT MIN(bucket) FROM usage)",
            [],
        )?;
        if dropped == 0 {
            break;
        }
        metrics::counter!("warmgate_usage_hours_dropped_total").increment(1);
    }
    Ok(())
}

/// Seconds since the epoch.
pub fn unix_now() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64)
}

fn rfc3339(secs: i64) -> String {
    /// 9999-12-31T23:59:59Z, the last time RFC 3339 can write.
    const LAST: i64 = 253_402_300_799;
    let t = UNIX_EPOCH + Duration::from_secs(secs.clamp(0, LAST) as u64);
    humantime::format_rfc3339_seconds(t).to_string()
}

/// What a row is grouped by.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dim {
    /// The tenant.
    Tenant,
    /// The app.
    App,
    /// The model the request named.
    Model,
}

impl Dim {
    /// In the order of the table's columns.
    pub const ALL: [Dim; 3] = [Dim::Tenant, Dim::App, Dim::Model];

    fn column(self) -> &'static str {
        match self {
            Dim::Tenant => "tenant",
            Dim::App => "app",
            Dim::Model => "model",
        }
    }

    /// The dimension named `s`.
    pub fn parse(s: &str) -> Option<Dim> {
        Dim::ALL.into_iter().find(|d| d.column() == s)
    }
}

/// How rows are split in time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Bucket {
    /// An hour a row.
    Hour,
    /// A day (UTC) a row.
    Day,
    /// One row for the whole span.
    Total,
}

impl Bucket {
    fn secs(self) -> Option<i64> {
        match self {
            Bucket::Hour => Some(BUCKET_SECS),
            Bucket::Day => Some(24 * BUCKET_SECS),
            Bucket::Total => None,
        }
    }

    /// The bucket named `s`.
    pub fn parse(s: &str) -> Option<Bucket> {
        match s {
            "hour" => Some(Bucket::Hour),
            "day" => Some(Bucket::Day),
            "total" => Some(Bucket::Total),
            _ => None,
        }
    }
}

/// A question to the ledger.
#[derive(Debug, Clone)]
pub struct Query {
    /// From (seconds since the epoch; counted from the start of its hour).
    pub since: i64,
    /// To (exclusive).
    pub until: i64,
    /// Rows by time.
    pub bucket: Bucket,
    /// Rows by these.
    pub group_by: Vec<Dim>,
    /// Only this tenant's.
    pub tenant: Option<String>,
    /// Only this app's.
    pub app: Option<String>,
    /// Only this model's.
    pub model: Option<String>,
}

/// The ledger's answer.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct Report {
    /// The start of the first hour counted (RFC 3339).
    pub since: String,
    /// The end (exclusive).
    pub until: String,
    /// How rows are split in time.
    #[schema(value_type = String)]
    pub bucket: Bucket,
    /// The rows, oldest first.
    pub data: Vec<Row>,
    /// More rows matched than [`MAX_ROWS`].
    pub truncated: bool,
}

/// Usage in one bucket, for one group.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, utoipa::ToSchema)]
pub struct Row {
    /// The bucket's start (RFC 3339); absent with `bucket=total`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub start: Option<String>,
    /// The tenant (`-`: none), when grouped by tenant.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
    /// The app, when grouped by app.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub app: Option<String>,
    /// The model (the app or an adapter), when grouped by model.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// Answers counted.
    pub requests: u64,
    /// Of those, answers that carried no usage (their tokens are not in
    /// the sums).
    pub requests_without_usage: u64,
    /// Prompt tokens, cached ones included.
    pub prompt_tokens: u64,
    /// Prompt tokens the engines' prefix caches held.
    pub cached_tokens: u64,
    /// Completion tokens.
    pub completion_tokens: u64,
    /// Prompt and completion tokens.
    pub total_tokens: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(t: &str, a: &str, m: &str) -> UsageKey {
        UsageKey {
            tenant: t.into(),
            app: a.into(),
            model: m.into(),
        }
    }

    fn all(bucket: Bucket, group_by: Vec<Dim>) -> Query {
        Query {
            since: 0,
            until: i64::MAX,
            bucket,
            group_by,
            tenant: None,
            app: None,
            model: None,
        }
    }

    const T: Tokens = Tokens {
        prompt: 10,
        cached: 4,
        completion: 3,
    };

    #[test]
    fn counts_are_kept_across_a_reopen_and_grouped_as_asked() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state.db");
        {
            let l = Ledger::open(&path, 1 << 20).unwrap();
            l.cell(&key("a", "llm", "llm")).add(Some(T));
            l.cell(&key("a", "llm", "sql")).add(Some(T));
            l.cell(&key("b", "llm", "llm")).add(None);
            l.flush_at(7200 + 5).unwrap();
            l.cell(&key("a", "llm", "llm")).add(Some(T));
            l.flush_at(3 * 3600 + 1).unwrap();
        }
        let l = Ledger::open(&path, 1 << 20).unwrap();
        let r = l.query(&all(Bucket::Total, vec![Dim::Tenant])).unwrap();
        assert_eq!(r.data.len(), 2);
        let a = &r.data[0];
        assert_eq!(a.tenant.as_deref(), Some("a"));
        assert_eq!(
            (
                a.requests,
                a.prompt_tokens,
                a.cached_tokens,
                a.completion_tokens
            ),
            (3, 30, 12, 9)
        );
        assert_eq!(a.total_tokens, 39);
        let b = &r.data[1];
        assert_eq!(
            (b.requests, b.requests_without_usage, b.prompt_tokens),
            (1, 1, 0)
        );
        let hours = l.query(&all(Bucket::Hour, vec![])).unwrap();
        assert_eq!(hours.data.len(), 2, "{hours:?}");
        assert_eq!(hours.data[0].start.as_deref(), Some("1970-01-01T02:00:00Z"));
        assert_eq!(hours.data[0].requests, 3);
        let mut only = all(Bucket::Total, vec![Dim::Model]);
        only.model = Some("sql".into());
        let sql = l.query(&only).unwrap();
        assert_eq!(sql.data.len(), 1);
        assert_eq!(sql.data[0].prompt_tokens, 10);
    }

    #[test]
    fn the_oldest_hours_go_past_the_budget() {
        let dir = tempfile::tempdir().unwrap();
        // Room for about two rows.
        let l = Ledger::open(&dir.path().join("state.db"), 230).unwrap();
        for hour in 0..5 {
            l.cell(&key("t", "app", "model")).add(Some(T));
            l.flush_at(hour * 3600).unwrap();
        }
        let r = l.query(&all(Bucket::Hour, vec![])).unwrap();
        let starts: Vec<_> = r.data.iter().filter_map(|r| r.start.clone()).collect();
        assert_eq!(starts, ["1970-01-01T03:00:00Z", "1970-01-01T04:00:00Z"]);
    }
}
