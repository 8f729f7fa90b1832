//! The config's tests: parsing, defaults and every check's key.

#[test]
fn aliases_are_model_names_and_nothing_else() {
    for good in [
        "gpt-4o",
        "meta-llama/Llama-3.1-8B-Instruct",
        "org/model-x",
        "m:v2",
        "a@b",
        "x_y.z",
    ] {
        super::check_model_name(good).unwrap_or_else(|e| panic!("{good}: {e}"));
    }
    let long = "a".repeat(super::names::MAX_MODEL_NAME_LEN + 1);
    for bad in [
        "",
        "a\0b",
        "a\u{1b}[31m",
        "a\u{200b}b",
        "gpt\u{0430}",
        "../../etc/passwd",
        "a/../b",
        "a//b",
        "-a",
        "a b",
        long.as_str(),
    ] {
        assert!(super::check_model_name(bad).is_err(), "{bad:?}");
    }
}

use super::*;
use std::time::Duration;

fn parse(text: &str) -> Result<Config> {
    Config::parse(text, Path::new("test.toml"), Path::new("/base"))
}

#[test]
fn object_store_adapters_are_pulled_by_the_gateway_so_not_on_kubernetes() {
    let app = |backend: &str, uri: &str| {
        parse(&format!(
            "{backend}[[apps]]\nname = \"m\"\ncommand = [\"./w\"]\nimage = \"w:1\"\n\
             [[apps.adapters.models]]\nname = \"sql\"\ncheckpoint = \"{uri}\"\n"
        ))
    };
    assert!(app("", "s3://b/sql").is_ok());
    assert!(app("[backend]\nkind = \"kubernetes\"\n", "file:///mnt/sql").is_ok());
    let err = app("[backend]\nkind = \"kubernetes\"\n", "s3://b/sql")
        .expect_err("refused")
        .to_string();
    assert!(
        err.contains("apps[0].adapters.models[0].checkpoint"),
        "{err}"
    );
    assert!(err.contains("volume"), "{err}");
}

#[test]
fn a_pool_of_vllm_engines_syncs_from_local_folders_so_not_on_kubernetes() {
    let pool = |backend: &str| {
        parse(&format!(
            "{backend}[[pools]]\nname = \"p\"\ncommand = [\"./w\"]\nimage = \"w:1\"\n\
             weight_sync = \"vllm\"\n"
        ))
    };
    let c = pool("").expect("local: valid");
    assert_eq!(c.pools[0].weight_sync, crate::WeightSync::Vllm);
    let err = pool("[backend]\nkind = \"kubernetes\"\n")
        .expect_err("refused")
        .to_string();
    assert!(err.contains("pools[0].weight_sync"), "{err}");
    assert!(err.contains("local backend only"), "{err}");
}

#[test]
fn the_checkpoint_watcher_cannot_be_a_busy_loop() {
    let with = |interval: &str| {
        parse(&format!(
            "[[apps]]\nname = \"m\"\ncommand = [\"./w\"]\n[apps.promotion]\nwatch = \"file:///ckpt\"\nwatch_interval = \"{interval}\"\n"
        ))
    };
    let err = with("1ns").expect_err("a busy loop");
    assert!(
        err.to_string().contains("promotion.watch_interval"),
        "{err}"
    );
    with("100ms").expect("ten looks a second");
}

#[test]
fn a_pool_cannot_take_the_name_of_an_app_revision_or_an_on_demand_fallback() {
    let err = parse(
        r#"
        [[apps]]
        name = "minilm"
        command = ["./w"]
        [[pools]]
        name = "minilm-00001"
        command = ["./p"]
        "#,
    )
    .expect_err("a pool named like the app's first revision");
    let text = err.to_string();
    assert!(text.contains("pools[0].name"), "{text}");
    assert!(text.contains("revision of app"), "{text}");
    // Not a revision id: fewer than five digits, or not digits.
    for ok in ["minilm-0001", "minilm-x0001", "minilm2-00001"] {
        parse(&format!(
            "[[apps]]\nname = \"minilm\"\ncommand = [\"./w\"]\n[[pools]]\nname = \"{ok}\"\ncommand = [\"./p\"]\n"
        ))
        .unwrap_or_else(|e| panic!("{ok}: {e}"));
    }
    let err = parse(
        r#"
        [[apps]]
        name = "spot-ondemand"
        command = ["./w"]
        [[pools]]
        name = "spot"
        command = ["./p"]
        [pools.kubernetes]
        interruptible = true
        "#,
    )
    .expect_err("an app named like the pool's on-demand fallback");
    assert!(err.to_string().contains("on-demand"), "{err}");
}

