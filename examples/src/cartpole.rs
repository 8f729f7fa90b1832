//! CartPole, the classic control task, and a small policy network for it.
//!
//! The dynamics are those of Barto, Sutton and Anderson (1983), "Neuronlike
//! adaptive elements that can solve difficult learning control problems",
//! with the constants and Euler integration that OpenAI Gym's
//! `CartPole-v0` uses: a pole of half-length 0.5 m and mass 0.1 kg on a
//! cart of 1 kg, pushed left or right with 10 N, stepped every 20 ms. An
//! episode ends when the pole leans past 12 degrees, the cart leaves
//! ±2.4 m, or after 200 steps; every step earns a reward of 1. A random
//! policy averages about 22; the task counts as solved at 195.

use candle_core::{D, DType, Device, Tensor};

/// Gravity, m/s².
pub const GRAVITY: f64 = 9.8;
/// Cart mass, kg.
pub const MASS_CART: f64 = 1.0;
/// Pole mass, kg.
pub const MASS_POLE: f64 = 0.1;
/// Half the pole's length, m.
pub const HALF_LENGTH: f64 = 0.5;
/// Force of a push, N.
pub const FORCE: f64 = 10.0;
/// Seconds per step.
pub const TAU: f64 = 0.02;
/// The pole falls past this angle, rad (12°).
pub const THETA_LIMIT: f64 = 12.0 * 2.0 * std::f64::consts::PI / 360.0;
/// The cart leaves the track past this position, m.
pub const X_LIMIT: f64 = 2.4;
/// Steps in a full episode (`CartPole-v0`).
pub const MAX_STEPS: u32 = 200;
/// Observation size: x, ẋ, θ, θ̇.
pub const OBS: usize = 4;
/// Actions: push left (0) or right (1).
pub const ACTIONS: usize = 2;
/// Hidden units of the policy network.
pub const HIDDEN: usize = 32;

/// The cart and pole.
#[derive(Debug, Clone, PartialEq)]
pub struct CartPole {
    /// `[x, x_dot, theta, theta_dot]`.
    pub state: [f64; 4],
    /// Steps taken in this episode.
    pub steps: u32,
}

impl CartPole {
    /// A new episode: every state variable uniform in ±0.05, as in Gym.
    pub fn reset(rng: &mut fastrand::Rng) -> Self {
        let mut u = || rng.f64() * 0.1 - 0.05;
        CartPole {
            state: [u(), u(), u(), u()],
            steps: 0,
        }
    }

    /// The observation the policy sees.
    pub fn obs(&self) -> [f32; 4] {
        self.state.map(|v| v as f32)
    }

    /// Applies `action` for one step. Returns `(reward, done)`.
    pub fn step(&mut self, action: usize) -> (f32, bool) {
        let [x, x_dot, theta, theta_dot] = self.state;
        let force = if action == 1 { FORCE } else { -FORCE };
        let (sin, cos) = theta.sin_cos();
        let total = MASS_CART + MASS_POLE;
        let pole_ml = MASS_POLE * HALF_LENGTH;
        let temp = (force + pole_ml * theta_dot * theta_dot * sin) / total;
        let theta_acc = (GRAVITY * sin - cos * temp)
            / (HALF_LENGTH * (4.0 / 3.0 - MASS_POLE * cos * cos / total));
        let x_acc = temp - pole_ml * theta_acc * cos / total;
        self.state = [
            x + TAU * x_dot,
            x_dot + TAU * x_acc,
            theta + TAU * theta_dot,
            theta_dot + TAU * theta_acc,
        ];
        self.steps += 1;
        let [x, _, theta, _] = self.state;
        let fell = x.abs() > X_LIMIT || theta.abs() > THETA_LIMIT;
        (1.0, fell || self.steps >= MAX_STEPS)
    }
}

/// The policy: observation → tanh layer of [`HIDDEN`] → action logits.
/// Its tensors are named `l1.weight` (HIDDEN×4), `l1.bias`, `l2.weight`
/// (2×HIDDEN) and `l2.bias`, as `candle_nn::Linear` and safetensors have
/// them.
#[derive(Debug, Clone)]
pub struct Policy {
    /// First layer.
    pub l1: candle_nn::Linear,
    /// Output layer.
    pub l2: candle_nn::Linear,
}

