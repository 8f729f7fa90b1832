//! Data-plane API keys: each key names a tenant, and each tenant has quotas
//! on requests in flight, tasks pending and requests per second.
//!
//! Keys are matched by their SHA-256 digest, so the gateway never keeps a
//! key itself and a lookup leaks nothing about how close a wrong key came.
//! No key, digest or header value is ever logged, shown in status or used
//! as a metric label; tenants appear by name only.

use std::collections::HashMap;
use std::num::NonZeroU32;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use governor::clock::{Clock, DefaultClock};
use governor::state::{InMemoryState, NotKeyed};
use governor::{Quota, RateLimiter};
use serde::Serialize;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq as _;
use warmgate_deploy::TenantSpec;

use crate::error::{Error, ErrorKind};
use crate::usage::budget::TokenBudget;

type Limiter = RateLimiter<NotKeyed, InMemoryState, DefaultClock>;

/// Every tenant, by the digest of its key.
pub struct Tenants {
    by_digest: Vec<([u8; 32], Arc<Tenant>)>,
    list: Vec<Arc<Tenant>>,
}

/// One tenant and its live counters.
pub struct Tenant {
    /// Its name, from the config.
    pub name: String,
    max_inflight: Option<u32>,
    max_pending: Option<u32>,
    rps: Option<f64>,
    max_priority: i32,
    limiter: Option<Limiter>,
    inflight: AtomicU32,
    pending: AtomicU32,
    /// Input bytes of its tasks accepted and not finished.
    pending_bytes: AtomicU64,
    /// Its share of `limits.max_pending_task_bytes` (see
    /// [`Tenants::with_byte_shares`]); `u64::MAX` until set.
    byte_share: AtomicU64,
    rejected: AtomicU64,
    /// `tokens_per_minute`, if set.
    tokens_per_minute: Option<u64>,
    /// Its token bucket, with `tokens_per_minute`.
    tokens: Option<parking_lot::Mutex<TokenBudget>>,
    /// The largest `max_tokens` a request may ask for.
    max_tokens: Option<u64>,
}

/// What `/v1/status` shows of a tenant.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct TenantStatus {
    /// Name.
    pub name: String,
    /// Requests in flight now.
    pub inflight: u32,
    /// Tasks accepted and not finished.
    pub pending: u32,
    /// Their input bytes.
    pub pending_bytes: u64,
    /// Requests refused for a quota since start.
    pub rejected: u64,
    /// `max_inflight`, if set.
    pub max_inflight: Option<u32>,
    /// `max_pending`, if set.
    pub max_pending: Option<u32>,
    /// `rps`, if set.
    pub rps: Option<f64>,
    /// `tokens_per_minute`, if set.
    pub tokens_per_minute: Option<u64>,
    /// Tokens in its bucket now (negative: the debt it must repay before
    /// its next request), with `tokens_per_minute`.
    pub tokens_available: Option<i64>,
}

/// Holds one of a tenant's in-flight slots until dropped.
#[derive(Debug)]
pub struct InflightGuard(Arc<Tenant>);

/// Holds one of a tenant's pending-task slots, and its input's bytes,
/// until dropped (when the task finishes).
#[derive(Debug)]
pub struct PendingPermit {
    tenant: Arc<Tenant>,
    bytes: u64,
}

impl std::fmt::Debug for Tenant {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tenant").field("name", &self.name).finish()
    }
}

// === impl Tenants ===

