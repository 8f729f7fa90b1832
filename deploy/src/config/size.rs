//! A size in bytes, written as a whole number of bytes or with a unit, as
//! people write sizes elsewhere in the file (`memory = "16Gi"`):
//! `"64MiB"`, `"64 MiB"`, `"1.5GiB"`, `"500MB"`, `"16Gi"`, `"16Ki"`
//! (`Ki`/`Mi`/`Gi`/`Ti` are the binary units, as in Kubernetes).

use serde::{Deserialize, Deserializer, Serializer};

/// The schema of a size: a whole number of bytes or a text with a unit.
pub struct Size;

impl schemars::JsonSchema for Size {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "Size".into()
    }

    fn inline_schema() -> bool {
        true
    }

    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        schemars::json_schema!({
            "type": ["integer", "string"],
            "format": "size",
        })
    }
}

pub fn serialize<S: Serializer>(n: &u64, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_u64(*n)
}

pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Raw {
        Bytes(u64),
        Text(String),
    }
    match Raw::deserialize(d)? {
        Raw::Bytes(n) => Ok(n),
        Raw::Text(t) => parse(&t).map_err(serde::de::Error::custom),
    }
}

/// Bytes from a size with a unit.
pub fn parse(text: &str) -> Result<u64, String> {
    let t = text.trim();
    // Kubernetes' binary suffixes (`16Gi`) are bytesize's `GiB`.
    let kube = ["Ki", "Mi", "Gi", "Ti", "Pi", "Ei"]
        .iter()
        .find(|s| t.ends_with(*s))
        .map(|_| format!("{t}B"));
    kube.as_deref()
        .unwrap_or(t)
        .parse::<bytesize::ByteSize>()
        .map(|b| b.as_u64())
        .map_err(|_| {
            format!(
                "{text:?} is not a size: write bytes (1048576) or a number and a unit (\"64MiB\", \"16Gi\", \"500MB\")"
            )
        })
}