/// The tensor names, in the order [`Policy::tensors`] gives them.
pub const TENSOR_NAMES: [&str; 4] = ["l1.weight", "l1.bias", "l2.weight", "l2.bias"];

impl Policy {
    /// A policy from its four tensors.
    pub fn from_tensors(get: impl Fn(&str) -> candle_core::Result<Tensor>) -> anyhow::Result<Self> {
        let check = |name: &str, shape: &[usize]| -> anyhow::Result<Tensor> {
            let t = get(name).map_err(|e| anyhow::anyhow!("tensor {name}: {e}"))?;
            anyhow::ensure!(
                t.dims() == shape,
                "tensor {name} has shape {:?}, expected {shape:?}",
                t.dims()
            );
            Ok(t.to_dtype(DType::F32)?)
        };
        Ok(Policy {
            l1: candle_nn::Linear::new(
                check("l1.weight", &[HIDDEN, OBS])?,
                Some(check("l1.bias", &[HIDDEN])?),
            ),
            l2: candle_nn::Linear::new(
                check("l2.weight", &[ACTIONS, HIDDEN])?,
                Some(check("l2.bias", &[ACTIONS])?),
            ),
        })
    }

    /// A policy read from safetensors bytes.
    pub fn from_safetensors(bytes: &[u8]) -> anyhow::Result<Self> {
        let map = candle_core::safetensors::load_buffer(bytes, &Device::Cpu)?;
        Policy::from_tensors(|name| {
            map.get(name)
                .cloned()
                .ok_or_else(|| candle_core::Error::Msg(format!("missing tensor {name}")))
        })
    }

    /// A fresh policy: uniform in ±1/√fan_in, like PyTorch's default, drawn
    /// from `seed` so a run can be repeated exactly.
    pub fn init(seed: u64) -> anyhow::Result<Self> {
        let mut rng = fastrand::Rng::with_seed(seed);
        let mut uniform = |n: usize, fan_in: usize| -> Vec<f32> {
            let bound = 1.0 / (fan_in as f32).sqrt();
            (0..n).map(|_| (rng.f32() * 2.0 - 1.0) * bound).collect()
        };
        let dev = Device::Cpu;
        let w1 = Tensor::from_vec(uniform(HIDDEN * OBS, OBS), (HIDDEN, OBS), &dev)?;
        let b1 = Tensor::from_vec(uniform(HIDDEN, OBS), HIDDEN, &dev)?;
        let w2 = Tensor::from_vec(uniform(ACTIONS * HIDDEN, HIDDEN), (ACTIONS, HIDDEN), &dev)?;
        let b2 = Tensor::from_vec(uniform(ACTIONS, HIDDEN), ACTIONS, &dev)?;
        Ok(Policy {
            l1: candle_nn::Linear::new(w1, Some(b1)),
            l2: candle_nn::Linear::new(w2, Some(b2)),
        })
    }

    /// The four tensors, named as in [`TENSOR_NAMES`].
    pub fn tensors(&self) -> Vec<(&'static str, Tensor)> {
        let bias = |l: &candle_nn::Linear| l.bias().cloned().expect("layers have biases");
        vec![
            ("l1.weight", self.l1.weight().clone()),
            ("l1.bias", bias(&self.l1)),
            ("l2.weight", self.l2.weight().clone()),
            ("l2.bias", bias(&self.l2)),
        ]
    }

    /// Action logits for a batch of observations (N×4 → N×2).
    pub fn logits(&self, obs: &Tensor) -> candle_core::Result<Tensor> {
        use candle_core::Module as _;
        self.l2.forward(&self.l1.forward(obs)?.tanh()?)
    }

    /// Log-probabilities of the actions (N×4 → N×2).
    pub fn log_probs(&self, obs: &Tensor) -> candle_core::Result<Tensor> {
        candle_nn::ops::log_softmax(&self.logits(obs)?, D::Minus1)
    }
}

/// One finished episode.
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize, PartialEq)]
pub struct Episode {
    /// The observation before each step.
    pub obs: Vec<[f32; 4]>,
    /// The action taken at each step.
    pub actions: Vec<u8>,
    /// Sum of rewards (the number of steps).
    pub ret: f32,
}

