//! The composition root around a gateway: the backend it runs on (and
//! the orphans a crashed run left), metrics, the listener, SIGHUP reloads,
//! and an orderly stop (drain, then stop every replica). `warmgate serve`
//! and the operator's leader both run a gateway through here.

pub mod admin_token;
mod assemble;
pub mod autoscale;
pub(crate) mod state_db;
pub mod state_lock;
pub(crate) mod takeover;

use std::io::Write as _;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use warmgate_deploy::Config;
use warmgate_pool::LocalBackend;

use crate::http::hot::Edge;
use crate::server::Gateway;

pub(crate) async fn serve_async(
    config: Config,
    path: PathBuf,
    config_wins: bool,
) -> anyhow::Result<()> {
    // Before anything in the folder is touched (orphans, cache, journal).
    let _owner = state_lock::lock(&config.state_dir)?;
    if config_wins {
        drop_api_changes(&config)?;
    }
    let listener = tokio::net::TcpListener::bind(config.listen)
        .await
        .with_context(|| format!("listen on {}", config.listen))?;
    // No control plane without a credential: without WARMGATE_ADMIN_TOKEN
    // the gateway keeps one of its own, for the CLI of its user.
    let _published = if crate::access::admin_token().is_none() {
        let token = admin_token::ensure(&config.state_dir)?;
        let addr = listener
            .local_addr()
            .context("read the listening address")?;
        let published = admin_token::publish(addr, &token);
        crate::access::use_generated_admin_token(token);
        published
    } else {
        None
    };
    let backend = backend_for(&config).await?;
    serve_with(config, backend, None, listener, move |gw| {
        // Listened for before the gateway says it is listening: a SIGHUP
        // that comes right after must reload, not kill (its default).
        let hup = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup());
        reload_on_hangup(gw, path, hup)
    })
    .await
}

/// On every SIGHUP, re-reads the config file and applies its apps and
/// pools as `warmgate apply` does, logging each change. A file that does
/// not load changes nothing. Settings other than apps and pools need a
/// restart; a change to them is logged. Runs until the gateway stops.
async fn reload_on_hangup(
    gw: Arc<Gateway>,
    path: PathBuf,
    hup: std::io::Result<tokio::signal::unix::Signal>,
) -> String {
    let mut hup = match hup {
        Ok(s) => s,
        Err(e) => {
            tracing::warn!(error = %e, "cannot listen for SIGHUP; reload with `warmgate apply`");
            return std::future::pending().await;
        }
    };
    while hup.recv().await.is_some() {
        let file = match Config::load(&path) {
            Ok(c) => c,
            Err(e) => {
                tracing::error!(file = %path.display(), error = %e, "SIGHUP: the config file does not load; nothing changed");
                continue;
            }
        };
        if gw.changes.other_settings_differ(&file) {
            tracing::warn!(file = %path.display(), "SIGHUP: settings other than [[apps]] and [[pools]] changed; they take effect at the next restart");
        }
        tracing::info!(file = %path.display(), "SIGHUP: applying the config file's apps and pools");
        for change in gw.changes.apply_file(file).await {
            match &change.outcome {
                Ok(_) => tracing::info!("{change}"),
                Err(_) => tracing::error!("{change}"),
            }
        }
        // The file is the truth now: a later edit of it is not overridden
        // at the next start by what the API (or this apply) saved.
        if let Err(e) = gw.changes.forget_api_changes() {
            tracing::error!(error = %e.message, "SIGHUP: the file was applied, but the saved API changes remain");
        }
    }
    std::future::pending().await
}

