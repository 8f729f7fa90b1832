//! A fast upstream for proxy benchmarks: answers every request with a short
//! fixed body, and `GET /healthz` as the worker contract asks. A `POST`
//! whose body says `"stream":true` is answered as vLLM streams a chat:
//! `$ECHO_TOKENS` (default 16) events of one token each, one body frame
//! apiece, and the usage chunk when the body asks for it with
//! `"include_usage":true`. Listens on `127.0.0.1:$PORT`; exits on SIGTERM.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;

use bytes::Bytes;
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, Response};
use hyper_util::rt::TokioIo;
use warmgate_benches::{chat_stream_frames, contains};

const BODY: &[u8] = b"{\"ok\":true,\"worker\":\"echo-upstream\"}\n";

type Answer = Response<UnsyncBoxBody<Bytes, Infallible>>;

/// The two streamed answers, built once: with and without usage.
struct Streams {
    plain: Vec<Bytes>,
    usage: Vec<Bytes>,
}

async fn handle(req: Request<Incoming>, streams: Arc<Streams>) -> Result<Answer, Infallible> {
    let health = req.uri().path() == "/healthz";
    if req.method() == Method::POST {
        let body = match req.into_body().collect().await {
            Ok(b) => b.to_bytes(),
            Err(_) => Bytes::new(),
        };
        if contains(&body, b"\"stream\":true") {
            let frames = if contains(&body, b"\"include_usage\":true") {
                streams.usage.clone()
            } else {
                streams.plain.clone()
            };
            let frames = futures_util::stream::iter(
                frames
                    .into_iter()
                    .map(|f| Ok::<_, Infallible>(Frame::data(f))),
            );
            return Ok(Response::builder()
                .header("content-type", "text/event-stream")
                .body(StreamBody::new(frames).boxed_unsync())
                .expect("static response"));
        }
    }
    let body = if health {
        Bytes::from_static(b"{\"status\":\"ok\"}")
    } else {
        Bytes::from_static(BODY)
    };
    Ok(Response::builder()
        .header("content-type", "application/json")
        .body(Full::new(body).boxed_unsync())
        .expect("static response"))
}

fn main() -> anyhow::Result<()> {
    let port: u16 = std::env::var("PORT")
        .map_err(|_| anyhow::anyhow!("PORT must be set"))?
        .parse()?;
    let tokens: usize = match std::env::var("ECHO_TOKENS") {
        Ok(v) => v.parse()?,
        Err(_) => 16,
    };
    let streams = Arc::new(Streams {
        plain: chat_stream_frames(tokens, false),
        usage: chat_stream_frames(tokens, true),
    });
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
                    let streams = streams.clone();
                    tokio::spawn(async move {
                        let _ = http1::Builder::new()
                            .serve_connection(
                                TokioIo::new(stream),
                                service_fn(move |req| handle(req, streams.clone())),
                            )
                            .await;
                    });
                }
                _ = term.recv() => return Ok(()),
            }
        }
    })
}
