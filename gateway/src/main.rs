//! The `warmgate` binary: parse the command line and hand over to the CLI.

use clap::Parser;

fn main() {
    let cli = warmgate_gateway::cli::Cli::parse();
    std::process::exit(warmgate_gateway::cli::run(cli));
}
