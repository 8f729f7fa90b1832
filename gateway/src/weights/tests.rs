//! Unit tests of `weights`.

use super::*;
use object_store::memory::InMemory;
use object_store::{ObjectStoreExt, PutPayload};

fn weights(dir: &std::path::Path) -> Arc<Weights> {
    let cache = Cache::open(dir.join("cache"), u64::MAX).expect("cache");
    Arc::new(Weights::new(
        cache,
        StreamConfig::default(),
        AllowList::default(),
        dir.to_path_buf(),
    ))
}

/// Weights whose downloads keep a window of a few 64 KiB parts in
/// memory, with a cache of `cache_max` bytes.
fn small_window(dir: &std::path::Path, cache_max: u64) -> Arc<Weights> {
    let cfg = StreamConfig {
        concurrency: 4,
        part_size: 64 * 1024,
        memory_limit: 512 * 1024,
    };
    let cache = Cache::open(dir.join("cache"), cache_max).expect("cache");
    Arc::new(Weights::new(
        cache,
        cfg,
        AllowList::default(),
        dir.to_path_buf(),
    ))
}

/// A reader of `m/r1/model.bin` that waits `pause` after each chunk;
/// it ends with every byte it got.
fn spawn_reader(
    w: &Arc<Weights>,
    pause: Option<std::time::Duration>,
) -> tokio::task::JoinHandle<Vec<u8>> {
    let w = w.clone();
    tokio::spawn(async move {
        let (body, _) = w.file("m", "r1", "model.bin").await.expect("file");
        let mut stream = body.into_data_stream();
        let mut got = Vec::new();
        while let Some(chunk) = stream.next().await {
            got.extend_from_slice(&chunk.expect("chunk"));
            if let Some(p) = pause {
                tokio::time::sleep(p).await;
            }
        }
        got
    })
}

/// A checkpoint in a fresh in-memory store: its first object gets
/// ETag 0, as in every other fresh store.
async fn checkpoint(files: &[(&str, &[u8])], uri: &str) -> Source {
    let store = Arc::new(InMemory::new());
    for (name, data) in files {
        store
            .put(
                &object_store::path::Path::from(format!("ck/{name}")),
                PutPayload::from(data.to_vec()),
            )
            .await
            .expect("put");
    }
    Source::new(store, object_store::path::Path::from("ck"), uri)
}

async fn read(w: &Arc<Weights>, target: &str, rev: &str, name: &str) -> Result<Vec<u8>, String> {
    let (body, _) = w.file(target, rev, name).await.map_err(|e| e.message)?;
    axum::body::to_bytes(body, usize::MAX)
        .await
        .map(|b| b.to_vec())
        .map_err(|e| e.to_string())
}

/// Registers `data` as `model.bin` of `m` at `r1`, with its digest in
/// `SHA256SUMS`.
async fn register_with_sums(w: &Arc<Weights>, data: &[u8]) {
    let sums = format!("{}  model.bin\n", sha(data));
    let src = checkpoint(
        &[("model.bin", data), ("SHA256SUMS", sums.as_bytes())],
        "memory://one/ck",
    )
    .await;
    w.register("m", "r1", src);
}