/// On every SIGHUP, reads the listener's certificate and key again; new
/// connections get the new pair. A pair that does not load changes
/// nothing and is logged.
async fn reload_tls_on_hangup(
    tls: Arc<crate::tls::ServerTls>,
    hup: std::io::Result<tokio::signal::unix::Signal>,
) {
    let mut hup = match hup {
        Ok(s) => s,
        Err(e) => {
            tracing::warn!(error = %e, "cannot listen for SIGHUP; a renewed certificate needs a restart");
            return;
        }
    };
    while hup.recv().await.is_some() {
        match tls.reload() {
            Ok(()) => {
                metrics::counter!("warmgate_tls_reloads_total", "outcome" => "ok").increment(1);
                tracing::info!(cert = %tls.cert_path().display(), "SIGHUP: TLS certificate reloaded");
            }
            Err(e) => {
                metrics::counter!("warmgate_tls_reloads_total", "outcome" => "error").increment(1);
                tracing::error!(error = %e, "SIGHUP: the TLS certificate does not load; the old one stays");
            }
        }
    }
}

/// The backend the config names: local processes (after stopping any a
/// crashed run left), or pods through the kubeconfig or in-cluster
/// credentials.
///
/// On Kubernetes a `serve` does not take over or delete the pods of its
/// instance it finds at start: without a lease it cannot tell a crashed
/// run's pods from those of another gateway running now (a rolling update,
/// a colleague on the same namespace), and deleting those would take down
/// a live gateway's replicas. The operator does, under its lease.
async fn backend_for(config: &Config) -> anyhow::Result<Arc<dyn warmgate_pool::Backend>> {
    match config.backend.kind {
        warmgate_deploy::BackendKind::Local => {
            let logs = config.state_dir.join("logs");
            // Owner only, like the state folder itself (replica logs can
            // hold what workers print).
            {
                use std::os::unix::fs::DirBuilderExt as _;
                std::fs::DirBuilder::new()
                    .recursive(true)
                    .mode(0o700)
                    .create(&logs)
                    .with_context(|| format!("create the state folder {}", logs.display()))?;
            }
            let backend = LocalBackend::new(logs)
                .with_run_dir(config.state_dir.join("run"))
                .with_socket_dir(config.state_dir.join("sockets"))
                .with_pass_env(config.backend.pass_env.clone());
            // A previous run killed with `kill -9` left its replicas
            // running: stop them before anything starts, so GPUs and ports
            // are free again.
            let orphans = backend.reap_orphans();
            if !orphans.is_empty() {
                let names: Vec<&str> = orphans.iter().map(|o| o.replica.as_str()).collect();
                tracing::warn!(count = orphans.len(), replicas = ?names, "stopped replicas a previous run left running");
            }
            ORPHANS.store(orphans.len() as u64, std::sync::atomic::Ordering::Relaxed);
            Ok(Arc::new(backend))
        }
        warmgate_deploy::BackendKind::Kubernetes => {
            let client = kube::Client::try_default().await.map_err(|e| {
                anyhow::anyhow!(
                    "cannot reach the Kubernetes API (no in-cluster config, and no KUBECONFIG): {e}"
                )
            })?;
            let namespace = config
                .backend
                .kubernetes
                .namespace
                .clone()
                .unwrap_or_else(|| client.default_namespace().to_string());
            let backend = warmgate_pool::kubernetes::KubeBackend::new(
                client,
                warmgate_pool::kubernetes::KubeSettings {
                    namespace,
                    instance: std::env::var("WARMGATE_INSTANCE")
                        .unwrap_or_else(|_| "warmgate".into()),
                    config: config.backend.kubernetes.clone(),
                    stop_grace: config.backend.stop_grace,
                },
            );
            Ok(Arc::new(backend))
        }
    }
}

