//! A tiny character-level language model, and the corpus it learns.
//!
//! The model reads the last [`CONTEXT`] characters, embeds each, and passes
//! them through one tanh layer to the next character's logits (Bengio et
//! al.'s 2003 neural probabilistic language model, on characters). It is
//! small enough to train on two CPU cores in seconds, and its loss falls
//! visibly from epoch to epoch, which is what the training-to-serving
//! example needs.
//!
//! The corpus is generated here, from a small grammar with word lists
//! written for this project, so nothing is downloaded.

use candle_core::{D, DType, Device, Tensor};

/// Characters of context.
pub const CONTEXT: usize = 8;
/// Embedding width per character.
pub const EMBED: usize = 16;
/// Hidden units.
pub const HIDDEN: usize = 128;
/// The alphabet: lower-case letters, space, and a few marks. Index 0 is
/// the padding before the start of a text.
pub const ALPHABET: &str = "\u{0}abcdefghijklmnopqrstuvwxyz .,\n";

/// The vocabulary size.
pub fn vocab() -> usize {
    ALPHABET.chars().count()
}

/// A character's index (unknown characters map to a space).
pub fn encode(c: char) -> u32 {
    let c = c.to_ascii_lowercase();
    ALPHABET
        .chars()
        .position(|a| a == c)
        .or_else(|| ALPHABET.chars().position(|a| a == ' '))
        .unwrap_or(0) as u32
}

/// The character at `i`.
pub fn decode(i: u32) -> char {
    ALPHABET.chars().nth(i as usize).unwrap_or(' ')
}

/// The corpus's sentence subjects.
pub const SUBJECTS: [&str; 8] = [
    "the cat",
    "a dog",
    "the old man",
    "my sister",
    "the farmer",
    "a small bird",
    "the teacher",
    "our neighbour",
];
/// Its verbs.
pub const VERBS: [&str; 8] = [
    "sees", "likes", "finds", "carries", "paints", "follows", "feeds", "watches",
];
/// Its objects.
pub const OBJECTS: [&str; 8] = [
    "the red ball",
    "a green apple",
    "the river",
    "a quiet house",
    "the morning sun",
    "a wooden boat",
    "the tall tree",
    "a warm loaf of bread",
];
/// The phrases that may end a sentence.
pub const ENDS: [&str; 6] = [
    "every day",
    "in the garden",
    "near the road",
    "before dinner",
    "at night",
    "with great care",
];

/// Every word the corpus uses.
pub fn words() -> std::collections::BTreeSet<&'static str> {
    SUBJECTS
        .iter()
        .chain(&VERBS)
        .chain(&OBJECTS)
        .chain(&ENDS)
        .flat_map(|p| p.split(' '))
        .collect()
}

/// A deterministic corpus of simple English sentences about `n` lines
/// long.
pub fn corpus(seed: u64, n: usize) -> String {
    let mut rng = fastrand::Rng::with_seed(seed);
    let mut out = String::new();
    for _ in 0..n {
        out.push_str(SUBJECTS[rng.usize(..SUBJECTS.len())]);
        out.push(' ');
        out.push_str(VERBS[rng.usize(..VERBS.len())]);
        out.push(' ');
        out.push_str(OBJECTS[rng.usize(..OBJECTS.len())]);
        if rng.bool() {
            out.push(' ');
            out.push_str(ENDS[rng.usize(..ENDS.len())]);
        }
        out.push_str(".\n");
    }
    out
}

/// The model's tensors, named as safetensors stores them.
pub const TENSOR_NAMES: [&str; 5] = ["embed", "w1", "b1", "w2", "b2"];

/// The model.
#[derive(Debug, Clone)]
pub struct CharLm {
    embed: Tensor,
    w1: Tensor,
    b1: Tensor,
    w2: Tensor,
    b2: Tensor,
}

impl CharLm {
    /// A fresh model, drawn from `seed`.
    pub fn init(seed: u64) -> candle_core::Result<Self> {
        let mut rng = fastrand::Rng::with_seed(seed);
        let v = vocab();
        let mut uniform = |n: usize, bound: f32| -> Vec<f32> {
            (0..n).map(|_| (rng.f32() * 2.0 - 1.0) * bound).collect()
        };
        let dev = Device::Cpu;
        let fan1 = (CONTEXT * EMBED) as f32;
        Ok(CharLm {
            embed: Tensor::from_vec(uniform(v * EMBED, 1.0), (v, EMBED), &dev)?,
            w1: Tensor::from_vec(
                uniform(CONTEXT * EMBED * HIDDEN, 1.0 / fan1.sqrt()),
                (CONTEXT * EMBED, HIDDEN),
                &dev,
            )?,
            b1: Tensor::zeros(HIDDEN, DType::F32, &dev)?,
            w2: Tensor::from_vec(
                uniform(HIDDEN * v, 1.0 / (HIDDEN as f32).sqrt()),
                (HIDDEN, v),
                &dev,
            )?,
            b2: Tensor::zeros(v, DType::F32, &dev)?,
        })
    }

