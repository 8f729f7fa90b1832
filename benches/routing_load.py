#!/usr/bin/env python3
"""Load driver for benches/routing.sh: LLM-aware routing against baselines.

Standard library only (asyncio and a small HTTP/1.1 client with keep-alive),
so the driver's own cost stays low on a 2-core machine.

    routing_load.py run --target NAME --mode gateway|hash|rr
        --engines http://127.0.0.1:P1,... [--url GATEWAY] [--model llm]
        [--workloads prefix,chat,skew,unique] --out FILE.json
    routing_load.py report FILE.json... [--json OUT]

`run` drives one target through the workloads, one phase each; before each
phase it waits until the engines are idle and empties their prefix caches
(`POST /reset_prefix_cache`), so every target starts every workload from
the same state. `mode` says where requests go: `gateway` to --url (warmgate
picks the replica), `hash` straight to the engine chosen by a stable hash of
the request's prefix group or session id, `rr` straight to the engines in
turn. Every target gets the same requests at the same times (seeded).

Workloads (all streamed chat completions, `stream_options.include_usage`):

- `prefix`: 64 groups, each a 2,048-word system prompt; each request is one
  group's system prompt and a 256-word question of its own; Poisson at
  ROUTING_RATE (50/s).
- `chat`: sessions of 6 turns, the whole conversation sent again each turn
  with the answer received and a new 160-word user message; 8 system
  prompts of 256 words shared between sessions; header `X-Session-Id` and
  the OpenAI `user` field are the session id; sessions start Poisson so that
  turns come at ROUTING_CHAT_RATE (110/s); think time between turns
  exponential, mean ROUTING_THINK_S (0.5 s).
- `skew`: as `prefix`, but group 0 has half of the traffic.
- `unique`: nothing shared: a 1,024-word prompt of its own per request.

Measured per phase: the cached-token ratio (sum of
`usage.prompt_tokens_details.cached_tokens` over sum of `prompt_tokens`),
TTFT p50/p90/p99 from the request's scheduled send time to its first
content chunk (open loop: a late send counts against the target), end to
end latency, requests sent per second of the phase, throughput (answered
requests over the time from the first send to the last answer), errors,
requests per replica (by the `X-Warmgate-Replica` header behind the
gateway, by engine when direct), and each engine's own counters from
/metrics (requests, prompt tokens, prefix cache hits, the largest wait
queue seen).

Environment: ROUTING_DURATION (s per phase, 20), ROUTING_DRAIN (s allowed
after the sending stops, 20), ROUTING_RATE (50), ROUTING_CHAT_RATE (110),
ROUTING_THINK_S (0.5), ROUTING_MAX_TOKENS (16), ROUTING_SEED (1); the
sizes, for engines that take less (real vLLM on a CPU): ROUTING_GROUPS
(64), ROUTING_SYSTEM_WORDS (2048), ROUTING_QUESTION_WORDS (256),
ROUTING_UNIQUE_WORDS (1024).
"""

import argparse
import asyncio
import hashlib
import json
import os
import random
import sys
import time
from urllib.parse import urlsplit

ENV = os.environ.get
DURATION = float(ENV("ROUTING_DURATION", "20"))
DRAIN = float(ENV("ROUTING_DRAIN", "20"))
RATE = float(ENV("ROUTING_RATE", "50"))
CHAT_RATE = float(ENV("ROUTING_CHAT_RATE", "110"))
THINK_S = float(ENV("ROUTING_THINK_S", "0.5"))
MAX_TOKENS = int(ENV("ROUTING_MAX_TOKENS", "16"))
SEED = int(ENV("ROUTING_SEED", "1"))

GROUPS = int(ENV("ROUTING_GROUPS", "64"))
SYSTEM_WORDS = int(ENV("ROUTING_SYSTEM_WORDS", "2048"))
QUESTION_WORDS = int(ENV("ROUTING_QUESTION_WORDS", "256"))
UNIQUE_WORDS = int(ENV("ROUTING_UNIQUE_WORDS", "1024"))
CHAT_TURNS = 6
CHAT_SYSTEMS = 8
CHAT_SYSTEM_WORDS = 256
CHAT_USER_WORDS = 160
WORKLOADS = ("prefix", "chat", "skew", "unique")


