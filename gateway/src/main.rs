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

fn main() {
    return_freed_memory_promptly();
    let cli = warmgate_gateway::cli::Cli::parse();
    std::process::exit(warmgate_gateway::cli::run(cli));
}
