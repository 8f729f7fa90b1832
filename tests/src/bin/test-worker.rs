//! `test-worker`: a fixture worker process for warmgate's end-to-end tests.
//!
//! It follows the worker contract (listen on `$WARMGATE_SOCKET` when the
//! gateway offers one, else on `127.0.0.1:$PORT`; answer
//! `GET /healthz` once ready, drain in-flight requests on SIGTERM/SIGINT and
//! exit 0) and lets tests script its behaviour:
//!
//! * at startup, through `TEST_WORKER_*` environment variables (slow start,
//!   never ready, immediate exit, default latency);
//! * per request, through query parameters or `x-test-*` headers (latency,
//!   status code, crash, crash mid-body, a body broken off by a live
//!   worker, server-sent events).
//!
//! `GET /stats` exposes in-flight / peak / total request counters so tests can
//! check how the gateway spreads and limits load.
//!
//! Weights: at startup it loads `$WARMGATE_WEIGHTS_URL` (version
//! `$WARMGATE_WEIGHTS_VERSION`) when set, and `POST /weights {"url",
//! "version"}` swaps them in place. Loading reads every file of the
//! manifest and keeps their SHA-256, which `/stats` reports. A replica named
//! in `TEST_WORKER_WEIGHTS_FAIL` (comma-separated ids) answers 500 to
//! `POST /weights`; one in `TEST_WORKER_WEIGHTS_HANG` never answers; with
//! `TEST_WORKER_NO_WEIGHTS` set it has no `POST /weights` at all (404);
//! `TEST_WORKER_WEIGHTS_DELAY_MS` draws each swap out by that long.
//! `TEST_WORKER_WEIGHTS_NO_HASH=1` skips the hashing (for benchmarks of the
//! transport). `TEST_WORKER_WEIGHTS_LOCAL=1` reads a file where the
//! manifest's `path` says it lies on this machine, as the Python kit does,
//! instead of over HTTP. A checkpoint with a file named `BROKEN` makes the worker
//! answer every other request with 500: a deliberately broken model. One
//! with a file named `SLOW` adds 200 ms to every request. One with a file
//! named `CRASH` cannot be loaded: the worker prints a CUDA out-of-memory
//! error and exits 1 at start, and a `POST /weights` of it answers 500.

use std::collections::{BTreeMap, HashMap};
use std::convert::Infallible;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use anyhow::Context as _;
use axum::Router;
use axum::body::{Body, Bytes, to_bytes};
use axum::extract::{Query, Request, State};
use axum::http::header::{CACHE_CONTROL, CONTENT_TYPE};
use axum::http::request::Parts;
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use futures_util::StreamExt as _;
use futures_util::stream;
use serde::Serialize;
use serde_json::{Value, json};
use tokio::signal::unix::{Signal, SignalKind, signal};

/// Exit code used when a request asks the worker to crash.
const CRASH_EXIT_CODE: i32 = 17;
/// Exit code for a missing or invalid `PORT`.
const USAGE_EXIT_CODE: i32 = 2;
/// Largest request body the worker reads.
const MAX_BODY_BYTES: usize = 64 * 1024 * 1024;
/// Delay between the partial chunk and the exit of a `crash_mid` request.
const CRASH_MID_DELAY: Duration = Duration::from_millis(50);
/// Default delay between server-sent events.
const DEFAULT_SSE_INTERVAL: Duration = Duration::from_millis(100);
/// Number of events streamed when an OpenAI request sets `"stream": true`.
const OPENAI_STREAM_EVENTS: u32 = 5;
/// Latency a checkpoint marked `SLOW` adds.
const SLOW_CHECKPOINT: Duration = Duration::from_millis(200);
/// Dimension of the fake embeddings.
const EMBEDDING_DIM: u64 = 8;

fn main() {
    if let Some(code) = exit_code_at_start() {
        eprintln!("test-worker: TEST_WORKER_EXIT_AT_START={code}, exiting before binding");
        std::process::exit(code);
    }
    let bind = match bind_from_env() {
        Ok(bind) => bind,
        Err(message) => {
            eprintln!("test-worker: {message}");
            std::process::exit(USAGE_EXIT_CODE);
        }
    };
    let config = Config::from_env(bind);

    let result = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("building the tokio runtime")
        .and_then(|runtime| runtime.block_on(run(config)));
    if let Err(err) = result {
        eprintln!("test-worker: {err:#}");
        std::process::exit(1);
    }
}

/// Waits for the simulated model load, serves until SIGTERM/SIGINT, then
/// drains the requests in flight.
async fn run(config: Config) -> anyhow::Result<()> {
    // Install the handlers first so a signal during the startup delay is a
    // clean exit rather than the default "killed by signal".
    let mut signals = ShutdownSignals::install()?;
    if !config.startup_delay.is_zero() {
        tokio::select! {
            () = tokio::time::sleep(config.startup_delay) => {}
            name = signals.wait() => {
                eprintln!("test-worker: received {name} during startup, exiting");
                return Ok(());
            }
        }
    }

    let bind = config.bind.clone();
    let listener = listen(&bind).await?;

    let (loaded, weights_seconds) = load_startup_weights().await?;
    let close = Arc::new(tokio::sync::Notify::new());
    let state = Arc::new(AppState {
        config,
        counters: Arc::default(),
        pid: std::process::id(),
        close: close.clone(),
        reopen_after: std::sync::Mutex::new(None),
        weights_seconds,
        weights_version: AtomicU64::new(loaded.version),
        broken: std::sync::atomic::AtomicBool::new(loaded.broken),
        slow: std::sync::atomic::AtomicBool::new(loaded.slow),
        weights: tokio::sync::Mutex::new(loaded),
        http: reqwest::Client::new(),
    });
    let app = Router::new()
        .route("/healthz", get(healthz))
        .route("/stats", get(stats))
        .route("/close-listener", axum::routing::post(close_listener))
        .route("/invoke", axum::routing::post(invoke))
        .route("/weights", axum::routing::post(swap_weights))
        .fallback(handle_request)
        .with_state(state.clone());

    // A signal stops the worker whether it listens or not.
    let stop = Arc::new(tokio::sync::Notify::new());
    {
        let stop = stop.clone();
        tokio::spawn(async move {
            let name = signals.wait().await;
            eprintln!("test-worker: received {name}, draining in-flight requests");
            stop.notify_one();
        });
    }
    serve_until_stopped(listener, &bind, app, &state, &close, &stop).await?;
    eprintln!("test-worker: stopped");
    Ok(())
}

