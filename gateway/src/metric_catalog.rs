//! Every series `/metrics` shows: its kind, labels, help text and, for a
//! histogram, buckets that fit what it measures. The recorder is set up
//! from this list, and `docs/observability.md`'s reference table is
//! generated from it (a test keeps the two in step).

/// What kind of series.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Only goes up.
    Counter,
    /// A value now.
    Gauge,
    /// A distribution, in buckets.
    Histogram,
}

impl Kind {
    /// As Prometheus names it.
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Counter => "counter",
            Kind::Gauge => "gauge",
            Kind::Histogram => "histogram",
        }
    }
}

/// One series.
#[derive(Debug, Clone, Copy)]
pub struct Metric {
    /// Its name.
    pub name: &'static str,
    /// Counter, gauge or histogram.
    pub kind: Kind,
    /// Its label names.
    pub labels: &'static [&'static str],
    /// The `# HELP` text.
    pub help: &'static str,
    /// A histogram's bucket bounds, in seconds.
    pub buckets: &'static [f64],
}

/// A request end to end, or waiting in the queue: up to the 300 s a
/// request may run, and the queue timeout's 120 s default.
const REQUEST: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
];
/// The first byte: a token streamed within milliseconds, or a whole
/// answer after a cold start.
const FIRST_BYTE: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    120.0, 300.0,
];
/// Cold starts, tasks and weight syncs: seconds to ten minutes.
const LONG: &[f64] = &[
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0,
];
/// The gateway's own share of a cold start: down to 100 µs.
const SHORT: &[f64] = &[
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
];

const fn counter(
    name: &'static str,
    labels: &'static [&'static str],
    help: &'static str,
) -> Metric {
    Metric {
        name,
        kind: Kind::Counter,
        labels,
        help,
        buckets: &[],
    }
}

const fn gauge(name: &'static str, labels: &'static [&'static str], help: &'static str) -> Metric {
    Metric {
        name,
        kind: Kind::Gauge,
        labels,
        help,
        buckets: &[],
    }
}

const fn histogram(
    name: &'static str,
    labels: &'static [&'static str],
    help: &'static str,
    buckets: &'static [f64],
) -> Metric {
    Metric {
        name,
        kind: Kind::Histogram,
        labels,
        help,
        buckets,
    }
}

