#!/usr/bin/env python3
"""A day under load, compressed: `warmgate serve` with real worker processes
held at a stated fraction of its measured capacity for a while, with the
usual day's faults in turn (a worker killed, a weight sync, live changes of
an app and a pool, a promotion with a canary rolled back, SIGHUP, and once a
`kill -9` of the gateway and its restart), while every request and task is
accounted for and the gateway's resources are sampled for drift.

    python3 benches/soak.py --duration 600 --out target/bench-results
    SMOKE=1 python3 benches/soak.py   (or --smoke: 20 s, a fault every 2 s,
                                       the debug build, built first, no
                                       embeddings app)

writes `soak.json` and `soak.svg` (RSS and p99 over time) to `--out`, prints
a summary, and exits 1 when a request or task was lost or answered twice,
or a worker process outlived the run; the smoke run also when a kind of
fault did not run, a fault's own call went unanswered, or a traffic class
had no answer at all. Standard library only.

Accounting. Every request ends in an answer (a 2xx, or an error in the
gateway's JSON format: a named error) or, while the gateway is down for its
restart, a refused connection (named `gateway_down`). Anything else (no
answer within the client's timeout, an answer that is not the API's, a task
whose output is not its own input's) is *lost*. Async tasks accepted before
the gateway's kill are looked up after its restart: each must be found
finished, or failed as `gateway_restarted`. Each task carries a unique id
in its input and the worker echoes it: an answer carrying another task's id
is counted as answered twice.
"""

import argparse
import atexit
import http.client
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KEYS = {"alpha": "soak-key-alpha-0123456789", "bravo": "soak-key-bravo-0123456789"}


def free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Gateway:
    """`warmgate serve` on a config of its own, restartable."""

    def __init__(self, binary, workdir, port):
        self.binary, self.workdir, self.port = binary, workdir, port
        self.proc = None
        self.down = threading.Event()
        self.token = None
        self.log = open(workdir / "serve.log", "ab")

    def start(self):
        self.proc = subprocess.Popen(
            [self.binary, "serve", "--config", str(self.workdir / "warmgate.toml")],
            cwd=self.workdir,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "SOAK_KEY_ALPHA": KEYS["alpha"], "SOAK_KEY_BRAVO": KEYS["bravo"]},
        )
        deadline = time.time() + 60
        while time.time() < deadline:
            try:
                c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
                c.request("GET", "/readyz")
                if c.getresponse().status == 200:
                    break
            except OSError:
                pass
            time.sleep(0.1)
        else:
            raise SystemExit("the gateway did not become ready within 60 s")
        self.token = (self.workdir / "state" / "admin-token").read_text().strip()
        self.down.clear()

    def kill9(self):
        self.down.set()
        self.proc.kill()
        self.proc.wait()

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()

    def call(self, method, path, body=None, key=None, admin=False, timeout=30):
        """(status, JSON or None). Raises OSError when there is no answer."""
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        headers = {"Content-Type": "application/json"}
        if admin:
            headers["Authorization"] = f"Bearer {self.token}"
        elif key:
            headers["Authorization"] = f"Bearer {KEYS[key]}"
        c.request(method, path, body=None if body is None else json.dumps(body), headers=headers)
        r = c.getresponse()
        data = r.read()
        try:
            return r.status, json.loads(data) if data else None
        except ValueError:
            return r.status, {"_raw": data[:200].decode("utf-8", "replace")}

    def raw(self, method, path, body, key, timeout=30):
        """(status, the body's bytes), for answers that are not one JSON."""
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        c.request(
            method,
            path,
            body=json.dumps(body),
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEYS[key]}"},
        )
        r = c.getresponse()
        return r.status, r.read()

    def stream(self, path, body, key, timeout=30):
        """A streamed completion: (status, events, whether it ended with [DONE])."""
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        c.request(
            "POST",
            path,
            body=json.dumps(body),
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEYS[key]}"},
        )
        r = c.getresponse()
        if r.status != 200:
            data = r.read()
            try:
                return r.status, json.loads(data), False
            except ValueError:
                return r.status, {"_raw": data[:200].decode("utf-8", "replace")}, False
        # Read by chunks, not lines: http.client's line reader takes a
        # chunked body cut short for its end, while `read` raises, as
        # httpx (the OpenAI client's transport) does.
        data = b""
        try:
            while True:
                part = r.read(4096)
                if not part:
                    break
                data += part
        except http.client.IncompleteRead:
            return 200, "cut", False
        lines = [x.strip() for x in data.splitlines()]
        events = sum(1 for x in lines if x.startswith(b"data:"))
        return 200, events, b"data: [DONE]" in lines


