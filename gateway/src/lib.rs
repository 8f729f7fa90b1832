//! warmgate's gateway: the HTTP data plane (proxy, balancer, hold queue),
//! the control-plane API, the CLI, and the composition root that wires the
//! pool manager and the autoscaler together.

#![warn(missing_docs)]

pub mod access;
pub mod change;
pub mod cli;
pub mod error;
pub mod gate;
pub mod host;
pub mod http;
pub mod listener;
pub mod metric_catalog;
pub mod operator;
pub mod outcomes;
pub mod peering;
pub mod peers;
pub mod preflight;
pub mod promote;
pub mod registry;
pub mod replica_logs;
pub mod replica_sink;
pub mod report;
pub mod runtime;
pub mod server;
pub mod serving;
pub mod simplot;
pub mod simulate;
pub mod status;
pub mod tasks;
pub mod telemetry;
pub mod tenants;
pub mod tls;
pub mod trace;
pub mod upstream;
pub mod usage;
pub mod weights;

pub use error::{Error, ErrorKind};
pub use http::router;
pub use server::Gateway;
