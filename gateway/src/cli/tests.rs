//! Tests of the command line: the exit code of each class of failed call,
//! and the gateway's process hardening.

#[test]
fn each_class_of_failure_has_its_exit_code() {
    let answered = |status| CallError::Answered {
        url: "u".into(),
        status,
        message: "m".into(),
    };
    let codes: Vec<i32> = [400, 401, 403, 404, 405, 409, 413, 429, 500, 502, 503, 504]
        .into_iter()
        .map(|s| answered(s).exit_code())
        .collect();
    assert_eq!(codes, [65, 77, 77, 66, 65, 75, 65, 75, 70, 70, 75, 75]);
    assert_eq!(CallError::Unreachable("x".into()).exit_code(), 69);
    assert_eq!(CallError::Protocol("x".into()).exit_code(), 76);
}

use super::*;

#[test]
fn the_gateway_is_not_dumpable() {
    keep_environment_private();
    assert!(
        !nix::sys::prctl::get_dumpable().expect("prctl"),
        "a worker of the same user could read /proc/<gateway>/environ"
    );
}
