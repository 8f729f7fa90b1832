//! The data plane for apps: OpenAI-compatible routes, the passthrough and
//! the model list.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Path, Request, State};
use axum::response::{IntoResponse, Response};
use serde_json::json;

use super::body::{BodyLimit, MAX_ECHOED_CHARS, Scalar, check_content_length};
use super::{ErrorBody, within_deadline};
use crate::error::{Error, ErrorKind};
use crate::server::Gateway;
use crate::serving::dispatch::App;
use crate::serving::proxy::LimitedBody;
use crate::serving::served::Served;

// === handlers ===

#[utoipa::path(post, path = "/v1/chat/completions", tag = "inference",
    description = "OpenAI-compatible: routed by the body's `model` to an app (or an alias), streamed when the worker streams. Every path of `MODEL_ROUTES` works the same way: `/v1/completions`, `/v1/embeddings`, `/v1/responses`, `/v1/moderations`, `/v1/images/generations`, `/v1/audio/speech`, and vLLM's `/v1/rerank` (`/rerank`, `/v2/rerank`), `/v1/score` (`/score`), `/v1/classify` (`/classify`), `/pooling` (`/v1/pooling`), `/tokenize` and `/detokenize`.",
    request_body(content = Object, description = "An OpenAI request with a `model` field"),
    responses((status = 200, description = "The worker's answer, passed through"), (status = 404, description = "Unknown model", body = ErrorBody), (status = 429, description = "Queue full", body = ErrorBody), (status = 503, description = "Starting or no capacity", body = ErrorBody)))]
pub(crate) async fn openai(State(gw): State<Arc<Gateway>>, req: Request) -> Response {
    let path = req
        .uri()
        .path_and_query()
        .map_or("/", |p| p.as_str())
        .to_string();
    within_deadline(&gw, async {
        match read_model(&gw, req, &path).await {
            Ok((served, mut req)) => {
                let metering = req.extensions_mut().remove::<Metering>();
                let resp = serve(&gw, &served, req, &path).await;
                metered(&gw, resp, metering)
            }
            Err(e) => finish(None, Err(e)),
        }
    })
    .await
}

/// How an answer's usage is counted: whose it is, and whether the gateway
/// asked the engine for a usage chunk the client did not ask for.
#[derive(Clone)]
pub(crate) struct Metering {
    key: crate::usage::UsageKey,
    strip: bool,
    tenant: Option<Arc<crate::tenants::Tenant>>,
    /// What a tenant is charged for an answer that carries no usage: its
    /// prompt's bytes over four, and the completion tokens it asked for
    /// (and a token for each chunk that passed).
    estimate: u64,
}

/// `resp`, its body read for usage when it is a success to count.
fn metered(gw: &Gateway, resp: Response, metering: Option<Metering>) -> Response {
    let Some(m) = metering.filter(|_| resp.status().is_success()) else {
        return resp;
    };
    let charge = m.tenant.filter(|t| t.has_token_rate()).map(
        |tenant| -> Box<dyn crate::usage::tap::Charge> {
            Box::new(TenantCharge {
                tenant,
                gateways: gw.pool.share().get().1,
                estimate: m.estimate,
            })
        },
    );
    let meter = crate::usage::tap::Meter {
        cell: gw.usage.cell(&m.key),
        charge,
    };
    let (mut parts, body) = resp.into_parts();
    if m.strip {
        parts.headers.remove(http::header::CONTENT_LENGTH);
    }
    let body = Body::new(crate::usage::tap::Metered::new(body, meter, m.strip));
    Response::from_parts(parts, body)
}

/// An answer's tokens charged to its tenant's token rate.
struct TenantCharge {
    tenant: Arc<crate::tenants::Tenant>,
    gateways: u32,
    estimate: u64,
}

impl crate::usage::tap::Charge for TenantCharge {
    /// Without usage: the estimate, and a token for each chunk that passed
    /// (an engine streams about one token a chunk).
    fn charge(&self, tokens: Option<crate::usage::Tokens>, chunks: u64) {
        let n = tokens.map_or(self.estimate.saturating_add(chunks), |t| t.total());
        self.tenant.charge_tokens(n, self.gateways);
    }
}

