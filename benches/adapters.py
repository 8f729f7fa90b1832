#!/usr/bin/env python3
"""LoRA adapters routed by warmgate against a router that ignores them, in
one run, on loopback.

    python3 benches/adapters.py            (WARMGATE_BIN, default target/release/warmgate)
    SMOKE=1 python3 benches/adapters.py    (or --smoke: 2 engines, 4 adapters, 3 s
                                            after 1 s, the debug build; fails
                                            unless every request was answered)

Engines: ENGINES (4) replicas of tests/standins/llm_engine.py, each with
MAX_LORAS (2) adapter slots, swapping an adapter in or loading one takes
LORA_LOAD_MS (200) ms, STANDIN_SLOTS (4) requests run at once, 4 ms per
output token. ADAPTERS (24) adapters, each request's adapter drawn from a
Zipf law with s = ZIPF_S (1.1), Poisson arrivals at RATE (20) requests/s
for DURATION (120) s after WARMUP (20) s; 8 output tokens, not streamed.

Targets, each on fresh engines:
- warmgate: one app of ENGINES replicas with `[apps.adapters] max_loaded =
  MAX_LORAS` and the 24 adapters; the gateway loads an adapter where it
  routes a request for it, keeps it there, unloads an idle one for room.
- naive: no gateway; every engine has all 24 adapters registered (vLLM's
  `--lora-modules`, or a controller that loads every adapter everywhere),
  and the client sends requests round robin, as a router that ignores
  adapters does. The engine swaps adapters into its MAX_LORAS slots (LRU).

Reported: adapter loads per minute (the engines' own count of loads and
swap-ins, `standin:lora_loads_total`, over the measured window), request
latency p50/p99, requests that waited for a load (warmgate says so in
`x-warmgate-adapter-load-ms`; for the naive target, the engines' swap-ins,
each of which at least one request waited for), and for warmgate each
adapter's loads per minute (from `warmgate_adapter_loads_total`). Table on stdout and in
target/bench-results/adapters.md, figures in adapters.json.
"""

import asyncio
import json
import math
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
ENGINE = ROOT / "tests" / "standins" / "llm_engine.py"
env = os.environ.get
# The smoke run: seconds, small, on the debug build, checked for errors
# (its figures mean nothing). Each setting can still be set.
SMOKE = env("SMOKE") == "1" or "--smoke" in sys.argv[1:]
if SMOKE:
    for k, v in {"ENGINES": "2", "ADAPTERS": "4", "LORA_LOAD_MS": "20", "RATE": "10",
                 "DURATION": "3", "WARMUP": "1"}.items():
        os.environ.setdefault(k, v)
ENGINES = int(env("ENGINES", "4"))
MAX_LORAS = int(env("MAX_LORAS", "2"))
LORA_LOAD_MS = float(env("LORA_LOAD_MS", "200"))
ADAPTERS = int(env("ADAPTERS", "24"))
ZIPF_S = float(env("ZIPF_S", "1.1"))
RATE = float(env("RATE", "20"))
DURATION = float(env("DURATION", "120"))
WARMUP = float(env("WARMUP", "20"))
SEED = int(env("SEED", "1"))
SLOTS = env("STANDIN_SLOTS", "4")
TOKEN = "bench-adapters-token"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def engine_cmd(port=None):
    cmd = [sys.executable, str(ENGINE), "--model", "base", "--slots", SLOTS,
           "--prefill-ms-per-token", "0.01", "--decode-ms-per-token", "4",
           "--max-loras", str(MAX_LORAS), "--lora-load-ms", str(LORA_LOAD_MS)]
    if port is not None:
        cmd += ["--port", str(port)]
    return cmd


def names():
    return [f"lora-{i:02d}" for i in range(ADAPTERS)]


