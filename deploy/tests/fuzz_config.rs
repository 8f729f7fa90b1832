//! Fuzzing the config parser: arbitrary text, mutations of a full config,
//! and hostile values for every kind of key. The parser must never panic,
//! and whatever it accepts must pass validation and hold no value that
//! would break the code that runs on it.

use std::path::Path;

use proptest::prelude::*;
use warmgate_deploy::Config;

/// A config that sets every section.
const FULL: &str = r#"
listen = "127.0.0.1:8080"
state_dir = ".warmgate"
[backend]
kind = "local"
gpus = [0, 1]
stop_grace = "30s"
[limits]
max_body_bytes = 1048576
max_connections = 100
header_read_timeout = "10s"
idle_timeout = "60s"
request_timeout = "300s"
[weights]
concurrency = 8
part_size_bytes = 8388608
[[apps]]
name = "minilm"
aliases = ["text-embedding-3-small"]
command = ["./embedder", "--port", "0"]
checkpoint = "file://./checkpoints/minilm"
concurrency = 8
gpus = 1
startup_timeout = "300s"
[apps.env]
HF_HOME = "/tmp/hf"
[apps.autoscale]
min = 0
max = 4
target = 4
scale_to_zero_after = "60s"
stable_window = "60s"
panic_window = "6s"
[apps.queue]
max_pending = 1000
timeout = "120s"
[apps.promotion]
canary = 10
bake = "60s"
max_error_rate = 0.05
[[pools]]
name = "rollouts"
command = ["./cartpole-worker"]
replicas = [2, 10]
concurrency = 4
idle_ttl = "300s"
[pools.queue]
max_pending = 100000
fairness = "tenant"
[[tenants]]
name = "team-a"
api_key_sha256 = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"
max_inflight = 10
rps = 5.5
"#;

fn parse(text: &str) -> Result<Config, warmgate_deploy::Error> {
    Config::parse(text, Path::new("fuzz.toml"), Path::new("/base"))
}

/// What an accepted config must satisfy whatever its text was.
fn check_accepted(c: &Config) {
    assert!(c.validate().is_ok(), "parse accepted what validate refuses");
    for a in &c.apps {
        let s = &a.autoscale;
        assert!(s.max >= s.min, "max below min accepted");
        for f in [
            s.panic_threshold,
            s.max_scale_up_rate,
            s.max_scale_down_rate,
            s.target_utilization,
            s.target.unwrap_or(1.0),
        ] {
            assert!(f.is_finite(), "a non-finite rate was accepted");
        }
        assert!(a.promotion.max_error_rate.is_finite());
        assert!(a.concurrency >= 1);
    }
    for p in &c.pools {
        assert!(p.replicas[0] <= p.replicas[1]);
        assert!(p.concurrency >= 1);
    }
    for t in &c.tenants {
        if let Some(r) = t.rps {
            assert!(r.is_finite() && r > 0.0);
        }
    }
    // Deadline arithmetic on any accepted duration must not overflow.
    let now = std::time::Instant::now();
    for a in &c.apps {
        let _ = now + a.startup_timeout + a.queue.timeout + a.autoscale.stable_window;
    }
    for p in &c.pools {
        let _ = now + p.task_timeout + p.idle_ttl + p.weight_sync_timeout;
    }
    let _ = now + c.limits.request_timeout + c.limits.idle_timeout;
}

/// Values that have broken parsers before: wrong types, extremes, NaN.
fn hostile_value() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("-1".to_string()),
        Just("0".to_string()),
        Just("18446744073709551615".to_string()),
        Just("9223372036854775807".to_string()),
        Just("nan".to_string()),
        Just("inf".to_string()),
        Just("-inf".to_string()),
        Just("1e308".to_string()),
        Just("\"\"".to_string()),
        Just("\"0s\"".to_string()),
        Just("\"-5s\"".to_string()),
        Just("\"99999999999y\"".to_string()),
        Just("\"584542046090y\"".to_string()),
        Just("\"1ns\"".to_string()),
        Just("\"../../etc\"".to_string()),
        Just("\"UPPER\"".to_string()),
        Just("[]".to_string()),
        Just("[1, 0]".to_string()),
        Just("{}".to_string()),
        Just("true".to_string()),
        "\"[^\"\\\\]{0,10}\"",
        any::<i64>().prop_map(|i| i.to_string()),
        any::<f64>().prop_map(|f| format!("{f:?}")),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1000))]

    /// Any text at all.
    #[test]
    fn arbitrary_text_never_panics(text in ".{0,300}") {
        if let Ok(c) = parse(&text) {
            check_accepted(&c);
        }
    }

    /// The full config with bytes inserted, removed or replaced.
    #[test]
    fn mutated_configs_never_panic(
        edits in proptest::collection::vec((any::<usize>(), 0usize..3, prop_oneof![
            Just("=".to_string()), Just("[".to_string()), Just("]".to_string()),
            Just("\"".to_string()), Just("\n".to_string()), Just("[[".to_string()),
            Just("0".to_string()), Just("-".to_string()), Just(".".to_string()),
            "[a-z_]{1,6}",
        ]), 1..6)
    ) {
        let mut text = FULL.to_string();
        for (pos, op, piece) in edits {
            let mut at = pos % (text.len() + 1);
            while !text.is_char_boundary(at) {
                at -= 1;
            }
            match op {
                0 => text.insert_str(at, &piece),
                1 => {
                    let mut end = (at + piece.len()).min(text.len());
                    while !text.is_char_boundary(end) {
                        end -= 1;
                    }
                    text.replace_range(at..end, "");
                }
                _ => {
                    let mut end = (at + piece.len()).min(text.len());
                    while !text.is_char_boundary(end) {
                        end -= 1;
                    }
                    text.replace_range(at..end, &piece);
                }
            }
        }
        if let Ok(c) = parse(&text) {
            check_accepted(&c);
        }
    }

    /// Every `key = value` line of the full config given a hostile value.
    #[test]
    fn hostile_values_are_refused_or_safe(line in 0usize..200, value in hostile_value()) {
        let lines: Vec<&str> = FULL.lines().collect();
        let assignments: Vec<usize> = lines
            .iter()
            .enumerate()
            .filter(|(_, l)| l.contains(" = "))
            .map(|(i, _)| i)
            .collect();
        let target = assignments[line % assignments.len()];
        let key = lines[target].split(" = ").next().unwrap_or("");
        let text: String = lines
            .iter()
            .enumerate()
            .map(|(i, l)| if i == target { format!("{key} = {value}") } else { (*l).to_string() })
            .collect::<Vec<_>>()
            .join("\n");
        match parse(&text) {
            Ok(c) => check_accepted(&c),
            Err(e) => {
                // A refusal names the key at fault (or the syntax).
                let msg = e.to_string();
                prop_assert!(msg.starts_with("fuzz.toml: "), "{}", msg);
            }
        }
    }
}

#[test]
fn the_full_config_parses() {
    let c = parse(FULL).expect("the fuzzing seed is valid");
    check_accepted(&c);
}
