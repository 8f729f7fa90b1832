"""The harness: the real ``warmgate serve`` on a free loopback port, with a
config written into a temporary folder, and Python workers built on
``warmgate.worker``. Nothing of the gateway is mocked.

The binary is ``$WARMGATE_BIN``, else ``<repo>/target/debug/warmgate``
(``cargo build --workspace --bins`` makes it)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, TypeVar

import pytest

HERE = Path(__file__).resolve().parent
PYTHON_DIR = HERE.parent
REPO = PYTHON_DIR.parent
SRC = PYTHON_DIR / "src"
WORKERS = HERE / "workers"
EXAMPLES = PYTHON_DIR / "examples"

# The package under test is the source tree's, not an installed copy.
sys.path.insert(0, str(SRC))

ADMIN_TOKEN = "py-admin-token"
ALPHA_KEY = "alpha-key-0123456789"
BRAVO_KEY = "bravo-key-0123456789"

T = TypeVar("T")


def warmgate_bin() -> Path:
    p = Path(os.environ.get("WARMGATE_BIN") or REPO / "target" / "debug" / "warmgate")
    if not p.exists():
        pytest.fail(f"{p} not found: build it first (cargo build --workspace --bins) or set WARMGATE_BIN")
    return p


def toml_str(s: str) -> str:
    return json.dumps(s)


def worker_command(script: str = "task_worker.py", *args: str) -> str:
    """A TOML ``command`` running a test worker with this interpreter."""
    parts = [sys.executable, str(WORKERS / script), *args]
    return "[" + ", ".join(toml_str(p) for p in parts) + "]"


def worker_env(**extra: str) -> str:
    """A TOML inline table for ``env``: the package's source on the path."""
    env = {"PYTHONPATH": str(SRC), "PYTHONUNBUFFERED": "1", **extra}
    return "{ " + ", ".join(f"{k} = {toml_str(v)}" for k, v in env.items()) + " }"


def eventually(what: str, check: Callable[[], Optional[T]], timeout: float = 30.0) -> T:
    deadline = time.monotonic() + timeout
    delay = 0.01
    while True:
        v = check()
        if v is not None:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for: {what}")
        time.sleep(delay)
        delay = min(delay * 2, 0.2)


class Gateway:
    """A running ``warmgate serve``."""

    def __init__(self, config: str, env: Optional[Mapping[str, str]] = None) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="warmgate-py-"))
        self.config = self.dir / "warmgate.toml"
        self.config.write_text(f'state_dir = "state"\n{config}')
        self.env = dict(env or {})
        self.runtime_dir = self.dir / "run"
        self.proc: Optional[subprocess.Popen[bytes]] = None
        self.url = ""
        self._start()

    def _start(self) -> None:
        log = open(self.dir / "gateway.log", "ab")
        env = {k: v for k, v in os.environ.items() if not k.startswith("WARMGATE_")}
        # A token the gateway makes for itself is published here, not in
        # the user's own runtime folder.
        env.update({"WARMGATE_LOG": "info", "WARMGATE_RUNTIME_DIR": str(self.runtime_dir)})
        env.update(self.env)
        self.proc = subprocess.Popen(
            [str(warmgate_bin()), "serve", "--config", str(self.config), "--listen", "127.0.0.1:0"],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log, env=env,
        )
        log.close()
        first: List[str] = []
        got = threading.Event()
        stdout = self.proc.stdout
        assert stdout is not None

        def drain() -> None:
            line = stdout.readline().decode().strip()
            first.append(line)
            got.set()
            for _ in stdout:  # keep the pipe from filling
                pass

        threading.Thread(target=drain, daemon=True).start()
        if not got.wait(30) or not first[0].startswith("warmgate listening on "):
            self.stop()
            raise RuntimeError(f"warmgate did not start: {first}\n{self.log()}")
        self.url = first[0][len("warmgate listening on "):]

    def log(self) -> str:
        try:
            return (self.dir / "gateway.log").read_text()[-8000:]
        except OSError:
            return ""

    @property
    def admin_token(self) -> str:
        """``WARMGATE_ADMIN_TOKEN`` as given, else the token the gateway made
        for itself in its state folder."""
        given = self.env.get("WARMGATE_ADMIN_TOKEN")
        if given:
            return given
        return (self.dir / "state" / "admin-token").read_text().strip()

    def get(self, path: str) -> Any:
        """A GET of the gateway's own, without the client under test."""
        req = urllib.request.Request(self.url + path)
        req.add_header("authorization", f"Bearer {self.admin_token}")
        with urllib.request.urlopen(req, timeout=30) as r:
            body = r.read()
        return json.loads(body) if path != "/metrics" else body.decode()

    def pool_status(self, name: str) -> Dict[str, Any]:
        for p in self.get("/v1/status")["pools"]:
            if p["name"] == name:
                return p  # type: ignore[no-any-return]
        raise AssertionError(f"no pool {name}")

    def replica_pids(self, pool: str) -> List[int]:
        s = self.pool_status(pool)
        reps = (s.get("pool") or {}).get("replicas") or []
        return [r["pid"] for r in reps if r.get("pid") and r.get("state") == "ready"]

    def wait_pool_ready(self, pool: str, n: int) -> Dict[str, Any]:
        return eventually(
            f"{n} ready replicas of {pool}",
            lambda: (lambda s: s if s["ready"] >= n else None)(self.pool_status(pool)),
        )

    def wait_app_ready(self, app: str, n: int) -> Dict[str, Any]:
        def ready() -> Optional[Dict[str, Any]]:
            for a in self.get("/v1/status")["apps"]:
                if a["name"] == app and a["ready"] >= n:
                    return a
            return None

        return eventually(f"{n} ready replicas of {app}", ready)

    def metric(self, name: str) -> float:
        for line in self.get("/metrics").splitlines():
            parts = line.split()
            if parts and parts[0] == name:
                return float(parts[-1])
        return 0.0

    def stop(self) -> None:
        if self.proc is None:
            return
        proc, self.proc = self.proc, None
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture
def make_gateway() -> Iterator[Callable[..., Gateway]]:
    """Starts gateways for one test; stops them after it."""
    started: List[Gateway] = []

    def make(config: str, env: Optional[Mapping[str, str]] = None) -> Gateway:
        gw = Gateway(config, env)
        started.append(gw)
        return gw

    yield make
    for gw in started:
        gw.stop()


