//! Arrival traces: the Azure LLM inference format, and the service-time
//! model that turns a request's tokens into the time it holds a slot.

use std::time::Duration;

/// One request of a trace.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TraceRequest {
    /// Arrival time since the trace's first request.
    pub arrival: Duration,
    /// Prompt tokens.
    pub context_tokens: u32,
    /// Tokens generated.
    pub generated_tokens: u32,
}

/// Parses the Azure LLM inference trace format
/// (`TIMESTAMP,ContextTokens,GeneratedTokens`, timestamps like
/// `2023-11-16 18:15:46.6805900`). Arrivals are made relative to the first
/// request and sorted.
pub fn parse_azure_trace(csv: &str) -> Result<Vec<TraceRequest>, String> {
    let mut rows = Vec::new();
    for (i, line) in csv.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || (i == 0 && line.starts_with("TIMESTAMP")) {
            continue;
        }
        let mut f = line.split(',');
        let (Some(ts), Some(ctx), Some(gen_tokens)) = (f.next(), f.next(), f.next()) else {
            return Err(format!("line {}: expected 3 columns", i + 1));
        };
        let at =
            parse_timestamp(ts).ok_or_else(|| format!("line {}: bad timestamp {ts:?}", i + 1))?;
        let context_tokens = ctx
            .trim()
            .parse()
            .map_err(|_| format!("line {}: bad ContextTokens {ctx:?}", i + 1))?;
        let generated_tokens = gen_tokens
            .trim()
            .parse()
            .map_err(|_| format!("line {}: bad GeneratedTokens {gen_tokens:?}", i + 1))?;
        rows.push((at, context_tokens, generated_tokens));
    }
    let Some(&(base, _, _)) = rows
        .iter()
        .min_by(|a, b| a.0.0.cmp(&b.0.0).then(a.0.1.total_cmp(&b.0.1)))
    else {
        return Err("the trace has no requests".into());
    };
    let mut out: Vec<TraceRequest> = rows
        .into_iter()
        .map(|((days, secs), context_tokens, generated_tokens)| {
            // Days and seconds apart, so sub-microsecond digits survive.
            let rel = (days - base.0) as f64 * 86_400.0 + (secs - base.1);
            TraceRequest {
                arrival: Duration::from_secs_f64(rel.max(0.0)),
                context_tokens,
                generated_tokens,
            }
        })
        .collect();
    out.sort_by_key(|r| r.arrival);
    Ok(out)
}

/// `YYYY-MM-DD HH:MM:SS.fraction` as (days since an epoch, seconds into the
/// day).
fn parse_timestamp(ts: &str) -> Option<(i64, f64)> {
    let (date, time) = ts.trim().split_once(' ')?;
    let mut d = date.split('-').map(|x| x.parse::<i64>().ok());
    let (y, m, day) = (d.next()??, d.next()??, d.next()??);
    let mut t = time.split(':');
    let (h, min, s) = (
        t.next()?.parse::<f64>().ok()?,
        t.next()?.parse::<f64>().ok()?,
        t.next()?.parse::<f64>().ok()?,
    );
    if !(1..=12).contains(&m) || !(1..=31).contains(&day) {
        return None;
    }
    // Days from a fixed epoch (civil-from-days, proleptic Gregorian).
    let (y, m) = if m <= 2 { (y - 1, m + 9) } else { (y, m - 3) };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let doy = (153 * m + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    Some((era * 146_097 + doe, h * 3600.0 + min * 60.0 + s))
}

/// How long a request holds its slot: a fixed overhead, prefill per prompt
/// token and decode per generated token.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ServiceModel {
    /// Fixed overhead per request.
    pub base: Duration,
    /// Prefill time per prompt token.
    pub per_context_token: Duration,
    /// Decode time per generated token.
    pub per_generated_token: Duration,
}

impl Default for ServiceModel {
    /// A 7B-class model on one GPU with continuous batching: 20 ms overhead,
    /// prefill at 10,000 tokens/s, decode at 50 tokens/s per sequence.
    fn default() -> Self {
        ServiceModel {
            base: Duration::from_millis(20),
            per_context_token: Duration::from_micros(100),
            per_generated_token: Duration::from_millis(20),
        }
    }
}

impl ServiceModel {
    /// The service time of `r`.
    pub fn service(&self, r: &TraceRequest) -> Duration {
        self.base
            + self.per_context_token * r.context_tokens
            + self.per_generated_token * r.generated_tokens
    }
}

/// The replicas the trace needs at its peak: the highest 60-second average
/// demand (Little's law: arrivals × service time) over `target`.
pub fn peak_replicas(trace: &[TraceRequest], model: &ServiceModel, target: f64, max: u32) -> u32 {
    let window = 60.0;
    let mut best: f64 = 0.0;
    let mut start = 0usize;
    let mut work = 0.0;
    for (i, r) in trace.iter().enumerate() {
        work += model.service(r).as_secs_f64();
        while r.arrival.as_secs_f64() - trace[start].arrival.as_secs_f64() > window {
            work -= model.service(&trace[start]).as_secs_f64();
            start += 1;
        }
        let _ = i;
        best = best.max(work / window);
    }
    ((best / target.max(1e-9)).ceil() as u32).clamp(1, max.max(1))
}

/// Whether a trace is bursty: some 10-second window holds far more
/// requests than the five minutes before it, past what Poisson noise at
/// that rate explains (at least 3× the rate before, plus five standard
/// deviations, plus ten requests). A flat trace at any rate, a slow ramp
/// and a trickle are not; a burst after quiet and a spike after
/// silence are. This is how a replayed trace is told apart for the
/// bursty goals, as generated shapes are by their parameters.
pub fn is_bursty(trace: &[TraceRequest]) -> bool {
    const WINDOW: f64 = 10.0;
    const BEFORE: usize = 30;
    let Some(last) = trace.last() else {
        return false;
    };
    let windows = (last.arrival.as_secs_f64() / WINDOW) as usize + 1;
    let mut counts = vec![0u32; windows];
    for r in trace {
        counts[(r.arrival.as_secs_f64() / WINDOW) as usize] += 1;
    }
    // A running sum of the (up to `BEFORE`) windows before each one;
    // a window is judged once a minute is known before it.
    let mut before: u64 = 0;
    for i in 0..windows {
        let seen = i.min(BEFORE);
        if seen >= 6 {
            let mean = before as f64 / seen as f64;
            if f64::from(counts[i]) >= 3.0 * mean + 5.0 * mean.sqrt() + 10.0 {
                return true;
            }
        }
        before += u64::from(counts[i]);
        if i >= BEFORE {
            before -= u64::from(counts[i - BEFORE]);
        }
    }
    false
}
