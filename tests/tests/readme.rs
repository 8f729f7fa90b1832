//! The README's examples work as a new user would paste them: every `curl`
//! line runs against `warmgate serve` on the quickstart config.

mod common;

use common::Gateway;

fn root() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readme_curl_examples_work_against_the_quickstart_config() {
    let quickstart = std::fs::read_to_string(root().join("examples/configs/quickstart.toml"))
        .expect("the quickstart config exists");
    assert!(
        quickstart.contains("../../target/release/test-worker")
            && quickstart.contains("../../target/release/embedder")
            && quickstart.contains("../../target/release/cartpole-worker"),
        "the quickstart runs the workers the README builds"
    );
    // Same config, but with the binaries this test run built, and the
    // harness's own port and state folder.
    let ckpt = root().join("checkpoints/minilm");
    if !ckpt.join("model.safetensors").exists() {
        assert!(
            std::env::var_os("CI").is_none(),
            "CI fetches the MiniLM checkpoint (.ci/run)"
        );
        eprintln!("SKIPPED: run examples/fetch-minilm.sh first");
        return;
    }
    let ckpt = std::path::absolute(ckpt).expect("absolute");
    let root_checkpoints = ckpt.parent().expect("checkpoints/").to_path_buf();
    let config: String = quickstart
        .lines()
        .filter(|l| !l.starts_with("listen") && !l.starts_with("state_dir"))
        .map(|l| {
            l.replace("../../target/release/test-worker", "{worker}")
                .replace(
                    "../../target/release/embedder",
                    &common::bin("embedder").to_string_lossy(),
                )
                .replace(
                    "../../target/release/cartpole-worker",
                    &common::bin("cartpole-worker").to_string_lossy(),
                )
                .replace(
                    "file://../../checkpoints/minilm",
                    &format!("file://{}", ckpt.display()),
                )
                .replace(
                    "\"file://../../checkpoints\"",
                    &format!("\"file://{}\"", root_checkpoints.display()),
                )
                + "\n"
        })
        .collect();
    let gw = Gateway::start(&config);
    let hostport = gw.url.trim_start_matches("http://").to_string();

    // The README's tour, and the longer list of what works that it links.
    let readme = ["README.md", "docs/status.md"]
        .map(|f| std::fs::read_to_string(root().join(f)).expect(f))
        .join("\n");
    let curls: Vec<&str> = readme
        .lines()
        .map(str::trim)
        .filter(|l| l.starts_with("curl "))
        .collect();
    assert!(curls.len() >= 5, "the README shows curl examples");
    for line in curls {
        let cmd = line.replace("localhost:8080", &hostport);
        let out = tokio::process::Command::new("sh")
            .args(["-c", &cmd])
            .output()
            .await
            .expect("run curl");
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{line}\nfailed: {out:?}");
        assert!(!text.is_empty(), "{line}\nprinted nothing");
        if line.contains("\"nope\"") {
            assert!(text.contains("\"kind\":\"not_found\""), "{line}\n{text}");
        } else {
            assert!(!text.contains("\"error\""), "{line}\n{text}");
            assert!(
                !text.starts_with("HTTP/1.1 4") && !text.starts_with("HTTP/1.1 5"),
                "{line}\n{text}"
            );
        }
        if line.contains("/v1/embeddings") {
            assert!(text.contains("\"embedding\""), "{line}\n{text}");
        }
        if line.contains("\"stream\": true") {
            assert!(text.contains("data: [DONE]"), "{line}\n{text}");
        }
    }
}
