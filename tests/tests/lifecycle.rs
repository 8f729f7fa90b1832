//! The gateway's own lifecycle: config checks, GPUs, graceful shutdown.

mod common;

use std::collections::HashSet;
use std::process::Command;

use common::{Gateway, alive, bin, eventually};
use serde_json::Value;

fn check(config: &str) -> (i32, String) {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("bad.toml");
    std::fs::write(&path, config).expect("write");
    let out = Command::new(bin("warmgate"))
        .args(["serve", "--check", "--config"])
        .arg(&path)
        .output()
        .expect("run warmgate");
    let text =
        String::from_utf8_lossy(&out.stderr).to_string() + &String::from_utf8_lossy(&out.stdout);
    (out.status.code().unwrap_or(-1), text)
}

#[test]
fn serve_check_exits_64_naming_the_key_and_the_file() {
    let (code, text) = check("[[apps]]\nname = \"a\"\ncommand = [\"w\"]\nconcurency = 2\n");
    assert_eq!(code, 64, "{text}");
    assert!(text.contains("bad.toml"), "names the file: {text}");
    assert!(text.contains("apps[0].concurency"), "names the key: {text}");

    let (code, text) =
        check("[[apps]]\nname = \"a\"\ncommand = [\"w\"]\n[apps.autoscale]\nmin = 5\nmax = 2\n");
    assert_eq!(code, 64, "{text}");
    assert!(text.contains("apps[0].autoscale.min"), "{text}");

    let (code, text) = check("[[apps]]\nname = \"a\"\ncommand = [\"sh\"]\n");
    assert_eq!(code, 0, "{text}");
}

#[test]
fn serve_check_fails_on_a_missing_program_and_warns_of_a_missing_checkpoint() {
    let (code, text) = check(
        "[[apps]]\nname = \"a\"\ncommand = [\"./no-such-worker\"]\n\
         [[apps]]\nname = \"b\"\ncommand = [\"no-such-program-on-path\"]\n\
         [[apps]]\nname = \"c\"\ncommand = [\"sh\"]\ncheckpoint = \"file:///no/such/ckpt\"\n",
    );
    assert_eq!(code, 64, "{text}");
    assert!(
        text.contains("error:")
            && text.contains("apps[0].command[0]")
            && text.contains("no-such-worker does not exist"),
        "{text}"
    );
    assert!(
        text.contains("apps[1].command[0]") && text.contains("not a program on PATH"),
        "{text}"
    );
    assert!(
        text.contains("warning:") && text.contains("apps[2].checkpoint"),
        "a checkpoint written later is a warning: {text}"
    );
    assert!(text.contains("2 errors (1 warning"), "{text}");

    // Only warnings: valid, and said so.
    let (code, text) = check(
        "[[apps]]\nname = \"c\"\ncommand = [\"sh\"]\ncheckpoint = \"file:///no/such/ckpt\"\n",
    );
    assert_eq!(code, 0, "{text}");
    assert!(text.contains("ok (1 app, 1 warning)"), "{text}");
}