    /// A model from its named tensors.
    pub fn from_tensors(
        get: impl Fn(&str) -> candle_core::Result<Tensor>,
    ) -> candle_core::Result<Self> {
        Ok(CharLm {
            embed: get("embed")?,
            w1: get("w1")?,
            b1: get("b1")?,
            w2: get("w2")?,
            b2: get("b2")?,
        })
    }

    /// A model from safetensors bytes.
    pub fn from_safetensors(bytes: &[u8]) -> anyhow::Result<Self> {
        let map = candle_core::safetensors::load_buffer(bytes, &Device::Cpu)?;
        let m = CharLm::from_tensors(|n| {
            map.get(n)
                .cloned()
                .ok_or_else(|| candle_core::Error::Msg(format!("missing tensor {n}")))
        })?;
        anyhow::ensure!(
            m.embed.dims() == [vocab(), EMBED] && m.w2.dims() == [HIDDEN, vocab()],
            "the tensors do not fit this model (vocabulary {})",
            vocab()
        );
        Ok(m)
    }

    /// The tensors, named.
    pub fn tensors(&self) -> Vec<(&'static str, Tensor)> {
        vec![
            ("embed", self.embed.clone()),
            ("w1", self.w1.clone()),
            ("b1", self.b1.clone()),
            ("w2", self.w2.clone()),
            ("b2", self.b2.clone()),
        ]
    }

    /// Next-character logits for a batch of contexts (N×CONTEXT indices).
    pub fn logits(&self, ctx: &Tensor) -> candle_core::Result<Tensor> {
        let n = ctx.dim(0)?;
        let emb = self
            .embed
            .index_select(&ctx.flatten_all()?, 0)?
            .reshape((n, CONTEXT * EMBED))?;
        let h = emb.matmul(&self.w1)?.broadcast_add(&self.b1)?.tanh()?;
        h.matmul(&self.w2)?.broadcast_add(&self.b2)
    }

    /// Continues `prompt` by `n` characters, sampling at `temperature`
    /// (0: the most likely character each time) from `seed`.
    pub fn complete(
        &self,
        prompt: &str,
        n: usize,
        temperature: f32,
        seed: u64,
    ) -> anyhow::Result<String> {
        let mut rng = fastrand::Rng::with_seed(seed);
        let mut ids: Vec<u32> = vec![0; CONTEXT];
        ids.extend(prompt.chars().map(encode));
        let mut out = String::new();
        for _ in 0..n {
            let ctx = Tensor::from_vec(
                ids[ids.len() - CONTEXT..].to_vec(),
                (1, CONTEXT),
                &Device::Cpu,
            )?;
            let logits: Vec<f32> = self.logits(&ctx)?.squeeze(0)?.to_vec1()?;
            let next = sample(&logits, temperature, &mut rng);
            ids.push(next);
            out.push(decode(next));
        }
        Ok(out)
    }
}

/// Draws an index from `logits` at `temperature`.
fn sample(logits: &[f32], temperature: f32, rng: &mut fastrand::Rng) -> u32 {
    // Never the padding character.
    let best = logits
        .iter()
        .enumerate()
        .skip(1)
        .max_by(|a, b| a.1.total_cmp(b.1))
        .map_or(1, |(i, _)| i as u32);
    if temperature <= 0.0 {
        return best;
    }
    let max = logits.iter().copied().fold(f32::MIN, f32::max);
    let weights: Vec<f32> = logits
        .iter()
        .enumerate()
        .map(|(i, l)| {
            if i == 0 {
                0.0
            } else {
                ((l - max) / temperature).exp()
            }
        })
        .collect();
    let total: f32 = weights.iter().sum();
    let mut draw = rng.f32() * total;
    for (i, w) in weights.iter().enumerate() {
        draw -= w;
        if draw <= 0.0 {
            return i as u32;
        }
    }
    best
}