impl Tenants {
    /// The tenants of the config, with keys read from the environment
    /// through `env` where the config names a variable. `None` when no
    /// tenant is configured (the data plane is then open). An error names
    /// the key at fault.
    pub fn from_config(
        specs: &[TenantSpec],
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<Option<Tenants>, (String, String)> {
        if specs.is_empty() {
            return Ok(None);
        }
        let mut by_digest = HashMap::new();
        let mut list = Vec::new();
        for (i, spec) in specs.iter().enumerate() {
            let digest = match (&spec.api_key_sha256, &spec.api_key_env) {
                (Some(hex), _) => parse_hex_digest(hex).ok_or_else(|| {
                    (
                        format!("tenants[{i}].api_key_sha256"),
                        "must be 64 hex digits".to_string(),
                    )
                })?,
                (None, Some(var)) => match env(var) {
                    Some(key) if !key.is_empty() => digest_of(&key),
                    _ => {
                        return Err((
                            format!("tenants[{i}].api_key_env"),
                            format!("the environment variable {var} is not set or empty"),
                        ));
                    }
                },
                (None, None) => {
                    return Err((
                        format!("tenants[{i}].api_key_sha256"),
                        "give api_key_sha256 or api_key_env".to_string(),
                    ));
                }
            };
            let tenant = Arc::new(Tenant {
                name: spec.name.clone(),
                max_inflight: spec.max_inflight,
                max_pending: spec.max_pending,
                rps: spec.rps,
                max_priority: spec.max_priority(),
                limiter: spec
                    .rps
                    .and_then(|r| quota(r, spec.burst))
                    .map(Limiter::direct),
                inflight: AtomicU32::new(0),
                pending: AtomicU32::new(0),
                pending_bytes: AtomicU64::new(0),
                byte_share: AtomicU64::new(u64::MAX),
                rejected: AtomicU64::new(0),
                tokens_per_minute: spec.tokens_per_minute,
                tokens: spec.tokens_per_minute.map(|per_minute| {
                    let burst = spec.token_burst.unwrap_or(per_minute);
                    parking_lot::Mutex::new(TokenBudget::new(
                        per_minute,
                        burst,
                        crate::usage::clock(),
                    ))
                }),
                max_tokens: spec.max_tokens,
            });
            if by_digest.insert(digest, tenant.clone()).is_some() {
                return Err((
                    format!("tenants[{i}]"),
                    "another tenant has the same API key".to_string(),
                ));
            }
            list.push(tenant);
        }
        Ok(Some(Tenants {
            by_digest: by_digest.into_iter().collect(),
            list,
        }))
    }

    /// Gives each tenant an equal share of `budget` bytes of pending task
    /// input (`limits.max_pending_task_bytes`), and never less than
    /// `floor` (one task body at the largest): one tenant's tasks cannot
    /// take the whole budget and leave the others `429 queue_full`.
    pub fn with_byte_shares(self, budget: u64, floor: u64) -> Self {
        let share = (budget / self.list.len().max(1) as u64).max(floor);
        for t in &self.list {
            t.byte_share.store(share, Ordering::Relaxed);
        }
        self
    }

    /// The tenant whose key `Authorization: Bearer <key>` carries.
    pub fn identify(&self, headers: &http::HeaderMap) -> Option<Arc<Tenant>> {
        let key = headers
            .get(http::header::AUTHORIZATION)?
            .to_str()
            .ok()?
            .strip_prefix("Bearer ")?
            .trim();
        // Every digest is compared, in constant time, so neither the
        // position of a match nor how much of a digest matched shows in
        // the time taken.
        let presented = digest_of(key);
        let mut found = None;
        for (digest, tenant) in &self.by_digest {
            if bool::from(digest.ct_eq(&presented)) {
                found = Some(tenant.clone());
            }
        }
        found
    }

    /// The live figures of every tenant, in config order.
    pub fn status(&self) -> Vec<TenantStatus> {
        self.list.iter().map(|t| t.status()).collect()
    }
}

// === impl Tenant ===

impl Tenant {
    /// Admits one request: within the rate, and within `max_inflight`.
    pub fn admit(self: &Arc<Self>) -> Result<InflightGuard, Error> {
        self.admit_as_one_of(1)
    }

