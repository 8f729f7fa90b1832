//! The HTTP edge: the router, its middleware (request id, admin token,
//! tenant keys, deadline), the OpenAPI document and the error body. The
//! handlers, by area, are in the submodules; each parses, calls the gateway
//! and renders.

pub(crate) mod body;
pub(crate) mod control;
pub(crate) mod error;
pub(crate) mod forgery;
pub(crate) mod host;
pub(crate) mod hot;
pub(crate) mod inference;
pub(crate) mod leftover;
pub(crate) mod logs;
pub(crate) mod ops;
pub(crate) mod request_id;
pub(crate) mod tasks;
pub(crate) mod usage;
pub(crate) mod weights;

use std::sync::Arc;

use axum::Json;
use axum::Router;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{any, get, post};
use http::{HeaderValue, header};

use crate::error::{Error, ErrorKind};
use crate::server::{Gateway, X_TENANT};
use control::{
    delete_adapter, delete_app, delete_pool, get_app, get_pool, list_apps, promote, put_adapter,
    put_app, put_pool, revisions, rollback, status,
};
use inference::{model, models, openai, passthrough};
use ops::{dashboard, healthz, metrics_text, readyz};
use tasks::{cancel_batch, cancel_task, get_task, submit_batch, submit_task, sync_weights};
use weights::{weights_file, weights_manifest};

/// The routes whose JSON body names an app in `model`, forwarded to the
/// same path on one of its replicas: OpenAI's, and those of the stock
/// servers users bring (vLLM's rerank, score, pooling, classify and
/// tokenizer routes, with and without `/v1`; Cohere's `/v2/rerank`).
pub const MODEL_ROUTES: [&str; 18] = [
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/embeddings",
    "/v1/responses",
    "/v1/moderations",
    "/v1/images/generations",
    "/v1/audio/speech",
    "/v1/rerank",
    "/v2/rerank",
    "/rerank",
    "/v1/score",
    "/score",
    "/v1/classify",
    "/classify",
    "/pooling",
    "/v1/pooling",
    "/tokenize",
    "/detokenize",
];

/// The HTTP routes, data plane and control plane.
pub fn router(gw: Arc<Gateway>) -> Router {
    // The control plane: with `WARMGATE_ADMIN_TOKEN` set, only callers that
    // present it may read status or change deployments.
    let control = Router::new()
        .route("/v1/status", get(status))
        .route("/v1/apps", get(list_apps))
        .route(
            "/v1/apps/{app}",
            get(get_app).put(put_app).delete(delete_app),
        )
        .route(
            "/v1/pools/{pool}",
            get(get_pool).put(put_pool).delete(delete_pool),
        )
        .route(
            "/v1/apps/{app}/adapters/{*name}",
            axum::routing::put(put_adapter).delete(delete_adapter),
        )
        .route("/v1/apps/{app}/promote", post(promote))
        .route("/v1/apps/{app}/rollback", post(rollback))
        .route("/v1/apps/{app}/revisions", get(revisions))
        .route("/v1/pools/{pool}/weights", post(sync_weights))
        .route("/v1/apps/{app}/logs", get(logs::app_logs))
        .route("/v1/pools/{pool}/logs", get(logs::pool_logs))
        .route_layer(middleware::from_fn_with_state(gw.clone(), require_admin));
    // What scrapers and tools read: behind the admin token unless
    // `[access] public_metrics`.
    let mut observe = Router::new()
        .route("/metrics", get(metrics_text))
        .route("/openapi.json", get(openapi));
    if !gw.config().access.public_metrics {
        observe = observe.route_layer(middleware::from_fn_with_state(gw.clone(), require_admin));
    }
    // The data plane: with `[[tenants]]` configured, only callers with an
    // API key get through, each within its tenant's quotas.
    let mut data = MODEL_ROUTES
        .iter()
        .fold(Router::new(), |r, path| r.route(path, post(openai)))
        .route("/v1/models", get(models))
        .route("/v1/models/{*model}", get(model))
        .route("/apps/{*rest}", any(passthrough))
        .route("/v1/pools/{pool}/tasks", post(submit_task))
        .route("/v1/pools/{pool}/tasks/batch", post(submit_batch))
        .route("/v1/tasks/{id}", get(get_task).delete(cancel_task))
        .route("/v1/batches/{id}", axum::routing::delete(cancel_batch));
    // Without tenants the layer would only cost time on every request.
    if gw.access.tenants.is_some() {
        data = data.route_layer(middleware::from_fn_with_state(gw.clone(), require_tenant));
    }
    Router::new()
        .route("/v1/weights/{target}/{revision}", get(weights_manifest))
        .route("/v1/weights/{target}/{revision}/{*file}", get(weights_file))
        .merge(data)
        .route("/ui", get(dashboard))
        .route("/ui/", get(dashboard))
        .route("/v1/usage", get(usage::usage))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route(crate::peers::PEERS_PATH, post(peer_report))
        .merge(observe)
        .merge(control)
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(request_id::RequestIdLayer)
        .with_state(gw)
}