/// Training: minibatches of (context, next character) from a text, and
/// Adam steps on the cross-entropy.
pub struct Trainer {
    vars: crate::train::Vars,
    opt: candle_nn::AdamW,
    data: Vec<u32>,
    rng: fastrand::Rng,
}

impl Trainer {
    /// A trainer of `model` on `text`.
    pub fn new(model: &CharLm, text: &str, lr: f64, seed: u64) -> anyhow::Result<Self> {
        let (vars, opt) = crate::train::adam(model.tensors(), lr)?;
        let mut data = vec![0u32; CONTEXT];
        data.extend(text.chars().map(encode));
        anyhow::ensure!(data.len() > CONTEXT + 1, "the text is too short");
        Ok(Trainer {
            vars,
            opt,
            data,
            rng: fastrand::Rng::with_seed(seed),
        })
    }

    /// The model as it stands.
    pub fn model(&self) -> candle_core::Result<CharLm> {
        CharLm::from_tensors(|n| self.vars.get(n, false))
    }

    /// One step on `batch` random positions; returns the loss.
    pub fn step(&mut self, batch: usize) -> anyhow::Result<f32> {
        use candle_nn::Optimizer as _;
        let (ctx, next) = self.batch(batch)?;
        let model = CharLm::from_tensors(|n| self.vars.get(n, true))?;
        let loss = candle_nn::loss::cross_entropy(&model.logits(&ctx)?, &next)?;
        self.opt.backward_step(&loss)?;
        Ok(loss.to_scalar::<f32>()?)
    }

    /// The mean loss over `n` fixed positions (the same each call, so
    /// epochs compare).
    pub fn eval(&self, n: usize) -> anyhow::Result<f32> {
        let mut rng = fastrand::Rng::with_seed(0xe7a1);
        let (ctx, next) = self.sample_with(&mut rng, n)?;
        let model = self.model()?;
        let logp = candle_nn::ops::log_softmax(&model.logits(&ctx)?, D::Minus1)?;
        let picked = logp.gather(&next.unsqueeze(1)?, 1)?;
        Ok(picked.mean_all()?.neg()?.to_scalar::<f32>()?)
    }

    fn batch(&mut self, n: usize) -> anyhow::Result<(Tensor, Tensor)> {
        let mut rng = std::mem::replace(&mut self.rng, fastrand::Rng::with_seed(0));
        let out = self.sample_with(&mut rng, n);
        self.rng = rng;
        out
    }

    fn sample_with(&self, rng: &mut fastrand::Rng, n: usize) -> anyhow::Result<(Tensor, Tensor)> {
        let mut ctx = Vec::with_capacity(n * CONTEXT);
        let mut next = Vec::with_capacity(n);
        for _ in 0..n {
            let i = rng.usize(CONTEXT..self.data.len());
            ctx.extend_from_slice(&self.data[i - CONTEXT..i]);
            next.push(self.data[i]);
        }
        Ok((
            Tensor::from_vec(ctx, (n, CONTEXT), &Device::Cpu)?,
            Tensor::from_vec(next, n, &Device::Cpu)?,
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_alphabet_round_trips() {
        for c in "the cat sees a boat.\n".chars() {
            assert_eq!(decode(encode(c)), c);
        }
        assert_eq!(decode(encode('Q')), 'q');
        assert_eq!(decode(encode('!')), ' ');
    }

    #[test]
    fn the_loss_falls_and_the_model_round_trips() {
        let text = corpus(1, 400);
        let mut t = Trainer::new(&CharLm::init(2).expect("init"), &text, 0.01, 3).expect("t");
        let before = t.eval(512).expect("eval");
        for _ in 0..60 {
            t.step(64).expect("step");
        }
        let after = t.eval(512).expect("eval");
        assert!(after < before - 0.5, "{before} -> {after}");
        let m = t.model().expect("model");
        let dir = std::env::temp_dir().join(format!("charlm-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("mkdir");
        let path = dir.join("m.safetensors");
        let map: std::collections::HashMap<String, Tensor> = m
            .tensors()
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect();
        candle_core::safetensors::save(&map, &path).expect("save");
        let back = CharLm::from_safetensors(&std::fs::read(&path).expect("read")).expect("load");
        assert_eq!(
            m.complete("the ", 20, 0.0, 1).expect("a"),
            back.complete("the ", 20, 0.0, 1).expect("b")
        );
        let _ = std::fs::remove_dir_all(dir);
    }
}
