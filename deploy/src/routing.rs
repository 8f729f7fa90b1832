//! `[apps.routing]` and `[apps.engine]`: how an app's requests are spread
//! over its replicas, and where the gateway reads what an LLM engine says
//! of its own load. Each section with its defaults and its validation.

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// Defaults of the two sections, each with the reason for it.
pub mod defaults {
    use std::time::Duration;

    /// No replica above 1.25 × the mean load: the common default of
    /// consistent hashing with bounded loads (Mirrokni et al.; HAProxy's
    /// `hash-balance-factor 125`, KubeAI). Lower spreads a hot prefix
    /// sooner and reuses caches less; higher the reverse.
    pub const LOAD_BOUND: f64 = 1.25;
    /// A replica that holds a prompt keeps it while it carries at most 4
    /// requests more than the least loaded replica, whatever the mean: an
    /// engine batches a few requests at once at little cost to each (vLLM
    /// runs up to 256), while recomputing a long prefix elsewhere costs its
    /// whole prefill. The relative bound alone, at low load, moves a
    /// prompt off its cache as soon as one other request runs there. The
    /// SGLang router's cache-aware policy has the same kind of absolute
    /// threshold (32 by default).
    pub const LOAD_SLACK: u32 = 4;
    /// The prefix index of one app: 8 MiB of tables keep about 110,000
    /// chunks, the prompts of some 3.5 million tokens, several times what
    /// the KV caches of a few replicas hold, so the index forgets a prefix
    /// after the engines do, not before.
    pub const INDEX_BYTES: u64 = 8 * 1024 * 1024;
    /// vLLM and SGLang are scraped by Prometheus every 15 s or so; the
    /// gateway reads more often, since it routes on what it reads, but
    /// once a second costs an engine nothing measurable.
    pub const ENGINE_PERIOD: Duration = Duration::from_secs(1);
    /// A reading older than three periods (a slow or stuck engine) is no
    /// longer a reading: the gateway routes on its own counts.
    pub const ENGINE_MAX_AGE: Duration = Duration::from_secs(3);
}

/// How requests are spread over an app's ready replicas.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum RoutingPolicy {
    /// To the replica that recently served the longest leading part of
    /// the same prompt (its KV cache likely still holds it), under the
    /// load bound; a prompt never seen goes where rendezvous hashing of
    /// its start says, so several gateways agree. The default: it costs
    /// nothing measurable where nothing is shared.
    Prefix,
    /// To the replica the session (`X-Session-Id`, else the OpenAI `user`
    /// field) went to before, under the load bound.
    Session,
    /// The less loaded of two random replicas.
    LeastLoaded,
}

/// `[apps.routing]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct RoutingSpec {
    /// `prefix` (default), `session` or `least_loaded`.
    pub policy: RoutingPolicy,
    /// No replica is given a request above this × the mean load of the
    /// app's replicas (at least 1.0)...
    pub load_bound: f64,
    /// ...except that a replica that was sent the prompt before keeps it
    /// while it carries at most this many requests more than the least
    /// loaded replica.
    pub load_slack: u32,
    /// The prefix index's bound, in bytes (`"8MiB"`).
    #[serde(with = "crate::config::size")]
    #[schemars(with = "String")]
    pub index_bytes: u64,
    /// With `[[tenants]]`, tenants share no cached prompt: each tenant's
    /// prompts are indexed apart, and an LLM engine's requests carry a
    /// `cache_salt` of the tenant's (vLLM keeps a salted prompt's KV blocks
    /// apart), so one tenant can neither time nor read
    /// (`usage.prompt_tokens_details.cached_tokens`) whether another sent
    /// a prompt. `true` shares them: a system prompt common to tenants is
    /// cached once, at the cost of that side channel.
    pub share_cache_across_tenants: bool,
}

impl Default for RoutingSpec {
    fn default() -> Self {
        RoutingSpec {
            policy: RoutingPolicy::Prefix,
            load_bound: defaults::LOAD_BOUND,
            load_slack: defaults::LOAD_SLACK,
            index_bytes: defaults::INDEX_BYTES,
            share_cache_across_tenants: false,
        }
    }
}

