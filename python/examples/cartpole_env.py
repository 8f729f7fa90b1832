"""CartPole in numpy, and a linear softmax policy: what the example worker
and trainer share.

The dynamics are Barto, Sutton and Anderson's, with the constants and the
termination Gym's ``CartPole-v0`` uses (pole past 12 degrees, cart past
2.4, at most 200 steps); a step earns 1.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Tuple

import numpy as np

GRAVITY = 9.8
MASS_CART = 1.0
MASS_POLE = 0.1
TOTAL_MASS = MASS_CART + MASS_POLE
HALF_LENGTH = 0.5
POLE_MASS_LENGTH = MASS_POLE * HALF_LENGTH
FORCE = 10.0
TAU = 0.02
THETA_LIMIT = 12 * 2 * math.pi / 360
X_LIMIT = 2.4
MAX_STEPS = 200

OBS = 4
ACTIONS = 2


class CartPole:
    """One environment: ``reset`` then ``step`` until done."""

    def __init__(self, rng: np.random.Generator) -> None:
        self.rng = rng
        self.state = np.zeros(4)
        self.steps = 0

    def reset(self) -> np.ndarray:
        self.state = self.rng.uniform(-0.05, 0.05, size=4)
        self.steps = 0
        return self.state.copy()

    def step(self, action: int) -> Tuple[np.ndarray, float, bool]:
        x, x_dot, theta, theta_dot = self.state
        force = FORCE if action == 1 else -FORCE
        cos, sin = math.cos(theta), math.sin(theta)
        temp = (force + POLE_MASS_LENGTH * theta_dot**2 * sin) / TOTAL_MASS
        theta_acc = (GRAVITY * sin - cos * temp) / (
            HALF_LENGTH * (4.0 / 3.0 - MASS_POLE * cos**2 / TOTAL_MASS)
        )
        x_acc = temp - POLE_MASS_LENGTH * theta_acc * cos / TOTAL_MASS
        x, x_dot = x + TAU * x_dot, x_dot + TAU * x_acc
        theta, theta_dot = theta + TAU * theta_dot, theta_dot + TAU * theta_acc
        self.state = np.array([x, x_dot, theta, theta_dot])
        self.steps += 1
        done = (
            abs(x) > X_LIMIT or abs(theta) > THETA_LIMIT or self.steps >= MAX_STEPS
        )
        return self.state.copy(), 1.0, done


def init_policy(rng: np.random.Generator) -> Dict[str, np.ndarray]:
    """A linear softmax policy: ``logits = W @ obs + b``."""
    return {
        "w": (rng.standard_normal((ACTIONS, OBS)) * 0.01).astype(np.float32),
        "b": np.zeros(ACTIONS, dtype=np.float32),
    }


def probabilities(policy: Dict[str, np.ndarray], obs: np.ndarray) -> np.ndarray:
    """Action probabilities for a batch of observations ``[n, 4]``."""
    logits = obs @ policy["w"].astype(np.float64).T + policy["b"].astype(np.float64)
    logits -= logits.max(axis=-1, keepdims=True)
    e = np.exp(logits)
    return e / e.sum(axis=-1, keepdims=True)  # type: ignore[no-any-return]


def rollout(policy: Dict[str, np.ndarray], seed: int, episodes: int) -> List[Dict[str, Any]]:
    """Whole episodes on the policy: each its observations, actions and
    return."""
    rng = np.random.default_rng(seed)
    env = CartPole(rng)
    out = []
    for _ in range(episodes):
        obs, done = env.reset(), False
        observations: List[List[float]] = []
        actions: List[int] = []
        while not done:
            p = probabilities(policy, obs[None, :])[0]
            a = int(rng.random() < p[1])
            observations.append([float(v) for v in obs])
            actions.append(a)
            obs, _, done = env.step(a)
        out.append({"obs": observations, "actions": actions, "return": float(len(actions))})
    return out
