//! Unit tests of `backend`.

use super::*;

fn launch(cmd: &[&str]) -> Launch {
    Launch {
        replica: "t-1".into(),
        target: "t".into(),
        revision: "t-00001".into(),
        command: cmd.iter().map(|s| s.to_string()).collect(),
        env: BTreeMap::from([("EXTRA".to_string(), "yes".to_string())]),
        gpus: vec![2, 3],
        workdir: None,
        checkpoint: None,
        image: None,
        pod: warmgate_deploy::PodSpec::default(),
        gpu_count: 2,
        pool: false,
        health: warmgate_deploy::HealthSpec::default(),
        listen: Default::default(),
        startup_timeout: std::time::Duration::from_secs(60),
    }
}

#[tokio::test]
async fn child_gets_the_contract_environment_and_a_log_file() {
    let dir = std::env::temp_dir().join(format!("wg-backend-{}", std::process::id()));
    let backend = LocalBackend::new(&dir);
    let mut p = backend
        .spawn(&launch(&[
            "sh",
            "-c",
            "echo port=$PORT replica=$WARMGATE_REPLICA target=$WARMGATE_TARGET \
             revision=$WARMGATE_REVISION gpus=$CUDA_VISIBLE_DEVICES extra=$EXTRA; \
             echo oops >&2; exit 3",
        ]))
        .await
        .expect("spawn");
    assert_eq!(p.wait().await, "exited with status 3");
    let log = std::fs::read_to_string(p.log()).expect("log written");
    let port = p.addr().tcp().expect("a port").port();
    assert!(
        log.contains(&format!(
            "port={port} replica=t-1 target=t revision=t-00001 gpus=2,3 extra=yes"
        )),
        "{log}"
    );
    assert!(log.contains("oops"), "stderr goes to the log too: {log}");
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test]
async fn the_child_inherits_only_the_base_and_listed_variables() {
    // Cargo sets CARGO_* in the environment of every test process: a
    // stand-in for the gateway's secrets, without `set_var`.
    assert!(std::env::var_os("CARGO_MANIFEST_DIR").is_some());
    let dir = tempfile::tempdir().expect("dir");
    let backend = LocalBackend::new(dir.path()).with_pass_env(["CARGO_PKG_NAME".to_string()]);
    let mut p = backend
        .spawn(&launch(&["sh", "-c", "env"]))
        .await
        .expect("spawn");
    assert_eq!(p.wait().await, "exited with status 0");
    let log = std::fs::read_to_string(p.log()).expect("log written");
    let names: Vec<&str> = log.lines().filter_map(|l| l.split('=').next()).collect();
    assert!(
        log.contains("CARGO_PKG_NAME=warmgate-pool"),
        "a pass_env variable is inherited: {log}"
    );
    assert!(
        !names.contains(&"CARGO_MANIFEST_DIR"),
        "an unlisted variable is not: {log}"
    );
    for name in [
        "PATH",
        "EXTRA",
        "PORT",
        "WARMGATE_REPLICA",
        "CUDA_VISIBLE_DEVICES",
    ] {
        assert!(names.contains(&name), "{name} is set: {log}");
    }
}

#[test]
fn inherited_variables_are_the_base_the_locale_and_the_listed() {
    let env = [
        "PATH",
        "HOME",
        "LC_ALL",
        "WARMGATE_ADMIN_TOKEN",
        "AWS_SECRET_ACCESS_KEY",
        "TEAM_KEY",
        "HF_TOKEN",
    ]
    .map(|n| (OsString::from(n), OsString::from("v")));
    let pass = ["HF_TOKEN".to_string()];
    let kept: Vec<String> = inherited(env, &pass)
        .map(|(n, _)| n.to_string_lossy().into_owned())
        .collect();
    assert_eq!(kept, ["PATH", "HOME", "LC_ALL", "HF_TOKEN"]);
}