class Ledger:
    """What every request and task came to."""

    def __init__(self):
        self.lock = threading.Lock()
        self.records = []  # (t, class, seconds, outcome)
        self.lost = []
        self.duplicated = []
        self.async_open = {}  # task id -> submitted at

    def add(self, t, cls, seconds, outcome):
        with self.lock:
            self.records.append((t, cls, seconds, outcome))

    def lose(self, cls, why):
        with self.lock:
            self.lost.append({"class": cls, "why": why})
            self.records.append((time.time(), cls, 0.0, "lost"))


def named(status, body):
    """The outcome a non-2xx answer names, or None when it is not the API's."""
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return body["error"].get("kind")
    return None


def client(gw, ledger, cls, rate, stop, t0):
    """One traffic class at `rate` per second (open loop, paced)."""
    period = 1.0 / rate
    next_at = time.time()
    tenants = ["alpha", "bravo"]
    while not stop.is_set():
        now = time.time()
        if now < next_at:
            time.sleep(min(next_at - now, 0.2))
            continue
        next_at += period
        if next_at < now - 1:
            next_at = now  # behind by more than a second: do not burst
        key = random.choice(tenants)
        started = time.time()
        try:
            outcome = one(gw, ledger, cls, key)
        except (OSError, http.client.HTTPException) as e:
            outcome = "gateway_down" if gw.down.is_set() else f"conn:{type(e).__name__}"
            if not gw.down.is_set() and isinstance(e, TimeoutError):
                ledger.lose(cls, f"no answer within the client's timeout: {e}")
                continue
        ledger.add(started - t0, cls, time.time() - started, outcome)


def one(gw, ledger, cls, key):
    if cls == "chat":
        body = {"model": "chat", "messages": [{"role": "user", "content": "hi"}]}
        status, out = gw.call("POST", "/v1/chat/completions", body, key=key)
        return check_answer(ledger, cls, status, out, lambda o: o.get("choices"))
    if cls == "stream":
        body = {"model": "chat", "messages": [{"role": "user", "content": "hi"}], "stream": True}
        status, out, done = gw.stream("/v1/chat/completions", body, key)
        if status == 200:
            if out == "cut":
                # The gateway ended the body short: the client is told.
                return "stream_cut"
            if not done:
                ledger.lose(cls, "a stream that ended without [DONE]")
                return "lost"
            return "ok"
        return check_answer(ledger, cls, status, out, None)
    if cls == "embed":
        body = {"model": "embed", "input": ["a soak test sentence"]}
        status, out = gw.call("POST", "/v1/embeddings", body, key=key)
        return check_answer(ledger, cls, status, out, lambda o: o.get("data"))
    if cls == "task":
        tid = uuid.uuid4().hex
        status, out = gw.call("POST", "/v1/pools/rollouts/tasks", {"input": {"id": tid}}, key=key)
        return check_task(ledger, cls, status, out, tid)
    if cls == "async":
        tid = uuid.uuid4().hex
        status, out = gw.call(
            "POST", "/v1/pools/rollouts/tasks?async=true", {"input": {"id": tid}}, key=key
        )
        if status == 202:
            with ledger.lock:
                ledger.async_open[out["id"]] = (tid, key)
            return "accepted"
        return check_answer(ledger, cls, status, out, None)
    if cls == "batch":
        tids = [uuid.uuid4().hex for _ in range(4)]
        status, data = gw.raw(
            "POST", "/v1/pools/rollouts/tasks/batch", {"inputs": [{"id": t} for t in tids]}, key
        )
        if status != 200:
            try:
                out = json.loads(data)
            except ValueError:
                out = {"_raw": data[:200].decode("utf-8", "replace")}
            return check_answer(ledger, cls, status, out, None)
        # One line an input, in input order: its own output, or a named error.
        lines = [json.loads(x) for x in data.splitlines() if x.strip()]
        seen = [line.get("index") for line in lines]
        if seen != list(range(len(tids))):
            if gw.down.is_set():
                return "gateway_down"
            ledger.lose(cls, f"a batch answered indexes {seen} for {len(tids)} inputs")
            return "lost"
        kinds = []
        for line, tid in zip(lines, tids):
            if "error" in line:
                kinds.append(line["error"].get("kind", "error"))
            elif ((line.get("output") or {}).get("echo") or {}).get("id") != tid:
                with ledger.lock:
                    ledger.duplicated.append({"sent": tid, "answered": line.get("output")})
                return "duplicated"
        return kinds[0] if kinds else "ok"
    raise ValueError(cls)


