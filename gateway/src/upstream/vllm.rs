//! New weights into a running vLLM engine, in place (`[[pools]]
//! weight_sync = "vllm"`).
//!
//! vLLM 0.32 started with `VLLM_SERVER_DEV_MODE=1` serves, beside the
//! OpenAI routes, `POST /collective_rpc`, which runs a method on every
//! worker of the engine. Its workers' `reload_weights(weights_path=DIR)`
//! reads the safetensors files of a checkpoint folder into the loaded
//! model, in place: the process, its KV cache and its compiled graphs
//! stay. Three calls make a sync:
//!
//! 1. `POST /collective_rpc {"method": "reload_weights", "kwargs":
//!    {"weights_path": DIR}}`: the new weights.
//! 2. `POST /reset_prefix_cache`: the KV blocks cached for earlier prompts
//!    were computed with the old weights, and a later request must not
//!    reuse them (the reload does not drop them).
//! 3. `POST /update_weight_version {"new_version": "N"}`: the version the
//!    engine reports at `GET /weight_info`, read back to check.
//!
//! The gateway sends these only once the replica's requests in flight
//! have ended (the pool's sync drains it first), so no answer mixes two
//! versions. The routes are the engine's admin routes: data-plane clients
//! cannot reach them through the gateway (`serving::engine_routes`), and
//! the replica listens on a socket only the gateway's user can open.

use axum::body::Body;
use bytes::Bytes;
use http::{Request, header};
use http_body_util::{BodyExt as _, Limited};
use warmgate_pool::Endpoint;

use super::{LoadError, Upstream};

/// The most of an answer read: an error's text, or the version.
const ANSWER_LIMIT: usize = 64 * 1024;

impl Upstream {
    /// Loads the checkpoint in `folder` into the vLLM engine at `addr` in
    /// place, as `version` (see the module's text).
    pub async fn vllm_reload(
        &self,
        addr: &Endpoint,
        folder: &str,
        version: u64,
    ) -> Result<(), LoadError> {
        let rpc = serde_json::json!({
            "method": "reload_weights",
            "kwargs": {"weights_path": folder},
        });
        let (status, body) = self
            .engine_call(addr, "POST", "/collective_rpc", Some(rpc))
            .await?;
        if status == 404 {
            // Not served: the engine runs without its dev routes.
            return Err(LoadError::Failed(
                "vLLM has no POST /collective_rpc (404): start it with VLLM_SERVER_DEV_MODE=1 \
                 for in-place weight reloads"
                    .into(),
            ));
        }
        expect_ok("POST /collective_rpc reload_weights", status, &body)?;
        let (status, body) = self
            .engine_call(addr, "POST", "/reset_prefix_cache", None)
            .await?;
        expect_ok("POST /reset_prefix_cache", status, &body)?;
        let named = serde_json::json!({"new_version": version.to_string()});
        let (status, body) = self
            .engine_call(addr, "POST", "/update_weight_version", Some(named))
            .await?;
        expect_ok("POST /update_weight_version", status, &body)?;
        let (status, body) = self.engine_call(addr, "GET", "/weight_info", None).await?;
        expect_ok("GET /weight_info", status, &body)?;
        let reported = serde_json::from_slice::<serde_json::Value>(&body)
            .ok()
            .and_then(|v| {
                v.get("weight_version")
                    .and_then(|v| v.as_str().map(str::to_string))
            });
        match reported {
            Some(v) if v == version.to_string() => Ok(()),
            other => Err(LoadError::Failed(format!(
                "vLLM reports weight version {} after loading {version}",
                other.unwrap_or_else(|| "none".into())
            ))),
        }
    }

    /// One call to the engine at `addr`: its status and (the start of) its
    /// answer.
    async fn engine_call(
        &self,
        addr: &Endpoint,
        method: &str,
        path: &str,
        json: Option<serde_json::Value>,
    ) -> Result<(u16, Bytes), LoadError> {
        let failed = |e: String| LoadError::Failed(e);
        let mut req = Request::builder().method(method).uri(path);
        let body = match json {
            Some(v) => {
                req = req.header(header::CONTENT_TYPE, "application/json");
                Body::from(v.to_string())
            }
            None => Body::empty(),
        };
        let req = req.body(body).map_err(|e| failed(e.to_string()))?;
        let resp = self.send_to(addr, req).await.map_err(|e| {
            failed(format!(
                "vLLM did not answer {method} {path}: {}",
                warmgate_pool::probe::error_chain(&e.error)
            ))
        })?;
        let status = resp.status().as_u16();
        let body = Limited::new(resp.into_body(), ANSWER_LIMIT)
            .collect()
            .await
            .map(|b| b.to_bytes())
            .unwrap_or_default();
        Ok((status, body))
    }
}

/// `Ok` for a 2xx answer; else the call, the status and the engine's text.
fn expect_ok(call: &str, status: u16, body: &[u8]) -> Result<(), LoadError> {
    if (200..300).contains(&status) {
        return Ok(());
    }
    let text = String::from_utf8_lossy(&body[..body.len().min(512)]);
    Err(LoadError::Failed(format!(
        "vLLM answered {status} to {call}: {}",
        text.trim()
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failed_call_names_the_call_the_status_and_the_engine_s_words() {
        assert_eq!(expect_ok("POST /x", 200, b""), Ok(()));
        let Err(LoadError::Failed(m)) = expect_ok("POST /x", 500, b" out of memory\n") else {
            panic!("a 500 is a failure");
        };
        assert_eq!(m, "vLLM answered 500 to POST /x: out of memory");
    }
}