    /// [`Tenant::admit`] on one of `gateways` gateways serving the tenant
    /// together (the operator's replicas): each allows its part of the
    /// rate (a request costs `gateways` of the limiter's cells, or one when
    /// the burst is smaller) and of `max_inflight` (rounded up, at least
    /// one), so the quotas hold in total within a request or so a gateway.
    pub fn admit_as_one_of(self: &Arc<Self>, gateways: u32) -> Result<InflightGuard, Error> {
        let gateways = gateways.max(1);
        let cells = NonZeroU32::new(gateways).unwrap_or(NonZeroU32::MIN);
        let checked = self.limiter.as_ref().map(|l| match l.check_n(cells) {
            Ok(r) => r,
            // The burst is smaller than the count: one cell, as alone.
            Err(_) => l.check(),
        });
        if let Some(Err(not_until)) = checked {
            let wait = not_until.wait_time_from(DefaultClock::default().now());
            return Err(self.refuse(
                format!(
                    "tenant '{}' is over its rate of {} requests per second",
                    self.name,
                    self.rps.unwrap_or(0.0)
                ),
                wait,
            ));
        }
        let now = self.inflight.fetch_add(1, Ordering::AcqRel) + 1;
        let guard = InflightGuard(self.clone());
        if let Some(max) = self.max_inflight
            && now > max.div_ceil(gateways).max(1)
        {
            drop(guard);
            return Err(self.refuse(
                format!(
                    "tenant '{}' has {max} requests in flight, its max_inflight",
                    self.name
                ),
                Duration::from_secs(1),
            ));
        }
        Ok(guard)
    }

    /// Lets an inference request in within the tenant's token rate (on one
    /// of `gateways` gateways serving together, each at its part of the
    /// rate), with `asked` (its `max_tokens`) within the tenant's
    /// `max_tokens`. Returns the `max_tokens` to give a request that asked
    /// none.
    pub fn admit_tokens(&self, asked: Option<u64>, gateways: u32) -> Result<Option<u64>, Error> {
        if let (Some(max), Some(asked)) = (self.max_tokens, asked)
            && asked > max
        {
            self.rejected.fetch_add(1, Ordering::Relaxed);
            return Err(Error::new(
                ErrorKind::BadRequest,
                format!(
                    "max_tokens {asked} is more than tenant '{}' may ask for ({max})",
                    self.name
                ),
            )
            .param("max_tokens"));
        }
        if let Some(budget) = &self.tokens {
            let share = 1.0 / f64::from(gateways.max(1));
            let admitted = budget.lock().admit(crate::usage::clock(), share);
            if let Err(wait) = admitted {
                return Err(self.refuse(
                    format!(
                        "tenant '{}' is over its rate of {} tokens per minute; its next request is let in once the tokens of its last answers are paid for",
                        self.name,
                        self.tokens_per_minute.unwrap_or(0)
                    ),
                    wait,
                ));
            }
        }
        Ok(if asked.is_none() {
            self.max_tokens
        } else {
            None
        })
    }

    /// Whether the tenant has a largest `max_tokens`.
    pub fn has_max_tokens(&self) -> bool {
        self.max_tokens.is_some()
    }

    /// Whether the tenant has a token rate to charge.
    pub fn has_token_rate(&self) -> bool {
        self.tokens.is_some()
    }

    /// Charges `tokens` an answer used to the tenant's token rate.
    pub fn charge_tokens(&self, tokens: u64, gateways: u32) {
        if let Some(budget) = &self.tokens {
            let share = 1.0 / f64::from(gateways.max(1));
            budget.lock().charge(crate::usage::clock(), tokens, share);
        }
    }

    /// The priority a task of this tenant gets when it asks for `asked`:
    /// at most its `max_priority`, so it cannot jump ahead of the other
    /// tenants' tasks.
    pub fn priority(&self, asked: i32) -> i32 {
        asked.min(self.max_priority)
    }