def check_answer(ledger, cls, status, out, ok):
    if 200 <= status < 300:
        if ok is None or not ok(out or {}):
            ledger.lose(cls, f"a {status} that is not the API's answer: {str(out)[:200]}")
            return "lost"
        return "ok"
    kind = named(status, out)
    if kind is None:
        ledger.lose(cls, f"a {status} that is not the API's error: {str(out)[:200]}")
        return "lost"
    return kind


def check_task(ledger, cls, status, out, tid):
    if status == 200:
        echo = ((out or {}).get("output") or {}).get("echo") or {}
        if echo.get("id") != tid:
            with ledger.lock:
                ledger.duplicated.append({"sent": tid, "answered": echo.get("id")})
            return "duplicated"
        return "ok"
    return check_answer(ledger, cls, status, out, None)


def settle_async(gw, ledger, deadline):
    """Looks up every async task until it has ended; what is not found is lost."""
    pending = dict(ledger.async_open)
    ended = {"done": 0, "failed": 0, "gateway_restarted": 0}
    while pending and time.time() < deadline:
        for task_id, (tid, key) in list(pending.items()):
            try:
                status, out = gw.call("GET", f"/v1/tasks/{task_id}", key=key)
            except OSError:
                continue
            if status == 404:
                ledger.lose("async", f"task {task_id} was accepted and is not found")
                del pending[task_id]
                continue
            state = (out or {}).get("state")
            if state == "succeeded":
                echo = ((out or {}).get("output") or {}).get("echo") or {}
                if echo.get("id") != tid:
                    ledger.duplicated.append({"sent": tid, "answered": echo.get("id")})
                ended["done"] += 1
                del pending[task_id]
            elif state == "failed":
                kind = ((out or {}).get("error") or {}).get("kind", "failed")
                ended["gateway_restarted" if kind == "gateway_restarted" else "failed"] += 1
                del pending[task_id]
        if pending:
            time.sleep(0.5)
    for task_id in pending:
        ledger.lose("async", f"task {task_id} had not ended when the run did")
    return ended


# --- the faults ---------------------------------------------------------


def app_replica_pids(gw, app):
    status, out = gw.call("GET", f"/v1/apps/{app}", admin=True)
    return [r["pid"] for r in (out or {}).get("pool", {}).get("replicas", []) if r.get("pid")]


def fault_kill_worker(gw, ctx):
    pids = app_replica_pids(gw, "chat")
    if pids:
        os.kill(random.choice(pids), signal.SIGKILL)
    return f"kill -9 of a chat worker (of {len(pids)})"


def fault_weight_sync(gw, ctx):
    ctx["version"] += 1
    v = ctx["version"]
    ck = make_checkpoint(ctx["dir"] / "ck" / f"pool-v{v}", f"pool v{v}")
    status, out = gw.call(
        "POST", "/v1/pools/rollouts/weights", {"checkpoint": ck, "version": v}, admin=True, timeout=120
    )
    return f"weight sync to v{v}: {status} {named(status, out) or ''}".strip()


def fault_live_change(gw, ctx):
    ctx["flip"] = not ctx["flip"]
    app = dict(ctx["app_spec"])
    app["autoscale"] = {**app["autoscale"], "max": 3 if ctx["flip"] else 2}
    a, _ = gw.call("PUT", "/v1/apps/chat", app, admin=True)
    pool = dict(ctx["pool_spec"])
    pool["idle_ttl"] = "9m" if ctx["flip"] else "10m"
    p, _ = gw.call("PUT", "/v1/pools/rollouts", pool, admin=True)
    return f"live change of the app ({a}) and the pool ({p})"