/// The usage key of a request to `app` for `model` (the app's name, or an
/// adapter's) by `tenant`.
fn usage_key(
    tenant: Option<&crate::tenants::Tenant>,
    app: &str,
    model: &str,
) -> crate::usage::UsageKey {
    crate::usage::UsageKey {
        tenant: tenant.map_or(crate::usage::NO_TENANT, |t| &t.name).into(),
        app: app.into(),
        model: model.into(),
    }
}

pub(crate) async fn read_model(
    gw: &Gateway,
    req: Request,
    path: &str,
) -> Result<(Arc<Served>, Request), Error> {
    let (mut parts, bytes, reading) =
        crate::http::body::read_body_held(req, gw, BodyLimit::Inference).await?;
    let (model, asks) = request_fields(&bytes)?;
    if let Some(field) = asks.bad_flag {
        return Err(Error::new(
            ErrorKind::BadRequest,
            format!("\"{field}\" must be true or false"),
        )
        .param(field));
    }
    let (app, renamed) = find_model(gw, &model, &mut parts)?;
    let salted = route_by_prompt(gw, &app, path, &mut parts, &bytes);
    // Tokens: the tenant's token rate and largest `max_tokens`, and a
    // stream asked for its usage so that it can be counted.
    let tenant = parts
        .extensions
        .get::<Arc<crate::tenants::Tenant>>()
        .cloned();
    let metered = crate::usage::is_metered(path);
    let cap = token_cap(gw, tenant.as_deref(), &asks, path, metered)?;
    let strip =
        metered && asks.stream && !asks.include_usage && crate::usage::takes_include_usage(path);
    let fields = fields_to_set(path, &asks, renamed, salted, strip, cap)?;
    if metered {
        let model_name = match parts
            .extensions
            .get::<crate::serving::adapter_split::RequestedAdapter>()
        {
            Some(r) => crate::serving::adapter_split::parse_model(&r.engine)
                .0
                .to_string(),
            None => app.name.clone(),
        };
        let asked = asks.max_tokens.or(cap).unwrap_or(0);
        parts.extensions.insert(Metering {
            key: usage_key(tenant.as_deref(), &app.name, &model_name),
            strip,
            estimate: (bytes.len() as u64 / 4).saturating_add(asked),
            tenant,
        });
    }
    let bytes = with_fields(&mut parts, bytes, fields)?;
    let body = reading.into_held(bytes);
    Ok((app, Request::from_parts(parts, Body::new(body))))
}

/// The app a request's `model` names, and the name the engine is to be
/// asked for instead (an adapter's chosen revision), if another.
fn find_model(
    gw: &Gateway,
    model: &str,
    parts: &mut http::request::Parts,
) -> Result<(Arc<Served>, Option<Arc<str>>), Error> {
    let registry = gw.registry.load();
    let mut renamed = None;
    let app = match registry.app(model) {
        Some(app) => app.clone(),
        None => {
            // A LoRA adapter served on an app's replicas: the engine is
            // asked for it by the name it holds the chosen revision under.
            let app = registry.adapter(model).cloned();
            let requested = app.as_ref().and_then(|a| a.adapter_request(model));
            let (Some(app), Some(requested)) = (app, requested) else {
                return Err(model_not_found(gw, model));
            };
            if *requested.engine != *model {
                renamed = Some(requested.engine.clone());
            }
            parts.extensions.insert(requested);
            app
        }
    };
    Ok((app, renamed))
}

