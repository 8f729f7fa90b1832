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

/// A shape of traffic.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Shape {
    /// Poisson arrivals at a steady 3 requests/s.
    Steady,
    /// On/off (a two-state Markov-modulated Poisson process): 0.5/s
    /// between bursts, 25/s in a burst; bursts last 6 s on average
    /// (shorter than a 20 s cold start), gaps 60 s.
    BurstsShort,
    /// The same process with long bursts: 0.5/s between, 10/s in a burst
    /// that lasts 150 s on average (longer than a 60 s cold start), gaps
    /// 300 s.
    BurstsLong,
    /// A day compressed into the hour: the rate follows a cosine from
    /// 0.1/s at night to 6/s at noon and back.
    Daily,
    /// Sparse spikes with long idle gaps: nothing at all between spikes,
    /// which come every 4 minutes on average; each is 20 to 120 requests
    /// within 2 s.
    Spikes,
}

impl Shape {
    /// Every shape, in the order reports list them.
    pub const ALL: [Shape; 5] = [
        Shape::Steady,
        Shape::BurstsShort,
        Shape::BurstsLong,
        Shape::Daily,
        Shape::Spikes,
    ];

    /// Its name on the command line and in reports.
    pub fn name(self) -> &'static str {
        match self {
            Shape::Steady => "steady",
            Shape::BurstsShort => "bursts-short",
            Shape::BurstsLong => "bursts-long",
            Shape::Daily => "daily",
            Shape::Spikes => "spikes",
        }
    }

    /// Whether the shape is bursty: demand jumps by more than the
    /// running replicas can absorb and falls again.
    pub fn bursty(self) -> bool {
        matches!(self, Shape::BurstsShort | Shape::BurstsLong | Shape::Spikes)
    }

    /// One hour of this shape from `seed`, sorted by arrival.
    pub fn generate(self, seed: u64) -> Vec<TraceRequest> {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let tokens = Tokens::default();
        let end = DURATION.as_secs_f64();
        let arrivals = match self {
            Shape::Steady => poisson(&mut rng, 0.0, end, 3.0),
            Shape::BurstsShort => on_off(&mut rng, end, 0.5, 25.0, 6.0, 60.0),
            Shape::BurstsLong => on_off(&mut rng, end, 0.5, 10.0, 150.0, 300.0),
            Shape::Daily => {
                let (low, high) = (0.1, 6.0);
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
            Shape::Spikes => {
                let gap = Exp::new(1.0 / 240.0).expect("positive rate");
                let mut out = Vec::new();
                let mut t = gap.sample(&mut rng);
                while t < end {
                    let n = rng.random_range(20..=120);
                    for _ in 0..n {
                        out.push(t + rng.random::<f64>() * 2.0);
                    }
                    t += 2.0 + gap.sample(&mut rng);
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
        out
    }
}

impl fmt::Display for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Shape {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Shape::ALL
            .into_iter()
            .find(|shape| shape.name() == s)
            .ok_or_else(|| {
                let names: Vec<_> = Shape::ALL.iter().map(|s| s.name()).collect();
                format!("unknown shape {s:?}; known: {}", names.join(", "))
            })
    }
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
    let gap = Exp::new(rate).expect("positive rate");
    let mut out = Vec::new();
    let mut t = from + gap.sample(rng);
    while t < to {
        out.push(t);
        t += gap.sample(rng);
    }
    out
}

/// A two-state Markov-modulated Poisson process: `low` per second in the
/// off state, `high` in the on state; the states last exponential times
/// with means `on` and `off` seconds. It starts off.
fn on_off(rng: &mut ChaCha8Rng, end: f64, low: f64, high: f64, on: f64, off: f64) -> Vec<f64> {
    let (on_len, off_len) = (
        Exp::new(1.0 / on).expect("positive mean"),
        Exp::new(1.0 / off).expect("positive mean"),
    );
    let mut out = Vec::new();
    let mut t = 0.0;
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

    #[test]
    fn each_shape_is_reproducible_and_has_its_stated_rate() {
        for shape in Shape::ALL {
            let a = shape.generate(7);
            assert_eq!(a, shape.generate(7), "{shape}");
            assert_ne!(a, shape.generate(8), "{shape}");
            assert!(a.windows(2).all(|w| w[0].arrival <= w[1].arrival));
            assert!(a.iter().all(|r| r.arrival < DURATION));
            // On/off cycles are minutes long, so an hour holds few of them:
            // average 32 seeds.
            let total: usize = (1..=32).map(|seed| shape.generate(seed).len()).sum();
            let rate = total as f64 / 32.0 / DURATION.as_secs_f64();
            // Long-run means: steady 3/s; on/off low + (high - low) × on /
            // (on + off); daily the cosine's mean; spikes 70 per 242 s.
            let expected = match shape {
                Shape::Steady => 3.0,
                Shape::BurstsShort => 0.5 + 24.5 * 6.0 / 66.0,
                Shape::BurstsLong => 0.5 + 9.5 * 150.0 / 450.0,
                Shape::Daily => 3.05,
                Shape::Spikes => 70.0 / 242.0,
            };
            assert!(
                (rate / expected - 1.0).abs() < 0.15,
                "{shape}: {rate:.2}/s, expected about {expected:.2}/s"
            );
        }
    }

    #[test]
    fn shapes_parse_by_name() {
        for shape in Shape::ALL {
            assert_eq!(shape.name().parse::<Shape>(), Ok(shape));
        }
        assert!("bursty".parse::<Shape>().unwrap_err().contains("known:"));
    }
}
