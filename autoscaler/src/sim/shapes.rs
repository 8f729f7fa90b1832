//! Traffic of stated shapes, generated from a seed, so the policy is
//! measured on more than the one trace it was tuned on.
//!
//! Every shape lasts [`DURATION`] and draws each request's tokens from the
//! same [`Tokens`] model; only the arrival process differs. The same seed
//! gives the same requests on every machine (ChaCha8).

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, Exp, LogNormal};

use super::TraceRequest;

/// How long each generated trace runs: one hour, as the Azure traces do.
pub const DURATION: Duration = Duration::from_secs(3600);

/// A shape of traffic: an arrival process with its parameters. The five
/// named shapes ([`Shape::PRESETS`]) are the sweep's; any other is written
/// `FAMILY:KEY=VALUE:…` on the command line (see [`Shape::from_str`]), and
/// [`Shape::random`] draws one of any family, so a policy can be measured
/// on shapes nobody chose for it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Shape {
    /// Poisson arrivals at `rate` per second.
    Poisson {
        /// Requests per second.
        rate: f64,
    },
    /// On/off (a two-state Markov-modulated Poisson process): `low` per
    /// second between bursts, `high` in a burst; bursts last `on` seconds
    /// on average and the gaps `off` (both exponential). It starts off.
    OnOff {
        /// Requests per second between bursts.
        low: f64,
        /// Requests per second in a burst.
        high: f64,
        /// Mean burst length, seconds.
        on: f64,
        /// Mean gap between bursts, seconds.
        off: f64,
    },
    /// A day compressed into the hour: the rate follows a cosine from
    /// `low` at night to `high` at noon and back.
    Daily {
        /// Requests per second at night.
        low: f64,
        /// Requests per second at noon.
        high: f64,
    },
    /// Sparse spikes with idle gaps: nothing between spikes, which come
    /// every `every` seconds on average (exponential gaps); each is `min`
    /// to `max` requests (uniform) within `within` seconds.
    Spikes {
        /// Mean time between spikes, seconds.
        every: f64,
        /// Fewest requests in a spike.
        min: u32,
        /// Most requests in a spike.
        max: u32,
        /// How long a spike's arrivals are spread over, seconds.
        within: f64,
    },
    /// Busy periods between idle gaps, as a service used in working
    /// sessions: a busy period lasts `busy` seconds on average
    /// (exponential) and runs at `rate` per second, with bursts of
    /// `burst` per second lasting `burst_len` seconds on average, about
    /// `burst_every` seconds apart (an on/off process); between busy
    /// periods nothing at all arrives for `idle_min` to `idle_max`
    /// seconds (uniform). It starts busy.
    Sessions {
        /// Requests per second in a busy period, between bursts.
        rate: f64,
        /// Requests per second in a burst.
        burst: f64,
        /// Mean burst length, seconds.
        burst_len: f64,
        /// Mean time between bursts in a busy period, seconds.
        burst_every: f64,
        /// Mean busy period, seconds.
        busy: f64,
        /// Shortest idle gap, seconds.
        idle_min: f64,
        /// Longest idle gap, seconds.
        idle_max: f64,
    },
}

/// The highest rate a generated shape may ask for: an hour of it is a
/// few million requests, which the simulator replays in seconds.
pub const MAX_RATE: f64 = 200.0;
/// The most requests one spike may hold.
pub const MAX_SPIKE: u32 = 100_000;

impl Shape {
    /// Poisson arrivals at a steady 3 requests/s.
    pub const STEADY: Shape = Shape::Poisson { rate: 3.0 };
    /// 0.5/s between bursts, 25/s in a burst; bursts last 6 s on average
    /// (shorter than a 20 s cold start), gaps 60 s.
    pub const BURSTS_SHORT: Shape = Shape::OnOff {
        low: 0.5,
        high: 25.0,
        on: 6.0,
        off: 60.0,
    };
    /// 0.5/s between, 10/s in a burst that lasts 150 s on average (longer
    /// than a 60 s cold start), gaps 300 s.
    pub const BURSTS_LONG: Shape = Shape::OnOff {
        low: 0.5,
        high: 10.0,
        on: 150.0,
        off: 300.0,
    };
    /// A cosine from 0.1/s at night to 6/s at noon and back.
    pub const DAILY: Shape = Shape::Daily {
        low: 0.1,
        high: 6.0,
    };
    /// A spike every 4 minutes on average, each 20 to 120 requests within
    /// 2 s, and nothing at all between them.
    pub const SPIKES: Shape = Shape::Spikes {
        every: 240.0,
        min: 20,
        max: 120,
        within: 2.0,
    };

