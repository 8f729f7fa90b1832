//! Pool tasks: submission (one, async, or a batch), results, and weight
//! syncs.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Path, Request, State};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use futures_util::{FutureExt as _, StreamExt as _};
use http::{HeaderValue, StatusCode, header};
use serde_json::json;

use super::ErrorBody;
use super::body::{
    BodyLimit, Scalar, duration_value, max_unavailable, parse_json, read_body_within,
};
use crate::error::{Error, ErrorKind};
use crate::server::Gateway;
use crate::tasks::ordered::Ordered;
use crate::tenants::Tenant;

/// The pool named in the path, the request's headers, and its body, read
/// within the `which` limit (parse it with [`parse_json`]).
pub(crate) async fn pool_request(
    gw: &Gateway,
    name: &str,
    req: Request,
    which: BodyLimit,
) -> Result<(Arc<crate::tasks::pool::Pool>, http::HeaderMap, Bytes), Error> {
    let pool = gw
        .registry
        .load()
        .pool(name)
        .cloned()
        .ok_or_else(|| Error::new(ErrorKind::NotFound, format!("pool '{name}' not found")))?;
    let (parts, bytes) = read_body_within(req, gw, which).await?;
    Ok((pool, parts.headers, bytes))
}

/// A task submission. The input is kept as the client's text (validated,
/// never built into values) and sent to the worker as it is.
#[derive(serde::Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct TaskBody<'a> {
    #[serde(borrow)]
    #[schema(value_type = Object)]
    pub(crate) input: &'a serde_json::value::RawValue,
    pub(crate) priority: Option<i32>,
    #[serde(borrow, default)]
    #[schema(value_type = Option<Object>)]
    pub(crate) timeout: Scalar<'a>,
    pub(crate) retries: Option<u32>,
    pub(crate) min_weights_version: Option<u64>,
}

/// The query of `POST /v1/pools/{pool}/tasks`.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct TaskQuery {
    /// `async`: answer 202 with the id at once.
    pub(crate) is_async: bool,
}

impl TaskQuery {
    /// Reads `async` as clients write a flag (`true`, `1`, Python's
    /// `True`, …); other keys are left alone. A value that is no flag is a
    /// `400` in the error format, not the framework's plain text.
    pub(crate) fn parse(query: Option<&str>) -> Result<TaskQuery, Error> {
        let mut q = TaskQuery::default();
        for pair in query.unwrap_or("").split('&') {
            let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
            if key != "async" {
                continue;
            }
            let value = percent_encoding::percent_decode_str(value).decode_utf8_lossy();
            q.is_async = match value.to_ascii_lowercase().as_str() {
                "true" | "1" | "yes" | "on" | "" => true,
                "false" | "0" | "no" | "off" => false,
                other => {
                    return Err(Error::new(
                        ErrorKind::BadRequest,
                        format!(
                            "async={} is not a flag: give async=true or async=false",
                            other.chars().take(40).collect::<String>()
                        ),
                    ));
                }
            };
        }
        Ok(q)
    }
}

/// `POST /v1/pools/{pool}/tasks`: queue a task; wait for its output, or
/// answer 202 with its id when `?async=true`.
#[utoipa::path(post, path = "/v1/pools/{pool}/tasks", tag = "pools",
    params(("pool" = String, Path, description = "Pool name"), ("async" = Option<bool>, Query, description = "Answer 202 with the id at once")),
    request_body = TaskBody,
    responses((status = 200, description = "`{id, output, replica, weights_version, attempts}`", body = Object), (status = 202, description = "`{id}`", body = Object), (status = 409, description = "min_weights_version not synced", body = ErrorBody), (status = 429, description = "Queue full or tenant quota", body = ErrorBody), (status = 502, description = "Failed in the worker", body = ErrorBody), (status = 504, description = "Timed out", body = ErrorBody)))]
