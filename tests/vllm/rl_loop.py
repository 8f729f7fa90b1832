#!/usr/bin/env python3
"""A policy-gradient loop on real vLLM through warmgate: rollouts from a
pool of stock vLLM engines, a REINFORCE step on the same tiny model here,
and the new weights synced into the running engines in place
(`POST /v1/pools/{pool}/weights`, the pool's `weight_sync = "vllm"`).

    python tests/vllm/rl_loop.py GATEWAY_URL MODEL_DIR WORK_DIR
        [--pool policy] [--app policy-chat] [--steps 6]

Run with the vLLM environment's Python (tests/vllm/install.sh): it has
torch and transformers. `WARMGATE_ADMIN_TOKEN` authorises the syncs.

The task is one a random tiny model can learn in a few steps and a test
can check: the reward of a completion is the share of its tokens whose id
is in the lower half of the vocabulary. A random policy scores about 0.5;
each step samples completions from the engines (temperature 1), weighs
each one's log-probability under the policy here by its reward less the
batch's mean, takes one Adam step, writes the weights as a checkpoint
folder, and syncs it into the engines. One JSON line per step: the batch's
mean reward (of the policy that generated it), the sync's seconds, the
replicas and the versions they report.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time
import urllib.request


def call(url: str, body: dict | None = None, token: str | None = None, timeout: float = 600):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="GET" if body is None else "POST")
    req.add_header("content-type", "application/json")
    if token:
        req.add_header("authorization", f"Bearer {token}")
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("gateway")
    p.add_argument("model")
    p.add_argument("work")
    p.add_argument("--pool", default="policy")
    p.add_argument("--app", default="policy-chat")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-2)
    a = p.parse_args()
    token = os.environ.get("WARMGATE_ADMIN_TOKEN")

    import torch
    from concurrent.futures import ThreadPoolExecutor
    from transformers import AutoTokenizer, LlamaForCausalLM

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(a.model)
    policy = LlamaForCausalLM.from_pretrained(a.model, torch_dtype=torch.float32)
    policy.train()
    opt = torch.optim.Adam(policy.parameters(), lr=a.lr)
    half = len(tok) // 2
    words = "the pool the gateway a replica weights the engine serves".split()
    prompts = [tok.encode(" ".join(words[i % len(words):] + words[: i % len(words)]))
               for i in range(a.prompts)]

    def rollout(ids: list[int], n: int = a.samples) -> list[list[int]]:
        body = {"model": a.app, "prompt": ids, "max_tokens": a.tokens, "n": n,
                "temperature": 1.0, "ignore_eos": True, "return_token_ids": True}
        out = call(f"{a.gateway}/v1/completions", body)
        return [c["token_ids"] for c in out["choices"]]

    work = pathlib.Path(a.work)
    for step in range(1, a.steps + 1):
        with ThreadPoolExecutor(max_workers=len(prompts)) as ex:
            batches = list(ex.map(rollout, prompts))
        samples = [(pi, g) for pi, gs in enumerate(batches) for g in gs]
        rewards = torch.tensor([sum(t < half for t in g) / len(g) for _, g in samples])
        mean = rewards.mean().item()
        adv = rewards - rewards.mean()
        opt.zero_grad()
        loss = torch.tensor(0.0)
        for (pi, g), adv_i in zip(samples, adv):
            ids = torch.tensor([prompts[pi] + g])
            logits = policy(ids).logits[0, len(prompts[pi]) - 1:-1]
            logp = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(g)[:, None]).sum()
            loss = loss - adv_i * logp / len(samples)
        loss.backward()
        opt.step()
        folder = work / f"step-{step}"
        policy.to(torch.bfloat16).save_pretrained(folder, safe_serialization=True)
        policy.to(torch.float32)
        t0 = time.monotonic()
        synced = call(f"{a.gateway}/v1/pools/{a.pool}/weights",
                      {"checkpoint": f"file://{folder}", "version": step}, token)
        seconds = time.monotonic() - t0
        print(json.dumps({
            "step": step, "reward": round(mean, 4), "samples": len(samples),
            "sync_seconds": round(seconds, 3),
            "replicas": [{"replica": r["replica"], "version": r.get("version"),
                          "seconds": r.get("seconds"), "ok": r.get("ok")}
                         for r in synced.get("replicas", [])],
        }), flush=True)
    # The policy after the last step, as the engines now serve it, on
    # twice the samples of a step.
    with ThreadPoolExecutor(max_workers=len(prompts)) as ex:
        batches = list(ex.map(lambda ids: rollout(ids, 2 * a.samples), prompts))
    final = [sum(t < half for t in g) / len(g) for gs in batches for g in gs]
    print(json.dumps({"step": a.steps + 1, "reward": round(sum(final) / len(final), 4),
                      "samples": len(final)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