def shared_config(checkpoints: Path) -> str:
    """The config most tests share: an admin token, two tenants with keys,
    a pool of two Python workers, and an app with a checkpoint."""
    return f"""
[weights]
allowed_prefixes = [{toml_str("file://" + str(checkpoints))}]

[[tenants]]
name = "alpha"
api_key_env = "ALPHA_KEY"

[[tenants]]
name = "bravo"
api_key_env = "BRAVO_KEY"
rps = 0.1
burst = 1

[[pools]]
name = "rollouts"
command = {worker_command()}
env = {worker_env()}
replicas = [2, 2]
concurrency = 8
retries = 1

[[apps]]
name = "policy"
command = {worker_command()}
env = {worker_env()}
checkpoint = {toml_str("file://" + str(checkpoints / "app-v1"))}
[apps.autoscale]
min = 1
max = 1
"""


def write_checkpoint(folder: Path, value: float) -> str:
    """A one-tensor safetensors checkpoint holding ``value``; its ``file://``
    URI."""
    import struct

    from warmgate import safetensors

    safetensors.save(folder / "model.safetensors", {"w": ("F32", [1], struct.pack("<f", value))})
    return "file://" + str(folder)


@pytest.fixture(scope="session")
def checkpoints() -> Path:
    d = Path(tempfile.mkdtemp(prefix="warmgate-py-ckpt-"))
    write_checkpoint(d / "app-v1", 1.0)
    return d


@pytest.fixture(scope="session")
def gateway(checkpoints: Path) -> Iterator[Gateway]:
    """One gateway for the tests that do not need a config of their own."""
    gw = Gateway(
        shared_config(checkpoints),
        {"WARMGATE_ADMIN_TOKEN": ADMIN_TOKEN, "ALPHA_KEY": ALPHA_KEY, "BRAVO_KEY": BRAVO_KEY},
    )
    try:
        gw.wait_pool_ready("rollouts", 2)
        yield gw
    finally:
        gw.stop()


@pytest.fixture
def client_env(gateway: Gateway, monkeypatch: pytest.MonkeyPatch) -> Gateway:
    """The variables the CLI reads, set as a user would: the client takes
    the gateway, the admin token and the tenant key from them."""
    monkeypatch.setenv("WARMGATE_GATEWAY", gateway.url)
    monkeypatch.setenv("WARMGATE_ADMIN_TOKEN", ADMIN_TOKEN)
    monkeypatch.setenv("WARMGATE_API_KEY", ALPHA_KEY)
    return gateway