/// Loads `$WARMGATE_WEIGHTS_URL` (version `$WARMGATE_WEIGHTS_VERSION`)
/// when it is set; what was loaded (nothing when unset) and how many
/// seconds loading took.
async fn load_startup_weights() -> anyhow::Result<(Loaded, Option<f64>)> {
    let mut loaded = Loaded::default();
    let mut weights_seconds = None;
    if let Ok(url) = std::env::var("WARMGATE_WEIGHTS_URL") {
        let version = std::env::var("WARMGATE_WEIGHTS_VERSION")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        loaded = load_weights(&reqwest::Client::new(), &url, version)
            .await
            .with_context(|| format!("loading the weights at {url}"))?;
        eprintln!(
            "test-worker: loaded weights version {version} ({} bytes)",
            loaded.bytes
        );
        weights_seconds = Some(loaded.finished_ms.saturating_sub(loaded.started_ms) as f64 / 1e3);
    }
    Ok((loaded, weights_seconds))
}

/// Serves `app` on `listener` until `stop` (a signal) is notified. A
/// `POST /close-listener` (`close`) closes the listener but keeps the
/// worker alive: for good (until a signal), or for its `reopen_after`,
/// then listening again where it was.
async fn serve_until_stopped(
    mut listener: Listening,
    bind: &Bind,
    app: Router,
    state: &AppState,
    close: &Arc<tokio::sync::Notify>,
    stop: &Arc<tokio::sync::Notify>,
) -> anyhow::Result<()> {
    loop {
        let by_request = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (flag, close, signalled) = (by_request.clone(), close.clone(), stop.clone());
        let shutdown = async move {
            tokio::select! {
                () = signalled.notified() => {}
                () = close.notified() => {
                    flag.store(true, Ordering::SeqCst);
                    eprintln!("test-worker: closing the listener but staying alive");
                }
            }
        };
        match listener {
            Listening::Tcp(l) => {
                axum::serve(l, app.clone())
                    .with_graceful_shutdown(shutdown)
                    .await
            }
            Listening::Unix(l) => {
                axum::serve(l, app.clone())
                    .with_graceful_shutdown(shutdown)
                    .await
            }
        }
        .context("serving")?;
        if !by_request.load(Ordering::SeqCst) {
            break;
        }
        let reopen = *state.reopen_after.lock().unwrap_or_else(|e| e.into_inner());
        // A worker that is alive but refuses connections: for good (until
        // a signal), or for a while, then listening again where it was.
        let Some(after) = reopen else {
            stop.notified().await;
            break;
        };
        tokio::select! {
            () = tokio::time::sleep(after) => {}
            () = stop.notified() => break,
        }
        if let Bind::Socket(path) = bind {
            let _ = std::fs::remove_file(path);
        }
        listener = listen(bind).await?;
    }
    Ok(())
}

/// Binds where the gateway said to listen.
async fn listen(bind: &Bind) -> anyhow::Result<Listening> {
    Ok(match bind {
        Bind::Port(port) => {
            let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, *port));
            let l = tokio::net::TcpListener::bind(addr)
                .await
                .with_context(|| format!("binding {addr}"))?;
            eprintln!("test-worker listening on {addr}");
            Listening::Tcp(l)
        }
        Bind::Socket(path) => {
            let l = tokio::net::UnixListener::bind(path)
                .with_context(|| format!("binding {}", path.display()))?;
            eprintln!("test-worker listening on {}", path.display());
            Listening::Unix(l)
        }
    })
}

