"""REINFORCE on CartPole through a warm pool, with only warmgate and numpy.

Each iteration:

1. writes the policy to the store as ``<store>/v<N>/policy.safetensors``;
2. syncs it into the pool's warm workers (``sync_weights``, in place);
3. runs the rollouts as pool tasks pinned to that version
   (``min_weights_version=N``), so every episode is on-policy, with
   ``pool.map`` keeping them all in flight;
4. takes a gradient step (reward-to-go, normalised advantages, Adam).

It stops when one iteration's episodes average the target return (150 of
the 200 a CartPole-v0 episode can earn) and prints one JSON line per
iteration, then a summary line.

    python3 cartpole_train.py --store ./checkpoints/cartpole --pool cartpole

The gateway, its admin token and a tenant key come from
``WARMGATE_GATEWAY``, ``WARMGATE_ADMIN_TOKEN`` and ``WARMGATE_API_KEY``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, Dict, List

import numpy as np

import warmgate
from cartpole_env import init_policy, probabilities
from warmgate import safetensors


def reinforce_gradient(
    policy: Dict[str, np.ndarray], episodes: List[Dict[str, Any]], gamma: float = 0.99
) -> Dict[str, np.ndarray]:
    """The policy gradient's estimate (to ascend): reward-to-go as the
    return, normalised over the batch."""
    obs: List[List[float]] = []
    actions: List[int] = []
    returns: List[float] = []
    for e in episodes:
        n = len(e["actions"])
        g = np.zeros(n)
        running = 0.0
        for t in range(n - 1, -1, -1):
            running = 1.0 + gamma * running
            g[t] = running
        obs += e["obs"]
        actions += e["actions"]
        returns += list(g)
    x = np.asarray(obs)
    adv = np.asarray(returns)
    adv = (adv - adv.mean()) / (adv.std() + 1e-8)
    p = probabilities(policy, x)
    d = (np.eye(2)[np.asarray(actions)] - p) * adv[:, None]
    return {"w": d.T @ x / len(episodes), "b": d.sum(axis=0) / len(episodes)}


class Adam:
    def __init__(self, lr: float) -> None:
        self.lr, self.t = lr, 0
        self.m: Dict[str, np.ndarray] = {}
        self.v: Dict[str, np.ndarray] = {}

    def ascend(self, params: Dict[str, np.ndarray], grads: Dict[str, np.ndarray]) -> None:
        self.t += 1
        for k, g in grads.items():
            m = self.m[k] = 0.9 * self.m.get(k, np.zeros_like(g)) + 0.1 * g
            v = self.v[k] = 0.999 * self.v.get(k, np.zeros_like(g)) + 0.001 * g * g
            step = self.lr * (m / (1 - 0.9**self.t)) / (np.sqrt(v / (1 - 0.999**self.t)) + 1e-8)
            params[k] = (params[k] + step).astype(np.float32)


def train(args: argparse.Namespace) -> Dict[str, Any]:
    rng = np.random.default_rng(args.seed)
    policy = init_policy(rng)
    adam = Adam(args.lr)
    client = warmgate.Client(args.gateway)
    pool = client.pool(args.pool)
    store = os.path.abspath(args.store)
    # Versions only go up: start past what the pool has.
    version = pool.weights_version
    curve: List[float] = []
    t0 = time.monotonic()
    for iteration in range(1, args.max_iterations + 1):
        version += 1
        folder = os.path.join(store, f"v{version}")
        safetensors.save(os.path.join(folder, "policy.safetensors"), policy)
        synced = pool.sync_weights("file://" + folder, version)
        tasks = [{"seed": int(rng.integers(1 << 31)), "episodes": args.episodes}
                 for _ in range(args.tasks)]
        episodes: List[Dict[str, Any]] = []
        for out in pool.map(tasks, concurrency=args.tasks, min_weights_version=version):
            assert out["weights_version"] >= version, out["weights_version"]
            episodes += out["episodes"]
        mean = float(np.mean([e["return"] for e in episodes]))
        curve.append(mean)
        print(json.dumps({"iteration": iteration, "version": version, "mean_return": mean,
                          "episodes": len(episodes), "synced": synced["synced"],
                          "sync_seconds": round(synced["seconds"], 3)}), flush=True)
        if mean >= args.target:
            break
        adam.ascend(policy, reinforce_gradient(policy, episodes))
    client.close()
    return {"solved": curve[-1] >= args.target, "iterations": len(curve),
            "final_mean_return": curve[-1], "target": args.target,
            "seconds": round(time.monotonic() - t0, 2), "curve": curve}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gateway", default=None, help="default: $WARMGATE_GATEWAY")
    ap.add_argument("--pool", default="cartpole")
    ap.add_argument("--store", required=True, help="a folder for the checkpoints")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--tasks", type=int, default=8, help="rollout tasks per iteration")
    ap.add_argument("--episodes", type=int, default=2, help="episodes per task")
    ap.add_argument("--target", type=float, default=150.0)
    ap.add_argument("--max-iterations", type=int, default=60)
    summary = train(ap.parse_args())
    print(json.dumps({"summary": summary}), flush=True)
    return 0 if summary["solved"] else 1


if __name__ == "__main__":
    sys.exit(main())