# --- a small HTTP/1.1 client ------------------------------------------------------

class HttpFailure(Exception):
    pass


class Pool:
    """Keep-alive connections to one host:port."""

    def __init__(self, url):
        u = urlsplit(url)
        self.host, self.port = u.hostname, u.port or 80
        self.base = u.path.rstrip("/")
        self.idle = []

    async def conn(self):
        while self.idle:
            r, w = self.idle.pop()
            if not w.is_closing() and not r.at_eof():
                return r, w
            w.close()
        return await asyncio.open_connection(self.host, self.port, limit=1 << 20)

    async def request(self, method, path, body=b"", headers=(), on_data=None):
        """Send one request; returns (status, headers, body). With on_data,
        the body is handed over piece by piece as it arrives instead."""
        r, w = await self.conn()
        ok = False
        try:
            head = [f"{method} {self.base}{path} HTTP/1.1", f"host: {self.host}:{self.port}",
                    f"content-length: {len(body)}"]
            if body:
                head.append("content-type: application/json")
            head += [f"{k}: {v}" for k, v in headers]
            w.write(("\r\n".join(head) + "\r\n\r\n").encode() + body)
            await w.drain()
            while True:
                raw = await r.readuntil(b"\r\n\r\n")
                lines = raw.decode("latin-1").split("\r\n")
                parts = lines[0].split(" ", 2)
                status = int(parts[1])
                if status >= 200:
                    break
            hdrs = {}
            for line in lines[1:]:
                if line:
                    k, _, v = line.partition(":")
                    hdrs[k.strip().lower()] = v.strip()
            out = []
            sink = on_data or out.append
            if method == "HEAD" or status in (204, 304):
                pass
            elif "chunked" in hdrs.get("transfer-encoding", "").lower():
                while True:
                    size = int((await r.readuntil(b"\r\n")).split(b";")[0], 16)
                    if size == 0:
                        while (await r.readuntil(b"\r\n")) != b"\r\n":
                            pass
                        break
                    sink(await r.readexactly(size))
                    await r.readexactly(2)
            elif "content-length" in hdrs:
                n = int(hdrs["content-length"])
                if n:
                    sink(await r.readexactly(n))
            else:
                sink(await r.read())
                hdrs["connection"] = "close"
            ok = "close" not in hdrs.get("connection", "").lower()
            return status, hdrs, b"".join(out)
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError, IndexError) as e:
            raise HttpFailure(f"{type(e).__name__}: {e}") from None
        finally:
            if ok:
                self.idle.append((r, w))
            else:
                w.close()

    def close(self):
        for _, w in self.idle:
            w.close()
        self.idle.clear()


# --- engines' /metrics ------------------------------------------------------------

def parse_metrics(text):
    """{name: value} summed over label sets, for the vllm:* samples."""
    out = {}
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        try:
            value = float(line.rsplit(" ", 1)[1])
        except (IndexError, ValueError):
            continue
        out[name] = out.get(name, 0.0) + value
    return out


class Engines:
    def __init__(self, urls):
        self.urls = urls
        self.pools = [Pool(u) for u in urls]

    async def metrics(self):
        async def one(p):
            s, _, b = await p.request("GET", "/metrics")
            if s != 200:
                raise HttpFailure(f"/metrics answered {s}")
            return parse_metrics(b.decode())
        return await asyncio.gather(*(one(p) for p in self.pools))

    async def wait_idle(self, limit):
        end = time.monotonic() + limit
        while True:
            ms = await self.metrics()
            busy = sum(m.get("vllm:num_requests_running", 0) + m.get("vllm:num_requests_waiting", 0) for m in ms)
            if busy == 0:
                return True
            if time.monotonic() > end:
                return False
            await asyncio.sleep(0.2)

    async def reset(self):
        for p in self.pools:
            s, _, b = await p.request("POST", "/reset_prefix_cache")
            if s != 200:
                raise HttpFailure(f"POST /reset_prefix_cache answered {s}: {b[:200]!r}")


# --- workloads --------------------------------------------------------------------