    /// Busy periods of three minutes on average at 2.5 requests/s, with
    /// bursts of 30/s lasting 3 s about every 45 s, between idle gaps of 1
    /// to 4 minutes: a service between its users' working sessions.
    pub const BUSY_IDLE: Shape = Shape::Sessions {
        rate: 2.5,
        burst: 30.0,
        burst_len: 3.0,
        burst_every: 45.0,
        busy: 180.0,
        idle_min: 60.0,
        idle_max: 240.0,
    };

    /// The named shapes, in the order reports list them.
    pub const PRESETS: [(&'static str, Shape); 6] = [
        ("steady", Shape::STEADY),
        ("bursts-short", Shape::BURSTS_SHORT),
        ("bursts-long", Shape::BURSTS_LONG),
        ("daily", Shape::DAILY),
        ("spikes", Shape::SPIKES),
        ("busy-idle", Shape::BUSY_IDLE),
    ];

    /// The named shapes alone.
    pub fn presets() -> impl Iterator<Item = Shape> {
        Self::PRESETS.into_iter().map(|(_, s)| s)
    }

    /// Its name in reports: a preset's name, or the shape written out as
    /// it is given on the command line.
    pub fn name(&self) -> String {
        match Self::PRESETS.iter().find(|(_, s)| s == self) {
            Some((name, _)) => (*name).to_string(),
            None => self.to_string(),
        }
    }

    /// Whether the shape is bursty: demand jumps well past its rate
    /// before and falls again (on/off with a burst at least three times
    /// the rate between, and every spike train).
    pub fn bursty(&self) -> bool {
        match *self {
            Shape::Poisson { .. } | Shape::Daily { .. } => false,
            Shape::OnOff { low, high, .. } => high >= 3.0 * low && high > 0.0,
            Shape::Spikes { .. } | Shape::Sessions { .. } => true,
        }
    }

    /// The long-run mean rate, requests per second.
    pub fn mean_rate(&self) -> f64 {
        match *self {
            Shape::Poisson { rate } => rate,
            Shape::OnOff { low, high, on, off } => low + (high - low) * on / (on + off),
            Shape::Daily { low, high } => (low + high) / 2.0,
            Shape::Spikes {
                every,
                min,
                max,
                within,
            } => (f64::from(min) + f64::from(max)) / 2.0 / (every + within),
            Shape::Sessions {
                rate,
                burst,
                burst_len,
                burst_every,
                busy,
                idle_min,
                idle_max,
            } => {
                let in_busy = rate + (burst - rate) * burst_len / (burst_len + burst_every);
                in_busy * busy / (busy + (idle_min + idle_max) / 2.0)
            }
        }
    }

    /// Checks the parameters: finite, rates in `[0, MAX_RATE]`, lengths
    /// above zero, `min <= max`.
    pub fn validate(&self) -> Result<(), String> {
        let rate = |name: &str, v: f64| {
            if v.is_finite() && (0.0..=MAX_RATE).contains(&v) {
                Ok(())
            } else {
                Err(format!(
                    "{name} must be a rate from 0 to {MAX_RATE} requests/s, got {v}"
                ))
            }
        };
        let length = |name: &str, v: f64, least: f64| {
            if v.is_finite() && v >= least && v <= DURATION.as_secs_f64() * 24.0 {
                Ok(())
            } else {
                Err(format!(
                    "{name} must be a length of at least {least} s, got {v}"
                ))
            }
        };
        match *self {
            Shape::Poisson { rate: r } => rate("rate", r),
            Shape::OnOff { low, high, on, off } => {
                rate("low", low)?;
                rate("high", high)?;
                length("on", on, 0.1)?;
                length("off", off, 0.1)
            }
            Shape::Daily { low, high } => {
                rate("low", low)?;
                rate("high", high)?;
                if low > high {
                    return Err(format!("low ({low}) must not exceed high ({high})"));
                }
                Ok(())
            }
            Shape::Spikes {
                every,
                min,
                max,
                within,
            } => {
                length("every", every, 1.0)?;
                length("within", within, 0.0)?;
                if min > max || max > MAX_SPIKE {
                    return Err(format!(
                        "a spike must be min <= max <= {MAX_SPIKE} requests, got {min} to {max}"
                    ));
                }
                Ok(())
            }
            Shape::Sessions {
                rate: r,
                burst,
                burst_len,
                burst_every,
                busy,
                idle_min,
                idle_max,
            } => {
                rate("rate", r)?;
                rate("burst", burst)?;
                length("burst_len", burst_len, 0.1)?;
                length("burst_every", burst_every, 0.1)?;
                length("busy", busy, 1.0)?;
                length("idle_min", idle_min, 0.0)?;
                length("idle_max", idle_max, 0.0)?;
                if idle_min > idle_max {
                    return Err(format!(
                        "idle_min ({idle_min}) must not exceed idle_max ({idle_max})"
                    ));
                }
                Ok(())
            }
        }
    }

    /// A shape of any family with parameters drawn from `rng`, spread over
    /// what LLM services see: rates from a few an hour to tens a second,
    /// bursts from a second to minutes, gaps from seconds to a quarter
    /// hour (log-uniform, so each order of magnitude is as likely).
    pub fn random(rng: &mut impl Rng) -> Shape {
        fn log_uniform(rng: &mut impl Rng, lo: f64, hi: f64) -> f64 {
            (lo.ln() + rng.random::<f64>() * (hi / lo).ln()).exp()
        }
        match rng.random_range(0..5u32) {
            0 => Shape::Poisson {
                rate: round(log_uniform(rng, 0.05, 20.0)),
            },
            1 => {
                // A quarter of them silent between bursts.
                let low = if rng.random::<f64>() < 0.25 {
                    0.0
                } else {
                    round(log_uniform(rng, 0.02, 3.0))
                };
                Shape::OnOff {
                    low,
                    high: round(low + log_uniform(rng, 2.0, 50.0)),
                    on: round(log_uniform(rng, 1.0, 300.0)),
                    off: round(log_uniform(rng, 5.0, 900.0)),
                }
            }
            2 => {
                let low = round(log_uniform(rng, 0.01, 1.0));
                Shape::Daily {
                    low,
                    high: round(low + log_uniform(rng, 1.0, 15.0)),
                }
            }
            3 => {
                let rate = round(log_uniform(rng, 0.2, 5.0));
                let idle_min = round(log_uniform(rng, 20.0, 300.0));
                Shape::Sessions {
                    rate,
                    burst: round(rate + log_uniform(rng, 5.0, 50.0)),
                    burst_len: round(log_uniform(rng, 1.0, 10.0)),
                    burst_every: round(log_uniform(rng, 10.0, 300.0)),
                    busy: round(log_uniform(rng, 60.0, 900.0)),
                    idle_min,
                    idle_max: round(idle_min * log_uniform(rng, 1.0, 4.0)),
                }
            }
            _ => {
                let min = log_uniform(rng, 5.0, 150.0).round() as u32;
                Shape::Spikes {
                    every: round(log_uniform(rng, 20.0, 900.0)),
                    min,
                    max: (f64::from(min) * log_uniform(rng, 1.0, 4.0)).round() as u32,
                    within: round(log_uniform(rng, 0.5, 10.0)),
                }
            }
        }
    }

    /// `n` shapes of random parameters from `seed` ([`Shape::random`]):
    /// the same on every machine, and the first `k` of `n + 1` are the
    /// `k` of `n`.
    pub fn random_many(seed: u64, n: usize) -> Vec<Shape> {
        // A stream of its own, apart from the arrivals' (`generate`).
        let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x5ba9_e5ee_d5a9);
        (0..n).map(|_| Shape::random(&mut rng)).collect()
    }

