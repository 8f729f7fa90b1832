//! The SQLite store: histories kept across reopens, batches, privacy, the
//! API's changes.

use std::time::Duration;

use super::*;
use crate::revision::{Event, Plan, Promotion, RevisionState, revision_id};

fn rev(seq: u32, traffic: u8) -> Revision {
    Revision {
        id: revision_id("m", seq),
        app: "m".into(),
        seq,
        checkpoint: Some(format!("s3://b/ckpt/{seq}")),
        checkpoint_version: Some(format!("\"etag-{seq}\"")),
        spec: r#"{"name":"m"}"#.into(),
        created_unix: 1.0,
        state: if traffic > 0 {
            RevisionState::Serving
        } else {
            RevisionState::Pending
        },
        traffic,
        served: traffic > 0,
    }
}

#[test]
fn history_survives_a_reopen_step_by_step() {
    let dir = tempfile::tempdir().expect("dir");
    let path = dir.path().join("state.db");
    let mut h = History {
        revisions: vec![rev(1, 100), rev(2, 0)],
        promotion: None,
        config: Some("{}".into()),
    };
    {
        let mut s = Store::open(&path).expect("open");
        assert_eq!(s.load("m").expect("load"), History::default());
        s.save("m", &h, "created m-00002").expect("save");
        let (p, fx) = Promotion::begin(
            "m",
            Some("m-00001"),
            "m-00002",
            Plan {
                canary: Some(20),
                bake: Duration::from_secs(30),
                at_zero: false,
                in_place: false,
                canary_asked: None,
            },
        );
        h.apply(&p, &fx);
        s.save("m", &h, "promote m-00002").expect("save");
        let (p, fx) = p.on(Event::Ready).expect("ready");
        h.apply(&p, &fx);
        s.save("m", &h, "canary 20%").expect("save");
        // Dropped without any shutdown: what a kill leaves.
    }
    let s = Store::open(&path).expect("reopen");
    let back = s.load("m").expect("load");
    assert_eq!(back, h);
    assert!(back.promoting());
    let notes: Vec<String> = s
        .notes("m", 10)
        .expect("notes")
        .into_iter()
        .map(|n| n.what)
        .collect();
    assert_eq!(notes, ["created m-00002", "promote m-00002", "canary 20%"]);
    assert_eq!(s.notes("m", 1).expect("notes").len(), 1);
    assert_eq!(s.load("other").expect("load"), History::default());
}

#[test]
fn every_history_read_at_once_is_what_each_read_alone_gives() {
    let dir = tempfile::tempdir().expect("dir");
    let path = dir.path().join("state.db");
    let mut s = Store::open(&path).expect("open");
    let mut promoted = History {
        revisions: vec![rev(1, 100), rev(2, 0)],
        promotion: None,
        config: Some("{\"a\":1}".into()),
    };
    let (p, fx) = Promotion::switch(
        "m",
        Some("m-00001"),
        "m-00002",
        Plan {
            canary: None,
            bake: Duration::ZERO,
            at_zero: true,
            in_place: false,
            canary_asked: None,
        },
    );
    promoted.apply(&p, &fx);
    let mut only = rev(1, 100);
    only.id = "n-00001".into();
    let plain = History {
        revisions: vec![only],
        promotion: None,
        config: None,
    };
    s.save("m", &promoted, "created").expect("save");
    s.save("n", &plain, "created").expect("save");
    let all = s.load_all().expect("load all");
    assert_eq!(all.len(), 2);
    assert_eq!(all["m"], s.load("m").expect("load"));
    assert_eq!(all["m"], promoted);
    assert_eq!(all["n"], plain);
    assert!(!all.contains_key("other"));
    // A corrupt row fails the whole read, as it fails the app's own.
    s.conn
        .execute(
            "INSERT INTO revisions (id, app, seq, body) VALUES ('o-00001', 'o', 1, 'nope')",
            [],
        )
        .expect("insert");
    assert!(s.load_all().is_err());
}

