//! `GET /v1/usage`: the tokens the engines counted, by tenant, app, model
//! and time. The admin sees every tenant's; a tenant's API key sees its
//! own only.

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::Json;
use axum::extract::{Request, State};
use http::header;

use super::ErrorBody;
use crate::error::{Error, ErrorKind};
use crate::server::Gateway;
use crate::usage::ledger::{Bucket, Dim, Query, Report};

/// Who asks: everyone's usage, or one tenant's.
enum Scope {
    All,
    Tenant(String),
}

#[utoipa::path(get, path = "/v1/usage", tag = "control",
    description = "Tokens used, as the engines counted them in each answer's `usage`, in hour buckets. The admin token sees every tenant's; a tenant's API key sees its own only.",
    params(
        ("since" = Option<String>, Query, description = "From: an RFC 3339 time, or a duration ago (`24h`, `7d`); counted from the start of its hour. Default: 24 hours ago"),
        ("until" = Option<String>, Query, description = "To (exclusive): an RFC 3339 time or a duration ago. Default: now"),
        ("bucket" = Option<String>, Query, description = "`hour` (default), `day` or `total`"),
        ("group_by" = Option<String>, Query, description = "A comma-separated list of `tenant`, `app`, `model` (default: all three); empty for one row a bucket"),
        ("tenant" = Option<String>, Query, description = "Only this tenant's (`-`: requests without one)"),
        ("app" = Option<String>, Query, description = "Only this app's"),
        ("model" = Option<String>, Query, description = "Only this model's (an app, or an adapter)")),
    responses((status = 200, description = "`{since, until, bucket, data: [{start, tenant, app, model, requests, requests_without_usage, prompt_tokens, cached_tokens, completion_tokens, total_tokens}], truncated}`", body = crate::usage::ledger::Report),
              (status = 400, description = "A parameter that cannot be read", body = ErrorBody),
              (status = 401, description = "Neither the admin token nor a tenant's key", body = ErrorBody)))]
pub(crate) async fn usage(
    State(gw): State<Arc<Gateway>>,
    req: Request,
) -> Result<Json<Report>, Error> {
    let (parts, _) = req.into_parts();
    let scope = caller(&gw, &parts)?;
    let mut q = parse(parts.uri.query(), unix_now())?;
    if let Scope::Tenant(name) = scope {
        if q.tenant.as_ref().is_some_and(|t| *t != name) {
            return Err(Error::new(
                ErrorKind::Unauthorized,
                format!("a tenant's key reads its own usage only ('{name}')"),
            )
            .param("tenant"));
        }
        q.tenant = Some(name);
    }
    let ledger = gw.usage.clone();
    let report = tokio::task::spawn_blocking(move || ledger.query(&q))
        .await
        .map_err(|e| Error::new(ErrorKind::Internal, e.to_string()))?
        .map_err(|e| {
            Error::new(
                ErrorKind::Internal,
                format!("could not read the usage ledger: {e}"),
            )
        })?;
    Ok(Json(report))
}

/// The caller's scope: a tenant's key (with tenants configured), else the
/// admin token as the control plane takes it.
fn caller(gw: &Gateway, req: &http::request::Parts) -> Result<Scope, Error> {
    if let Some(tenants) = &gw.access.tenants
        && let Some(t) = tenants.identify(&req.headers)
    {
        return Ok(Scope::Tenant(t.name.clone()));
    }
    let Some(token) = &gw.access.admin_token else {
        if let Some(why) = super::forgery::forged(&req.method, &req.headers, &req.uri) {
            return Err(Error::new(
                ErrorKind::Unauthorized,
                format!("refused: {why}"),
            ));
        }
        return Ok(Scope::All);
    };
    let presented = req
        .headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or("");
    if crate::tenants::same_secret(presented, token) {
        Ok(Scope::All)
    } else {
        Err(Error::new(
            ErrorKind::Unauthorized,
            "this endpoint needs Authorization: Bearer <the gateway's admin token, or a tenant's API key>",
        ))
    }
}

fn unix_now() -> i64 {
    crate::usage::ledger::unix_now()
}

/// The query string read into a [`Query`], at `now` (seconds since the
/// epoch).
fn parse(query: Option<&str>, now: i64) -> Result<Query, Error> {
    let bad = |key: &'static str, why: String| Error::new(ErrorKind::BadRequest, why).param(key);
    let mut q = Query {
        since: now - 24 * 3600,
        until: now + 1,
        bucket: Bucket::Hour,
        group_by: Dim::ALL.to_vec(),
        tenant: None,
        app: None,
        model: None,
    };
    for pair in query.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
        let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
        let value = percent_encoding::percent_decode_str(&value.replace('+', " "))
            .decode_utf8_lossy()
            .into_owned();
        match key {
            "since" => q.since = time(&value, now).map_err(|w| bad("since", w))?,
            "until" => q.until = time(&value, now).map_err(|w| bad("until", w))?,
            "bucket" => {
                q.bucket = Bucket::parse(&value).ok_or_else(|| {
                    bad(
                        "bucket",
                        format!("bucket is hour, day or total, not {value:?}"),
                    )
                })?;
            }
            "group_by" => {
                q.group_by = value
                    .split(',')
                    .map(str::trim)
                    .filter(|d| !d.is_empty())
                    .map(|d| {
                        Dim::parse(d).ok_or_else(|| {
                            bad(
                                "group_by",
                                format!("group_by lists tenant, app and model, not {d:?}"),
                            )
                        })
                    })
                    .collect::<Result<_, _>>()?;
            }
            "tenant" => q.tenant = Some(value),
            "app" => q.app = Some(value),
            "model" => q.model = Some(value),
            other => {
                return Err(bad(
                    "query",
                    format!(
                        "unknown parameter {other:?}: since, until, bucket, group_by, tenant, app, model"
                    ),
                ));
            }
        }
    }
    if q.since >= q.until {
        return Err(bad("since", "since must be before until".into()));
    }
    Ok(q)
}

/// An RFC 3339 time, or a duration ago, as seconds since the epoch.
fn time(value: &str, now: i64) -> Result<i64, String> {
    if let Ok(d) = humantime::parse_duration(value) {
        let d = d.min(Duration::from_secs(100 * 365 * 24 * 3600));
        return Ok(now - d.as_secs() as i64);
    }
    humantime::parse_rfc3339_weak(value)
        .map(|t: SystemTime| {
            t.duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_secs() as i64)
        })
        .map_err(|_| {
            format!("{value:?} is neither an RFC 3339 time (2026-12-07T10:00:00Z) nor a duration ago (24h)")
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parameters_are_read_or_refused_by_name() {
        let now = 1_000_000;
        let q = parse(
            Some("since=2h&bucket=total&group_by=tenant,model&app=llm&tenant=team-a"),
            now,
        )
        .unwrap();
        assert_eq!(q.since, now - 7200);
        assert_eq!(q.bucket, Bucket::Total);
        assert_eq!(q.group_by, vec![Dim::Tenant, Dim::Model]);
        assert_eq!(q.app.as_deref(), Some("llm"));
        let q = parse(Some("since=1970-01-02T00:00:00Z&group_by="), now).unwrap();
        assert_eq!(q.since, 86_400);
        assert!(q.group_by.is_empty());
        for (query, param) in [
            ("bucket=week", "bucket"),
            ("group_by=region", "group_by"),
            ("since=yesterday", "since"),
            ("sinse=1h", "query"),
            ("since=1h&until=2h", "since"),
        ] {
            let e = parse(Some(query), now).expect_err(query);
            assert_eq!(e.param, Some(param), "{query}: {e:?}");
        }
    }
}
