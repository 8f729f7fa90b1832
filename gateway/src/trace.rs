//! W3C Trace Context: a `traceparent` from the client is passed on to the
//! worker; a request without a valid one gets a new one, so the gateway's
//! log line and the worker's can be joined on the trace id.

use http::{HeaderMap, HeaderValue};

/// The header.
pub const TRACEPARENT: http::HeaderName = http::HeaderName::from_static("traceparent");

/// Whether `v` is a valid version-00 `traceparent`:
/// `00-<32 hex trace id, not all zero>-<16 hex parent id, not all zero>-<2 hex flags>`.
pub fn is_valid(v: &str) -> bool {
    let hex = |s: &str, n: usize| {
        s.len() == n
            && s.bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    };
    let mut parts = v.split('-');
    let (Some(version), Some(trace), Some(parent), Some(flags), None) = (
        parts.next(),
        parts.next(),
        parts.next(),
        parts.next(),
        parts.next(),
    ) else {
        return false;
    };
    version == "00"
        && hex(trace, 32)
        && trace.bytes().any(|b| b != b'0')
        && hex(parent, 16)
        && parent.bytes().any(|b| b != b'0')
        && hex(flags, 2)
}

/// A new sampled `traceparent`.
pub fn new_traceparent() -> String {
    // One allocation: this runs for every request and task that comes
    // without a trace of its own.
    let trace = fastrand::u128(..) | 1;
    let span = fastrand::u64(..) | 1;
    format!("00-{trace:032x}-{span:016x}-01")
}

/// The request's `traceparent`, set to a new one when it is missing or
/// invalid (one allocation, for the new one's text).
pub fn ensure_traceparent(headers: &mut HeaderMap) -> &str {
    let valid = headers
        .get(&TRACEPARENT)
        .and_then(|v| v.to_str().ok())
        .is_some_and(is_valid);
    if !valid {
        let v = HeaderValue::from_maybe_shared(bytes::Bytes::from(new_traceparent()))
            .expect("a traceparent is a valid header value");
        headers.insert(TRACEPARENT, v);
    }
    headers
        .get(&TRACEPARENT)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
}

/// The trace id of a valid `traceparent`.
pub fn trace_id(traceparent: &str) -> &str {
    traceparent.get(3..35).unwrap_or("")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn valid_and_invalid_traceparents() {
        let v = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        assert!(is_valid(v));
        assert_eq!(trace_id(v), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert!(!is_valid(
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01"
        ));
        assert!(!is_valid(
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01"
        ));
        assert!(!is_valid(
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
        ));
        assert!(!is_valid(
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01"
        ));
        assert!(!is_valid("garbage"));
        for _ in 0..100 {
            assert!(is_valid(&new_traceparent()));
        }
        let mut h = HeaderMap::new();
        let made = ensure_traceparent(&mut h).to_string();
        assert!(is_valid(&made), "{made}");
        assert_eq!(h[TRACEPARENT], made.as_str());
        assert!(!is_valid(
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-x"
        ));
        assert!(!is_valid(
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7"
        ));
        h.insert(TRACEPARENT, HeaderValue::from_static(v));
        assert_eq!(ensure_traceparent(&mut h), v, "a valid one is kept");
    }
}