/// Keys the request for routing (salted per tenant), and the tenant's
/// cache salt when the engine is to be given it.
fn route_by_prompt(
    gw: &Gateway,
    app: &Served,
    path: &str,
    parts: &mut http::request::Parts,
    bytes: &[u8],
) -> Option<CacheSalt> {
    // A tenant's prompts share no cache with another's (unless the app
    // says they may): indexed apart, and salted for the engine.
    let salt = parts
        .extensions
        .get::<Arc<crate::tenants::Tenant>>()
        .filter(|_| !app.spec().routing.share_cache_across_tenants)
        .map(|t| cache_salt(gw, &t.name));
    if let Some(key) = route_key(app, path, &parts.headers, bytes) {
        let key = match &salt {
            Some(s) => key.salted(s.seed),
            None => key,
        };
        parts.extensions.insert(Arc::new(key));
    }
    salt.filter(|_| is_prompt_path(path) && crate::serving::engine_routes::is_engine(&app.spec()))
}

/// The `max_tokens` a metered request of `tenant` is given (a prompt's,
/// capped by the tenant's), once admitted under its token rate.
fn token_cap(
    gw: &Gateway,
    tenant: Option<&crate::tenants::Tenant>,
    asks: &Asks<'_>,
    path: &str,
    metered: bool,
) -> Result<Option<u64>, Error> {
    let mut cap = None;
    if metered && let Some(t) = tenant {
        if t.has_max_tokens()
            && let Some(field) = asks.max_tokens_malformed
        {
            return Err(Error::new(
                ErrorKind::BadRequest,
                format!("\"{field}\" must be a whole number of tokens (or null)"),
            )
            .param(field));
        }
        cap = t
            .admit_tokens(asks.max_tokens, gw.pool.share().get().1)?
            .filter(|_| is_prompt_path(path));
    }
    Ok(cap)
}