#[test]
fn a_batch_keeps_all_its_saves_or_none() {
    let dir = tempfile::tempdir().expect("dir");
    let state = SqliteState::open(&dir.path().join("state.db")).expect("open");
    let h = History {
        revisions: vec![rev(1, 100)],
        promotion: None,
        config: Some("{}".into()),
    };
    state
        .batch(&mut || {
            state.save("m", &h, "created m-00001")?;
            Ok(())
        })
        .expect("batch");
    assert_eq!(state.load("m").expect("load"), h);
    // A batch that fails keeps nothing it queued.
    let mut later = h.clone();
    later.revisions.push(rev(2, 0));
    let err = state
        .batch(&mut || {
            state.save("m", &later, "created m-00002")?;
            anyhow::bail!("the start stopped")
        })
        .expect_err("fails");
    assert!(err.to_string().contains("the start stopped"), "{err}");
    assert_eq!(state.load("m").expect("load"), h);
    // A save that cannot be written fails the batch with its own error.
    state
        .store()
        .conn
        .execute_batch("DROP TABLE notes")
        .expect("drop");
    let err = state
        .batch(&mut || {
            for _ in 0..1000 {
                state.save("m", &later, "created m-00002")?;
            }
            Ok(())
        })
        .expect_err("fails");
    assert!(format!("{err:#}").contains("notes"), "{err:#}");
    assert!(err.to_string().contains("save app 'm'"), "{err}");
    assert_eq!(state.load("m").expect("load"), h);
    // A panic in the batch ends its writer and rolls back; the store
    // works on.
    let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let _ = state.batch(&mut || {
            state.save("m", &later, "created m-00002")?;
            panic!("a bug while the apps are prepared")
        });
    }));
    assert!(panicked.is_err());
    assert_eq!(state.load("m").expect("load"), h);
    state
        .store()
        .conn
        .execute_batch("CREATE TABLE notes (id INTEGER PRIMARY KEY AUTOINCREMENT, app TEXT NOT NULL, at REAL NOT NULL, what TEXT NOT NULL)")
        .expect("notes again");
    state
        .batch(&mut || {
            state.save("m", &later, "created m-00002")?;
            Ok(())
        })
        .expect("a batch after the panic");
    assert_eq!(state.load("m").expect("load"), later);
    // Outside a batch, a save is written at once.
    state.save("m", &later, "").expect("save");
    assert_eq!(state.load("m").expect("load"), later);
}

#[test]
fn the_database_and_its_wal_files_are_private() {
    use std::os::unix::fs::PermissionsExt as _;
    let dir = tempfile::tempdir().expect("dir");
    let path = dir.path().join("state.db");
    // A file an older version left world-readable is narrowed too.
    std::fs::write(&path, b"").expect("create");
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).expect("chmod");
    let mut s = Store::open(&path).expect("open");
    s.save("m", &History::default(), "a note").expect("save");
    for name in ["state.db", "state.db-wal", "state.db-shm"] {
        let mode = std::fs::metadata(dir.path().join(name))
            .unwrap_or_else(|e| panic!("{name}: {e}"))
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600, "{name} has mode {:o}", mode & 0o777);
    }
}

#[test]
fn a_corrupt_row_is_an_error_not_a_panic() {
    let dir = tempfile::tempdir().expect("dir");
    let path = dir.path().join("state.db");
    let s = Store::open(&path).expect("open");
    s.conn
        .execute(
            "INSERT INTO revisions (id, app, seq, body) VALUES ('m-00001', 'm', 1, 'nope')",
            [],
        )
        .expect("insert");
    let err = s.load("m").expect_err("corrupt");
    assert!(err.to_string().contains("revision"), "{err}");
}

#[test]
fn changes_made_through_the_api_are_kept_and_laid_over_the_file() {
    let text = r#"
        [[apps]]
        name = "a"
        command = ["w"]
        [[apps]]
        name = "b"
        command = ["w"]
        [[pools]]
        name = "p"
        command = ["w"]
    "#;
    let file = Config::parse(text, Path::new("t.toml"), Path::new("/")).expect("config");
    let dir = tempfile::tempdir().expect("dir");
    let path = dir.path().join("state.db");
    let mut b = file.apps[1].clone();
    b.autoscale.max = 7;
    let mut c = file.apps[0].clone();
    c.name = "c".into();
    {
        let mut store = Store::open(&path).expect("open");
        assert!(store.overlay().expect("overlay").is_empty());
        let json = |s: &AppSpec| serde_json::to_string(s).expect("json");
        store
            .record_spec(SpecKind::App, "b", Some(&json(&b)), "put b")
            .expect("b");
        store
            .record_spec(SpecKind::App, "c", Some(&json(&c)), "put c")
            .expect("c");
        store
            .record_spec(SpecKind::App, "a", None, "delete a")
            .expect("a");
        store
            .record_spec(SpecKind::Pool, "p", None, "delete p")
            .expect("p");
    }
    // Reopened, as after a restart.
    let store = Store::open(&path).expect("reopen");
    let overlay = store.overlay().expect("overlay");
    let mut config = file.clone();
    overlay.apply_to(&mut config);
    let names: Vec<&str> = config.apps.iter().map(|a| a.name.as_str()).collect();
    assert_eq!(names, ["b", "c"]);
    assert_eq!(config.apps[0].autoscale.max, 7);
    assert!(config.pools.is_empty());
    let mut store = store;
    store.forget_spec(SpecKind::App, "c").expect("forget c");
    assert!(!store.overlay().expect("overlay").apps.contains_key("c"));
    store.clear_overlay().expect("clear");
    assert!(store.overlay().expect("overlay").is_empty());
}
