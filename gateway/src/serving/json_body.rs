//! An OpenAI request body with some of its top-level fields set: the
//! `model` an adapter's revision is held under, a tenant's `cache_salt`,
//! `stream_options.include_usage` so that a stream's tokens are counted,
//! a tenant's `max_tokens`.
//! The other values are kept byte for byte, never parsed into a tree (the
//! keys come out sorted); a field the client sent twice is read as JSON
//! parsers read it, the last one winning, and then replaced.

use std::collections::BTreeMap;

use bytes::Bytes;
use serde_json::value::RawValue;

use crate::error::{Error, ErrorKind};

/// `body` (a JSON object) with each `(name, value)` of `fields` set to the
/// JSON string `value`.
pub fn with_fields(body: &[u8], fields: &[(&str, &str)]) -> Result<Bytes, Error> {
    let values: Vec<(&str, Box<RawValue>)> = fields
        .iter()
        .map(|(k, v)| Ok((*k, json(v)?)))
        .collect::<Result<_, Error>>()?;
    with_values(body, &values)
}

/// `value` as a JSON value to set.
pub fn json<T: serde::Serialize + ?Sized>(value: &T) -> Result<Box<RawValue>, Error> {
    serde_json::value::to_raw_value(value)
        .map_err(|e| Error::new(ErrorKind::Internal, e.to_string()))
}

/// `body` (a JSON object) with each `(name, value)` of `fields` set to the
/// JSON `value`.
pub fn with_values(body: &[u8], fields: &[(&str, Box<RawValue>)]) -> Result<Bytes, Error> {
    let mut map: BTreeMap<String, &RawValue> = serde_json::from_slice(body).map_err(|e| {
        Error::new(
            ErrorKind::BadRequest,
            format!("the request body must be a JSON object ({e})"),
        )
    })?;
    for (name, value) in fields {
        map.insert((*name).to_string(), value);
    }
    serde_json::to_vec(&map)
        .map(Bytes::from)
        .map_err(|e| Error::new(ErrorKind::Internal, e.to_string()))
}

/// `body` (a JSON object known to have none of `fields`' names) with each
/// of them added at its start: the body's bytes are copied, not parsed
/// again (the cheap way for what every streamed request gets).
pub fn prepend(body: &[u8], fields: &[(&str, Box<RawValue>, bool)]) -> Result<Bytes, Error> {
    let not_object = || {
        Error::new(
            ErrorKind::BadRequest,
            "the request body must be a JSON object",
        )
    };
    let open = body
        .iter()
        .position(|b| !b.is_ascii_whitespace())
        .filter(|&i| body[i] == b'{')
        .ok_or_else(not_object)?;
    let empty = body[open + 1..]
        .iter()
        .find(|b| !b.is_ascii_whitespace())
        .is_some_and(|&b| b == b'}');
    let mut out = Vec::with_capacity(body.len() + 64);
    out.extend_from_slice(&body[..=open]);
    for (i, (name, value, _)) in fields.iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        serde_json::to_writer(&mut out, name)
            .map_err(|e| Error::new(ErrorKind::Internal, e.to_string()))?;
        out.push(b':');
        out.extend_from_slice(value.get().as_bytes());
    }
    if !empty {
        out.push(b',');
    }
    out.extend_from_slice(&body[open + 1..]);
    Ok(Bytes::from(out))
}

/// `stream_options` as a client sent it (an object, or none), with
/// `include_usage` set: the other options are kept.
pub fn include_usage(options: Option<&RawValue>) -> Result<Box<RawValue>, Error> {
    let Some(options) = options else {
        return RawValue::from_string(r#"{"include_usage":true}"#.to_string())
            .map_err(|e| Error::new(ErrorKind::Internal, e.to_string()));
    };
    let options = Some(options);
    let mut map: BTreeMap<String, &RawValue> = options
        .and_then(|o| serde_json::from_str(o.get()).ok())
        .unwrap_or_default();
    let yes = json(&true)?;
    map.insert("include_usage".into(), &yes);
    json(&map)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_are_set_and_the_rest_kept_as_it_was() {
        let body = br#"{"model": "a", "messages": [{"role": "user", "content": "hi \u00e9"}], "cache_salt": "mine", "cache_salt": "theirs"}"#;
        let out = with_fields(body, &[("model", "b"), ("cache_salt", "s1")]).expect("object");
        let v: serde_json::Value = serde_json::from_slice(&out).expect("json");
        assert_eq!(v["model"], "b");
        assert_eq!(v["cache_salt"], "s1");
        assert!(
            String::from_utf8_lossy(&out).contains(r#""content": "hi \u00e9""#),
            "kept byte for byte: {}",
            String::from_utf8_lossy(&out)
        );
        assert_eq!(
            String::from_utf8_lossy(&out).matches("cache_salt").count(),
            1
        );
        assert!(with_fields(b"[1]", &[("model", "b")]).is_err());
    }

    #[test]
    fn prepended_fields_make_the_same_object() {
        let f = vec![
            ("stream_options", include_usage(None).unwrap(), true),
            ("max_tokens", json(&7).unwrap(), true),
        ];
        for body in [&b" {\"model\": \"m\", \"stream\": true}"[..], b"{}", b"{ }"] {
            let out = prepend(body, &f).unwrap();
            let v: serde_json::Value = serde_json::from_slice(&out).unwrap();
            assert_eq!(
                v["stream_options"]["include_usage"],
                true,
                "{}",
                String::from_utf8_lossy(&out)
            );
            assert_eq!(v["max_tokens"], 7);
        }
        assert!(prepend(b"[1]", &f).is_err());
    }

    #[test]
    fn include_usage_keeps_the_client_s_other_stream_options() {
        let given = RawValue::from_string(
            r#"{"continuous_usage_stats": true, "include_usage": false}"#.into(),
        )
        .unwrap();
        let set = include_usage(Some(&given)).unwrap();
        let v: serde_json::Value = serde_json::from_str(set.get()).unwrap();
        assert_eq!(
            v,
            serde_json::json!({"continuous_usage_stats": true, "include_usage": true})
        );
        let none = include_usage(None).unwrap();
        assert_eq!(none.get(), r#"{"include_usage":true}"#);
        let odd = RawValue::from_string("null".into()).unwrap();
        assert_eq!(
            include_usage(Some(&odd)).unwrap().get(),
            r#"{"include_usage":true}"#
        );
    }
}
