//! Reading request bodies within their limits, and the small JSON pieces
//! (a scalar, a duration) handlers share.

#[allow(unused_imports)]
use super::prelude::*;

/// The whole request body, within `limits.max_body_bytes` (413 past it).
/// A body that trickles in is cut off at `limits.request_timeout`.
pub(crate) async fn read_body(
    req: Request,
    gw: &Gateway,
) -> Result<(http::request::Parts, Bytes), ApiError> {
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
) -> Result<(http::request::Parts, Bytes), ApiError> {
    let (parts, bytes, _reading) = read_body_held(req, gw, which).await?;
    Ok((parts, bytes))
}

/// The whole request body, within the `which` limit (413 past it), read
/// into one buffer of the announced length: the body is in memory once,
/// never twice. The bytes that have come hold their share of
/// `limits.max_buffered_body_bytes` as they arrive (429 when it is spent),
/// and keep it in the returned [`Reading`] (hand it on with
/// [`Reading::into_held`], or drop it). A body that stops arriving for
/// `limits.idle_timeout`, or is not whole by `limits.request_timeout`,
/// gets 504.
pub(crate) async fn read_body_held(
    req: Request,
    gw: &Gateway,
    which: BodyLimit,
) -> Result<(http::request::Parts, Bytes, Reading), ApiError> {
    let limits = &gw.config.limits;
    let (limit, key) = match which {
        BodyLimit::Inference => (limits.max_body_bytes, "limits.max_body_bytes"),
        BodyLimit::Task => (limits.max_task_body_bytes, "limits.max_task_body_bytes"),
    };
    let announced = content_length(&req);
    if announced.is_some_and(|n| n > limit) {
        return Err(too_large_for(limit, key));
    }
    // Charged as the bytes come, not as announced: a client that sends
    // headers alone holds no share (the buffer's pages are not touched
    // until written).
    let mut reading = gw.buffered.reading();
    let capacity = announced.unwrap_or(0).min(limit);
    let idle = limits.idle_timeout;
    let (parts, body) = req.into_parts();
    let read = async move {
        let mut body = std::pin::pin!(Limited::new(body, limit as usize));
        let mut buf = bytes::BytesMut::with_capacity(capacity as usize);
        loop {
            let next = tokio::time::timeout(idle, body.frame())
                .await
                .map_err(|_| {
                    ApiError::new(
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
                    ApiError::new(ErrorKind::BadRequest, "could not read the request body")
                }
            })?;
            if let Ok(data) = frame.into_data() {
                reading.cover((buf.len() + data.len()) as u64)?;
                buf.extend_from_slice(&data);
            }
        }
        Ok::<_, ApiError>((buf.freeze(), reading))
    };
    let (bytes, reading) = tokio::time::timeout(limits.request_timeout, read)
        .await
        .map_err(|_| {
            ApiError::new(
                ErrorKind::Timeout,
                "the request body did not arrive within limits.request_timeout",
            )
        })??;
    Ok((parts, bytes, reading))
}

/// A JSON body as `B`, which may borrow from it; `shape` tells the client
/// what was expected.
pub(crate) fn parse_json<'a, B: serde::Deserialize<'a>>(
    bytes: &'a [u8],
    shape: &str,
) -> Result<B, ApiError> {
    serde_json::from_slice(bytes).map_err(|e| {
        ApiError::new(
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

pub(crate) fn check_content_length(req: &Request, limit: u64) -> Result<(), ApiError> {
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
pub(crate) fn duration_value(v: &Scalar<'_>, key: &str) -> Result<Option<Duration>, ApiError> {
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
            ApiError::new(
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
pub(crate) fn max_unavailable(v: &Scalar<'_>, ready: usize) -> Result<usize, ApiError> {
    let pct = |p: f64| ((ready as f64 * p / 100.0).ceil() as usize).max(1);
    let bad = || {
        ApiError::new(
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