    /// One hour of this shape from `seed`, sorted by arrival, from the
    /// first request on.
    pub fn generate(&self, seed: u64) -> Vec<TraceRequest> {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let tokens = Tokens::default();
        let end = DURATION.as_secs_f64();
        let arrivals = match *self {
            Shape::Poisson { rate } => poisson(&mut rng, 0.0, end, rate),
            Shape::OnOff { low, high, on, off } => {
                on_off(&mut rng, 0.0, end, (low, high), (on, off))
            }
            Shape::Daily { low, high } => {
                let rate = |t: f64| {
                    low + (high - low) * (1.0 - (2.0 * std::f64::consts::PI * t / end).cos()) / 2.0
                };
                // Thinning: candidates at the peak rate, kept with
                // probability rate(t) / peak.
                poisson(&mut rng, 0.0, end, high)
                    .into_iter()
                    .filter(|&t| rng.random::<f64>() < rate(t) / high)
                    .collect()
            }
            Shape::Spikes {
                every,
                min,
                max,
                within,
            } => {
                let gap = Exp::new(1.0 / every).expect("a positive mean");
                let mut out = Vec::new();
                let mut t = gap.sample(&mut rng);
                while t < end {
                    let n = rng.random_range(min..=max);
                    for _ in 0..n {
                        out.push(t + rng.random::<f64>() * within);
                    }
                    t += within + gap.sample(&mut rng);
                }
                out
            }
            Shape::Sessions {
                rate,
                burst,
                burst_len,
                burst_every,
                busy,
                idle_min,
                idle_max,
            } => {
                let length = Exp::new(1.0 / busy).expect("a positive mean");
                let mut out = Vec::new();
                let mut t = 0.0;
                while t < end {
                    let until = (t + length.sample(&mut rng)).min(end);
                    out.extend(on_off(
                        &mut rng,
                        t,
                        until,
                        (rate, burst),
                        (burst_len, burst_every),
                    ));
                    t = until + rng.random_range(idle_min..=idle_max);
                }
                out
            }
        };
        let mut out: Vec<TraceRequest> = arrivals
            .into_iter()
            .filter(|&t| t < end)
            .map(|t| tokens.request(&mut rng, t))
            .collect();
        out.sort_by_key(|r| r.arrival);
        // Time since the first request, as a replayed trace has it: no
        // policy sees anything before it.
        if let Some(first) = out.first().map(|r| r.arrival) {
            for r in &mut out {
                r.arrival -= first;
            }
        }
        out
    }
}