#[test]
fn the_example_configs_are_valid() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/configs");
    let mut n = 0;
    for entry in std::fs::read_dir(&root).expect("examples/configs exists") {
        let path = entry.expect("entry").path();
        if path.extension().is_some_and(|e| e == "toml") {
            let out = Command::new(bin("warmgate"))
                .args(["serve", "--check", "--config"])
                .arg(&path)
                .output()
                .expect("run warmgate");
            // Valid as written: the only errors allowed are programs this
            // machine lacks (vLLM, SGLang, the release builds of the
            // example workers), which `--check` rightly names.
            let err = String::from_utf8_lossy(&out.stderr);
            let schema_errors: Vec<&str> = err
                .lines()
                .filter(|l| l.starts_with("error:") && !l.contains(".command[0]:"))
                .collect();
            assert!(
                out.status.success() || (out.status.code() == Some(64) && schema_errors.is_empty()),
                "{}: {err}",
                path.display()
            );
            n += 1;
        }
    }
    assert!(n > 0, "no example configs found in {}", root.display());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gpus_are_never_shared_and_a_replica_without_one_waits() {
    let gw = Gateway::start(
        r#"
        [backend]
        gpus = [0, 1]
        [[apps]]
        name = "gpu"
        command = ["{worker}"]
        gpus = 1
        [apps.autoscale]
        min = 3
        max = 3
        [[apps]]
        name = "cpu"
        command = ["{worker}"]
        [apps.autoscale]
        min = 1
        max = 1
        "#,
    );
    let s = eventually("two GPU replicas ready and one pending", || async {
        let s = gw.app_status("gpu").await;
        let states: Vec<String> = s["pool"]["replicas"]
            .as_array()?
            .iter()
            .filter_map(|r| r["state"].as_str().map(String::from))
            .collect();
        let ready = states.iter().filter(|x| *x == "ready").count();
        let pending = states.iter().filter(|x| *x == "pending").count();
        (ready == 2 && pending == 1).then_some(s)
    })
    .await;
    let pending = s["pool"]["replicas"]
        .as_array()
        .expect("replicas")
        .iter()
        .find(|r| r["state"] == "pending")
        .expect("a pending replica");
    assert!(
        pending["reason"]
            .as_str()
            .unwrap_or_default()
            .contains("needs 1 GPU(s), 0 of 2 free"),
        "the reason is shown: {pending}"
    );

    // Each ready replica sees its own GPU.
    let mut seen = HashSet::new();
    for _ in 0..50 {
        let stats: Value = gw.json("/apps/gpu/stats").await;
        seen.insert(
            stats["env"]["CUDA_VISIBLE_DEVICES"]
                .as_str()
                .unwrap_or("?")
                .to_string(),
        );
        if seen.len() == 2 {
            break;
        }
    }
    assert_eq!(seen, HashSet::from(["0".to_string(), "1".to_string()]));

    // A replica that asked for no GPU sees none.
    eventually("the cpu app is ready", || async {
        (gw.app_status("cpu").await["ready"] == 1).then_some(())
    })
    .await;
    let stats: Value = gw.json("/apps/cpu/stats").await;
    assert_eq!(stats["env"]["CUDA_VISIBLE_DEVICES"], "");
    assert_eq!(stats["env"]["WARMGATE_TARGET"], "cpu");
    assert_eq!(stats["env"]["WARMGATE_REVISION"], "cpu-00001");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_finishes_requests_in_flight_and_leaves_no_process_behind() {
    let mut gw = Gateway::start(
        r#"
        [backend]
        stop_grace = "10s"
        [[apps]]
        name = "svc"
        command = ["{worker}"]
        [apps.autoscale]
        min = 2
        max = 2
        "#,
    );
    let pids = eventually("two replicas ready", || async {
        let pids = gw.replica_pids("svc").await;
        (gw.app_status("svc").await["ready"] == 2 && pids.len() == 2).then_some(pids)
    })
    .await;
    assert!(pids.iter().all(|p| alive(*p)));

    let http = gw.http.clone();
    let slow = tokio::spawn(http.get(gw.at("/apps/svc/slow?latency_ms=1500")).send());
    eventually("the slow request is in flight", || async {
        (gw.app_status("svc").await["inflight"] == 1).then_some(())
    })
    .await;
    let status = tokio::task::spawn_blocking(move || {
        let status = gw.stop();
        (status, gw)
    });
    let resp = slow
        .await
        .expect("task")
        .expect("the in-flight request completes");
    assert_eq!(resp.status(), 200);
    let (status, gw) = status.await.expect("stop");
    assert!(status.success(), "clean exit: {status}\n{}", gw.log());
    for pid in pids {
        assert!(!alive(pid), "replica process {pid} outlived the gateway");
    }
}

/// A second gateway started on a state folder in use stops at once,
/// naming the holder, and touches nothing: the first one's replica is
/// neither killed as an orphan nor restarted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_gateway_on_a_state_folder_in_use_stops_and_harms_nothing() {
    let gw = Gateway::start(
        r#"
        [[apps]]
        name = "svc"
        command = ["{worker}"]
        [apps.autoscale]
        min = 1
        "#,
    );
    let pids = eventually("the replica is ready", || async {
        let pids = gw.replica_pids("svc").await;
        (gw.app_status("svc").await["ready"] == 1 && pids.len() == 1).then_some(pids)
    })
    .await;
    let mut second = Command::new(bin("warmgate"))
        .args(["serve", "--config"])
        .arg(gw.dir.path().join("warmgate.toml"))
        .args(["--listen", "127.0.0.1:0"])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("start the second gateway");
    let status = eventually("the second gateway exits", || {
        let exited = second.try_wait().expect("wait");
        async move { exited }
    })
    .await;
    let mut stderr = String::new();
    std::io::Read::read_to_string(second.stderr.as_mut().expect("stderr"), &mut stderr)
        .expect("read stderr");
    assert!(!status.success(), "{stderr}");
    assert!(stderr.contains("in use by another warmgate"), "{stderr}");
    assert!(stderr.contains("state_dir"), "{stderr}");
    assert!(alive(pids[0]), "the first gateway's replica was killed");
    assert_eq!(
        gw.replica_pids("svc").await,
        pids,
        "the replica was replaced"
    );
    let r = gw
        .http
        .get(gw.at("/apps/svc/hello"))
        .send()
        .await
        .expect("send");
    assert_eq!(r.status(), 200);
}

