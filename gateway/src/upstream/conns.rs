//! Keep-alive HTTP/1 connections to replicas, kept per replica address.
//!
//! A request takes the connection given back last (so under light load
//! few stay open and the rest time out), sends on it, and gives it back
//! when its answer's body has ended; a connection whose answer was not
//! read to the end is closed with it. This is what the generic pooled
//! client does, without its checkout racing a connect, its pool-wide
//! lock and its task per request that waits for the connection to be
//! ready again: a forwarded request costs a map read, a lock and a pop.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};
use warmgate_pool::Endpoint;

use axum::body::Body;
use bytes::Bytes;
use http::{HeaderValue, Request, Response, Uri, header};
use http_body::{Body as HttpBody, Frame, SizeHint};
use hyper::body::Incoming;
use hyper::client::conn::http1::{self, SendRequest};
use hyper_util::rt::TokioIo;
use parking_lot::{Mutex, RwLock};

/// Why a request to a replica got no answer.
#[derive(Debug, thiserror::Error)]
pub enum SendError {
    /// No connection could be made: nothing was sent, so another replica
    /// may take the request.
    #[error("could not connect to {addr}: {source}")]
    Connect {
        /// The replica's address.
        addr: Endpoint,
        /// What the connect returned.
        #[source]
        source: std::io::Error,
    },
    /// The connection failed while, or after, the request was sent.
    #[error(transparent)]
    Http(#[from] hyper::Error),
}

impl SendError {
    /// Nothing was sent.
    pub fn is_connect(&self) -> bool {
        matches!(self, SendError::Connect { .. })
    }
}

/// A request that got no answer: why, and the request itself when
/// nothing of it was sent (so it may go to another replica, body and all).
#[derive(Debug)]
pub struct Failed {
    /// Why.
    pub error: SendError,
    /// The request, untouched, when no connection could be made.
    pub unsent: Option<Box<Request<Body>>>,
}

impl From<SendError> for Failed {
    fn from(error: SendError) -> Self {
        Failed {
            error,
            unsent: None,
        }
    }
}

/// How connections are made and kept.
#[derive(Debug, Clone, Copy)]
pub struct Settings {
    /// A connect that has not finished by then fails.
    pub connect_timeout: Duration,
    /// Idle connections older than this are closed.
    pub idle_timeout: Duration,
    /// Idle connections kept per replica; more are closed.
    pub max_idle_per_host: usize,
}

/// The connections to every replica the gateway has sent to lately.
pub struct Conns {
    hosts: RwLock<HashMap<Endpoint, Arc<Host>>>,
    settings: Settings,
    started: Instant,
    /// When hosts with nothing open are next dropped, in ms after `started`.
    next_sweep_ms: AtomicU64,
}

/// One replica address and its idle connections, the last returned on top.
struct Host {
    addr: Endpoint,
    /// `Host:` for requests that do not carry one.
    authority: HeaderValue,
    idle: Mutex<Vec<Idle>>,
    max_idle: usize,
}

struct Idle {
    tx: SendRequest<Body>,
    since: Instant,
}

impl Conns {
    /// An empty set of connections.
    pub fn new(settings: Settings) -> Self {
        Conns {
            hosts: RwLock::new(HashMap::new()),
            settings,
            started: Instant::now(),
            next_sweep_ms: AtomicU64::new(settings.idle_timeout.as_millis() as u64),
        }
    }

