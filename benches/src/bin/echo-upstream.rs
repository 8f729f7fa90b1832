//! A fast upstream for proxy benchmarks: answers every request with a short
//! fixed body, and `GET /healthz` as the worker contract asks. Listens on
//! `127.0.0.1:$PORT`; exits on SIGTERM.

use std::convert::Infallible;
use std::net::SocketAddr;

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;

const BODY: &[u8] = b"{\"ok\":true,\"worker\":\"echo-upstream\"}\n";

async fn handle(req: Request<Incoming>) -> Result<Response<Full<Bytes>>, Infallible> {
    let body = if req.uri().path() == "/healthz" {
        Bytes::from_static(b"{\"status\":\"ok\"}")
    } else {
        Bytes::from_static(BODY)
    };
    Ok(Response::builder()
        .header("content-type", "application/json")
        .body(Full::new(body))
        .expect("static response"))
}

fn main() -> anyhow::Result<()> {
    let port: u16 = std::env::var("PORT")
        .map_err(|_| anyhow::anyhow!("PORT must be set"))?
        .parse()?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let addr = SocketAddr::from(([127, 0, 0, 1], port));
        let listener = tokio::net::TcpListener::bind(addr).await?;
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        loop {
            tokio::select! {
                accepted = listener.accept() => {
                    let (stream, _) = match accepted {
                        Ok(s) => s,
                        Err(_) => continue,
                    };
                    let _ = stream.set_nodelay(true);
                    tokio::spawn(async move {
                        let _ = http1::Builder::new()
                            .serve_connection(TokioIo::new(stream), service_fn(handle))
                            .await;
                    });
                }
                _ = term.recv() => return Ok(()),
            }
        }
    })
}