fn sha(data: &[u8]) -> String {
    Sha256::digest(data)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

#[tokio::test]
async fn two_checkpoints_with_the_same_etag_and_size_get_their_own_bytes() {
    let dir = tempfile::tempdir().expect("tempdir");
    let w = weights(dir.path());
    let a = checkpoint(&[("model.bin", b"aaaaaaaa")], "memory://one/ck").await;
    let b = checkpoint(&[("model.bin", b"bbbbbbbb")], "memory://two/ck").await;
    let file = object_store::path::Path::from("ck/model.bin");
    let ma = a.child(&file).head().await.expect("head");
    let mb = b.child(&file).head().await.expect("head");
    assert_eq!((ma.e_tag.clone(), ma.size), (mb.e_tag.clone(), mb.size));
    w.register("m", "r1", a);
    w.register("m", "r2", b);
    assert_eq!(read(&w, "m", "r1", "model.bin").await.unwrap(), b"aaaaaaaa");
    assert_eq!(read(&w, "m", "r2", "model.bin").await.unwrap(), b"bbbbbbbb");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readers_fast_slow_and_late_of_one_cold_download_all_get_every_byte() {
    let dir = tempfile::tempdir().expect("tempdir");
    // A window of a few parts, so the slow and the late readers fall
    // behind it and read the cache file or the store instead.
    let w = small_window(dir.path(), u64::MAX);
    let data: Vec<u8> = (0..(6u32 << 20))
        .map(|i| (i * 7 + i / 4099) as u8)
        .collect();
    register_with_sums(&w, &data).await;
    let reader = |pause| spawn_reader(&w, pause);
    let fast = [reader(None), reader(None)];
    let slow = reader(Some(std::time::Duration::from_millis(20)));
    // One that comes when the first ones are well into the object.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let arrived = || {
        w.downloads
            .lock()
            .values()
            .next()
            .map_or(u64::MAX, |f| f.read(State::received))
    };
    while arrived() < 2 << 20 {
        assert!(
            std::time::Instant::now() < deadline,
            "the download never got going"
        );
        tokio::task::yield_now().await;
    }
    let late = reader(None);
    for h in fast.into_iter().chain([slow, late]) {
        let got = h.await.expect("reader");
        assert_eq!(got.len(), data.len());
        assert!(got == data, "a reader got other bytes");
    }
    // The cache holds it whole in the end, and a cache hit reads it.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while !w.downloads.lock().is_empty() {
        assert!(std::time::Instant::now() < deadline, "never committed");
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    let listing = w.files("m", "r1").await.expect("listed");
    let item = listing
        .items
        .iter()
        .find(|i| i.relative.to_str() == Some("model.bin"))
        .expect("listed");
    assert!(w.local_path(item).is_some(), "not cached");
    assert!(read(&w, "m", "r1", "model.bin").await.unwrap() == data);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_cache_file_the_readers_are_served_from_memory() {
    let dir = tempfile::tempdir().expect("tempdir");
    let w = weights(dir.path());
    // The cache's folder is gone: no file can be created in it.
    std::fs::remove_dir_all(dir.path().join("cache")).expect("rm");
    let data: Vec<u8> = (0..(3u32 << 20)).map(|i| (i / 3) as u8).collect();
    register_with_sums(&w, &data).await;
    let readers: Vec<_> = (0..3)
        .map(|_| {
            let w = w.clone();
            tokio::spawn(async move { read(&w, "m", "r1", "model.bin").await })
        })
        .collect();
    for r in readers {
        assert!(r.await.expect("reader").expect("served") == data);
    }
    // Nothing is cached, and a later read downloads again.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while !w.downloads.lock().is_empty() {
        assert!(std::time::Instant::now() < deadline, "never retired");
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    assert!(read(&w, "m", "r1", "model.bin").await.expect("again") == data);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_file_larger_than_the_whole_cache_is_served_and_never_cached() {
    let dir = tempfile::tempdir().expect("tempdir");
    // A window of a few parts, which a slow reader falls behind.
    let w = small_window(dir.path(), 1 << 20);
    let data: Vec<u8> = (0..(3u32 << 20)).map(|i| (i / 5) as u8).collect();
    register_with_sums(&w, &data).await;
    let reader = |pause| spawn_reader(&w, pause);
    let fast = reader(None);
    let slow = reader(Some(std::time::Duration::from_millis(5)));
    for h in [fast, slow] {
        assert!(h.await.expect("reader") == data, "a reader got other bytes");
    }
    assert!(w.downloads.lock().is_empty(), "no shared download");
    let on_disk: u64 = std::fs::read_dir(dir.path().join("cache"))
        .expect("cache folder")
        .flatten()
        .filter_map(|e| e.metadata().ok())
        .map(|m| m.len())
        .sum();
    assert_eq!(on_disk, 0, "nothing of it is written to the cache");
    assert!(read(&w, "m", "r1", "model.bin").await.expect("again") == data);
}

#[tokio::test]
async fn a_file_is_offered_locally_once_the_cache_holds_it_whole() {
    let dir = tempfile::tempdir().expect("tempdir");
    let w = weights(dir.path());
    let data = vec![3u8; 3 * CHUNK / 2];
    let src = checkpoint(&[("model.bin", &data)], "memory://one/ck").await;
    w.register("m", "r1", src);
    let item = || async { w.files("m", "r1").await.expect("listed").items[0].clone() };
    // Not on this machine (an object store), not cached: HTTP only.
    assert_eq!(w.local_path(&item().await), None);
    assert_eq!(read(&w, "m", "r1", "model.bin").await.unwrap(), data);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let path = loop {
        if let Some(p) = w.local_path(&item().await) {
            break p;
        }
        assert!(std::time::Instant::now() < deadline, "never offered");
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    };
    assert!(
        path.starts_with(dir.path().join("cache")),
        "{}",
        path.display()
    );
    assert_eq!(std::fs::read(&path).expect("read"), data);
}

#[tokio::test]
async fn a_cache_hit_whose_bytes_do_not_match_sha256sums_ends_in_an_error() {
    let dir = tempfile::tempdir().expect("tempdir");
    let w = weights(dir.path());
    let data = vec![7u8; 3 * CHUNK / 2];
    register_with_sums(&w, &data).await;
    assert_eq!(read(&w, "m", "r1", "model.bin").await.unwrap(), data);
    // The entry is corrupted on disk, keeping its size.
    // The reader may finish before the download commits its entry.
    let cache = dir.path().join("cache");
    let committed = || {
        std::fs::read_dir(&cache)
            .expect("cache dir")
            .flatten()
            .map(|e| e.path())
            .find(|p| {
                !p.to_string_lossy().ends_with(".tmp")
                    && std::fs::metadata(p).is_ok_and(|m| m.len() == data.len() as u64)
            })
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let entry = loop {
        if let Some(p) = committed()
            && w.downloads.lock().is_empty()
        {
            break p;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the entry was never committed"
        );
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    };
    std::fs::write(&entry, vec![8u8; data.len()]).expect("corrupt");
    let err = read(&w, "m", "r1", "model.bin").await.unwrap_err();
    assert!(!err.is_empty());
    // The bad entry is gone: the next read downloads the good bytes.
    assert_eq!(read(&w, "m", "r1", "model.bin").await.unwrap(), data);
}

#[tokio::test]
async fn a_follower_never_sees_the_end_of_bytes_whose_digest_is_wrong() {
    let dir = tempfile::tempdir().expect("tempdir");
    let tmp = dir.path().join("partial");
    let bad = vec![1u8; CHUNK + 10];
    std::fs::write(&tmp, &bad).expect("write");
    // Every byte is written; the writer has not committed yet.
    let fanout = Fanout::new(bad.len() as u64, 1 << 20, Some(tmp));
    fanout.update(|s| s.written(bad.len() as u64));
    let origin = Origin {
        reader: fanout.reader(0, true),
        entry: dir.path().join("entry"),
        hit: false,
    };
    let mut stream = std::pin::pin!(follow_stream(origin, bad.len() as u64, Some(sha(b"good"))));
    let mut got = 0usize;
    let mut failed = false;
    while let Some(chunk) = stream.next().await {
        match chunk {
            Ok(c) => got += c.len(),
            Err(_) => {
                failed = true;
                break;
            }
        }
    }
    assert!(failed, "the body ended cleanly after {got} bytes");
    assert!(got < bad.len());
}

#[test]
fn a_weights_token_reads_only_its_own_grant_until_revoked() {
    let dir = tempfile::tempdir().expect("tempdir");
    let w = weights(dir.path());
    let rev = |r: &str| Grant::Revision {
        target: "m".into(),
        revision: r.into(),
    };
    let t1 = w.issue("m-00001-1", rev("r1")).expect("token");
    let t2 = w.issue("m-00001-2", rev("r1")).expect("token");
    let pool = w
        .issue("p-1", Grant::Pool { target: "p".into() })
        .expect("token");
    assert_eq!(t1.len(), 64);
    assert_ne!(t1, t2, "each replica has its own token");
    assert!(w.authorized("m", "r1", &t1) && w.authorized("m", "r1", &t2));
    assert!(!w.authorized("m", "r2", &t1));
    assert!(!w.authorized("p", "v1", &t1));
    assert!(w.authorized("p", "v1", &pool) && w.authorized("p", "v7", &pool));
    assert!(!w.authorized("m", "r1", ""));
    assert!(!w.authorized("m", "r1", &t1[..63]));
    // Swapped in place, a replica's token reads the new revision only.
    assert!(w.regrant("m-00001-2", rev("r2")));
    assert!(w.authorized("m", "r2", &t2) && !w.authorized("m", "r1", &t2));
    assert!(w.regrant("m-00001-2", rev("r1")), "and back on a rollback");
    assert!(
        !w.regrant("m-00009-9", rev("r2")),
        "no token, nothing to regrant"
    );
    // A replica taken over after a failover keeps the token it holds.
    let old = "ab".repeat(32);
    assert!(w.adopt_token("m-00001-7", rev("r1"), &old));
    assert!(w.authorized("m", "r1", &old));
    assert!(
        !w.adopt_token("m-00001-8", rev("r1"), "short"),
        "not a token of ours"
    );
    // A replica that ended loses its token; the others keep theirs.
    w.revoke_replica("m-00001-1");
    assert!(!w.authorized("m", "r1", &t1));
    assert!(w.authorized("m", "r1", &t2));
    // A retired revision loses them all.
    w.unregister("m", "r1");
    assert!(!w.authorized("m", "r1", &t2));
    assert_eq!(w.tokens(), 1, "only the pool replica's token is left");
}

/// A reader whose cache lookup missed just before another reader's
/// download committed its file (and left the downloads) reads that file:
/// it does not fetch the object from the store a second time.
#[tokio::test]
async fn a_reader_that_missed_the_cache_as_a_download_ended_reads_its_file() {
    let dir = tempfile::tempdir().expect("tempdir");
    let w = weights(dir.path());
    let data = vec![5u8; 3 * CHUNK / 2];
    let src = checkpoint(&[("model.bin", &data)], "memory://one/ck").await;
    w.register("m", "r1", src);
    assert_eq!(read(&w, "m", "r1", "model.bin").await.unwrap(), data);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while !w.downloads.lock().is_empty() {
        assert!(std::time::Instant::now() < deadline, "never retired");
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    // What `file` does past a cache lookup that missed.
    let item = w.files("m", "r1").await.expect("listed").items[0].clone();
    let key = Cache::key(item.source.uri(), &item.meta);
    let (_reader, hit) = w.download(key, item, None).await.expect("download");
    assert!(hit, "a second download of a committed file");
    assert!(
        w.downloads.lock().is_empty(),
        "no download started for a file the cache holds"
    );
}