    /// Takes one pending-task slot for a task of `bytes` of input, within
    /// `max_pending` and the tenant's share of the pending bytes.
    pub fn pending_permit(self: &Arc<Self>, bytes: u64) -> Result<PendingPermit, Error> {
        let now = self.pending.fetch_add(1, Ordering::AcqRel) + 1;
        let held = self.pending_bytes.fetch_add(bytes, Ordering::AcqRel) + bytes;
        let permit = PendingPermit {
            tenant: self.clone(),
            bytes,
        };
        if let Some(max) = self.max_pending
            && now > max
        {
            drop(permit);
            return Err(self.refuse(
                format!(
                    "tenant '{}' has {max} tasks pending, its max_pending",
                    self.name
                ),
                Duration::from_secs(1),
            ));
        }
        let share = self.byte_share.load(Ordering::Relaxed);
        if held > share {
            drop(permit);
            return Err(self.refuse(
                format!(
                    "tenant '{}' already has {} bytes of task input pending; its share of \
                     limits.max_pending_task_bytes is {share}",
                    self.name,
                    held - bytes
                ),
                Duration::from_secs(1),
            ));
        }
        Ok(permit)
    }

    fn refuse(&self, message: String, wait: Duration) -> Error {
        self.rejected.fetch_add(1, Ordering::Relaxed);
        metrics::counter!("warmgate_tenant_rejected_total", "tenant" => self.name.clone())
            .increment(1);
        let secs = wait.as_secs_f64().ceil().max(1.0) as u64;
        Error::new(ErrorKind::QuotaExceeded, message).retry_after(secs)
    }