#[test]
fn an_app_served_by_a_pool_names_one_and_sets_nothing_of_its_own() {
    let pool = "[[pools]]\nname = \"policy\"\ncommand = [\"./p\"]\ninference_share = 0.25\n";
    let c = parse(&format!(
        "{pool}[[apps]]\nname = \"chat\"\npool = \"policy\"\naliases = [\"tiny\"]\n[apps.queue]\ntimeout = \"5s\"\n"
    ))
    .expect("an app on a pool needs no command");
    assert_eq!(c.apps[0].pool.as_deref(), Some("policy"));
    assert_eq!(c.pools[0].inference_share, 0.25);
    let refused = |app: &str, key: &str| {
        let err = parse(&format!("{pool}[[apps]]\nname = \"chat\"\n{app}"))
            .expect_err(app)
            .to_string();
        assert!(err.contains(key), "{app}: {err}");
    };
    refused("pool = \"nope\"\n", "apps[0].pool");
    refused(
        "pool = \"policy\"\ncommand = [\"./w\"]\n",
        "apps[0].command",
    );
    refused(
        "pool = \"policy\"\ncheckpoint = \"file:///c\"\n",
        "apps[0].checkpoint",
    );
    refused(
        "pool = \"policy\"\n[apps.autoscale]\nmax = 3\n",
        "apps[0].autoscale",
    );
    refused(
        "pool = \"policy\"\nconcurrency = 9\n",
        "apps[0].concurrency",
    );
    let err = parse(&format!(
        "{pool}[[apps]]\nname = \"a\"\npool = \"policy\"\n[[apps]]\nname = \"b\"\npool = \"policy\"\n"
    ))
    .expect_err("two apps on one pool");
    assert!(err.to_string().contains("apps[1].pool"), "{err}");
    for share in ["1.5", "-0.1", "nan"] {
        let err = parse(&format!(
            "[[pools]]\nname = \"p\"\ncommand = [\"./p\"]\ninference_share = {share}\n"
        ))
        .expect_err(share);
        assert!(
            err.to_string().contains("inference_share"),
            "{share}: {err}"
        );
    }
}

#[test]
fn sizes_take_units_as_people_write_them() {
    for (text, bytes) in [
        ("64MiB", 64 << 20),
        ("64 MiB", 64 << 20),
        ("16Gi", 16u64 << 30),
        ("16Ki", 16 << 10),
        ("1.5GiB", 3 << 29),
        ("500MB", 500_000_000),
        ("1048576", 1 << 20),
    ] {
        assert_eq!(size::parse(text), Ok(bytes), "{text}");
    }
    for bad in ["", "lots", "12 parsecs", "-1MiB"] {
        assert!(size::parse(bad).is_err(), "{bad}");
    }
    let c = parse("[limits]\nmax_body_bytes = \"16MiB\"\n[weights]\ncache_max_bytes = \"20Gi\"\npart_size_bytes = 8388608\n")
        .expect("sizes with units");
    assert_eq!(c.limits.max_body_bytes, 16 << 20);
    assert_eq!(c.weights.cache_max_bytes, 20u64 << 30);
    assert_eq!(c.weights.part_size_bytes, 8 << 20);
    let err = parse("[limits]\nmax_body_bytes = \"huge\"\n").expect_err("not a size");
    let text = err.to_string();
    assert!(
        text.contains("limits.max_body_bytes") || text.contains("max_body_bytes"),
        "{text}"
    );
    assert!(text.contains("not a size"), "{text}");
}

#[test]
fn interface_example_parses_with_defaults() {
    let c = parse(
        r#"
        listen = "127.0.0.1:9000"
        [backend]
        gpus = [0, 1]
        [[apps]]
        name = "minilm"
        command = ["./bin/embedder", "--flag"]
        gpus = 1
        [apps.autoscale]
        max = 2
        scale_to_zero_after = "90s"
        "#,
    )
    .expect("valid config");
    let app = &c.apps[0];
    assert_eq!(app.command[0], "/base/./bin/embedder");
    assert_eq!(app.command[1], "--flag");
    assert_eq!(app.concurrency, defaults::CONCURRENCY);
    assert_eq!(
        app.autoscale.scale_to_zero_after,
        crate::ScaleToZeroAfter::After(Duration::from_secs(90))
    );
    assert_eq!(app.autoscale.max, 2);
    assert_eq!(app.queue.max_pending, defaults::MAX_PENDING);
    assert!((app.target() - 5.6).abs() < 1e-9);
    assert_eq!(c.state_dir, PathBuf::from("/base/.warmgate"));
}

