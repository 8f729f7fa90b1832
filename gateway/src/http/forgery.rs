//! Requests a web page made, refused on a control plane without a token.
//!
//! Without `WARMGATE_ADMIN_TOKEN` the gateway listens on loopback only and
//! trusts whoever can reach the socket. A browser on the same machine can
//! reach it too, on behalf of any page it shows:
//!
//! - **DNS rebinding**: a page whose name the attacker points at 127.0.0.1
//!   after it loaded talks to the gateway as its own origin, reads the
//!   answers and can `PUT` an app whose command runs on the machine. Its
//!   requests carry the attacker's name in `Host`.
//! - **Cross-site requests**: a page anywhere can send a form-style `POST`
//!   (no preflight) to `http://127.0.0.1:8080/v1/apps/x/rollback`. It
//!   carries the page's `Origin`, and `Sec-Fetch-Site: cross-site`.
//!
//! - **A page of an app**: what `/apps/{app}/…` serves (a Gradio UI, a
//!   worker that echoes its input as HTML) comes from the gateway's own
//!   origin, so its scripts' requests are same-origin.
//!
//! So a tokenless control plane answers only a `Host` that no one else can
//! point at this machine (an IP literal, `localhost`, `*.localhost`), only
//! reads whose `Origin`, when a browser sent one, is the gateway's own (the
//! dashboard's `GET /v1/status`), and no change at all that a browser sent:
//! browsers mark every `POST`, `PUT` and `DELETE` of a page with `Origin`
//! and `Sec-Fetch-Site`. Programs (curl, `warmgate apply`, the tests, SDKs)
//! send neither header.

use http::{HeaderMap, Method, Uri, header};

/// Why a request looks like one a web page made rather than the operator's
/// program, or `None`.
pub(crate) fn forged(method: &Method, headers: &HeaderMap, uri: &Uri) -> Option<String> {
    let host = headers
        .get(header::HOST)
        .and_then(|v| v.to_str().ok())
        .or_else(|| uri.authority().map(|a| a.as_str()));
    if let Some(host) = host
        && !unrebindable(host)
    {
        return Some(format!(
            "Host '{}' is a name, which a web page can point at this machine",
            printable(host)
        ));
    }
    if let Some(site) = headers
        .get("sec-fetch-site")
        .and_then(|v| v.to_str().ok())
        .filter(|s| s.eq_ignore_ascii_case("cross-site") || s.eq_ignore_ascii_case("same-site"))
    {
        return Some(format!(
            "the browser says it came from another site ({site})"
        ));
    }
    let fetched = headers
        .get("sec-fetch-site")
        .is_some_and(|v| !v.as_bytes().eq_ignore_ascii_case(b"none"));
    if !method.is_safe() && (fetched || headers.contains_key(header::ORIGIN)) {
        return Some(format!(
            "a web page sent this {method}, and the pages of apps served here share the \
             gateway's origin, so changes are taken only from programs"
        ));
    }
    if let Some(origin) = headers.get(header::ORIGIN) {
        let origin = origin.to_str().unwrap_or("");
        let authority = origin
            .split_once("://")
            .map(|(_, rest)| rest.trim_end_matches('/'));
        let same = matches!((authority, host), (Some(a), Some(h)) if a.eq_ignore_ascii_case(h));
        if !same {
            return Some(format!(
                "it came from the web page of origin '{}'",
                printable(origin)
            ));
        }
    }
    None
}

/// Whether a `Host` value cannot be a name an attacker controls: an IP
/// literal (v4 or bracketed v6), `localhost` or a name under it, with or
/// without a port.
fn unrebindable(host: &str) -> bool {
    let name = if let Some(rest) = host.strip_prefix('[') {
        return rest.split_once(']').is_some_and(|(ip, port)| {
            ip.parse::<std::net::Ipv6Addr>().is_ok()
                && (port.is_empty() || port.strip_prefix(':').is_some_and(port_ok))
        });
    } else {
        match host.rsplit_once(':') {
            Some((name, port)) if port_ok(port) => name,
            Some(_) => return false,
            None => host,
        }
    };
    let name = name.trim_end_matches('.');
    name.parse::<std::net::Ipv4Addr>().is_ok()
        || name.eq_ignore_ascii_case("localhost")
        || name
            .len()
            .checked_sub(".localhost".len())
            .and_then(|i| name.get(i..))
            .is_some_and(|tail| tail.eq_ignore_ascii_case(".localhost"))
}