/// The leader's side of [`crate::peers`]: a follower's report in, the
/// table out. Needs `Authorization: Bearer <WARMGATE_PEER_TOKEN>`; without
/// that variable the gateway has no peers and answers 404.
async fn peer_report(
    State(gw): State<Arc<Gateway>>,
    headers: http::HeaderMap,
    body: axum::body::Body,
) -> Result<Json<crate::peers::Table>, Error> {
    let Some(token) = gw.peers.token() else {
        return Err(Error::new(
            ErrorKind::NotFound,
            "this gateway serves alone (WARMGATE_PEER_TOKEN is not set)",
        ));
    };
    let presented = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or("");
    if !crate::tenants::same_secret(presented, token) {
        return Err(Error::new(
            ErrorKind::Unauthorized,
            "this endpoint needs Authorization: Bearer <the operator's WARMGATE_PEER_TOKEN>",
        ));
    }
    if gw.peers.follower().is_some() {
        return Err(Error::new(
            ErrorKind::Conflict,
            "this gateway replica does not lead; report to the leader",
        ));
    }
    let bytes = axum::body::to_bytes(body, crate::peers::MAX_REPORT_BYTES)
        .await
        .map_err(|_| {
            Error::new(
                ErrorKind::TooLarge,
                format!(
                    "a peer report is at most {} bytes",
                    crate::peers::MAX_REPORT_BYTES
                ),
            )
        })?;
    let report: crate::peers::Report = serde_json::from_slice(&bytes)
        .map_err(|e| Error::new(ErrorKind::BadRequest, format!("not a peer report: {e}")))?;
    gw.answer_peer(&report).map(Json).ok_or_else(|| {
        Error::new(
            ErrorKind::Conflict,
            format!(
                "{} gateway replicas serve already, the most counted",
                crate::peers::MAX_PEERS
            ),
        )
    })
}

/// Lets a control-plane request through when no admin token is configured,
/// or when it carries `Authorization: Bearer <token>`; the comparison takes
/// the same time wherever the tokens differ.
pub(crate) async fn require_admin(
    State(gw): State<Arc<Gateway>>,
    req: Request,
    next: Next,
) -> Response {
    let Some(token) = &gw.access.admin_token else {
        // Open to loopback, but not to the web pages of its browser.
        if let Some(why) = forgery::forged(req.method(), req.headers(), req.uri()) {
            return Error::new(
                ErrorKind::Unauthorized,
                format!(
                    "refused: {why}. Without WARMGATE_ADMIN_TOKEN the control plane answers only \
                     programs on this machine; set the token and send Authorization: Bearer \
                     <token> to use it from elsewhere"
                ),
            )
            .into_response();
        }
        return next.run(req).await;
    };
    let presented = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or("");
    if crate::tenants::same_secret(presented, token) {
        next.run(req).await
    } else {
        Error::new(
            ErrorKind::Unauthorized,
            "this endpoint needs Authorization: Bearer <the gateway's WARMGATE_ADMIN_TOKEN>",
        )
        .into_response()
    }
}