    /// Sends `req` to the replica at `addr` on an idle connection, or a
    /// new one. The request's URI is sent in origin form (its path and
    /// query); without a `Host` header it gets `addr`. When no connection
    /// can be made the request comes back unsent.
    pub async fn send(
        &self,
        addr: &Endpoint,
        mut req: Request<Body>,
    ) -> Result<Response<Returned>, Failed> {
        self.sweep();
        let host = self.host(addr);
        if !req.headers().contains_key(header::HOST) {
            req.headers_mut()
                .insert(header::HOST, host.authority.clone());
        }
        if req.uri().scheme().is_some() || req.uri().authority().is_some() {
            let origin = req
                .uri()
                .path_and_query()
                .map_or_else(|| Uri::from_static("/"), |pq| Uri::from(pq.clone()));
            *req.uri_mut() = origin;
        }
        // An idle connection the replica has closed meanwhile hands the
        // request back unsent; then the next one, or a new one, takes it.
        while let Some(mut tx) = host.take(self.settings.idle_timeout) {
            match tx.try_send_request(req).await {
                Ok(resp) => return Ok(Returned::wrap(resp, tx, host)),
                Err(mut e) => match e.take_message() {
                    Some(back) => req = back,
                    None => return Err(SendError::Http(e.into_error()).into()),
                },
            }
        }
        let mut tx = match self.connect(addr).await {
            Ok(tx) => tx,
            Err(error) => {
                return Err(Failed {
                    error,
                    unsent: Some(Box::new(req)),
                });
            }
        };
        match tx.try_send_request(req).await {
            Ok(resp) => Ok(Returned::wrap(resp, tx, host)),
            // A new connection that closed before it took the request
            // hands it back too: nothing was sent.
            Err(mut e) => Err(Failed {
                unsent: e.take_message().map(Box::new),
                error: SendError::Http(e.into_error()),
            }),
        }
    }

    fn host(&self, addr: &Endpoint) -> Arc<Host> {
        if let Some(h) = self.hosts.read().get(addr) {
            return h.clone();
        }
        self.hosts
            .write()
            .entry(addr.clone())
            .or_insert_with(|| {
                Arc::new(Host {
                    addr: addr.clone(),
                    authority: HeaderValue::from_str(&addr.authority())
                        .expect("an address or localhost is a valid header value"),
                    idle: Mutex::new(Vec::new()),
                    max_idle: self.settings.max_idle_per_host,
                })
            })
            .clone()
    }

    async fn connect(&self, addr: &Endpoint) -> Result<SendRequest<Body>, SendError> {
        let connect_error = |source| SendError::Connect {
            addr: addr.clone(),
            source,
        };
        let stream = tokio::time::timeout(self.settings.connect_timeout, addr.connect())
            .await
            .map_err(|_| {
                connect_error(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!("no connection within {:?}", self.settings.connect_timeout),
                ))
            })?
            .map_err(connect_error)?;
        let (tx, conn) = http1::Builder::new()
            .handshake(TokioIo::new(stream))
            .await?;
        let addr = addr.clone();
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!(%addr, error = %e, "replica connection ended");
            }
        });
        Ok(tx)
    }

    /// Once per idle timeout, closes the idle connections past it and
    /// forgets the replicas that have none left and none in use (replicas
    /// come and go; their addresses must not pile up).
    fn sweep(&self) {
        let now_ms = self.started.elapsed().as_millis() as u64;
        let due = self.next_sweep_ms.load(Ordering::Relaxed);
        if now_ms < due {
            return;
        }
        let next = now_ms + self.settings.idle_timeout.as_millis() as u64;
        if self
            .next_sweep_ms
            .compare_exchange(due, next, Ordering::Relaxed, Ordering::Relaxed)
            .is_err()
        {
            return;
        }
        let timeout = self.settings.idle_timeout;
        self.hosts.write().retain(|_, h| {
            let mut idle = h.idle.lock();
            idle.retain(|i| i.since.elapsed() <= timeout && !i.tx.is_closed());
            !idle.is_empty() || Arc::strong_count(h) > 1
        });
    }

    /// Idle connections kept now to `addr`.
    #[cfg(test)]
    fn idle(&self, addr: &Endpoint) -> usize {
        self.hosts
            .read()
            .get(addr)
            .map_or(0, |h| h.idle.lock().len())
    }
}

impl Host {
    /// The connection given back last that is still open and young enough.
    fn take(&self, timeout: Duration) -> Option<SendRequest<Body>> {
        let mut idle = self.idle.lock();
        while let Some(i) = idle.pop() {
            if i.since.elapsed() > timeout {
                // The rest were given back earlier still.
                idle.clear();
                return None;
            }
            if !i.tx.is_closed() {
                return Some(i.tx);
            }
        }
        None
    }

    fn give_back(&self, tx: SendRequest<Body>) {
        if tx.is_closed() {
            return;
        }
        let mut idle = self.idle.lock();
        if idle.len() >= self.max_idle.max(1) {
            idle.remove(0);
        }
        idle.push(Idle {
            tx,
            since: Instant::now(),
        });
    }
}

