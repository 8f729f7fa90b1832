//! Which of an app's own routes a data-plane client may call through the
//! passthrough (`/apps/{app}/…`), and which only the admin token reaches.
//!
//! An LLM engine serves its clients' routes (completions, embeddings,
//! tokenize, health) beside routes that change it for everyone: vLLM's
//! `/reset_prefix_cache`, `/sleep`, `/collective_rpc`, its runtime LoRA
//! API; SGLang's `/flush_cache`, `/update_weights_from_disk`, … A tenant
//! must not empty every tenant's cache or swap the weights others are
//! served. So:
//!
//! - the engines' known admin routes need the admin token, on every app;
//! - an app's `passthrough` list, when set, is an allow-list: only those
//!   paths (and what lies below them) for data-plane clients;
//! - an app that serves LoRA adapters or whose engine metrics are read is
//!   an LLM engine, and without a list gets [`ENGINE_CLIENT_ROUTES`].
//!
//! Paths are read as the engine's router reads them: percent escapes
//! decoded, empty and `.` segments dropped, `..` applied, case ignored.
//! Pure: no I/O.

use warmgate_deploy::AppSpec;

/// What an OpenAI-compatible engine's clients call (vLLM's and SGLang's
/// serving routes), for an engine app with no `passthrough` list.
pub const ENGINE_CLIENT_ROUTES: &[&str] = &[
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/embeddings",
    "/v1/responses",
    "/v1/models",
    "/v1/rerank",
    "/v1/score",
    "/v1/audio/transcriptions",
    "/v1/audio/translations",
    "/v1/messages",
    "/v2/rerank",
    "/rerank",
    "/score",
    "/pooling",
    "/classify",
    "/tokenize",
    "/detokenize",
    "/health",
    "/ping",
    "/version",
];

/// Routes that change an engine for every client, on any app: vLLM's
/// (its dev-mode and runtime-LoRA routes among them) and SGLang's.
pub const ENGINE_ADMIN_ROUTES: &[&str] = &[
    // vLLM
    "/reset_prefix_cache",
    "/reset_mm_cache",
    "/reset_encoder_cache",
    "/sleep",
    "/wake_up",
    "/is_sleeping",
    "/collective_rpc",
    "/pause",
    "/resume",
    "/is_paused",
    "/update_weights",
    "/init_weight_transfer_engine",
    "/update_weight_version",
    "/weight_info",
    "/start_weight_update",
    "/start_draft_weight_update",
    "/finish_weight_update",
    "/shutdown_weight_transfer_engine",
    "/weight_checker",
    "/abort_requests",
    "/release_kv_cache_memory",
    "/fault_tolerance/apply",
    "/fault_tolerance/status",
    "/get_world_size",
    "/start_profile",
    "/stop_profile",
    "/scale_elastic_ep",
    "/is_scaling_elastic_ep",
    "/server_info",
    "/v1/load_lora_adapter",
    "/v1/unload_lora_adapter",
    // SGLang
    "/flush_cache",
    "/update_weights_from_disk",
    "/update_weights_from_tensor",
    "/update_weights_from_distributed",
    "/init_weights_update_group",
    "/release_memory_occupation",
    "/resume_memory_occupation",
    "/abort_request",
    "/configure_logging",
    "/set_internal_state",
    "/load_lora_adapter",
    "/unload_lora_adapter",
];

/// `path` as the engine's router reads it: `/a/b`, lower case.
pub fn normalize(path: &str) -> String {
    let decoded = percent_encoding::percent_decode_str(path).decode_utf8_lossy();
    let mut segs: Vec<&str> = Vec::new();
    for seg in decoded.split(['/', '\\']) {
        match seg {
            "" | "." => {}
            ".." => {
                segs.pop();
            }
            s => segs.push(s),
        }
    }
    let mut out = String::with_capacity(path.len() + 1);
    for s in segs {
        out.push('/');
        out.push_str(&s.to_ascii_lowercase());
    }
    if out.is_empty() {
        out.push('/');
    }
    out
}