pub(crate) async fn submit_task(
    State(gw): State<Arc<Gateway>>,
    Path(name): Path<String>,
    axum::extract::RawQuery(query): axum::extract::RawQuery,
    req: Request,
) -> Result<Response, Error> {
    let q = TaskQuery::parse(query.as_deref())?;
    let tenant_key = req.extensions().get::<Arc<Tenant>>().cloned();
    let tenant_owner = tenant_key.as_ref().map(|t| t.name.clone());
    let (pool, headers, bytes) = pool_request(&gw, &name, req, BodyLimit::Task).await?;
    let body: TaskBody<'_> = parse_json(
        &bytes,
        "{\"input\": …, \"priority\"?, \"timeout\"?, \"retries\"?, \"min_weights_version\"?}",
    )?;
    let (priority, tenant, timeout) = task_options(&headers, body.priority, &body.timeout)?;
    let priority = tenant_key
        .as_ref()
        .map_or(priority, |t| t.priority(priority));
    let input = Bytes::copy_from_slice(body.input.get().as_bytes());
    let (retries, min_weights_version) = (body.retries, body.min_weights_version);
    // The request's body is not kept while the task waits and runs:
    // its input, copied, is what the task's charge counts.
    drop(body);
    drop(bytes);
    let hold = tenant_key
        .map(|t| t.pending_permit(input.len() as u64))
        .transpose()?;
    // An async task is on disk before it is queued: one that cannot be
    // recorded is refused and never runs, and a crash after the 202
    // cannot lose it silently (it reads back as failed after the
    // restart).
    let journal = gw.tasks.journal().filter(|_| q.is_async);
    let id = match journal {
        Some(j) => {
            let id = pool.new_id();
            let record = crate::tasks::pool::TaskRecord {
                id: id.clone(),
                pool: pool.name.clone(),
                state: crate::tasks::pool::TaskState::Pending,
                output: None,
                error: None,
                attempts: 0,
                replica: None,
                weights_version: None,
                owner: tenant_owner,
                durable: true,
            };
            j.accept(&record).await.map_err(|e| {
                tracing::error!(pool = %pool.name, error = %e, "could not journal an async task; refused it");
                Error::new(
                    ErrorKind::Internal,
                    "the gateway could not record the task, so it was not accepted",
                )
            })?;
            Some(id)
        }
        None => None,
    };
    let submit = crate::tasks::pool::Submit {
        input,
        priority,
        tenant,
        timeout,
        retries,
        min_weights_version,
        traceparent: traceparent(&headers),
        hold,
        durable: q.is_async,
        id: id.clone(),
        cancel: None,
    };
    let (id, rx) = match gw.enqueue(&pool, submit) {
        Ok(accepted) => accepted,
        Err(e) => {
            if let (Some(j), Some(id)) = (journal, &id) {
                j.forget(id);
            }
            return Err(e);
        }
    };
    if q.is_async {
        return Ok((StatusCode::ACCEPTED, axum::Json(json!({"id": id}))).into_response());
    }
    // A client that leaves before the answer cancels its task.
    let mut left = CancelOnDrop::new(pool.clone(), id);
    let record = rx.await.map_err(|_| {
        Error::new(ErrorKind::NoCapacity, "the gateway is shutting down").retry_after(1)
    });
    left.disarm();
    Ok(axum::Json(Finished::of(&record??)).into_response())
}

/// The answer to a task run to its end: written straight from the record,
/// the worker's output as the text it sent (no JSON tree is built for it),
/// keys in the order `json!` gave them.
#[derive(serde::Serialize)]
pub(crate) struct Finished<'a> {
    attempts: u32,
    id: &'a str,
    output: Option<&'a crate::tasks::record::Output>,
    replica: Option<&'a str>,
    weights_version: Option<u64>,
}

impl<'a> Finished<'a> {
    pub(crate) fn of(r: &'a crate::tasks::pool::TaskRecord) -> Finished<'a> {
        Finished {
            attempts: r.attempts,
            id: &r.id,
            output: r.output.as_ref(),
            replica: r.replica.as_deref(),
            weights_version: r.weights_version,
        }
    }
}

/// The client's `traceparent`, if it sent one.
pub(crate) fn traceparent(headers: &http::HeaderMap) -> Option<String> {
    headers
        .get(crate::trace::TRACEPARENT)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
}

/// Priority (body, else `X-Warmgate-Priority`), tenant and timeout of a
/// task submission.
pub(crate) fn task_options(
    headers: &http::HeaderMap,
    priority: Option<i32>,
    timeout: &Scalar<'_>,
) -> Result<(i32, String, Option<Duration>), Error> {
    let parsed = duration_value(timeout, "timeout")?;
    let header = |n: &str| headers.get(n).and_then(|v| v.to_str().ok());
    let priority = match (priority, header("x-warmgate-priority")) {
        (Some(p), _) => p,
        (None, Some(h)) => h.parse().map_err(|_| {
            Error::new(
                ErrorKind::BadRequest,
                "X-Warmgate-Priority must be an integer",
            )
        })?,
        (None, None) => 0,
    };
    let tenant = header("x-warmgate-tenant")
        .filter(|t| !t.is_empty())
        .unwrap_or(crate::tasks::pool::DEFAULT_TENANT)
        .to_string();
    Ok((priority, tenant, parsed))
}

/// A batch. `inputs` is validated as it is read but kept as text; its
/// elements are taken one at a time as the batch's window moves on.
#[derive(serde::Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct BatchBody<'a> {
    #[serde(borrow)]
    #[schema(value_type = Vec<Object>)]
    pub(crate) inputs: &'a serde_json::value::RawValue,
    pub(crate) priority: Option<i32>,
    #[serde(borrow, default)]
    #[schema(value_type = Option<Object>)]
    pub(crate) timeout: Scalar<'a>,
    pub(crate) retries: Option<u32>,
    pub(crate) min_weights_version: Option<u64>,
}

