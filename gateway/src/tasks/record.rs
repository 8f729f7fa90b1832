//! A task's record as clients read it back: its state, its output kept as
//! the JSON text the worker sent, and who may read it. Shared by the pools
//! that run tasks and the journal that keeps async ones.

use std::sync::Arc;

use serde::Serialize;
use serde_json::Value;
use serde_json::value::RawValue;

/// A task's lifecycle state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum TaskState {
    /// Waiting in the queue.
    Pending,
    /// On a replica.
    Running,
    /// Done, with an output.
    Succeeded,
    /// Done, with an error.
    Failed,
    /// Cancelled before it finished: never run, or its run dropped.
    Cancelled,
}

impl TaskState {
    /// As the API and the journal write it.
    pub fn as_str(self) -> &'static str {
        match self {
            TaskState::Pending => "pending",
            TaskState::Running => "running",
            TaskState::Succeeded => "succeeded",
            TaskState::Failed => "failed",
            TaskState::Cancelled => "cancelled",
        }
    }

    /// Whether the task has ended (succeeded, failed or cancelled).
    pub fn ended(self) -> bool {
        !matches!(self, TaskState::Pending | TaskState::Running)
    }
}

/// What `GET /v1/tasks/{id}` shows.
#[derive(Debug, Clone, Serialize)]
pub struct TaskRecord {
    /// Task id.
    pub id: String,
    /// Pool.
    pub pool: String,
    /// State.
    pub state: TaskState,
    /// The worker's answer, once succeeded.
    pub output: Option<Output>,
    /// Why it failed, once failed.
    pub error: Option<Value>,
    /// Attempts made.
    pub attempts: u32,
    /// The replica of the last attempt.
    pub replica: Option<String>,
    /// Its weights version.
    pub weights_version: Option<u64>,
    /// The tenant whose API key submitted it, when keys are configured:
    /// only that tenant may read it back.
    #[serde(skip)]
    pub owner: Option<String>,
    /// Submitted with `?async=true`: its end goes to the journal.
    #[serde(skip)]
    pub durable: bool,
}

/// A worker's JSON answer, kept as the text it sent: never expanded into
/// a tree of values, so it costs its size in memory, and shared by the
/// copies of its record.
#[derive(Debug, Clone)]
pub struct Output(Arc<RawValue>);

impl Output {
    /// Checks that `body` is one JSON value and keeps its text.
    pub fn parse(body: &[u8]) -> serde_json::Result<Output> {
        let raw: Box<RawValue> = serde_json::from_slice(body)?;
        Ok(Output(Arc::from(raw)))
    }

    /// The JSON text.
    pub fn get(&self) -> &str {
        self.0.get()
    }
}

impl Serialize for Output {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.0.serialize(s)
    }
}