/// `POST /close-listener`: stop accepting connections but keep the process
/// alive, to test how the gateway handles a worker that refuses connections;
/// with `?reopen_ms=N`, listen again where it was after N ms.
/// The answer closes its connection: the shutdown closes it anyway, and a
/// client that kept it would race that close with its next request, which
/// then fails on a connection the worker never read (not the refused
/// connect the tests are about).
async fn close_listener(
    State(state): State<Arc<AppState>>,
    Query(q): Query<HashMap<String, String>>,
) -> (StatusCode, [(axum::http::HeaderName, &'static str); 1]) {
    let reopen = q
        .get("reopen_ms")
        .and_then(|v| v.parse().ok())
        .map(Duration::from_millis);
    *state.reopen_after.lock().unwrap_or_else(|e| e.into_inner()) = reopen;
    state.close.notify_one();
    (
        StatusCode::ACCEPTED,
        [(axum::http::header::CONNECTION, "close")],
    )
}

// ---------------------------------------------------------------------------
// Startup configuration
// ---------------------------------------------------------------------------

/// Where to listen.
#[derive(Clone)]
enum Bind {
    /// `127.0.0.1:$PORT`.
    Port(u16),
    /// `$WARMGATE_SOCKET`.
    Socket(std::path::PathBuf),
}

/// A bound listener.
enum Listening {
    Tcp(tokio::net::TcpListener),
    Unix(tokio::net::UnixListener),
}

/// Everything read from the environment at startup.
struct Config {
    /// Where to listen (`WARMGATE_SOCKET`, else `PORT`).
    bind: Bind,
    /// `TEST_WORKER_STARTUP_MS`: delay before binding.
    startup_delay: Duration,
    /// `TEST_WORKER_NEVER_READY=1`: `/healthz` always answers 503.
    never_ready: bool,
    /// `TEST_WORKER_LATENCY_MS`: latency added to each request by default.
    default_latency: Duration,
    /// The contract variables, reported by `/stats` and the echo answers.
    env: WorkerEnv,
}

impl Config {
    fn from_env(bind: Bind) -> Self {
        Self {
            bind,
            startup_delay: env_millis("TEST_WORKER_STARTUP_MS"),
            never_ready: std::env::var("TEST_WORKER_NEVER_READY").is_ok_and(|v| parse_flag(&v)),
            default_latency: env_millis("TEST_WORKER_LATENCY_MS"),
            env: WorkerEnv::from_env(),
        }
    }

    /// `$WARMGATE_REPLICA`, or `null` when unset.
    fn replica(&self) -> Option<&str> {
        self.env.replica.as_deref()
    }

    /// `$WARMGATE_REVISION`, or `null` when unset.
    fn revision(&self) -> Option<&str> {
        self.env.revision.as_deref()
    }
}

/// The environment variables warmgate passes to its workers, as seen by this
/// process (`null` when unset).
#[derive(Serialize)]
struct WorkerEnv {
    #[serde(rename = "PORT")]
    port: Option<String>,
    #[serde(rename = "WARMGATE_REPLICA")]
    replica: Option<String>,
    #[serde(rename = "WARMGATE_TARGET")]
    target: Option<String>,
    #[serde(rename = "WARMGATE_REVISION")]
    revision: Option<String>,
    #[serde(rename = "CUDA_VISIBLE_DEVICES")]
    cuda_visible_devices: Option<String>,
}

impl WorkerEnv {
    fn from_env() -> Self {
        let var = |name: &str| std::env::var_os(name).map(|v| v.to_string_lossy().into_owned());
        Self {
            port: var("PORT"),
            replica: var("WARMGATE_REPLICA"),
            target: var("WARMGATE_TARGET"),
            revision: var("WARMGATE_REVISION"),
            cuda_visible_devices: var("CUDA_VISIBLE_DEVICES"),
        }
    }
}

/// The socket the gateway offers (`WARMGATE_SOCKET`), else `PORT`.
fn bind_from_env() -> Result<Bind, String> {
    match std::env::var_os("WARMGATE_SOCKET").filter(|s| !s.is_empty()) {
        Some(path) => Ok(Bind::Socket(path.into())),
        None => port_from_env().map(Bind::Port),
    }
}

/// Reads `PORT`, which is required and must be in `1..=65535`.
fn port_from_env() -> Result<u16, String> {
    let raw = std::env::var("PORT").map_err(|_| "PORT must be set to the port to listen on")?;
    match raw.trim().parse::<u16>() {
        Ok(port) if port != 0 => Ok(port),
        _ => Err(format!(
            "invalid PORT {raw:?}: expected an integer in 1..=65535"
        )),
    }
}

/// Whether `url` has the origin of `WARMGATE_GATEWAY_URL` (else of
/// `WARMGATE_WEIGHTS_URL`); without either, any URL (a worker run by hand).
fn on_the_gateway(url: &str) -> bool {
    let Some(base) = std::env::var("WARMGATE_GATEWAY_URL")
        .or_else(|_| std::env::var("WARMGATE_WEIGHTS_URL"))
        .ok()
    else {
        return true;
    };
    match (reqwest::Url::parse(&base), reqwest::Url::parse(url)) {
        (Ok(b), Ok(u)) => b.origin() == u.origin(),
        _ => false,
    }
}

/// `TEST_WORKER_EXIT_AT_START`: the code to exit with before binding, if set.
fn exit_code_at_start() -> Option<i32> {
    let raw = std::env::var("TEST_WORKER_EXIT_AT_START").ok()?;
    let code = raw.trim().parse().ok();
    if code.is_none() {
        eprintln!("test-worker: ignoring invalid TEST_WORKER_EXIT_AT_START={raw:?}");
    }
    code
}

/// A duration in milliseconds from the environment; zero when unset or invalid.
fn env_millis(name: &str) -> Duration {
    let Ok(raw) = std::env::var(name) else {
        return Duration::ZERO;
    };
    parse_millis(&raw).unwrap_or_else(|| {
        eprintln!("test-worker: ignoring invalid {name}={raw:?}");
        Duration::ZERO
    })
}

/// Parses a non-negative integer number of milliseconds.
fn parse_millis(raw: &str) -> Option<Duration> {
    raw.trim().parse().ok().map(Duration::from_millis)
}

/// `1`, `true`, `yes` and `on` (any case) are true; anything else is false.
fn parse_flag(raw: &str) -> bool {
    matches!(
        raw.trim().to_ascii_lowercase().as_str(),
        "1" | "true" | "yes" | "on"
    )
}

// ---------------------------------------------------------------------------
// Signals
// ---------------------------------------------------------------------------

/// The signals that ask the worker to stop.
struct ShutdownSignals {
    term: Signal,
    int: Signal,
}

impl ShutdownSignals {
    fn install() -> anyhow::Result<Self> {
        Ok(Self {
            term: signal(SignalKind::terminate()).context("installing the SIGTERM handler")?,
            int: signal(SignalKind::interrupt()).context("installing the SIGINT handler")?,
        })
    }

    /// Resolves with the name of the first signal received.
    async fn wait(&mut self) -> &'static str {
        tokio::select! {
            _ = self.term.recv() => "SIGTERM",
            _ = self.int.recv() => "SIGINT",
        }
    }
}

// ---------------------------------------------------------------------------
// Shared state and in-flight accounting
// ---------------------------------------------------------------------------

/// State shared by all handlers.
struct AppState {
    config: Config,
    counters: Arc<Counters>,
    pid: u32,
    /// Notified by `POST /close-listener`.
    close: Arc<tokio::sync::Notify>,
    /// How long the listener it closes stays closed (`None`: for good).
    reopen_after: std::sync::Mutex<Option<Duration>>,
    /// The weights loaded; the lock is held while a swap loads new ones.
    weights: tokio::sync::Mutex<Loaded>,
    /// The version loaded, readable while a swap holds the lock.
    weights_version: AtomicU64,
    /// How long loading the weights took at start, for `/healthz`.
    weights_seconds: Option<f64>,
    /// The loaded checkpoint is marked broken.
    broken: std::sync::atomic::AtomicBool,
    /// The loaded checkpoint is marked slow.
    slow: std::sync::atomic::AtomicBool,
    http: reqwest::Client,
}

/// What a weights load read.
#[derive(Debug, Clone, Default, Serialize)]
struct Loaded {
    /// The checkpoint has a `BROKEN` file.
    broken: bool,
    /// The checkpoint has a `SLOW` file.
    slow: bool,
    version: u64,
    bytes: u64,
    files: u64,
    /// SHA-256 of the files' contents, in manifest order.
    sha256: Option<String>,
    /// Unix milliseconds when the load started and finished.
    started_ms: u128,
    finished_ms: u128,
}

fn unix_ms() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis())
}