/// The elements of a JSON array already validated, one at a time, each as
/// its own text: a batch never holds its inputs as values.
pub(crate) struct RawElements {
    body: Bytes,
    /// Where the next element (or the closing bracket) starts, past
    /// whitespace and a comma.
    pos: usize,
}

impl RawElements {
    /// The elements of the array whose text is `array`, a part of `body`.
    pub(crate) fn new(body: Bytes, array: &str) -> Option<RawElements> {
        let start = (array.as_ptr() as usize).checked_sub(body.as_ptr() as usize)?;
        if start + array.len() > body.len() || !array.starts_with('[') {
            return None;
        }
        Some(RawElements {
            body,
            pos: start + 1,
        })
    }
}

impl Iterator for RawElements {
    type Item = Bytes;

    fn next(&mut self) -> Option<Bytes> {
        use serde::Deserialize as _;
        let rest = self.body.get(self.pos..)?;
        let skip = rest.iter().position(|b| !b.is_ascii_whitespace())?;
        let rest = &rest[skip..];
        if rest.first() == Some(&b']') {
            self.pos = self.body.len();
            return None;
        }
        let mut de = serde_json::Deserializer::from_slice(rest);
        let Ok(raw) = <&serde_json::value::RawValue>::deserialize(&mut de) else {
            self.pos = self.body.len();
            return None;
        };
        let item = Bytes::copy_from_slice(raw.get().as_bytes());
        let end = (raw.get().as_ptr() as usize + raw.get().len())
            .saturating_sub(self.body.as_ptr() as usize);
        let after = self.body.get(end..).unwrap_or_default();
        let sep = after.iter().position(|b| !b.is_ascii_whitespace());
        self.pos = match sep.map(|i| (i, after[i])) {
            Some((i, b',')) => end + i + 1,
            _ => self.body.len(),
        };
        Some(item)
    }
}

/// Bytes of finished lines a batch holds behind an earlier, slower one, with
/// what its tasks in flight may bring (see [`Ordered`]): room for two
/// outputs of the largest size a worker may send.
const BATCH_HELD_BYTES: u64 = 128 * 1024 * 1024;

/// `POST /v1/pools/{pool}/tasks/batch`: one NDJSON line per input, in input
/// order, streamed as results complete. At most a window of tasks is
/// submitted ahead of the line being written, so a batch of 10,000 never
/// holds 10,000 results while it waits for the first; and fewer when their
/// outputs are large, within [`BATCH_HELD_BYTES`].
#[utoipa::path(post, path = "/v1/pools/{pool}/tasks/batch", tag = "pools",
    params(("pool" = String, Path, description = "Pool name")),
    request_body = BatchBody,
    responses((status = 200, description = "NDJSON, one line per input, in input order", content_type = "application/x-ndjson")))]