/// Runs `n` episodes side by side, sampling actions from `policy` (or
/// uniformly when there is none), with every random draw from `seed`.
pub fn rollout(policy: Option<&Policy>, seed: u64, n: usize) -> anyhow::Result<Vec<Episode>> {
    let mut rng = fastrand::Rng::with_seed(seed);
    let mut envs: Vec<CartPole> = (0..n).map(|_| CartPole::reset(&mut rng)).collect();
    let mut episodes = vec![Episode::default(); n];
    let mut live: Vec<usize> = (0..n).collect();
    while !live.is_empty() {
        let obs: Vec<[f32; 4]> = live.iter().map(|&i| envs[i].obs()).collect();
        let probs: Vec<Vec<f32>> = match policy {
            Some(p) => {
                let flat: Vec<f32> = obs.iter().flatten().copied().collect();
                let t = Tensor::from_vec(flat, (obs.len(), OBS), &Device::Cpu)?;
                p.log_probs(&t)?.exp()?.to_vec2()?
            }
            None => vec![vec![0.5, 0.5]; obs.len()],
        };
        let mut still = Vec::with_capacity(live.len());
        for (k, &i) in live.iter().enumerate() {
            let action = usize::from(rng.f32() >= probs[k][0]);
            let ep = &mut episodes[i];
            ep.obs.push(obs[k]);
            ep.actions.push(action as u8);
            let (reward, done) = envs[i].step(action);
            ep.ret += reward;
            if !done {
                still.push(i);
            }
        }
        live = still;
    }
    Ok(episodes)
}

/// REINFORCE (Williams, 1992) with reward-to-go and a normalised
/// advantage, optimised with Adam: the policy-gradient learner of the
/// example trainer.
pub struct Learner {
    vars: crate::train::Vars,
    opt: candle_nn::AdamW,
    /// Discount of future rewards.
    pub gamma: f32,
}

impl Learner {
    /// A learner that starts from `policy`.
    pub fn new(policy: &Policy, lr: f64, gamma: f32) -> anyhow::Result<Self> {
        let (vars, opt) = crate::train::adam(policy.tensors(), lr)?;
        Ok(Learner { vars, opt, gamma })
    }

    /// The policy as it stands.
    pub fn policy(&self) -> anyhow::Result<Policy> {
        Policy::from_tensors(|name| self.vars.get(name, false))
    }