/// Reads every file of the checkpoint at `url` (the gateway's weights URL).
async fn load_weights(http: &reqwest::Client, url: &str, version: u64) -> anyhow::Result<Loaded> {
    use sha2::Digest as _;
    #[derive(serde::Deserialize)]
    struct Manifest {
        files: Vec<File>,
    }
    #[derive(serde::Deserialize)]
    struct File {
        name: String,
        #[serde(default)]
        size: u64,
        /// Where the file lies on this machine, when the gateway offers it.
        path: Option<std::path::PathBuf>,
    }
    // The gateway serves weights only with the worker's token.
    let token = std::env::var("WARMGATE_WEIGHTS_TOKEN").unwrap_or_default();
    let manifest: Manifest = http
        .get(url)
        .bearer_auth(&token)
        .send()
        .await?
        .error_for_status()?
        .json()
        .await?;
    if manifest.files.iter().any(|f| f.name == "CRASH") {
        anyhow::bail!(
            "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 GiB \
             (the checkpoint has a CRASH file)"
        );
    }
    let started_ms = unix_ms();
    let hash = !std::env::var("TEST_WORKER_WEIGHTS_NO_HASH").is_ok_and(|v| parse_flag(&v));
    let mut hasher = sha2::Sha256::new();
    let local = std::env::var("TEST_WORKER_WEIGHTS_LOCAL").is_ok_and(|v| parse_flag(&v));
    let mut bytes = 0u64;
    for f in &manifest.files {
        if local && let Some(path) = &f.path {
            let (path, size) = (path.clone(), f.size);
            // A copy of the digest so far: a read that fails midway must
            // leave the checkpoint's own untouched.
            let partial = hash.then(|| hasher.clone());
            let read = tokio::task::spawn_blocking(move || read_local(&path, size, partial))
                .await
                .context("the local read panicked")?;
            // A copy that is not the file the manifest names (changed
            // meanwhile) is read over HTTP instead, as the kit does.
            if let Some((n, digest)) = read {
                bytes += n;
                if let Some(d) = digest {
                    hasher = d;
                }
                continue;
            }
        }
        let mut resp = http
            .get(format!("{url}/{}", f.name))
            .bearer_auth(&token)
            .send()
            .await?
            .error_for_status()?;
        while let Some(chunk) = resp.chunk().await? {
            bytes += chunk.len() as u64;
            if hash {
                hasher.update(&chunk);
            }
        }
    }
    Ok(Loaded {
        broken: manifest.files.iter().any(|f| f.name == "BROKEN"),
        slow: manifest.files.iter().any(|f| f.name == "SLOW"),
        version,
        bytes,
        files: manifest.files.len() as u64,
        sha256: hash.then(|| format!("{:x}", hasher.finalize())),
        started_ms,
        finished_ms: unix_ms(),
    })
}

/// Reads the file at `path` where it lies, when it is a regular file of
/// `size` bytes, into `hasher` when given (as its bytes over HTTP would
/// be): how many bytes, and the hasher. `None`: not usable here.
fn read_local(
    path: &std::path::Path,
    size: u64,
    mut hasher: Option<sha2::Sha256>,
) -> Option<(u64, Option<sha2::Sha256>)> {
    use sha2::Digest as _;
    use std::io::Read as _;
    let mut file = std::fs::File::open(path).ok()?;
    let meta = file.metadata().ok()?;
    if !meta.is_file() || meta.len() != size {
        return None;
    }
    let mut buf = vec![0u8; 8 << 20];
    let mut n = 0u64;
    loop {
        let got = file.read(&mut buf).ok()?;
        if got == 0 {
            break;
        }
        n += got as u64;
        if let Some(h) = hasher.as_mut() {
            h.update(&buf[..got]);
        }
    }
    (n == size).then_some((n, hasher))
}

/// Whether `$name` (comma-separated replica ids) names this replica.
fn listed(name: &str, replica: Option<&str>) -> bool {
    let (Ok(list), Some(me)) = (std::env::var(name), replica) else {
        return false;
    };
    list.split(',').any(|r| r.trim() == me)
}