/// With `[[tenants]]` configured: identifies the caller's tenant by its API
/// key (401 without a known one), admits the request within the tenant's
/// rate and in-flight quotas (429 `quota_exceeded` past them), and sets
/// `X-Warmgate-Tenant` to the tenant's name, so fairness cannot be gamed by
/// the header. The key is not passed on to workers. The in-flight slot is
/// held until the response body ends, so a streamed answer counts.
pub(crate) async fn require_tenant(
    State(gw): State<Arc<Gateway>>,
    mut req: Request,
    next: Next,
) -> Response {
    match admit_tenant(&gw, &mut req) {
        Ok(guard) => held(next.run(req).await, guard),
        Err(refused) => refused.into_response(),
    }
}

/// The tenant check of [`require_tenant`], for the routes served without
/// the router ([`hot`]): with `[[tenants]]` configured, identifies the
/// caller by its API key, admits it within its quotas, and replaces the key
/// with `X-Tenant` and the tenant in the request's extensions. Returns what
/// the answer must hold until its body ends, or the refusal.
pub(crate) fn admit_tenant(
    gw: &Gateway,
    req: &mut Request,
) -> Result<Option<crate::tenants::InflightGuard>, Error> {
    let Some(tenants) = &gw.access.tenants else {
        return Ok(None);
    };
    let Some(tenant) = tenants.identify(req.headers()) else {
        return Err(Error::new(
            ErrorKind::Unauthorized,
            "this endpoint needs Authorization: Bearer <an API key of a [[tenants]] entry>",
        ));
    };
    // Each gateway serving together allows its part of the quotas.
    let guard = tenant.admit_as_one_of(gw.pool.share().get().1)?;
    let headers = req.headers_mut();
    headers.remove(header::AUTHORIZATION);
    if let Ok(v) = HeaderValue::from_str(&tenant.name) {
        headers.insert(X_TENANT, v);
    }
    req.extensions_mut().insert(tenant);
    Ok(Some(guard))
}

/// A data-plane request that came with the admin token (with tenants
/// configured, in place of a tenant's key).
#[derive(Debug, Clone, Copy)]
pub(crate) struct AdminCaller;

/// `resp`, holding the tenant's in-flight place until its body ends.
pub(crate) fn held(resp: Response, guard: Option<crate::tenants::InflightGuard>) -> Response {
    match guard {
        Some(guard) => resp.map(|body| Body::new(crate::tenants::HeldBody::new(body, guard))),
        None => resp,
    }
}

/// Runs an inference request under `limits.request_timeout`, from its
/// arrival to its response's headers: past it the client gets `504 timeout`
/// and the request gives up its place in the queue or its replica slot.
pub(crate) async fn within_deadline(
    gw: &Gateway,
    work: impl Future<Output = Response>,
) -> Response {
    let limit = gw.host.config.limits.request_timeout;
    match tokio::time::timeout(limit, work).await {
        Ok(resp) => resp,
        Err(_) => {
            metrics::counter!("warmgate_request_deadline_exceeded_total").increment(1);
            Error::new(
                ErrorKind::Timeout,
                format!(
                    "no response within {} (limits.request_timeout)",
                    humantime::format_duration(limit)
                ),
            )
            .into_response()
        }
    }
}

/// The error format every endpoint uses.
#[derive(utoipa::ToSchema)]
#[allow(dead_code)]
pub(crate) struct ErrorBody {
    /// `{"kind": "queue_full", "message": "…"}`
    error: ErrorDetail,
}

/// One error.
#[derive(utoipa::ToSchema)]
#[allow(dead_code)]
pub(crate) struct ErrorDetail {
    /// `bad_request`, `unauthorized`, `not_found`, `method_not_allowed`,
    /// `conflict`, `too_large`, `queue_full`, `replica_failed`,
    /// `no_capacity`, `starting` or `timeout`.
    kind: String,
    /// What went wrong, for people.
    message: String,
    /// The OpenAI error type: `invalid_request_error`,
    /// `authentication_error`, `rate_limit_error` or `server_error`.
    #[schema(rename = "type")]
    kind_type: String,
    /// The same as `kind`, where OpenAI clients look for it.
    code: String,
    /// The request field at fault (`model`), or null.
    param: Option<String>,
}

