//! The command line: `warmgate serve` and the client commands.
//!
//! This file holds the exit codes and [`run`], the dispatch of a parsed
//! [`Cli`] to its command; the clap definitions are in `args`, the API
//! client in `client`, and each command group in a file of its own.

mod apply;
mod args;
mod cancel;
mod client;
mod logs;
mod promote;
mod serve;
mod status;
mod usage;
mod weights;

#[cfg(test)]
mod tests;

pub use crate::telemetry::LogFormat;
pub use args::{Cli, Command, Output, WeightsCommand};
pub use client::CallError;
pub use promote::render_revisions;
pub use serve::keep_environment_private;
pub use status::render_status;
pub use usage::render_usage;

use apply::apply;
use cancel::cancel;
use client::CACERT;
use logs::logs;
use promote::{Promotion, promote, revisions, rollback};
use serve::{Start, raise_open_file_limit, refuse_open_listen, runtime, serve};
use status::status;
use usage::{UsageAsk, usage};
use weights::weights_pull;

/// Exit code for a bad config or bad usage (`EX_USAGE` from sysexits.h).
pub const EXIT_USAGE: i32 = 64;
/// Exit code when the gateway cannot be reached (`EX_UNAVAILABLE`).
pub const EXIT_UNAVAILABLE: i32 = 69;

/// Runs a command; returns the process exit code.
pub fn run(cli: Cli) -> i32 {
    let _ = CACERT.set(cli.cacert.clone());
    match cli.command {
        Command::Serve {
            config,
            listen,
            check,
            threads,
            log_format,
            insecure,
            config_wins,
        } => serve(
            config,
            listen,
            check,
            threads,
            log_format,
            Start {
                insecure,
                config_wins,
            },
        ),
        Command::Cancel { id, batch, gateway } => cancel(&gateway, &id, batch),
        Command::Usage {
            since,
            until,
            bucket,
            by,
            tenant,
            app,
            model,
            gateway,
            output,
        } => usage(
            &gateway,
            &UsageAsk {
                since: &since,
                until: until.as_deref(),
                bucket: &bucket,
                by: &by,
                tenant: tenant.as_deref(),
                app: app.as_deref(),
                model: model.as_deref(),
            },
            output,
        ),
        Command::Status {
            watch,
            interval,
            gateway,
            output,
        } => status(&gateway, watch, interval, output),
        Command::Completions { shell } => {
            use clap::CommandFactory as _;
            clap_complete::generate(
                shell,
                &mut Cli::command(),
                "warmgate",
                &mut std::io::stdout(),
            );
            0
        }
        Command::Simulate {
            trace,
            shape,
            random,
            seed,
            config,
            app,
            cold_start,
            base,
            prefill,
            decode,
            plot,
            sweep,
        } => match crate::simulate::run(crate::simulate::Args {
            traces: trace,
            shapes: shape,
            random,
            seed,
            config,
            app,
            colds: cold_start.into_iter().map(Into::into).collect(),
            model: warmgate_autoscaler::sim::ServiceModel {
                base: base.into(),
                per_context_token: prefill.into(),
                per_generated_token: decode.into(),
            },
            plot,
            sweep,
        }) {
            Ok(()) => 0,
            Err(e) => {
                eprintln!("error: {e:#}");
                EXIT_USAGE
            }
        },
        Command::Promote {
            app,
            checkpoint,
            canary,
            bake,
            wait,
            in_place,
            adapter,
            gateway,
            output,
        } => promote(
            &gateway,
            &app,
            &checkpoint,
            Promotion {
                canary,
                bake,
                wait,
                in_place,
                adapter,
            },
            output,
        ),
        Command::Apply {
            config,
            gateway,
            output,
        } => apply(&gateway, &config, output),
        Command::Rollback {
            app,
            gateway,
            output,
        } => rollback(&gateway, &app, output),
        Command::Revisions {
            app,
            gateway,
            output,
        } => revisions(&gateway, &app, output),
        Command::Logs {
            name,
            replica,
            follow,
            tail,
            gateway,
        } => logs(&gateway, &name, replica.as_deref(), follow, tail),
        Command::Operator {
            config,
            namespace,
            listen,
            log_format,
            insecure,
        } => {
            if let Err(e) = refuse_open_listen(listen, insecure) {
                eprintln!("error: {e}");
                return EXIT_USAGE;
            }
            let _telemetry = crate::telemetry::init(log_format);
            raise_open_file_limit();
            keep_environment_private();
            let rt = match runtime(None) {
                Ok(rt) => rt,
                Err(e) => {
                    eprintln!("error: could not start the runtime: {e}");
                    return 1;
                }
            };
            let args = crate::operator::OperatorArgs {
                config,
                namespace,
                listen,
            };
            match rt.block_on(crate::operator::run(args)) {
                Ok(()) => 0,
                Err(e) => {
                    eprintln!("error: {e:#}");
                    1
                }
            }
        }
        Command::Crds => match warmgate_deploy::crd::crds_yaml() {
            Ok(yaml) => {
                print!("{yaml}");
                0
            }
            Err(e) => {
                eprintln!("warmgate crds: {e}");
                1
            }
        },
        Command::Weights {
            command:
                WeightsCommand::Pull {
                    uri,
                    dir,
                    concurrency,
                    part_size,
                    memory_limit,
                    part_size_mib,
                    memory_limit_mib,
                    cache,
                },
        } => {
            let cfg = warmgate_pool::weights::StreamConfig {
                concurrency: concurrency.max(1),
                part_size: part_size_mib.map_or(part_size, |m| m << 20).max(1),
                memory_limit: memory_limit_mib.map_or(memory_limit, |m| m << 20).max(1),
            };
            weights_pull(&uri, &dir, cfg, cache)
        }
    }
}