pub(crate) async fn submit_batch(
    State(gw): State<Arc<Gateway>>,
    Path(name): Path<String>,
    req: Request,
) -> Result<impl IntoResponse, Error> {
    let tenant_key = req.extensions().get::<Arc<Tenant>>().cloned();
    let (pool, headers, bytes) = pool_request(&gw, &name, req, BodyLimit::Task).await?;
    let shape =
        "{\"inputs\": [...], \"priority\"?, \"timeout\"?, \"retries\"?, \"min_weights_version\"?}";
    let body: BatchBody<'_> = parse_json(&bytes, shape)?;
    let (priority, tenant, timeout) = task_options(&headers, body.priority, &body.timeout)?;
    let priority = tenant_key
        .as_ref()
        .map_or(priority, |t| t.priority(priority));
    let inputs = RawElements::new(bytes.clone(), body.inputs.get()).ok_or_else(|| {
        Error::new(
            ErrorKind::BadRequest,
            format!("the body must be {shape} (inputs is not an array)"),
        )
    })?;
    let window = pool.spec().replicas[1]
        .saturating_mul(pool.spec().concurrency)
        .saturating_mul(2)
        .clamp(1, 1024) as usize;
    let retries = body.retries;
    pool.check_retries(retries)?;
    let min_version = body.min_weights_version;
    let traceparent = traceparent(&headers);
    let batch = gw
        .tasks
        .batches
        .begin(tenant_key.as_ref().map(|t| t.name.clone()), pool.clone());
    let batch_id = batch.id().to_string();
    let tasks = inputs.enumerate().map(move |(index, input)| {
        let (gw, pool, tenant) = (gw.clone(), pool.clone(), tenant.clone());
        let traceparent = traceparent.clone();
        let tenant_key = tenant_key.clone();
        let batch = batch.clone();
        async move {
            let submit = BatchTask {
                tenant_key,
                traceparent,
                priority,
                tenant,
                timeout,
                retries,
                min_weights_version: min_version,
            };
            // Written from the record: the output stays the text the
            // worker sent (a tree of it would cost many times its size,
            // and one nested past serde_json's depth limit would not
            // convert at all).
            let mut line = match batch_one(&gw, &pool, input, submit, &batch).await {
                Ok(r) => serde_json::to_vec(&BatchLine {
                    index,
                    id: &r.id,
                    output: r.output.as_ref(),
                    replica: r.replica.as_deref(),
                    weights_version: r.weights_version,
                    attempts: r.attempts,
                })
                .unwrap_or_else(|e| {
                    error_line(
                        index,
                        Some(&r.id),
                        &Error::new(ErrorKind::Internal, e.to_string()),
                    )
                }),
                Err((id, e)) => error_line(index, id.as_deref(), &e),
            };
            line.push(b'\n');
            Bytes::from(line)
        }
        .boxed()
    });
    let lines = Ordered::new(tasks, window, BATCH_HELD_BYTES).map(Ok::<_, Infallible>);
    Ok((
        [
            (
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/x-ndjson"),
            ),
            (
                http::HeaderName::from_static(X_BATCH_ID),
                HeaderValue::from_str(&batch_id)
                    .map_err(|e| Error::new(ErrorKind::Internal, e.to_string()))?,
            ),
        ],
        Body::from_stream(lines),
    ))
}

/// The options every task of a batch shares.
pub(crate) struct BatchTask {
    tenant_key: Option<Arc<Tenant>>,
    traceparent: Option<String>,
    priority: i32,
    tenant: String,
    timeout: Option<Duration>,
    retries: Option<u32>,
    min_weights_version: Option<u64>,
}

/// One finished task of a batch, as its NDJSON line.
#[derive(serde::Serialize)]
struct BatchLine<'a> {
    index: usize,
    id: &'a str,
    output: Option<&'a crate::tasks::record::Output>,
    replica: Option<&'a str>,
    weights_version: Option<u64>,
    attempts: u32,
}

/// One failed task of a batch, as its NDJSON line (without the newline),
/// with its id when it was submitted.
fn error_line(index: usize, id: Option<&str>, e: &Error) -> Vec<u8> {
    let mut line =
        json!({"index": index, "error": {"kind": e.kind.as_str(), "message": e.message}});
    if let Some(id) = id {
        line["id"] = json!(id);
    }
    line.to_string().into_bytes()
}

/// The header a batch's answer names it in, for `DELETE /v1/batches/{id}`.
pub(crate) const X_BATCH_ID: &str = "x-warmgate-batch-id";

/// Cancels a task if dropped before [`CancelOnDrop::disarm`]: its client
/// (a waiting request, or a batch's stream) went away.
pub(crate) struct CancelOnDrop {
    pool: Arc<crate::tasks::pool::Pool>,
    id: Option<String>,
}

impl CancelOnDrop {
    pub(crate) fn new(pool: Arc<crate::tasks::pool::Pool>, id: String) -> Self {
        CancelOnDrop { pool, id: Some(id) }
    }

    /// The task ended: nothing to cancel.
    pub(crate) fn disarm(&mut self) {
        self.id = None;
    }
}

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        if let Some(id) = self.id.take()
            && self.pool.cancel(&id).is_some()
        {
            tracing::info!(task = %id, pool = %self.pool.name, "the task's client left; cancelled it");
        }
    }
}

