//! The checkpoint watcher: an app's `promotion.watch` prefix scanned for
//! the newest complete checkpoint, which is promoted.

use std::sync::Arc;

use super::Promotions;
use crate::serving::served::Served;

use super::PromoteRequest;

impl Promotions {
    /// Watches an app's `promotion.watch` prefix until the gateway stops:
    /// the newest checkpoint folder whose marker file exists, and that no
    /// revision has used yet, is promoted. A folder without its marker (a
    /// checkpoint still being written) is never looked at.
    pub(crate) async fn watch(self: Arc<Self>, app: Arc<Served>) {
        let Some(uri) = app.spec().promotion.watch.clone() else {
            return;
        };
        let marker = app.spec().promotion.marker.clone();
        let every = app.spec().promotion.watch_interval;
        let source = match self.weights.open(&uri) {
            Ok(s) => s,
            Err(e) => {
                tracing::error!(app = %app.name, %uri, error = %e.message, "cannot watch for checkpoints");
                return;
            }
        };
        let generation = app.watcher();
        loop {
            if app.is_removed() || app.watcher() != generation {
                // Deleted, or its watch settings changed (a new watcher
                // took over, if it still watches).
                return;
            }
            match newest_complete(&source, &marker).await {
                Ok(Some(folder)) => {
                    let checkpoint = format!("{}/{folder}", uri.trim_end_matches('/'));
                    let known = {
                        let h = app.history.lock();
                        h.promoting()
                            || h.revisions
                                .iter()
                                .any(|r| r.checkpoint.as_deref() == Some(checkpoint.as_str()))
                    };
                    if !known {
                        tracing::info!(app = %app.name, %checkpoint, "a new checkpoint is complete; promoting it");
                        let req = PromoteRequest {
                            checkpoint,
                            canary: None,
                            bake: None,
                            in_place: None,
                        };
                        if let Err(e) = self.promote(&app, req).await {
                            tracing::warn!(app = %app.name, error = %e.message, "the watcher could not promote");
                        }
                    }
                }
                Ok(None) => {}
                Err(e) => tracing::debug!(app = %app.name, error = %e, "nothing to watch yet"),
            }
            app.watch_scans
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            tokio::time::sleep(every).await;
        }
    }
}

/// The newest direct sub-folder of `source` holding `marker`, by the
/// marker's modification time.
pub(crate) async fn newest_complete(
    source: &warmgate_pool::weights::Source,
    marker: &str,
) -> Result<Option<String>, warmgate_pool::Error> {
    let objects = source.list().await?;
    let base = source.path_str().trim_end_matches('/');
    let newest = objects
        .iter()
        .filter_map(|o| {
            let path = o.location.as_ref();
            let rel = path.strip_prefix(base)?.trim_start_matches('/');
            let (folder, file) = rel.split_once('/')?;
            (file == marker && !folder.is_empty()).then(|| (o.last_modified, folder.to_string()))
        })
        .max();
    Ok(newest.map(|(_, f)| f))
}
