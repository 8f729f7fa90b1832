#!/usr/bin/env python3
"""A promotion gate that evaluates an adapter by its loss: the mean
negative log-likelihood per token of a text, read through the gateway
from the engine's own `prompt_logprobs`, for the revision being promoted
(`$WARMGATE_EVAL_MODEL`) and for the base model. It passes (exit 0) when
the adapter's loss is the lower.

    gate_loss.py BASE_MODEL TEXT [--tokens 256]

warmgate runs it as `[apps.promotion] gate_command`, with
`WARMGATE_EVAL_OPENAI_BASE` (the gateway's `/v1`) and `WARMGATE_EVAL_MODEL`
(`name@revision`). Standard library only.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.request


def loss(base_url: str, model: str, text: str, tokens: int) -> float:
    body = {"model": model, "prompt": text, "max_tokens": 1, "temperature": 0,
            "prompt_logprobs": 0, "return_token_ids": True, "truncate_prompt_tokens": tokens}
    req = urllib.request.Request(f"{base_url}/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    # A 5xx is the engine's failure, not the adapter's verdict: two more
    # tries (the gateway takes a failed engine out of rotation meanwhile).
    for attempt in range(3):
        try:
            with urllib.request.urlopen(req, timeout=300) as r:
                choice = json.loads(r.read())["choices"][0]
            break
        except urllib.error.HTTPError as e:
            if e.code < 500 or attempt == 2:
                raise
            time.sleep(5)
    ids, per = choice["prompt_token_ids"], choice["prompt_logprobs"]
    nll = [-per[i][str(t)]["logprob"] for i, t in enumerate(ids) if i and per[i]]
    return sum(nll) / len(nll)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("base")
    p.add_argument("text")
    p.add_argument("--tokens", type=int, default=256)
    a = p.parse_args()
    url = os.environ["WARMGATE_EVAL_OPENAI_BASE"].rstrip("/")
    model = os.environ["WARMGATE_EVAL_MODEL"]
    text = open(a.text).read()
    base, adapter = loss(url, a.base, text, a.tokens), loss(url, model, text, a.tokens)
    print(json.dumps({"model": model, "loss": round(adapter, 4), "base_loss": round(base, 4)}))
    if adapter < base:
        return 0
    # The verdict's reason, where the promotion's `reason` shows it.
    print(f"{model}'s loss {adapter:.4f} is not below the base's {base:.4f}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
