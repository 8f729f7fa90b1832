#!/usr/bin/env python3
"""Makes a tiny Llama-architecture model that real vLLM loads, on the spot:
nothing is downloaded but packages. Its byte-level BPE tokenizer is trained
here on text the repository ships (its own docs), it has a chat template,
and its weights are random (seeded) unless trained later.

    python tests/vllm/make_model.py OUT_DIR [--hidden 256] [--layers 4]

Run with the vLLM environment's Python (tests/vllm/install.sh), which has
torch, transformers and tokenizers. A folder that already holds the model
made with the same settings is left as it is.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
SPECIAL = ["<s>", "</s>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>"]


def corpus() -> list[str]:
    """The repository's own prose: its docs and READMEs."""
    files = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
    return [f.read_text(encoding="utf-8") for f in files]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    out = pathlib.Path(a.out)
    stamp = {k: getattr(a, k) for k in ("hidden", "layers", "heads", "vocab", "seed")}
    done = out / "warmgate-model.json"
    if done.exists() and json.loads(done.read_text()) == stamp:
        print(f"the model is in {out}")
        return 0

    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=a.vocab,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        additional_special_tokens=SPECIAL[3:],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)

    torch.manual_seed(a.seed)
    config = LlamaConfig(
        vocab_size=len(fast),
        hidden_size=a.hidden,
        intermediate_size=a.hidden * 8 // 3 // 32 * 32,
        num_hidden_layers=a.layers,
        num_attention_heads=a.heads,
        num_key_value_heads=a.heads,
        max_position_embeddings=4096,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    done.write_text(json.dumps(stamp))
    n = sum(p.numel() for p in model.parameters())
    print(f"made a {n / 1e6:.1f} M parameter Llama with a {len(fast)}-token tokenizer in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
