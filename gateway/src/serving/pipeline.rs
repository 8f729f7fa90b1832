//! A request's way through an app: the revision the split picks, a slot
//! on a ready replica (or a wait in the hold queue, which wakes an app at
//! zero), the forward, and a retry on another replica when one refuses the
//! connection.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::Request;
use axum::response::Response;
use http::{HeaderName, HeaderValue};
use warmgate_pool::{PoolManager, ReplicaHandle};

use super::dispatch::{Acquire, App};
use super::proxy::{Forward, Slot as _};
use super::route::RouteKey;
use super::served::Served;
use crate::error::{Error, ErrorKind};
use crate::upstream::Upstream;

/// The replica that answered.
pub const X_REPLICA: HeaderName = HeaderName::from_static("x-warmgate-replica");
/// The revision that answered; on a request, pins one.
pub const X_REVISION: HeaderName = HeaderName::from_static("x-warmgate-revision");
/// Milliseconds the request waited for a slot.
pub const X_QUEUED_MS: HeaderName = HeaderName::from_static("x-warmgate-queued-ms");
/// Milliseconds the request waited for its LoRA adapter to be loaded on
/// its replica (a cold-start phase of its own); absent when it was loaded.
pub const X_ADAPTER_LOAD_MS: HeaderName = HeaderName::from_static("x-warmgate-adapter-load-ms");
/// Set when the request woke its app from zero.
pub const X_COLD_START: HeaderName = HeaderName::from_static("x-warmgate-cold-start");
/// Tries of a request whose replicas refuse the connection.
const MAX_CONNECT_ATTEMPTS: u32 = 3;
/// How many times a request follows its revision's replicas to another
/// revision (an in-place promotion hands them on once; a rollback in the
/// middle hands them back).
const MAX_MOVES: u32 = 4;
/// Pause before the next try, times the tries so far.
const CONNECT_RETRY_PAUSE: Duration = Duration::from_millis(20);

/// What a request is routed on: its prompt's key (`[apps.routing]`) and
/// the adapter its `model` names (`[apps.adapters]`).
#[derive(Debug, Default)]
pub(crate) struct Wants {
    /// The prompt's or session's key.
    pub key: Option<Arc<RouteKey>>,
    /// The adapter, by the name the engine holds it under.
    pub adapter: Option<Arc<str>>,
    /// The adapter's checkpoint.
    pub checkpoint: Option<Arc<str>>,
    /// The tenant asking, for a fair share of the adapter slots.
    pub tenant: Option<Arc<str>>,
}

/// What serving a request needs: the upstream client, the pool manager
/// (to wake an app at zero and to see a failing one), and the clock the
/// autoscaler runs on.
#[derive(Clone)]
pub struct Pipeline {
    upstream: Upstream,
    pool: PoolManager,
    started: Instant,
    adapter_files: Arc<super::adapter_files::AdapterFiles>,
}

/// A slot [`Pipeline::take_slot`] took: the revision whose replica it
/// is, how long the request queued for it, and whether it woke the app.
struct Taken {
    app: Arc<App>,
    slot: super::dispatch::SlotGuard,
    queued: Duration,
    cold: bool,
}

impl Pipeline {
    /// Checkpoints as folders on this machine, for engines that read one
    /// (vLLM's adapters and in-place weight reloads).
    pub(crate) fn checkpoint_folders(&self) -> &super::adapter_files::AdapterFiles {
        &self.adapter_files
    }

    /// A pipeline over these parts; `started` is the autoscaler's clock;
    /// adapters' files come from `adapter_files`.
    pub fn new(
        upstream: Upstream,
        pool: PoolManager,
        started: Instant,
        adapter_files: Arc<super::adapter_files::AdapterFiles>,
    ) -> Self {
        Pipeline {
            upstream,
            pool,
            started,
            adapter_files,
        }
    }

