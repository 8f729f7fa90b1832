//! Loading LoRA adapters into a replica's engine before a request for one
//! is forwarded: vLLM's runtime API (`POST /v1/load_lora_adapter
//! {"lora_name", "lora_path"}`, `POST /v1/unload_lora_adapter
//! {"lora_name"}`), which the Python worker kit speaks too. The choice of
//! replica and what to unload is [`super::adapters`]'; this is the I/O.
//!
//! A load runs as a task of its own, so a client that goes away does not
//! leave it half done, and every request for that adapter on that replica
//! waits for the one load.

use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt as _, Full, Limited};
use warmgate_deploy::AppSpec;

use std::sync::Arc;

use warmgate_pool::{Endpoint, ReplicaHandle};

use super::adapter_files::AdapterFiles;
use super::adapters::{LoadState, Ticket};
use super::dispatch::{App, SlotGuard};
use crate::error::{Error, ErrorKind};

/// An engine's answer to a load is a line of text; more is not read.
const MAX_ANSWER_BYTES: usize = 64 * 1024;

/// Makes the adapter `slot`'s request asked for ready on its replica:
/// at once when it is loaded, after the load under way, or after a load
/// started now. Fails when the load fails or outlasts `load_timeout`.
/// Returns how long the request waited for a load, if it did.
pub async fn prepare(
    slot: &mut SlotGuard,
    spec: &AppSpec,
    checkpoint: Option<&str>,
    files: &Arc<AdapterFiles>,
) -> Result<Option<Duration>, Error> {
    let Some(ticket) = slot.take_ticket() else {
        return Ok(None);
    };
    let Some(name) = slot.adapter().cloned() else {
        return Ok(None);
    };
    let waiting = Instant::now();
    let replica = slot.replica_handle().clone();
    let timeout = spec.adapters.load_timeout;
    let mut state = match ticket {
        Ticket::Ready => return Ok(None),
        Ticket::Wait(rx) => rx,
        Ticket::Load { done, evict } => {
            let rx = done.subscribe();
            let checkpoint = checkpoint.unwrap_or_default().to_string();
            let files = files.clone();
            let app = slot.app().clone();
            tokio::spawn(async move {
                let t0 = Instant::now();
                let (evicted, outcome) = match files.local_path(&checkpoint).await {
                    Ok(path) => {
                        // In the order they were decided: the unload that
                        // made room before a later load of the same name.
                        let calls = app.engine_calls(&replica.id);
                        let _turn = calls.lock().await;
                        load(&replica.addr, &name, &path, evict.as_deref(), timeout).await
                    }
                    Err(e) => (false, Err(e)),
                };
                // By adapter, whichever revision (`name@n`) was loaded.
                let adapter = super::adapter_split::parse_model(&name).0.to_string();
                let labels = [("app", app.name.clone()), ("adapter", adapter.clone())];
                match &outcome {
                    Ok(()) => {
                        metrics::counter!("warmgate_adapter_loads_total", &labels).increment(1);
                        metrics::histogram!("warmgate_adapter_load_seconds", &labels)
                            .record(t0.elapsed().as_secs_f64());
                        tracing::info!(app = %app.name, adapter = %name, replica = %replica.id, took_ms = t0.elapsed().as_millis() as u64, evicted = evict.as_deref().unwrap_or(""), "adapter loaded");
                    }
                    Err(e) => {
                        metrics::counter!("warmgate_adapter_load_failures_total", &labels)
                            .increment(1);
                        tracing::warn!(app = %app.name, adapter = %name, replica = %replica.id, error = %e, "adapter load failed");
                    }
                }
                if let Some(ev) = evict.as_ref().filter(|_| evicted) {
                    let evicted = super::adapter_split::parse_model(ev).0.to_string();
                    metrics::counter!("warmgate_adapter_evictions_total", "app" => app.name.clone(), "adapter" => evicted)
                        .increment(1);
                }
                let state = match outcome {
                    Ok(()) => LoadState::Ready,
                    Err(e) => LoadState::Failed(e),
                };
                app.adapter_loaded(&replica.id, &name, evict.as_deref(), evicted, &done, state);
            });
            rx
        }
    };
    let waited = tokio::time::timeout(timeout, state.wait_for(|s| *s != LoadState::Loading)).await;
    let failed = |why: String| {
        Error::new(
            ErrorKind::ReplicaFailed,
            format!(
                "adapter '{}' could not be loaded on replica {}: {why}",
                slot.adapter().map_or("", |a| a),
                slot.replica_handle().id
            ),
        )
    };
    match waited {
        Ok(Ok(s)) => match &*s {
            LoadState::Ready => Ok(Some(waiting.elapsed())),
            LoadState::Failed(why) => Err(failed(why.clone())),
            LoadState::Loading => Err(failed("the load did not end".into())),
        },
        Ok(Err(_)) => Err(failed("the load was abandoned".into())),
        Err(_) => Err(failed(format!(
            "the load took longer than [apps.adapters] load_timeout ({})",
            humantime::format_duration(timeout)
        ))),
    }
}

