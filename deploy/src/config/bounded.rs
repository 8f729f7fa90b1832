//! Durations in the config, as humantime strings (`"30s"`, `"5m"`), at
//! most [`MAX`]: a larger one is a typo, and would overflow the clock
//! arithmetic of deadlines.

use std::time::Duration;

use serde::{Deserializer, Serializer};

/// Ten years.
pub const MAX: Duration = Duration::from_secs(10 * 365 * 24 * 3600);

fn check<E: serde::de::Error>(d: Duration) -> Result<Duration, E> {
    if d > MAX {
        Err(E::custom(format!(
            "{}s is too long (at most 10 years)",
            d.as_secs()
        )))
    } else {
        Ok(d)
    }
}

pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    humantime_serde::serialize(d, s)
}

pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
    let v: Duration = humantime_serde::deserialize(d)?;
    check(v)
}

pub mod option {
    use super::*;

    pub fn serialize<S: Serializer>(d: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
        humantime_serde::serialize(d, s)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
        let v: Option<Duration> = humantime_serde::deserialize(d)?;
        v.map(check).transpose()
    }
}