#[test]
fn unknown_key_names_its_path() {
    let err = parse(
        r#"
        [[apps]]
        name = "a"
        command = ["x"]
        [apps.autoscale]
        mni = 1
        "#,
    )
    .unwrap_err();
    assert_eq!(err.key(), Some("apps[0].autoscale.mni"));
    assert!(err.to_string().contains("unknown field `mni`"), "{err}");
    assert!(err.to_string().starts_with("test.toml: "), "{err}");
}

#[test]
fn bad_duration_names_its_key() {
    let err = parse("[[apps]]\nname = \"a\"\ncommand = [\"x\"]\nstartup_timeout = \"soon\"\n")
        .unwrap_err();
    assert_eq!(err.key(), Some("apps[0].startup_timeout"));
}

#[test]
fn invalid_values_are_refused() {
    let cases = [
        ("[[apps]]\nname = \"A\"\ncommand = [\"x\"]", "apps[0].name"),
        ("[[apps]]\nname = \"a\"", "apps[0].command"),
        (
            "[[apps]]\nname = \"a\"\ncommand = [\"x\"]\nconcurrency = 0",
            "apps[0].concurrency",
        ),
        (
            "[[apps]]\nname = \"a\"\ncommand = [\"x\"]\ngpus = 1",
            "apps[0].gpus",
        ),
        (
            "[[apps]]\nname = \"a\"\ncommand = [\"x\"]\n[apps.autoscale]\nmin = 3\nmax = 2",
            "apps[0].autoscale.min",
        ),
        (
            "[[apps]]\nname = \"a\"\ncommand = [\"x\"]\n[[apps]]\nname = \"b\"\ncommand = [\"x\"]\naliases = [\"a\"]",
            "apps[1].aliases[0]",
        ),
        (
            "[backend]\nkind = \"kubernetes\"\n[[apps]]\nname = \"a\"",
            "apps[0].image",
        ),
        ("[backend]\ngpus = [0, 0]", "backend.gpus[1]"),
        (
            "[[apps]]\nname = \"a\"\ncommand = [\"x\", \"--port\", \"${PORT\"]",
            "apps[0].command[2]",
        ),
        (
            "[[apps]]\nname = \"a\"\ncommand = [\"x\"]\n[apps.health]\npath = \"health\"",
            "apps[0].health.path",
        ),
        (
            "[[apps]]\nname = \"a\"\ncommand = [\"x\"]\n[apps.health]\npath = \"/a b\"",
            "apps[0].health.path",
        ),
        (
            "[[apps]]\nname = \"a\"\ncommand = [\"x\"]\n[apps.health]\nready_statuses = []",
            "apps[0].health.ready_statuses",
        ),
        (
            "[[apps]]\nname = \"a\"\ncommand = [\"x\"]\n[apps.health]\nready_statuses = [200, 700]",
            "apps[0].health.ready_statuses",
        ),
        (
            "[[apps]]\nname = \"a\"\ncommand = [\"x\"]\n[apps.health]\nfailure_threshold = 0",
            "apps[0].health.failure_threshold",
        ),
        (
            "[[pools]]\nname = \"p\"\ncommand = [\"x\"]\n[pools.health]\ntimeout = \"0s\"",
            "pools[0].health.timeout",
        ),
        (
            "[[apps]]\nname = \"a\"\ncommand = [\"x\"]\n[apps.health]\npaht = \"/h\"",
            "apps[0].health.paht",
        ),
    ];
    for (text, key) in cases {
        let err = parse(text).unwrap_err();
        assert_eq!(err.key(), Some(key), "{text}: {err}");
    }
}

#[test]
fn pools_parse_and_share_the_name_space_with_apps() {
    let c = parse(
        "[[pools]]\nname = \"rollouts\"\ncommand = [\"./w\"]\nreplicas = [2, 10]\n[pools.queue]\nfairness = \"none\"\n",
    )
    .expect("valid");
    assert_eq!(c.pools[0].replicas, [2, 10]);
    assert_eq!(c.pools[0].queue.fairness, Fairness::None);
    assert_eq!(c.pools[0].command[0], "/base/./w");
    assert_eq!(c.pools[0].idle_ttl, defaults::IDLE_TTL);
    let err = parse(
        "[[apps]]\nname = \"x\"\ncommand = [\"w\"]\n[[pools]]\nname = \"x\"\ncommand = [\"w\"]\n",
    )
    .unwrap_err();
    assert_eq!(err.key(), Some("pools[0].name"));
    let err = parse("[[pools]]\nname = \"p\"\ncommand = [\"w\"]\nreplicas = [3, 1]\n").unwrap_err();
    assert_eq!(err.key(), Some("pools[0].replicas"));
}