/// Waits (bounded) until `pid` has exited.
fn gone(pid: i32, what: &str) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !exited(pid) {
        if std::time::Instant::now() > deadline {
            let _ = nix::sys::signal::kill(Pid::from_raw(pid), Signal::SIGKILL);
            panic!("{what} is still running");
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}

/// Spawns `script` (which must write `$!` of a background helper to
/// `$BG`), and returns the process and the helper's pid.
async fn spawn_with_helper(
    backend: &LocalBackend,
    dir: &Path,
    script: &str,
) -> (Box<dyn Process>, i32) {
    let bg = dir.join("bg.pid");
    let mut l = launch(&["sh", "-c", script]);
    l.env.insert("BG".into(), bg.display().to_string());
    let p = backend.spawn(&l).await.expect("spawn");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let pid = loop {
        if let Some(pid) = std::fs::read_to_string(&bg)
            .ok()
            .and_then(|s| s.trim().parse().ok())
        {
            break pid;
        }
        assert!(std::time::Instant::now() < deadline, "the helper started");
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    };
    (p, pid)
}

#[tokio::test]
async fn a_worker_that_exits_by_itself_leaves_no_helper_behind() {
    let dir = tempfile::tempdir().expect("dir");
    let backend = LocalBackend::new(dir.path());
    let (mut p, helper) = spawn_with_helper(
        &backend,
        dir.path(),
        "sleep 600 & echo $! > $BG.tmp; mv $BG.tmp $BG; exit 1",
    )
    .await;
    assert_eq!(p.wait().await, "exited with status 1");
    gone(helper, "the helper of a crashed worker");
}

#[tokio::test]
async fn a_worker_killed_from_outside_leaves_no_helper_behind() {
    let dir = tempfile::tempdir().expect("dir");
    let backend = LocalBackend::new(dir.path());
    let (mut p, helper) = spawn_with_helper(
        &backend,
        dir.path(),
        "sleep 600 & echo $! > $BG.tmp; mv $BG.tmp $BG; exec sleep 600",
    )
    .await;
    let leader = p.pid().expect("pid") as i32;
    // `kill -9` of the worker alone, not of its group.
    nix::sys::signal::kill(Pid::from_raw(leader), Signal::SIGKILL).expect("kill");
    assert_eq!(p.wait().await, "was killed by SIGKILL");
    gone(helper, "the helper of a killed worker");
}

#[tokio::test]
async fn a_dropped_worker_leaves_no_helper_behind() {
    let dir = tempfile::tempdir().expect("dir");
    let backend = LocalBackend::new(dir.path());
    let (p, helper) = spawn_with_helper(
        &backend,
        dir.path(),
        "sleep 600 & echo $! > $BG.tmp; mv $BG.tmp $BG; exec sleep 600",
    )
    .await;
    drop(p);
    gone(helper, "the helper of a dropped worker");
}

#[tokio::test]
async fn terminate_stops_the_whole_process_group() {
    let dir = std::env::temp_dir().join(format!("wg-backend-g-{}", std::process::id()));
    let backend = LocalBackend::new(&dir);
    let mut p = backend
        .spawn(&launch(&["sh", "-c", "sleep 600 & sleep 600; wait"]))
        .await
        .expect("spawn");
    p.terminate();
    let how = tokio::time::timeout(std::time::Duration::from_secs(10), p.wait())
        .await
        .expect("exits after SIGTERM");
    assert_eq!(how, "was killed by SIGTERM");
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test]
async fn orphans_of_a_crashed_run_are_found_and_stopped_with_their_children() {
    let dir = tempfile::tempdir().expect("dir");
    let run = dir.path().join("run");
    let child_pid = dir.path().join("bg.pid");
    let backend = LocalBackend::new(dir.path()).with_run_dir(&run);
    let script = format!("sleep 600 & echo $! > {}; wait", child_pid.display());
    let p = backend
        .spawn(&launch(&["sh", "-c", &script]))
        .await
        .expect("spawn");
    let leader = p.pid().expect("pid") as i32;
    assert!(run.join("t-1.pid").exists(), "the replica is recorded");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let bg: i32 = loop {
        if let Some(pid) = std::fs::read_to_string(&child_pid)
            .ok()
            .and_then(|s| s.trim().parse().ok())
        {
            break pid;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the worker's child started"
        );
        std::thread::sleep(std::time::Duration::from_millis(10));
    };
    // A crash: the gateway never stops or drops its process.
    std::mem::forget(p);

    let next_run = LocalBackend::new(dir.path()).with_run_dir(&run);
    let reaped = next_run.reap_orphans();
    assert_eq!(
        reaped,
        vec![Orphan {
            replica: "t-1".into(),
            pid: leader
        }]
    );
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !(exited(leader) && exited(bg)) {
        assert!(std::time::Instant::now() < deadline, "the group was killed");
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    assert!(!run.join("t-1.pid").exists(), "the record is gone");
    assert!(
        next_run.reap_orphans().is_empty(),
        "nothing is reaped twice"
    );
}

#[test]
fn a_record_whose_pid_is_now_another_process_is_left_alone() {
    let dir = tempfile::tempdir().expect("dir");
    let run = dir.path().join("run");
    std::fs::create_dir_all(&run).expect("mkdir");
    // This test process, with a start time that is not its own.
    let me = std::process::id();
    let real = start_time(me as i32).expect("own start time");
    std::fs::write(run.join("x-1.pid"), format!("{me} {}\n", real + 1)).expect("write");
    let reaped = LocalBackend::new(dir.path())
        .with_run_dir(&run)
        .reap_orphans();
    assert!(reaped.is_empty(), "a reused pid is not ours: {reaped:?}");
}

#[test]
fn a_planted_record_naming_an_unrelated_process_with_its_true_start_time_is_left_alone() {
    let dir = tempfile::tempdir().expect("dir");
    let run = dir.path().join("run");
    std::fs::create_dir_all(&run).expect("mkdir");
    // An unrelated process in a group of its own: what a planted record
    // would name, with the start time anyone can read in /proc.
    use std::os::unix::process::CommandExt as _;
    let mut victim = std::process::Command::new("sleep")
        .arg("30")
        .process_group(0)
        .spawn()
        .expect("sleep");
    let pid = victim.id() as i32;
    let started = start_time(pid).expect("start time");
    std::fs::write(run.join("x-1.pid"), format!("{pid} {started}\n")).expect("write");
    let reaped = LocalBackend::new(dir.path())
        .with_run_dir(&run)
        .reap_orphans();
    assert!(reaped.is_empty(), "not a replica: {reaped:?}");
    assert!(!exited(pid), "the unrelated process still runs");
    assert!(
        !is_replica_process(pid, "x-1", started, nix::unistd::geteuid().as_raw()),
        "no WARMGATE_REPLICA in its environment"
    );
    victim.kill().expect("kill");
    let _ = victim.wait();
}

#[tokio::test]
async fn a_missing_program_is_a_spawn_error() {
    let backend = LocalBackend::new(std::env::temp_dir().join("wg-backend-missing"));
    let err = backend
        .spawn(&launch(&["/nonexistent/worker"]))
        .await
        .err()
        .expect("spawn fails");
    assert!(
        err.to_string().contains("/nonexistent/worker"),
        "names the program: {err}"
    );
}