    /// Serves one request of `served` on the revision the split (or a
    /// pinning `X-Warmgate-Revision`) picks, and counts the answer for
    /// that revision's health unless it was pinned.
    pub async fn serve(
        &self,
        served: &Served,
        mut req: Request,
        path_and_query: &str,
    ) -> (Option<Arc<App>>, Result<Response, Error>) {
        use tracing::Instrument as _;
        let traceparent = crate::trace::ensure_traceparent(req.headers_mut());
        let span = tracing::info_span!(
            "request",
            app = %served.name,
            trace_id = %crate::trace::trace_id(traceparent),
            revision = tracing::field::Empty,
            replica = tracing::field::Empty,
            queued_ms = tracing::field::Empty,
            status = tracing::field::Empty,
        );
        crate::telemetry::set_parent(&span, req.headers());
        let pinned = req
            .headers()
            .get(X_REVISION)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        let app = match served.pick(pinned.as_deref()) {
            Ok(a) => a,
            Err(e) => return (None, Err(e)),
        };
        span.record("revision", app.revision.as_str());
        // A canary's request of a promoted adapter judges its new revision.
        let canary = req
            .extensions()
            .get::<super::adapter_split::RequestedAdapter>()
            .and_then(|a| a.canary.clone());
        let t0 = Instant::now();
        let result = self
            .serve_app(&app, req, path_and_query, pinned.is_some())
            .instrument(span.clone())
            .await;
        match &result {
            Ok(r) => {
                let h = r.headers();
                let text = |n: HeaderName| h.get(n).and_then(|v| v.to_str().ok()).unwrap_or("");
                span.record("replica", text(X_REPLICA));
                span.record("queued_ms", text(X_QUEUED_MS));
                span.record("status", r.status().as_u16());
            }
            Err(e) => {
                span.record("status", e.kind.as_str());
            }
        }
        tracing::debug!(parent: &span, took_ms = t0.elapsed().as_secs_f64() * 1e3, "request done");
        let failed = match &result {
            Ok(r) => r.status().is_server_error(),
            Err(e) => matches!(
                e.kind,
                ErrorKind::ReplicaFailed | ErrorKind::Timeout | ErrorKind::NoCapacity
            ),
        };
        // Only traffic the split routed judges a revision's health: a
        // client pinning a revision (an evaluation, or anyone who can
        // reach the data plane) must not be able to fail a canary, nor to
        // make a bad one look healthy.
        if pinned.is_none() {
            app.answered(failed, t0.elapsed());
        }
        // An adapter's canary is judged on what its revision did: a 5xx, a
        // failed load or a timeout; not on the gateway's own overload, nor
        // on requests pinned to an app revision.
        if let Some(c) = canary.filter(|_| pinned.is_none()) {
            c.answered(match &result {
                Ok(r) => r.status().is_server_error(),
                Err(e) => matches!(e.kind, ErrorKind::ReplicaFailed | ErrorKind::Timeout),
            });
        }
        (Some(app), result)
    }

    /// Serves one request with `app`: a slot now, or a wait in the hold
    /// queue, then the forward.
    pub(crate) async fn serve_app(
        &self,
        app: &Arc<App>,
        mut req: Request,
        path_and_query: &str,
        pinned: bool,
    ) -> Result<Response, Error> {
        // What the proxy uses of the request; its extensions stay behind,
        // but for the key it is routed on.
        let requested = req
            .extensions_mut()
            .remove::<super::adapter_split::RequestedAdapter>();
        let tenant = req
            .extensions()
            .get::<Arc<crate::tenants::Tenant>>()
            .map(|t| Arc::from(t.name.as_str()));
        let wants = Wants {
            tenant,
            key: req.extensions_mut().remove::<Arc<RouteKey>>(),
            adapter: requested.as_ref().map(|a| a.engine.clone()),
            checkpoint: requested.map(|a| a.checkpoint),
        };
        req.extensions_mut().clear();
        let mut req = read_small_body(req).await?;
        // A replica that refuses the connection (killed a moment ago, not
        // yet seen to exit) was sent nothing and hands the request back,
        // body and all, so it may try another one; it is out of rotation
        // until it answers its probe (`serving::outlier`), so with no
        // other replica the request waits for one.
        let mut attempt = 1;
        let mut refused: Vec<Arc<ReplicaHandle>> = Vec::new();
        loop {
            match self
                .serve_once_or_refused(app, req, path_and_query, pinned, &refused, &wants)
                .await
            {
                Err(Forward::Refused(e, back, replica)) if attempt < MAX_CONNECT_ATTEMPTS => {
                    refused.push(replica);
                    metrics::counter!("warmgate_connect_retries_total").increment(1);
                    tracing::debug!(attempt, error = %e.message, "retrying on another replica");
                    // The pool manager sees a dead process within
                    // milliseconds; give it that long to drop the replica.
                    tokio::time::sleep(CONNECT_RETRY_PAUSE * attempt).await;
                    attempt += 1;
                    req = *back;
                }
                other => return other.map_err(Forward::into_error),
            }
        }
    }

    /// One request on `app`, following its replicas to the revision they
    /// moved to, unless it is `pinned` to `app` (an evaluation must be
    /// answered by the revision it names, or not at all).
    pub(crate) async fn serve_once_or_refused(
        &self,
        app: &Arc<App>,
        req: Request,
        path_and_query: &str,
        pinned: bool,
        avoid: &[Arc<ReplicaHandle>],
        wants: &Wants,
    ) -> Result<Response, Forward> {
        use Forward::Failed;
        let Taken {
            app,
            mut slot,
            queued,
            cold,
        } = self.take_slot(app, pinned, avoid, wants).await?;
        // An adapter's request reaches its replica only once the adapter
        // is loaded there.
        let adapter_wait = super::adapter_load::prepare(
            &mut slot,
            &app.spec(),
            wants.checkpoint.as_deref(),
            &self.adapter_files,
        )
        .await
        .map_err(Failed)?;
        let replica = slot.replica().clone();
        let mut resp = super::proxy::forward(&self.upstream, req, path_and_query, slot).await?;
        let h = resp.headers_mut();
        if let Some(v) = &replica.id_header {
            h.insert(X_REPLICA, v.clone());
        }
        // The revision that served it: a replica swapped in place keeps
        // the name of the revision it started with.
        if let Some(v) = &app.revision_header {
            h.insert(X_REVISION, v.clone());
        }
        h.insert(X_QUEUED_MS, queued_ms(queued));
        if let Some(waited) = adapter_wait {
            h.insert(X_ADAPTER_LOAD_MS, queued_ms(waited));
        }
        if cold {
            h.insert(X_COLD_START, HeaderValue::from_static("true"));
        }
        Ok(resp)
    }

