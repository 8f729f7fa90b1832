#!/usr/bin/env python3
"""Trains a LoRA adapter of the tiny Llama (make_model.py) on a text, here
on the CPU, and writes it in PEFT's layout, as a training run writes the
checkpoints warmgate promotes: `adapter_config.json`,
`adapter_model.safetensors` (`base_model.model.model.layers.N.self_attn.
{q,v}_proj.lora_{A,B}.weight`), then the `_COMPLETE` marker, last.

    python tests/vllm/train_adapter.py MODEL_DIR TEXT OUT_DIR [--steps 60]

The base model's weights are frozen; each q_proj and v_proj gets
h = W x + (alpha / r) B A x, with A small and random and B zero at first,
as PEFT starts them. Run with the vLLM environment's Python (torch,
transformers, safetensors). Prints the loss before and after, per token.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("text")
    p.add_argument("out")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--seq", type=int, default=128)
    a = p.parse_args()

    import torch
    from safetensors.torch import save_file
    from transformers import AutoTokenizer, LlamaForCausalLM

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(a.model)
    model = LlamaForCausalLM.from_pretrained(a.model, torch_dtype=torch.float32)
    for prm in model.parameters():
        prm.requires_grad_(False)
    alpha = 2 * a.rank
    scale = alpha / a.rank
    lora = {}
    for i, layer in enumerate(model.model.layers):
        for name in ("q_proj", "v_proj"):
            lin = getattr(layer.self_attn, name)
            A = torch.nn.Parameter(torch.randn(a.rank, lin.in_features) / lin.in_features ** 0.5)
            B = torch.nn.Parameter(torch.zeros(lin.out_features, a.rank))
            lora[f"base_model.model.model.layers.{i}.self_attn.{name}"] = (A, B)

            def forward(x, lin=lin, A=A, B=B):
                return torch.nn.functional.linear(x, lin.weight, lin.bias) + (x @ A.T @ B.T) * scale

            lin.forward = forward
    ids = tok.encode(pathlib.Path(a.text).read_text())
    chunks = [ids[i:i + a.seq] for i in range(0, len(ids) - a.seq, a.seq)]
    batch = torch.tensor(chunks)

    def loss() -> torch.Tensor:
        return model(batch, labels=batch).loss

    params = [t for pair in lora.values() for t in pair]
    opt = torch.optim.Adam(params, lr=a.lr)
    with torch.no_grad():
        before = loss().item()
    for _ in range(a.steps):
        opt.zero_grad()
        l = loss()
        l.backward()
        opt.step()
    with torch.no_grad():
        after = loss().item()
    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for key, (A, B) in lora.items():
        tensors[f"{key}.lora_A.weight"] = A.detach().contiguous()
        tensors[f"{key}.lora_B.weight"] = B.detach().contiguous()
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "base_model_name_or_path": str(pathlib.Path(a.model).resolve()),
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": a.rank,
        "lora_alpha": alpha, "lora_dropout": 0.0, "bias": "none",
        "fan_in_fan_out": False, "target_modules": ["q_proj", "v_proj"],
    }, indent=1))
    (out / "_COMPLETE").write_text("")
    print(json.dumps({"loss_before": round(before, 4), "loss_after": round(after, 4),
                      "tokens": len(chunks) * a.seq, "steps": a.steps}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
