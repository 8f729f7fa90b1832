//! `warmgate weights pull` and the weights streamer end to end: a local
//! folder, and a real S3-compatible server (moto) with real SigV4 requests
//! and range reads.

mod common;

use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;

use common::{Moto, bin};
use futures_util::TryStreamExt;
use object_store::aws::AmazonS3Builder;
use object_store::{ObjectStoreExt, PutPayload};
use warmgate_pool::weights::{Source, StreamConfig};

/// A safetensors file with a few tensors of distinct contents.
fn safetensors(tensors: usize, floats: usize) -> Vec<u8> {
    let mut entries = Vec::new();
    for i in 0..tensors {
        let (a, b) = (i * floats * 4, (i + 1) * floats * 4);
        entries.push(format!(
            "\"t{i}\":{{\"dtype\":\"F32\",\"shape\":[{floats}],\"data_offsets\":[{a},{b}]}}"
        ));
    }
    let json = format!("{{{}}}", entries.join(","));
    let mut out = (json.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(json.as_bytes());
    for i in 0..tensors * floats * 4 {
        out.push((i * 31 % 251) as u8);
    }
    out
}

fn pull(args: &[&str], cwd: &Path, env: &[(&str, String)]) -> (i32, String, String) {
    let out = Command::new(bin("warmgate"))
        .args(["weights", "pull"])
        .args(args)
        .current_dir(cwd)
        .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
        .output()
        .expect("run warmgate");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn pull_copies_a_local_checkpoint_and_the_cache_serves_the_second_pull() {
    let dir = tempfile::tempdir().expect("dir");
    let ck = dir.path().join("ck");
    std::fs::create_dir_all(ck.join("tokenizer")).expect("mkdir");
    let model = safetensors(6, 50_000);
    std::fs::write(ck.join("model.safetensors"), &model).expect("write");
    std::fs::write(ck.join("tokenizer/tokenizer.json"), br#"{"version":"1.0"}"#).expect("write");

    let (code, out, err) = pull(
        &[
            "file://./ck",
            "out",
            "--part-size-mib",
            "1",
            "--cache",
            "cache",
        ],
        dir.path(),
        &[],
    );
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("pulled 2 files"), "{out}");
    assert!(out.contains("(0 B from the cache)"), "{out}");
    assert_eq!(
        std::fs::read(dir.path().join("out/model.safetensors")).expect("read"),
        model
    );
    assert_eq!(
        std::fs::read(dir.path().join("out/tokenizer/tokenizer.json")).expect("read"),
        br#"{"version":"1.0"}"#
    );

    let (code, out, err) = pull(
        &["file://./ck", "again", "--cache", "cache"],
        dir.path(),
        &[],
    );
    assert_eq!(code, 0, "{err}");
    assert!(
        !out.contains("(0 B from the cache)"),
        "the second pull reads the cache: {out}"
    );
    assert_eq!(
        std::fs::read(dir.path().join("again/model.safetensors")).expect("read"),
        model
    );
}

fn sha256_hex(data: &[u8]) -> String {
    let out = Command::new("sha256sum")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .and_then(|mut c| {
            use std::io::Write;
            c.stdin.take().expect("stdin").write_all(data)?;
            c.wait_with_output()
        })
        .expect("sha256sum");
    String::from_utf8_lossy(&out.stdout)[..64].to_string()
}

#[test]
fn a_sha256sums_file_is_verified_and_a_mismatch_refused() {
    let dir = tempfile::tempdir().expect("dir");
    let ck = dir.path().join("ck");
    std::fs::create_dir_all(&ck).expect("mkdir");
    let model = safetensors(3, 10_000);
    std::fs::write(ck.join("model.safetensors"), &model).expect("write");
    std::fs::write(ck.join("config.json"), b"{}").expect("write");
    let good = format!(
        "{}  model.safetensors\n{}  config.json\n",
        sha256_hex(&model),
        sha256_hex(b"{}")
    );
    std::fs::write(ck.join("SHA256SUMS"), &good).expect("write");
    for cache in [true, false] {
        let mut args = vec!["file://./ck", "ok"];
        if cache {
            args.extend(["--cache", "cache"]);
        }
        let (code, _, err) = pull(&args, dir.path(), &[]);
        assert_eq!(code, 0, "{err}");
    }

    // One flipped byte in the data (same size, valid header): refused.
    let mut bad = model.clone();
    let last = bad.len() - 1;
    bad[last] ^= 0xff;
    std::fs::write(ck.join("model.safetensors"), &bad).expect("write");
    for cache in [true, false] {
        let out = format!("out-{cache}");
        let mut args = vec!["file://./ck", out.as_str()];
        if cache {
            args.extend(["--cache", "cache2"]);
        }
        let (code, _, err) = pull(&args, dir.path(), &[]);
        assert_eq!(code, 1);
        assert!(
            err.contains("file://./ck/model.safetensors") && err.contains("sha256 mismatch"),
            "{err}"
        );
        assert!(!dir.path().join(&out).join("model.safetensors").exists());
    }
    let bad_cached = std::fs::read_dir(dir.path().join("cache2"))
        .expect("cache folder")
        .flatten()
        .any(|e| e.metadata().is_ok_and(|m| m.len() == bad.len() as u64));
    assert!(!bad_cached, "the bad model is never cached");
}

#[test]
fn pull_refuses_a_lying_checkpoint_before_downloading_it() {
    let dir = tempfile::tempdir().expect("dir");
    std::fs::create_dir_all(dir.path().join("ck")).expect("mkdir");
    let model = safetensors(2, 1000);
    std::fs::write(
        dir.path().join("ck/model.safetensors"),
        &model[..model.len() - 3],
    )
    .expect("write");
    let (code, _, err) = pull(&["file://./ck", "out", "--cache", "cache"], dir.path(), &[]);
    assert_eq!(code, 1);
    assert!(
        err.contains("file://./ck/model.safetensors") && err.contains("truncated"),
        "{err}"
    );
    assert!(!dir.path().join("out/model.safetensors").exists());
    let cached = std::fs::read_dir(dir.path().join("cache")).map_or(0, |d| d.count());
    assert_eq!(cached, 0, "nothing corrupt is cached");

    let (code, _, err) = pull(&["file://./missing", "out"], dir.path(), &[]);
    assert_eq!(code, 1);
    assert!(err.contains("file://./missing"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s3_checkpoints_stream_through_a_real_s3_server() {
    let Some(moto) = Moto::start(&[]) else {
        return;
    };
    let http = reqwest::Client::new();
    let made = http
        .put(format!("{}/ckpts", moto.endpoint))
        .send()
        .await
        .expect("create bucket");
    assert!(made.status().is_success(), "{}", made.status());
    let store = Arc::new(
        AmazonS3Builder::new()
            .with_endpoint(&moto.endpoint)
            .with_allow_http(true)
            .with_bucket_name("ckpts")
            .with_region("us-east-1")
            .with_access_key_id("test")
            .with_secret_access_key("test-secret")
            .build()
            .expect("s3 client"),
    );
    let model = safetensors(5, 40_000);
    store
        .put(
            &"run-1/model.safetensors".into(),
            PutPayload::from(model.clone()),
        )
        .await
        .expect("upload");
    store
        .put(&"run-1/config.json".into(), PutPayload::from_static(b"{}"))
        .await
        .expect("upload");

    // The library: tensors over SigV4-signed range reads, 100 KiB parts.
    let src = Source::new(
        store.clone(),
        "run-1/model.safetensors".into(),
        "s3://ckpts/run-1/model.safetensors",
    );
    let size = src.head().await.expect("head").size;
    let header = src.header(size).await.expect("header");
    let cfg = StreamConfig {
        concurrency: 4,
        part_size: 100 * 1024,
        memory_limit: 1 << 30,
    };
    let tensors: Vec<_> = src
        .tensors(header, &cfg)
        .try_collect()
        .await
        .expect("tensors");
    assert_eq!(tensors.len(), 5);
    let data_start = model.len() - 5 * 40_000 * 4;
    assert_eq!(
        tensors[3].data.as_ref(),
        &model[data_start + 3 * 160_000..data_start + 4 * 160_000]
    );

    // The CLI, with credentials from the environment.
    let dir = tempfile::tempdir().expect("dir");
    let (code, out, err) = pull(&["s3://ckpts/run-1", "out"], dir.path(), &moto.env("test"));
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("pulled 2 files"), "{out}");
    assert_eq!(
        std::fs::read(dir.path().join("out/model.safetensors")).expect("read"),
        model
    );

    let (code, _, err) = pull(
        &["s3://ckpts/run-404", "out"],
        dir.path(),
        &moto.env("test"),
    );
    assert_eq!(code, 1);
    assert!(err.contains("s3://ckpts/run-404"), "{err}");
}

#[test]
fn refused_s3_credentials_are_named_as_such() {
    // With authentication enforced, moto refuses unknown access keys.
    let Some(moto) = Moto::start(&[("INITIAL_NO_AUTH_ACTION_COUNT", "0")]) else {
        return;
    };
    let dir = tempfile::tempdir().expect("dir");
    let (code, _, err) = pull(
        &["s3://ckpts/run-1", "out"],
        dir.path(),
        &moto.env("AKIAFAKEFAKEFAKE"),
    );
    assert_eq!(code, 1);
    assert!(
        err.contains("s3://ckpts/run-1: credentials refused"),
        "{err}"
    );
}
