//! Reading request bodies within their limits, and the small JSON pieces
//! (a scalar, a duration) handlers share.

use std::time::Duration;

use axum::extract::Request;
use bytes::Bytes;
use http::header;
use http_body_util::{BodyExt as _, Limited};

use crate::error::{Error, ErrorKind, too_large, too_large_for};
use crate::server::{Gateway, MAX_CLIENT_DURATION};
use crate::serving::buffered::Reading;

/// The whole request body, within `limits.max_body_bytes` (413 past it).
/// A body that trickles in is cut off at `limits.request_timeout`.
pub(crate) async fn read_body(
    req: Request,
    gw: &Gateway,
) -> Result<(http::request::Parts, Bytes), Error> {
    read_body_within(req, gw, BodyLimit::Inference).await
}

/// Which size limit a body is read within.
#[derive(Debug, Clone, Copy)]
pub(crate) enum BodyLimit {
    /// `limits.max_body_bytes`: inference and control-plane bodies (a
    /// weight sync, a promotion).
    Inference,
    /// `limits.max_task_body_bytes`: task submissions and batches, which
    /// are held until a replica takes them.
    Task,
}

/// The whole request body, within the `which` limit (413 past it); see
/// [`read_body_held`].
pub(crate) async fn read_body_within(
    req: Request,
    gw: &Gateway,
    which: BodyLimit,
) -> Result<(http::request::Parts, Bytes), Error> {
    let (parts, bytes, _reading) = read_body_held(req, gw, which).await?;
    Ok((parts, bytes))
}

/// The whole request body, within the `which` limit (413 past it), read
/// into one buffer that grows with what has arrived (see
/// [`next_capacity`]): a length announced in the headers reserves
/// nothing. Every byte of the buffer's capacity holds its share of
/// `limits.max_buffered_body_bytes` before it is reserved (429 when it is
/// spent), and keeps it in the returned [`Reading`] (hand it on with
/// [`Reading::into_held`], or drop it). A body that stops arriving for
/// `limits.idle_timeout`, or is not whole by `limits.request_timeout`,
/// gets 504.
pub(crate) async fn read_body_held(
    req: Request,
    gw: &Gateway,
    which: BodyLimit,
) -> Result<(http::request::Parts, Bytes, Reading), Error> {
    let limits = &gw.host.config.limits;
    let (limit, key) = match which {
        BodyLimit::Inference => (limits.max_body_bytes, "limits.max_body_bytes"),
        BodyLimit::Task => (limits.max_task_body_bytes, "limits.max_task_body_bytes"),
    };
    let announced = content_length(&req);
    if announced.is_some_and(|n| n > limit) {
        return Err(too_large_for(limit, key));
    }
    // Charged as the bytes come, not as announced: a client that sends
    // headers alone holds no share and no memory. The buffer grows in
    // steps charged before they are reserved, never past the announced
    // length (a body longer than it announced is an error of hyper's).
    let mut reading = gw.buffered.reading();
    let ceiling = announced.unwrap_or(limit).min(limit) as usize;
    let idle = limits.idle_timeout;
    let (parts, body) = req.into_parts();
    let read = async move {
        let mut body = std::pin::pin!(Limited::new(body, limit as usize));
        let mut buf: Vec<u8> = Vec::new();
        loop {
            let next = tokio::time::timeout(idle, body.frame())
                .await
                .map_err(|_| {
                    Error::new(
                        ErrorKind::Timeout,
                        format!(
                            "the request body stopped arriving for {} (limits.idle_timeout)",
                            humantime::format_duration(idle)
                        ),
                    )
                })?;
            let Some(frame) = next else { break };
            let frame = frame.map_err(|e| {
                if e.is::<http_body_util::LengthLimitError>() {
                    too_large_for(limit, key)
                } else {
                    Error::new(ErrorKind::BadRequest, "could not read the request body")
                }
            })?;
            if let Ok(data) = frame.into_data() {
                let need = buf.len() + data.len();
                if need > buf.capacity() {
                    let grown = next_capacity(buf.capacity(), need, ceiling);
                    reading.cover(grown as u64)?;
                    buf.reserve_exact(grown - buf.len());
                }
                buf.extend_from_slice(&data);
            }
        }
        Ok::<_, Error>((Bytes::from(buf), reading))
    };
    let (bytes, reading) = tokio::time::timeout(limits.request_timeout, read)
        .await
        .map_err(|_| {
            Error::new(
                ErrorKind::Timeout,
                "the request body did not arrive within limits.request_timeout",
            )
        })??;
    Ok((parts, bytes, reading))
}

