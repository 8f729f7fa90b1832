//! `[apps.autoscale] scale_to_zero_after`: `"auto"` or a duration.

use std::fmt;
use std::time::Duration;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// When an idle app's last replica goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ScaleToZeroAfter {
    /// As long as a cold start would cost, learned from the app's idle
    /// spells and measured cold start; a minute until those are known.
    #[default]
    Auto,
    /// After this long without a request, whatever the cold start.
    After(Duration),
}

impl fmt::Display for ScaleToZeroAfter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ScaleToZeroAfter::Auto => f.write_str("auto"),
            ScaleToZeroAfter::After(d) => write!(f, "{}", humantime::format_duration(*d)),
        }
    }
}

impl Serialize for ScaleToZeroAfter {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for ScaleToZeroAfter {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        if text.trim() == "auto" {
            return Ok(ScaleToZeroAfter::Auto);
        }
        let after = humantime::parse_duration(text.trim()).map_err(|e| {
            serde::de::Error::custom(format!(
                "expected \"auto\" or a duration such as \"90s\", got {text:?}: {e}"
            ))
        })?;
        if after > crate::config::bounded::MAX {
            return Err(serde::de::Error::custom(format!(
                "{}s is too long (at most 10 years)",
                after.as_secs()
            )));
        }
        Ok(ScaleToZeroAfter::After(after))
    }
}

impl schemars::JsonSchema for ScaleToZeroAfter {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "ScaleToZeroAfter".into()
    }

    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        schemars::json_schema!({
            "type": "string",
            "description": "\"auto\", or a duration such as \"90s\"",
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(v: &str) -> Result<ScaleToZeroAfter, String> {
        serde_json::from_value(serde_json::Value::String(v.into())).map_err(|e| e.to_string())
    }

    #[test]
    fn auto_and_durations_read_back_as_written() {
        assert_eq!(parse("auto"), Ok(ScaleToZeroAfter::Auto));
        assert_eq!(
            parse("90s"),
            Ok(ScaleToZeroAfter::After(Duration::from_secs(90)))
        );
        for v in [
            ScaleToZeroAfter::Auto,
            ScaleToZeroAfter::After(Duration::from_secs(150)),
        ] {
            let text = serde_json::to_value(v).unwrap();
            assert_eq!(serde_json::from_value::<ScaleToZeroAfter>(text).unwrap(), v);
        }
    }

    #[test]
    fn anything_else_is_refused_with_what_is_expected() {
        for bad in ["automatic", "", "-5s", "20 years"] {
            let e = parse(bad).unwrap_err();
            assert!(
                e.contains("expected \"auto\" or a duration") || e.contains("too long"),
                "{bad}: {e}"
            );
        }
    }
}