/// `POST /weights {"url", "version"}`: loads new weights in place.
async fn swap_weights(State(state): State<Arc<AppState>>, body: Bytes) -> Response {
    #[derive(serde::Deserialize)]
    struct Swap {
        url: String,
        version: u64,
    }
    let swap: Swap = match serde_json::from_slice(&body) {
        Ok(s) => s,
        Err(e) => {
            return (
                StatusCode::BAD_REQUEST,
                axum::Json(json!({"error": format!("bad body: {e}")})),
            )
                .into_response();
        }
    };
    // The worker's token goes to the gateway that started it only.
    if !on_the_gateway(&swap.url) {
        return (
            StatusCode::BAD_REQUEST,
            axum::Json(json!({
                "error": "the weights URL is not on the gateway this worker was started by"
            })),
        )
            .into_response();
    }
    let replica = state.config.replica();
    // A stock server without in-place sync: the route is not there.
    if std::env::var_os("TEST_WORKER_NO_WEIGHTS").is_some() {
        return (
            StatusCode::NOT_FOUND,
            axum::Json(json!({"error": "no such route"})),
        )
            .into_response();
    }
    if listed("TEST_WORKER_WEIGHTS_HANG", replica) {
        std::future::pending::<()>().await;
    }
    if listed("TEST_WORKER_WEIGHTS_FAIL", replica) {
        return (
            StatusCode::INTERNAL_SERVER_ERROR,
            axum::Json(json!({"error": "asked to fail loading weights"})),
        )
            .into_response();
    }
    let mut weights = state.weights.lock().await;
    let loaded = load_weights(&state.http, &swap.url, swap.version).await;
    // A large model's load, drawn out.
    if let Some(ms) = std::env::var("TEST_WORKER_WEIGHTS_DELAY_MS")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
    {
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
    match loaded {
        Ok(loaded) => {
            *weights = loaded.clone();
            state
                .weights_version
                .store(loaded.version, Ordering::SeqCst);
            state.broken.store(loaded.broken, Ordering::Relaxed);
            state.slow.store(loaded.slow, Ordering::Relaxed);
            axum::Json(json!({"weights_version": loaded.version, "bytes": loaded.bytes}))
                .into_response()
        }
        Err(e) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            axum::Json(json!({"error": format!("{e:#}")})),
        )
            .into_response(),
    }
}

/// Request counters reported by `/stats`.
#[derive(Default)]
struct Counters {
    in_flight: AtomicU64,
    peak_in_flight: AtomicU64,
    requests: AtomicU64,
}

/// Counts one request as in flight from its creation until it is dropped.
///
/// Buffered answers drop it when the handler returns; streamed answers move it
/// into the body stream so it lives until the last chunk has been produced
/// (or the client went away).
struct InFlightGuard {
    counters: Arc<Counters>,
}

impl InFlightGuard {
    fn start(counters: &Arc<Counters>) -> Self {
        counters.requests.fetch_add(1, Ordering::SeqCst);
        let now = counters.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        counters.peak_in_flight.fetch_max(now, Ordering::SeqCst);
        Self {
            counters: Arc::clone(counters),
        }
    }
}

impl Drop for InFlightGuard {
    fn drop(&mut self) {
        self.counters.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

// ---------------------------------------------------------------------------
// /healthz and /stats
// ---------------------------------------------------------------------------

/// Body of `GET /healthz`.
#[derive(Serialize)]
struct Health<'a> {
    status: &'static str,
    weights_version: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    weights_seconds: Option<f64>,
    replica: Option<&'a str>,
}

/// `GET /healthz`: 200 once serving, or always 503 with `TEST_WORKER_NEVER_READY`.
async fn healthz(State(state): State<Arc<AppState>>) -> Response {
    let (status, label) = if state.config.never_ready {
        (StatusCode::SERVICE_UNAVAILABLE, "loading")
    } else {
        (StatusCode::OK, "ok")
    };
    let health = Health {
        status: label,
        weights_version: state.weights_version.load(Ordering::SeqCst),
        weights_seconds: state.weights_seconds,
        replica: state.config.replica(),
    };
    (status, axum::Json(health)).into_response()
}

/// Body of `GET /stats`.
#[derive(Serialize)]
struct Stats<'a> {
    in_flight: u64,
    peak_in_flight: u64,
    requests: u64,
    replica: Option<&'a str>,
    pid: u32,
    env: &'a WorkerEnv,
    /// `null` while a swap is loading.
    weights: Option<Loaded>,
}

/// `GET /stats`: request counters, process id and contract environment.
async fn stats(State(state): State<Arc<AppState>>) -> Response {
    let counters = &state.counters;
    let stats = Stats {
        in_flight: counters.in_flight.load(Ordering::SeqCst),
        peak_in_flight: counters.peak_in_flight.load(Ordering::SeqCst),
        requests: counters.requests.load(Ordering::SeqCst),
        replica: state.config.replica(),
        pid: state.pid,
        env: &state.config.env,
        weights: state.weights.try_lock().ok().map(|w| w.clone()),
    };
    axum::Json(stats).into_response()
}

// ---------------------------------------------------------------------------
// Per-request controls
// ---------------------------------------------------------------------------

/// What a request asks the worker to do, from query parameters (which win)
/// or `x-test-*` headers. Unparsable values fall back to the defaults.
struct Controls {
    latency: Duration,
    status: StatusCode,
    crash: bool,
    crash_mid: bool,
    /// Send `partial\n`, then break the connection, and stay alive.
    abort_mid: bool,
    sse_events: Option<u32>,
    sse_interval: Duration,
}