def make_vocab(rng, n=4000):
    letters = "abcdefghijklmnopqrstuvwxyz"
    return ["".join(rng.choice(letters) for _ in range(rng.randint(3, 9))) for _ in range(n)]


def words(rng, vocab, n):
    return " ".join(rng.choices(vocab, k=n))


def stable_hash(key):
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")


class Phase:
    """One target × workload: sends, collects, summarises."""

    def __init__(self, args, workload, engines):
        self.args = args
        self.workload = workload
        self.engines = engines
        self.mode = args.mode
        self.gw = Pool(args.url) if args.mode == "gateway" else None
        self.rr = 0
        self.results = []
        self.tasks = set()

    def pick(self, key):
        """The pool to send to and the replica label, for direct modes."""
        if self.mode == "gateway":
            return self.gw, None
        n = len(self.engines.pools)
        if self.mode == "hash":
            i = stable_hash(key) % n
        else:
            i = self.rr % n
            self.rr += 1
        return self.engines.pools[i], f"engine{i}"

    async def send(self, key, messages, scheduled, session=None):
        """One streamed chat completion; returns the answer's text or None."""
        pool, replica = self.pick(key)
        body = {"model": self.args.model, "messages": messages, "max_tokens": MAX_TOKENS,
                "stream": True, "stream_options": {"include_usage": True}}
        headers = []
        if session:
            body["user"] = session
            headers.append(("x-session-id", session))
        res = {"scheduled": scheduled, "ttft": None, "end": None, "status": None, "error": None,
               "prompt": 0, "cached": 0, "out": 0, "replica": replica}
        text = []
        buf = bytearray()
        loop = asyncio.get_running_loop()
        done = [False]

        def on_data(data):
            buf.extend(data)
            while True:
                i = buf.find(b"\n\n")
                if i < 0:
                    return
                ev = bytes(buf[:i])
                del buf[:i + 2]
                for line in ev.split(b"\n"):
                    if not line.startswith(b"data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == b"[DONE]":
                        done[0] = True
                        continue
                    try:
                        chunk = json.loads(payload)
                    except ValueError:
                        res["error"] = "bad SSE data"
                        continue
                    for c in chunk.get("choices") or ():
                        piece = (c.get("delta") or {}).get("content")
                        if piece:
                            if res["ttft"] is None:
                                res["ttft"] = loop.time() - scheduled
                            text.append(piece)
                    u = chunk.get("usage")
                    if u:
                        res["prompt"] = u.get("prompt_tokens", 0)
                        res["out"] = u.get("completion_tokens", 0)
                        res["cached"] = ((u.get("prompt_tokens_details") or {}).get("cached_tokens")) or 0
        self.results.append(res)
        try:
            status, hdrs, rest = await pool.request(
                "POST", "/v1/chat/completions", json.dumps(body).encode(), headers, on_data)
            res["status"] = status
            if self.mode == "gateway":
                res["replica"] = hdrs.get("x-warmgate-replica", "?")
            if status != 200:
                res["error"] = f"HTTP {status}"
            elif not done[0]:
                res["error"] = "no [DONE]"
            elif not res["prompt"]:
                res["error"] = "no usage"
        except HttpFailure as e:
            res["error"] = str(e)
        except asyncio.CancelledError:
            res["error"] = "timeout"
            raise
        finally:
            res["end"] = loop.time()
        return None if res["error"] else "".join(text)

    def spawn(self, coro):
        t = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(t)
        t.add_done_callback(self.tasks.discard)

    async def drive(self):
        loop = asyncio.get_running_loop()
        rng = random.Random(SEED * 1000 + WORKLOADS.index(self.workload))
        vocab = make_vocab(random.Random(SEED))
        w = self.workload
        self.t0 = loop.time()
        stop = self.t0 + DURATION
        if w in ("prefix", "skew"):
            systems = [words(random.Random(f"{SEED}-sys-{g}"), vocab, SYSTEM_WORDS) for g in range(GROUPS)]
            t = self.t0
            n = 0
            while True:
                t += rng.expovariate(RATE)
                if t >= stop:
                    break
                if w == "skew" and rng.random() < 0.5:
                    g = 0
                else:
                    g = rng.randrange(GROUPS)
                msgs = [{"role": "system", "content": systems[g]},
                        {"role": "user", "content": words(rng, vocab, QUESTION_WORDS)}]
                await asyncio.sleep(max(0.0, t - loop.time()))
                self.spawn(self.send(f"group-{g}", msgs, t))
                n += 1
        elif w == "unique":
            t = self.t0
            n = 0
            while True:
                t += rng.expovariate(RATE)
                if t >= stop:
                    break
                msgs = [{"role": "user", "content": words(rng, vocab, UNIQUE_WORDS)}]
                await asyncio.sleep(max(0.0, t - loop.time()))
                self.spawn(self.send(f"req-{n}", msgs, t))
                n += 1
        elif w == "chat":
            systems = [words(random.Random(f"{SEED}-chat-{i}"), vocab, CHAT_SYSTEM_WORDS)
                       for i in range(CHAT_SYSTEMS)]
            t = self.t0
            n = 0
            while True:
                t += rng.expovariate(CHAT_RATE / CHAT_TURNS)
                if t >= stop:
                    break
                sid = f"s{SEED}-{n:05d}"
                srng = random.Random(f"{SEED}-session-{n}")
                await asyncio.sleep(max(0.0, t - loop.time()))
                self.spawn(self.session(sid, srng, systems[srng.randrange(CHAT_SYSTEMS)], vocab, t))
                n += 1
        self.sent_until = loop.time()
        deadline = stop + DRAIN
        while self.tasks and loop.time() < deadline:
            await asyncio.wait(set(self.tasks), timeout=max(0.0, deadline - loop.time()))
        for t in list(self.tasks):
            t.cancel()
        if self.tasks:
            await asyncio.gather(*self.tasks, return_exceptions=True)
        if self.gw:
            self.gw.close()

    async def session(self, sid, srng, system, vocab, start):
        loop = asyncio.get_running_loop()
        msgs = [{"role": "system", "content": system}]
        t = start
        for turn in range(CHAT_TURNS):
            if turn:
                t = loop.time() + srng.expovariate(1.0 / THINK_S) if THINK_S > 0 else loop.time()
                await asyncio.sleep(max(0.0, t - loop.time()))
            msgs.append({"role": "user", "content": words(srng, vocab, CHAT_USER_WORDS)})
            answer = await self.send(sid, list(msgs), t, session=sid)
            if answer is None:
                return
            msgs.append({"role": "assistant", "content": answer})


def pct(values, p):
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, max(0, int(round(p / 100.0 * len(v) + 0.5)) - 1))]


