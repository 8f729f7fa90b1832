//! Tokens, the unit an LLM gateway's traffic costs: read off each answer's
//! `usage` as it passes (`scan`, `sse`, `tap`), counted per tenant, app
//! and model (`ledger`, `warmgate_tokens_total`, `GET /v1/usage`), and
//! charged to a tenant's token rate (`budget`).

pub mod budget;
pub mod ledger;
pub mod scan;
pub mod sse;
pub mod tap;

use std::sync::Arc;
use std::time::Duration;

pub use ledger::{Ledger, UsageKey};
pub use scan::Tokens;

/// The tenant label of a request without one.
pub const NO_TENANT: &str = "-";

/// The routes whose answers spend an engine's tokens and carry `usage`:
/// OpenAI's generation and embedding routes, and vLLM's pooling, scoring
/// and reranking ones (with and without `/v1`).
const METERED: [&str; 16] = [
    "/v1/chat/completions",
    "/v1/messages",
    "/v1/audio/transcriptions",
    "/v1/audio/translations",
    "/v1/completions",
    "/v1/embeddings",
    "/v1/responses",
    "/v1/rerank",
    "/v2/rerank",
    "/rerank",
    "/v1/score",
    "/score",
    "/v1/classify",
    "/classify",
    "/pooling",
    "/v1/pooling",
];

/// Whether answers on `path` carry usage worth counting (see
/// [`METERED`]). The gateway's own routes are matched as they are.
pub fn is_metered(path: &str) -> bool {
    METERED.contains(&path.split('?').next().unwrap_or(path))
}

/// Whether a streamed request on `path` can be asked for a usage chunk
/// with `stream_options.include_usage` (chat and completions; a Responses
/// stream always ends with its usage).
pub fn takes_include_usage(path: &str) -> bool {
    matches!(
        path.split('?').next().unwrap_or(path),
        "/v1/chat/completions" | "/v1/completions"
    )
}

/// Writes the ledger's counters every [`ledger::FLUSH_EVERY`] until
/// aborted.
pub fn spawn_flush(ledger: Arc<Ledger>) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(ledger::FLUSH_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            flush(&ledger).await;
        }
    })
}

/// Writes the ledger's counters now, off the async threads.
pub async fn flush(ledger: &Arc<Ledger>) {
    let l = ledger.clone();
    match tokio::task::spawn_blocking(move || l.flush()).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => {
            tracing::warn!(error = %e, "could not write the usage ledger; kept to write again")
        }
        Err(e) => tracing::warn!(error = %e, "the usage ledger's write failed"),
    }
}

/// How long a process-wide clock has run: the token budgets' time.
pub fn clock() -> Duration {
    static START: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    START.get_or_init(std::time::Instant::now).elapsed()
}
