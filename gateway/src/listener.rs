//! The HTTP/1 accept loop: one task per connection, header-read timeouts,
//! and a graceful drain on shutdown.
//!
//! axum's own `serve` would do, but it sniffs every connection for HTTP/2
//! and hides hyper's knobs; serving HTTP/1 directly is measurably cheaper
//! per request and lets us bound how long a client may take to send headers.

use std::time::Duration;

use axum::Router;
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::TcpListener;
use tower::ServiceExt as _;

/// A client must send its request headers within this time: long enough for
/// a slow network, short enough that idle half-open sockets do not pile up.
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(30);
/// Pause after a failed accept (e.g. out of file descriptors), so the loop
/// does not spin while the condition lasts.
const ACCEPT_ERROR_PAUSE: Duration = Duration::from_millis(50);

/// Serves `router` on `listener` until `shutdown` resolves, then stops
/// accepting and waits for the open connections to finish their requests.
pub async fn serve(listener: TcpListener, router: Router, shutdown: impl Future<Output = ()>) {
    let graceful = GracefulShutdown::new();
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
        let router = router.clone();
        let service = hyper::service::service_fn(move |req: http::Request<Incoming>| {
            router.clone().oneshot(req)
        });
        let conn = http1::Builder::new()
            .timer(TokioTimer::new())
            .header_read_timeout(HEADER_READ_TIMEOUT)
            .serve_connection(TokioIo::new(stream), service);
        let conn = graceful.watch(conn);
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!(%peer, error = %e, "connection ended with an error");
            }
        });
    }
    drop(listener);
    graceful.shutdown().await;
}