impl Controls {
    fn from_parts(parts: &Parts, default_latency: Duration) -> Self {
        let query = Query::<HashMap<String, String>>::try_from_uri(&parts.uri)
            .map(|Query(query)| query)
            .unwrap_or_default();
        let lookup =
            |param: &str, header: &str| control_value(&query, &parts.headers, param, header);
        Self {
            latency: lookup("latency_ms", "x-test-latency-ms")
                .and_then(|v| parse_millis(&v))
                .unwrap_or(default_latency),
            status: lookup("status", "x-test-status")
                .and_then(|v| v.trim().parse::<u16>().ok())
                .and_then(|code| StatusCode::from_u16(code).ok())
                .unwrap_or(StatusCode::OK),
            crash: lookup("crash", "x-test-crash").is_some_and(|v| parse_flag(&v)),
            crash_mid: lookup("crash_mid", "x-test-crash-mid").is_some_and(|v| parse_flag(&v)),
            abort_mid: lookup("abort_mid", "x-test-abort-mid").is_some_and(|v| parse_flag(&v)),
            sse_events: lookup("sse", "x-test-sse").and_then(|v| v.trim().parse().ok()),
            sse_interval: lookup("interval_ms", "x-test-interval-ms")
                .and_then(|v| parse_millis(&v))
                .unwrap_or(DEFAULT_SSE_INTERVAL),
        }
    }
}

/// The query parameter `param` if present, else the header `header`.
fn control_value(
    query: &HashMap<String, String>,
    headers: &HeaderMap,
    param: &str,
    header: &str,
) -> Option<String> {
    query.get(param).cloned().or_else(|| {
        headers
            .get(header)
            .and_then(|v| v.to_str().ok())
            .map(|v| v.trim().to_owned())
    })
}

// ---------------------------------------------------------------------------
// Pool tasks
// ---------------------------------------------------------------------------

/// `POST /invoke`: the pool-task contract. The JSON input may ask for
/// `sleep_ms`, `fail` (500), `fail_before_attempt: N` (500 while
/// `X-Warmgate-Attempt` < N) or `crash_on_attempt: N` (exit without
/// answering on that attempt). Answers `{"echo", "replica", "attempt"}`;
/// an input nested too deep to parse, `{"echo_raw": input}`.
async fn invoke(State(state): State<Arc<AppState>>, headers: HeaderMap, body: Bytes) -> Response {
    let _guard = InFlightGuard::start(&state.counters);
    let input: Value = match serde_json::from_slice(&body) {
        Ok(v) => v,
        // JSON nested deeper than serde_json builds trees of: answered
        // inside a raw echo, for the gateway's tests of deep outputs.
        Err(e) if e.to_string().contains("recursion limit") => {
            let mut raw = b"{\"echo_raw\": ".to_vec();
            raw.extend_from_slice(&body);
            raw.push(b'}');
            return (
                [(axum::http::header::CONTENT_TYPE, "application/json")],
                raw,
            )
                .into_response();
        }
        Err(e) => {
            return (
                StatusCode::BAD_REQUEST,
                axum::Json(json!({"error": format!("input is not JSON: {e}")})),
            )
                .into_response();
        }
    };
    let attempt: u64 = headers
        .get("x-warmgate-attempt")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok())
        .unwrap_or(1);
    let field = |k: &str| input.get(k).and_then(Value::as_u64);
    if field("crash_on_attempt") == Some(attempt) {
        crash("crash_on_attempt");
    }
    if let Some(ms) = field("sleep_ms") {
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
    let fail = input.get("fail").and_then(Value::as_bool) == Some(true)
        || field("fail_before_attempt").is_some_and(|n| attempt < n);
    if fail {
        return (
            StatusCode::INTERNAL_SERVER_ERROR,
            axum::Json(json!({"error": "asked to fail", "attempt": attempt})),
        )
            .into_response();
    }
    axum::Json(json!({
        "echo": input,
        "replica": state.config.replica(),
        "attempt": attempt,
        "weights_version": state.weights_version.load(Ordering::SeqCst),
        "traceparent": headers.get("traceparent").and_then(|v| v.to_str().ok()),
    }))
    .into_response()
}

// ---------------------------------------------------------------------------
// Counted requests (fallback handler)
// ---------------------------------------------------------------------------

/// Handles every request other than `/healthz` and `/stats`.
async fn handle_request(State(state): State<Arc<AppState>>, request: Request) -> Response {
    let guard = InFlightGuard::start(&state.counters);
    let (parts, body) = request.into_parts();
    let controls = Controls::from_parts(&parts, state.config.default_latency);
    if controls.crash {
        crash("crash requested");
    }

    let body = match to_bytes(body, MAX_BODY_BYTES).await {
        Ok(body) => body,
        Err(err) => {
            let message = format!("failed to read request body: {err}");
            return (
                StatusCode::BAD_REQUEST,
                axum::Json(json!({ "error": message })),
            )
                .into_response();
        }
    };
    if !controls.latency.is_zero() {
        tokio::time::sleep(controls.latency).await;
    }
    if controls.crash_mid {
        return crash_mid_response(guard);
    }
    if controls.abort_mid {
        return abort_mid_response(guard);
    }
    if controls.status.as_u16() >= 400 {
        let error = json!({ "error": "requested status" });
        return (controls.status, axum::Json(error)).into_response();
    }
    if state.slow.load(Ordering::Relaxed) {
        tokio::time::sleep(SLOW_CHECKPOINT).await;
    }
    if state.broken.load(Ordering::Relaxed)
        && state.counters.requests.load(Ordering::SeqCst) % 2 == 0
    {
        let error = json!({ "error": "this checkpoint is broken" });
        return (StatusCode::INTERNAL_SERVER_ERROR, axum::Json(error)).into_response();
    }

    let json_body: Option<Value> = serde_json::from_slice(&body).ok();
    let path = parts.uri.path();
    let sse_events = controls
        .sse_events
        .or_else(|| wants_openai_stream(path, json_body.as_ref()).then_some(OPENAI_STREAM_EVENTS));
    let mut response = match sse_events {
        Some(events) => sse_response(events, controls.sse_interval, guard),
        None => answer(&state.config, &parts, &body, json_body),
    };
    *response.status_mut() = controls.status;
    // The version this process ran the request on, as it sees it itself.
    response.headers_mut().insert(
        "x-worker-weights-version",
        state.weights_version.load(Ordering::SeqCst).into(),
    );
    response
}

