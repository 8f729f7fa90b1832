//! The `warmgate` binary: parse the command line and hand over to the CLI.

use clap::Parser;

/// mimalloc: the proxy allocates small, short-lived buffers per request,
/// where it is measurably faster than the system allocator.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// `mi_option_purge_delay` in mimalloc's `mi_option_e` (v3 and v2 both);
/// `libmimalloc-sys` does not name it.
const MI_OPTION_PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;

/// Gives memory the gateway has freed back to the OS at once, unless the
/// operator chose otherwise with `MIMALLOC_PURGE_DELAY`.
///
/// By default mimalloc keeps freed pages for a second before returning
/// them. A gateway that takes 16 MiB bodies one after another on different
/// worker threads then holds each freed body for that second, and its
/// resident set climbs past 100 MB while it holds only one body; at once,
/// it stays near its idle size plus the bodies in flight (see
/// `docs/reliability.md`, "Memory per request").
#[allow(unsafe_code)]
fn return_freed_memory_promptly() {
    if std::env::var_os("MIMALLOC_PURGE_DELAY").is_some() {
        return;
    }
    // SAFETY: `mi_option_set` only stores an integer in mimalloc's option
    // table; it takes no pointers and any value of this option is valid.
    unsafe { libmimalloc_sys::mi_option_set(MI_OPTION_PURGE_DELAY, 0) };
}

/// Turns transparent huge pages off for the gateway, unless the operator
/// asked for them with `MIMALLOC_ALLOW_THP=1`.
///
/// With THP, the kernel backs a touched page of a large, sparsely used
/// mapping with a whole 2 MiB page. The gateway's memory is many buffers
/// per connection, most far smaller than that: an attacker's review
/// measured 1,000 connections each announcing a 16 MiB body at 2.2 GB
/// resident with THP and 88 MB without. A proxy gains nothing measurable
/// from huge pages, so they are off (`PR_SET_THP_DISABLE`, which the
/// kernel checks at each fault, so it covers the mappings mimalloc made
/// before `main`).
fn refuse_transparent_huge_pages() {
    if std::env::var("MIMALLOC_ALLOW_THP").is_ok_and(|v| v == "1") {
        return;
    }
    #[cfg(target_os = "linux")]
    if let Err(e) = nix::sys::prctl::set_thp_disable(true) {
        eprintln!("warmgate: could not turn transparent huge pages off: {e}");
    }
}

/// A client command whose reader went away (`warmgate status --watch |
/// head`) ends as Unix tools do, killed by `SIGPIPE`, rather than with a
/// panic on the failed write. Rust ignores `SIGPIPE` by default; the
/// servers keep ignoring it (a client that closes its connection must not
/// kill the gateway).
#[allow(unsafe_code)]
fn end_quietly_on_a_closed_pipe() {
    use nix::sys::signal::{SigHandler, Signal, signal};
    // SAFETY: restoring the default disposition installs no handler of
    // ours, and runs before any other thread exists.
    let _ = unsafe { signal(Signal::SIGPIPE, SigHandler::SigDfl) };
}

fn main() {
    return_freed_memory_promptly();
    refuse_transparent_huge_pages();
    let cli = match warmgate_gateway::cli::Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            // Help and version are answers (0); anything else is a usage
            // error: 64 (`EX_USAGE`), as the CLI reference says, not
            // clap's 2.
            let _ = e.print();
            std::process::exit(if e.use_stderr() {
                warmgate_gateway::cli::EXIT_USAGE
            } else {
                0
            });
        }
    };
    if cli.is_client() {
        end_quietly_on_a_closed_pipe();
    }
    std::process::exit(warmgate_gateway::cli::run(cli));
}