impl RoutingSpec {
    /// Checks the section; the error names the key under `at`.
    pub fn validate(&self, at: impl Fn(&str) -> String) -> Result<(), (String, String)> {
        if !(self.load_bound.is_finite() && self.load_bound >= 1.0 && self.load_bound <= 100.0) {
            return Err((
                at("routing.load_bound"),
                "must be from 1.0 to 100 (1.25: no replica above 125% of the mean load)".into(),
            ));
        }
        if self.load_slack > 100_000 {
            return Err((at("routing.load_slack"), "must be at most 100000".into()));
        }
        if self.index_bytes < 64 * 1024 {
            return Err((
                at("routing.index_bytes"),
                "must be at least 64KiB (\"8MiB\" keeps the prompts of millions of tokens)".into(),
            ));
        }
        if self.index_bytes > 1024 * 1024 * 1024 {
            return Err((at("routing.index_bytes"), "must be at most 1GiB".into()));
        }
        Ok(())
    }
}

/// `[apps.engine]`: the engine's own signals, read from its Prometheus
/// endpoint (vLLM's `vllm:num_requests_waiting`,
/// `vllm:num_requests_running`, `vllm:kv_cache_usage_perc`; SGLang's and
/// TGI's equivalents).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct EngineSpec {
    /// The path of the engine's metrics (`"/metrics"`); absent: not read.
    pub metrics_path: Option<String>,
    /// How often each replica's metrics are read.
    #[serde(with = "crate::config::bounded")]
    #[schemars(with = "String")]
    pub period: Duration,
    /// A reading older than this counts as unknown.
    #[serde(with = "crate::config::bounded")]
    #[schemars(with = "String")]
    pub max_age: Duration,
    /// Another engine's names for the signals; vLLM's, SGLang's and
    /// TGI's are read whatever this says.
    pub names: EngineMetricNames,
}

/// `[apps.engine.names]`: the metric names of an engine warmgate does not
/// know (llama.cpp's server, TensorRT-LLM, your own), each summed over
/// its label sets like the known ones.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct EngineMetricNames {
    /// Requests the engine runs now (its batch).
    pub running: Option<String>,
    /// Requests waiting in its own queue.
    pub waiting: Option<String>,
    /// Its KV cache's fill, a fraction from 0 to 1 (the fullest of
    /// several is taken).
    pub kv_cache_usage: Option<String>,
}

impl Default for EngineSpec {
    fn default() -> Self {
        EngineSpec {
            metrics_path: None,
            period: defaults::ENGINE_PERIOD,
            max_age: defaults::ENGINE_MAX_AGE,
            names: EngineMetricNames::default(),
        }
    }
}

/// The names vLLM, SGLang and TGI give the signals, read whatever the
/// app says (`[apps.engine.names]` adds to them, and may not give one of
/// them for another signal).
pub mod known_names {
    /// The requests an engine runs now.
    pub const RUNNING: [&str; 3] = [
        "vllm:num_requests_running",
        "sglang:num_running_reqs",
        "tgi_batch_current_size",
    ];
    /// The requests waiting in an engine's own queue.
    pub const WAITING: [&str; 3] = [
        "vllm:num_requests_waiting",
        "sglang:num_queue_reqs",
        "tgi_queue_size",
    ];
    /// The KV cache's fill, 0 to 1 (vLLM before 0.10 said
    /// `gpu_cache_usage_perc`).
    pub const KV_CACHE: [&str; 3] = [
        "vllm:kv_cache_usage_perc",
        "vllm:gpu_cache_usage_perc",
        "sglang:token_usage",
    ];
    /// All of them.
    pub const ALL: [[&str; 3]; 3] = [RUNNING, WAITING, KV_CACHE];
}

