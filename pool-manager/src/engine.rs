//! What an LLM engine says of its own load, read from its Prometheus
//! endpoint (`[apps.engine] metrics_path`): requests running, requests
//! waiting in its own queue, and how full its KV cache is.
//!
//! [`parse`] is pure: Prometheus text in, a [`EngineLoad`] out. It knows the
//! names vLLM, SGLang and TGI use, and sums each over its label sets (a
//! server with several models or ranks reports one line each). The reader
//! that fetches the text lives beside the health probe and stamps each
//! reading with the time it was taken: a reading has an age, and an old one
//! counts as unknown ([`EngineReading::fresh`]).

use std::time::{Duration, Instant};

use warmgate_deploy::EngineMetricNames;
use warmgate_deploy::routing::known_names::{KV_CACHE, RUNNING, WAITING};

/// An engine's load at one moment.
#[derive(Debug, Clone, Copy, PartialEq, Default, serde::Serialize)]
pub struct EngineLoad {
    /// Requests it runs (in its batch).
    pub running: Option<u32>,
    /// Requests waiting in its own queue.
    pub waiting: Option<u32>,
    /// Its KV cache's fill, 0 to 1.
    pub kv_cache_usage: Option<f64>,
}

impl EngineLoad {
    /// Whether the text named none of the signals.
    pub fn is_empty(&self) -> bool {
        self.running.is_none() && self.waiting.is_none() && self.kv_cache_usage.is_none()
    }

    /// Requests it holds, running or waiting, when it said either.
    pub fn holding(&self) -> Option<u32> {
        match (self.running, self.waiting) {
            (None, None) => None,
            (r, w) => Some(r.unwrap_or(0).saturating_add(w.unwrap_or(0))),
        }
    }
}

/// A load and when it was read.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EngineReading {
    /// What the engine said.
    pub load: EngineLoad,
    /// When.
    pub at: Instant,
    /// What of the engine's count may be this gateway's own: the most
    /// requests it had in flight to the engine while the read was under
    /// way (when it was asked, or when the answer came). A request that
    /// ended during the read may still be in the engine's count; taking
    /// only the count at the answer would see it as another's.
    pub local: u32,
}

impl EngineReading {
    /// Requests the engine held for others (other gateways, clients that
    /// reach it directly) when it was read: what it held, less this
    /// gateway's own. This gateway's requests are counted exactly, and
    /// now, by its own in-flight count; a stale reading must not count
    /// them twice.
    pub fn others(&self) -> u32 {
        self.load.holding().unwrap_or(0).saturating_sub(self.local)
    }

    /// The load, if read no longer than `max_age` before `now`.
    pub fn fresh(&self, now: Instant, max_age: Duration) -> Option<EngineLoad> {
        (now.saturating_duration_since(self.at) <= max_age).then_some(self.load)
    }
}

/// The signals in a Prometheus text exposition; what it does not name stays
/// `None`. Lines it cannot read are skipped.
pub fn parse(text: &str) -> EngineLoad {
    parse_named(text, &EngineMetricNames::default())
}

/// [`parse`], also reading the names an app gave for an engine warmgate
/// does not know (`[apps.engine.names]`).
pub fn parse_named(text: &str, names: &EngineMetricNames) -> EngineLoad {
    let is = |known: &[&str], other: &Option<String>, name: &str| {
        known.contains(&name) || other.as_deref() == Some(name)
    };
    let mut running: Option<f64> = None;
    let mut waiting: Option<f64> = None;
    let mut kv: Option<f64> = None;
    for line in text.lines() {
        let line = line.trim_start();
        if line.starts_with('#') || line.is_empty() {
            continue;
        }
        // `name{labels} value [timestamp]` or `name value [timestamp]`.
        let name_end = line
            .find(|c: char| c == '{' || c.is_ascii_whitespace())
            .unwrap_or(line.len());
        let name = &line[..name_end];
        #[derive(PartialEq)]
        enum Signal {
            Running,
            Waiting,
            Kv,
        }
        let signal = if is(&RUNNING, &names.running, name) {
            Signal::Running
        } else if is(&WAITING, &names.waiting, name) {
            Signal::Waiting
        } else if is(&KV_CACHE, &names.kv_cache_usage, name) {
            Signal::Kv
        } else {
            continue;
        };
        let rest = &line[name_end..];
        let after_labels = match rest.strip_prefix('{') {
            Some(r) => match closing_brace(r) {
                Some(i) => &r[i + 1..],
                None => continue,
            },
            None => rest,
        };
        let Some(value) = after_labels
            .split_ascii_whitespace()
            .next()
            .and_then(|v| v.parse::<f64>().ok())
            .filter(|v| v.is_finite() && *v >= 0.0)
        else {
            continue;
        };
        match signal {
            // Several caches (ranks): the fullest one limits.
            Signal::Kv => kv = Some(kv.map_or(value, |s| s.max(value))),
            Signal::Running => running = Some(running.unwrap_or(0.0) + value),
            Signal::Waiting => waiting = Some(waiting.unwrap_or(0.0) + value),
        }
    }
    let count = |v: Option<f64>| v.map(|v| v.round().min(f64::from(u32::MAX)) as u32);
    EngineLoad {
        running: count(running),
        waiting: count(waiting),
        kv_cache_usage: kv.map(|v| v.min(1.0)),
    }
}

