"""The Python RL loop (examples/cartpole_train.py) through a real gateway:
REINFORCE on CartPole, rollouts on a warm pool of Python workers, the
policy written to the store and synced into the pool every iteration. It
must reach its target return."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from conftest import EXAMPLES, SRC, toml_str, worker_env

SEED = int(os.environ.get("CARTPOLE_SEED", "1"))


def test_reinforce_through_the_gateway_solves_cartpole(make_gateway: Any) -> None:
    store = Path(tempfile.mkdtemp(prefix="warmgate-py-cartpole-"))
    command = json.dumps([sys.executable, str(EXAMPLES / "cartpole_worker.py")])
    gw = make_gateway(f"""
[weights]
allowed_prefixes = [{toml_str("file://" + str(store))}]

[[pools]]
name = "cartpole"
command = {command}
env = {worker_env()}
replicas = [2, 2]
concurrency = 4
""")
    gw.wait_pool_ready("cartpole", 2)
    env = {
        **os.environ,
        "PYTHONPATH": str(SRC),
        "WARMGATE_GATEWAY": gw.url,
        "WARMGATE_ADMIN_TOKEN": gw.admin_token,
    }
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / "cartpole_train.py"), "--store", str(store),
         "--seed", str(SEED)],
        env=env, capture_output=True, text=True, timeout=240,
    )
    lines = [json.loads(l) for l in out.stdout.splitlines() if l.startswith("{")]
    assert out.returncode == 0, f"{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    summary = lines[-1]["summary"]
    print("RL", json.dumps({k: v for k, v in summary.items() if k != "curve"}),
          "curve", [round(x) for x in summary["curve"]])
    assert summary["solved"] and summary["final_mean_return"] >= 150
    assert summary["iterations"] <= 60
    # Every iteration synced the new policy into both warm replicas in place.
    iterations = [l for l in lines if "iteration" in l]
    assert all(l["synced"] == 2 for l in iterations), iterations
    assert [l["version"] for l in iterations] == list(range(1, len(iterations) + 1))
    # It learned: the first iterations were far from the target.
    assert iterations[0]["mean_return"] < 60, iterations[0]
    assert sorted(p.name for p in store.iterdir())[:1] == ["v1"]
