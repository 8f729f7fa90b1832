//! Tenants of the data plane: who holds an API key, its quotas, and their
//! checks.

use std::collections::HashSet;

use serde::{Deserialize, Serialize};

use super::Config;
use super::names::{check_dns_label, check_sha256_hex};

/// A tenant of the data plane: who holds an API key, and its quotas.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct TenantSpec {
    /// The tenant's name (a DNS label), used for fairness, status and
    /// metrics in place of `X-Warmgate-Tenant`.
    pub name: String,
    /// SHA-256 of the API key, as 64 hex digits (`printf %s KEY | sha256sum`),
    /// so the config holds no secret.
    pub api_key_sha256: Option<String>,
    /// Or the environment variable that holds the key.
    pub api_key_env: Option<String>,
    /// Requests and task submissions in flight at once (429 past it).
    pub max_inflight: Option<u32>,
    /// Tasks accepted and not finished, over every pool (429 past it).
    pub max_pending: Option<u32>,
    /// Requests per second, sustained (429 with `Retry-After` past it).
    pub rps: Option<f64>,
    /// Requests allowed in a burst above `rps`; default: one second's worth.
    pub burst: Option<u32>,
    /// Prompt and completion tokens per minute, as the engines count them
    /// in each answer's `usage`, over every app (429 with `Retry-After`
    /// past it). An answer is charged when it ends; requests wait while the
    /// tenant is in debt.
    pub tokens_per_minute: Option<u64>,
    /// Tokens allowed in a burst above `tokens_per_minute`; default: one
    /// minute's worth.
    pub token_burst: Option<u64>,
    /// The largest `max_tokens` (`max_completion_tokens`,
    /// `max_output_tokens`) a request may ask for (400 past it); a request
    /// that asks none is given this one.
    pub max_tokens: Option<u64>,
    /// The highest task `priority` this tenant may ask for; a higher one is
    /// lowered to it. Default `0`, the default priority (see
    /// [`TenantSpec::max_priority()`]).
    pub max_priority: Option<i32>,
}

/// A tenant's default `max_priority`: the default priority itself, so no
/// tenant can jump ahead of the others unless the operator allows it (a
/// tenant may still lower its own tasks' priority).
const DEFAULT_TENANT_MAX_PRIORITY: i32 = 0;
/// The slowest tenant rate limit: one request in 1,000 s.
const MIN_TENANT_RPS: f64 = 0.001;
/// The fastest: 10^9 requests a second, a one-nanosecond period.
const MAX_TENANT_RPS: f64 = 1e9;
/// The largest token rate, burst or `max_tokens`: 10^12, far past any
/// engine, and exact as a float.
const MAX_TOKEN_FIGURE: u64 = 1_000_000_000_000;

impl TenantSpec {
    /// The highest task priority the tenant may ask for.
    pub fn max_priority(&self) -> i32 {
        self.max_priority.unwrap_or(DEFAULT_TENANT_MAX_PRIORITY)
    }
}

impl Config {
    /// Each tenant has a unique name, exactly one key (none shared), and
    /// quotas the limiter can keep.
    pub(super) fn validate_tenants(&self) -> std::result::Result<(), (String, String)> {
        let mut names = HashSet::new();
        let mut keys = HashSet::new();
        for (i, t) in self.tenants.iter().enumerate() {
            let at = |key: &str| format!("tenants[{i}].{key}");
            check_dns_label(&t.name).map_err(|m| (at("name"), m))?;
            if !names.insert(t.name.as_str()) {
                return Err((at("name"), format!("tenant {:?} is listed twice", t.name)));
            }
            match (&t.api_key_sha256, &t.api_key_env) {
                (Some(h), None) => {
                    check_sha256_hex(h).map_err(|m| (at("api_key_sha256"), m))?;
                    if !keys.insert(h.to_ascii_lowercase()) {
                        return Err((
                            at("api_key_sha256"),
                            "another tenant has the same key".into(),
                        ));
                    }
                }
                (None, Some(v)) if !v.is_empty() => {}
                (None, Some(_)) => {
                    return Err((at("api_key_env"), "names no variable".into()));
                }
                _ => {
                    return Err((
                        at("api_key_sha256"),
                        "give exactly one of api_key_sha256 and api_key_env".into(),
                    ));
                }
            }
            // Outside these the limiter's period does not exist (over 10^9
            // a second it is under a nanosecond, and the limit would be off)
            // or is a thousand seconds long.
            if let Some(r) = t.rps
                && !(MIN_TENANT_RPS..=MAX_TENANT_RPS).contains(&r)
            {
                return Err((
                    at("rps"),
                    format!("must be a number from {MIN_TENANT_RPS} to {MAX_TENANT_RPS:e}"),
                ));
            }
            for (key, v) in [
                ("max_inflight", t.max_inflight),
                ("max_pending", t.max_pending),
                ("burst", t.burst),
            ] {
                if v == Some(0) {
                    return Err((at(key), "must be at least 1".into()));
                }
            }
            for (key, v) in [
                ("tokens_per_minute", t.tokens_per_minute),
                ("token_burst", t.token_burst),
                ("max_tokens", t.max_tokens),
            ] {
                match v {
                    Some(0) => return Err((at(key), "must be at least 1".into())),
                    Some(n) if n > MAX_TOKEN_FIGURE => {
                        return Err((at(key), format!("must be at most {MAX_TOKEN_FIGURE}")));
                    }
                    _ => {}
                }
            }
            if t.token_burst.is_some() && t.tokens_per_minute.is_none() {
                return Err((
                    at("token_burst"),
                    "is a burst above tokens_per_minute, which is not set".into(),
                ));
            }
        }
        Ok(())
    }
}