def schedule():
    """(send time, adapter) for warm-up and measurement, seeded."""
    rng = random.Random(SEED)
    weights = [1 / (k + 1) ** ZIPF_S for k in range(ADAPTERS)]
    total = sum(weights)
    cum, acc = [], 0.0
    for w in weights:
        acc += w / total
        cum.append(acc)
    t, out = 0.0, []
    while t < WARMUP + DURATION:
        t += rng.expovariate(RATE)
        u = rng.random()
        k = next(i for i, c in enumerate(cum) if u <= c)
        out.append((t, names()[k]))
    return out


async def wait_http(url, timeout=60, headers=None):
    end = time.monotonic() + timeout
    async with httpx.AsyncClient() as c:
        while time.monotonic() < end:
            try:
                r = await c.get(url, headers=headers)
                if r.status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.1)
    raise RuntimeError(f"{url} did not answer")


def counter(text, name):
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def engine_loads(urls):
    async with httpx.AsyncClient() as c:
        texts = await asyncio.gather(*(c.get(u + "/metrics") for u in urls))
    return sum(counter(t.text, "standin:lora_loads_total") for t in texts)


# Requests that failed while warming up (not measured, but an error all
# the same), per target.
WARMUP_FAILED = {}


async def drive(plan, send):
    """Sends each request at its time; returns [(t, latency_s, waited, ok)]."""
    t0 = time.monotonic()
    results = []

    async def one(at, adapter):
        delay = at - (time.monotonic() - t0)
        if delay > 0:
            await asyncio.sleep(delay)
        start = time.monotonic()
        ok, waited = await send(adapter)
        results.append((at, time.monotonic() - start, waited, ok, adapter))

    await asyncio.gather(*(one(at, a) for at, a in plan))
    return results


def body(adapter):
    return {"model": adapter, "messages": [{"role": "user", "content": "say something"}],
            "max_tokens": 8}


def pct(xs, p):
    xs = sorted(xs)
    if not xs:
        return float("nan")
    return xs[min(len(xs) - 1, int(math.ceil(p / 100 * len(xs))) - 1)]


async def run_warmgate(bin_path, plan, folders):
    work = Path(tempfile.mkdtemp(prefix="warmgate-adapters."))
    try:
        return await warmgate_target(work, bin_path, plan, folders)
    except BaseException:
        log = work / "gateway.log"
        if log.exists():
            sys.stderr.write("the gateway's log (last lines):\n" + "".join(log.read_text().splitlines(True)[-30:]))
        raise
    finally:
        shutil.rmtree(work, ignore_errors=True)


async def warmgate_target(work, bin_path, plan, folders):
    models = "".join(
        f'[[apps.adapters.models]]\nname = "{n}"\ncheckpoint = "file://{folders[n]}"\n'
        for n in names())
    cmd = ", ".join(json.dumps(c) for c in engine_cmd())
    port = free_port()
    (work / "warmgate.toml").write_text(f"""
listen = "127.0.0.1:{port}"
state_dir = "state"
[[apps]]
name = "base"
command = [{cmd}]
env = {{ VLLM_ALLOW_RUNTIME_LORA_UPDATING = "True" }}
concurrency = {SLOTS}
startup_timeout = "60s"
[apps.health]
path = "/health"
[apps.autoscale]
min = {ENGINES}
max = {ENGINES}
[apps.queue]
max_pending = 100000
timeout = "120s"
[apps.adapters]
max_loaded = {MAX_LORAS}
{models}
""")
    genv = dict(os.environ, WARMGATE_ADMIN_TOKEN=TOKEN, WARMGATE_LOG="warn")
    proc = subprocess.Popen([bin_path, "serve", "-c", str(work / "warmgate.toml")],
                            env=genv, stdout=subprocess.DEVNULL,
                            stderr=open(work / "gateway.log", "w"), start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    auth = {"authorization": f"Bearer {TOKEN}"}
    try:
        await wait_http(base + "/healthz")
        async with httpx.AsyncClient() as c:
            for _ in range(600):
                s = (await c.get(base + "/v1/status", headers=auth)).json()
                if s["apps"][0]["ready"] == ENGINES:
                    break
                await asyncio.sleep(0.1)
            s = (await c.get(base + "/v1/status", headers=auth)).json()
            addrs = [r["addr"] for r in s["apps"][0]["pool"]["replicas"]]
        urls = [f"http://{a}" for a in addrs]
        limits = httpx.Limits(max_connections=2000, max_keepalive_connections=2000)
        async with httpx.AsyncClient(base_url=base, timeout=300, limits=limits) as client:
            async def send(adapter):
                r = await client.post("/v1/chat/completions", json=body(adapter))
                return r.status_code == 200, r.headers.get("x-warmgate-adapter-load-ms") is not None
            warm = [p for p in plan if p[0] < WARMUP]
            measured = [(t - WARMUP, a) for t, a in plan if t >= WARMUP]
            WARMUP_FAILED["warmgate"] = sum(1 for r in await drive(warm, send) if not r[3])
            before = await engine_loads(urls)
            per_adapter_before = await gateway_loads(base, auth)
            t_start = time.monotonic()
            results = await drive(measured, send)
            took = time.monotonic() - t_start
            after = await engine_loads(urls)
            per_adapter_after = await gateway_loads(base, auth)
        per_adapter = {k: per_adapter_after.get(k, 0) - per_adapter_before.get(k, 0)
                       for k in per_adapter_after}
        return results, after - before, took, per_adapter
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)


