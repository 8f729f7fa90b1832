//! Logging, and OTLP trace export behind the `otlp` cargo feature.
//!
//! With the feature, and `OTEL_EXPORTER_OTLP_ENDPOINT` (or
//! `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) set, every `tracing` span (the
//! per-request `request` span above all) is exported over OTLP/HTTP
//! protobuf, as a child of the client's `traceparent` when it sent one.
//! Without the feature none of the OpenTelemetry crates are built.

use tracing_subscriber::Layer as _;
use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::util::SubscriberInitExt as _;

/// How `serve` writes its log.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

/// Keeps the trace exporter alive; flushes it when dropped.
#[derive(Default)]
pub struct Guard {
    #[cfg(feature = "otlp")]
    provider: Option<opentelemetry_sdk::trace::SdkTracerProvider>,
}

impl Drop for Guard {
    fn drop(&mut self) {
        #[cfg(feature = "otlp")]
        if let Some(p) = self.provider.take() {
            let _ = p.shutdown();
        }
    }
}

/// A writer that escapes control characters in one formatted log line
/// (`\n` as `\\n`, others as `\\xNN`) but for the line's own final
/// newline. The text formatter writes each event whole, in one call.
pub struct Escaping<W>(pub W);

impl<W: std::io::Write> std::io::Write for Escaping<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let body = buf.strip_suffix(b"\n").unwrap_or(buf);
        if !body.iter().any(|&b| is_control(b)) {
            self.0.write_all(buf)?;
            return Ok(buf.len());
        }
        let mut out = Vec::with_capacity(buf.len() + 16);
        for &b in body {
            match b {
                b'\n' => out.extend_from_slice(b"\\n"),
                b'\r' => out.extend_from_slice(b"\\r"),
                b if is_control(b) => out.extend_from_slice(format!("\\x{b:02x}").as_bytes()),
                b => out.push(b),
            }
        }
        if body.len() < buf.len() {
            out.push(b'\n');
        }
        self.0.write_all(&out)?;
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.0.flush()
    }
}

fn is_control(b: u8) -> bool {
    (b < 0x20 && b != b'\t') || b == 0x7f
}

/// Installs the global subscriber: `WARMGATE_LOG` filtering (or the usual
/// `RUST_LOG` when it is unset), text or JSON lines on stderr (coloured
/// only on a terminal, and never with `NO_COLOR` set), and OTLP export
/// when built in and configured.
pub fn init(format: LogFormat) -> Guard {
    let filter = tracing_subscriber::EnvFilter::try_from_env("WARMGATE_LOG")
        .or_else(|_| tracing_subscriber::EnvFilter::try_from_env("RUST_LOG"))
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let colour = std::io::IsTerminal::is_terminal(&std::io::stderr())
        && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty());
    let lines = match format {
        LogFormat::Json => tracing_subscriber::fmt::layer()
            .json()
            .with_current_span(true)
            .flatten_event(true)
            .with_writer(std::io::stderr)
            .boxed(),
        // Colour goes to a terminal, where a person reads; a log file or a
        // pipe gets every control character of what the line quotes
        // escaped, so a newline in a client's or a worker's text cannot
        // forge a line of its own.
        LogFormat::Text if colour => tracing_subscriber::fmt::layer()
            .with_ansi(true)
            .with_writer(std::io::stderr)
            .boxed(),
        LogFormat::Text => tracing_subscriber::fmt::layer()
            .with_ansi(false)
            .with_writer(|| Escaping(std::io::stderr()))
            .boxed(),
    };
    let registry = tracing_subscriber::registry().with(filter).with(lines);
    #[cfg(feature = "otlp")]
    {
        let configured = [
            "OTEL_EXPORTER_OTLP_ENDPOINT",
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
        ]
        .iter()
        .any(|k| std::env::var_os(k).is_some());
        let (layer, provider) = match configured.then(|| otlp::provider(None)) {
            Some(Ok(p)) => (Some(otlp::layer(&p)), Some(p)),
            Some(Err(e)) => {
                eprintln!("warmgate: OTLP export is off: {e}");
                (None, None)
            }
            None => (None, None),
        };
        let _ = registry.with(layer).try_init();
        Guard { provider }
    }
    #[cfg(not(feature = "otlp"))]
    {
        let _ = registry.try_init();
        Guard::default()
    }
}

/// Makes `span` a child of the client's trace context, for OTLP.
#[cfg(feature = "otlp")]
pub fn set_parent(span: &tracing::Span, headers: &http::HeaderMap) {
    use opentelemetry::propagation::TextMapPropagator as _;
    use tracing_opentelemetry::OpenTelemetrySpanExt as _;
    let cx = opentelemetry_sdk::propagation::TraceContextPropagator::new()
        .extract(&otlp::Headers(headers));
    let _ = span.set_parent(cx);
}

/// Without OTLP there is no span context to link.
#[cfg(not(feature = "otlp"))]
pub fn set_parent(_span: &tracing::Span, _headers: &http::HeaderMap) {}

#[cfg(feature = "otlp")]
pub mod otlp {
    //! The OTLP exporter and its `tracing` layer.

    use opentelemetry::trace::TracerProvider as _;

