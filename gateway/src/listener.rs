//! The HTTP/1 accept loop: one task per connection, a bound on open
//! connections (those over it are answered by one shared task, not one
//! each), header-read and idle timeouts, TLS when configured (the
//! handshake bounded by the header-read timeout, in the connection's own
//! task), and a graceful drain on shutdown.
//!
//! axum's own `serve` would do, but it sniffs every connection for HTTP/2
//! and hides hyper's knobs; serving HTTP/1 directly is measurably cheaper
//! per request and lets us bound how long a client may hold a socket.

use std::sync::Arc;
use std::time::Duration;

use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio_io_timeout::TimeoutStream;
use warmgate_deploy::LimitsConfig;

use crate::http::hot::Edge;

/// Pause after a failed accept (e.g. out of file descriptors), so the loop
/// does not spin while the condition lasts.
const ACCEPT_ERROR_PAUSE: Duration = Duration::from_millis(50);
/// Time allowed to tell a connection over the limit why it is refused.
const REFUSAL_WRITE_TIMEOUT: Duration = Duration::from_secs(1);
/// Refused connections that may linger at once (answered, then read until
/// the client closes, so it sees the answer rather than a reset). Past
/// these, a refused connection gets the answer written if its socket takes
/// it at once and is closed: a flood of connections then holds no more
/// than this many descriptors beyond `max_connections`, and no task each.
const MAX_LINGERING_REFUSALS: usize = 64;
/// Refused connections handed to the shared task and not yet answered: a
/// small buffer for a burst of accepts.
const REFUSALS_WAITING: usize = 16;

/// The most a connection's read buffer (the request line and headers, and
/// body bytes not yet taken) and its write buffer may each hold; hyper's
/// default is about 400 KiB. 64 KiB takes any header a client library
/// sends (nginx's default is 32 KiB) and bounds the memory of a
/// connection that sends headers alone to about 2 × 64 KiB, which
/// `docs/reliability.md` ("Memory per connection") adds up.
pub const MAX_CONNECTION_BUFFER: usize = 64 * 1024;

/// The bounds on client connections.
#[derive(Debug, Clone, Copy)]
pub struct ConnLimits {
    /// Connections open at once.
    pub max_connections: u32,
    /// See `limits.header_read_timeout`.
    pub header_read_timeout: Duration,
    /// See `limits.idle_timeout`.
    pub idle_timeout: Duration,
}

impl From<&LimitsConfig> for ConnLimits {
    fn from(l: &LimitsConfig) -> Self {
        ConnLimits {
            max_connections: l.max_connections,
            header_read_timeout: l.header_read_timeout,
            idle_timeout: l.idle_timeout,
        }
    }
}

/// Serves `edge` on `listener` (over TLS when `tls` is given) until
/// `shutdown` resolves, then stops accepting and waits for the open
/// connections to finish their requests.
pub async fn serve(
    listener: TcpListener,
    edge: Edge,
    limits: ConnLimits,
    tls: Option<Arc<crate::tls::ServerTls>>,
    shutdown: impl Future<Output = ()>,
) {
    let graceful = GracefulShutdown::new();
    let slots = Arc::new(Semaphore::new(limits.max_connections as usize));
    // One task answers every refused connection.
    let (refused, lingering) = tokio::sync::mpsc::channel(REFUSALS_WAITING);
    let shedder = tokio::spawn(shed(lingering, limits.max_connections));
    tokio::pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(conn) => conn,
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(ACCEPT_ERROR_PAUSE).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let _ = stream.set_nodelay(true);
        let Ok(permit) = slots.clone().try_acquire_owned() else {
            metrics::counter!("warmgate_connections_refused_total").increment(1);
            if let Err(tokio::sync::mpsc::error::TrySendError::Full(stream)) =
                refused.try_send(stream)
            {
                refuse_now(&stream, limits.max_connections);
            }
            continue;
        };
        let edge = edge.clone();
        // A response the client stops reading ends the connection after
        // `idle_timeout`; hyper's header-read timeout covers slow headers
        // and idle keep-alive connections. Reads are not timed here: a
        // request held in the queue legitimately reads nothing for long.
        let mut io = TimeoutStream::new(stream);
        io.set_write_timeout(Some(limits.idle_timeout));
        let watcher = graceful.watcher();
        let tls = tls.clone();
        tokio::spawn(async move {
            match tls {
                None => serve_connection(Box::pin(io), edge, limits, watcher, peer).await,
                Some(tls) => {
                    // The handshake counts toward the header-read timeout:
                    // a client that opens and says nothing holds a slot no
                    // longer than one that sends no headers.
                    let accept = tls.acceptor().accept(Box::pin(io));
                    match tokio::time::timeout(limits.header_read_timeout, accept).await {
                        Ok(Ok(stream)) => {
                            serve_connection(Box::pin(stream), edge, limits, watcher, peer).await;
                        }
                        Ok(Err(e)) => {
                            metrics::counter!("warmgate_tls_handshake_failures_total").increment(1);
                            tracing::debug!(%peer, error = %e, "TLS handshake failed");
                        }
                        Err(_) => {
                            metrics::counter!("warmgate_tls_handshake_failures_total").increment(1);
                            tracing::debug!(%peer, "TLS handshake timed out");
                        }
                    }
                }
            }
            drop(permit);
        });
    }
    drop(listener);
    drop(refused);
    graceful.shutdown().await;
    let _ = shedder.await;
}