async def gateway_loads(base, auth):
    async with httpx.AsyncClient() as c:
        text = (await c.get(base + "/metrics", headers=auth)).text
    out = {}
    for line in text.splitlines():
        m = re.match(r'warmgate_adapter_loads_total\{(.*)\} (\S+)', line)
        if m:
            a = re.search(r'adapter="([^"]*)"', m.group(1))
            if a:
                out[a.group(1)] = float(m.group(2))
    return out


async def run_naive(plan, folders):
    ports = [free_port() for _ in range(ENGINES)]
    eenv = dict(os.environ, VLLM_ALLOW_RUNTIME_LORA_UPDATING="True")
    procs = [subprocess.Popen(engine_cmd(p), env=eenv, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, start_new_session=True) for p in ports]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    try:
        for u in urls:
            await wait_http(u + "/health")
        async with httpx.AsyncClient(timeout=60) as c:
            for u in urls:
                for n in names():
                    r = await c.post(u + "/v1/load_lora_adapter",
                                     json={"lora_name": n, "lora_path": str(folders[n])})
                    r.raise_for_status()
        limits = httpx.Limits(max_connections=2000, max_keepalive_connections=2000)
        clients = [httpx.AsyncClient(base_url=u, timeout=300, limits=limits) for u in urls]
        turn = [0]

        async def send(adapter):
            i = turn[0] % len(clients)
            turn[0] += 1
            r = await clients[i].post("/v1/chat/completions", json=body(adapter))
            return r.status_code == 200, False

        warm = [p for p in plan if p[0] < WARMUP]
        measured = [(t - WARMUP, a) for t, a in plan if t >= WARMUP]
        WARMUP_FAILED["naive"] = sum(1 for r in await drive(warm, send) if not r[3])
        before = await engine_loads(urls)
        t_start = time.monotonic()
        results = await drive(measured, send)
        took = time.monotonic() - t_start
        after = await engine_loads(urls)
        for c in clients:
            await c.aclose()
        return results, after - before, took
    finally:
        for p in procs:
            os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            p.wait(timeout=30)


def summary(name, results, loads, took, waited=None):
    lat = [r[1] * 1000 for r in results if r[3]]
    failed = sum(1 for r in results if not r[3])
    if waited is None:
        waited = sum(1 for r in results if r[2])
    return {
        "target": name, "requests": len(results), "failed": failed,
        "loads": loads, "loads_per_min": loads / (took / 60),
        "p50_ms": pct(lat, 50), "p99_ms": pct(lat, 99), "waited_for_load": waited,
    }


