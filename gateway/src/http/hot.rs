//! The hot routes, served without the router: an app's passthrough
//! (`/apps/{app}/…`, any method) and a task (`POST /v1/pools/{pool}/tasks`).
//!
//! axum's router costs about ten allocations a request on these routes
//! (the path parameters and matched path in the extensions map, the
//! route's boxed service and its boxed future, the handler's boxed future)
//! and as many indirect calls; at tens of thousands of requests a second
//! on one core that is a measurable share of the gateway's user time (see
//! `docs/serving-path.md`). [`Edge`] recognises the two routes from the
//! path's bytes and calls their handlers itself, with the same request id,
//! tenant check and handler as through the router; everything else, and
//! anything it is unsure of (a percent-escaped pool name), goes through
//! the router unchanged.

use std::convert::Infallible;
use std::sync::Arc;

use axum::Router;
use axum::body::Body;
use axum::extract::{Path, Request, State};
use axum::response::{IntoResponse as _, Response};
use futures_util::future::Either;
use hyper::body::Incoming;
use tower::ServiceExt as _;

use super::inference::passthrough;
use super::leftover;
use super::request_id::{self, WithId};
use super::tasks::submit_task;
use super::{admit_tenant, held};
use crate::error::{Error, ErrorKind};
use crate::server::Gateway;

/// What the listener serves: the hot routes directly, the rest through
/// [`super::router`].
#[derive(Clone)]
pub struct Edge {
    gw: Arc<Gateway>,
    router: Router,
    /// `[access] allowed_hosts`, when set.
    hosts: Option<Arc<super::host::AllowedHosts>>,
    /// The workers' own listener (`tls.worker_listen`): it serves what
    /// workers call (`/v1/weights/…`) and the probes, nothing else.
    workers_only: bool,
}

/// A hot route, recognised.
enum Hot {
    Passthrough,
    Task { pool: String },
}

impl Edge {
    /// The edge of `gw`: its router and the hot routes beside it.
    pub fn new(gw: Arc<Gateway>) -> Self {
        let router = super::router(gw.clone());
        let hosts = super::host::AllowedHosts::new(&gw.config().access.allowed_hosts);
        Edge {
            gw,
            router,
            hosts: (!hosts.is_empty()).then(|| Arc::new(hosts)),
            workers_only: false,
        }
    }

    /// The edge of the workers' listener: `/v1/weights/…`, `/healthz` and
    /// `/readyz` only; any other path is `404`.
    pub fn for_workers(gw: Arc<Gateway>) -> Self {
        Edge {
            workers_only: true,
            ..Edge::new(gw)
        }
    }

    /// Answers one request; a body its handler left unread is read to its
    /// end before the answer goes out, or the answer closes the connection
    /// (see [`super::leftover`]).
    pub fn serve(
        &self,
        req: http::Request<Incoming>,
    ) -> impl Future<Output = Result<Response, Infallible>> + Send + use<> {
        let asked = leftover::Asked::of(&req);
        let (parts, body) = req.into_parts();
        let (body, rest) = leftover::Watched::new(body);
        let answer = self.route(Request::from_parts(parts, Body::new(body)));
        async move {
            let Ok(resp) = answer.await;
            Ok(leftover::settle(resp, &rest, asked).await)
        }
    }

    /// The answer to `req`, from a hot route or the router.
    fn route(
        &self,
        mut req: Request,
    ) -> impl Future<Output = Result<Response, Infallible>> + Send + use<> {
        if self.workers_only && !is_workers_path(req.uri().path()) {
            let refused = Error::new(
                ErrorKind::NotFound,
                "this is the workers' listener (tls.worker_listen): it serves /v1/weights only; \
                 the API is on the gateway's listen address",
            )
            .into_response();
            return Either::Right(Either::Right(std::future::ready(Ok(refused))));
        }
        if let Some(hosts) = &self.hosts
            && !hosts.admits(&req)
        {
            metrics::counter!("warmgate_host_refused_total").increment(1);
            let refused = Error::new(
                ErrorKind::MisdirectedRequest,
                "this gateway does not serve the host this request names ([access] allowed_hosts)",
            )
            .into_response();
            return Either::Right(Either::Right(std::future::ready(Ok(refused))));
        }
        match recognise(&req) {
            Some(route) => {
                let id = request_id::assign(&mut req);
                let gw = self.gw.clone();
                Either::Left(WithId::new(
                    async move { Ok::<_, Infallible>(answer(gw, route, req).await) },
                    id,
                ))
            }
            None => Either::Right(Either::Left(self.router.clone().oneshot(req))),
        }
    }
}