async def monitor(engines, peaks, stop):
    """The largest wait queue and running count each engine shows."""
    while not stop.is_set():
        try:
            for i, m in enumerate(await engines.metrics()):
                peaks[i]["max_waiting"] = max(peaks[i]["max_waiting"], m.get("vllm:num_requests_waiting", 0))
                peaks[i]["max_running"] = max(peaks[i]["max_running"], m.get("vllm:num_requests_running", 0))
        except HttpFailure:
            pass
        try:
            await asyncio.wait_for(stop.wait(), 0.5)
        except asyncio.TimeoutError:
            pass


async def run_phase(args, workload, engines):
    if not await engines.wait_idle(60):
        print(f"warning: engines still busy before {args.target}/{workload}", file=sys.stderr)
    await engines.reset()
    before = await engines.metrics()
    peaks = [{"max_waiting": 0, "max_running": 0} for _ in engines.urls]
    stop = asyncio.Event()
    mon = asyncio.get_running_loop().create_task(monitor(engines, peaks, stop))
    phase = Phase(args, workload, engines)
    await phase.drive()
    stop.set()
    await mon
    idle = await engines.wait_idle(30)
    after = await engines.metrics()

    R = phase.results
    ok = [r for r in R if not r["error"]]
    errors = {}
    for r in R:
        if r["error"]:
            errors[r["error"]] = errors.get(r["error"], 0) + 1
    ttft = [r["ttft"] * 1e3 for r in ok if r["ttft"] is not None]
    lat = [(r["end"] - r["scheduled"]) * 1e3 for r in ok]
    prompt = sum(r["prompt"] for r in ok)
    cached = sum(r["cached"] for r in ok)
    end = max((r["end"] for r in ok), default=phase.t0 + DURATION)
    span = max(end - phase.t0, 1e-9)
    per_replica = {}
    for r in R:
        per_replica[r["replica"] or "?"] = per_replica.get(r["replica"] or "?", 0) + 1
    counts = sorted(per_replica.values())
    eng = []
    for i, (b, a) in enumerate(zip(before, after)):
        d = lambda k: a.get(k, 0.0) - b.get(k, 0.0)
        q = d("vllm:prefix_cache_queries_total")
        eng.append({"url": engines.urls[i], "requests": int(d("vllm:request_success_total")),
                    "prompt_tokens": int(d("vllm:prompt_tokens_total")),
                    "cache_hit_tokens": int(d("vllm:prefix_cache_hits_total")),
                    "cache_hit_ratio": d("vllm:prefix_cache_hits_total") / q if q else None,
                    **peaks[i]})
    nreq = [e["requests"] for e in eng]
    mean = sum(nreq) / len(nreq) if nreq else 0
    r2 = lambda x: None if x is None else round(x, 2)
    out = {
        "target": args.target, "mode": args.mode, "workload": workload,
        "duration_s": DURATION, "offered_rps": CHAT_RATE if workload == "chat" else RATE,
        "sent": len(R), "ok": len(ok), "errors": len(R) - len(ok), "error_kinds": errors,
        "cached_ratio": round(cached / prompt, 4) if prompt else None,
        "prompt_tokens": prompt, "cached_tokens": cached,
        "ttft_ms": {"p50": r2(pct(ttft, 50)), "p90": r2(pct(ttft, 90)), "p99": r2(pct(ttft, 99))},
        "latency_ms": {"p50": r2(pct(lat, 50)), "p99": r2(pct(lat, 99))},
        "sent_rps": round(len(R) / DURATION, 2),
        "throughput_rps": round(len(ok) / span, 2),
        "per_replica": dict(sorted(per_replica.items())),
        "engine_imbalance": round(max(nreq) / mean, 3) if mean else None,
        "engines": eng,
        "engines_idle_after": idle,
    }
    return out