/// The HTTP API, generated from the handlers above.
#[derive(utoipa::OpenApi)]
#[openapi(
    info(title = "warmgate", description = "The warmgate gateway's HTTP API."),
    paths(
        inference::openai,
        inference::passthrough,
        inference::models,
        inference::model,
        control::status,
        control::list_apps,
        control::get_app,
        control::put_app,
        control::delete_app,
        control::put_adapter,
        control::delete_adapter,
        control::get_pool,
        control::put_pool,
        control::delete_pool,
        control::promote,
        control::rollback,
        control::revisions,
        logs::app_logs,
        logs::pool_logs,
        usage::usage,
        tasks::submit_task,
        tasks::submit_batch,
        tasks::sync_weights,
        tasks::get_task,
        tasks::cancel_task,
        tasks::cancel_batch,
        weights::weights_manifest,
        weights::weights_file,
        ops::dashboard,
        ops::healthz,
        ops::readyz,
        ops::metrics_text
    ),
    components(schemas(
        ErrorBody,
        ErrorDetail,
        control::PromoteBody,
        tasks::TaskBody,
        tasks::BatchBody,
        tasks::SyncBody
    ))
)]
pub struct ApiDoc;

/// The OpenAPI document served at `/openapi.json`: the handlers' paths,
/// with the bodies of `PUT /v1/apps/{app}` and `PUT /v1/pools/{pool}`
/// typed by the config's own schema (the keys `warmgate serve` reads).
pub fn api_document() -> serde_json::Value {
    use utoipa::OpenApi as _;
    let mut doc = serde_json::to_value(ApiDoc::openapi()).expect("the OpenAPI document is JSON");
    let mut generator = schemars::generate::SchemaSettings::draft2020_12()
        .with(|s| s.definitions_path = "/components/schemas".into())
        .into_generator();
    let bodies = [
        (
            "/v1/apps/{app}",
            generator.subschema_for::<warmgate_deploy::AppSpec>(),
        ),
        (
            "/v1/pools/{pool}",
            generator.subschema_for::<warmgate_deploy::PoolSpec>(),
        ),
    ];
    for (path, schema) in bodies {
        doc["paths"][path]["put"]["requestBody"]["content"]["application/json"]["schema"] =
            schema.to_value();
    }
    if let Some(schemas) = doc["components"]["schemas"].as_object_mut() {
        schemas.extend(generator.take_definitions(true));
    }
    doc
}

pub(crate) async fn openapi() -> Json<serde_json::Value> {
    Json(api_document())
}

pub(crate) async fn not_found(req: Request) -> Response {
    Error::new(
        ErrorKind::NotFound,
        format!("no route for {} {}", req.method(), req.uri().path()),
    )
    .into_response()
}

