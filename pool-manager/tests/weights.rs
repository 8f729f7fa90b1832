//! The weights streamer against real stores: the local file system and the
//! in-memory store (S3 is tested end to end against a real S3 server).

use std::sync::Arc;

use bytes::Bytes;
use futures_util::TryStreamExt;
use object_store::memory::InMemory;
use object_store::path::Path;
use object_store::{ObjectStoreExt, PutPayload};
use warmgate_pool::weights::{Cache, Source, StreamConfig};

/// A safetensors file whose tensor `i` is filled with byte `i + 1`.
fn checkpoint(shapes: &[&[usize]]) -> (Vec<u8>, Vec<(String, Vec<u8>)>) {
    let mut off = 0usize;
    let mut entries = Vec::new();
    let mut tensors = Vec::new();
    for (i, shape) in shapes.iter().enumerate() {
        let size = 4 * shape.iter().product::<usize>();
        let name = format!("layers.{i}.weight");
        entries.push(format!(
            "\"{name}\":{{\"dtype\":\"F32\",\"shape\":{shape:?},\"data_offsets\":[{off},{}]}}",
            off + size
        ));
        tensors.push((name, vec![i as u8 + 1; size]));
        off += size;
    }
    let json = format!(
        "{{\"__metadata__\":{{\"format\":\"pt\"}},{}}}",
        entries.join(",")
    );
    let mut out = (json.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(json.as_bytes());
    for (_, data) in &tensors {
        out.extend_from_slice(data);
    }
    (out, tensors)
}

async fn memory_source(bytes: Vec<u8>) -> Source {
    let store = Arc::new(InMemory::new());
    let path = Path::from("ckpt/model.safetensors");
    store
        .put(&path, PutPayload::from(bytes))
        .await
        .expect("put");
    Source::new(store, path, "memory:///ckpt/model.safetensors")
}

#[tokio::test]
async fn tensors_arrive_whole_and_in_order_across_odd_part_sizes() {
    let (file, expected) = checkpoint(&[&[3], &[5, 7], &[1], &[64, 3], &[2, 2]]);
    for part_size in [1u64, 7, 13, 64, 4096] {
        for concurrency in [1usize, 3, 16] {
            let src = memory_source(file.clone()).await;
            let size = src.head().await.expect("head").size;
            let header = src.header(size).await.expect("header");
            let cfg = StreamConfig {
                concurrency,
                part_size,
                memory_limit: 1 << 30,
            };
            let got: Vec<_> = src
                .tensors(header, &cfg)
                .try_collect()
                .await
                .expect("stream");
            assert_eq!(got.len(), expected.len());
            for (t, (name, data)) in got.iter().zip(&expected) {
                assert_eq!(&t.name, name);
                assert_eq!(
                    t.data.as_ref(),
                    data.as_slice(),
                    "{name} at part size {part_size}"
                );
            }
        }
    }
}

#[tokio::test]
async fn a_local_file_streams_like_any_store() {
    let dir = tempfile::tempdir().expect("dir");
    let (file, expected) = checkpoint(&[&[1024], &[16, 16]]);
    std::fs::create_dir_all(dir.path().join("ckpt")).expect("mkdir");
    std::fs::write(dir.path().join("ckpt/model.safetensors"), &file).expect("write");
    let prefix = Source::open("file://./ckpt", dir.path()).expect("open");
    let objects = prefix.list().await.expect("list");
    assert_eq!(objects.len(), 1);
    let src = prefix.child(&objects[0].location);
    assert!(
        src.uri().ends_with("ckpt/model.safetensors"),
        "{}",
        src.uri()
    );
    let header = src.header(objects[0].size).await.expect("header");
    let got: Vec<_> = src
        .tensors(header, &StreamConfig::default())
        .try_collect()
        .await
        .expect("stream");
    assert_eq!(got[1].shape, vec![16, 16]);
    assert_eq!(got[1].data.as_ref(), expected[1].1.as_slice());
}

#[tokio::test]
async fn bad_objects_fail_with_the_uri_and_the_reason() {
    let dir = tempfile::tempdir().expect("dir");
    let missing = Source::open("file://./nowhere/model.safetensors", dir.path()).expect("open");
    let err = missing.head().await.expect_err("missing");
    let msg = err.to_string();
    assert!(
        msg.contains("nowhere/model.safetensors") && msg.contains("not found"),
        "{msg}"
    );

    let (file, _) = checkpoint(&[&[100]]);
    let truncated = memory_source(file[..file.len() - 10].to_vec()).await;
    let size = truncated.head().await.expect("head").size;
    let msg = truncated
        .header(size)
        .await
        .expect_err("truncated")
        .to_string();
    assert!(
        msg.starts_with("memory:///ckpt/model.safetensors: "),
        "{msg}"
    );
    assert!(msg.contains("truncated"), "{msg}");

    let junk = memory_source(b"\xff\xff\xff\xff\xff\xff\xff\x7fjunk".to_vec()).await;
    let msg = junk.header(12).await.expect_err("junk").to_string();
    assert!(msg.contains("over the limit"), "{msg}");

    let empty = Source::new(Arc::new(InMemory::new()), Path::from("x"), "memory:///x");
    let msg = empty.list().await.expect_err("empty prefix").to_string();
    assert!(msg.contains("no objects"), "{msg}");
}

#[tokio::test]
async fn the_memory_limit_caps_parallel_reads() {
    let cfg = StreamConfig {
        concurrency: 32,
        part_size: 8 << 20,
        memory_limit: 64 << 20,
    };
    assert_eq!(cfg.effective_concurrency(), 8);
    let tiny = StreamConfig {
        memory_limit: 1,
        ..cfg
    };
    assert_eq!(tiny.effective_concurrency(), 1);
}

#[tokio::test]
async fn cache_entries_are_atomic_checked_and_evicted_lru() {
    let dir = tempfile::tempdir().expect("dir");
    let cache = Cache::open(dir.path(), 250).expect("cache");
    let src = memory_source(vec![7u8; 100]).await;
    let meta = src.head().await.expect("head");
    let key = Cache::key(src.uri(), &meta);
    assert_eq!(key.len(), 64);
    assert!(cache.lookup(&key, 100).is_none());

    // An abandoned write leaves nothing behind.
    let mut w = cache.writer(&key).await.expect("writer");
    w.write(&Bytes::from(vec![7u8; 40])).await.expect("write");
    drop(w);
    assert!(cache.lookup(&key, 100).is_none());
    assert_eq!(std::fs::read_dir(dir.path()).expect("ls").count(), 0);

    // A short write is refused at commit.
    let mut w = cache.writer(&key).await.expect("writer");
    w.write(&Bytes::from(vec![7u8; 40])).await.expect("write");
    assert!(w.commit(100, None).await.is_err());
    assert!(cache.lookup(&key, 100).is_none());

    let mut w = cache.writer(&key).await.expect("writer");
    w.write(&Bytes::from(vec![7u8; 100])).await.expect("write");
    let path = w.commit(100, None).await.expect("commit");
    assert_eq!(cache.lookup(&key, 100), Some(path.clone()));
    // A wrong-size entry is treated as absent and removed.
    assert!(cache.lookup(&key, 99).is_none());
    assert!(!path.exists());

    // LRU: three 100-byte entries in a 250-byte cache keep the two newest.
    for (i, k) in ["a", "b", "c"].iter().enumerate() {
        let mut w = cache.writer(k).await.expect("writer");
        w.write(&Bytes::from(vec![1u8; 100])).await.expect("write");
        let p = w.commit(100, None).await.expect("commit");
        // Distinct, ordered use times without waiting for the clock.
        let t = std::time::UNIX_EPOCH + std::time::Duration::from_secs(1_000 + i as u64);
        if let Ok(f) = std::fs::File::options().write(true).open(&p) {
            f.set_modified(t).expect("set mtime");
        }
    }
    assert!(cache.size() <= 250);
    assert!(
        cache.lookup("a", 100).is_none(),
        "the oldest entry was evicted"
    );
    assert!(cache.lookup("c", 100).is_some());

    // A crash leftover is cleaned when the cache opens.
    std::fs::write(dir.path().join("x.1.2.tmp"), b"partial").expect("write");
    let _ = Cache::open(dir.path(), 250).expect("reopen");
    assert!(!dir.path().join("x.1.2.tmp").exists());
}
