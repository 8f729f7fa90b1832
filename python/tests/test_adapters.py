"""The worker kit's runtime LoRA routes, driven by the real gateway: an
app of kit workers with one adapter slot each loads the adapter a request
names before forwarding it, and unloads the idle one to make room."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import pytest

from conftest import Gateway, toml_str, worker_command, worker_env


def folder(root: Path, name: str) -> Path:
    d = root / name
    d.mkdir()
    (d / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 8}')
    return d


@pytest.fixture(scope="module")
def gw(tmp_path_factory: Any) -> Iterator[Gateway]:
    root = tmp_path_factory.mktemp("adapters")
    a, b = folder(root, "a"), folder(root, "b")
    config = f"""
[[apps]]
name = "base"
command = {worker_command("adapter_worker.py")}
env = {worker_env()}
[apps.autoscale]
min = 1
max = 1
[apps.adapters]
max_loaded = 1
[[apps.adapters.models]]
name = "lora-a"
checkpoint = {toml_str("file://" + str(a))}
[[apps.adapters.models]]
name = "lora-b"
checkpoint = {toml_str("file://" + str(b))}
"""
    g = Gateway(config)
    try:
        g.wait_app_ready("base", 1)
        yield g
    finally:
        g.stop()


def chat(gw: Gateway, model: str) -> Any:
    req = urllib.request.Request(
        gw.url + "/v1/chat/completions",
        data=json.dumps({"model": model, "messages": []}).encode(),
        headers={"content-type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def test_the_kit_loads_the_adapter_a_request_names_and_unloads_the_idle_one(gw: Gateway) -> None:
    assert chat(gw, "lora-a") == {"model": "lora-a", "loaded": ["lora-a"]}
    assert chat(gw, "lora-a") == {"model": "lora-a", "loaded": ["lora-a"]}
    # One slot: lora-a, idle, makes room for lora-b.
    assert chat(gw, "lora-b") == {"model": "lora-b", "loaded": ["lora-b"]}
    assert chat(gw, "base") == {"model": "base", "loaded": ["lora-b"]}
    with pytest.raises(urllib.error.HTTPError) as e:
        chat(gw, "lora-c")
    assert e.value.code == 404
