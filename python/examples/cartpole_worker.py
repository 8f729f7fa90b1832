"""A warm-pool worker for the CartPole example, on ``warmgate.worker``.

It keeps the environment's code and the policy in memory between tasks.
``POST /invoke {"seed", "episodes"}`` plays that many episodes with the
policy it holds and answers ``{"episodes": [{"obs", "actions", "return"}],
"weights_version"}``. New policies arrive in place through ``POST
/weights`` (the gateway's weight sync), as ``policy.safetensors`` with the
tensors ``w`` and ``b``.

    [[pools]]
    name = "cartpole"
    command = ["python3", "examples/cartpole_worker.py"]
    replicas = [2, 2]
"""

from __future__ import annotations

from typing import Any, Dict

import numpy as np

from cartpole_env import ACTIONS, OBS, init_policy, rollout
from warmgate.worker import Tensor, Worker


class CartPoleWorker(Worker):
    def __init__(self) -> None:
        super().__init__()
        # Before the first sync: a policy of zeros (uniformly random).
        self.model = {k: np.zeros_like(v) for k, v in init_policy(np.random.default_rng(0)).items()}

    def load(self, tensors: Dict[str, Tensor], version: int) -> Any:
        w, b = tensors["w"].data, tensors["b"].data
        if np.shape(w) != (ACTIONS, OBS) or np.shape(b) != (ACTIONS,):
            raise ValueError(f"expected w {ACTIONS}x{OBS} and b {ACTIONS}, got {np.shape(w)}, {np.shape(b)}")
        return {"w": np.asarray(w, dtype=np.float32), "b": np.asarray(b, dtype=np.float32)}

    def invoke(self, payload: Any) -> Any:
        with self._swap:  # the policy and its version, read together
            policy, version = self.model, self.weights_version
        episodes = rollout(policy, int(payload["seed"]), int(payload.get("episodes", 1)))
        return {"episodes": episodes, "weights_version": version}


if __name__ == "__main__":
    CartPoleWorker().serve()