/// A field the gateway sets in the body: its key, its value, and whether
/// the body is known not to have it.
type SetField = (&'static str, Box<serde_json::value::RawValue>, bool);

/// The fields the gateway sets in a request's body: the engine's name
/// for the model, the cache salt, the stream's usage and the token cap.
fn fields_to_set(
    path: &str,
    asks: &Asks<'_>,
    renamed: Option<Arc<str>>,
    salted: Option<CacheSalt>,
    strip: bool,
    cap: Option<u64>,
) -> Result<Vec<SetField>, Error> {
    use crate::serving::json_body::json;
    let mut fields: Vec<SetField> = Vec::new();
    if let Some(name) = &renamed {
        fields.push(("model", json(&**name)?, false));
    }
    if let Some(s) = salted {
        fields.push(("cache_salt", json(&s.text)?, false));
    }
    if strip {
        let options = crate::serving::json_body::include_usage(asks.stream_options)?;
        fields.push(("stream_options", options, asks.stream_options.is_none()));
    }
    if let Some(max) = cap {
        fields.push((max_tokens_field(path), json(&max)?, !asks.max_tokens_sent));
    }
    Ok(fields)
}

/// The body with `fields` set (and its `Content-Length` to match).
fn with_fields(
    parts: &mut http::request::Parts,
    bytes: bytes::Bytes,
    fields: Vec<SetField>,
) -> Result<bytes::Bytes, Error> {
    if fields.is_empty() {
        return Ok(bytes);
    }
    let body = if fields.iter().all(|f| f.2) {
        crate::serving::json_body::prepend(&bytes, &fields)?
    } else {
        let values: Vec<_> = fields.into_iter().map(|(k, v, _)| (k, v)).collect();
        crate::serving::json_body::with_values(&bytes, &values)?
    };
    parts.headers.insert(
        http::header::CONTENT_LENGTH,
        http::HeaderValue::from(body.len()),
    );
    Ok(body)
}

/// A tenant's cache salt: the engine's `cache_salt` and the seed its
/// prompts are indexed under. Derived from the admin token (which every
/// gateway serving together shares) and the tenant's name, so another
/// tenant cannot name it in its own requests to share the first's cache.
struct CacheSalt {
    text: String,
    seed: u64,
}

fn cache_salt(gw: &Gateway, tenant: &str) -> CacheSalt {
    use sha2::Digest as _;
    let mut h = sha2::Sha256::new();
    h.update(b"warmgate cache salt\0");
    h.update(gw.access.admin_token.as_deref().unwrap_or("").as_bytes());
    h.update(b"\0");
    h.update(tenant.as_bytes());
    let d = h.finalize();
    let seed = u64::from_le_bytes(d[..8].try_into().unwrap_or_default());
    CacheSalt {
        text: d[..16].iter().map(|b| format!("{b:02x}")).collect(),
        seed,
    }
}

/// Whether `path` runs a prompt through an engine's KV cache.
fn is_prompt_path(path: &str) -> bool {
    PROMPT_PATHS.contains(&path.split('?').next().unwrap_or(path))
}

/// Paths whose requests run a prompt through an LLM engine's KV cache:
/// the only ones routed by prefix or session (an embedding or a rerank has
/// no cache to reuse, and pays nothing for routing).
const PROMPT_PATHS: [&str; 3] = ["/v1/chat/completions", "/v1/completions", "/v1/responses"];

/// The key a request to `app` is routed on under the app's
/// `[apps.routing]`, if any (see `serving::route`).
fn route_key(
    app: &Served,
    path: &str,
    headers: &http::HeaderMap,
    body: &[u8],
) -> Option<crate::serving::route::RouteKey> {
    use crate::serving::route::key;
    use warmgate_deploy::RoutingPolicy;
    let path = path.split('?').next().unwrap_or(path);
    if !PROMPT_PATHS.contains(&path) {
        return None;
    }
    match app.spec().routing.policy {
        RoutingPolicy::LeastLoaded => None,
        RoutingPolicy::Prefix => key::prompt_key(body),
        RoutingPolicy::Session => key::session_key(
            headers.get(X_SESSION_ID).map(http::HeaderValue::as_bytes),
            body,
        ),
    }
}

/// The header that names a session (the OpenAI `user` field otherwise).
const X_SESSION_ID: &str = "x-session-id";

/// 404 for a model no app answers to, listing those that do.
fn model_not_found(gw: &Gateway, model: &str) -> Error {
    let registry = gw.registry.load();
    let mut names: Vec<&str> = registry.route_names().collect();
    names.sort_unstable();
    // A name can be as long as the body: echo only its start.
    let shown: String = model.chars().take(MAX_ECHOED_CHARS).collect();
    let more = if shown.len() < model.len() { "…" } else { "" };
    Error::new(
        ErrorKind::NotFound,
        format!(
            "model '{shown}{more}' not found; available models: {}",
            if names.is_empty() {
                "none".to_string()
            } else {
                names.join(", ")
            }
        ),
    )
    .param("model")
}

/// The field a request on `path` asks for its largest completion in.
fn max_tokens_field(path: &str) -> &'static str {
    match path.split('?').next().unwrap_or(path) {
        "/v1/chat/completions" => "max_completion_tokens",
        "/v1/responses" => "max_output_tokens",
        _ => "max_tokens",
    }
}

/// What the gateway reads of an OpenAI body besides its `model`.
#[derive(Debug, Default)]
pub(crate) struct Asks<'a> {
    /// `stream: true`.
    pub stream: bool,
    /// `stream_options`, as sent (`null` included).
    pub stream_options: Option<&'a serde_json::value::RawValue>,
    /// `stream_options.include_usage: true`.
    pub include_usage: bool,
    /// The largest completion asked for: `max_tokens`,
    /// `max_completion_tokens` or `max_output_tokens`, the largest given.
    pub max_tokens: Option<u64>,
    /// One of those fields is in the body, whatever its value.
    pub max_tokens_sent: bool,
    /// The first of those fields whose value is not a whole number (or
    /// `null`): refused for a tenant with a `max_tokens`.
    pub max_tokens_malformed: Option<&'static str>,
    /// A flag (`stream`, `stream_options.include_usage`) that is not a
    /// boolean: the request is refused, naming it.
    pub bad_flag: Option<&'static str>,
}

/// A field's raw JSON value when the key is present (`null` included),
/// where `Option<&RawValue>` would read `null` as absent.
#[derive(Default)]
struct Present<'a>(Option<&'a serde_json::value::RawValue>);