    /// Reads trace context from request headers.
    pub struct Headers<'a>(pub &'a http::HeaderMap);

    impl opentelemetry::propagation::Extractor for Headers<'_> {
        fn get(&self, key: &str) -> Option<&str> {
            self.0.get(key).and_then(|v| v.to_str().ok())
        }

        fn keys(&self) -> Vec<&str> {
            self.0.keys().map(|k| k.as_str()).collect()
        }
    }

    /// A provider exporting in batches over OTLP/HTTP protobuf, to
    /// `endpoint` or to what the `OTEL_EXPORTER_OTLP_*` variables say.
    pub fn provider(
        endpoint: Option<String>,
    ) -> Result<opentelemetry_sdk::trace::SdkTracerProvider, String> {
        use opentelemetry_otlp::WithExportConfig as _;
        let mut builder = opentelemetry_otlp::SpanExporter::builder().with_http();
        if let Some(e) = endpoint {
            builder = builder.with_endpoint(e);
        }
        let exporter = builder.build().map_err(|e| e.to_string())?;
        Ok(opentelemetry_sdk::trace::SdkTracerProvider::builder()
            .with_batch_exporter(exporter)
            .with_resource(
                opentelemetry_sdk::Resource::builder()
                    .with_service_name("warmgate")
                    .build(),
            )
            .build())
    }

    /// The `tracing` layer that feeds `provider`.
    pub fn layer<S>(
        provider: &opentelemetry_sdk::trace::SdkTracerProvider,
    ) -> tracing_opentelemetry::OpenTelemetryLayer<S, opentelemetry_sdk::trace::Tracer>
    where
        S: tracing::Subscriber + for<'span> tracing_subscriber::registry::LookupSpan<'span>,
    {
        tracing_opentelemetry::layer().with_tracer(provider.tracer("warmgate"))
    }

    #[cfg(test)]
    mod tests {
        use std::io::{Read as _, Write as _};
        use std::sync::mpsc;

        use tracing_subscriber::layer::SubscriberExt as _;

        /// A one-request OTLP collector on loopback: answers 200 and hands
        /// over the request head and body.
        fn collector() -> (String, mpsc::Receiver<(String, Vec<u8>)>) {
            let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
            let addr = listener.local_addr().expect("addr");
            let (tx, rx) = mpsc::channel();
            std::thread::spawn(move || {
                for stream in listener.incoming().flatten() {
                    let mut stream = stream;
                    let mut buf = Vec::new();
                    let mut chunk = [0u8; 65536];
                    // Read the head, then Content-Length bytes of body.
                    loop {
                        let n = stream.read(&mut chunk).unwrap_or(0);
                        if n == 0 {
                            break;
                        }
                        buf.extend_from_slice(&chunk[..n]);
                        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                            let head = String::from_utf8_lossy(&buf[..end]).to_string();
                            let len = head
                                .lines()
                                .find_map(|l| {
                                    let (k, v) = l.split_once(':')?;
                                    k.eq_ignore_ascii_case("content-length")
                                        .then(|| v.trim().parse::<usize>().ok())?
                                })
                                .unwrap_or(0);
                            while buf.len() < end + 4 + len {
                                let n = stream.read(&mut chunk).unwrap_or(0);
                                if n == 0 {
                                    break;
                                }
                                buf.extend_from_slice(&chunk[..n]);
                            }
                            let body = buf[end + 4..].to_vec();
                            let _ = stream.write_all(
                                b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n",
                            );
                            let _ = tx.send((head, body));
                            break;
                        }
                    }
                }
            });
            (format!("http://{addr}/v1/traces"), rx)
        }

        #[test]
        fn spans_reach_an_otlp_collector_as_children_of_the_client_trace() {
            let (endpoint, rx) = collector();
            let provider = super::provider(Some(endpoint)).expect("provider");
            let subscriber = tracing_subscriber::registry().with(super::layer(&provider));
            tracing::subscriber::with_default(subscriber, || {
                let span = tracing::info_span!("request", app = "m");
                let mut headers = http::HeaderMap::new();
                headers.insert(
                    "traceparent",
                    http::HeaderValue::from_static(
                        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
                    ),
                );
                crate::telemetry::set_parent(&span, &headers);
                span.in_scope(|| tracing::info!("inside"));
            });
            provider.shutdown().expect("flush");
            let (head, body) = rx
                .recv_timeout(std::time::Duration::from_secs(30))
                .expect("the collector got a request");
            assert!(head.starts_with("POST /v1/traces"), "{head}");
            assert!(
                head.to_ascii_lowercase()
                    .contains("content-type: application/x-protobuf"),
                "{head}"
            );
            // The protobuf carries the span's name and the client's trace
            // id (as raw bytes).
            let trace_id: Vec<u8> = (0..16)
                .map(|i| {
                    u8::from_str_radix(&"4bf92f3577b34da6a3ce929d0e0e4736"[2 * i..2 * i + 2], 16)
                        .expect("hex")
                })
                .collect();
            assert!(body.windows(7).any(|w| w == b"request"), "span name");
            assert!(
                body.windows(16).any(|w| w == trace_id.as_slice()),
                "trace id"
            );
            assert!(body.windows(8).any(|w| w == b"warmgate"), "service name");
        }
    }
}

#[cfg(test)]
mod escaping_tests {
    use super::Escaping;
    use std::io::Write as _;

    #[test]
    fn a_quoted_newline_or_escape_cannot_forge_a_line() {
        let mut out = Escaping(Vec::new());
        out.write_all(b"INFO gate stderr=\"ok\nERROR forged \x1b[31mred\r\"\n")
            .expect("write");
        out.write_all(b"INFO plain line\n").expect("write");
        let text = String::from_utf8(out.0).expect("utf8");
        assert_eq!(
            text,
            "INFO gate stderr=\"ok\\nERROR forged \\x1b[31mred\\r\"\nINFO plain line\n"
        );
        assert_eq!(text.lines().count(), 2);
    }
}