/// Serves HTTP/1 on one accepted connection until it ends, or until the
/// gateway drains.
async fn serve_connection<I>(
    io: std::pin::Pin<Box<I>>,
    edge: Edge,
    limits: ConnLimits,
    watcher: hyper_util::server::graceful::Watcher,
    peer: std::net::SocketAddr,
) where
    I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + 'static,
{
    let service = hyper::service::service_fn(move |req: http::Request<Incoming>| edge.serve(req));
    let conn = http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout)
        .max_buf_size(MAX_CONNECTION_BUFFER)
        .serve_connection(TokioIo::new(io), service);
    if let Err(e) = watcher.watch(conn).await {
        tracing::debug!(%peer, error = %e, "connection ended with an error");
    }
}

/// Answers the refused connections sent to it, at most
/// [`MAX_LINGERING_REFUSALS`] at once, all in this one task.
async fn shed(mut refused: tokio::sync::mpsc::Receiver<TcpStream>, max: u32) {
    use futures_util::StreamExt as _;
    let mut lingering = futures_util::stream::FuturesUnordered::new();
    loop {
        tokio::select! {
            next = refused.recv(), if lingering.len() < MAX_LINGERING_REFUSALS => match next {
                Some(stream) => lingering.push(refuse(stream, max)),
                None => break,
            },
            Some(()) = lingering.next(), if !lingering.is_empty() => {}
        }
    }
    while lingering.next().await.is_some() {}
}

/// The refusal of [`refuse`], written only if the socket takes it without
/// waiting; the connection closes when `stream` is dropped.
fn refuse_now(stream: &TcpStream, max: u32) {
    let (head, body) = refusal(max);
    let mut answer = head.into_bytes();
    answer.extend_from_slice(body.as_bytes());
    let _ = stream.try_write(&answer);
}

/// The `503` answer to a connection over the limit: head and body.
fn refusal(max: u32) -> (String, String) {
    let body = format!(
        "{{\"error\":{{\"kind\":\"no_capacity\",\"message\":\"the gateway has {max} connections \
         open, its limit (limits.max_connections); retry shortly\"}}}}"
    );
    let head = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n\
         retry-after: 1\r\nconnection: close\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    (head, body)
}

/// Answers a connection over `limits.max_connections` with a `503` in the
/// JSON error format, then closes it, so the client learns why at once
/// rather than timing out in the kernel's backlog.
async fn refuse(mut stream: TcpStream, max: u32) {
    let (head, body) = refusal(max);
    // Then read until the client closes (a lingering close, as nginx does):
    // closing with its request unread would reset the connection, and the
    // client would see the reset instead of the answer.
    let _ = tokio::time::timeout(REFUSAL_WRITE_TIMEOUT, async {
        stream.write_all(head.as_bytes()).await?;
        stream.write_all(body.as_bytes()).await?;
        stream.shutdown().await?;
        let mut sink = [0u8; 1024];
        while stream.read(&mut sink).await? > 0 {}
        std::io::Result::Ok(())
    })
    .await;
}
