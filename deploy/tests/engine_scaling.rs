//! `[apps.autoscale] target_waiting` and `target_kv_cache_usage`: read,
//! bounded, and refused without the engine's metrics to read.

use std::path::Path;

use warmgate_deploy::Config;

fn parse(autoscale: &str, engine: &str) -> Result<Config, String> {
    let text = format!(
        "[[apps]]\nname = \"llm\"\ncommand = [\"./serve\"]\n[apps.autoscale]\n{autoscale}\n{engine}\n"
    );
    Config::parse(&text, Path::new("test.toml"), Path::new("/base")).map_err(|e| e.to_string())
}

const ENGINE: &str = "[apps.engine]\nmetrics_path = \"/metrics\"";

#[test]
fn engine_targets_are_read_with_the_engine_s_metrics() {
    let c = parse("target_waiting = 2\ntarget_kv_cache_usage = 0.8", ENGINE).unwrap();
    assert_eq!(c.apps[0].autoscale.target_waiting, Some(2.0));
    assert_eq!(c.apps[0].autoscale.target_kv_cache_usage, Some(0.8));
    let plain = parse("", "").unwrap();
    assert_eq!(plain.apps[0].autoscale.target_waiting, None);
}

#[test]
fn bad_engine_targets_name_the_key() {
    for (autoscale, engine, key, says) in [
        (
            "target_waiting = 0",
            ENGINE,
            "autoscale.target_waiting",
            "above 0",
        ),
        (
            "target_waiting = -1",
            ENGINE,
            "autoscale.target_waiting",
            "above 0",
        ),
        (
            "target_kv_cache_usage = 1.5",
            ENGINE,
            "autoscale.target_kv_cache_usage",
            "at most 1.0",
        ),
        (
            "target_kv_cache_usage = 0",
            ENGINE,
            "autoscale.target_kv_cache_usage",
            "at most 1.0",
        ),
        (
            "target_waiting = 2",
            "",
            "autoscale.target_waiting",
            "metrics_path",
        ),
        (
            "target_kv_cache_usage = 0.8",
            "",
            "autoscale.target_kv_cache_usage",
            "metrics_path",
        ),
    ] {
        let e = parse(autoscale, engine).unwrap_err();
        assert!(e.contains(key) && e.contains(says), "{autoscale}: {e}");
    }
}