pub(crate) async fn batch_one(
    gw: &Gateway,
    pool: &Arc<crate::tasks::pool::Pool>,
    input: Bytes,
    o: BatchTask,
    batch: &crate::tasks::batches::BatchGuard,
) -> Result<crate::tasks::pool::TaskRecord, (Option<String>, Error)> {
    if batch.token().is_cancelled() {
        return Err((
            None,
            Error::new(
                ErrorKind::Cancelled,
                format!(
                    "the batch {} was cancelled before this task was submitted",
                    batch.id()
                ),
            ),
        ));
    }
    let hold = o
        .tenant_key
        .map(|t| t.pending_permit(input.len() as u64))
        .transpose()
        .map_err(|e| (None, e))?;
    let (id, rx) = gw
        .enqueue(
            pool,
            crate::tasks::pool::Submit {
                input,
                priority: o.priority,
                tenant: o.tenant,
                timeout: o.timeout,
                retries: o.retries,
                min_weights_version: o.min_weights_version,
                traceparent: o.traceparent,
                hold,
                durable: false,
                id: None,
                // Cancelled with the batch, at once, wherever it is.
                cancel: Some(batch.token().child_token()),
            },
        )
        .map_err(|e| (None, e))?;
    let mut left = CancelOnDrop::new(pool.clone(), id.clone());
    if !batch.track(&id) {
        // Cancelled between the check above and the submission.
        pool.cancel(&id);
    }
    let outcome = rx.await;
    batch.untrack(&id);
    left.disarm();
    outcome
        .map_err(|_| Error::new(ErrorKind::NoCapacity, "the gateway is shutting down"))
        .and_then(|r| r)
        .map_err(|e| (Some(id), e))
}

#[derive(serde::Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct SyncBody<'a> {
    pub(crate) checkpoint: String,
    pub(crate) version: u64,
    #[serde(borrow, default)]
    #[schema(value_type = Option<Object>)]
    pub(crate) timeout: Scalar<'a>,
    #[serde(borrow, default)]
    #[schema(value_type = Option<Object>)]
    pub(crate) max_unavailable: Scalar<'a>,
}

/// `POST /v1/pools/{pool}/weights`: swap the weights of the pool's warm
/// replicas in place, a few at a time, within a deadline; answer with
/// per-replica results once every replica has the new weights or was
/// replaced by one that starts with them.
#[utoipa::path(post, path = "/v1/pools/{pool}/weights", tag = "pools",
    params(("pool" = String, Path, description = "Pool name")),
    request_body = SyncBody,
    responses((status = 200, description = "`{pool, version, asked_version, checkpoint, seconds, synced, replaced, replicas}`: `version` is the one asked for, or the next one when that would go back (an older number, or the latest's number for another checkpoint)", body = Object), (status = 409, description = "A sync is running", body = ErrorBody), (status = 502, description = "No replica could load the new version: the sync was rolled back and the pool keeps its version", body = ErrorBody)))]
pub(crate) async fn sync_weights(
    State(gw): State<Arc<Gateway>>,
    Path(name): Path<String>,
    req: Request,
) -> Result<axum::Json<crate::tasks::weight_sync::SyncReport>, Error> {
    let (pool, _, bytes) = pool_request(&gw, &name, req, BodyLimit::Inference).await?;
    let body: SyncBody<'_> = parse_json(
        &bytes,
        "{\"checkpoint\": \"s3://…\", \"version\": N, \"timeout\"?, \"max_unavailable\"?}",
    )?;
    let asked = crate::tasks::weight_sync::SyncRequest {
        timeout: duration_value(&body.timeout, "timeout")?
            .unwrap_or(pool.spec().weight_sync_timeout),
        max_unavailable: max_unavailable(&body.max_unavailable, pool.load().2)?,
        checkpoint: body.checkpoint,
        version: body.version,
    };
    let services = crate::tasks::weight_sync::Services {
        weights: &gw.weights,
        folders: gw.serving.checkpoint_folders(),
        manager: &gw.pool,
        host: &gw.host,
    };
    crate::tasks::weight_sync::sync_weights(&services, &pool, asked)
        .await
        .map(axum::Json)
}