    /// A slot on one of `app`'s replicas, waited for in its queue (and
    /// woken for, when it has none), following its replicas to the
    /// revision they moved to unless `pinned`.
    async fn take_slot(
        &self,
        app: &Arc<App>,
        pinned: bool,
        avoid: &[Arc<ReplicaHandle>],
        wants: &Wants,
    ) -> Result<Taken, Forward> {
        use super::dispatch::Slotted;
        use Forward::Failed;
        // A revision whose last replica went to another (swapped in place)
        // sends its requests there: followed a few times at most, since
        // two revisions could hand a replica back and forth.
        let mut app = app.clone();
        let mut hops = 0;
        loop {
            if app.ready_replicas() == 0 && !app.is_redirected() {
                self.refuse_if_failing(&app).map_err(Failed)?;
            }
            let next = match app
                .acquire_avoiding_for(
                    avoid,
                    wants.key.as_ref(),
                    wants.adapter.as_ref(),
                    wants.tenant.as_ref(),
                )
                .map_err(Failed)?
            {
                Acquire::Ready(slot) => {
                    return Ok(Taken {
                        app,
                        slot,
                        queued: Duration::ZERO,
                        cold: false,
                    });
                }
                Acquire::Moved(to) => to,
                Acquire::Held { pending, cold } => {
                    if cold && !app.is_guest() {
                        let pool = &self.pool;
                        app.wake(self.started.elapsed(), |n| {
                            if pool.desired(&app.target).unwrap_or(0) < n {
                                pool.scale(&app.target, n);
                            }
                        });
                    }
                    match pending
                        .wait(app.spec().queue.timeout)
                        .await
                        .map_err(Failed)?
                    {
                        Slotted::Slot(slot, queued) => {
                            return Ok(Taken {
                                app,
                                slot,
                                queued,
                                cold,
                            });
                        }
                        Slotted::Moved(to) => to,
                    }
                }
            };
            if pinned {
                return Err(Failed(
                    Error::new(
                        ErrorKind::NoCapacity,
                        format!(
                            "revision '{}' has no replica now (they moved to '{}'); a pinned request is not sent to another revision",
                            app.revision, next.revision
                        ),
                    )
                    .retry_after(1),
                ));
            }
            hops += 1;
            if hops > MAX_MOVES {
                return Err(Failed(
                    Error::new(
                        ErrorKind::NoCapacity,
                        format!("app '{}' is moving between revisions; try again", app.name),
                    )
                    .retry_after(1),
                ));
            }
            app = next;
        }
    }

    /// With no replica ready and the last starts failing, a new request is
    /// refused at once instead of waiting out the crash-loop backoff.
    pub(crate) fn refuse_if_failing(&self, app: &App) -> Result<(), Error> {
        let Some(h) = self.pool.health(&app.target) else {
            return Ok(());
        };
        // In a crash loop, while its backoff runs: one answer, at once.
        if h.retry_in.is_some()
            && let Some(e) = super::crash_loop::crash_loop_error(&format!("app '{}'", app.name), &h)
        {
            return Err(e);
        }
        if h.ready == 0
            && h.starting == 0
            && h.failing_to_start
            && let Some(retry) = h.retry_in
        {
            let secs = retry.as_secs_f64().ceil() as u64;
            return Err(Error::new(
                ErrorKind::NoCapacity,
                format!(
                    "app '{}' is failing to start ({}); next attempt in {secs}s",
                    app.name,
                    h.last_failure.as_deref().unwrap_or("unknown error")
                ),
            )
            .retry_after(secs));
        }
        Ok(())
    }
}

/// `X-Warmgate-Queued-Ms` for a wait: most requests waited 0 ms, which
/// needs no allocation.
pub(crate) fn queued_ms(waited: Duration) -> HeaderValue {
    match waited.as_millis() {
        0 => HeaderValue::from_static("0"),
        ms => HeaderValue::from(ms as u64),
    }
}

/// Bodies of a known size up to this are read in full before a slot is
/// taken, so that a client trickling a small upload holds no replica's
/// slot meanwhile; larger ones, and those of unknown size, stream to the
/// replica.
pub(crate) const READ_AHEAD_BYTES: u64 = 64 * 1024;

/// `req` with its body read in full if it is small (see
/// [`READ_AHEAD_BYTES`]), else as it is.
pub(crate) async fn read_small_body(req: Request) -> Result<Request, Error> {
    match http_body::Body::size_hint(req.body()).exact() {
        Some(n) if n > 0 && n <= READ_AHEAD_BYTES => {}
        _ => return Ok(req),
    }
    let (parts, body) = req.into_parts();
    let bytes = http_body_util::BodyExt::collect(body)
        .await
        .map_err(|e| crate::error::body_error(&e))?
        .to_bytes();
    Ok(Request::from_parts(parts, axum::body::Body::from(bytes)))
}