/// The first reservation of a body's buffer: a small body fits at once.
pub(crate) const FIRST_BODY_STEP: usize = 16 * 1024;

/// The capacity a body's buffer grows to when `need` bytes no longer fit
/// in `capacity`: doubled (at least [`FIRST_BODY_STEP`]), so a body costs
/// O(log n) reallocations, and at most `ceiling` (the announced length or
/// the limit) unless `need` itself is larger. The buffer never holds more
/// than twice what has arrived, or one step, and every byte of it was
/// charged first.
pub(crate) fn next_capacity(capacity: usize, need: usize, ceiling: usize) -> usize {
    capacity
        .saturating_mul(2)
        .max(FIRST_BODY_STEP)
        .min(ceiling)
        .max(need)
}

/// A JSON body as `B`, which may borrow from it; `shape` tells the client
/// what was expected.
pub(crate) fn parse_json<'a, B: serde::Deserialize<'a>>(
    bytes: &'a [u8],
    shape: &str,
) -> Result<B, Error> {
    serde_json::from_slice(bytes).map_err(|e| {
        Error::new(
            ErrorKind::BadRequest,
            format!("the body must be {shape} ({e})"),
        )
    })
}

/// Characters of a client's string echoed back in an error.
pub(crate) const MAX_ECHOED_CHARS: usize = 200;

/// A JSON value read without building it: a number, a string (borrowed
/// from the body when it has no escapes), or anything else, skipped
/// without keeping it (an array of a million numbers costs nothing).
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) enum Scalar<'a> {
    /// The key is not in the body.
    #[default]
    Absent,
    /// A number.
    Number(serde_json::Number),
    /// A string.
    Str(std::borrow::Cow<'a, str>),
    /// `null`, a boolean, an array or an object.
    Other,
}

impl<'de: 'a, 'a> serde::Deserialize<'de> for Scalar<'a> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        use serde::de::{IgnoredAny, MapAccess, SeqAccess, Visitor};
        struct V<'a>(std::marker::PhantomData<&'a ()>);
        impl<'de: 'a, 'a> Visitor<'de> for V<'a> {
            type Value = Scalar<'a>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("any JSON value")
            }
            fn visit_bool<E>(self, _: bool) -> Result<Self::Value, E> {
                Ok(Scalar::Other)
            }
            fn visit_i64<E>(self, v: i64) -> Result<Self::Value, E> {
                Ok(Scalar::Number(v.into()))
            }
            fn visit_u64<E>(self, v: u64) -> Result<Self::Value, E> {
                Ok(Scalar::Number(v.into()))
            }
            fn visit_f64<E>(self, v: f64) -> Result<Self::Value, E> {
                Ok(serde_json::Number::from_f64(v).map_or(Scalar::Other, Scalar::Number))
            }
            fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Self::Value, E> {
                Ok(Scalar::Str(std::borrow::Cow::Borrowed(v)))
            }
            fn visit_str<E>(self, v: &str) -> Result<Self::Value, E> {
                Ok(Scalar::Str(std::borrow::Cow::Owned(v.to_owned())))
            }
            fn visit_string<E>(self, v: String) -> Result<Self::Value, E> {
                Ok(Scalar::Str(std::borrow::Cow::Owned(v)))
            }
            fn visit_unit<E>(self) -> Result<Self::Value, E> {
                Ok(Scalar::Other)
            }
            fn visit_none<E>(self) -> Result<Self::Value, E> {
                Ok(Scalar::Other)
            }
            fn visit_some<D: serde::Deserializer<'de>>(
                self,
                d: D,
            ) -> Result<Self::Value, D::Error> {
                <Scalar<'a> as serde::Deserialize<'de>>::deserialize(d)
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                while seq.next_element::<IgnoredAny>()?.is_some() {}
                Ok(Scalar::Other)
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
                Ok(Scalar::Other)
            }
        }
        d.deserialize_any(V(std::marker::PhantomData))
    }
}

