//! Training to serving, for real: `charlm-train` writes a checkpoint per
//! epoch while traffic flows; the watcher promotes each complete one; the
//! served model gets better and no request fails.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

use common::{Gateway, bin, eventually};
use serde_json::{Value, json};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn checkpoints_from_training_are_promoted_while_traffic_flows() {
    let root = tempfile::tempdir().expect("dir");
    let ckpts = root.path().join("ckpts");
    std::fs::create_dir_all(&ckpts).expect("mkdir");
    let gw = Gateway::start(&format!(
        r#"
        [[apps]]
        name = "charlm"
        command = ["{}"]
        concurrency = 8

        [apps.autoscale]
        min = 1
        max = 1

        [apps.promotion]
        watch = "file://{}"
        watch_interval = "100ms"
        "#,
        bin("charlm-worker").display(),
        ckpts.display()
    ));
    gw.wait_ready("charlm", 1).await;

    // Traffic: completions, streamed and whole, until told to stop.
    let stop = Arc::new(AtomicBool::new(false));
    let ok = Arc::new(AtomicU64::new(0));
    let failed = Arc::new(AtomicU64::new(0));
    // What the first failed request got, for the assertion's message.
    let first_failure = Arc::new(std::sync::Mutex::new(None::<String>));
    let seen = Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let clients: Vec<_> = (0..4)
        .map(|i| {
            let (stop, ok, failed, seen) = (stop.clone(), ok.clone(), failed.clone(), seen.clone());
            let first_failure = first_failure.clone();
            let (http, url) = (gw.http.clone(), gw.at("/v1/completions"));
            tokio::spawn(async move {
                let stream = i % 2 == 0;
                while !stop.load(Ordering::Relaxed) {
                    let body = json!({"model": "charlm", "prompt": "the ", "max_tokens": 12,
                                      "temperature": 0, "stream": stream});
                    let r = http.post(&url).json(&body).send().await;
                    let mut why = String::new();
                    let good = match r {
                        Ok(r) if r.status().is_success() => {
                            let rev = r
                                .headers()
                                .get("x-warmgate-revision")
                                .and_then(|v| v.to_str().ok())
                                .unwrap_or("")
                                .to_string();
                            let text = r.text().await.unwrap_or_default();
                            let whole = if stream {
                                text.contains("data: [DONE]")
                            } else {
                                serde_json::from_str::<Value>(&text)
                                    .is_ok_and(|v| v["choices"][0]["text"].is_string())
                            };
                            if !whole {
                                why = format!("{rev} answered an incomplete body: {text}");
                            }
                            let mut s = seen.lock().unwrap_or_else(|e| e.into_inner());
                            if s.last() != Some(&rev) {
                                s.push(rev);
                            }
                            whole
                        }
                        Ok(r) => {
                            let status = r.status();
                            why = format!("{status}: {}", r.text().await.unwrap_or_default());
                            false
                        }
                        Err(e) => {
                            why = format!("{e:?}");
                            false
                        }
                    };
                    if good {
                        ok.fetch_add(1, Ordering::Relaxed);
                    } else {
                        failed.fetch_add(1, Ordering::Relaxed);
                        first_failure
                            .lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .get_or_insert(why);
                    }
                }
            })
        })
        .collect();

    // Training, three epochs, while the traffic flows.
    let out = {
        let ckpts = ckpts.clone();
        tokio::task::spawn_blocking(move || {
            std::process::Command::new(bin("charlm-train"))
                .arg("--out")
                .arg(&ckpts)
                .args(["--epochs", "3", "--steps", "40"])
                .output()
                .expect("run charlm-train")
        })
        .await
        .expect("join")
    };
    let log = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{log}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let losses: Vec<f64> = log
        .lines()
        .filter_map(|l| {
            l.split("loss ")
                .nth(1)?
                .split_whitespace()
                .next()?
                .parse()
                .ok()
        })
        .collect();
    assert_eq!(losses.len(), 4, "{log}");
    assert!(
        losses.windows(2).all(|w| w[1] < w[0]),
        "the loss falls every epoch: {losses:?}"
    );

    // The last epoch ends up serving all traffic.
    let marker = ckpts.join("epoch-003/_COMPLETE");
    let written = std::fs::metadata(&marker)
        .and_then(|m| m.modified())
        .expect("marker");
    let serving = eventually("epoch-003 serves", || async {
        let revs = gw.json("/v1/apps/charlm/revisions").await;
        let top = &revs["revisions"][0];
        let done = revs["promotion"]["phase"] == "done"
            && top["traffic"] == 100
            && top["checkpoint"]
                .as_str()
                .is_some_and(|c| c.ends_with("epoch-003"));
        done.then(|| top["id"].as_str().unwrap_or("").to_string())
    })
    .await;
    let took = SystemTime::now()
        .duration_since(written)
        .unwrap_or(Duration::ZERO);
    eprintln!("checkpoint written -> serving 100%: at most {took:?}");

    // Traffic on it for a moment, then stop.
    let before = ok.load(Ordering::Relaxed);
    eventually("traffic on the last revision", || async {
        (ok.load(Ordering::Relaxed) > before + 20).then_some(())
    })
    .await;
    stop.store(true, Ordering::Relaxed);
    for c in clients {
        let _ = c.await;
    }
    let seen = seen.lock().unwrap_or_else(|e| e.into_inner()).clone();
    assert_eq!(
        failed.load(Ordering::Relaxed),
        0,
        "no request failed; the first got {:?}",
        first_failure.lock().unwrap_or_else(|e| e.into_inner())
    );
    assert!(seen.len() >= 2, "the served revision changed: {seen:?}");
    assert_eq!(seen.first().map(String::as_str), Some("charlm-00001"));
    assert_eq!(seen.last(), Some(&serving), "{seen:?}");

    // And it writes words: the trained model completes with the corpus's
    // vocabulary, where an untrained one emits random letters.
    let r = gw
        .http
        .post(gw.at("/v1/completions"))
        .json(&json!({"model": "charlm", "prompt": "the cat ", "max_tokens": 60, "temperature": 0}))
        .send()
        .await
        .expect("send");
    let v: Value = r.json().await.expect("json");
    let text = v["choices"][0]["text"].as_str().unwrap_or("");
    let vocabulary = [
        "the",
        "cat",
        "dog",
        "old",
        "man",
        "sister",
        "farmer",
        "small",
        "bird",
        "teacher",
        "neighbour",
        "sees",
        "likes",
        "finds",
        "carries",
        "paints",
        "follows",
        "feeds",
        "watches",
        "red",
        "ball",
        "green",
        "apple",
        "river",
        "quiet",
        "house",
        "morning",
        "sun",
        "wooden",
        "boat",
        "tall",
        "tree",
        "warm",
        "loaf",
        "bread",
        "every",
        "day",
        "garden",
        "near",
        "road",
        "before",
        "dinner",
        "night",
        "with",
        "great",
        "care",
    ];
    let known: std::collections::HashSet<&str> = text
        .split(|c: char| !c.is_ascii_alphabetic())
        .filter(|w| vocabulary.contains(w))
        .collect();
    assert!(
        known.len() >= 3,
        "a trained completion uses the corpus's words: {text:?}"
    );

    // The official client streams it.
    if !common::has_openai() {
        return;
    }
    let script = r#"
import sys
from openai import OpenAI
client = OpenAI(base_url=sys.argv[1] + "/v1", api_key="unused")
parts = [c.choices[0].text for c in client.completions.create(
    model="charlm", prompt="the cat ", max_tokens=20, temperature=0, stream=True)]
print(len(parts), "".join(parts).replace("\n", "/"))
"#;
    let printed = common::python(script, &gw.url).await;
    let chunks: usize = printed
        .split_whitespace()
        .next()
        .and_then(|n| n.parse().ok())
        .unwrap_or(0);
    assert!(chunks >= 20, "one chunk per character, streamed: {printed}");
}
