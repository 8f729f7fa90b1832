//! An operator replica that does not lead: it serves the apps' traffic on
//! the leader's pods ([`crate::peers`]) and passes every other request
//! (tasks, the control plane, the workers' weights, status) to the
//! leader, so the Service may send anything to any replica.
//!
//! Its `/readyz` is 200 while the leader answered its last reports, so a
//! follower cut off from the leader leaves the Service's endpoints; it
//! keeps serving on the replicas it knows meanwhile.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::Request;
use axum::response::{IntoResponse as _, Response};
use http::header;
use http_body_util::{BodyExt as _, Limited};
use tower::ServiceExt as _;

use crate::Gateway;
use crate::error::{Error, ErrorKind};
use crate::peers::{PEERS_PATH, Table};

/// How often a follower reports to the leader.
pub const REPORT_INTERVAL: Duration = Duration::from_secs(1);
/// A follower whose leader has not answered for this long is not ready.
pub const LEADER_SILENCE: Duration = Duration::from_secs(5);
/// The largest table a follower reads.
const MAX_TABLE_BYTES: usize = 16 << 20;

/// Where the leader is, as the follower last found it.
pub type LeaderAddr = Arc<arc_swap::ArcSwapOption<SocketAddr>>;

/// Whether a follower may answer `path` itself: the data plane of the
/// apps (their OpenAI routes and `/apps/…`) and its own health and
/// metrics. Anything else (the model list too: the leader knows every
/// app) is the leader's.
pub fn serves_here(path: &str) -> bool {
    path.starts_with("/apps/")
        || crate::http::MODEL_ROUTES.contains(&path)
        || matches!(path, "/healthz" | "/metrics")
}

/// The follower's HTTP service. An app it does not serve itself (one on
/// a warm pool, or one the leader has just added) is the leader's too.
pub fn router(gw: Arc<Gateway>, leader: LeaderAddr) -> axum::Router {
    let local = crate::http::router(gw.clone());
    axum::Router::new().fallback(move |req: Request| {
        let (local, gw, leader) = (local.clone(), gw.clone(), leader.clone());
        async move {
            let path = req.uri().path();
            if path == "/readyz" {
                return if gw.peers.leader_heard_within(LEADER_SILENCE) {
                    (http::StatusCode::OK, "ready: serving with the leader").into_response()
                } else {
                    Error::new(
                        ErrorKind::NoCapacity,
                        "this replica has not heard from the leader lately",
                    )
                    .into_response()
                };
            }
            if !serves_here(path) {
                return to_leader(&gw, leader.load_full().as_deref().copied(), req).await;
            }
            let req = match served_here(&gw, req).await {
                Ok(Here::Local(req)) => req,
                Ok(Here::Leader(req)) => {
                    return to_leader(&gw, leader.load_full().as_deref().copied(), req).await;
                }
                Err(e) => return e.into_response(),
            };
            match local.oneshot(req).await {
                Ok(r) => r,
                Err(never) => match never {},
            }
        }
    })
}

/// Where a data-plane request goes.
enum Here {
    Local(Request),
    Leader(Request),
}

/// Whether this gateway's part is 0 on every ready replica of the app
/// (a `concurrency` below the number of gateways): the leader, whose
/// part may not be, takes its requests rather than they wait here.
fn no_part_here(served: &crate::serving::served::Served) -> bool {
    let ready: Vec<_> = served.live().iter().flat_map(|a| a.replicas()).collect();
    !ready.is_empty() && ready.iter().all(|h| h.limit() == 0)
}

/// Local when this gateway serves the app the request names (by
/// `/apps/{app}/…`, or the body's `model`, read within the body limit)
/// and has a part of its replicas.
async fn served_here(gw: &Gateway, req: Request) -> Result<Here, Error> {
    let local = |name: &str| {
        gw.registry
            .load()
            .app(name)
            .is_some_and(|s| !no_part_here(s))
    };
    let path = req.uri().path();
    let name = if let Some(rest) = path.strip_prefix("/apps/") {
        rest.split('/').next().unwrap_or("").to_string()
    } else if crate::http::MODEL_ROUTES.contains(&path) {
        let (parts, bytes) = crate::http::body::read_body(req, gw).await?;
        let model = crate::http::inference::model_field(&bytes)?.into_owned();
        let req = Request::from_parts(parts, Body::from(bytes));
        return Ok(if local(&model) {
            Here::Local(req)
        } else {
            Here::Leader(req)
        });
    } else {
        return Ok(Here::Local(req));
    };
    Ok(if local(&name) {
        Here::Local(req)
    } else {
        Here::Leader(req)
    })
}