/// A port number's digits.
fn port_ok(port: &str) -> bool {
    !port.is_empty() && port.len() <= 5 && port.bytes().all(|b| b.is_ascii_digit())
}

/// At most 100 printable characters of a header, for the error message.
fn printable(s: &str) -> String {
    s.chars().filter(|c| !c.is_control()).take(100).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(pairs: &[(&str, &str)]) -> Option<String> {
        check_method(Method::GET, pairs)
    }

    fn check_method(method: Method, pairs: &[(&str, &str)]) -> Option<String> {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(
                http::HeaderName::from_bytes(k.as_bytes()).unwrap(),
                v.parse().unwrap(),
            );
        }
        forged(&method, &h, &Uri::from_static("/v1/apps/x"))
    }

    #[test]
    fn programs_and_the_dashboard_pass() {
        for host in [
            "127.0.0.1:8080",
            "127.0.0.1",
            "localhost:8080",
            "LOCALHOST",
            "gpu.localhost:80",
            "[::1]:8080",
            "10.0.0.5:8080",
            "localhost.",
        ] {
            assert_eq!(check(&[("host", host)]), None, "{host}");
        }
        assert_eq!(check(&[]), None, "no Host at all (HTTP/1.0)");
        // The dashboard's same-origin requests.
        assert_eq!(
            check(&[
                ("host", "127.0.0.1:8080"),
                ("origin", "http://127.0.0.1:8080"),
                ("sec-fetch-site", "same-origin")
            ]),
            None
        );
        assert_eq!(
            check(&[("host", "127.0.0.1:1"), ("sec-fetch-site", "none")]),
            None,
            "typed into the address bar"
        );
    }

    #[test]
    fn a_rebound_name_or_another_page_is_refused() {
        for host in [
            "evil.example:8080",
            "evil.example",
            "localhost.evil.example",
            "127.0.0.1.nip.io:8080",
            "[::1]:x",
            "[evil]:80",
            "127.0.0.1:99999999",
        ] {
            assert!(check(&[("host", host)]).is_some(), "{host}");
        }
        let other_page = check(&[
            ("host", "127.0.0.1:8080"),
            ("origin", "https://evil.example"),
        ]);
        assert!(other_page.unwrap().contains("evil.example"));
        // Another port on the same machine is another origin.
        assert!(
            check(&[
                ("host", "localhost:8080"),
                ("origin", "http://localhost:8888")
            ])
            .is_some()
        );
        assert!(check(&[("host", "localhost:8080"), ("origin", "null")]).is_some());
        assert!(check(&[("host", "localhost:8080"), ("sec-fetch-site", "cross-site")]).is_some());
        assert!(check(&[("host", "localhost:8080"), ("sec-fetch-site", "same-site")]).is_some());
    }

    #[test]
    fn a_change_sent_by_any_page_is_refused_even_from_this_origin() {
        let same_origin = [
            ("host", "127.0.0.1:8080"),
            ("origin", "http://127.0.0.1:8080"),
            ("sec-fetch-site", "same-origin"),
        ];
        for method in [Method::PUT, Method::POST, Method::DELETE, Method::PATCH] {
            let why = check_method(method.clone(), &same_origin).expect("refused");
            assert!(why.contains("web page"), "{why}");
            assert!(check_method(method.clone(), &same_origin[..2]).is_some());
            assert!(check_method(method.clone(), &[same_origin[0], same_origin[2]]).is_some());
            // Programs send neither header.
            assert_eq!(check_method(method, &[same_origin[0]]), None);
        }
        assert_eq!(check_method(Method::HEAD, &same_origin), None);
    }
}