#[test]
fn syntax_error_is_reported() {
    let err = parse("[[apps]\nname = ").unwrap_err();
    assert!(matches!(err, Error::Parse { .. }), "{err}");
}

#[test]
fn pass_env_names_variables_and_no_secret_of_the_gateway() {
    let c = parse("[backend]\npass_env = [\"HF_TOKEN\", \"AWS_PROFILE\"]").expect("valid");
    assert_eq!(c.backend.pass_env, ["HF_TOKEN", "AWS_PROFILE"]);
    let tenant = "[[tenants]]\nname = \"team\"\napi_key_env = \"TEAM_KEY\"\n";
    for (text, key) in [
        ("[backend]\npass_env = [\"A=B\"]", "backend.pass_env[0]"),
        ("[backend]\npass_env = [\"\"]", "backend.pass_env[0]"),
        ("[backend]\npass_env = [\"1X\"]", "backend.pass_env[0]"),
        (
            "[backend]\npass_env = [\"PATH\", \"WARMGATE_ADMIN_TOKEN\"]",
            "backend.pass_env[1]",
        ),
        (
            &format!("[backend]\npass_env = [\"TEAM_KEY\"]\n{tenant}"),
            "backend.pass_env[0]",
        ),
    ] {
        let err = parse(text).unwrap_err();
        assert_eq!(err.key(), Some(key), "{text}: {err}");
    }
}

#[test]
fn a_tenant_rate_must_have_a_period_the_limiter_can_keep() {
    let tenant = "[[tenants]]\nname = \"team\"\napi_key_env = \"TEAM_KEY\"\n";
    for rps in ["1e-20", "0.0001", "1e10", "0", "-1", "nan", "inf"] {
        let err = parse(&format!("{tenant}rps = {rps}\n")).unwrap_err();
        assert_eq!(err.key(), Some("tenants[0].rps"), "{rps}: {err}");
        assert!(err.to_string().contains("from 0.001"), "{err}");
    }
    for rps in ["0.001", "5.5", "1e9"] {
        parse(&format!("{tenant}rps = {rps}\n")).expect(rps);
    }
}

#[test]
fn a_service_account_must_be_allowed_by_the_backend_settings() {
    let app = "[[apps]]\nname = \"a\"\nimage = \"r/w:1\"\n[apps.kubernetes]\nservice_account = \"warmgate\"\n";
    let err = parse(&format!("[backend]\nkind = \"kubernetes\"\n{app}")).unwrap_err();
    assert_eq!(err.key(), Some("apps[0].kubernetes.service_account"));
    assert!(
        err.to_string().contains("allowed_service_accounts"),
        "{err}"
    );
    let allowed = "[backend]\nkind = \"kubernetes\"\n[backend.kubernetes]\nallowed_service_accounts = [\"warmgate\"]\n";
    let c = parse(&format!("{allowed}{app}")).expect("allowed");
    assert_eq!(
        c.apps[0].kubernetes.service_account.as_deref(),
        Some("warmgate")
    );
    let pool = "[[pools]]\nname = \"p\"\nimage = \"r/w:1\"\n[pools.kubernetes]\nservice_account = \"other\"\n";
    let err = parse(&format!("{allowed}{pool}")).unwrap_err();
    assert_eq!(err.key(), Some("pools[0].kubernetes.service_account"));
    let err =
        parse("[backend.kubernetes]\nallowed_service_accounts = [\"Not A Name\"]").unwrap_err();
    assert_eq!(
        err.key(),
        Some("backend.kubernetes.allowed_service_accounts[0]")
    );
}