/// Two significant decimals, so a drawn shape reads back as written.
fn round(v: f64) -> f64 {
    if v >= 10.0 {
        (v * 10.0).round() / 10.0
    } else {
        (v * 100.0).round() / 100.0
    }
}

impl fmt::Display for Shape {
    /// The shape as the command line takes it: `on-off:low=0.5:high=25:on=6:off=60`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Shape::Poisson { rate } => write!(f, "poisson:rate={rate}"),
            Shape::OnOff { low, high, on, off } => {
                write!(f, "on-off:low={low}:high={high}:on={on}:off={off}")
            }
            Shape::Daily { low, high } => write!(f, "daily:low={low}:high={high}"),
            Shape::Spikes {
                every,
                min,
                max,
                within,
            } => write!(
                f,
                "spikes:every={every}:min={min}:max={max}:within={within}"
            ),
            Shape::Sessions {
                rate,
                burst,
                burst_len,
                burst_every,
                busy,
                idle_min,
                idle_max,
            } => write!(
                f,
                "sessions:rate={rate}:burst={burst}:burst_len={burst_len}:burst_every={burst_every}:busy={busy}:idle_min={idle_min}:idle_max={idle_max}"
            ),
        }
    }
}

impl FromStr for Shape {
    type Err = String;
    /// A preset's name (`steady`, `bursts-short`, `bursts-long`, `daily`,
    /// `spikes`, `busy-idle`), or a family with parameters, `:`-separated,
    /// each left out taking the family's preset value: `poisson:rate=R`,
    /// `on-off:low=R:high=R:on=S:off=S`, `daily:low=R:high=R`,
    /// `spikes:every=S:min=N:max=N:within=S`,
    /// `sessions:rate=R:burst=R:burst_len=S:burst_every=S:busy=S:idle_min=S:idle_max=S`.
    /// Rates are per second;
    /// lengths are seconds, or with a unit (`90s`, `5m`).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let s = s.trim();
        if let Some((_, shape)) = Self::PRESETS.iter().find(|(name, _)| *name == s) {
            return Ok(*shape);
        }
        let mut parts = s.split(':');
        let family = parts.next().unwrap_or_default();
        let mut shape = match family {
            "poisson" => Shape::STEADY,
            "on-off" => Shape::BURSTS_SHORT,
            "daily" => Shape::DAILY,
            "spikes" => Shape::SPIKES,
            "sessions" => Shape::BUSY_IDLE,
            _ => {
                let names: Vec<_> = Self::PRESETS.iter().map(|(n, _)| *n).collect();
                return Err(format!(
                    "unknown shape {s:?}; known: {}, or poisson:…, on-off:…, daily:…, spikes:…, sessions:… with parameters",
                    names.join(", ")
                ));
            }
        };
        for part in parts {
            let (key, value) = part
                .split_once('=')
                .ok_or_else(|| format!("{s:?}: expected KEY=VALUE, got {part:?}"))?;
            let bad = || format!("{s:?}: {key}={value:?} is not a number");
            let number = || value.trim().parse::<f64>().map_err(|_| bad());
            let seconds = || parse_seconds(value).ok_or_else(bad);
            let count = || value.trim().parse::<u32>().map_err(|_| bad());
            match (&mut shape, key.trim()) {
                (Shape::Poisson { rate }, "rate") => *rate = number()?,
                (Shape::OnOff { low, .. } | Shape::Daily { low, .. }, "low") => *low = number()?,
                (Shape::OnOff { high, .. } | Shape::Daily { high, .. }, "high") => {
                    *high = number()?
                }
                (Shape::OnOff { on, .. }, "on") => *on = seconds()?,
                (Shape::OnOff { off, .. }, "off") => *off = seconds()?,
                (Shape::Spikes { every, .. }, "every") => *every = seconds()?,
                (Shape::Spikes { within, .. }, "within") => *within = seconds()?,
                (Shape::Spikes { min, .. }, "min") => *min = count()?,
                (Shape::Spikes { max, .. }, "max") => *max = count()?,
                (Shape::Sessions { rate, .. }, "rate") => *rate = number()?,
                (Shape::Sessions { burst, .. }, "burst") => *burst = number()?,
                (Shape::Sessions { burst_len, .. }, "burst_len") => *burst_len = seconds()?,
                (Shape::Sessions { burst_every, .. }, "burst_every") => *burst_every = seconds()?,
                (Shape::Sessions { busy, .. }, "busy") => *busy = seconds()?,
                (Shape::Sessions { idle_min, .. }, "idle_min") => *idle_min = seconds()?,
                (Shape::Sessions { idle_max, .. }, "idle_max") => *idle_max = seconds()?,
                (_, key) => return Err(format!("{s:?}: {family} has no parameter {key:?}")),
            }
        }
        shape.validate().map_err(|e| format!("{s:?}: {e}"))?;
        Ok(shape)
    }
}

