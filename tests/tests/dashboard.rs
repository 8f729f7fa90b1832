//! The live dashboard in a real headless Chromium: it loads from the
//! gateway, reads `/v1/status`, and shows the apps, pools and replicas.

mod common;

use std::path::PathBuf;
use std::process::Command;

use common::{Gateway, eventually};

/// Debian's `chromium`, or another Chromium on the PATH.
fn chromium() -> Option<String> {
    ["chromium", "chromium-browser", "google-chrome"]
        .into_iter()
        .find(|c| {
            Command::new(c)
                .arg("--version")
                .output()
                .is_ok_and(|o| o.status.success())
        })
        .map(str::to_string)
}

/// Chromium, or `None` (the test is skipped) off CI; under CI it must be
/// there.
fn chromium_or_skip() -> Option<String> {
    let found = chromium();
    if found.is_none() {
        assert!(
            std::env::var_os("CI").is_none(),
            "Chromium is required under CI (.ci/run installs it)"
        );
        eprintln!("SKIPPED: apt-get install chromium");
    }
    found
}

fn headless(browser: &str, args: &[&str]) -> std::process::Output {
    let profile = tempfile::tempdir().expect("profile dir");
    Command::new(browser)
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--no-first-run",
            "--virtual-time-budget=4000",
        ])
        .arg(format!("--user-data-dir={}", profile.path().display()))
        .args(args)
        .output()
        .expect("run chromium")
}

/// The page as the browser built it once its script has read the API
/// and the DOM holds `wanted`.
async fn rendered(browser: &str, url: &str, wanted: &str) -> String {
    eventually("the dashboard shows its data", || {
        let (browser, url, wanted) = (browser.to_string(), url.to_string(), wanted.to_string());
        async move {
            let out =
                tokio::task::spawn_blocking(move || headless(&browser, &["--dump-dom", &url]))
                    .await
                    .expect("join");
            let dom = String::from_utf8_lossy(&out.stdout).into_owned();
            (dom.contains("data-loaded=\"true\"") && dom.contains(&wanted)).then_some(dom)
        }
    })
    .await
}

/// An app in a crash loop says so on its card, with the worker's last
/// output, instead of showing `starting` with no reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_shows_why_an_app_is_not_serving() {
    let Some(browser) = chromium_or_skip() else {
        return;
    };
    let gw = Gateway::start(
        r#"
        [[apps]]
        name = "broken"
        command = ["{worker}"]
        env = { TEST_WORKER_EXIT_AT_START = "3" }
        "#,
    );
    gw.wait_crash_loop("broken").await;
    let url = format!("{}#token={}", gw.at("/ui"), gw.admin_token());
    let dom = rendered(&browser, &url, "data-failure").await;
    assert!(dom.contains("CrashLoopBackOff"), "{dom}");
    assert!(
        dom.contains("TEST_WORKER_EXIT_AT_START=3, exiting before binding"),
        "the worker's last output: {dom}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_renders_apps_pools_and_replicas_in_chromium() {
    let Some(browser) = chromium_or_skip() else {
        return;
    };
    let adapters = tempfile::tempdir().expect("dir");
    let gw = Gateway::start(&format!(
        r#"
        [[apps]]
        name = "chat"
        command = ["{{worker}}"]
        [apps.autoscale]
        min = 2
        max = 3
        [[apps.adapters.models]]
        name = "sql-lora"
        checkpoint = "file://{adapters}"
        aliases = ["sql"]

        [[pools]]
        name = "rollouts"
        command = ["{{worker}}"]
        replicas = [1, 1]
        "#,
        adapters = adapters.path().display()
    ));
    gw.wait_ready("chat", 2).await;
    eventually("the pool is ready", || async {
        let s = gw.json("/v1/status").await;
        (s["pools"][0]["ready"] == 1).then_some(())
    })
    .await;

    // The page as the browser built it, once its script has read the API
    // with the token the gateway made (as its start-up log shows the URL).
    let url = format!("{}#token={}", gw.at("/ui"), gw.admin_token());
    let dom = rendered(&browser, &url, "data-loaded=\"true\"").await;
    assert!(dom.contains("data-app=\"chat\""), "{dom}");
    assert!(dom.contains("data-pool=\"rollouts\""), "{dom}");
    assert!(dom.contains(">2/2<"), "ready/desired of the app: {dom}");
    assert_eq!(
        dom.matches("data-replica=\"chat-00001-").count(),
        2,
        "both app replicas are listed"
    );
    assert!(dom.contains("data-replica=\"rollouts-1\""), "{dom}");
    assert!(dom.contains("data-revision=\"chat-00001\""), "{dom}");
    assert!(dom.contains("100%"), "the revision's traffic: {dom}");
    assert!(dom.contains("<canvas"), "the demand chart");
    assert!(
        dom.contains("data-adapter=\"sql-lora\"") && dom.contains("sql-lora (sql)"),
        "the app's adapters, with their aliases: {dom}"
    );

    // A screenshot for people to look at.
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("dashboard");
    std::fs::create_dir_all(&dir).expect("mkdir");
    let shot = dir.join("dashboard.png");
    let _ = std::fs::remove_file(&shot);
    let out = headless(
        &browser,
        &[
            "--window-size=1280,900",
            &format!("--screenshot={}", shot.display()),
            &url,
        ],
    );
    let png = std::fs::read(&shot).unwrap_or_else(|e| {
        panic!(
            "no screenshot at {}: {e}\n{}",
            shot.display(),
            String::from_utf8_lossy(&out.stderr)
        )
    });
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
    eprintln!("screenshot: {}", shot.display());
}