async def run(args):
    engines = Engines(args.engines.split(","))
    results = []
    for w in args.workloads.split(","):
        if w not in WORKLOADS:
            sys.exit(f"unknown workload {w!r}; known: {', '.join(WORKLOADS)}")
        t = time.monotonic()
        r = await run_phase(args, w, engines)
        results.append(r)
        print(f"{args.target:>24} {w:>7}: {r['ok']}/{r['sent']} ok, cached {fmt(r['cached_ratio'])}, "
              f"TTFT p50/p90/p99 {fmt(r['ttft_ms']['p50'])}/{fmt(r['ttft_ms']['p90'])}/"
              f"{fmt(r['ttft_ms']['p99'])} ms, {r['throughput_rps']} req/s, engines "
              f"{[e['requests'] for e in r['engines']]}, max waiting "
              f"{[int(e['max_waiting']) for e in r['engines']]} ({time.monotonic() - t:.0f} s)",
              file=sys.stderr, flush=True)
    for p in engines.pools:
        p.close()
    prev = []
    if os.path.exists(args.out):
        with open(args.out) as f:
            prev = json.load(f)
    with open(args.out, "w") as f:
        json.dump(prev + results, f, indent=1)


def fmt(x, nd=0):
    if x is None:
        return "-"
    if isinstance(x, float) and x < 1.5 and nd == 0:
        return f"{x:.3f}"
    return f"{x:.{nd}f}"