/// Whether normalized `path` is `route` or lies below it.
fn under(path: &str, route: &str) -> bool {
    let route = route.trim_end_matches('/');
    if route.is_empty() {
        return true;
    }
    path.strip_prefix(route)
        .is_some_and(|rest| rest.is_empty() || rest.starts_with('/'))
}

/// Whether `spec`'s replicas run an LLM engine: it serves LoRA adapters,
/// or its engine's metrics are read.
pub fn is_engine(spec: &AppSpec) -> bool {
    !spec.adapters.models.is_empty() || spec.engine.metrics_path.is_some()
}

/// Why `path` (an app's own path, after `/apps/{app}`) needs the admin
/// token, or `None` when any data-plane client may call it.
pub fn admin_only(spec: &AppSpec, path: &str) -> Option<&'static str> {
    let path = normalize(path);
    if ENGINE_ADMIN_ROUTES.iter().any(|r| under(&path, r)) {
        return Some("it changes the engine for every client");
    }
    let allowed: Box<dyn Iterator<Item = &str>> = if !spec.passthrough.is_empty() {
        Box::new(spec.passthrough.iter().map(String::as_str))
    } else if is_engine(spec) {
        Box::new(ENGINE_CLIENT_ROUTES.iter().copied())
    } else {
        return None;
    };
    let mut allowed = allowed.map(|r| r.to_ascii_lowercase());
    if allowed.any(|r| under(&path, &r)) {
        None
    } else {
        Some("it is not in the app's passthrough list")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn engine() -> AppSpec {
        let mut spec = AppSpec::default();
        spec.engine.metrics_path = Some("/metrics".into());
        spec
    }

    #[test]
    fn paths_are_read_as_a_router_reads_them() {
        assert_eq!(normalize("/a//b/./c/../D"), "/a/b/d");
        assert_eq!(normalize("/%72eset_prefix_cache"), "/reset_prefix_cache");
        assert_eq!(normalize("/x/..%2F..%2Fsleep"), "/sleep");
        assert_eq!(normalize(""), "/");
    }

    #[test]
    fn an_engine_s_admin_routes_need_the_token_on_every_app() {
        let plain = AppSpec::default();
        for p in [
            "/reset_prefix_cache",
            "/RESET_PREFIX_CACHE",
            "//collective_rpc",
            "/x/../sleep",
            "/v1/load_lora_adapter",
            "/flush_cache",
            "/update_weights_from_disk",
        ] {
            assert!(admin_only(&plain, p).is_some(), "{p}");
            assert!(admin_only(&engine(), p).is_some(), "{p}");
        }
        // Anything else of a plain app passes, as its own API.
        for p in [
            "/hello",
            "/predict",
            "/reset_prefix_cache_stats",
            "/v1/chat/completions",
        ] {
            assert_eq!(admin_only(&plain, p), None, "{p}");
        }
    }

    #[test]
    fn an_engine_app_passes_its_clients_routes_only() {
        for p in [
            "/v1/chat/completions",
            "/v1/completions",
            "/v1/responses/resp_1",
            "/tokenize",
            "/health",
        ] {
            assert_eq!(admin_only(&engine(), p), None, "{p}");
        }
        // The engine's metrics tell one tenant of others' cache hits.
        for p in [
            "/debug",
            "/v1/chat/completionsX",
            "/",
            "/admin/x",
            "/metrics",
        ] {
            assert!(admin_only(&engine(), p).is_some(), "{p}");
        }
    }

    #[test]
    fn an_app_s_own_list_is_its_allow_list() {
        let mut spec = AppSpec {
            passthrough: vec!["/predict".into(), "/v1/".into()],
            ..AppSpec::default()
        };
        assert_eq!(admin_only(&spec, "/predict"), None);
        assert_eq!(admin_only(&spec, "/predict/batch"), None);
        assert_eq!(admin_only(&spec, "/v1/anything"), None);
        assert!(admin_only(&spec, "/predictx").is_some());
        assert!(admin_only(&spec, "/train").is_some());
        // The engines' admin routes stay the admin's, whatever the list.
        spec.passthrough = vec!["/".into()];
        assert_eq!(admin_only(&spec, "/anything"), None);
        assert!(admin_only(&spec, "/sleep").is_some());
    }
}