/// `GET /v1/tasks/{id}`.
#[utoipa::path(get, path = "/v1/tasks/{id}", tag = "pools",
    params(("id" = String, Path, description = "Task id")),
    responses((status = 200, description = "The task's state and output", body = Object), (status = 404, description = "Unknown or evicted task", body = ErrorBody)))]
pub(crate) async fn get_task(
    State(gw): State<Arc<Gateway>>,
    Path(id): Path<String>,
    req: Request,
) -> Response {
    let caller = req
        .extensions()
        .get::<Arc<Tenant>>()
        .map(|t| t.name.as_str());
    // With API keys, a tenant sees only its own tasks; another's reads as
    // unknown, so ids cannot be probed.
    let mine = |owner: Option<&str>| caller.is_none() || owner == caller;
    if let Some(r) = gw.tasks.get(&id) {
        if mine(r.owner.as_deref()) {
            return axum::Json(r).into_response();
        }
    } else if let Some(j) = gw.tasks.journal()
        && let Some((v, owner)) = j.find(&id).await
        && mine(owner.as_deref())
    {
        // Ended before this gateway started, or evicted from memory.
        return axum::Json(v).into_response();
    }
    Error::new(ErrorKind::NotFound, format!("task '{id}' not found")).into_response()
}

/// `DELETE /v1/tasks/{id}`: cancels a task. A queued one never runs; a
/// running one's request to the worker is dropped and it is not tried
/// again. Answers its record, state `cancelled`; `409` if it had already
/// ended otherwise.
#[utoipa::path(delete, path = "/v1/tasks/{id}", tag = "pools",
    params(("id" = String, Path, description = "Task id")),
    responses((status = 200, description = "The task's record, `state: cancelled`", body = Object),
              (status = 404, description = "No such task (or another tenant's)", body = ErrorBody),
              (status = 409, description = "It ended before it could be cancelled", body = ErrorBody)))]
pub(crate) async fn cancel_task(
    State(gw): State<Arc<Gateway>>,
    Path(id): Path<String>,
    tenant: Option<axum::Extension<Arc<Tenant>>>,
) -> Result<axum::Json<serde_json::Value>, Error> {
    let caller = tenant.as_ref().map(|t| t.name.as_str());
    let pool_of = |p: &str| gw.registry.load().pool(p).cloned();
    crate::tasks::cancel::cancel_task(&gw.tasks, pool_of, &id, caller)
        .await
        .map(axum::Json)
}

/// `DELETE /v1/batches/{id}`: cancels what is left of a batch being
/// streamed (`X-Warmgate-Batch-Id`): its tasks not yet submitted never
/// are, those queued or running are cancelled; each gets its line, with
/// `"error": {"kind": "cancelled"}`, and the stream ends.
#[utoipa::path(delete, path = "/v1/batches/{id}", tag = "pools",
    params(("id" = String, Path, description = "The batch's id, from its answer's X-Warmgate-Batch-Id")),
    responses((status = 200, description = "`{id, cancelled: true}`", body = Object),
              (status = 404, description = "No batch streams under that id (it ended), or another tenant's", body = ErrorBody)))]
pub(crate) async fn cancel_batch(
    State(gw): State<Arc<Gateway>>,
    Path(id): Path<String>,
    req: Request,
) -> Response {
    let caller = req
        .extensions()
        .get::<Arc<Tenant>>()
        .map(|t| t.name.as_str());
    match gw.tasks.batches.cancel(&id, caller) {
        Ok(()) => axum::Json(json!({"id": id, "cancelled": true})).into_response(),
        Err(crate::tasks::batches::NotCancelled::Unknown) => Error::new(
            ErrorKind::NotFound,
            format!("no batch '{id}' is streaming (it ended, or never was)"),
        )
        .into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn async_is_read_as_clients_write_flags() {
        let flag = |q: Option<&str>| TaskQuery::parse(q).map(|t| t.is_async);
        for (q, want) in [
            (None, false),
            (Some(""), false),
            (Some("async=true"), true),
            (Some("async=True"), true),
            (Some("async=1"), true),
            (Some("async"), true),
            (Some("async=false"), false),
            (Some("async=0"), false),
            (Some("other=x&async=%74rue"), true),
            (Some("asynchronous=1"), false),
        ] {
            assert_eq!(flag(q).ok(), Some(want), "{q:?}");
        }
        let err = TaskQuery::parse(Some("async=maybe")).unwrap_err();
        assert_eq!(err.kind, ErrorKind::BadRequest);
        assert!(err.message.contains("async=maybe"), "{}", err.message);
    }
}