pub(crate) async fn method_not_allowed(req: Request) -> Response {
    Error::new(
        ErrorKind::MethodNotAllowed,
        format!("{} is not allowed on {}", req.method(), req.uri().path()),
    )
    .into_response()
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;
    use http::HeaderValue;

    use super::body::{Scalar, duration_value, max_unavailable, parse_json};
    use super::inference::model_field;
    use super::tasks::{BatchBody, RawElements, SyncBody, TaskBody, task_options};
    use crate::error::ErrorKind;
    use crate::server::MAX_CLIENT_DURATION;
    use crate::serving::served::Served;

    #[test]
    fn model_field_errors_are_clear() {
        assert_eq!(
            model_field(br#"{"model":"a","input":[1,2]}"#).expect("ok"),
            "a"
        );
        let kinds = [
            &b"not json"[..],
            br#"{"input":"x"}"#,
            br#"{"model":7}"#,
            br#"{"model":""}"#,
            br#"[1,2]"#,
            br#"{"model":null}"#,
            br#"{"model":[0,0,[{"a":1}]]}"#,
            br#"{"model":{"a":[1]}}"#,
        ];
        for body in kinds {
            let err = model_field(body).expect_err("error");
            assert_eq!(err.kind, ErrorKind::BadRequest);
            assert!(err.message.contains("model"), "{}", err.message);
        }
        assert_eq!(
            model_field(br#"{"x":[1,{"y":2}],"model":"b\u0061"}"#).expect("ok"),
            "ba"
        );
    }

    #[test]
    fn batch_inputs_are_taken_one_at_a_time_as_text() {
        let body = Bytes::from_static(br#" {"inputs" : [ 1 , {"a": [2, "]"]},"x,y" ,[] ] } "#);
        let parsed: BatchBody<'_> = parse_json(&body, "a batch").expect("batch");
        let items: Vec<Bytes> = RawElements::new(body.clone(), parsed.inputs.get())
            .expect("an array")
            .collect();
        assert_eq!(
            items,
            vec![
                Bytes::from_static(b"1"),
                Bytes::from_static(br#"{"a": [2, "]"]}"#),
                Bytes::from_static(br#""x,y""#),
                Bytes::from_static(b"[]"),
            ]
        );
        let empty = Bytes::from_static(br#"{"inputs":[]}"#);
        let parsed: BatchBody<'_> = parse_json(&empty, "a batch").expect("batch");
        let mut items = RawElements::new(empty.clone(), parsed.inputs.get()).expect("array");
        assert!(items.next().is_none());
        let not_array = Bytes::from_static(br#"{"inputs":{"a":1}}"#);
        let parsed: BatchBody<'_> = parse_json(&not_array, "a batch").expect("batch");
        assert!(RawElements::new(not_array.clone(), parsed.inputs.get()).is_none());
    }

    use proptest::prelude::any;
    use proptest::prelude::*;

    /// Arbitrary JSON values, nested a few levels.
    fn json_value() -> impl Strategy<Value = serde_json::Value> {
        let leaf = prop_oneof![
            Just(serde_json::Value::Null),
            any::<bool>().prop_map(serde_json::Value::from),
            any::<i64>().prop_map(serde_json::Value::from),
            any::<u64>().prop_map(serde_json::Value::from),
            any::<f64>()
                .prop_filter("JSON has no NaN or infinity", |f| f.is_finite())
                .prop_map(serde_json::Value::from),
            prop_oneof![
                ".{0,12}",
                Just("30s".to_string()),
                Just("-1s".to_string()),
                Just("99999999999y".to_string()),
                Just("50%".to_string()),
                Just("1e308%".to_string()),
                Just("NaN%".to_string()),
            ]
            .prop_map(serde_json::Value::from),
        ];
        leaf.prop_recursive(3, 24, 4, |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..4).prop_map(serde_json::Value::from),
                proptest::collection::btree_map(
                    prop_oneof![
                        Just("input".to_string()),
                        Just("inputs".to_string()),
                        Just("model".to_string()),
                        Just("priority".to_string()),
                        Just("timeout".to_string()),
                        Just("retries".to_string()),
                        Just("min_weights_version".to_string()),
                        Just("checkpoint".to_string()),
                        Just("version".to_string()),
                        Just("max_unavailable".to_string()),
                        ".{0,6}",
                    ],
                    inner,
                    0..5
                )
                .prop_map(|m| serde_json::Value::Object(m.into_iter().collect())),
            ]
        })
    }

    fn header_map(pairs: &[(&'static str, Vec<u8>)]) -> http::HeaderMap {
        let mut h = http::HeaderMap::new();
        for (name, value) in pairs {
            if let Ok(v) = HeaderValue::from_bytes(value) {
                h.insert(*name, v);
            }
        }
        h
    }

    #[test]
    fn a_timeout_below_a_nanosecond_is_refused_not_zero() {
        // Found by `task_bodies_never_panic`: above 0, but no time at all
        // once a Duration.
        let body = br#"{"input":null,"timeout":4.272414105715504e-284}"#;
        read_task_like(body);
        let b = parse_json::<TaskBody<'_>>(body, "a task").expect("a task body");
        let err = duration_value(&b.timeout, "timeout").expect_err("refused");
        assert_eq!(err.kind, ErrorKind::BadRequest);
    }

    /// Every way a task or sync body can be read, as the handlers read it.
    fn read_task_like(bytes: &[u8]) {
        if let Ok(b) = parse_json::<TaskBody<'_>>(bytes, "a task") {
            let h = http::HeaderMap::new();
            if let Ok((_, _, Some(t))) = task_options(&h, b.priority, &b.timeout) {
                assert!(!t.is_zero() && t <= MAX_CLIENT_DURATION);
                // The deadline arithmetic the pool does must not overflow.
                let _ = std::time::Instant::now() + t;
            }
        }
        if let Ok(b) = parse_json::<BatchBody<'_>>(bytes, "a batch") {
            let _ = duration_value(&b.timeout, "timeout");
            let body = Bytes::copy_from_slice(bytes);
            let parsed: BatchBody<'_> = parse_json(&body, "a batch").expect("parsed once");
            if let Some(items) = RawElements::new(body.clone(), parsed.inputs.get()) {
                let want: Vec<serde_json::Value> =
                    serde_json::from_str(parsed.inputs.get()).expect("an array");
                let got: Vec<serde_json::Value> = items
                    .map(|i| serde_json::from_slice(&i).expect("each element is JSON"))
                    .collect();
                assert_eq!(got, want);
            }
        }
        if let Ok(b) = parse_json::<SyncBody<'_>>(bytes, "a sync") {
            let _ = duration_value(&b.timeout, "timeout");
            if let Ok(n) = max_unavailable(&b.max_unavailable, 7) {
                assert!(n >= 1);
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(1000))]

        /// The `model` field extraction never panics on any bytes, and
        /// what it accepts is a non-empty name.
        #[test]
        fn model_field_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
            if let Ok(m) = model_field(&bytes) {
                prop_assert!(!m.is_empty());
            }
        }

        /// Nor on JSON of any shape, with `model` anywhere.
        #[test]
        fn model_field_on_any_json(v in json_value()) {
            let bytes = serde_json::to_vec(&v).expect("serialises");
            let got = model_field(&bytes);
            match v.get("model") {
                Some(serde_json::Value::String(s)) if !s.is_empty() => {
                    prop_assert_eq!(got.expect("a name"), s.clone());
                }
                _ => prop_assert_eq!(got.expect_err("no name").kind, ErrorKind::BadRequest),
            }
        }

        /// Task, batch and sync bodies: arbitrary bytes and arbitrary JSON
        /// either parse into options within bounds or are refused.
        #[test]
        fn task_bodies_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..256), v in json_value()) {
            read_task_like(&bytes);
            read_task_like(&serde_json::to_vec(&v).expect("serialises"));
        }

        /// Routing headers with arbitrary bytes: priority, tenant,
        /// traceparent and a pinned revision.
        #[test]
        fn routing_headers_never_panic(
            priority in proptest::collection::vec(any::<u8>(), 0..24),
            tenant in proptest::collection::vec(any::<u8>(), 0..24),
            trace in prop_oneof![
                proptest::collection::vec(any::<u8>(), 0..64),
                "00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}".prop_map(String::into_bytes),
            ],
            pinned in ".{0,24}",
        ) {
            let mut h = header_map(&[
                ("x-warmgate-priority", priority),
                ("x-warmgate-tenant", tenant),
                ("traceparent", trace),
            ]);
            if let Ok((_, tenant, _)) = task_options(&h, None, &Scalar::Absent) {
                prop_assert!(!tenant.is_empty());
            }
            let tp = crate::trace::ensure_traceparent(&mut h);
            prop_assert!(crate::trace::is_valid(tp));
            prop_assert_eq!(crate::trace::trace_id(tp).len(), 32);
            let served = Served::new(
                warmgate_deploy::AppSpec { name: "m".into(), ..Default::default() },
                warmgate_deploy::revision::History::default(),
            );
            let err = served.pick(Some(&pinned)).err().expect("no live revision");
            prop_assert_eq!(err.kind, ErrorKind::NotFound);
            prop_assert_eq!(served.pick(None).err().expect("no split").kind, ErrorKind::NoCapacity);
        }
    }
}