/// Every series, in the order the reference table lists them.
pub const METRICS: &[Metric] = &[
    counter(
        "warmgate_requests_total",
        &["app", "outcome"],
        "Requests answered, by `ok` or error kind.",
    ),
    histogram(
        "warmgate_request_duration_seconds",
        &["app"],
        "Requests end to end, until the answer's body ends.",
        REQUEST,
    ),
    histogram(
        "warmgate_request_queued_seconds",
        &["app"],
        "Time a request was held for a slot.",
        REQUEST,
    ),
    histogram(
        "warmgate_time_to_first_byte_seconds",
        &["app"],
        "From a request's arrival to the first byte of its answer's body (the first token of a stream).",
        FIRST_BYTE,
    ),
    gauge(
        "warmgate_inflight",
        &["app"],
        "Requests in flight on the app's replicas.",
    ),
    gauge("warmgate_queued", &["app"], "Requests held for a slot."),
    gauge(
        "warmgate_autoscaler_panicking",
        &["app"],
        "1 while the autoscaler scales for a burst (panic mode or a backlog that outlasts a cold start), else 0.",
    ),
    counter(
        "warmgate_request_deadline_exceeded_total",
        &[],
        "Requests that ran past their deadline header.",
    ),
    counter(
        "warmgate_connect_retries_total",
        &[],
        "Requests sent again to another replica after a refused connection.",
    ),
    counter(
        "warmgate_connections_refused_total",
        &[],
        "Client connections refused at limits.max_connections.",
    ),
    gauge(
        "warmgate_buffered_body_bytes",
        &[],
        "Bytes of request bodies held now (being read, or waiting for a replica), of limits.max_buffered_body_bytes; read when scraped.",
    ),
    counter(
        "warmgate_replica_ejections_total",
        &["cause"],
        "Replicas taken out of rotation because a connection to them failed: refused, or broke before the answer ended (cause). Each is back once it answers its health probe.",
    ),
    counter(
        "warmgate_unread_bodies_closed_total",
        &[],
        "Answers given before the request's body was read whose connection then closed (Connection: close), the rest of the body being too large, too slow or not yet asked for (Expect: 100-continue).",
    ),
    counter(
        "warmgate_tls_handshake_failures_total",
        &[],
        "TLS handshakes that failed or did not finish within limits.header_read_timeout.",
    ),
    counter(
        "warmgate_tls_reloads_total",
        &["outcome"],
        "Reloads of the [tls] certificate on SIGHUP: ok, or error (the old pair stays).",
    ),
    counter(
        "warmgate_host_refused_total",
        &[],
        "Requests refused because their Host is not in [access] allowed_hosts.",
    ),
    counter(
        "warmgate_adapter_requests_total",
        &["app", "adapter"],
        "Requests routed to a LoRA adapter (by its name or an alias, any revision).",
    ),
    counter(
        "warmgate_adapter_loads_total",
        &["app", "adapter"],
        "LoRA adapters loaded into a replica's engine ([apps.adapters]), each when a request needed it there.",
    ),
    counter(
        "warmgate_adapter_load_failures_total",
        &["app", "adapter"],
        "Adapter loads the engine refused or did not answer within load_timeout.",
    ),
    counter(
        "warmgate_adapter_evictions_total",
        &["app", "adapter"],
        "Idle adapters unloaded to make room for another on the same replica.",
    ),
    histogram(
        "warmgate_adapter_load_seconds",
        &["app", "adapter"],
        "Time to load an adapter into a replica's engine: a cold-start phase of its own, which the request that waited for it pays.",
        LONG,
    ),
    counter(
        "warmgate_adapter_promotions_total",
        &["app", "outcome"],
        "Promotions of LoRA adapters ended: done (the new revision is the adapter's) or rolled_back.",
    ),
    counter(
        "warmgate_adapter_route_decisions_total",
        &["reason"],
        "Requests for an adapter routed: held (to a replica holding it, under the load bound), room (loaded where a slot was free), evict (an idle adapter unloaded to make room) or over_bound.",
    ),
    counter(
        "warmgate_route_decisions_total",
        &["reason"],
        "Requests routed by prompt or session ([apps.routing]): affinity (to the replica that was sent the longest part of the prompt, or the session before), home (its rendezvous home under the load bound) or wait (held for the full replica that holds the prompt, whose next free slot costs less than recomputing the prompt elsewhere).",
    ),
    gauge(
        "warmgate_engine_replicas_read",
        &["app"],
        "The app's replicas whose engine metrics were read within [apps.engine] max_age.",
    ),
    gauge(
        "warmgate_engine_requests_running",
        &["app"],
        "Requests the app's engines said they run (vllm:num_requests_running and the like), summed over fresh readings.",
    ),
    gauge(
        "warmgate_engine_requests_waiting",
        &["app"],
        "Requests waiting in the app's engines' own queues (vllm:num_requests_waiting and the like), summed over fresh readings.",
    ),
    gauge(
        "warmgate_engine_kv_cache_usage_max",
        &["app"],
        "The fullest KV cache among the app's engines, 0 to 1 (vllm:kv_cache_usage_perc and the like).",
    ),
    counter(
        "warmgate_buffered_body_refusals_total",
        &[],
        "Requests refused at limits.max_buffered_body_bytes, while their bodies were read or waited for a replica.",
    ),
    counter(
        "warmgate_stalled_answers_total",
        &[],
        "Replica answers cut off after sending nothing for limits.idle_timeout.",
    ),
    counter(
        "warmgate_tenant_rejected_total",
        &["tenant"],
        "Requests refused for a tenant's quota.",
    ),
    counter(
        "warmgate_tasks_cancelled_total",
        &["pool"],
        "Cancellations of tasks pending or running: `DELETE /v1/tasks/{id}`, a batch cancelled, or a waiting client gone.",
    ),
    counter(
        "warmgate_tokens_total",
        &["tenant", "app", "model", "kind"],
        "Tokens the engines counted in their answers' `usage`, by tenant (`-`: none), app, model (the app or an adapter) and kind: `prompt` (cached ones included), `cached` (`prompt_tokens_details.cached_tokens`), `completion`.",
    ),
    counter(
        "warmgate_answers_without_usage_total",
        &["tenant", "app", "model"],
        "Successful answers on token-spending routes that carried no `usage` (or broke off before it): counted as requests, their tokens unknown.",
    ),
    counter(
        "warmgate_usage_hours_dropped_total",
        &[],
        "Hours of the usage ledger dropped, oldest first, to keep it within `limits.max_usage_bytes`.",
    ),
    counter(
        "warmgate_tasks_total",
        &["pool", "outcome"],
        "Tasks finished, by `ok` or error kind.",
    ),
    histogram(
        "warmgate_task_duration_seconds",
        &["pool"],
        "Tasks from accepted to finished.",
        LONG,
    ),
    histogram(
        "warmgate_task_queued_seconds",
        &["pool"],
        "Tasks from accepted to first dispatch.",
        LONG,
    ),
    gauge(
        "warmgate_tasks_pending",
        &["pool"],
        "Tasks waiting for a replica, or waiting out the pause before a retry.",
    ),
    gauge(
        "warmgate_tasks_inflight",
        &["pool"],
        "Tasks running on the pool's replicas.",
    ),
    counter(
        "warmgate_task_retries_total",
        &["pool", "cause"],
        "Task attempts tried again, by `user` or `system` cause.",
    ),
    counter(
        "warmgate_task_ondemand_fallbacks_total",
        &["pool"],
        "Tasks whose last try ran on an on-demand replica.",
    ),
    counter(
        "warmgate_tasks_failed_by_restart_total",
        &[],
        "Accepted tasks reported failed because the gateway restarted.",
    ),
    counter(
        "warmgate_task_journal_dropped_total",
        &[],
        "Task records the journal could not keep.",
    ),
    counter(
        "warmgate_task_results_evicted_total",
        &[],
        "Finished task results dropped to stay within the result store's bound.",
    ),
    gauge(
        "warmgate_replicas",
        &["app", "pool", "state"],
        "Replicas by state (pending, starting, ready, draining); an app's revisions by `app`, a pool's replicas by `pool`.",
    ),
    gauge(
        "warmgate_replicas_desired",
        &["app", "pool"],
        "The replica count asked for, by `app` or `pool`.",
    ),
    gauge(
        "warmgate_replicas_unschedulable",
        &["app", "pool"],
        "Replicas the cluster cannot place (Kubernetes), by `app` or `pool`.",
    ),
    counter(
        "warmgate_replica_seconds_total",
        &["app", "pool"],
        "Every live replica's seconds, starting ones included: the GPU bill, by `app` or `pool`.",
    ),
    counter(
        "warmgate_replica_disruptions_total",
        &["cause"],
        "Replicas lost to a cause outside the gateway (crash, eviction, preemption).",
    ),
    counter(
        "warmgate_orphans_stopped_total",
        &[],
        "Worker processes a crashed earlier run left, stopped at start.",
    ),
    histogram(
        "warmgate_cold_start_seconds",
        &["app", "pool", "phase"],
        "Cold starts by phase: `spawn`, `ready` (weights and model load included) and `weights` when the worker reports it; by `app` or `pool`.",
        LONG,
    ),
    histogram(
        "warmgate_cold_start_handoff_seconds",
        &["app"],
        "From a replica ready to its first request forwarded: the gateway's own share of a cold start.",
        SHORT,
    ),
    counter(
        "warmgate_weights_store_bytes_total",
        &[],
        "Weight bytes read from the object store.",
    ),
    counter(
        "warmgate_weights_cache_bytes_total",
        &[],
        "Weight bytes served from the node-local cache.",
    ),
    counter(
        "warmgate_weight_syncs_total",
        &["pool"],
        "Weight syncs started.",
    ),
    counter(
        "warmgate_weight_sync_replicas_total",
        &["pool", "outcome"],
        "Replicas through a weight sync, `synced` or `replaced`.",
    ),
    histogram(
        "warmgate_weight_sync_seconds",
        &["pool"],
        "One replica's weight swap.",
        LONG,
    ),
];

