//! Fine-tuning the tiny character-level LM by reinforcement, GRPO style
//! (Shao et al., 2024): sample a group of completions per prompt, score
//! each with a reward, and push up the log-probability of the completions
//! that scored above their group's mean (and down those below), weighted
//! by the group-normalised advantage. No value network, no reference
//! model: the group is the baseline.
//!
//! The reward is simple and dense: alliteration in the language the model
//! knows. It is the share of the completion's whole words that are words
//! of the corpus *and* begin with `s` (`sees`, `sister`, `small`, `sun`);
//! made-up words count against it, so the policy cannot win by babbling
//! `s`s. The corpus uses such words rarely, so the reward starts low and
//! can only rise by the policy changing what it says.

use candle_core::{D, Device, Tensor};

use crate::charlm::{CONTEXT, CharLm, encode};

/// The reward of one completion: among its whole words (a last word cut
/// off by the length limit does not count), the share that are corpus
/// words beginning with `s`; 0 with no whole word.
pub fn reward(completion: &str) -> f32 {
    let mut words: Vec<&str> = completion
        .split(|c: char| !c.is_ascii_alphabetic())
        .collect();
    // The piece after the last separator is whole only if the text ends
    // there; `split` leaves an empty piece when it does.
    words.pop();
    words.retain(|w| !w.is_empty());
    if words.is_empty() {
        return 0.0;
    }
    let known = crate::charlm::words();
    let alliterating = words
        .iter()
        .filter(|w| w.starts_with('s') && known.contains(*w))
        .count();
    alliterating as f32 / words.len() as f32
}

/// Group-normalised advantages: each reward minus the group's mean, over
/// the group's standard deviation (all zero when the group agrees).
pub fn advantages(rewards: &[f32]) -> Vec<f32> {
    let n = rewards.len().max(1) as f32;
    let mean = rewards.iter().sum::<f32>() / n;
    let var = rewards.iter().map(|r| (r - mean).powi(2)).sum::<f32>() / n;
    let std = var.sqrt();
    if std < 1e-6 {
        return vec![0.0; rewards.len()];
    }
    rewards.iter().map(|r| (r - mean) / std).collect()
}

/// One prompt's sampled completions and their rewards.
#[derive(Debug, Clone)]
pub struct Group {
    /// The prompt the completions continue.
    pub prompt: String,
    /// The completions, sampled at temperature 1 from the policy.
    pub completions: Vec<String>,
    /// Their rewards, in the same order.
    pub rewards: Vec<f32>,
}

/// The learner: the policy's trainable tensors and Adam over them.
pub struct Grpo {
    vars: crate::train::Vars,
    opt: candle_nn::AdamW,
}

impl Grpo {
    /// A learner starting from `model`.
    pub fn new(model: &CharLm, lr: f64) -> anyhow::Result<Self> {
        let (vars, opt) = crate::train::adam(model.tensors(), lr)?;
        Ok(Grpo { vars, opt })
    }

    /// The policy as it stands.
    pub fn model(&self) -> candle_core::Result<CharLm> {
        CharLm::from_tensors(|n| self.vars.get(n, false))
    }