/// A Prometheus metric name: `[a-zA-Z_:][a-zA-Z0-9_:]*`, at most 200 bytes.
fn is_metric_name(n: &str) -> bool {
    let mut b = n.bytes();
    n.len() <= 200
        && b.next()
            .is_some_and(|c| c.is_ascii_alphabetic() || c == b'_' || c == b':')
        && b.all(|c| c.is_ascii_alphanumeric() || c == b'_' || c == b':')
}

impl EngineSpec {
    /// Checks the section; the error names the key under `at`.
    pub fn validate(&self, at: impl Fn(&str) -> String) -> Result<(), (String, String)> {
        if let Some(p) = &self.metrics_path
            && (!p.starts_with('/') || p.len() > 256 || p.bytes().any(|b| !b.is_ascii_graphic()))
        {
            return Err((
                at("engine.metrics_path"),
                "must be a path starting with '/' (\"/metrics\"), visible ASCII, at most 256 bytes"
                    .into(),
            ));
        }
        if self.period < Duration::from_millis(100) {
            return Err((at("engine.period"), "must be at least 100ms".into()));
        }
        if self.max_age < self.period {
            return Err((
                at("engine.max_age"),
                "must be at least engine.period".into(),
            ));
        }
        for (key, name) in [
            ("running", &self.names.running),
            ("waiting", &self.names.waiting),
            ("kv_cache_usage", &self.names.kv_cache_usage),
        ] {
            if let Some(n) = name
                && known_names::ALL.iter().any(|k| k.contains(&n.as_str()))
            {
                return Err((
                    at(&format!("engine.names.{key}")),
                    format!("{n:?} is a name warmgate reads already, as the signal it stands for"),
                ));
            }
            if let Some(n) = name
                && !is_metric_name(n)
            {
                return Err((
                    at(&format!("engine.names.{key}")),
                    format!(
                        "{n:?} is not a Prometheus metric name ([a-zA-Z_:][a-zA-Z0-9_:]*, at most 200 bytes)"
                    ),
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(k: &str) -> String {
        format!("apps[0].{k}")
    }

    #[test]
    fn the_defaults_are_valid_and_route_by_prefix() {
        let r = RoutingSpec::default();
        assert_eq!(r.policy, RoutingPolicy::Prefix);
        r.validate(at).expect("valid");
        EngineSpec::default().validate(at).expect("valid");
    }

    #[test]
    fn other_engines_names_must_be_metric_names() {
        let named = |n: &str| EngineSpec {
            names: EngineMetricNames {
                waiting: Some(n.into()),
                ..EngineMetricNames::default()
            },
            ..EngineSpec::default()
        };
        named("llamacpp:requests_deferred")
            .validate(at)
            .expect("valid");
        let (key, says) = named("vllm:num_requests_running").validate(at).unwrap_err();
        assert_eq!(key, "apps[0].engine.names.waiting");
        assert!(says.contains("reads already"), "{says}");
        for bad in ["", "9lives", "queue size", "a{b}", &"x".repeat(201)] {
            let (key, says) = named(bad).validate(at).unwrap_err();
            assert_eq!(key, "apps[0].engine.names.waiting");
            assert!(says.contains("Prometheus metric name"), "{says}");
        }
    }

    #[test]
    fn bad_values_name_their_key() {
        let r = RoutingSpec {
            load_bound: 0.9,
            ..RoutingSpec::default()
        };
        assert_eq!(r.validate(at).unwrap_err().0, "apps[0].routing.load_bound");
        let r = RoutingSpec {
            load_bound: f64::NAN,
            ..RoutingSpec::default()
        };
        assert!(r.validate(at).is_err());
        let e = EngineSpec {
            metrics_path: Some("metrics".into()),
            ..EngineSpec::default()
        };
        assert_eq!(e.validate(at).unwrap_err().0, "apps[0].engine.metrics_path");
        let e = EngineSpec {
            max_age: Duration::from_millis(200),
            ..EngineSpec::default()
        };
        assert_eq!(e.validate(at).unwrap_err().0, "apps[0].engine.max_age");
    }
}