pub(crate) fn check_content_length(req: &Request, limit: u64) -> Result<(), Error> {
    match content_length(req) {
        Some(n) if n > limit => Err(too_large(limit)),
        _ => Ok(()),
    }
}

/// The announced `Content-Length`, if any.
pub(crate) fn content_length(req: &Request) -> Option<u64> {
    req.headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
}

/// A duration given as seconds (a number) or a string like `"30s"`.
pub(crate) fn duration_value(v: &Scalar<'_>, key: &str) -> Result<Option<Duration>, Error> {
    let parsed = match v {
        Scalar::Absent => return Ok(None),
        Scalar::Number(n) => n
            .as_f64()
            .filter(|s| *s > 0.0)
            .and_then(|s| Duration::try_from_secs_f64(s).ok())
            // Above 0 but below a nanosecond is no time at all.
            .filter(|d| !d.is_zero()),
        Scalar::Str(s) => humantime::parse_duration(s).ok().filter(|d| !d.is_zero()),
        Scalar::Other => None,
    };
    parsed
        .filter(|d| *d <= MAX_CLIENT_DURATION)
        .map(Some)
        .ok_or_else(|| {
            Error::new(
                ErrorKind::BadRequest,
                format!(
                    "{key} must be seconds (a number above 0) or a duration like \"30s\", \
                     at most 30 days"
                ),
            )
        })
}

/// Replicas a sync may take out of dispatch at once: a count, or a
/// percentage of the ready replicas (rounded up). Kubernetes' rolling
/// update default, 25%, when absent.
pub(crate) fn max_unavailable(v: &Scalar<'_>, ready: usize) -> Result<usize, Error> {
    let pct = |p: f64| ((ready as f64 * p / 100.0).ceil() as usize).max(1);
    let bad = || {
        Error::new(
            ErrorKind::BadRequest,
            "max_unavailable must be a count (1 or more) or a percentage like \"50%\"",
        )
    };
    match v {
        Scalar::Absent => Ok(pct(25.0)),
        Scalar::Number(n) => match n.as_u64() {
            Some(k) if k >= 1 => Ok(k as usize),
            _ => Err(bad()),
        },
        Scalar::Str(s) => match s.strip_suffix('%').map(str::parse::<f64>) {
            Some(Ok(p)) if p > 0.0 && p <= 100.0 => Ok(pct(p)),
            _ => Err(bad()),
        },
        Scalar::Other => Err(bad()),
    }
}

#[cfg(test)]
mod tests {
    use super::{FIRST_BODY_STEP, next_capacity};

    #[test]
    fn a_buffer_grows_by_doubling_and_never_past_what_was_announced() {
        // A small body takes one small step, whatever it announced.
        assert_eq!(next_capacity(0, 10, 16 << 20), FIRST_BODY_STEP);
        // Doubling up to the announced length.
        assert_eq!(
            next_capacity(FIRST_BODY_STEP, FIRST_BODY_STEP + 1, 1 << 20),
            2 * FIRST_BODY_STEP
        );
        assert_eq!(next_capacity(768 << 10, (768 << 10) + 1, 1 << 20), 1 << 20);
        // A body shorter than a step announced: no more than announced.
        assert_eq!(next_capacity(0, 100, 300), 300);
        // A frame larger than the doubled capacity gets what it needs.
        assert_eq!(next_capacity(FIRST_BODY_STEP, 1 << 20, 16 << 20), 1 << 20);
    }

    #[test]
    fn the_buffer_never_holds_more_than_twice_what_arrived_or_one_step() {
        let ceiling = 16 << 20;
        let mut capacity = 0usize;
        let mut arrived = 0usize;
        for frame in [1usize, 8 << 10, 3, 64 << 10, 100 << 10, 1 << 20, 7, 5 << 20] {
            arrived += frame;
            if arrived > capacity {
                capacity = next_capacity(capacity, arrived, ceiling);
            }
            assert!(capacity >= arrived);
            assert!(
                capacity <= (2 * arrived).max(FIRST_BODY_STEP),
                "{capacity} for {arrived}"
            );
        }
    }
}