    /// One gradient step on a batch of episodes sampled from the current
    /// policy. Returns the loss.
    pub fn update(&mut self, episodes: &[Episode]) -> anyhow::Result<f32> {
        use candle_nn::Optimizer as _;
        let mut obs = Vec::new();
        let mut actions = Vec::new();
        let mut adv = Vec::new();
        for ep in episodes {
            let mut g = 0.0f32;
            let mut rtg = vec![0.0f32; ep.actions.len()];
            for t in (0..ep.actions.len()).rev() {
                g = 1.0 + self.gamma * g;
                rtg[t] = g;
            }
            adv.extend(rtg);
            obs.extend(ep.obs.iter().flatten().copied());
            actions.extend(ep.actions.iter().map(|&a| u32::from(a)));
        }
        let n = actions.len();
        anyhow::ensure!(n > 0, "no steps to learn from");
        let mean = adv.iter().sum::<f32>() / n as f32;
        let var = adv.iter().map(|a| (a - mean).powi(2)).sum::<f32>() / n as f32;
        let std = var.sqrt().max(1e-6);
        let adv: Vec<f32> = adv.iter().map(|a| (a - mean) / std).collect();
        let dev = Device::Cpu;
        let obs = Tensor::from_vec(obs, (n, OBS), &dev)?;
        let actions = Tensor::from_vec(actions, (n, 1), &dev)?;
        let adv = Tensor::from_vec(adv, n, &dev)?;
        let policy = Policy::from_tensors(|name| self.vars.get(name, true))?;
        let logp = policy.log_probs(&obs)?.gather(&actions, 1)?.squeeze(1)?;
        let loss = (logp * adv)?.mean_all()?.neg()?;
        self.opt.backward_step(&loss)?;
        Ok(loss.to_scalar::<f32>()?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One step computed by hand from the published equations (Florian,
    /// "Correct equations for the dynamics of the cart-pole system", 2007,
    /// with friction zero), for a state off the upright.
    #[test]
    fn a_step_follows_the_published_equations() {
        let mut env = CartPole {
            state: [0.1, -0.2, 0.05, 0.3],
            steps: 0,
        };
        env.step(1);
        let (theta, theta_dot) = (0.05f64, 0.3f64);
        let m = MASS_CART + MASS_POLE;
        let f = 10.0;
        let num = GRAVITY * theta.sin()
            + theta.cos() * ((-f - MASS_POLE * HALF_LENGTH * theta_dot.powi(2) * theta.sin()) / m);
        let den = HALF_LENGTH * (4.0 / 3.0 - MASS_POLE * theta.cos().powi(2) / m);
        let theta_acc = num / den;
        let x_acc = (f + MASS_POLE
            * HALF_LENGTH
            * (theta_dot.powi(2) * theta.sin() - theta_acc * theta.cos()))
            / m;
        let want = [
            0.1 + TAU * -0.2,
            -0.2 + TAU * x_acc,
            0.05 + TAU * 0.3,
            0.3 + TAU * theta_acc,
        ];
        for (got, want) in env.state.iter().zip(want) {
            assert!((got - want).abs() < 1e-12, "{:?} vs {want:?}", env.state);
        }
        // Pushing right accelerates the cart right and tips the pole left.
        assert!(x_acc > 0.0 && theta_acc < 0.0);
    }

    #[test]
    fn the_dynamics_are_mirror_symmetric() {
        let s = [0.3, 0.1, -0.04, 0.2];
        let mut a = CartPole { state: s, steps: 0 };
        let mut b = CartPole {
            state: s.map(|v| -v),
            steps: 0,
        };
        for step in 0..20 {
            a.step(step % 2);
            b.step(1 - step % 2);
            for (x, y) in a.state.iter().zip(b.state) {
                assert!((x + y).abs() < 1e-12);
            }
        }
    }

    #[test]
    fn episodes_end_at_the_limits_and_at_200_steps() {
        let mut env = CartPole {
            state: [0.0, 0.0, THETA_LIMIT - 1e-4, 1.0],
            steps: 0,
        };
        assert!(env.step(1).1, "the pole fell past 12 degrees");
        let mut env = CartPole {
            state: [X_LIMIT - 1e-4, 1.0, 0.0, 0.0],
            steps: 0,
        };
        assert!(env.step(1).1, "the cart left the track");
        let mut env = CartPole {
            state: [0.0; 4],
            steps: MAX_STEPS - 1,
        };
        assert!(env.step(0).1, "time limit");
        // Upright and still, one push does not end it.
        let mut env = CartPole {
            state: [0.0; 4],
            steps: 0,
        };
        assert_eq!(env.step(0), (1.0, false));
    }

    #[test]
    fn a_random_policy_scores_about_22_and_rollouts_repeat_by_seed() {
        let eps = rollout(None, 7, 500).expect("rollout");
        let mean = eps.iter().map(|e| e.ret).sum::<f32>() / eps.len() as f32;
        assert!((17.0..28.0).contains(&mean), "mean return {mean}");
        let policy = Policy::init(3).expect("init");
        let a = rollout(Some(&policy), 11, 8).expect("a");
        let b = rollout(Some(&policy), 11, 8).expect("b");
        assert_eq!(a, b);
        for e in &a {
            assert_eq!(e.obs.len(), e.actions.len());
            assert_eq!(e.ret as usize, e.actions.len());
        }
    }

    #[test]
    fn a_policy_round_trips_through_safetensors() {
        let p = Policy::init(5).expect("init");
        let dir = tempfile_dir();
        let path = dir.join("p.safetensors");
        let map: std::collections::HashMap<String, Tensor> = p
            .tensors()
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect();
        candle_core::safetensors::save(&map, &path).expect("save");
        let q = Policy::from_safetensors(&std::fs::read(&path).expect("read")).expect("load");
        let obs =
            Tensor::from_vec(vec![0.1f32, 0.2, -0.1, 0.3], (1, 4), &Device::Cpu).expect("obs");
        let a: Vec<Vec<f32>> = p.logits(&obs).expect("a").to_vec2().expect("v");
        let b: Vec<Vec<f32>> = q.logits(&obs).expect("b").to_vec2().expect("v");
        assert_eq!(a, b);
        assert!(Policy::from_safetensors(b"not safetensors").is_err());
        let _ = std::fs::remove_dir_all(dir);
    }

    fn tempfile_dir() -> std::path::PathBuf {
        let d = std::env::temp_dir().join(format!("cartpole-test-{}", std::process::id()));
        std::fs::create_dir_all(&d).expect("mkdir");
        d
    }
}
