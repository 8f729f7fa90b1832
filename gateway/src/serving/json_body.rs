//! An OpenAI request body with some of its top-level fields set: the
//! `model` an adapter's revision is held under, a tenant's `cache_salt`.
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
    let mut map: BTreeMap<String, &RawValue> = serde_json::from_slice(body).map_err(|e| {
        Error::new(
            ErrorKind::BadRequest,
            format!("the request body must be a JSON object ({e})"),
        )
    })?;
    let values: Vec<Box<RawValue>> = fields
        .iter()
        .map(|(_, v)| serde_json::value::to_raw_value(v))
        .collect::<Result<_, _>>()
        .map_err(|e| Error::new(ErrorKind::Internal, e.to_string()))?;
    for ((name, _), value) in fields.iter().zip(&values) {
        map.insert((*name).to_string(), value);
    }
    serde_json::to_vec(&map)
        .map(Bytes::from)
        .map_err(|e| Error::new(ErrorKind::Internal, e.to_string()))
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
}