/// Orphans stopped at start, counted once metrics are installed.
static ORPHANS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Runs the gateway on `listener` with `backend` until SIGTERM, or until
/// `side` (given the gateway) returns a reason to stop; then drains.
pub async fn serve_with<F, Fut>(
    config: Config,
    backend: Arc<dyn warmgate_pool::Backend>,
    state: Option<Box<dyn warmgate_deploy::store::StateStore>>,
    listener: tokio::net::TcpListener,
    side: F,
) -> anyhow::Result<()>
where
    F: FnOnce(Arc<Gateway>) -> Fut,
    Fut: Future<Output = String> + Send + 'static,
{
    let addr = listener.local_addr().context("read the listen address")?;
    let metrics = install_metrics();
    metrics::counter!("warmgate_orphans_stopped_total")
        .increment(ORPHANS.load(std::sync::atomic::Ordering::Relaxed));
    let grace = config.backend.stop_grace;
    let conn_limits = crate::listener::ConnLimits::from(&config.limits);
    let tls = load_tls(&config)?;
    let scheme = if tls.is_some() { "https" } else { "http" };
    let worker_listener = bind_worker_listener(&config).await?;
    let worker_addr = match &worker_listener {
        Some(l) => l.local_addr().context("read the workers' address")?,
        None => addr,
    };
    // A renewed certificate is read again on SIGHUP (listened for before
    // the gateway says it listens).
    let tls_reloader = tls.clone().map(|tls| {
        let hup = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup());
        tokio::spawn(reload_tls_on_hangup(tls, hup))
    });
    let gw = Gateway::with_state(config, backend, metrics, worker_addr, state)?;
    let autoscaler = autoscale::spawn(&gw);
    let usage_writer = crate::usage::spawn_flush(gw.usage.clone());
    let mut side = tokio::spawn(side(gw.clone()));

    let (stop_tx, mut stop_rx) = tokio::sync::watch::channel(false);
    let server = crate::listener::serve(
        listener,
        Edge::new(gw.clone()),
        conn_limits,
        tls,
        async move {
            let _ = stop_rx.wait_for(|s| *s).await;
        },
    );
    let mut server = tokio::spawn(server);
    let worker_server = worker_listener.map(|l| {
        let mut stop_rx = stop_tx.subscribe();
        tokio::spawn(crate::listener::serve(
            l,
            Edge::for_workers(gw.clone()),
            conn_limits,
            None,
            async move {
                let _ = stop_rx.wait_for(|s| *s).await;
            },
        ))
    });
    // Before the gateway says it listens: a SIGTERM right after must
    // drain it, not kill it (its default).
    let stop = shutdown_signal();
    announce(&gw, scheme, addr);

    tokio::select! {
        r = &mut server => {
            autoscaler.abort();
            usage_writer.abort();
            gw.shutdown().await;
            return r.context("the server task failed");
        }
        _ = stop => {}
        reason = &mut side => {
            tracing::warn!(reason = %reason.unwrap_or_else(|e| e.to_string()), "stopping the gateway");
        }
    }
    side.abort();
    if let Some(t) = tls_reloader {
        t.abort();
    }
    tracing::info!(grace = ?grace, "shutting down: finishing requests in flight");
    gw.start_draining();
    autoscaler.abort();
    let _ = stop_tx.send(true);
    if tokio::time::timeout(grace, &mut server).await.is_err() {
        tracing::warn!(grace = ?grace, "requests still in flight after the grace period; closing them");
        server.abort();
    }
    if let Some(w) = worker_server {
        w.abort();
    }
    usage_writer.abort();
    tracing::info!("stopping replicas");
    gw.shutdown().await;
    tracing::info!("stopped");
    Ok(())
}

/// The TLS certificate the config names, loaded.
fn load_tls(config: &Config) -> anyhow::Result<Option<Arc<crate::tls::ServerTls>>> {
    Ok(match &config.tls {
        Some(files) => Some(Arc::new(
            crate::tls::ServerTls::load(files).context("load the TLS certificate")?,
        )),
        None => None,
    })
}

/// The workers' own listener, with TLS: workers hold no CA to trust, so
/// they read their weights over plain HTTP from it (loopback by default).
async fn bind_worker_listener(config: &Config) -> anyhow::Result<Option<tokio::net::TcpListener>> {
    Ok(match &config.tls {
        Some(t) => {
            let at = t
                .worker_listen
                .unwrap_or_else(|| std::net::SocketAddr::from(([127, 0, 0, 1], 0)));
            Some(
                tokio::net::TcpListener::bind(at)
                    .await
                    .with_context(|| format!("listen for workers on {at}"))?,
            )
        }
        None => None,
    })
}