async def main():
    bin_path = env("WARMGATE_BIN")
    if not bin_path and SMOKE:
        subprocess.run(["cargo", "build", "--workspace", "--bins", "-q"], cwd=ROOT, check=True)
        bin_path = str(ROOT / "target" / "debug" / "warmgate")
    bin_path = bin_path or str(ROOT / "target" / "release" / "warmgate")
    folders_dir = Path(tempfile.mkdtemp(prefix="warmgate-adapter-folders."))
    try:
        return await measure(bin_path, folders_dir)
    finally:
        shutil.rmtree(folders_dir, ignore_errors=True)


async def measure(bin_path, folders_dir):
    folders = {}
    for n in names():
        d = folders_dir / n
        d.mkdir()
        (d / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 8}')
        folders[n] = d
    plan = schedule()
    print(f"{len(plan)} requests: {ADAPTERS} adapters, Zipf s={ZIPF_S}, {RATE}/s for "
          f"{DURATION:.0f} s after {WARMUP:.0f} s; {ENGINES} engines × {MAX_LORAS} slots, "
          f"load {LORA_LOAD_MS:.0f} ms", flush=True)
    rows = []
    results, loads, took, per_adapter = await run_warmgate(bin_path, plan, folders)
    w = summary("warmgate", results, loads, took)
    minutes = took / 60
    w["most_loads_of_one_adapter_per_min"] = max(per_adapter.values(), default=0) / minutes
    w["adapters_loaded_more_than_once_a_min"] = sum(
        1 for v in per_adapter.values() if v / minutes > 1.0)
    w["loads_per_min_by_adapter"] = {
        k: round(v / minutes, 2) for k, v in sorted(per_adapter.items())}
    rows.append(w)
    print(json.dumps(w), flush=True)
    results, loads, took = await run_naive(plan, folders)
    # Every request the naive engines swapped for waited for it.
    n = summary("naive (round robin, all adapters on every engine)", results, loads, took,
                waited=int(loads))
    rows.append(n)
    print(json.dumps(n), flush=True)
    w["loads_ratio_naive_over_warmgate"] = n["loads"] / max(w["loads"], 1)
    w["p99_ratio_warmgate_over_naive"] = w["p99_ms"] / n["p99_ms"]
    out = ROOT / "target" / "bench-results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "adapters.json").write_text(json.dumps(rows, indent=2))
    lines = ["| target | requests | failed | adapter loads/min | p50 ms | p99 ms | waited for a load |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['target']} | {r['requests']} | {r['failed']} | {r['loads_per_min']:.1f} | "
                     f"{r['p50_ms']:.0f} | {r['p99_ms']:.0f} | {r['waited_for_load']} |")
    lines.append("")
    lines.append(f"warmgate: {w['loads_ratio_naive_over_warmgate']:.1f}× fewer loads, p99 "
                 f"{w['p99_ratio_warmgate_over_naive']:.2f}× the naive router's; the most loads of "
                 f"one adapter {w['most_loads_of_one_adapter_per_min']:.1f}/min, "
                 f"{w['adapters_loaded_more_than_once_a_min']} adapters loaded more than once a minute")
    text = "\n".join(lines)
    (out / "adapters.md").write_text(text + "\n")
    print(text)
    if SMOKE:
        # The smoke run's figures mean nothing; that every request was
        # answered, and every figure is there, does.
        measured = sum(1 for t, _ in plan if t >= WARMUP)
        bad = [f"{r['target']}: {r['failed']} of {r['requests']} failed (of {measured} sent)"
               for r in rows if r["failed"] or r["requests"] != measured]
        bad += [f"{k}: {v} failed while warming up" for k, v in WARMUP_FAILED.items() if v]
        bad += [f"{r['target']}: no latency" for r in rows if math.isnan(r["p50_ms"]) or math.isnan(r["p99_ms"])]
        if not per_adapter:
            bad.append("warmgate counted no adapter loads (warmgate_adapter_loads_total)")
        if bad:
            print("adapters smoke: " + "; ".join(bad), file=sys.stderr)
            return 1
        print("adapters smoke: ok", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
