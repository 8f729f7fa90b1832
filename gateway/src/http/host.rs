//! `[access] allowed_hosts`: the `Host` names a request may address the
//! gateway by. A web page that rebinds its own DNS name to the gateway's
//! address (DNS rebinding) sends its own name as `Host`, so a gateway that
//! lists its names refuses it, whatever the request would reach.
//!
//! Matched case-insensitively, without the port and a trailing dot. The
//! probes (`/healthz`, `/readyz`), which kubelets send to a pod's IP, and
//! the routes that need a credential of their own (weights, peers) are
//! not checked: a rebound page holds no such credential.

use http::Request;

/// The names a gateway serves; empty: any.
#[derive(Debug, Clone, Default)]
pub struct AllowedHosts(Vec<String>);

impl AllowedHosts {
    /// From `[access] allowed_hosts`.
    pub fn new(names: &[String]) -> Self {
        AllowedHosts(names.iter().map(|n| normalise(n)).collect())
    }

    /// Whether no list is set (every `Host` passes).
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Whether `req` may be served: its host is listed, or its path is one
    /// that is not checked.
    pub fn admits<B>(&self, req: &Request<B>) -> bool {
        if self.0.is_empty() || exempt(req.uri().path()) {
            return true;
        }
        let named = req.uri().host().map(str::to_string).or_else(|| {
            req.headers()
                .get(http::header::HOST)
                .and_then(|v| v.to_str().ok())
                .map(strip_port)
        });
        named.is_some_and(|h| {
            let h = normalise(&h);
            self.0.contains(&h)
        })
    }
}

/// The host part of a `Host` value: `name:port`, `[v6]:port` or `[v6]`.
fn strip_port(value: &str) -> String {
    let v = value.trim();
    if let Some(rest) = v.strip_prefix('[') {
        return rest.split(']').next().unwrap_or("").to_string();
    }
    v.rsplit_once(':').map_or(v, |(h, _)| h).to_string()
}

fn normalise(name: &str) -> String {
    name.trim()
        .trim_start_matches('[')
        .trim_end_matches(']')
        .trim_end_matches('.')
        .to_ascii_lowercase()
}

fn exempt(path: &str) -> bool {
    path == "/healthz"
        || path == "/readyz"
        || path.starts_with("/v1/weights/")
        || path == crate::peers::PEERS_PATH
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(uri: &str, host: Option<&str>) -> Request<()> {
        let mut b = Request::builder().uri(uri);
        if let Some(h) = host {
            b = b.header("host", h);
        }
        b.body(()).expect("request")
    }

    #[test]
    fn only_listed_hosts_pass_with_any_port_case_or_trailing_dot() {
        let a = AllowedHosts::new(&["gw.example.com".into(), "127.0.0.1".into(), "::1".into()]);
        for (host, ok) in [
            ("gw.example.com", true),
            ("GW.Example.COM.:8080", true),
            ("127.0.0.1:9000", true),
            ("[::1]:9000", true),
            ("attacker.example", false),
            ("gw.example.com.attacker.example", false),
            ("", false),
        ] {
            assert_eq!(
                a.admits(&req("/v1/chat/completions", Some(host))),
                ok,
                "{host:?}"
            );
        }
        assert!(!a.admits(&req("/v1/status", None)), "no Host at all");
        assert!(
            a.admits(&req("http://gw.example.com/v1/status", Some("evil"))),
            "absolute form"
        );
    }

    #[test]
    fn probes_and_credentialed_routes_are_not_checked_and_an_empty_list_admits_all() {
        let a = AllowedHosts::new(&["gw.example.com".into()]);
        for path in ["/healthz", "/readyz", "/v1/weights/m/m-00001/model.bin"] {
            assert!(a.admits(&req(path, Some("10.0.0.7:8080"))), "{path}");
        }
        assert!(!a.admits(&req("/metrics", Some("10.0.0.7:8080"))));
        assert!(AllowedHosts::default().admits(&req("/v1/status", Some("anything"))));
    }
}