impl<'de: 'a, 'a> serde::Deserialize<'de> for Present<'a> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        <&'a serde_json::value::RawValue>::deserialize(d).map(|r| Present(Some(r)))
    }
}

/// The JSON `model` field, without parsing the rest of the body into
/// values: other keys are skipped as they are read, and `model` itself is
/// borrowed from the body (a non-string is skipped, not built).
pub fn model_field(body: &[u8]) -> Result<std::borrow::Cow<'_, str>, Error> {
    request_fields(body).map(|(model, _)| model)
}

/// [`model_field`] and the [`Asks`] of the body, read in the same pass.
pub(crate) fn request_fields(body: &[u8]) -> Result<(std::borrow::Cow<'_, str>, Asks<'_>), Error> {
    use serde_json::value::RawValue;
    #[derive(serde::Deserialize)]
    struct Model<'a> {
        #[serde(borrow, default)]
        model: Scalar<'a>,
        #[serde(borrow, default)]
        stream: Present<'a>,
        #[serde(borrow, default)]
        stream_options: Present<'a>,
        #[serde(borrow, default)]
        max_tokens: Present<'a>,
        #[serde(borrow, default)]
        max_completion_tokens: Present<'a>,
        #[serde(borrow, default)]
        max_output_tokens: Present<'a>,
    }
    #[derive(serde::Deserialize)]
    struct StreamOptions<'a> {
        #[serde(borrow, default)]
        include_usage: Present<'a>,
    }
    /// A flag as the OpenAI API types it: a JSON boolean (or `null`);
    /// `None` for anything else.
    fn flag(raw: Option<&RawValue>) -> Option<bool> {
        match raw.map(RawValue::get) {
            None | Some("null" | "false") => Some(false),
            Some("true") => Some(true),
            Some(_) => None,
        }
    }
    let not_object = |why: String| {
        Error::new(
            ErrorKind::BadRequest,
            format!("the request body must be a JSON object with a \"model\" field ({why})"),
        )
    };
    // serde reads a struct from an array too (`["m"]`); only an object is
    // an OpenAI request.
    if body.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
        return Err(not_object("it is not an object".into()));
    }
    let parsed: Model = serde_json::from_slice(body).map_err(|e| not_object(e.to_string()))?;
    let maxes = [
        &parsed.max_tokens,
        &parsed.max_completion_tokens,
        &parsed.max_output_tokens,
    ];
    let include_usage = match parsed
        .stream_options
        .0
        .and_then(|o| serde_json::from_str::<StreamOptions>(o.get()).ok())
    {
        Some(o) => flag(o.include_usage.0),
        None => Some(false),
    };
    let stream = flag(parsed.stream.0);
    let bad_flag = match (stream, include_usage) {
        (None, _) => Some("stream"),
        (_, None) => Some("stream_options.include_usage"),
        _ => None,
    };
    let names = ["max_tokens", "max_completion_tokens", "max_output_tokens"];
    // Each as given: absent or `null`, a whole number, or neither.
    let read: Vec<(Option<u64>, bool)> = maxes
        .iter()
        .map(|m| match m.0.map(RawValue::get) {
            None | Some("null") => (None, false),
            Some(v) => match v.parse::<u64>() {
                Ok(n) => (Some(n), false),
                Err(_) => (None, true),
            },
        })
        .collect();
    let max_tokens_malformed = read
        .iter()
        .zip(names)
        .find_map(|((_, bad), name)| bad.then_some(name));
    let asks = Asks {
        stream: stream.unwrap_or(false),
        include_usage: include_usage.unwrap_or(false),
        bad_flag,
        stream_options: parsed.stream_options.0,
        max_tokens: read.iter().filter_map(|(n, _)| *n).max(),
        max_tokens_sent: maxes.iter().any(|m| m.0.is_some()),
        max_tokens_malformed,
    };
    named_model(parsed.model).map(|model| (model, asks))
}