/// A replica's answer body; its connection goes back to the idle ones
/// when the body has been read to the end, and is closed if it is dropped
/// before.
pub struct Returned {
    inner: Incoming,
    lease: Option<(SendRequest<Body>, Arc<Host>)>,
}

impl Returned {
    fn wrap(resp: Response<Incoming>, tx: SendRequest<Body>, host: Arc<Host>) -> Response<Self> {
        let (parts, inner) = resp.into_parts();
        let mut body = Returned {
            inner,
            lease: Some((tx, host)),
        };
        if body.inner.is_end_stream() {
            body.release();
        }
        Response::from_parts(parts, body)
    }

    /// The answer has ended: the connection can carry the next request,
    /// once its reader has taken in the end (nearly always at once).
    fn release(&mut self) {
        let Some((mut tx, host)) = self.lease.take() else {
            return;
        };
        if tx.is_ready() {
            host.give_back(tx);
            return;
        }
        tokio::spawn(async move {
            if tx.ready().await.is_ok() {
                host.give_back(tx);
            }
        });
    }
}

impl HttpBody for Returned {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        match &polled {
            Poll::Ready(None) => self.release(),
            // Trailers are the last frame: the server will not poll again.
            Poll::Ready(Some(Ok(frame))) if frame.is_trailers() || self.inner.is_end_stream() => {
                self.release()
            }
            Poll::Ready(Some(Err(_))) => self.lease = None,
            _ => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl std::fmt::Debug for Returned {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let addr = self.lease.as_ref().map(|(_, h)| h.addr.clone());
        f.debug_struct("Returned").field("replica", &addr).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt as _;
    use std::sync::atomic::AtomicUsize;

    /// A replica that counts its connections and answers `size` bytes to
    /// any request; with `close_idle`, it closes each connection after one
    /// answer (as a worker whose keep-alive timeout passed).
    async fn replica(size: usize, one_per_conn: bool) -> (Endpoint, Arc<AtomicUsize>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = Endpoint::Tcp(listener.local_addr().unwrap());
        let accepted = Arc::new(AtomicUsize::new(0));
        let count = accepted.clone();
        tokio::spawn(async move {
            loop {
                let (stream, _) = listener.accept().await.unwrap();
                count.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(async move {
                    let svc =
                        hyper::service::service_fn(move |req: Request<Incoming>| async move {
                            let host = req.headers().get(header::HOST).cloned();
                            let mut resp =
                                Response::new(http_body_util::Full::new(Bytes::from(vec![
                                    b'x';
                                    size
                                ])));
                            resp.headers_mut().insert(
                                "x-target",
                                HeaderValue::from_str(&req.uri().to_string()).unwrap(),
                            );
                            if let Some(h) = host {
                                resp.headers_mut().insert("x-host", h);
                            }
                            Ok::<_, std::convert::Infallible>(resp)
                        });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .keep_alive(!one_per_conn)
                        .serve_connection(TokioIo::new(stream), svc)
                        .await;
                });
            }
        });
        (addr, accepted)
    }

    #[tokio::test]
    async fn a_replica_on_a_unix_socket_is_sent_to_with_host_localhost_and_kept_alive() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("r.sock");
        let listener = tokio::net::UnixListener::bind(&path).unwrap();
        let accepted = Arc::new(AtomicUsize::new(0));
        let count = accepted.clone();
        tokio::spawn(async move {
            loop {
                let (stream, _) = listener.accept().await.unwrap();
                count.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(async move {
                    let svc = hyper::service::service_fn(|req: Request<Incoming>| async move {
                        let host = req.headers()[header::HOST].to_str().unwrap().to_string();
                        Ok::<_, std::convert::Infallible>(Response::new(http_body_util::Full::new(
                            Bytes::from(host),
                        )))
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), svc)
                        .await;
                });
            }
        });
        let addr = Endpoint::unix(&path);
        let c = conns();
        for _ in 0..3 {
            let resp = c.send(&addr, get("/")).await.unwrap();
            let body = resp.into_body().collect().await.unwrap().to_bytes();
            assert_eq!(&body[..], b"localhost");
            until(|| c.idle(&addr) == 1).await;
        }
        assert_eq!(
            accepted.load(Ordering::SeqCst),
            1,
            "one connection, kept alive"
        );
    }