/// Says that the gateway listens, and where its dashboard is.
fn announce(gw: &Gateway, scheme: &str, addr: std::net::SocketAddr) {
    tracing::info!(%addr, apps = gw.config().apps.len(), "warmgate listening");
    println!("warmgate listening on {scheme}://{addr}");
    // A token the gateway made is shown to the user who started it, as
    // Jupyter shows its URL: the dashboard needs it.
    // Only to a terminal: stdout sent to a file or a pipe may be read by
    // others (a shared log, a CI job's output).
    if let Some(token) = crate::access::generated_admin_token() {
        use std::io::IsTerminal as _;
        let file = gw.config().state_dir.join(admin_token::FILE_NAME);
        if std::io::stdout().is_terminal() {
            println!(
                "dashboard: {scheme}://{addr}/ui#token={token} (admin token in {})",
                file.display()
            );
        } else {
            println!(
                "dashboard: {scheme}://{addr}/ui (open it with #token=<the admin token in {}>)",
                file.display()
            );
        }
    }
    let _ = std::io::stdout().flush();
}

/// The process's Prometheus recorder, installed at the first call: the
/// operator's follower and then its leader share it.
pub(crate) fn install_metrics() -> Option<metrics_exporter_prometheus::PrometheusHandle> {
    static HANDLE: std::sync::OnceLock<Option<metrics_exporter_prometheus::PrometheusHandle>> =
        std::sync::OnceLock::new();
    HANDLE.get_or_init(install_recorder).clone()
}

fn install_recorder() -> Option<metrics_exporter_prometheus::PrometheusHandle> {
    use metrics_exporter_prometheus::{Matcher, PrometheusBuilder};
    let mut builder = PrometheusBuilder::new();
    for m in crate::metric_catalog::METRICS
        .iter()
        .filter(|m| !m.buckets.is_empty())
    {
        builder = builder
            .set_buckets_for_metric(Matcher::Full(m.name.into()), m.buckets)
            .ok()?;
    }
    match builder.install_recorder() {
        Ok(handle) => {
            crate::metric_catalog::describe();
            let h = handle.clone();
            tokio::spawn(async move {
                let mut t = tokio::time::interval(Duration::from_secs(5));
                loop {
                    t.tick().await;
                    h.run_upkeep();
                }
            });
            Some(handle)
        }
        Err(e) => {
            tracing::warn!(error = %e, "metrics are off");
            None
        }
    }
}

/// A future that returns on SIGTERM or Ctrl-C. SIGTERM is listened for
/// from the call on, not from the first poll, so one that comes before the
/// future is awaited is not lost (nor fatal).
pub fn shutdown_signal() -> impl Future<Output = ()> + Send {
    use tokio::signal::unix::{SignalKind, signal};
    let term = signal(SignalKind::terminate());
    async move {
        let mut term = match term {
            Ok(s) => s,
            Err(e) => {
                tracing::error!(error = %e, "cannot listen for SIGTERM");
                return std::future::pending().await;
            }
        };
        tokio::select! {
            _ = term.recv() => {}
            _ = tokio::signal::ctrl_c() => {}
        }
    }
}

/// `serve --config-wins`: the changes made through the API are dropped
/// before the start reads them, so the file is the truth.
fn drop_api_changes(config: &Config) -> anyhow::Result<()> {
    let db = config.state_dir.join("state.db");
    if !db.exists() {
        return Ok(());
    }
    let mut store = warmgate_deploy::store::Store::open(&db)
        .with_context(|| format!("open {}", db.display()))?;
    let dropped = store
        .overlay()
        .map(|o| o.apps.len() + o.pools.len())
        .unwrap_or(0);
    store
        .clear_overlay()
        .context("drop the changes made through the API (--config-wins)")?;
    if dropped > 0 {
        tracing::warn!(
            changes = dropped,
            "--config-wins: the changes made through the API were dropped; the config file is the truth"
        );
    }
    Ok(())
}