/// The end of a label set: the first `}` outside a quoted value.
fn closing_brace(s: &str) -> Option<usize> {
    let mut quoted = false;
    let mut escaped = false;
    for (i, c) in s.char_indices() {
        match c {
            _ if escaped => escaped = false,
            '\\' if quoted => escaped = true,
            '"' => quoted = !quoted,
            '}' if !quoted => return Some(i),
            _ => {}
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vllm_text_gives_its_three_signals() {
        let text = r#"# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="meta-llama/Llama-3.1-8B"} 4.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="meta-llama/Llama-3.1-8B"} 7.0
vllm:kv_cache_usage_perc{engine="0",model_name="meta-llama/Llama-3.1-8B"} 0.625
vllm:prompt_tokens_total{model_name="m"} 12345.0
"#;
        let l = parse(text);
        assert_eq!(l.running, Some(4));
        assert_eq!(l.waiting, Some(7));
        assert_eq!(l.kv_cache_usage, Some(0.625));
        assert_eq!(l.holding(), Some(11));
    }

    #[test]
    fn an_engine_s_own_names_are_read_when_given() {
        // llama.cpp's server names.
        let text = "llamacpp:requests_processing 3\nllamacpp:requests_deferred 5\n\
                    llamacpp:kv_cache_usage_ratio 0.4\n";
        assert!(parse(text).is_empty());
        let names = EngineMetricNames {
            running: Some("llamacpp:requests_processing".into()),
            waiting: Some("llamacpp:requests_deferred".into()),
            kv_cache_usage: Some("llamacpp:kv_cache_usage_ratio".into()),
        };
        let l = parse_named(text, &names);
        assert_eq!((l.running, l.waiting), (Some(3), Some(5)));
        assert_eq!(l.kv_cache_usage, Some(0.4));
        // The known names are still read beside them.
        let l = parse_named("vllm:num_requests_waiting 2\n", &names);
        assert_eq!(l.waiting, Some(2));
    }

    #[test]
    fn label_sets_are_summed_and_the_fullest_cache_counts() {
        let text = "sglang:num_running_reqs{tp_rank=\"0\"} 2\nsglang:num_running_reqs{tp_rank=\"1\"} 3\n\
                    sglang:num_queue_reqs 1\nsglang:token_usage{tp_rank=\"0\"} 0.2\nsglang:token_usage{tp_rank=\"1\"} 0.9\n";
        let l = parse(text);
        assert_eq!(l.running, Some(5));
        assert_eq!(l.waiting, Some(1));
        assert_eq!(l.kv_cache_usage, Some(0.9));
    }

    #[test]
    fn junk_and_tricky_labels_are_skipped_or_read_right() {
        let text = "vllm:num_requests_waiting{model_name=\"a}b\\\"c\"} 3 1700000000000\n\
                    vllm:num_requests_running{model_name=\"x\"} NaN\n\
                    vllm:num_requests_running{unclosed 5\n\
                    vllm:num_requests_running -1\n\
                    tgi_queue_size\n";
        let l = parse(text);
        assert_eq!(l.waiting, Some(3));
        assert_eq!(l.running, None);
        assert!(parse("").is_empty());
        assert!(parse("other_metric 1\n").is_empty());
    }

    #[test]
    fn a_reading_past_its_age_is_unknown() {
        let t0 = Instant::now();
        let r = EngineReading {
            load: EngineLoad {
                waiting: Some(2),
                running: Some(3),
                ..EngineLoad::default()
            },
            at: t0,
            local: 4,
        };
        // Five held, four of them this gateway's own.
        assert_eq!(r.others(), 1);
        let max = Duration::from_secs(3);
        assert!(r.fresh(t0 + Duration::from_secs(2), max).is_some());
        assert!(r.fresh(t0 + Duration::from_secs(4), max).is_none());
    }
}