def report(args):
    rows = []
    for path in args.files:
        with open(path) as f:
            rows += json.load(f)
    if not rows:
        sys.exit("no results")
    targets = list(dict.fromkeys(r["target"] for r in rows))
    if args.order:
        order = args.order.split(",")
        targets.sort(key=lambda t: order.index(t) if t in order else len(order))
    workloads = [w for w in WORKLOADS if any(r["workload"] == w for r in rows)]
    by = {(r["target"], r["workload"]): r for r in rows}
    lines = [
        f"## LLM routing: {len(targets)} targets × {len(workloads)} workloads, "
        f"{rows[0]['duration_s']:.0f} s each, "
        f"{ENV('ROUTING_ENGINES_SAID', '4 engines (tests/standins/llm_engine.py)')}",
        "",
        "| workload | target | cached ratio | TTFT p50 ms | p90 ms | p99 ms | e2e p99 ms | sent/s | done/s | ok | errors | requests per engine | max waiting per engine |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for w in workloads:
        for t in targets:
            r = by.get((t, w))
            if not r:
                continue
            lines.append(
                f"| {w} | {t} | {fmt(r['cached_ratio'])} | {fmt(r['ttft_ms']['p50'])} | "
                f"{fmt(r['ttft_ms']['p90'])} | {fmt(r['ttft_ms']['p99'])} | {fmt(r['latency_ms']['p99'])} | "
                f"{r['sent_rps']:.1f} | {r['throughput_rps']:.1f} | {r['ok']} | {r['errors']} | "
                f"{' '.join(str(e['requests']) for e in r['engines'])} | "
                f"{' '.join(str(int(e['max_waiting'])) for e in r['engines'])} |")
    # Ratios against the baselines present.
    base = [b for b in ("warmgate-least_loaded", "direct-rr", "direct-hash") if b in targets]
    others = [t for t in targets if t not in ("direct-rr",)]
    ratio_lines = []
    for w in workloads:
        for t in others:
            for b in base:
                if b == t or (t, w) not in by or (b, w) not in by:
                    continue
                r, s = by[(t, w)], by[(b, w)]
                cr = (r["cached_ratio"] / s["cached_ratio"]) if r["cached_ratio"] and s["cached_ratio"] else None
                p90 = (r["ttft_ms"]["p90"] / s["ttft_ms"]["p90"]) if r["ttft_ms"]["p90"] and s["ttft_ms"]["p90"] else None
                ratio_lines.append(f"| {w} | {t} / {b} | {fmt(cr, 2)} | {fmt(p90, 2)} |")
    if ratio_lines:
        lines += ["", "Ratios (target / baseline): cached ratio (higher is better), TTFT p90 (lower is better)",
                  "", "| workload | target / baseline | cached | TTFT p90 |", "|---|---|---:|---:|"] + ratio_lines
    text = "\n".join(lines) + "\n"
    print(text)
    if args.md:
        with open(args.md, "w") as f:
            f.write(text)
    if args.json:
        import datetime
        import platform
        with open(args.json, "w") as f:
            json.dump({
                "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.release()}",
                "settings": {"duration_s": DURATION, "drain_s": DRAIN, "rate": RATE,
                             "chat_rate": CHAT_RATE, "think_s": THINK_S, "max_tokens": MAX_TOKENS,
                             "seed": SEED, "groups": GROUPS, "system_words": SYSTEM_WORDS,
                             "question_words": QUESTION_WORDS, "unique_words": UNIQUE_WORDS,
                             "chat": {"turns": CHAT_TURNS, "systems": CHAT_SYSTEMS,
                                      "system_words": CHAT_SYSTEM_WORDS, "user_words": CHAT_USER_WORDS}},
                "results": rows,
            }, f, indent=1)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--target", required=True)
    r.add_argument("--mode", choices=("gateway", "hash", "rr"), required=True)
    r.add_argument("--url", help="the gateway's base URL (mode gateway)")
    r.add_argument("--engines", required=True, help="the engines' base URLs, comma separated")
    r.add_argument("--model", default="llm")
    r.add_argument("--workloads", default=",".join(WORKLOADS))
    r.add_argument("--out", required=True)
    s = sub.add_parser("report")
    s.add_argument("files", nargs="+")
    s.add_argument("--order", help="the targets' order in the table, comma separated")
    s.add_argument("--json")
    s.add_argument("--md")
    args = p.parse_args()
    if args.cmd == "run":
        if args.mode == "gateway" and not args.url:
            p.error("--mode gateway needs --url")
        asyncio.run(run(args))
    else:
        report(args)


if __name__ == "__main__":
    main()