/// The app a body's `model` field names: a non-empty string.
fn named_model(model: Scalar<'_>) -> Result<std::borrow::Cow<'_, str>, Error> {
    match model {
        Scalar::Str(s) if !s.is_empty() => Ok(s),
        Scalar::Str(_) => Err(Error::new(
            ErrorKind::BadRequest,
            "the \"model\" field is empty; name an app (see GET /v1/models)",
        )),
        Scalar::Number(_) | Scalar::Other => Err(Error::new(
            ErrorKind::BadRequest,
            "the \"model\" field must be a string naming an app (see GET /v1/models)",
        )),
        Scalar::Absent => Err(Error::new(
            ErrorKind::BadRequest,
            "the request body has no \"model\" field; name an app (see GET /v1/models)",
        )),
    }
}

#[utoipa::path(get, path = "/apps/{app}/{path}", tag = "inference",
    description = "Any method and path, forwarded to one of the app's replicas. `X-Warmgate-Revision` pins a revision.",
    params(("app" = String, Path, description = "App name or alias"), ("path" = String, Path, description = "The worker's path")),
    responses((status = 200, description = "The worker's answer, passed through"), (status = 404, description = "Unknown app", body = ErrorBody)))]
pub(crate) async fn passthrough(State(gw): State<Arc<Gateway>>, req: Request) -> Response {
    let path = req.uri().path();
    let rest = path.strip_prefix("/apps/").unwrap_or("");
    let (name, sub) = match rest.find('/') {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, "/"),
    };
    let Some(app) = gw.registry.load().app(name).cloned() else {
        let err = Error::new(ErrorKind::NotFound, format!("app '{name}' not found"));
        return finish(None, Err(err));
    };
    let admin = is_admin(&gw, req.headers(), req.extensions());
    if let Some(why) = crate::serving::engine_routes::admin_only(&app.spec(), sub)
        && !admin
    {
        let err = Error::new(
            ErrorKind::Unauthorized,
            format!(
                "{sub} of app '{}' needs Authorization: Bearer <the gateway's admin token>: {why}",
                app.name
            ),
        );
        return finish(None, Err(err));
    }
    if let Some(control) = worker_control_path(sub) {
        let instead = if control.contains("lora") {
            "use PUT or DELETE /v1/apps/{app}/adapters/{name}"
        } else {
            "use POST /v1/pools/{pool}/weights or /v1/pools/{pool}/tasks"
        };
        let err = Error::new(
            ErrorKind::NotFound,
            format!("{control} is a control path only the gateway calls; {instead}"),
        );
        return finish(None, Err(err));
    }
    let target = match req.uri().query() {
        Some(q) => format!("{sub}?{q}"),
        None => sub.to_string(),
    };
    // Read as the engine's router reads it: `/v1/chat/%63ompletions` is
    // the chat route.
    let token_route = (req.method() == http::Method::POST
        && crate::usage::is_metered(&crate::serving::engine_routes::normalize(sub)))
    .then(|| sub.to_string());
    let mut req = req;
    if admin {
        // The admin token never reaches a worker.
        req.headers_mut().remove(http::header::AUTHORIZATION);
    }
    let limit = gw.host.config.limits.max_body_bytes;
    if let Err(e) = check_content_length(&req, limit) {
        return finish(None, Err(e));
    }
    // An engine's own routes that spend tokens are counted and charged as
    // the OpenAI routes are (the body is not read here: a stream not
    // asking for its usage is counted as an answer without it).
    let metering = if let Some(sub) = &token_route {
        let tenant = req
            .extensions()
            .get::<Arc<crate::tenants::Tenant>>()
            .cloned();
        if let Some(t) = &tenant
            && let Err(e) = passthrough_tokens(t, sub, &app.name)
        {
            return finish(None, Err(e));
        }
        let length = req
            .headers()
            .get(http::header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok()?.parse::<u64>().ok())
            .unwrap_or(0);
        Some(Metering {
            key: usage_key(tenant.as_deref(), &app.name, &app.name),
            strip: false,
            estimate: length / 4,
            tenant,
        })
    } else {
        None
    };
    let idle = gw.host.config.limits.idle_timeout;
    let req = req.map(|b| Body::new(LimitedBody::new(b, limit, idle)));
    let resp = within_deadline(&gw, serve(&gw, &app, req, &target)).await;
    metered(&gw, resp, metering)
}

