//! The listener and who is trusted: TLS, who may reach what on it, and
//! what the operator accepts from cluster resources.

use std::net::SocketAddr;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::BackendKind;

/// The listener's certificate. Relative paths are resolved against the
/// config file's folder.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct TlsConfig {
    /// PEM file with the certificate chain, the gateway's own first.
    pub cert: PathBuf,
    /// PEM file with its private key (PKCS#8, PKCS#1 or SEC1).
    pub key: PathBuf,
    /// Where the gateway also serves plain HTTP for its own workers (their
    /// weights URL), which hold no CA to trust. Default with the local
    /// backend: a free port on 127.0.0.1. Needed with the Kubernetes
    /// backend, whose `advertise` must then name this port.
    pub worker_listen: Option<SocketAddr>,
}

/// Who may reach what on the listener.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct AccessConfig {
    /// The names (or IP literals) clients may address the gateway by in
    /// `Host`, matched without the port and case-insensitively; a request
    /// naming any other host is refused (`421`). A defence against DNS
    /// rebinding. Empty (the default): any `Host`.
    pub allowed_hosts: Vec<String>,
    /// Serve `/metrics` and `/openapi.json` without the admin token (for a
    /// scraper that holds none). Off by default: they need it.
    pub public_metrics: bool,
}

/// What the operator accepts from cluster resources. Anyone who may edit a
/// `ServingApp` is not thereby trusted to run code in the operator's pod or
/// to make it send requests inside the cluster, so the spec fields that do
/// either are refused unless the operator's own config allows them.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct OperatorConfig {
    /// Accept `promotion.gate_command` from resources: it runs in the
    /// operator's container, beside its credentials. Off by default.
    pub allow_gate_command: bool,
    /// Accept `promotion.gate_url` from resources: the operator POSTs to
    /// it from inside the cluster. Off by default.
    pub allow_gate_url: bool,
}

impl TlsConfig {
    /// With the Kubernetes backend, pods need `worker_listen` to read their
    /// weights over plain HTTP.
    pub(super) fn validate(&self, backend: BackendKind) -> Result<(), (String, String)> {
        if self.worker_listen.is_none() && backend == BackendKind::Kubernetes {
            return Err((
                "tls.worker_listen".into(),
                "is needed with the Kubernetes backend: the address (e.g. \"0.0.0.0:8081\") where pods read their weights over plain HTTP, which backend.kubernetes.advertise then names".into(),
            ));
        }
        Ok(())
    }
}

impl AccessConfig {
    /// Each allowed host is a host name or an IP literal.
    pub(super) fn validate(&self) -> Result<(), (String, String)> {
        for (i, h) in self.allowed_hosts.iter().enumerate() {
            let ip6 = h.parse::<std::net::Ipv6Addr>().is_ok();
            let name = h
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'-');
            let ok = !h.is_empty() && h.len() <= 253 && (ip6 || name);
            if !ok {
                return Err((
                    format!("access.allowed_hosts[{i}]"),
                    format!("{h:?} is not a host name or IP address (no port, no scheme)"),
                ));
            }
        }
        Ok(())
    }
}