/// Runs the hot route's handler under the tenant check, as the router's
/// `route_layer` would.
async fn answer(gw: Arc<Gateway>, route: Hot, mut req: Request) -> Response {
    let guard = match admit_tenant(&gw, &mut req) {
        Ok(guard) => guard,
        // An engine's admin route takes the admin token in place of a
        // tenant's key (and only that route of the data plane does).
        Err(_) if matches!(route, Hot::Passthrough) && admin_on_admin_route(&gw, &mut req) => None,
        Err(refused) => return refused.into_response(),
    };
    let resp = match route {
        Hot::Passthrough => passthrough(State(gw), req).await,
        Hot::Task { pool } => {
            let query = req.uri().query().map(str::to_string);
            submit_task(State(gw), Path(pool), axum::extract::RawQuery(query), req)
                .await
                .into_response()
        }
    };
    held(resp, guard)
}

/// What the workers' listener serves.
fn is_workers_path(path: &str) -> bool {
    path.starts_with("/v1/weights/") || path == "/healthz" || path == "/readyz"
}

/// Whether `req` carries the admin token to one of an app's routes that
/// need it (see `serving::engine_routes`); if so it is marked as the
/// admin's, and the token taken off.
fn admin_on_admin_route(gw: &Gateway, req: &mut Request) -> bool {
    let Some(token) = &gw.access.admin_token else {
        return false;
    };
    let presented = req
        .headers()
        .get(http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    if !presented.is_some_and(|p| crate::tenants::same_secret(p, token)) {
        return false;
    }
    let rest = req.uri().path().strip_prefix("/apps/").unwrap_or("");
    let (name, sub) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
    let Some(app) = gw.registry.load().app(name).cloned() else {
        return false;
    };
    if crate::serving::engine_routes::admin_only(&app.spec(), sub).is_none() {
        return false;
    }
    req.headers_mut().remove(http::header::AUTHORIZATION);
    req.extensions_mut().insert(super::AdminCaller);
    true
}

/// The hot route `req` is for, when it surely is one the router would
/// send to the same handler with the same arguments.
fn recognise(req: &Request) -> Option<Hot> {
    let path = req.uri().path();
    // The router's `/apps/{*rest}` matches any method and a non-empty rest;
    // the handler reads the raw path itself. The router empties the body
    // of an answer to HEAD and checks one to CONNECT: those go through it.
    let odd = matches!(*req.method(), http::Method::HEAD | http::Method::CONNECT);
    if !odd
        && path
            .strip_prefix("/apps/")
            .is_some_and(|rest| !rest.is_empty())
    {
        return Some(Hot::Passthrough);
    }
    if req.method() == http::Method::POST {
        let pool = path
            .strip_prefix("/v1/pools/")
            .and_then(|rest| rest.strip_suffix("/tasks"))?;
        // The router would decode escapes in the name: leave those to it.
        if pool.is_empty() || pool.contains(['/', '%']) {
            return None;
        }
        return Some(Hot::Task {
            pool: pool.to_string(),
        });
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn route(method: &str, uri: &str) -> Option<String> {
        let req = http::Request::builder()
            .method(method)
            .uri(uri)
            .body(Body::empty())
            .unwrap();
        recognise(&req).map(|h| match h {
            Hot::Passthrough => "passthrough".to_string(),
            Hot::Task { pool } => format!("task {pool}"),
        })
    }

    #[test]
    fn the_hot_routes_are_recognised_and_anything_doubtful_left_to_the_router() {
        assert_eq!(route("GET", "/apps/echo/").as_deref(), Some("passthrough"));
        assert_eq!(
            route("DELETE", "/apps/echo").as_deref(),
            Some("passthrough")
        );
        assert_eq!(route("GET", "/apps/"), None);
        assert_eq!(route("HEAD", "/apps/echo/"), None);
        assert_eq!(route("GET", "/apps"), None);
        assert_eq!(
            route("POST", "/v1/pools/noop/tasks").as_deref(),
            Some("task noop")
        );
        assert_eq!(
            route("POST", "/v1/pools/noop/tasks?async=true").as_deref(),
            Some("task noop")
        );
        // The router answers these: a wrong method, an escaped name, the
        // batch route, an empty name.
        assert_eq!(route("GET", "/v1/pools/noop/tasks"), None);
        assert_eq!(route("POST", "/v1/pools/no%20op/tasks"), None);
        assert_eq!(route("POST", "/v1/pools/noop/tasks/batch"), None);
        assert_eq!(route("POST", "/v1/pools//tasks"), None);
        assert_eq!(route("POST", "/v1/pools/a/b/tasks"), None);
        assert_eq!(route("POST", "/v1/chat/completions"), None);
    }
}