    /// One policy-gradient step on `groups`: the loss is minus the mean,
    /// over completions, of the advantage times the completion's mean
    /// per-character log-probability. Returns false when no group had a
    /// spread of rewards (nothing to learn from).
    pub fn step(&mut self, groups: &[Group]) -> anyhow::Result<bool> {
        use candle_nn::Optimizer as _;
        let total: usize = groups.iter().map(|g| g.completions.len()).sum();
        let (mut ctx, mut next, mut weight) = (Vec::new(), Vec::new(), Vec::new());
        for g in groups {
            anyhow::ensure!(
                g.completions.len() == g.rewards.len(),
                "a group has {} completions and {} rewards",
                g.completions.len(),
                g.rewards.len()
            );
            for (text, adv) in g.completions.iter().zip(advantages(&g.rewards)) {
                let len = text.chars().count();
                if adv == 0.0 || len == 0 {
                    continue;
                }
                let mut ids: Vec<u32> = vec![0; CONTEXT];
                ids.extend(g.prompt.chars().map(encode));
                for c in text.chars() {
                    ctx.extend_from_slice(&ids[ids.len() - CONTEXT..]);
                    let id = encode(c);
                    next.push(id);
                    weight.push(adv / (len * total) as f32);
                    ids.push(id);
                }
            }
        }
        if next.is_empty() {
            return Ok(false);
        }
        let n = next.len();
        let dev = Device::Cpu;
        let ctx = Tensor::from_vec(ctx, (n, CONTEXT), &dev)?;
        let next = Tensor::from_vec(next, (n, 1), &dev)?;
        let weight = Tensor::from_vec(weight, (n, 1), &dev)?;
        let model = CharLm::from_tensors(|name| self.vars.get(name, true))?;
        let logp = candle_nn::ops::log_softmax(&model.logits(&ctx)?, D::Minus1)?;
        let picked = logp.gather(&next, 1)?;
        let loss = picked.mul(&weight)?.sum_all()?.neg()?;
        self.opt.backward_step(&loss)?;
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_reward_counts_words_that_begin_with_s() {
        // `sees` and `sun` are corpus words; `she` is not; `sis` is cut off.
        assert_eq!(reward("she sees the sun. sis"), 0.5);
        assert_eq!(reward("  ., "), 0.0);
        assert_eq!(reward("sees"), 0.0, "no whole word");
        assert_eq!(reward("sssss ssss "), 0.0, "babble earns nothing");
        assert_eq!(reward("my sister sees the morning sun."), 0.5);
        assert_eq!(advantages(&[1.0, 1.0]), vec![0.0, 0.0]);
        let a = advantages(&[0.0, 1.0]);
        assert!(a[0] < 0.0 && a[1] > 0.0 && (a[0] + a[1]).abs() < 1e-6);
    }

    /// Steps on fixed samples make the rewarded completion more likely
    /// and the other less, which is all a policy-gradient step promises.
    #[test]
    fn a_step_moves_probability_toward_the_rewarded_completion() {
        let model = CharLm::init(3).expect("init");
        let logp = |m: &CharLm, text: &str| -> f32 {
            let mut ids: Vec<u32> = vec![0; CONTEXT];
            ids.extend("the cat ".chars().map(encode));
            let mut sum = 0.0;
            for c in text.chars() {
                let ctx = Tensor::from_vec(
                    ids[ids.len() - CONTEXT..].to_vec(),
                    (1, CONTEXT),
                    &Device::Cpu,
                )
                .expect("ctx");
                let lp: Vec<f32> =
                    candle_nn::ops::log_softmax(&m.logits(&ctx).expect("logits"), D::Minus1)
                        .expect("lsm")
                        .squeeze(0)
                        .expect("squeeze")
                        .to_vec1()
                        .expect("vec");
                sum += lp[encode(c) as usize];
                ids.push(encode(c));
            }
            sum
        };
        let (good, bad) = ("sees the sun ", "finds a boat ");
        let (g0, b0) = (logp(&model, good), logp(&model, bad));
        let mut learner = Grpo::new(&model, 0.01).expect("learner");
        let group = Group {
            prompt: "the cat ".into(),
            completions: vec![good.into(), bad.into()],
            rewards: vec![reward(good), reward(bad)],
        };
        for _ in 0..5 {
            assert!(learner.step(std::slice::from_ref(&group)).expect("step"));
        }
        let after = learner.model().expect("model");
        assert!(
            logp(&after, good) > g0,
            "the rewarded completion got likelier"
        );
        assert!(logp(&after, bad) < b0, "the other got less likely");
        // A group that agrees teaches nothing.
        let flat = Group {
            rewards: vec![0.5, 0.5],
            ..group
        };
        assert!(!learner.step(&[flat]).expect("step"));
    }
}
