//! Where a replica listens: a TCP address (a pod, or a local worker given
//! `$PORT`), or a Unix socket in a folder only the gateway's user may
//! enter (a local worker given `$WARMGATE_SOCKET`), which no other local
//! user can connect to.

use std::fmt;
use std::io;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// A replica's address.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Endpoint {
    /// A TCP address.
    Tcp(SocketAddr),
    /// A Unix socket's path.
    Unix(Arc<Path>),
}

/// The prefix of a Unix socket's address in its text form.
const UNIX_PREFIX: &str = "unix:";

impl Endpoint {
    /// A Unix socket at `path`.
    pub fn unix(path: impl Into<PathBuf>) -> Self {
        Endpoint::Unix(Arc::from(path.into().into_boxed_path()))
    }

    /// Opens a connection, Nagle off for TCP.
    pub async fn connect(&self) -> io::Result<Stream> {
        match self {
            Endpoint::Tcp(addr) => {
                let s = tokio::net::TcpStream::connect(addr).await?;
                s.set_nodelay(true)?;
                Ok(Stream::Tcp(s))
            }
            Endpoint::Unix(path) => Ok(Stream::Unix(tokio::net::UnixStream::connect(path).await?)),
        }
    }

    /// The `Host` a request to it carries when it has none: the address,
    /// or `localhost` for a socket (what HTTP servers on one expect).
    pub fn authority(&self) -> String {
        match self {
            Endpoint::Tcp(addr) => addr.to_string(),
            Endpoint::Unix(_) => "localhost".to_string(),
        }
    }

    /// The TCP address, when it is one.
    pub fn tcp(&self) -> Option<SocketAddr> {
        match self {
            Endpoint::Tcp(a) => Some(*a),
            Endpoint::Unix(_) => None,
        }
    }
}

impl Endpoint {
    /// Sends `req` (its URI in origin form, `/path?query`) on a connection
    /// of its own, closed once the answer has been read: for calls too
    /// rare to keep a connection for (a probe of a socket, a weight swap).
    pub async fn send_once<B>(
        &self,
        mut req: http::Request<B>,
    ) -> Result<http::Response<hyper::body::Incoming>, String>
    where
        B: http_body::Body + Send + 'static,
        B::Data: Send,
        B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    {
        if !req.headers().contains_key(http::header::HOST)
            && let Ok(host) = http::HeaderValue::from_str(&self.authority())
        {
            req.headers_mut().insert(http::header::HOST, host);
        }
        let stream = self
            .connect()
            .await
            .map_err(|e| format!("could not connect to {self}: {e}"))?;
        let (mut tx, conn) =
            hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
                .await
                .map_err(|e| format!("{self}: {e}"))?;
        tokio::spawn(async move {
            let _ = conn.await;
        });
        tx.send_request(req)
            .await
            .map_err(|e| format!("{self}: {}", crate::probe::error_chain(&e)))
    }
}

impl From<SocketAddr> for Endpoint {
    fn from(addr: SocketAddr) -> Self {
        Endpoint::Tcp(addr)
    }
}

impl fmt::Display for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Endpoint::Tcp(a) => write!(f, "{a}"),
            Endpoint::Unix(p) => write!(f, "{UNIX_PREFIX}{}", p.display()),
        }
    }
}

impl std::str::FromStr for Endpoint {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if let Some(path) = s.strip_prefix(UNIX_PREFIX) {
            if !path.starts_with('/') {
                return Err(format!("{s}: a socket's path must be absolute"));
            }
            return Ok(Endpoint::unix(path));
        }
        s.parse::<SocketAddr>()
            .map(Endpoint::Tcp)
            .map_err(|e| format!("{s}: neither an address nor unix:/path ({e})"))
    }
}

impl serde::Serialize for Endpoint {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> serde::Deserialize<'de> for Endpoint {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = <std::borrow::Cow<'de, str>>::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// A connection to an [`Endpoint`].
#[derive(Debug)]
pub enum Stream {
    /// Over TCP.
    Tcp(tokio::net::TcpStream),
    /// Over a Unix socket.
    Unix(tokio::net::UnixStream),
}

impl AsyncRead for Stream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Tcp(s) => Pin::new(s).poll_read(cx, buf),
            Stream::Unix(s) => Pin::new(s).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Stream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Stream::Tcp(s) => Pin::new(s).poll_write(cx, buf),
            Stream::Unix(s) => Pin::new(s).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Stream::Tcp(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            Stream::Unix(s) => Pin::new(s).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            Stream::Tcp(s) => s.is_write_vectored(),
            Stream::Unix(s) => s.is_write_vectored(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Tcp(s) => Pin::new(s).poll_flush(cx),
            Stream::Unix(s) => Pin::new(s).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Tcp(s) => Pin::new(s).poll_shutdown(cx),
            Stream::Unix(s) => Pin::new(s).poll_shutdown(cx),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_endpoint_reads_back_from_its_text() {
        for text in ["127.0.0.1:8000", "[::1]:9", "unix:/run/w/r-1.sock"] {
            let e: Endpoint = text.parse().expect(text);
            assert_eq!(e.to_string(), text);
            let json = serde_json::to_string(&e).expect("json");
            assert_eq!(serde_json::from_str::<Endpoint>(&json).expect("back"), e);
        }
        assert!("unix:relative.sock".parse::<Endpoint>().is_err());
        assert!("nowhere".parse::<Endpoint>().is_err());
    }

    #[tokio::test]
    async fn a_socket_endpoint_connects() {
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        let dir = tempfile::tempdir().expect("dir");
        let path = dir.path().join("s.sock");
        let listener = tokio::net::UnixListener::bind(&path).expect("bind");
        let server = tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.expect("accept");
            s.write_all(b"hi").await.expect("write");
        });
        let mut c = Endpoint::unix(&path).connect().await.expect("connect");
        let mut got = Vec::new();
        c.read_to_end(&mut got).await.expect("read");
        assert_eq!(got, b"hi");
        server.await.expect("server");
    }
}