def fault_promotion(gw, ctx):
    ctx["app_version"] += 1
    v = ctx["app_version"]
    ck = make_checkpoint(ctx["dir"] / "ck" / f"app-v{v}", f"app v{v}")
    s1, _ = gw.call(
        "POST", "/v1/apps/chat/promote", {"checkpoint": ck, "canary": 20, "bake": "30s"}, admin=True
    )
    # Roll it back once its canary takes traffic.
    deadline = time.time() + 30
    while time.time() < deadline:
        _, out = gw.call("GET", "/v1/apps/chat", admin=True)
        if ((out or {}).get("promotion") or {}).get("phase") == "canary":
            break
        time.sleep(0.2)
    time.sleep(2)
    s2, out = gw.call("POST", "/v1/apps/chat/rollback", {}, admin=True)
    return f"promotion with a 20% canary ({s1}), rolled back ({s2})"


def fault_sighup(gw, ctx):
    gw.proc.send_signal(signal.SIGHUP)
    return "SIGHUP (the file applied again)"


def fault_restart(gw, ctx):
    gw.kill9()
    time.sleep(1)
    gw.start()
    return "kill -9 of the gateway, then a restart on the same state"


FAULTS = [
    fault_kill_worker,
    fault_weight_sync,
    fault_live_change,
    fault_promotion,
    fault_sighup,
    fault_restart,
]


# --- drift --------------------------------------------------------------


def proc_status(pid):
    fields = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            k, _, v = line.partition(":")
            fields[k] = v.strip()
    except OSError:
        return None
    return fields


def workers_of(port):
    """Worker processes of this gateway: their environment names its port."""
    marker = f"127.0.0.1:{port}/".encode()
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            env = (d / "environ").read_bytes()
        except OSError:
            continue
        if b"WARMGATE_REPLICA=" in env and marker in env:
            found.append(int(d.name))
    return found


def dir_bytes(path):
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.path.getsize(os.path.join(root, f))
            except OSError:
                pass
    return total


def sample(gw, t0):
    pid = gw.proc.pid
    st = proc_status(pid) or {}
    try:
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        fds = None
    state = gw.workdir / "state"
    db = sum(
        os.path.getsize(state / f)
        for f in ("state.db", "state.db-wal", "state.db-shm")
        if (state / f).exists()
    )
    return {
        "t": round(time.time() - t0, 1),
        "rss_mib": round(int(st.get("VmRSS", "0 kB").split()[0]) / 1024, 1) if st else None,
        "fds": fds,
        "threads": int(st["Threads"]) if "Threads" in st else None,
        "workers": len(workers_of(gw.port)),
        "state_db_bytes": db,
        "logs_bytes": dir_bytes(state / "logs"),
        "cache_bytes": dir_bytes(state / "cache"),
    }


# --- setup --------------------------------------------------------------


def make_checkpoint(path, text):
    path.mkdir(parents=True, exist_ok=True)
    (path / "model.bin").write_bytes((text * 4096).encode()[:65536])
    return f"file://{path}"


def write_config(d, port, worker, embedder, minilm):
    app_ck = make_checkpoint(d / "ck" / "app-v1", "app v1")
    pool_ck = make_checkpoint(d / "ck" / "pool-v0", "pool v0")
    embed = ""
    if embedder and minilm:
        embed = f"""
[[apps]]
name = "embed"
command = ["{embedder}"]
checkpoint = "file://{minilm}"
concurrency = 4
startup_timeout = "120s"
[apps.autoscale]
min = 1
max = 1
"""
    allowed = [f"file://{d / 'ck'}"] + ([f"file://{minilm}"] if minilm else [])
    (d / "warmgate.toml").write_text(
        f"""listen = "127.0.0.1:{port}"
state_dir = "state"

[[tenants]]
name = "alpha"
api_key_env = "SOAK_KEY_ALPHA"
[[tenants]]
name = "bravo"
api_key_env = "SOAK_KEY_BRAVO"

[[apps]]
name = "chat"
command = ["{worker}"]
checkpoint = "{app_ck}"
concurrency = 8
env = {{ TEST_WORKER_LATENCY_MS = "20" }}
[apps.autoscale]
min = 1
max = 2
[apps.promotion]
min_requests = 1000
{embed}
[[pools]]
name = "rollouts"
command = ["{worker}"]
checkpoint = "{pool_ck}"
replicas = [2, 3]
concurrency = 4
idle_ttl = "10m"

[weights]
allowed_prefixes = {json.dumps(allowed)}
"""
    )
    app_spec = {
        "command": [str(worker)],
        "checkpoint": app_ck,
        "concurrency": 8,
        "env": {"TEST_WORKER_LATENCY_MS": "20"},
        "autoscale": {"min": 1, "max": 2},
        "promotion": {"min_requests": 1000},
    }
    pool_spec = {
        "command": [str(worker)],
        "checkpoint": pool_ck,
        "replicas": [2, 3],
        "concurrency": 4,
        "idle_ttl": "10m",
    }
    return app_spec, pool_spec