/// A tenant's token quotas on a passthrough route that spends tokens:
/// with a token rate or a `max_tokens`, the route is refused, since its
/// body is not read here (its `max_tokens` unchecked, a stream not asked
/// for its usage): the OpenAI route does both.
fn passthrough_tokens(tenant: &crate::tenants::Tenant, sub: &str, app: &str) -> Result<(), Error> {
    if tenant.has_max_tokens() || tenant.has_token_rate() {
        return Err(Error::new(
            ErrorKind::BadRequest,
            format!(
                "tenant '{}' has token quotas, which only the OpenAI routes check: send the request to the gateway's own route (POST /v1/chat/completions, /v1/completions, …) with \"model\": \"{app}\" instead of /apps/{app}{sub}",
                tenant.name
            ),
        ));
    }
    Ok(())
}

/// Whether the request comes with the admin token: in `Authorization`
/// (no tenants), or as the caller the tenant check let through as admin.
fn is_admin(gw: &Gateway, headers: &http::HeaderMap, ext: &http::Extensions) -> bool {
    if ext.get::<crate::http::AdminCaller>().is_some() {
        return true;
    }
    let Some(token) = &gw.access.admin_token else {
        return false;
    };
    headers
        .get(http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .is_some_and(|presented| crate::tenants::same_secret(presented, token))
}

/// The worker contract's control paths (`/weights`, `/invoke`), which only
/// the gateway may call: the passthrough must not let a data-plane client
/// load weights into a replica behind the gateway's back (it would then
/// report a version it does not run) or run a task outside the pool's
/// queue. The path is read as a worker's router would read it: percent
/// escapes decoded, empty and `.` segments dropped, `..` applied, case
/// ignored. Returns the path refused.
pub(crate) fn worker_control_path(path: &str) -> Option<&'static str> {
    let decoded = percent_encoding::percent_decode_str(path).decode_utf8_lossy();
    // Only the first two segments left once `..` is applied matter, and
    // the depth: keep those, not every segment (this runs for every
    // request).
    let mut head: [&str; 2] = ["", ""];
    let mut depth = 0usize;
    for seg in decoded.split(['/', '\\']) {
        match seg {
            "" | "." => {}
            ".." => depth = depth.saturating_sub(1),
            s => {
                if depth < head.len() {
                    head[depth] = s;
                }
                depth += 1;
            }
        }
    }
    let is = |s: &str, what: &str| s.eq_ignore_ascii_case(what);
    match (depth, head) {
        (1.., [first, _]) if is(first, "weights") => Some("/weights"),
        (1.., [first, _]) if is(first, "invoke") => Some("/invoke"),
        // The engine's runtime LoRA API: only the gateway loads adapters,
        // under the names its record holds (a client loading its own
        // folder as `name@n` would have it served as that revision).
        (2, [v1, what]) if is(v1, "v1") && is(what, "load_lora_adapter") => {
            Some("/v1/load_lora_adapter")
        }
        (2, [v1, what]) if is(v1, "v1") && is(what, "unload_lora_adapter") => {
            Some("/v1/unload_lora_adapter")
        }
        _ => None,
    }
}

/// Serves a request of `served`: on its revisions, or on the replicas of
/// the pool that serves it.
async fn serve(gw: &Arc<Gateway>, served: &Served, req: Request, path: &str) -> Response {
    let Some(pool_name) = served.spec().pool.clone() else {
        let (app, result) = gw.serving.serve(served, req, path).await;
        return finish(app.as_deref(), result);
    };
    let result = match gw.registry.load().pool(&pool_name).cloned() {
        Some(pool) => {
            let queue = served.spec().queue.clone();
            crate::tasks::shared::serve(
                &pool,
                &served.name,
                &gw.upstream,
                &queue,
                req,
                path,
                || gw.nudge_pool(&pool),
            )
            .await
        }
        None => Err(Error::new(
            ErrorKind::NoCapacity,
            format!(
                "app '{}' is served by pool '{pool_name}', which is gone",
                served.name
            ),
        )),
    };
    let outcome = match &result {
        Ok(_) => "ok",
        Err(e) => e.kind.as_str(),
    };
    metrics::counter!("warmgate_requests_total", "app" => served.name.clone(), "outcome" => outcome)
        .increment(1);
    result.unwrap_or_else(IntoResponse::into_response)
}