    fn status(&self) -> TenantStatus {
        TenantStatus {
            name: self.name.clone(),
            inflight: self.inflight.load(Ordering::Relaxed),
            pending: self.pending.load(Ordering::Relaxed),
            pending_bytes: self.pending_bytes.load(Ordering::Relaxed),
            rejected: self.rejected.load(Ordering::Relaxed),
            max_inflight: self.max_inflight,
            max_pending: self.max_pending,
            rps: self.rps,
            tokens_per_minute: self.tokens_per_minute,
            tokens_available: self
                .tokens
                .as_ref()
                .map(|b| b.lock().level(crate::usage::clock(), 1.0).floor() as i64),
        }
    }
}

impl Drop for InflightGuard {
    fn drop(&mut self) {
        self.0.inflight.fetch_sub(1, Ordering::AcqRel);
    }
}

impl PendingPermit {
    /// The tenant's name.
    pub fn tenant(&self) -> &str {
        &self.tenant.name
    }
}

impl Drop for PendingPermit {
    fn drop(&mut self) {
        self.tenant.pending.fetch_sub(1, Ordering::AcqRel);
        self.tenant
            .pending_bytes
            .fetch_sub(self.bytes, Ordering::AcqRel);
    }
}

/// A response body that keeps a tenant's in-flight slot until it ends, fails
/// or is dropped (the client went away).
pub struct HeldBody {
    inner: axum::body::Body,
    guard: Option<InflightGuard>,
}

impl HeldBody {
    /// Wraps `inner`, holding `guard` for its life.
    pub fn new(inner: axum::body::Body, guard: InflightGuard) -> Self {
        HeldBody {
            inner,
            guard: Some(guard),
        }
    }
}

impl http_body::Body for HeldBody {
    type Data = bytes::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        let polled = std::pin::Pin::new(&mut self.inner).poll_frame(cx);
        if matches!(polled, std::task::Poll::Ready(None | Some(Err(_)))) {
            self.guard = None;
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// The rate limiter's quota: one request every `1/rps` seconds, with a
/// burst of `burst` (default: one second's worth, at least one).
fn quota(rps: f64, burst: Option<u32>) -> Option<Quota> {
    if !(rps.is_finite() && rps > 0.0) {
        return None;
    }
    let burst = burst.unwrap_or_else(|| rps.ceil().clamp(1.0, f64::from(u32::MAX)) as u32);
    Duration::try_from_secs_f64(1.0 / rps)
        .ok()
        .and_then(Quota::with_period)
        .map(|q| q.allow_burst(NonZeroU32::new(burst).unwrap_or(NonZeroU32::MIN)))
}

fn digest_of(key: &str) -> [u8; 32] {
    Sha256::digest(key.as_bytes()).into()
}

/// Whether `presented` is `secret`, compared as SHA-256 digests in
/// constant time: both sides are 32 bytes whatever their lengths, so the
/// time taken tells nothing about the secret's length or how much of it a
/// guess got right.
pub fn same_secret(presented: &str, secret: &str) -> bool {
    bool::from(digest_of(presented).ct_eq(&digest_of(secret)))
}

fn parse_hex_digest(hex: &str) -> Option<[u8; 32]> {
    if hex.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, byte) in out.iter_mut().enumerate() {
        *byte = u8::from_str_radix(hex.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use governor::clock::FakeRelativeClock;

    fn spec(name: &str, key: &str) -> TenantSpec {
        TenantSpec {
            name: name.into(),
            api_key_sha256: Some(hex(&digest_of(key))),
            ..TenantSpec::default()
        }
    }

    fn hex(d: &[u8]) -> String {
        d.iter().map(|b| format!("{b:02x}")).collect()
    }

    fn bearer(key: &str) -> http::HeaderMap {
        let mut h = http::HeaderMap::new();
        h.insert(
            http::header::AUTHORIZATION,
            format!("Bearer {key}").parse().expect("header"),
        );
        h
    }

    #[test]
    fn a_key_names_its_tenant_and_a_wrong_key_none() {
        let t = Tenants::from_config(&[spec("a", "ka"), spec("b", "kb")], |_| None)
            .expect("valid")
            .expect("some");
        assert_eq!(t.identify(&bearer("kb")).expect("b").name, "b");
        assert!(t.identify(&bearer("kc")).is_none());
        assert!(t.identify(&http::HeaderMap::new()).is_none());
    }

    #[test]
    fn secrets_compare_by_fixed_size_digest_whatever_their_length() {
        let secret = "s3cret-token";
        assert!(same_secret(secret, secret));
        // Shorter, longer, a prefix, an extension, empty: all refused.
        for wrong in ["", "s", "s3cret-toke", "s3cret-token!", &"x".repeat(4096)] {
            assert!(!same_secret(wrong, secret), "{wrong:?}");
        }
        // What is compared has the same size for every input, so a
        // length mismatch cannot end the comparison early.
        assert_eq!(digest_of("").len(), digest_of(&"x".repeat(4096)).len());
    }

    #[test]
    fn keys_come_from_the_environment_and_a_missing_variable_is_named() {
        let specs = [TenantSpec {
            name: "a".into(),
            api_key_env: Some("KEY_A".into()),
            ..TenantSpec::default()
        }];
        let t = Tenants::from_config(&specs, |v| (v == "KEY_A").then(|| "secret".into()))
            .expect("valid")
            .expect("some");
        assert!(t.identify(&bearer("secret")).is_some());
        let (key, msg) = Tenants::from_config(&specs, |_| None)
            .err()
            .expect("missing");
        assert_eq!(key, "tenants[0].api_key_env");
        assert!(msg.contains("KEY_A"), "{msg}");
        assert!(!msg.contains("secret"));
    }

    #[test]
    fn in_flight_and_pending_quotas_hold_and_free_on_drop() {
        let mut s = spec("a", "k");
        s.max_inflight = Some(2);
        s.max_pending = Some(1);
        let t = Tenants::from_config(&[s], |_| None)
            .expect("ok")
            .expect("some");
        let a = t.identify(&bearer("k")).expect("tenant");
        let g1 = a.admit().expect("first");
        let _g2 = a.admit().expect("second");
        let e = a.admit().expect_err("third is over");
        assert_eq!(e.kind, ErrorKind::QuotaExceeded);
        drop(g1);
        let _g3 = a.admit().expect("a slot was freed");
        let p = a.pending_permit(10).expect("first task");
        assert!(a.pending_permit(10).is_err());
        drop(p);
        assert!(a.pending_permit(10).is_ok());
        assert_eq!(t.status()[0].rejected, 2);
    }

    #[test]
    fn each_of_several_gateways_allows_its_part_of_the_quotas() {
        let mut s = spec("a", "k");
        s.max_inflight = Some(4);
        s.rps = Some(1.0);
        s.burst = Some(4);
        let t = Tenants::from_config(&[s], |_| None)
            .expect("ok")
            .expect("some");
        let a = t.identify(&bearer("k")).expect("tenant");
        // One of two gateways: 2 in flight of 4, and the burst of 4 is two
        // requests here.
        let _g1 = a.admit_as_one_of(2).expect("first");
        let _g2 = a.admit_as_one_of(2).expect("second");
        let e = a.admit_as_one_of(2).expect_err("over its part");
        assert_eq!(e.kind, ErrorKind::QuotaExceeded);
        assert!(e.message.contains("rate"), "{}", e.message);
    }

    #[test]
    fn the_rate_quota_allows_a_burst_then_the_rate_on_virtual_time() {
        let clock = FakeRelativeClock::default();
        let q = quota(10.0, Some(3)).expect("quota");
        let l = RateLimiter::direct_with_clock(q, clock.clone());
        for _ in 0..3 {
            assert!(l.check().is_ok(), "the burst passes");
        }
        let wait = l
            .check()
            .expect_err("past the burst")
            .wait_time_from(clock.now());
        assert_eq!(wait, Duration::from_millis(100));
        clock.advance(Duration::from_millis(100));
        assert!(l.check().is_ok(), "one more after 1/rps");
        assert!(l.check().is_err());
        // Fractional rates work too: one request every two seconds.
        let slow = quota(0.5, None).expect("quota");
        assert_eq!(slow.replenish_interval(), Duration::from_secs(2));
        assert_eq!(slow.burst_size().get(), 1);
        assert!(quota(0.0, None).is_none());
    }

    #[test]
    fn hex_digests_parse_and_junk_does_not() {
        let d = digest_of("k");
        assert_eq!(parse_hex_digest(&hex(&d)), Some(d));
        assert_eq!(parse_hex_digest(&hex(&d).to_uppercase()), Some(d));
        assert_eq!(parse_hex_digest("zz"), None);
        assert_eq!(parse_hex_digest(&"é".repeat(32)), None);
    }

    #[test]
    fn each_tenant_holds_at_most_its_share_of_the_pending_bytes() {
        let t = Tenants::from_config(&[spec("a", "ka"), spec("b", "kb")], |_| None)
            .expect("ok")
            .expect("some")
            .with_byte_shares(100, 10);
        let a = t.identify(&bearer("ka")).expect("a");
        let b = t.identify(&bearer("kb")).expect("b");
        let a1 = a.pending_permit(30).expect("within the share of 50");
        let _a2 = a.pending_permit(20).expect("up to it");
        let e = a.pending_permit(1).expect_err("past it");
        assert_eq!(e.kind, ErrorKind::QuotaExceeded);
        assert!(e.message.contains("share"), "{}", e.message);
        // The other tenant keeps its own share whatever the first holds.
        let _b1 = b.pending_permit(50).expect("b's share");
        assert_eq!(t.status()[0].pending_bytes, 50);
        assert_eq!(t.status()[0].pending, 2, "the refused one is given back");
        drop(a1);
        a.pending_permit(30).expect("freed");
        // Never less than one task body at the largest.
        let many = Tenants::from_config(&[spec("a", "ka"), spec("b", "kb")], |_| None)
            .expect("ok")
            .expect("some")
            .with_byte_shares(100, 80);
        let a = many.identify(&bearer("ka")).expect("a");
        a.pending_permit(80).expect("the floor");
    }
}