#[test]
fn simulate_prints_the_policy_table_for_each_cold_start() {
    let dir = tempfile::tempdir().expect("dir");
    let mut csv = String::from("TIMESTAMP,ContextTokens,GeneratedTokens\n");
    for i in 0..600 {
        csv.push_str(&format!(
            "2023-11-16 18:{:02}:{:02}.5000000,{},{}\n",
            15 + i / 60,
            i % 60,
            300 + i % 7,
            40 + i % 11
        ));
    }
    std::fs::write(dir.path().join("trace.csv"), csv).expect("write");
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let out = Command::new(bin("warmgate"))
        .args(["simulate", "--trace"])
        .arg(dir.path().join("trace.csv"))
        .arg("--config")
        .arg(root.join("examples/configs/llm-sim.toml"))
        .args(["--cold-start", "2s,60s"])
        .arg("--plot")
        .arg(dir.path().join("replicas.svg"))
        .output()
        .expect("run");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains("600 requests"), "{text}");
    assert_eq!(text.matches("| **warmgate** |").count(), 2, "{text}");
    for name in [
        "warmgate pool (tasks)",
        "Knative defaults",
        "Ray Serve defaults",
        "always at peak",
        "vs bound",
        "dominated by",
    ] {
        assert!(text.contains(name), "{name}: {text}");
    }
    // One SVG per cold start, with every policy in its legend.
    for cold in ["2s", "1m"] {
        let svg = std::fs::read_to_string(dir.path().join(format!("replicas-{cold}.svg")))
            .unwrap_or_else(|e| panic!("replicas-{cold}.svg: {e}\n{text}"));
        assert!(svg.starts_with("<svg"), "{}", &svg[..svg.len().min(200)]);
        for name in [
            "warmgate pool (tasks)",
            "Knative defaults",
            "demand / target",
        ] {
            assert!(svg.contains(name), "{name} missing from the plot");
        }
    }

    // Generated shapes, swept: the table and the plot land in the folder.
    let sweep = dir.path().join("sweep");
    let out = Command::new(bin("warmgate"))
        .args([
            "simulate",
            "--shape",
            "spikes,bursts-short",
            "--cold-start",
            "20s",
            "--sweep",
        ])
        .arg(&sweep)
        .output()
        .expect("run");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let md = std::fs::read_to_string(sweep.join("sweep.md")).expect("sweep.md");
    for row in [
        "| spikes | 20 s | **warmgate** |",
        "| bursts-short | 20 s | **warmgate** |",
    ] {
        assert!(md.contains(row), "{row}: {md}");
    }
    assert!(md.contains("bursty goal"), "{md}");
    let svg = std::fs::read_to_string(sweep.join("sweep.svg")).expect("sweep.svg");
    assert!(svg.starts_with("<svg") && svg.contains("clairvoyant frontier"));

    // Nothing to replay, or an unknown shape: usage errors.
    let out = Command::new(bin("warmgate"))
        .args(["simulate"])
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(64));
    assert!(String::from_utf8_lossy(&out.stderr).contains("nothing to replay"));
    let out = Command::new(bin("warmgate"))
        .args(["simulate", "--shape", "tsunami"])
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(64), "a usage error is EX_USAGE");
    assert!(String::from_utf8_lossy(&out.stderr).contains("known: steady"));

    // A bad trace is a clear usage error.
    std::fs::write(dir.path().join("bad.csv"), "TIMESTAMP,a,b\nyesterday,1,2\n").expect("write");
    let out = Command::new(bin("warmgate"))
        .args(["simulate", "--trace"])
        .arg(dir.path().join("bad.csv"))
        .arg("--config")
        .arg(root.join("examples/configs/llm-sim.toml"))
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(64));
    assert!(String::from_utf8_lossy(&out.stderr).contains("bad timestamp"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openapi_document_matches_the_routes() {
    let gw = common::Gateway::start(
        r#"
        [[apps]]
        name = "m"
        command = ["{worker}"]
        [[pools]]
        name = "p"
        command = ["{worker}"]
        replicas = [0, 1]
        "#,
    );
    let doc = gw.json("/openapi.json").await;
    assert!(
        doc["openapi"].as_str().is_some_and(|v| v.starts_with("3.")),
        "{doc}"
    );
    let paths = doc["paths"].as_object().expect("paths");
    // Every route the gateway serves is documented (the two other OpenAI
    // routes are described with /v1/chat/completions).
    for route in [
        "/v1/chat/completions",
        "/apps/{app}/{path}",
        "/v1/models",
        "/v1/status",
        "/v1/apps",
        "/v1/apps/{app}",
        "/v1/apps/{app}/promote",
        "/v1/apps/{app}/rollback",
        "/v1/apps/{app}/revisions",
        "/v1/apps/{app}/logs",
        "/v1/pools/{pool}/logs",
        "/v1/pools/{pool}/tasks",
        "/v1/pools/{pool}/tasks/batch",
        "/v1/pools/{pool}/weights",
        "/v1/tasks/{id}",
        "/v1/weights/{target}/{revision}",
        "/v1/weights/{target}/{revision}/{file}",
        "/ui",
        "/healthz",
        "/readyz",
        "/metrics",
    ] {
        assert!(paths.contains_key(route), "{route} is not documented");
    }
    // And every documented operation exists: the gateway answers it with a
    // handler, never with its "no route" or "method not allowed" errors.
    for (path, ops) in paths {
        for method in ops.as_object().expect("operations").keys() {
            let url = gw.at(&path
                .replace("{app}", "m")
                .replace("{pool}", "p")
                .replace("{path}", "x")
                .replace("{id}", "nope")
                .replace("{target}", "m")
                .replace("{revision}", "m-00001")
                .replace("{file}", "f"));
            let m = reqwest::Method::from_bytes(method.to_uppercase().as_bytes()).expect("method");
            let r = gw
                .http
                .request(m, &url)
                .header("content-type", "application/json")
                .body("{}")
                .send()
                .await
                .expect("send");
            let status = r.status();
            let text = r.text().await.unwrap_or_default();
            assert!(
                !text.contains("no route for") && status != 405,
                "{method} {path} is documented but not served: {status} {text}"
            );
        }
    }
    // Request bodies come from the handlers' own types.
    let schemas = doc["components"]["schemas"].as_object().expect("schemas");
    for s in [
        "TaskBody",
        "BatchBody",
        "SyncBody",
        "PromoteBody",
        "ErrorBody",
    ] {
        assert!(schemas.contains_key(s), "{s} missing");
    }
    assert!(
        schemas["TaskBody"]["properties"]
            .as_object()
            .is_some_and(|p| p.contains_key("min_weights_version")),
        "{}",
        schemas["TaskBody"]
    );
}

/// `warmgate` against a gateway: the exit code names the class of
/// failure (sysexits), so a script can tell "no such app" from "try
/// again" from "unreachable"; `-o json` prints the API's answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_exit_code_names_the_class_of_failure() {
    let gw = Gateway::start(
        r#"
        [[apps]]
        name = "m"
        command = ["{worker}"]
        "#,
    );
    let run = |args: &[&str], gateway: &str| {
        let out = Command::new(bin("warmgate"))
            .args(args)
            .args(["--gateway", gateway])
            .output()
            .expect("run warmgate");
        (
            out.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (code, _, err) = run(&["revisions", "nope"], &gw.url);
    assert_eq!(code, 66, "404 is EX_NOINPUT: {err}");
    assert!(err.contains("nope"), "{err}");
    let (code, _, err) = run(&["promote", "m", "nope://x"], &gw.url);
    assert_eq!(code, 65, "400 is EX_DATAERR: {err}");
    let (code, _, err) = run(&["status"], "http://127.0.0.1:9");
    assert_eq!(code, 69, "no answer is EX_UNAVAILABLE: {err}");

    let (code, out, err) = run(&["status", "-o", "json"], &gw.url);
    assert_eq!(code, 0, "{err}");
    let v: Value = serde_json::from_str(&out).expect("status -o json is JSON");
    assert_eq!(v["apps"][0]["name"], "m", "{v}");
    let (code, out, err) = run(&["revisions", "m", "--output", "json"], &gw.url);
    assert_eq!(code, 0, "{err}");
    let v: Value = serde_json::from_str(&out).expect("revisions -o json is JSON");
    assert!(
        v["revisions"].as_array().is_some_and(|r| !r.is_empty()),
        "{v}"
    );
    assert_eq!(
        v["revisions"][0]["spec"]["name"], "m",
        "a revision's spec is an object, not a string of JSON: {v}"
    );

    // Usage errors are 64 (EX_USAGE), as the reference says: a gateway
    // address without a scheme, a missing argument, an unknown flag.
    let (code, _, err) = run(&["status"], "127.0.0.1:9");
    assert_eq!(code, 64, "{err}");
    assert!(err.contains("http://"), "says what to give: {err}");
    let (code, _, err) = run(&["promote", "m"], &gw.url);
    assert_eq!(code, 64, "a missing CHECKPOINT: {err}");
    let (code, _, err) = run(&["status", "--no-such-flag"], &gw.url);
    assert_eq!(code, 64, "{err}");
    let (code, out, _) = run(&["--help"], &gw.url);
    assert_eq!(code, 0, "help is an answer");
    assert!(out.contains("Usage"), "{out}");

    // `status --watch | head`: the watch ends when its reader does.
    let out = Command::new("bash")
        .arg("-c")
        .arg(format!(
            "{} status --watch --interval 100ms --gateway {} | head -n 1 > /dev/null; \
             echo \"status=${{PIPESTATUS[0]}}\"",
            bin("warmgate").display(),
            gw.url
        ))
        .output()
        .expect("bash");
    let said = String::from_utf8_lossy(&out.stdout);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!err.contains("panicked"), "{err}");
    assert!(
        said.contains("status=141"),
        "killed by SIGPIPE: {said} {err}"
    );
}

/// A client command whose reader goes away ends quietly, as Unix tools
/// do (killed by SIGPIPE), not with a panic on the failed write.
#[test]
fn a_closed_pipe_ends_a_client_command_without_a_panic() {
    for args in ["completions bash", "completions zsh"] {
        let out = Command::new("bash")
            .arg("-c")
            .arg(format!(
                "{} {args} | head -c 10 > /dev/null; echo \"status=${{PIPESTATUS[0]}}\"",
                bin("warmgate").display()
            ))
            .output()
            .expect("bash");
        let said = String::from_utf8_lossy(&out.stdout);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!err.contains("panicked"), "{args}: {err}");
        assert!(
            said.contains("status=0") || said.contains("status=141"),
            "{args}: ended by SIGPIPE (141) or before it (0), not 101: {said} {err}"
        );
    }
}

/// `warmgate completions SHELL` prints a script the shell accepts.
#[test]
fn the_completion_scripts_are_valid_shell() {
    let out = Command::new(bin("warmgate"))
        .args(["completions", "bash"])
        .output()
        .expect("run warmgate");
    assert!(out.status.success());
    let script = String::from_utf8(out.stdout).expect("utf-8");
    for word in ["promote", "rollback", "status", "--output"] {
        assert!(script.contains(word), "{word} is completed");
    }
    let dir = tempfile::tempdir().expect("tmp");
    let path = dir.path().join("warmgate.bash");
    std::fs::write(&path, &script).expect("write");
    let check = Command::new("bash")
        .arg("-n")
        .arg(&path)
        .output()
        .expect("bash");
    assert!(
        check.status.success(),
        "{}",
        String::from_utf8_lossy(&check.stderr)
    );
    let out = Command::new(bin("warmgate"))
        .args(["completions", "tcsh"])
        .output()
        .expect("run warmgate");
    assert_eq!(
        out.status.code(),
        Some(64),
        "an unknown shell is a usage error"
    );
}

/// A change made through the API is kept over the config file at the next
/// start: said in the log and in `status`, and `serve --config-wins`
/// starts from the file alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_api_change_kept_over_the_file_is_said_and_config_wins_drops_it() {
    let mut gw = Gateway::start(
        r#"
        [[apps]]
        name = "m"
        command = ["{worker}"]
        concurrency = 2
        "#,
    );
    let concurrency =
        async |gw: &Gateway| gw.json("/v1/status").await["apps"][0]["concurrency"].clone();
    assert_eq!(concurrency(&gw).await, 2);
    let r = gw
        .http
        .put(gw.at("/v1/apps/m"))
        .json(&serde_json::json!({"command": [common::test_worker()], "concurrency": 3}))
        .send()
        .await
        .expect("put");
    assert!(
        r.status().is_success(),
        "{}",
        r.text().await.unwrap_or_default()
    );
    assert_eq!(
        gw.json("/v1/status").await["api_changes"],
        serde_json::json!(["app m"])
    );

    gw.restart();
    assert_eq!(concurrency(&gw).await, 3, "the API's change is kept");
    assert_eq!(
        gw.json("/v1/status").await["api_changes"],
        serde_json::json!(["app m"])
    );
    assert!(
        gw.log().contains("kept over the config file"),
        "the start says so: {}",
        gw.log()
    );
    let out = Command::new(bin("warmgate"))
        .args(["status", "--gateway", &gw.url])
        .output()
        .expect("run warmgate");
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(
        table.contains("kept over the config file: app m") && table.contains("--config-wins"),
        "{table}"
    );

    gw.restart_with(&["--config-wins"]);
    assert_eq!(concurrency(&gw).await, 2, "the file wins");
    assert!(gw.json("/v1/status").await.get("api_changes").is_none());
}
