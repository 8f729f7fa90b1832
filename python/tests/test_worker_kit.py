"""The worker kit on its own, as the gateway starts it: on the Unix socket
it is offered, and sending its weights token to the gateway that started
it and nowhere else."""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, Tuple

import pytest

import conftest
import warmgate.worker as kit


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str) -> None:
        super().__init__("localhost", timeout=10)
        self.path = path

    def connect(self) -> None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(10)
        s.connect(self.path)
        self.sock = s


def _call(path: str, method: str, target: str, body: Any = None) -> Tuple[int, Dict[str, Any]]:
    c = _UnixConnection(path)
    data = json.dumps(body).encode() if body is not None else None
    c.request(method, target, body=data, headers={"content-type": "application/json"})
    r = c.getresponse()
    out = json.loads(r.read() or b"null")
    c.close()
    return r.status, out


def test_the_kit_listens_on_the_socket_it_is_offered_and_sends_its_token_only_to_its_gateway(
    tmp_path: Path,
) -> None:
    sock = str(tmp_path / "w.sock")
    # A server that counts who connects: where a leaked token would go.
    trap = socket.socket()
    trap.bind(("127.0.0.1", 0))
    trap.listen(8)
    trap.setblocking(False)
    foreign = f"http://127.0.0.1:{trap.getsockname()[1]}/v1/weights/m/m-00001"
    env = {
        **os.environ,
        "PYTHONPATH": str(conftest.SRC),
        "WARMGATE_SOCKET": sock,
        "PORT": "1",  # offered too: the socket wins
        "WARMGATE_GATEWAY_URL": "http://127.0.0.1:9",
        "WARMGATE_WEIGHTS_TOKEN": "the-workers-own-token",
    }
    env.pop("WARMGATE_WEIGHTS_URL", None)
    proc = subprocess.Popen([sys.executable, "-m", "warmgate.worker"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while not os.path.exists(sock):
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            assert time.monotonic() < deadline, "the worker never made its socket"
            time.sleep(0.02)
        status, body = _wait(sock)
        assert status == 200 and body["status"] == "ok", body
        status, body = _call(sock, "POST", "/weights", {"url": foreign, "version": 3})
        assert status == 400, body
        assert "not on the gateway" in body["error"], body
        with pytest.raises(BlockingIOError):
            trap.accept()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        trap.close()


def _try(sock: str) -> Any:
    try:
        return _call(sock, "GET", "/healthz")
    except OSError:
        return None


def _wait(sock: str) -> Tuple[int, Dict[str, Any]]:
    deadline = time.monotonic() + 30
    while True:
        got = _try(sock)
        if got is not None:
            return got
        assert time.monotonic() < deadline, "no answer on the socket"
        time.sleep(0.02)


def test_stream_checkpoint_keeps_the_token_from_a_url_that_is_not_the_gateway(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("WARMGATE_WEIGHTS_TOKEN", "the-workers-own-token")
    monkeypatch.setenv("WARMGATE_GATEWAY_URL", "http://127.0.0.1:9")
    with pytest.raises(kit.WeightsError, match="sent nowhere else"):
        kit.stream_checkpoint("http://127.0.0.1:10/v1/weights/m/m-1", on_tensor=lambda t: None)
    # The same host on the gateway's port is the gateway: refused only for
    # want of a server there, never for its origin.
    with pytest.raises(OSError):
        kit.stream_checkpoint("http://127.0.0.1:9/v1/weights/m/m-1", on_tensor=lambda t: None)