def calibrate(gw, seconds=5.0, threads=8):
    """Requests a second the chat app answers, closed loop."""
    count = [0]
    stop = time.time() + seconds

    def loop():
        while time.time() < stop:
            try:
                s, _ = gw.call(
                    "POST",
                    "/v1/chat/completions",
                    {"model": "chat", "messages": []},
                    key="alpha",
                )
                if s == 200:
                    count[0] += 1
            except OSError:
                pass

    ts = [threading.Thread(target=loop) for _ in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return count[0] / seconds


def percentile(xs, q):
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def svg(samples, minutes, path):
    """RSS over time and each period's p99, one picture, no dependency."""
    w, h, pad = 720, 360, 50
    dur = max([s["t"] for s in samples] + [1])

    def poly(points, top, height, vmax, colour):
        pts = " ".join(
            f"{pad + (w - 2 * pad) * t / dur:.1f},{top + height - height * v / vmax:.1f}"
            for t, v in points
        )
        return f'<polyline fill="none" stroke="{colour}" stroke-width="2" points="{pts}"/>'

    rss = [(s["t"], s["rss_mib"]) for s in samples if s["rss_mib"] is not None]
    p99 = [(m["start"] + m["seconds"] / 2, m["p99_ms"]) for m in minutes if m["p99_ms"] is not None]
    rmax = max([v for _, v in rss] + [1]) * 1.2
    pmax = max([v for _, v in p99] + [1]) * 1.2
    ph = (h - 3 * pad) / 2
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">',
        '<rect width="100%" height="100%" fill="white"/>',
        f'<text x="{pad}" y="{pad - 10}">gateway RSS, MiB (max {rmax / 1.2:.1f})</text>',
        poly(rss, pad, ph, rmax, "#1f77b4"),
        f'<text x="{pad}" y="{2 * pad + ph - 10}">p99 of chat requests per period, ms (max {pmax / 1.2:.0f})</text>',
        poly(p99, 2 * pad + ph, ph, pmax, "#d62728"),
        f'<text x="{pad}" y="{h - 10}">seconds: 0 to {dur:.0f}; faults at each period\'s start</text>',
    ]
    for m in minutes:
        x = pad + (w - 2 * pad) * m["start"] / dur
        parts.append(f'<line x1="{x:.1f}" y1="{pad}" x2="{x:.1f}" y2="{h - pad}" stroke="#ccc"/>')
    parts.append("</svg>")
    Path(path).write_text("\n".join(parts))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=600, help="seconds of load")
    ap.add_argument("--period", type=float, default=60, help="seconds between faults (one per period)")
    ap.add_argument("--fraction", type=float, default=0.3, help="of the measured capacity")
    ap.add_argument("--sample-every", type=float, default=10)
    ap.add_argument("--out", default=str(ROOT / "target" / "bench-results"))
    ap.add_argument("--profile", default="debug", help="target/<profile> holds the binaries")
    ap.add_argument("--calibrate", type=float, default=5.0, help="seconds of measuring the capacity")
    ap.add_argument("--smoke", action="store_true",
                    help="seconds, not minutes, on a fresh debug build (also SMOKE=1); "
                         "the flags above still apply")
    smoke = os.environ.get("SMOKE") == "1" or "--smoke" in sys.argv[1:]
    if smoke:
        ap.set_defaults(duration=20, period=2, sample_every=1, calibrate=2)
    args = ap.parse_args()
    if smoke and args.profile == "debug":
        subprocess.run(["cargo", "build", "--workspace", "--bins", "-q"], cwd=ROOT, check=True)

    bins = ROOT / "target" / args.profile
    warmgate, worker, embedder = bins / "warmgate", bins / "test-worker", bins / "embedder"
    minilm = ROOT / "checkpoints" / "minilm"
    has_embed = embedder.exists() and (minilm / "model.safetensors").exists()
    if smoke and has_embed:
        # A debug embedder takes about ten seconds of both cores to load,
        # twice a run (the gateway's restart): most of a smoke run.
        # benches/weights.sh's smoke run starts it.
        print("soak smoke: without the embeddings app (its debug build loads for seconds)", file=sys.stderr)
        has_embed = False
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="warmgate-soak-"))
    atexit.register(shutil.rmtree, work, True)
    port = free_port()
    app_spec, pool_spec = write_config(
        work, port, worker, embedder if has_embed else None, minilm if has_embed else None
    )
    gw = Gateway(warmgate, work, port)
    # Stopped (and its folder removed) however the run ends.
    atexit.register(gw.stop)
    gw.start()
    ledger = Ledger()
    ctx = {"dir": work, "version": 0, "app_version": 1, "flip": False,
           "app_spec": app_spec, "pool_spec": pool_spec}
    try:
        capacity = calibrate(gw, args.calibrate)
        total = max(2.0, capacity * args.fraction)
        shares = {"chat": 0.35, "stream": 0.15, "task": 0.2, "async": 0.1, "batch": 0.05}
        if has_embed:
            shares["embed"] = 0.15
        norm = sum(shares.values())
        rates = {c: max(0.2, total * s / norm) for c, s in shares.items()}
        t0 = time.time()
        stop = threading.Event()
        threads = [
            threading.Thread(target=client, args=(gw, ledger, c, r / 2, stop, t0), daemon=True)
            for c, r in rates.items()
            for _ in range(2)  # two clients a class: one waits while one sends
        ]
        for t in threads:
            t.start()
        samples, faults = [], []
        baseline_workers = None
        next_sample = time.time()
        fault_index = 0
        next_fault = t0 + args.period
        restart_at = len(FAULTS) - 1
        while time.time() - t0 < args.duration:
            now = time.time()
            if now >= next_sample:
                s = sample(gw, t0)
                samples.append(s)
                if baseline_workers is None:
                    baseline_workers = s["workers"]
                next_sample += args.sample_every
            if now >= next_fault and now - t0 < args.duration - 5:
                f = FAULTS[fault_index % len(FAULTS)]
                # The gateway's restart once a run, the rest in turn.
                if f is fault_restart and fault_index > restart_at:
                    fault_index += 1
                    f = FAULTS[fault_index % len(FAULTS)]
                at = round(time.time() - t0, 1)
                try:
                    what = f(gw, ctx)
                except (OSError, http.client.HTTPException) as e:
                    what = f"{f.__name__} failed: {e}"
                faults.append({"t": at, "what": what})
                print(f"[{at:7.1f}s] {what}", flush=True)
                fault_index += 1
                next_fault += args.period
            time.sleep(0.2)
        stop.set()
        for t in threads:
            t.join(timeout=60)
        ended = settle_async(gw, ledger, time.time() + 120)
        # Leaks: once quiet, the workers alive are the replicas status lists.
        time.sleep(3)
        _, st = gw.call("GET", "/v1/status", admin=True)
        listed = set()
        for a in (st or {}).get("apps", []):
            listed |= {r.get("pid") for r in a.get("pool", {}).get("replicas", [])}
        for p in (st or {}).get("pools", []):
            listed |= {r.get("pid") for r in p.get("pool", {}).get("replicas", [])}
        alive = workers_of(port)
        leaked = sorted(set(alive) - listed)
        final = sample(gw, t0)
    finally:
        gw.stop()
    after_stop = workers_of(port)

    # Per period: p50/p99 of chat requests, and errors.
    periods = []
    n = int(args.duration // args.period) + 1
    for i in range(n):
        start, end = i * args.period, (i + 1) * args.period
        rec = [r for r in ledger.records if start <= r[0] < end]
        if not rec:
            continue
        lat = [r[2] * 1000 for r in rec if r[1] == "chat" and r[3] == "ok"]
        settled = [r[2] * 1000 for r in rec if r[1] == "chat" and r[3] == "ok" and r[0] >= start + min(15, args.period / 4)]
        errors = {}
        for r in rec:
            if r[3] not in ("ok", "accepted"):
                errors[r[3]] = errors.get(r[3], 0) + 1
        periods.append({
            "start": start,
            "seconds": args.period,
            "requests": len(rec),
            "p50_ms": round(percentile(lat, 0.5), 1) if lat else None,
            "p99_ms": round(percentile(lat, 0.99), 1) if lat else None,
            "settled_p99_ms": round(percentile(settled, 0.99), 1) if settled else None,
            "errors": errors,
        })
    by_class = {}
    for r in ledger.records:
        c = by_class.setdefault(r[1], {})
        c[r[3]] = c.get(r[3], 0) + 1
    warm = [s for s in samples if s["t"] >= min(120, args.duration / 3)]
    rss = [s["rss_mib"] for s in warm if s["rss_mib"]]
    report = {
        "duration_s": args.duration,
        "period_s": args.period,
        "profile": args.profile,
        "capacity_rps": round(capacity, 1),
        "fraction": args.fraction,
        "rates_per_s": {c: round(r, 2) for c, r in rates.items()},
        "embeddings": has_embed,
        "sent": len(ledger.records),
        "by_class": by_class,
        "lost": len(ledger.lost),
        "lost_detail": ledger.lost[:20],
        "duplicated": len(ledger.duplicated),
        "async_ended": ended,
        "leaked_workers": leaked,
        "workers_after_stop": after_stop,
        "faults": faults,
        "samples": samples + [final],
        "periods": periods,
        "rss_after_warmup_mib": {
            "min": min(rss) if rss else None,
            "max": max(rss) if rss else None,
            "median": statistics.median(rss) if rss else None,
        },
    }
    (out / "soak.json").write_text(json.dumps(report, indent=1))
    svg(samples + [final], periods, out / "soak.svg")
    print(json.dumps({k: report[k] for k in (
        "capacity_rps", "sent", "lost", "duplicated", "async_ended", "leaked_workers",
        "workers_after_stop", "rss_after_warmup_mib")}, indent=1))
    for p in periods:
        print(f"  {p['start']:6.0f}s  {p['requests']:6d} req  p50 {p['p50_ms']} ms  p99 {p['p99_ms']} ms "
              f"(settled {p['settled_p99_ms']})  errors {p['errors']}")
    bad = report["lost"] or report["duplicated"] or leaked or after_stop
    if bad:
        print("FAILED: lost, duplicated or leaked; see soak.json", file=sys.stderr)
    if smoke:
        # The smoke run's figures mean nothing; that every part ran, and
        # nothing was lost, does.
        kinds = ("kill -9 of a chat worker", "weight sync to", "live change", "promotion",
                 "SIGHUP", "kill -9 of the gateway")
        problems = [f"no fault '{k}'" for k in kinds if not any(k in f["what"] for f in faults)]
        problems += [f"a fault went unanswered: {f['what']}" for f in faults if " failed: " in f["what"]]
        problems += [f"no {c} request answered: {by_class.get(c)}" for c in rates
                     if not by_class.get(c, {}).get("ok") and not by_class.get(c, {}).get("accepted")]
        if not ended["done"]:
            problems.append(f"no async task finished: {ended}")
        if capacity <= 0:
            problems.append("no chat request answered while measuring the capacity")
        if not periods or not any(s["rss_mib"] for s in samples):
            problems.append("no period or no RSS sample")
        if problems or bad:
            print("soak smoke: " + "; ".join(problems or ["see above"]), file=sys.stderr)
            log = (work / "serve.log").read_bytes().decode("utf-8", "replace").splitlines()
            print("the gateway's log (last lines):\n" + "\n".join(log[-30:]), file=sys.stderr)
            return 1
        print("soak smoke: ok", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
