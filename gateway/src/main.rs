//! The `warmgate` binary: parse the command line and hand over to the CLI.

use clap::Parser;

/// mimalloc: the proxy allocates small, short-lived buffers per request,
/// where it is measurably faster than the system allocator.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() {
    let cli = warmgate_gateway::cli::Cli::parse();
    std::process::exit(warmgate_gateway::cli::run(cli));
}