/// Exits the process at once, without answering.
fn crash(reason: &str) -> ! {
    eprintln!("test-worker: {reason}, exiting with {CRASH_EXIT_CODE}");
    std::process::exit(CRASH_EXIT_CODE);
}

/// Whether the request is an OpenAI completion call that asks for streaming.
fn wants_openai_stream(path: &str, json_body: Option<&Value>) -> bool {
    is_completions_path(path) && json_body.and_then(|b| b.get("stream")) == Some(&Value::Bool(true))
}

/// `/v1/chat/completions`, `/v1/completions` (or any path ending like them).
fn is_completions_path(path: &str) -> bool {
    path.ends_with("/completions")
}

/// The buffered answer: OpenAI-shaped for embeddings and completions with a
/// usable JSON body, an echo of the request otherwise.
fn answer(config: &Config, parts: &Parts, body: &Bytes, json_body: Option<Value>) -> Response {
    let path = parts.uri.path();
    if let Some(request) = json_body.as_ref() {
        let openai = if path.ends_with("/embeddings") {
            embeddings_answer(config, request)
        } else if is_completions_path(path) {
            completion_answer(config, request)
        } else {
            None
        };
        if let Some(openai) = openai {
            return axum::Json(openai).into_response();
        }
    }
    axum::Json(echo_answer(config, parts, body, json_body)).into_response()
}

/// Describes the request back to the client.
fn echo_answer(config: &Config, parts: &Parts, body: &Bytes, json_body: Option<Value>) -> Value {
    let body_value =
        json_body.unwrap_or_else(|| Value::String(String::from_utf8_lossy(body).into_owned()));
    json!({
        "method": parts.method.as_str(),
        "path": parts.uri.path(),
        "query": parts.uri.query(),
        "replica": config.replica(),
        "revision": config.revision(),
        "headers": header_map(&parts.headers),
        "body_bytes": body.len(),
        "body": body_value,
    })
}

/// Request headers as `lowercase name -> value`; repeated headers are joined
/// with `", "`.
fn header_map(headers: &HeaderMap) -> BTreeMap<String, String> {
    let mut map: BTreeMap<String, String> = BTreeMap::new();
    for (name, value) in headers {
        let value = String::from_utf8_lossy(value.as_bytes());
        map.entry(name.as_str().to_owned())
            .and_modify(|existing| {
                existing.push_str(", ");
                existing.push_str(&value);
            })
            .or_insert_with(|| value.into_owned());
    }
    map
}

// ---------------------------------------------------------------------------
// OpenAI-shaped answers
// ---------------------------------------------------------------------------

/// `/v1/embeddings`: one deterministic 8-dimensional vector per input string.
/// `None` (so the request is echoed) without `model` or a usable `input`.
fn embeddings_answer(config: &Config, request: &Value) -> Option<Value> {
    let model = request.get("model")?;
    let inputs = embedding_inputs(request.get("input")?)?;
    let tokens: usize = inputs.iter().map(|input| count_tokens(input)).sum();
    let data: Vec<Value> = inputs
        .iter()
        .enumerate()
        .map(|(index, input)| {
            json!({ "object": "embedding", "index": index, "embedding": embed(input) })
        })
        .collect();
    Some(json!({
        "object": "list",
        "model": model,
        "data": data,
        "usage": { "prompt_tokens": tokens, "total_tokens": tokens },
        "replica": config.replica(),
        "revision": config.revision(),
    }))
}

/// `input` as a list of strings: a string, or an array whose non-string items
/// are taken as their JSON text.
fn embedding_inputs(input: &Value) -> Option<Vec<String>> {
    match input {
        Value::String(text) => Some(vec![text.clone()]),
        Value::Array(items) => Some(
            items
                .iter()
                .map(|item| match item {
                    Value::String(text) => text.clone(),
                    other => other.to_string(),
                })
                .collect(),
        ),
        _ => None,
    }
}

/// A unit-length vector derived from a hash of `text`'s bytes, rounded to six
/// decimals so the JSON stays short.
fn embed(text: &str) -> Vec<f64> {
    let raw: Vec<f64> = (0..EMBEDDING_DIM)
        .map(|dim| {
            // Top 53 bits of the hash as a float in [0, 1), mapped to [-1, 1).
            let unit = (seeded_hash(dim, text.as_bytes()) >> 11) as f64 / (1u64 << 53) as f64;
            unit * 2.0 - 1.0
        })
        .collect();
    let norm = raw.iter().map(|x| x * x).sum::<f64>().sqrt();
    raw.iter()
        .map(|x| {
            if norm > 0.0 {
                (x / norm * 1e6).round() / 1e6
            } else {
                0.0
            }
        })
        .collect()
}

