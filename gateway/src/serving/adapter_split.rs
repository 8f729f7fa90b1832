//! Which revision of a LoRA adapter a request goes to, and under which
//! name the engine knows it: the adapter's own (`sql`, or `sql@3` after
//! its checkpoint changed), an alias's target, or, while the adapter is
//! promoted, the new revision for the canary's share of its requests.
//!
//! The body's `model` is rewritten to the engine's name when the request
//! used another (an alias, or a canary's request): the engine serves an
//! adapter only by the `lora_name` it was loaded under.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;
use parking_lot::Mutex;
use warmgate_deploy::adapter_promotion::AdapterPromotion;
use warmgate_deploy::{AdapterSpec, AdaptersSpec};

use crate::error::Error;

/// The adapter revision a request is served by (a request extension,
/// from the body to the pipeline).
#[derive(Debug, Clone)]
pub struct RequestedAdapter {
    /// The name the engine holds it under (`lora_name`).
    pub engine: Arc<str>,
    /// Its checkpoint (a `file://` folder is the engine's `lora_path`; an
    /// object-store one is pulled first: `super::adapter_files`).
    pub checkpoint: Arc<str>,
    /// The promotion whose canary this request is part of: its answer
    /// judges the new revision.
    pub canary: Option<Arc<AdapterCanary>>,
}

impl RequestedAdapter {
    fn stable(a: &AdapterSpec) -> Self {
        RequestedAdapter {
            engine: Arc::from(a.engine_name()),
            checkpoint: Arc::from(a.checkpoint.as_str()),
            canary: None,
        }
    }
}

/// A running (or the last ended) promotion of one adapter, with the
/// answers of its canary.
#[derive(Debug)]
pub struct AdapterCanary {
    /// The promotion, as the driver steps it.
    pub promotion: Mutex<AdapterPromotion>,
    /// The new revision's `lora_name`.
    pub engine: Arc<str>,
    /// The new revision's checkpoint.
    pub checkpoint: Arc<str>,
    seq: AtomicU64,
    answered: AtomicU64,
    failed: AtomicU64,
}

impl AdapterCanary {
    /// The canary of `promotion`.
    pub fn new(promotion: AdapterPromotion) -> Self {
        AdapterCanary {
            engine: Arc::from(warmgate_deploy::adapters::engine_name(
                &promotion.adapter,
                promotion.to_revision,
            )),
            checkpoint: Arc::from(promotion.checkpoint.as_str()),
            promotion: Mutex::new(promotion),
            seq: AtomicU64::new(0),
            answered: AtomicU64::new(0),
            failed: AtomicU64::new(0),
        }
    }

    /// The new revision's number.
    pub fn to_revision(&self) -> u32 {
        self.promotion.lock().to_revision
    }

    /// Whether it is still under way.
    pub fn running(&self) -> bool {
        !self.promotion.lock().phase.is_terminal()
    }

    /// Whether the next routed request for the adapter goes to the new
    /// revision: `share` percent of them, spread evenly (request n goes
    /// when ⌊(n+1)·share/100⌋ passes ⌊n·share/100⌋).
    fn takes_next(&self) -> bool {
        let share = {
            let p = self.promotion.lock();
            if p.phase.is_terminal() {
                return false;
            }
            u64::from(p.share())
        };
        if share == 0 {
            return false;
        }
        let n = self.seq.fetch_add(1, Ordering::Relaxed);
        (n + 1) * share / 100 > n * share / 100
    }