    fn conns() -> Conns {
        Conns::new(Settings {
            connect_timeout: Duration::from_secs(5),
            idle_timeout: Duration::from_secs(30),
            max_idle_per_host: 4,
        })
    }

    fn get(uri: &str) -> Request<Body> {
        Request::get(uri).body(Body::empty()).unwrap()
    }

    /// Waits (bounded) until `f` holds.
    async fn until(mut f: impl FnMut() -> bool) {
        for _ in 0..500 {
            if f() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("condition not met within 5 s");
    }

    #[tokio::test]
    async fn answers_read_to_the_end_leave_their_connection_for_the_next_request() {
        let (addr, accepted) = replica(100_000, false).await;
        let c = conns();
        for _ in 0..5 {
            let resp = c
                .send(&addr, get("http://example.invalid/a?b=1"))
                .await
                .unwrap();
            assert_eq!(resp.headers()["x-target"], "/a?b=1", "origin form");
            assert_eq!(resp.headers()["x-host"], addr.to_string().as_str());
            let body = resp.into_body().collect().await.unwrap().to_bytes();
            assert_eq!(body.len(), 100_000);
            until(|| c.idle(&addr) == 1).await;
        }
        assert_eq!(
            accepted.load(Ordering::SeqCst),
            1,
            "one connection carried all five"
        );
    }

    #[tokio::test]
    async fn an_answer_dropped_before_its_end_takes_its_connection_with_it() {
        let (addr, accepted) = replica(4 << 20, false).await;
        let c = conns();
        let resp = c.send(&addr, get("/big")).await.unwrap();
        let mut body = resp.into_body();
        body.frame().await.unwrap().unwrap();
        drop(body);
        assert_eq!(c.idle(&addr), 0);
        let resp = c.send(&addr, get("/big")).await.unwrap();
        let n = resp.into_body().collect().await.unwrap().to_bytes().len();
        assert_eq!(n, 4 << 20, "the next request gets a whole answer");
        assert_eq!(accepted.load(Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn a_connection_the_replica_closed_is_not_used_again() {
        let (addr, accepted) = replica(10, true).await;
        let c = conns();
        for i in 1..=3 {
            let resp = c.send(&addr, get("/")).await.unwrap();
            assert_eq!(
                resp.into_body().collect().await.unwrap().to_bytes().len(),
                10
            );
            assert_eq!(accepted.load(Ordering::SeqCst), i);
        }
    }

    #[tokio::test]
    async fn a_refused_connect_is_a_connect_error_and_sends_nothing() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = Endpoint::Tcp(listener.local_addr().unwrap());
        drop(listener);
        let failed = conns().send(&addr, get("/again")).await.unwrap_err();
        let err = failed.error;
        assert!(err.is_connect(), "{err}");
        assert!(err.to_string().contains(&addr.to_string()), "{err}");
        let back = failed.unsent.expect("the request comes back");
        assert_eq!(back.uri(), "/again");
    }

    #[tokio::test]
    async fn idle_connections_are_capped_per_replica_and_old_ones_closed() {
        let (addr, _) = replica(10, false).await;
        let c = Conns::new(Settings {
            connect_timeout: Duration::from_secs(5),
            idle_timeout: Duration::from_millis(200),
            max_idle_per_host: 2,
        });
        let resps = futures_util::future::join_all((0..4).map(|_| c.send(&addr, get("/")))).await;
        for r in resps {
            r.unwrap().into_body().collect().await.unwrap();
        }
        until(|| c.idle(&addr) == 2).await;
        tokio::time::sleep(Duration::from_millis(250)).await;
        // Past the idle timeout the next request sweeps the old ones and
        // connects afresh; the replica nobody uses is forgotten.
        let (other, _) = replica(10, false).await;
        c.send(&other, get("/"))
            .await
            .unwrap()
            .into_body()
            .collect()
            .await
            .unwrap();
        assert_eq!(c.idle(&addr), 0);
        assert!(!c.hosts.read().contains_key(&addr));
    }
}