/// FNV-1a over `bytes` from a seed-dependent basis, finished with a
/// splitmix64 mix so nearby seeds give unrelated values.
fn seeded_hash(seed: u64, bytes: &[u8]) -> u64 {
    const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
    const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;
    let mut hash = FNV_OFFSET ^ seed.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    for &byte in bytes {
        hash ^= u64::from(byte);
        hash = hash.wrapping_mul(FNV_PRIME);
    }
    hash ^= hash >> 30;
    hash = hash.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    hash ^= hash >> 27;
    hash = hash.wrapping_mul(0x94d0_49bb_1331_11eb);
    hash ^ (hash >> 31)
}

/// A fake token count: whitespace-separated words.
fn count_tokens(text: &str) -> usize {
    text.split_whitespace().count()
}

/// Tokens in a prompt value: strings, arrays of them, and `{"text": ...}`
/// content parts.
fn count_value_tokens(value: &Value) -> usize {
    match value {
        Value::String(text) => count_tokens(text),
        Value::Array(items) => items.iter().map(count_value_tokens).sum(),
        Value::Object(fields) => fields.get("text").map_or(0, count_value_tokens),
        _ => 0,
    }
}

/// Prompt tokens of a completion request (`messages[].content` and `prompt`).
fn prompt_tokens(request: &Value) -> usize {
    let contents = request
        .get("messages")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|message| message.get("content"));
    contents
        .chain(request.get("prompt"))
        .map(count_value_tokens)
        .sum()
}

/// `/v1/chat/completions` and `/v1/completions` without streaming.
/// `None` (so the request is echoed) unless the body is a JSON object.
fn completion_answer(config: &Config, request: &Value) -> Option<Value> {
    if !request.is_object() {
        return None;
    }
    let content = format!("hello from {}", config.replica().unwrap_or("unknown"));
    let prompt = prompt_tokens(request);
    let completion = count_tokens(&content);
    Some(json!({
        "id": "cmpl-test",
        "object": "chat.completion",
        "model": request.get("model"),
        "choices": [{
            "index": 0,
            "message": { "role": "assistant", "content": content },
            "finish_reason": "stop",
        }],
        "usage": {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        },
        "replica": config.replica(),
        "revision": config.revision(),
    }))
}

// ---------------------------------------------------------------------------
// Streamed answers
// ---------------------------------------------------------------------------

/// One OpenAI streaming chunk, serialized in OpenAI's field order.
#[derive(Serialize)]
struct ChunkEvent {
    id: &'static str,
    object: &'static str,
    choices: [ChunkChoice; 1],
}

#[derive(Serialize)]
struct ChunkChoice {
    index: u32,
    delta: ChunkDelta,
}

#[derive(Serialize)]
struct ChunkDelta {
    content: String,
}

/// Produces `events` server-sent events then `data: [DONE]`, one every
/// `interval` (the first immediately). Holds the request's in-flight guard
/// until the stream ends or is dropped.
struct SseStream {
    events: u32,
    sent: u32,
    interval: Duration,
    _guard: InFlightGuard,
}

impl SseStream {
    /// The next frame, or `None` once `[DONE]` has been sent.
    async fn next_frame(&mut self) -> Option<Bytes> {
        if self.sent > self.events {
            return None;
        }
        if self.sent > 0 {
            tokio::time::sleep(self.interval).await;
        }
        let frame = if self.sent < self.events {
            sse_chunk(self.sent)
        } else {
            Bytes::from_static(b"data: [DONE]\n\n")
        };
        self.sent += 1;
        Some(frame)
    }
}

/// `data: {...chat.completion.chunk with content "tok<index>"...}\n\n`.
fn sse_chunk(index: u32) -> Bytes {
    let event = ChunkEvent {
        id: "x",
        object: "chat.completion.chunk",
        choices: [ChunkChoice {
            index: 0,
            delta: ChunkDelta {
                content: format!("tok{index}"),
            },
        }],
    };
    let json = serde_json::to_string(&event).unwrap_or_default();
    Bytes::from(format!("data: {json}\n\n"))
}

/// A `text/event-stream` answer whose events are sent as they are produced.
fn sse_response(events: u32, interval: Duration, guard: InFlightGuard) -> Response {
    let state = SseStream {
        events,
        sent: 0,
        interval,
        _guard: guard,
    };
    let frames = stream::unfold(state, |mut state| async move {
        let frame = state.next_frame().await?;
        Some((Ok::<_, Infallible>(frame), state))
    });
    let mut response = Body::from_stream(frames).into_response();
    let headers = response.headers_mut();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
    headers.insert(CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    response
}

/// A chunked 200 answer that sends `partial\n`, then kills the process so
/// the body is cut short.
fn crash_mid_response(guard: InFlightGuard) -> Response {
    let first = stream::once(async { Ok(Bytes::from_static(b"partial\n")) });
    let then_crash = stream::once(crash_after(CRASH_MID_DELAY, guard));
    let mut response = Body::from_stream(first.chain(then_crash)).into_response();
    response
        .headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("text/plain"));
    response
}

/// A chunked 200 answer that sends `partial\n`, then breaks off: the
/// connection ends without the body's end, and the worker lives on.
fn abort_mid_response(guard: InFlightGuard) -> Response {
    let first = stream::once(async { Ok(Bytes::from_static(b"partial\n")) });
    let then_break = stream::once(async move {
        tokio::time::sleep(CRASH_MID_DELAY).await;
        drop(guard);
        Err(std::io::Error::other("abort_mid requested"))
    });
    let mut response = Body::from_stream(first.chain(then_break)).into_response();
    response
        .headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("text/plain"));
    response
}

/// Sleeps, then exits the process; never yields a chunk.
async fn crash_after(delay: Duration, _guard: InFlightGuard) -> Result<Bytes, Infallible> {
    tokio::time::sleep(delay).await;
    crash("crash_mid requested")
}