/// Passes a request to the leader as it came, and its answer back.
async fn to_leader(gw: &Gateway, leader: Option<SocketAddr>, req: Request) -> Response {
    let Some(addr) = leader else {
        return Error::new(
            ErrorKind::NoCapacity,
            "this replica does not lead and knows no leader yet; try again",
        )
        .into_response();
    };
    let (mut parts, body) = req.into_parts();
    let pq = parts
        .uri
        .path_and_query()
        .map_or("/", |p| p.as_str())
        .to_string();
    parts.uri = match format!("http://{addr}{pq}").parse() {
        Ok(u) => u,
        Err(e) => {
            return Error::new(ErrorKind::BadRequest, format!("bad path: {e}")).into_response();
        }
    };
    // As the data plane forwards: HTTP/1.1, and no hop-by-hop headers.
    parts.version = http::Version::HTTP_11;
    parts.headers.remove(header::HOST);
    crate::serving::proxy::strip_hop_by_hop(&mut parts.headers);
    match gw.upstream.send(Request::from_parts(parts, body)).await {
        Ok(resp) => resp.map(Body::new),
        Err(e) => Error::new(
            ErrorKind::NoCapacity,
            format!("the leader did not answer: {e}"),
        )
        .into_response(),
    }
}

/// One report to the leader at `leader`, and the table it answers
/// followed.
pub async fn report_once(
    gw: &Arc<Gateway>,
    member: &str,
    leader: SocketAddr,
) -> Result<(), String> {
    let token = gw.peers.token().ok_or("no peer token")?.to_string();
    let report = gw.peer_report(member);
    let body = serde_json::to_vec(&report).map_err(|e| e.to_string())?;
    let req = http::Request::post(format!("http://{leader}{PEERS_PATH}"))
        .header(header::CONTENT_TYPE, "application/json")
        .header(header::AUTHORIZATION, format!("Bearer {token}"))
        .body(Body::from(body))
        .map_err(|e| e.to_string())?;
    let resp = tokio::time::timeout(REPORT_INTERVAL * 3, gw.upstream.send(req))
        .await
        .map_err(|_| "the leader took too long to answer".to_string())?
        .map_err(|e| format!("the leader did not answer: {e}"))?;
    let status = resp.status();
    let bytes = Limited::new(resp.into_body(), MAX_TABLE_BYTES)
        .collect()
        .await
        .map_err(|e| format!("reading the leader's table: {e}"))?
        .to_bytes();
    if !status.is_success() {
        return Err(format!(
            "the leader answered {status}: {}",
            String::from_utf8_lossy(&bytes)
        ));
    }
    let table: Table =
        serde_json::from_slice(&bytes).map_err(|e| format!("not a peer table: {e}"))?;
    gw.follow(table).await;
    Ok(())
}

/// Reports to the leader every [`REPORT_INTERVAL`], finding it with
/// `find` (again after a failed report), until dropped.
pub async fn follow<F, Fut>(gw: Arc<Gateway>, member: String, leader: LeaderAddr, mut find: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<SocketAddr>>,
{
    let mut tick = tokio::time::interval(REPORT_INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let addr = match leader.load_full() {
            Some(a) => *a,
            None => match find().await {
                Some(a) => {
                    leader.store(Some(Arc::new(a)));
                    a
                }
                None => continue,
            },
        };
        if let Err(e) = report_once(&gw, &member, addr).await {
            tracing::warn!(leader = %addr, error = %e, "could not report to the leader; looking for it again");
            leader.store(None);
        }
    }
}