/// Seconds, bare or with a unit: `6`, `6s`, `1.5m`, `1h`.
fn parse_seconds(v: &str) -> Option<f64> {
    let v = v.trim();
    let (number, scale) = if let Some(n) = v.strip_suffix("ms") {
        (n, 0.001)
    } else if let Some(n) = v.strip_suffix('s') {
        (n, 1.0)
    } else if let Some(n) = v.strip_suffix('m') {
        (n, 60.0)
    } else if let Some(n) = v.strip_suffix('h') {
        (n, 3600.0)
    } else {
        (v, 1.0)
    };
    number.trim().parse::<f64>().ok().map(|n| n * scale)
}

/// Tokens per generated request: log-normal prompt and output lengths.
/// The defaults give a mean service time of about 2.8 s with the default
/// [`super::ServiceModel`] (median prompt 1,024 tokens, median output 64,
/// a long tail of long answers), between the Azure code and conversation
/// traces.
#[derive(Debug, Clone, Copy)]
pub struct Tokens {
    /// Prompt tokens: median and the log-normal sigma.
    pub context: (f64, f64),
    /// Generated tokens: median and the log-normal sigma.
    pub generated: (f64, f64),
}

impl Default for Tokens {
    fn default() -> Self {
        Tokens {
            context: (1024.0, 1.0),
            generated: (64.0, 1.2),
        }
    }
}