#[test]
fn a_volume_must_be_allowed_have_one_source_and_its_own_path() {
    let backend =
        "[backend]\nkind = \"kubernetes\"\n[backend.kubernetes]\nallowed_claims = [\"hf-cache\"]\n";
    let app = |vol: &str| {
        format!(
            "{backend}[[apps]]\nname = \"a\"\nimage = \"r/w:1\"\n[apps.kubernetes.volumes]\n{vol}\n"
        )
    };
    let c = parse(&app(
        "models = { mount = \"/models\", claim = \"hf-cache\", read_only = true }\nscratch = { mount = \"/scratch\", empty_dir = \"20Gi\" }",
    ))
    .expect("allowed");
    assert_eq!(c.apps[0].kubernetes.volumes.len(), 2);
    for (vol, key, says) in [
        (
            "m = { mount = \"/m\", claim = \"other-team\" }",
            "apps[0].kubernetes.volumes.m.claim",
            "allowed_claims",
        ),
        (
            "m = { mount = \"/m\", config_map = \"cm\" }",
            "apps[0].kubernetes.volumes.m.config_map",
            "allowed_config_maps",
        ),
        (
            "m = { mount = \"/m\" }",
            "apps[0].kubernetes.volumes.m",
            "exactly one",
        ),
        (
            "m = { mount = \"/m\", claim = \"hf-cache\", empty_dir = \"1Gi\" }",
            "apps[0].kubernetes.volumes.m",
            "exactly one",
        ),
        (
            "m = { mount = \"models\", empty_dir = \"1Gi\" }",
            "apps[0].kubernetes.volumes.m.mount",
            "absolute",
        ),
        (
            "m = { mount = \"/a/../etc\", empty_dir = \"1Gi\" }",
            "apps[0].kubernetes.volumes.m.mount",
            "absolute",
        ),
        (
            "m = { mount = \"/dev/shm\", empty_dir = \"1Gi\" }",
            "apps[0].kubernetes.volumes.m.mount",
            "twice",
        ),
        (
            "a = { mount = \"/x\", empty_dir = \"1Gi\" }\nb = { mount = \"/x/\", empty_dir = \"1Gi\" }",
            "apps[0].kubernetes.volumes.b.mount",
            "twice",
        ),
        (
            "Bad_Name = { mount = \"/x\", empty_dir = \"1Gi\" }",
            "apps[0].kubernetes.volumes.Bad_Name",
            "DNS label",
        ),
        (
            "m = { mount = \"/m\", host_path = \"/\" }",
            "apps[0].kubernetes.volumes.m",
            "host_path",
        ),
    ] {
        let err = parse(&app(vol)).unwrap_err();
        assert!(
            err.key().is_some_and(|k| k.starts_with(key)),
            "{vol}: {err} (key {:?})",
            err.key()
        );
        assert!(err.to_string().contains(says), "{vol}: {err}");
    }
}

#[test]
fn node_affinity_needs_an_operator_kubernetes_knows_and_values_that_fit_it() {
    let app = |req: &str| {
        format!(
            "[backend]\nkind = \"kubernetes\"\n[[apps]]\nname = \"a\"\nimage = \"r/w:1\"\n[apps.kubernetes]\nnode_affinity = [{req}]\n"
        )
    };
    parse(&app(
        "{ key = \"zone\", operator = \"In\", values = [\"a\"] }",
    ))
    .expect("valid");
    parse(&app("{ key = \"gpu\", operator = \"Exists\" }")).expect("valid");
    for (req, key) in [
        (
            "{ key = \"zone\", operator = \"Near\", values = [\"a\"] }",
            "apps[0].kubernetes.node_affinity[0].operator",
        ),
        (
            "{ key = \"zone\", operator = \"In\" }",
            "apps[0].kubernetes.node_affinity[0]",
        ),
        (
            "{ key = \"gpu\", operator = \"Exists\", values = [\"x\"] }",
            "apps[0].kubernetes.node_affinity[0]",
        ),
        (
            "{ key = \"\", operator = \"Exists\" }",
            "apps[0].kubernetes.node_affinity[0]",
        ),
    ] {
        let err = parse(&app(req)).unwrap_err();
        assert_eq!(err.key(), Some(key), "{req}: {err}");
    }
}

#[test]
fn relative_paths_given_later_resolve_against_the_config_s_folder() {
    let text = "state_dir = \"/var/lib/warmgate/state\"\n";
    let c = Config::parse(text, Path::new("/etc/wg/w.toml"), Path::new("/etc/wg")).expect("valid");
    assert_eq!(c.workers_folder().as_deref(), Some(Path::new("/etc/wg")));
    let built = Config {
        state_dir: "/srv/wg/state".into(),
        ..Config::default()
    };
    assert_eq!(
        built.workers_folder().as_deref(),
        Some(Path::new("/srv/wg"))
    );
}