/// Tells the recorder every series' help text.
pub fn describe() {
    for m in METRICS {
        match m.kind {
            Kind::Counter => metrics::describe_counter!(m.name, m.help),
            Kind::Gauge => metrics::describe_gauge!(m.name, m.help),
            Kind::Histogram => metrics::describe_histogram!(m.name, metrics::Unit::Seconds, m.help),
        }
    }
}

/// The Markdown reference table in `docs/observability.md`.
pub fn reference_table() -> String {
    let mut out = String::from("| metric | kind | labels | what |\n|---|---|---|---|\n");
    for m in METRICS {
        out.push_str(&format!(
            "| `{}` | {} | {} | {} |\n",
            m.name,
            m.kind.as_str(),
            m.labels.join(", "),
            m.help
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The series a PromQL expression reads, each with the labels its
    /// selector names: `(name as written, labels)`.
    fn selectors(expr: &str) -> Vec<(String, Vec<String>)> {
        let mut out = Vec::new();
        let mut rest = expr;
        while let Some(i) = rest.find("warmgate_") {
            let tail = &rest[i..];
            let end = tail
                .find(|c: char| !(c.is_ascii_lowercase() || c == '_'))
                .unwrap_or(tail.len());
            let name = tail[..end].to_string();
            let mut labels = Vec::new();
            if let Some(body) = tail[end..].strip_prefix('{') {
                let close = body.find('}').expect("a closed selector");
                for m in body[..close].split(',').filter(|m| !m.trim().is_empty()) {
                    let key = m
                        .split(['=', '!', '~'])
                        .next()
                        .expect("a label")
                        .trim()
                        .to_string();
                    labels.push(key);
                }
            }
            out.push((name, labels));
            rest = &tail[end..];
        }
        out
    }

    /// The labels of every `by (...)` in an expression.
    fn grouped_by(expr: &str) -> Vec<String> {
        let mut out = Vec::new();
        let mut rest = expr;
        while let Some(i) = rest.find("by (") {
            let body = &rest[i + 4..];
            let close = body.find(')').expect("a closed by");
            out.extend(body[..close].split(',').map(|l| l.trim().to_string()));
            rest = &body[close..];
        }
        out
    }

    #[test]
    fn the_grafana_dashboard_reads_only_series_and_labels_the_gateway_has() {
        let dash: serde_json::Value =
            serde_json::from_str(include_str!("../../deploy/grafana/warmgate.json"))
                .expect("the dashboard is JSON");
        let panels = dash["panels"].as_array().expect("panels");
        assert!(panels.len() >= 10, "a dashboard worth the name");
        let mut read = std::collections::BTreeSet::new();
        for panel in panels {
            let title = panel["title"].as_str().expect("a title");
            let targets = panel["targets"].as_array().expect("targets");
            assert!(!targets.is_empty(), "{title} has a query");
            for t in targets {
                let expr = t["expr"].as_str().expect("expr");
                let used = selectors(expr);
                assert!(!used.is_empty(), "{title}: {expr} reads no warmgate series");
                let mut series = Vec::new();
                for (written, labels) in &used {
                    let (base, bucket) = ["_bucket", "_sum", "_count"]
                        .iter()
                        .find_map(|s| written.strip_suffix(s).map(|b| (b, *s == "_bucket")))
                        .filter(|(b, _)| METRICS.iter().any(|m| m.name == *b))
                        .unwrap_or((written.as_str(), false));
                    let m = METRICS.iter().find(|m| m.name == base).unwrap_or_else(|| {
                        panic!("{title}: {written} is not a series of the gateway")
                    });
                    if base != written {
                        assert_eq!(
                            m.kind,
                            Kind::Histogram,
                            "{title}: {written} on a {:?}",
                            m.kind
                        );
                    }
                    for l in labels {
                        assert!(
                            m.labels.contains(&l.as_str()),
                            "{title}: {base} has no label {l}"
                        );
                    }
                    read.insert(m.name);
                    series.push((m, bucket));
                }
                for l in grouped_by(expr) {
                    for (m, bucket) in &series {
                        assert!(
                            m.labels.contains(&l.as_str()) || (l == "le" && *bucket),
                            "{title}: grouped by {l}, which {} does not have",
                            m.name
                        );
                    }
                }
            }
        }
        // The series users chart first are all on it.
        for name in [
            "warmgate_requests_total",
            "warmgate_time_to_first_byte_seconds",
            "warmgate_replicas",
            "warmgate_autoscaler_panicking",
            "warmgate_cold_start_seconds",
            "warmgate_tasks_total",
            "warmgate_weight_sync_seconds",
        ] {
            assert!(read.contains(name), "{name} is not on the dashboard");
        }
    }

    #[test]
    fn names_are_unique_and_histograms_have_rising_buckets() {
        let mut names: Vec<_> = METRICS.iter().map(|m| m.name).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), METRICS.len());
        for m in METRICS {
            assert!(m.name.starts_with("warmgate_"));
            assert_eq!(
                m.kind == Kind::Histogram,
                !m.buckets.is_empty(),
                "{}",
                m.name
            );
            assert!(m.buckets.windows(2).all(|w| w[0] < w[1]), "{}", m.name);
            if m.kind == Kind::Counter {
                assert!(m.name.ends_with("_total"), "{}", m.name);
            }
        }
    }

    #[test]
    fn the_docs_reference_table_is_the_catalog() {
        let docs = include_str!("../../docs/observability.md");
        assert!(
            docs.contains(&reference_table()),
            "docs/observability.md is out of date; paste:\n{}",
            reference_table()
        );
    }
}