impl Tokens {
    fn request(&self, rng: &mut ChaCha8Rng, at: f64) -> TraceRequest {
        let draw = |rng: &mut ChaCha8Rng, (median, sigma): (f64, f64), cap: f64| {
            let d = LogNormal::new(median.ln(), sigma).expect("finite parameters");
            d.sample(rng).clamp(1.0, cap).round() as u32
        };
        TraceRequest {
            arrival: Duration::from_secs_f64(at.max(0.0)),
            context_tokens: draw(rng, self.context, 32_768.0),
            generated_tokens: draw(rng, self.generated, 4_096.0),
        }
    }
}

/// Poisson arrival times at `rate` per second in `[from, to)`.
fn poisson(rng: &mut ChaCha8Rng, from: f64, to: f64, rate: f64) -> Vec<f64> {
    if rate <= 0.0 {
        return Vec::new();
    }
    let gap = Exp::new(rate).expect("positive rate");
    let mut out = Vec::new();
    let mut t = from + gap.sample(rng);
    while t < to {
        out.push(t);
        t += gap.sample(rng);
    }
    out
}

/// A two-state Markov-modulated Poisson process in `[from, end)`: `low`
/// per second in the off state, `high` in the on state; the states last
/// exponential times with means `on` and `off` seconds. It starts off.
fn on_off(
    rng: &mut ChaCha8Rng,
    from: f64,
    end: f64,
    (low, high): (f64, f64),
    (on, off): (f64, f64),
) -> Vec<f64> {
    let (on_len, off_len) = (
        Exp::new(1.0 / on).expect("positive mean"),
        Exp::new(1.0 / off).expect("positive mean"),
    );
    let mut out = Vec::new();
    let mut t = from;
    let mut bursting = false;
    while t < end {
        let (len, rate) = if bursting {
            (on_len.sample(rng), high)
        } else {
            (off_len.sample(rng), low)
        };
        let until = (t + len).min(end);
        out.extend(poisson(rng, t, until, rate));
        t = until;
        bursting = !bursting;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The mean rate of `shape` over 32 seeds (on/off cycles are minutes
    /// long, so an hour holds few of them).
    fn measured_rate(shape: &Shape) -> f64 {
        let total: usize = (1..=32).map(|seed| shape.generate(seed).len()).sum();
        total as f64 / 32.0 / DURATION.as_secs_f64()
    }

    #[test]
    fn each_preset_is_reproducible_and_has_its_stated_rate() {
        for (name, shape) in Shape::PRESETS {
            let a = shape.generate(7);
            assert_eq!(a, shape.generate(7), "{name}");
            assert_ne!(a, shape.generate(8), "{name}");
            assert!(a.windows(2).all(|w| w[0].arrival <= w[1].arrival));
            assert!(a.iter().all(|r| r.arrival < DURATION));
            // Long-run means, worked out by hand: steady 3/s; on/off
            // low + (high - low) × on / (on + off); daily the cosine's
            // mean; spikes 70 per 242 s; busy-idle 2.5 + 27.5 × 3 / 48
            // per second for 180 s of every 330.
            let expected = match name {
                "steady" => 3.0,
                "bursts-short" => 0.5 + 24.5 * 6.0 / 66.0,
                "bursts-long" => 0.5 + 9.5 * 150.0 / 450.0,
                "daily" => 3.05,
                "spikes" => 70.0 / 242.0,
                "busy-idle" => (2.5 + 27.5 * 3.0 / 48.0) * 180.0 / 330.0,
                other => panic!("no expected rate for {other}"),
            };
            assert!((shape.mean_rate() / expected - 1.0).abs() < 1e-9, "{name}");
            let rate = measured_rate(&shape);
            assert!(
                (rate / expected - 1.0).abs() < 0.15,
                "{name}: {rate:.2}/s, expected about {expected:.2}/s"
            );
        }
    }

    #[test]
    fn random_shapes_are_valid_read_back_as_written_and_have_their_mean_rate() {
        let mut rng = ChaCha8Rng::seed_from_u64(11);
        let mut families = std::collections::HashSet::new();
        for _ in 0..24 {
            let shape = Shape::random(&mut rng);
            families.insert(std::mem::discriminant(&shape));
            shape.validate().unwrap();
            assert_eq!(shape.to_string().parse::<Shape>(), Ok(shape));
            let expected = shape.mean_rate();
            // Rare events (a spike every quarter hour, bursts minutes
            // apart) vary a lot between hours: check only the ones an
            // hour holds many of.
            if expected > 0.5 {
                let rate = measured_rate(&shape);
                assert!(
                    (rate / expected - 1.0).abs() < 0.3,
                    "{shape}: {rate:.2}/s, expected about {expected:.2}/s"
                );
            }
        }
        assert_eq!(families.len(), 5, "every family is drawn");
    }

    #[test]
    fn shapes_parse_by_name_or_by_family_with_parameters() {
        for (name, shape) in Shape::PRESETS {
            assert_eq!(name.parse::<Shape>(), Ok(shape));
            assert_eq!(shape.name(), name);
        }
        assert_eq!(
            "on-off:high=60:on=90s:off=5m".parse::<Shape>(),
            Ok(Shape::OnOff {
                low: 0.5,
                high: 60.0,
                on: 90.0,
                off: 300.0
            })
        );
        assert_eq!(
            "poisson:rate=0.2".parse::<Shape>().unwrap().name(),
            "poisson:rate=0.2"
        );
        assert_eq!(
            "spikes:min=5:max=5:within=0".parse::<Shape>(),
            Ok(Shape::Spikes {
                every: 240.0,
                min: 5,
                max: 5,
                within: 0.0
            })
        );
        assert!("bursty".parse::<Shape>().unwrap_err().contains("known:"));
        for (bad, says) in [
            ("poisson:rate=-1", "rate"),
            ("poisson:rate=1e9", "rate"),
            ("poisson:rate=NaN", "rate"),
            ("poisson:rat=1", "no parameter"),
            ("on-off:on=0", "on must"),
            ("on-off:high", "KEY=VALUE"),
            ("daily:low=5:high=1", "must not exceed"),
            ("spikes:min=9:max=3", "min <= max"),
            ("spikes:max=1000000", "min <= max"),
            ("spikes:min=x", "not a number"),
            ("sessions:idle_min=5m:idle_max=1m", "must not exceed"),
            ("sessions:busy=0", "busy must"),
        ] {
            let e = bad.parse::<Shape>().unwrap_err();
            assert!(e.contains(says), "{bad}: {e}");
        }
    }

    #[test]
    fn a_rate_of_zero_generates_nothing_and_ends() {
        assert!(
            "poisson:rate=0"
                .parse::<Shape>()
                .unwrap()
                .generate(1)
                .is_empty()
        );
        let silent_gaps = "on-off:low=0:high=5".parse::<Shape>().unwrap();
        assert!(!silent_gaps.generate(1).is_empty());
        assert!(silent_gaps.bursty());
    }
}