/// Unloads `evict` (if given) and loads `name` from `path` on the engine
/// at `addr`. Returns whether `evict` is gone from the engine (unloaded,
/// or found gone), and how the load went. An adapter the engine holds
/// already counts as loaded only when it holds it from `path` (its
/// `/v1/models` `root`); from another folder it is unloaded and loaded
/// again.
async fn load(
    addr: &Endpoint,
    name: &str,
    path: &str,
    evict: Option<&str>,
    timeout: Duration,
) -> (bool, Result<(), String>) {
    if let Some(old) = evict {
        let body = serde_json::json!({ "lora_name": old });
        match post(addr, "/v1/unload_lora_adapter", &body, timeout).await {
            // 404: the engine had lost it already (a restart).
            Ok((status, _)) if status.is_success() || status.as_u16() == 404 => {}
            Ok((status, text)) => {
                return (
                    false,
                    Err(format!(
                        "unloading '{old}' to make room answered {status}: {text}"
                    )),
                );
            }
            Err(e) => return (false, Err(format!("unloading '{old}' to make room: {e}"))),
        }
    }
    let loaded = async {
        let body = serde_json::json!({ "lora_name": name, "lora_path": path });
        let (status, text) = post(addr, "/v1/load_lora_adapter", &body, timeout).await?;
        if status.is_success() {
            return Ok(());
        }
        if !text.contains("already been loaded") {
            return Err(format!("the engine answered {status}: {text}"));
        }
        // Held already: from the folder asked for, or it is reloaded.
        let held = list(addr).await?;
        if held.iter().any(|(n, root)| n == name && root == path) {
            return Ok(());
        }
        let unload = serde_json::json!({ "lora_name": name });
        post(addr, "/v1/unload_lora_adapter", &unload, timeout).await?;
        let (status, text) = post(addr, "/v1/load_lora_adapter", &body, timeout).await?;
        if status.is_success() {
            Ok(())
        } else {
            Err(format!(
                "the engine held '{name}' from another folder; reloading it answered {status}: {text}"
            ))
        }
    };
    (true, loaded.await)
}

async fn post(
    addr: &Endpoint,
    path: &str,
    body: &serde_json::Value,
    timeout: Duration,
) -> Result<(http::StatusCode, String), String> {
    let req = http::Request::post(path)
        .header(http::header::CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .map_err(|e| e.to_string())?;
    let call = async {
        let resp = addr.send_once(req).await?;
        let status = resp.status();
        let bytes = Limited::new(resp.into_body(), MAX_ANSWER_BYTES)
            .collect()
            .await
            .map_err(|e| e.to_string())?
            .to_bytes();
        let text: String = String::from_utf8_lossy(&bytes)
            .chars()
            .filter(|c| !c.is_control())
            .take(512)
            .collect();
        Ok::<_, String>((status, text))
    };
    tokio::time::timeout(timeout, call)
        .await
        .map_err(|_| format!("no answer within {}", humantime::format_duration(timeout)))?
}

/// How long a replica's engine has to list its models when it joins.
const LIST_TIMEOUT: Duration = Duration::from_secs(5);

/// Checks the record against a replica's engine when it joins: adapters
/// its `/v1/models` lists (with `parent` set) that the revision serves,
/// from the same `lora_path`, count as loaded there (an engine started
/// with `--lora-modules`, a replica that outlived the gateway); the others
/// (a deleted adapter, an old revision, another folder) are unloaded, so
/// the engine holds only what the record says.
pub async fn reconcile(app: Arc<App>, replica: Arc<ReplicaHandle>) {
    // No load or unload of the gateway's runs on the engine meanwhile.
    let calls = app.engine_calls(&replica.id);
    let _turn = calls.lock().await;
    let found = match list(&replica.addr).await {
        Ok(found) => found,
        Err(e) => {
            tracing::debug!(app = %app.name, replica = %replica.id, error = %e, "could not list the engine's adapters");
            return;
        }
    };
    if found.is_empty() {
        return;
    }
    let kept = found.len();
    let stray = app.adopt_adapters(&replica.id, found);
    tracing::info!(app = %app.name, replica = %replica.id, adopted = kept - stray.len(), unloading = stray.len(), "adapters found in the engine");
    for name in stray {
        let body = serde_json::json!({ "lora_name": name });
        if let Err(e) = post(
            &replica.addr,
            "/v1/unload_lora_adapter",
            &body,
            LIST_TIMEOUT,
        )
        .await
        {
            tracing::warn!(app = %app.name, replica = %replica.id, adapter = %name, error = %e, "could not unload an adapter the gateway does not serve there");
        }
    }
}

/// The adapters an engine's `GET /v1/models` lists: (id, root) of each
/// model with a `parent`.
async fn list(addr: &Endpoint) -> Result<Vec<(String, String)>, String> {
    let req = http::Request::get("/v1/models")
        .body(Full::new(Bytes::new()))
        .map_err(|e| e.to_string())?;
    let call = async {
        let resp = addr.send_once(req).await?;
        if !resp.status().is_success() {
            return Err(format!("/v1/models answered {}", resp.status()));
        }
        Limited::new(resp.into_body(), MAX_LIST_BYTES)
            .collect()
            .await
            .map(|b| b.to_bytes())
            .map_err(|e| e.to_string())
    };
    let bytes = tokio::time::timeout(LIST_TIMEOUT, call)
        .await
        .map_err(|_| "no answer".to_string())??;
    #[derive(serde::Deserialize)]
    struct Models {
        data: Vec<Model>,
    }
    #[derive(serde::Deserialize)]
    struct Model {
        id: String,
        #[serde(default)]
        root: Option<String>,
        #[serde(default)]
        parent: Option<String>,
    }
    let models: Models = serde_json::from_slice(&bytes).map_err(|e| e.to_string())?;
    Ok(models
        .data
        .into_iter()
        .filter(|m| m.parent.is_some())
        .map(|m| (m.id, m.root.unwrap_or_default()))
        .collect())
}

/// An engine's model list is a few entries; a megabyte is plenty.
const MAX_LIST_BYTES: usize = 1024 * 1024;