    /// One of its canary's requests was answered.
    pub fn answered(&self, failed: bool) {
        self.answered.fetch_add(1, Ordering::Relaxed);
        if failed {
            self.failed.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// (answered, failed) so far.
    pub fn counts(&self) -> (u64, u64) {
        (
            self.answered.load(Ordering::Relaxed),
            self.failed.load(Ordering::Relaxed),
        )
    }
}

/// A request's `model` read as an adapter: its name or alias, and the
/// revision `name@n` pins, if any.
pub fn parse_model(model: &str) -> (&str, Option<u32>) {
    match model.rsplit_once('@') {
        Some((name, rev)) if !rev.is_empty() && rev.bytes().all(|b| b.is_ascii_digit()) => {
            (name, rev.parse().ok())
        }
        _ => (model, None),
    }
}

/// The revision of an adapter of `adapters` that serves a request whose
/// `model` is `model`; `None` when it names none (or a revision that is
/// neither the serving one nor the one promoted). `canary` is the
/// adapter's promotion, if one runs.
pub fn route(
    adapters: &AdaptersSpec,
    model: &str,
    canary: impl Fn(&str) -> Option<Arc<AdapterCanary>>,
) -> Option<RequestedAdapter> {
    let (name, pinned) = parse_model(model);
    let a = adapters.models.iter().find(|a| a.answers_to(name))?;
    let promoted = canary(&a.name).filter(|c| c.running());
    let candidate = |c: Arc<AdapterCanary>, counted: bool| RequestedAdapter {
        engine: c.engine.clone(),
        checkpoint: c.checkpoint.clone(),
        canary: counted.then_some(c),
    };
    match pinned {
        Some(r) if r == a.revision => Some(RequestedAdapter::stable(a)),
        // Pinned by name (a gate, an evaluation): served, not counted.
        Some(r) => promoted
            .filter(|c| c.to_revision() == r)
            .map(|c| candidate(c, false)),
        None => match promoted {
            Some(c) if c.takes_next() => Some(candidate(c, true)),
            _ => Some(RequestedAdapter::stable(a)),
        },
    }
}

/// `body` (a JSON object) with its `model` set to `model`; every other
/// value kept byte for byte (the keys come out sorted).
pub fn with_model(body: &[u8], model: &str) -> Result<Bytes, Error> {
    super::json_body::with_fields(body, &[("model", model)])
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use warmgate_deploy::adapter_promotion::AdapterPlan;

    use super::*;

    fn adapters() -> AdaptersSpec {
        let mut sql = AdapterSpec::new("sql", "file:///a/sql-v2");
        sql.revision = 2;
        sql.aliases = vec!["q".into()];
        AdaptersSpec {
            models: vec![sql, AdapterSpec::new("chat", "file:///a/chat")],
            ..AdaptersSpec::default()
        }
    }

    fn promoted(canary: u8) -> Arc<AdapterCanary> {
        let mut p = AdapterPromotion::begin(
            "sql",
            2,
            3,
            "file:///a/sql-v3",
            AdapterPlan {
                canary,
                bake: Duration::from_secs(60),
                min_requests: 10,
                max_error_rate: 0.1,
            },
        );
        p.gated(Duration::ZERO, Ok(()));
        Arc::new(AdapterCanary::new(p))
    }

    #[test]
    fn names_aliases_and_revisions_reach_the_engines_name() {
        let a = adapters();
        let none = |_: &str| None;
        let engine = |m: &str| route(&a, m, none).map(|r| r.engine.to_string());
        assert_eq!(engine("sql").as_deref(), Some("sql@2"));
        assert_eq!(engine("q").as_deref(), Some("sql@2"));
        assert_eq!(engine("sql@2").as_deref(), Some("sql@2"));
        assert_eq!(engine("chat").as_deref(), Some("chat"));
        assert_eq!(engine("sql@3"), None, "no such revision");
        assert_eq!(engine("other"), None);
        let r = route(&a, "chat", none).expect("chat");
        assert_eq!(&*r.checkpoint, "file:///a/chat");
    }

    #[test]
    fn a_canary_takes_its_share_evenly_and_pinned_requests_are_not_counted() {
        let a = adapters();
        let c = promoted(25);
        let with = |_: &str| Some(c.clone());
        let picks: Vec<bool> = (0..8)
            .map(|_| route(&a, "q", with).expect("q").canary.is_some())
            .collect();
        assert_eq!(
            picks,
            [false, false, false, true, false, false, false, true],
            "one in four, spread"
        );
        let pinned = route(&a, "sql@3", with).expect("pinned");
        assert_eq!((&*pinned.engine, pinned.canary.is_none()), ("sql@3", true));
        c.promotion.lock().roll_back("bad".into());
        assert!((0..8).all(|_| route(&a, "sql", with).expect("sql").canary.is_none()));
        assert!(route(&a, "sql@3", with).is_none(), "rolled back");
    }

    #[test]
    fn the_model_is_rewritten_and_the_rest_kept_as_sent() {
        let body = br#"{"model":"q","max_tokens":2,"temperature":0.10000000000000001,"n":18446744073709551616}"#;
        let out = with_model(body, "sql@2").expect("rewritten");
        let text = std::str::from_utf8(&out).expect("utf8");
        assert!(text.contains(r#""model":"sql@2""#), "{text}");
        assert!(text.contains("0.10000000000000001"), "{text}");
        assert!(text.contains("18446744073709551616"), "{text}");
        assert!(with_model(b"[1]", "x").is_err());
    }
}
