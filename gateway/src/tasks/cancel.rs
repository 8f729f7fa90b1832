//! Cancelling a task by its id, as a caller asks it: who may (a tenant
//! only its own; another's reads as unknown, so ids cannot be probed),
//! what it was (queued or running), and what it became.

use std::sync::Arc;
use std::time::Duration;

use serde_json::{Value, json};

use super::pool::{Cancelled, Pool, TaskState};
use super::store::TaskStore;
use crate::error::{Error, ErrorKind};

/// How long a cancel waits for a running task's end to be recorded: its
/// attempt is dropped at once, so this is only a bound.
const CANCEL_WAIT: Duration = Duration::from_secs(10);

/// Cancels task `id` for `caller` (a tenant's name; `None` for the admin)
/// in the pool `pool_of` names: its record, `state: cancelled` (or
/// `cancelling` if its end was not recorded within [`CANCEL_WAIT`]) and
/// `cancelled: queued | running`. `404` for an unknown task or another
/// tenant's; `409` for one that ended otherwise, or whose pool was deleted.
pub async fn cancel_task(
    store: &TaskStore,
    pool_of: impl FnOnce(&str) -> Option<Arc<Pool>>,
    id: &str,
    caller: Option<&str>,
) -> Result<Value, Error> {
    let not_found = || Error::new(ErrorKind::NotFound, format!("task '{id}' not found"));
    let mine = |owner: Option<&str>| caller.is_none() || owner == caller;
    let Some(record) = store.get(id) else {
        // Ended before this gateway started, or evicted: it cannot be
        // cancelled, but say how it ended.
        let j = store.journal().ok_or_else(not_found)?;
        let (v, owner) = j.find(id).await.ok_or_else(not_found)?;
        if !mine(owner.as_deref()) {
            return Err(not_found());
        }
        return Err(ended(id, v["state"].as_str().unwrap_or("ended")));
    };
    if !mine(record.owner.as_deref()) {
        return Err(not_found());
    }
    let pool = pool_of(&record.pool);
    let Some((was, ended_as)) = pool.as_ref().and_then(|p| p.cancel(id)) else {
        if pool.is_none() {
            return Err(Error::new(
                ErrorKind::Conflict,
                format!(
                    "task '{id}' belongs to pool '{}', which was deleted",
                    record.pool
                ),
            ));
        }
        let now = store.get(id).unwrap_or(record);
        return match now.state {
            TaskState::Cancelled => Ok(serde_json::to_value(&now).unwrap_or_default()),
            s => Err(ended(id, s.as_str())),
        };
    };
    let state = ended_as.wait(CANCEL_WAIT).await;
    // An async task's record stays to be read; a waiting client's went to
    // that client: say what became of it.
    let mut body = match store.get(id) {
        Some(now) => serde_json::to_value(&now).unwrap_or_default(),
        None => json!({"id": id, "pool": record.pool}),
    };
    body["state"] = json!(state.map_or("cancelling", TaskState::as_str));
    body["cancelled"] = json!(match was {
        Cancelled::Queued => "queued",
        Cancelled::Running => "running",
    });
    Ok(body)
}

/// `409`: task `id` ended (`state`) before it could be cancelled.
fn ended(id: &str, state: &str) -> Error {
    Error::new(
        ErrorKind::Conflict,
        format!(
            "task '{id}' already ended ({state}); only a task pending or running can be cancelled"
        ),
    )
}
