//! The soak's short version (`benches/soak.py`, a minute): the real
//! binary with real workers under mixed traffic from two tenants, with a
//! fault every few seconds in turn (a worker killed, a weight sync, live
//! changes, a promotion rolled back, SIGHUP, the gateway killed and
//! restarted). Fails on a request or task lost or answered twice, or a
//! worker process left behind. The ten-minute run and its figures are in
//! `docs/reliability.md`.

mod common;

#[test]
fn a_minute_of_load_and_faults_loses_nothing_and_leaks_no_process() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let out = tempfile::tempdir().expect("dir");
    let run = std::process::Command::new("python3")
        .arg(root.join("benches/soak.py"))
        .args(["--duration", "60", "--period", "9", "--sample-every", "3"])
        .arg("--out")
        .arg(out.path())
        .output()
        .expect("run benches/soak.py");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&run.stdout),
        String::from_utf8_lossy(&run.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(
        &std::fs::read(out.path().join("soak.json"))
            .unwrap_or_else(|e| panic!("no soak.json ({e}): {text}")),
    )
    .expect("soak.json");
    assert_eq!(report["lost"], 0, "{}\n{text}", report["lost_detail"]);
    assert_eq!(report["duplicated"], 0, "{text}");
    assert_eq!(report["leaked_workers"], serde_json::json!([]), "{text}");
    assert_eq!(
        report["workers_after_stop"],
        serde_json::json!([]),
        "{text}"
    );
    let faults = report["faults"].as_array().map_or(0, Vec::len);
    assert!(faults >= 6, "every kind of fault ran: {text}");
    assert!(
        report["faults"]
            .as_array()
            .is_some_and(|f| f.iter().any(|x| x["what"]
                .as_str()
                .is_some_and(|w| w.contains("kill -9 of the gateway")))),
        "{text}"
    );
    assert!(run.status.success(), "{text}");
    eprintln!("{text}");
}