pub(crate) fn finish(app: Option<&App>, result: Result<Response, Error>) -> Response {
    match result {
        Ok(resp) => {
            if let Some(app) = app {
                app.count(None);
            }
            resp
        }
        Err(e) => {
            if let Some(app) = app {
                app.count(Some(e.kind));
            }
            e.into_response()
        }
    }
}

#[utoipa::path(get, path = "/v1/models", tag = "inference",
    responses((status = 200, description = "The apps and their aliases, as OpenAI models, and each app's LoRA adapters with `parent` set to the app", body = Object)))]
pub(crate) async fn models(State(gw): State<Arc<Gateway>>) -> axum::Json<serde_json::Value> {
    let mut data = Vec::new();
    for app in gw.registry.load().apps() {
        let spec = app.spec();
        for id in std::iter::once(&app.name).chain(spec.aliases.iter()) {
            data.push(model_object(id));
        }
        for a in &spec.adapters.models {
            for id in std::iter::once(&a.name).chain(a.aliases.iter()) {
                data.push(adapter_object(id, &app.name));
            }
        }
    }
    axum::Json(json!({"object": "list", "data": data}))
}

/// An adapter as vLLM lists one: a model whose `parent` is the base.
fn adapter_object(id: &str, parent: &str) -> serde_json::Value {
    json!({"id": id, "object": "model", "created": 0, "owned_by": "warmgate", "parent": parent})
}

/// One OpenAI model object.
fn model_object(id: &str) -> serde_json::Value {
    json!({"id": id, "object": "model", "created": 0, "owned_by": "warmgate"})
}

#[utoipa::path(get, path = "/v1/models/{model}", tag = "inference",
    params(("model" = String, Path, description = "An app's name or alias (may contain '/')")),
    responses((status = 200, description = "The model, as OpenAI's retrieve answers", body = Object),
              (status = 404, description = "No app answers to that name", body = ErrorBody)))]
pub(crate) async fn model(
    State(gw): State<Arc<Gateway>>,
    Path(id): Path<String>,
) -> Result<axum::Json<serde_json::Value>, Error> {
    let registry = gw.registry.load();
    if registry.app(&id).is_some() {
        Ok(axum::Json(model_object(&id)))
    } else if let Some(app) = registry.adapter(&id) {
        Ok(axum::Json(adapter_object(&id, &app.name)))
    } else {
        Err(model_not_found(&gw, &id))
    }
}

#[cfg(test)]
mod tests {
    use super::worker_control_path;

    #[test]
    fn control_paths_are_found_however_they_are_spelled() {
        for p in [
            "/weights",
            "/weights/",
            "//Weights",
            "/a/../invoke",
            "/./invoke/x",
            "/%77eights",
            "/%2Fweights",
            "\\weights",
            "/a/b/../../weights",
            "/../weights",
            "/a/../b/../Invoke",
            "/v1/load_lora_adapter",
            "/V1/Unload_Lora_Adapter/",
            "/x/../v1/%6Coad_lora_adapter",
            "//v1//load_lora_adapter",
        ] {
            assert!(worker_control_path(p).is_some(), "{p}");
        }
        for p in [
            "/",
            "/v1/weights",
            "/weightsx",
            "/healthz",
            "/invoke-me",
            "/weights/../x",
            "/a/b/../weights",
            "/v1/load_lora_adapter/x",
            "/v1/models",
            "/load_lora_adapter",
        ] {
            assert!(worker_control_path(p).is_none(), "{p}");
        }
    }
}
