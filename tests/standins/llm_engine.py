#!/usr/bin/env python3
"""A stand-in vLLM engine: vLLM's OpenAI-compatible server where it matters
for routing (prefix cache, slots, a wait queue, usage and /metrics), with
no model and no GPU. Standard library only (asyncio).

    python3 tests/standins/llm_engine.py --port P [--model NAME] [--slots 4]
        [--prefill-ms-per-token 0.15] [--decode-ms-per-token 4]
        [--cache-tokens 64000] [--block-tokens 16] [--max-model-len 32768]
        [--load-seconds 0] [--host 127.0.0.1]

Each flag may come from the environment instead: ``STANDIN_MODEL``,
``STANDIN_SLOTS``, ``STANDIN_PREFILL_MS_PER_TOKEN``,
``STANDIN_DECODE_MS_PER_TOKEN``, ``STANDIN_CACHE_TOKENS``,
``STANDIN_BLOCK_TOKENS``, ``STANDIN_MAX_MODEL_LEN``, ``STANDIN_LOAD_SECONDS``
(a flag wins over its variable). ``--uds PATH`` listens on a Unix socket
instead, as vLLM's flag does (host and port are then ignored). Without
``--port`` the port is ``$PORT``
(warmgate gives each replica one), else 8000. ``--served-model-name`` is
taken as a synonym of ``--model`` (several names may be given, comma
separated; the first is the one reported).

Routes (as vLLM answers them):

- ``GET /health``: 200, empty body.
- ``GET /v1/models``: the OpenAI list with the model.
- ``POST /v1/completions`` (``prompt``: a string, a list of one string, or
  a list of token ids) and ``POST /v1/chat/completions`` (``messages``).
  ``max_tokens`` (chat also ``max_completion_tokens``) output tokens,
  default 16 (vLLM's chat default is the rest of the context; 16 here so a
  request that forgets it stays short). Always exactly that many tokens are
  generated, so ``finish_reason`` is ``"length"``. ``stream: true`` gives
  Server-Sent Events like vLLM's: for chat a first chunk with
  ``delta: {"role": "assistant", "content": ""}``, then one chunk per token,
  the last token's chunk carrying ``finish_reason`` (vLLM sends them
  together), with ``stream_options.include_usage`` a usage chunk with
  ``choices: []``, then ``data: [DONE]``; ``continuous_usage_stats`` puts
  usage on every chunk. Usage always has ``prompt_tokens``,
  ``completion_tokens``, ``total_tokens`` and ``prompt_tokens_details:
  {"cached_tokens": N}`` (real vLLM reports the details only when started
  with ``--enable-prompt-tokens-details``; this stand-in always does).
- ``GET /metrics``: Prometheus text with vLLM's names and its ``engine`` and
  ``model_name`` labels: ``vllm:num_requests_running``,
  ``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc`` (gauges),
  ``vllm:prefix_cache_queries_total``, ``vllm:prefix_cache_hits_total``
  (counters, in tokens), ``vllm:prompt_tokens_total``,
  ``vllm:generation_tokens_total``, ``vllm:request_success_total``
  (by ``finished_reason``).
- ``POST /reset_prefix_cache``: empties the prefix cache (vLLM has this
  path in its dev mode, ``VLLM_SERVER_DEV_MODE=1``); counters keep going,
  as in vLLM: take differences.
- ``GET /version``.
- New weights in place, as vLLM in its dev mode (``VLLM_SERVER_DEV_MODE=1``;
  without it the routes answer 404, as vLLM does not register them):
  ``POST /collective_rpc {"method": "reload_weights", "kwargs":
  {"weights_path": DIR}}`` reads the ``*.safetensors`` files of DIR (a
  folder without one gets vLLM's 500) and answers ``{"results": [null]}``;
  the weights' digest enters the hash that picks the output words, so the
  answers change with the weights, as a real model's do. Another method
  gets a 500. The prefix cache is kept, as vLLM's reload keeps it.
  ``POST /update_weight_version {"new_version": "N"}`` answers
  ``{"success": true, "new_version": "N"}`` and ``GET /weight_info``
  ``{"weight_version": "N"}`` (``null`` until set).
- LoRA adapters, as vLLM with ``--enable-lora`` and
  ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`` (without that variable the two
  routes answer 404, as vLLM does not register them):
  ``POST /v1/load_lora_adapter {"lora_name", "lora_path"}`` answers 200
  ``Success: LoRA adapter 'NAME' added successfully.`` after
  ``--lora-load-ms``; a name already loaded gets 400 ``The lora adapter
  'NAME' has already been loaded.``; a ``lora_path`` that is not a folder
  with ``adapter_config.json`` gets 400. ``POST /v1/unload_lora_adapter
  {"lora_name"}`` answers 200, or 404 ``The lora adapter 'NAME' cannot be
  found.``. ``/v1/models`` lists each loaded adapter with ``root`` its path
  and ``parent`` the base model. A request whose ``model`` is a loaded
  adapter is served; one not loaded gets vLLM's 404. At most
  ``--max-loras`` adapters are active at once (vLLM's GPU slots, LRU): a
  request for a loaded adapter that is not active waits ``--lora-load-ms``
  while it is swapped in (vLLM moves it from its CPU cache). Every load and
  swap counts in ``standin:lora_loads_total`` (the stand-in's own counter;
  vLLM has none), and ``vllm:lora_requests_info`` gives the running
  adapters and ``max_lora`` as vLLM's does. ``--lora-modules NAME=PATH
  ...`` loads adapters at start, as vLLM's option does.

Tokenisation: the prompt text split on whitespace (``str.split()``); each
word is one token. A chat is first rendered to one text, like a chat
template: for each message ``"<|ROLE|>\\n" + content + "\\n"``, then the
generation prompt ``"<|assistant|>\\n"``; so ``<|user|>`` is one token, and
a conversation sent again with the assistant's answer and one more user
turn appended starts with the earlier prompt and answer, token for token.
The generated tokens are words from a small vocabulary picked by a hash of
the prompt (deterministic), each chunk's text being ``" " + word``.

Prefix cache, as vLLM's automatic prefix caching: the tokens are cut into
full blocks of ``block_tokens``; block i's key is a hash of (block i-1's
key, block i's tokens), so a key names its whole prefix. A request counts
the leading blocks found in the cache (stopping at the first miss); as in
vLLM at least the prompt's last token is always computed, so a prompt that
is all full blocks, all cached, gets its last block recomputed.
``cached_tokens`` = hit blocks × ``block_tokens``. The cache is LRU over
blocks, ``cache_tokens / block_tokens`` blocks; after a request's prefill
its prompt's full blocks are inserted (or touched), and when it finishes
the full blocks of prompt + output (vLLM caches generated blocks too).
Blocks of running requests always count as hits (vLLM never evicts a block
in use).

Scheduling: at most ``slots`` requests run at once, the others wait in
FIFO order (``vllm:num_requests_waiting``); hits are looked up when a
request is scheduled. A running request sleeps ``prefill_ms_per_token`` ×
its uncached tokens, sends its first token, then one token each
``decode_ms_per_token`` (kept on a fixed schedule from the first token).
Timing is asyncio sleeps only: requests do not slow each other but for the
slots, as a batch on a GPU. A streamed response's headers are sent at once
(as vLLM's), its first data after prefill. A client that goes away while
its request waits or runs has it dropped (as vLLM aborts it).
``vllm:kv_cache_usage_perc`` is, as in vLLM, the blocks held by running
requests over all blocks (cached blocks no one uses count as free).

HTTP/1.1 with keep-alive; JSON bodies with Content-Length, streams in
chunked encoding. A malformed request gets a 400 with vLLM's error body
``{"error": {"message", "type", "param", "code"}}``; an unknown path a 404
``{"detail": "Not Found"}`` (FastAPI's). SIGTERM (or SIGINT): stop
listening, finish what is in flight, exit 0.
"""

import argparse
import asyncio
import collections
import hashlib
import json
import os
import signal
import sys
import time
import uuid

VOCAB = (
    "the of and to in is was for on that with as by at from it an be are this "
    "which or had not but were have has their more one all can been new other "
    "when there some time would about what into only also after first out two "
    "over most many such these could made like well then them may"
).split()

MAX_HEADER_BYTES = 64 * 1024
MAX_BODY_BYTES = 64 * 1024 * 1024


# --- configuration ------------------------------------------------------------

def parse_args(argv):
    env = os.environ.get
    p = argparse.ArgumentParser(description="a stand-in vLLM engine")
    p.add_argument("--host", default=env("STANDIN_HOST", "127.0.0.1"))
    p.add_argument("--port", type=int, default=None)
    p.add_argument("--uds", default=None, help="a Unix socket to listen on, as vLLM's --uds")
    p.add_argument("--model", "--served-model-name", dest="model",
                   default=env("STANDIN_MODEL", "standin"))
    p.add_argument("--slots", type=int, default=int(env("STANDIN_SLOTS", "4")))
    p.add_argument("--prefill-ms-per-token", type=float,
                   default=float(env("STANDIN_PREFILL_MS_PER_TOKEN", "0.15")))
    p.add_argument("--decode-ms-per-token", type=float,
                   default=float(env("STANDIN_DECODE_MS_PER_TOKEN", "4")))
    p.add_argument("--cache-tokens", type=int,
                   default=int(env("STANDIN_CACHE_TOKENS", "64000")))
    p.add_argument("--block-tokens", type=int,
                   default=int(env("STANDIN_BLOCK_TOKENS", "16")))
    p.add_argument("--max-model-len", type=int,
                   default=int(env("STANDIN_MAX_MODEL_LEN", "32768")))
    p.add_argument("--load-seconds", type=float,
                   default=float(env("STANDIN_LOAD_SECONDS", "0")))
    p.add_argument("--max-loras", type=int, default=int(env("STANDIN_MAX_LORAS", "1")))
    p.add_argument("--lora-load-ms", type=float,
                   default=float(env("STANDIN_LORA_LOAD_MS", "200")))
    p.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                   help="adapters loaded at start, as vLLM's --lora-modules")
    a = p.parse_args(argv)
    if a.port is None:
        port = os.environ.get("PORT", "8000")
        try:
            a.port = int(port)
        except ValueError:
            p.error(f"$PORT is {port!r}, not a number")
    if a.max_loras < 1 or a.lora_load_ms < 0:
        p.error("--max-loras must be >= 1 and --lora-load-ms >= 0")
    if any("=" not in m for m in a.lora_modules):
        p.error("--lora-modules takes NAME=PATH pairs")
    if a.slots < 1 or a.block_tokens < 1 or a.cache_tokens < 0 or a.max_model_len < 1:
        p.error("--slots, --block-tokens, --max-model-len must be >= 1, --cache-tokens >= 0")
    if a.prefill_ms_per_token < 0 or a.decode_ms_per_token < 0:
        p.error("the per-token times must be >= 0")
    names = [n.strip() for n in a.model.split(",") if n.strip()]
    if not names:
        p.error("--model is empty")
    a.names = names
    a.model = names[0]
    return a


# --- errors -------------------------------------------------------------------

class ApiError(Exception):
    def __init__(self, status, message, kind="BadRequestError", param=None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param

    def body(self):
        return {"error": {"message": self.message, "type": self.kind,
                          "param": self.param, "code": self.status}}


def bad(message, param=None):
    return ApiError(400, message, "BadRequestError", param)


# --- the prefix cache ----------------------------------------------------------

class PrefixCache:
    """LRU over block keys; a key is the chained hash of a full block."""

    def __init__(self, capacity_blocks, block_tokens):
        self.capacity = capacity_blocks
        self.bt = block_tokens
        self.lru = collections.OrderedDict()   # key -> None, oldest first
        self.in_use = collections.Counter()   # keys held by running requests
        self.partial_in_use = 0               # non-full blocks of running requests

    def keys(self, tokens, start_parent=b"", start=0):
        """Chained keys of the full blocks of tokens[start:], given the key
        of the block before them."""
        out = []
        parent = start_parent
        bt = self.bt
        end = len(tokens) - (len(tokens) - start) % bt
        for i in range(start, end, bt):
            h = hashlib.blake2b(parent, digest_size=16)
            h.update("\n".join(tokens[i:i + bt]).encode())
            parent = h.digest()
            out.append(parent)
        return out

    def hits(self, keys, n_tokens):
        limit = (n_tokens - 1) // self.bt if n_tokens else 0
        n = 0
        for k in keys[:limit]:
            if k in self.lru or k in self.in_use:
                n += 1
            else:
                break
        return n

    def insert(self, keys):
        if self.capacity <= 0:
            return
        lru = self.lru
        for k in keys:
            if k in lru:
                lru.move_to_end(k)
            else:
                lru[k] = None
        while len(lru) > self.capacity:
            lru.popitem(last=False)

    def hold(self, keys, partial):
        self.in_use.update(keys)
        self.partial_in_use += partial

    def unhold(self, keys, partial):
        self.in_use.subtract(keys)
        for k in keys:
            if self.in_use[k] <= 0:
                del self.in_use[k]
        self.partial_in_use -= partial

    def usage(self):
        if self.capacity <= 0:
            return 0.0
        return min(1.0, (len(self.in_use) + self.partial_in_use) / self.capacity)

    def reset(self):
        self.lru.clear()


# --- the scheduler ---------------------------------------------------------------

class Scheduler:
    """`slots` running at once, the rest in FIFO order."""

    def __init__(self, slots):
        self.slots = slots
        self.running = 0
        self.waiting = collections.deque()

    async def acquire(self, gone):
        """Wait for a slot; `gone()` tells whether the client left (then the
        request leaves the queue and ClientGone is raised)."""
        if self.running < self.slots and not self.waiting:
            self.running += 1
            return
        fut = asyncio.get_running_loop().create_future()
        self.waiting.append(fut)
        try:
            while True:
                done, _ = await asyncio.wait({fut}, timeout=0.25)
                if done:
                    return  # the slot was handed over by release()
                if gone():
                    raise ClientGone()
        except BaseException:
            if fut.done() and not fut.cancelled():
                self.release()
            else:
                fut.cancel()
                try:
                    self.waiting.remove(fut)
                except ValueError:
                    pass
            raise

    def release(self):
        while self.waiting:
            fut = self.waiting.popleft()
            if not fut.done():
                fut.set_result(None)  # the slot passes on; running stays
                return
        self.running -= 1


class ClientGone(Exception):
    pass


# --- the engine ----------------------------------------------------------------

class Loras:
    """Adapters loaded (name -> path) and the active ones (LRU, at most
    max_loras), as vLLM's LoRA manager keeps them."""

    def __init__(self, max_loras, load_ms):
        self.max, self.load_ms = max_loras, load_ms
        self.loaded = {}
        self.active = collections.OrderedDict()
        self.loads = 0
        self.running = collections.Counter()
        self.lock = asyncio.Lock()

    async def load(self, name, path):
        if name in self.loaded:
            raise ApiError(400, f"The lora adapter '{name}' has already been loaded.",
                           "InvalidUserInput")
        if not os.path.isfile(os.path.join(str(path), "adapter_config.json")):
            raise ApiError(400, f"Loading lora {name} failed: No adapter found for {path}",
                           "BadRequestError")
        async with self.lock:
            await asyncio.sleep(self.load_ms / 1000)
            self.loads += 1
            self.loaded[name] = path
            self.activate(name)

    def unload(self, name):
        if name not in self.loaded:
            raise ApiError(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError")
        del self.loaded[name]
        self.active.pop(name, None)

    def activate(self, name):
        self.active[name] = True
        self.active.move_to_end(name)
        while len(self.active) > self.max:
            self.active.popitem(last=False)

    async def use(self, name):
        """Makes `name` active, swapping it in (a load) if it is not."""
        if name in self.active:
            self.active.move_to_end(name)
            return
        async with self.lock:
            if name not in self.active:
                await asyncio.sleep(self.load_ms / 1000)
                self.loads += 1
            if name in self.loaded:
                self.activate(name)


class Engine:
    def __init__(self, cfg):
        self.cfg = cfg
        self.loras = Loras(cfg.max_loras, cfg.lora_load_ms)
        for m in cfg.lora_modules:
            name, path = m.split("=", 1)
            self.loras.loaded[name] = path
        self.cache = PrefixCache(cfg.cache_tokens // cfg.block_tokens, cfg.block_tokens)
        self.sched = Scheduler(cfg.slots)
        self.c = collections.Counter()  # counters
        self.created = int(time.time())
        # A digest of the weights reloaded in place (empty: the ones it
        # started with), and the version last named.
        self.weights = b""
        self.weight_version = None

    def reload_weights(self, path):
        """Reads the safetensors files of folder `path` as the new weights."""
        try:
            names = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
        except OSError as e:
            raise ApiError(500, f"cannot read weights_path {path!r}: {e}", "InternalServerError")
        if not names:
            raise ApiError(500, f"no *.safetensors file in {path!r}", "InternalServerError")
        h = hashlib.blake2b(digest_size=8)
        for n in names:
            with open(os.path.join(path, n), "rb") as f:
                h.update(f.read())
        self.weights = h.digest()

    def usage(self, n_prompt, n_out, cached):
        return {"prompt_tokens": n_prompt, "total_tokens": n_prompt + n_out,
                "completion_tokens": n_out,
                "prompt_tokens_details": {"cached_tokens": cached}}

    async def generate(self, tokens, n_out, gone, emit, salt=b""):
        """Run one request: wait for a slot, prefill, decode. `emit(i, word,
        cached)` is awaited for each output token i. Returns cached tokens.
        `salt` (the request's ``cache_salt``) enters the first block's key,
        as vLLM's does: requests with other salts share no block."""
        cfg, cache = self.cfg, self.cache
        keys = cache.keys(tokens, salt)
        # A hash of the whole prompt picks the output words.
        tail = hashlib.blake2b(keys[-1] if keys else b"", digest_size=8)
        tail.update("\n".join(tokens[len(keys) * cfg.block_tokens:]).encode())
        tail.update(self.weights)
        x = int.from_bytes(tail.digest(), "little")
        words = []
        for _ in range(n_out):
            x = (x * 6364136223846793005 + 1442695040888963407) & 0xFFFFFFFFFFFFFFFF
            words.append(VOCAB[(x >> 33) % len(VOCAB)])
        await self.sched.acquire(gone)
        held = None
        try:
            if gone():
                raise ClientGone()
            hit = cache.hits(keys, len(tokens))
            cached = hit * cfg.block_tokens
            self.c["prefix_cache_queries"] += len(tokens)
            self.c["prefix_cache_hits"] += cached
            self.c["prompt_tokens"] += len(tokens)
            total = len(tokens) + n_out
            partial = -(-total // cfg.block_tokens) - len(keys)
            held = (keys, partial)
            # The request's blocks are taken (prompt blocks now; the output
            # blocks counted as partial until they exist).
            cache.hold(keys, partial)
            delay = (len(tokens) - cached) * cfg.prefill_ms_per_token / 1000.0
            # A long prefill is watched for the client leaving, as vLLM
            # aborts a request between its scheduler's steps.
            end = time.monotonic() + delay
            while delay > 0:
                await asyncio.sleep(min(delay, 0.05))
                if gone():
                    raise ClientGone()
                delay = end - time.monotonic()
            cache.insert(keys)
            t0 = time.monotonic()
            step = cfg.decode_ms_per_token / 1000.0
            for i, w in enumerate(words):
                if i:
                    wait = t0 + i * step - time.monotonic()
                    if wait > 0:
                        await asyncio.sleep(wait)
                if gone():
                    raise ClientGone()
                self.c["generation_tokens"] += 1
                await emit(i, w, cached)
            # Finished: the full blocks of prompt + output go to the cache.
            out_keys = cache.keys(tokens + words, keys[-1] if keys else salt, len(keys) * cfg.block_tokens)
            cache.insert(keys + out_keys)
            self.c["request_success"] += 1
            return cached
        finally:
            if held is not None:
                cache.unhold(*held)
            self.sched.release()

    def metrics(self):
        name = self.cfg.model.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
        lbl = '{engine="0",model_name="%s"}' % name
        lbl_ok = '{engine="0",finished_reason="length",model_name="%s"}' % name
        out = []

        def one(name, kind, help_, value, labels=lbl):
            out.append(f"# HELP {name} {help_}\n# TYPE {name} {kind}\n{name}{labels} {float(value)!r}\n")

        one("vllm:num_requests_running", "gauge",
            "Number of requests in model execution batches.", self.sched.running)
        one("vllm:num_requests_waiting", "gauge",
            "Number of requests waiting to be processed.", len(self.sched.waiting))
        one("vllm:kv_cache_usage_perc", "gauge",
            "KV-cache usage. 1 means 100 percent usage.", self.cache.usage())
        one("vllm:prefix_cache_queries_total", "counter",
            "Prefix cache queries, in terms of number of queried tokens.",
            self.c["prefix_cache_queries"])
        one("vllm:prefix_cache_hits_total", "counter",
            "Prefix cache hits, in terms of number of cached tokens.",
            self.c["prefix_cache_hits"])
        one("vllm:prompt_tokens_total", "counter",
            "Number of prefill tokens processed.", self.c["prompt_tokens"])
        one("vllm:generation_tokens_total", "counter",
            "Number of generation tokens processed.", self.c["generation_tokens"])
        one("vllm:request_success_total", "counter",
            "Count of successfully processed requests.", self.c["request_success"], lbl_ok)
        running = ",".join(sorted(n for n, c in self.loras.running.items() if c > 0))
        one("vllm:lora_requests_info", "gauge", "Running stats on lora requests.", time.time(),
            '{max_lora="%d",running_lora_adapters="%s",waiting_lora_adapters=""}'
            % (self.loras.max, running))
        one("standin:lora_loads_total", "counter",
            "Adapters loaded or swapped into the active set (the stand-in's own).",
            self.loras.loads)
        return "".join(out).encode()


# --- requests ------------------------------------------------------------------

def post_json(req):
    """The JSON body of a POST, or the error vLLM answers."""
    if req.method != "POST":
        raise HttpError(405, "Method Not Allowed")
    try:
        return json.loads(req.body)
    except (ValueError, UnicodeDecodeError) as e:
        raise bad(f"the request body is not valid JSON: {e}")


def want_int(body, name, default, lo=None):
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad(f"{name} must be an integer", name)
    if lo is not None and v < lo:
        raise bad(f"{name} must be at least {lo}, got {v}.", name)
    return v


def render_chat(messages):
    if not isinstance(messages, list) or not messages:
        raise bad("messages must be a non-empty list", "messages")
    parts = []
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad("each message must be an object with a string role", "messages")
        content = m.get("content")
        if content is None:
            content = ""
        elif isinstance(content, list):
            texts = []
            for p in content:
                if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                    raise bad("only text content parts are supported", "messages")
                texts.append(p["text"])
            content = "\n".join(texts)
        elif not isinstance(content, str):
            raise bad("message content must be a string or a list of parts", "messages")
        parts.append(f"<|{m['role']}|>\n{content}\n")
    parts.append("<|assistant|>\n")
    return "".join(parts)


def prompt_tokens(prompt):
    if isinstance(prompt, str):
        return prompt.split()
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        return prompt[0].split()
    if isinstance(prompt, list) and prompt and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return [str(t) for t in prompt]
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, str) for p in prompt):
        raise bad("this stand-in takes one prompt per request, not a batch", "prompt")
    raise bad("prompt must be a string or a list of token ids", "prompt")


class Request:
    __slots__ = ("method", "target", "version", "headers", "body", "keep_alive", "started", "lora",
                 "salt")


class HttpError(Exception):
    def __init__(self, status, message):
        super().__init__(message)
        self.status, self.message = status, message


REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
           413: "Payload Too Large", 431: "Request Header Fields Too Large",
           500: "Internal Server Error", 501: "Not Implemented", 503: "Service Unavailable"}


async def read_request(reader, writer):
    """One request off the connection, or None at a clean end."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as e:
        if not e.partial.strip():
            return None
        raise HttpError(400, "incomplete request head")
    except asyncio.LimitOverrunError:
        raise HttpError(431, "request head too large")
    try:
        text = head.decode("latin-1")
        lines = text.split("\r\n")
        method, target, version = lines[0].split(" ")
    except ValueError:
        raise HttpError(400, "malformed request line")
    if not version.startswith("HTTP/1."):
        raise HttpError(400, f"unsupported protocol {version!r}")
    headers = {}
    for line in lines[1:]:
        if not line:
            continue
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip():
            raise HttpError(400, "malformed header line")
        name = name.lower()
        value = value.strip()
        headers[name] = headers[name] + ", " + value if name in headers else value
    req = Request()
    req.method, req.target, req.version, req.headers = method, target, version, headers
    conn = headers.get("connection", "").lower()
    if version == "HTTP/1.0":
        req.keep_alive = "keep-alive" in conn
    else:
        req.keep_alive = "close" not in conn
    te = headers.get("transfer-encoding", "").lower()
    if headers.get("expect", "").lower() == "100-continue":
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
    try:
        if te:
            if te != "chunked":
                raise HttpError(501, f"transfer-encoding {te!r} not supported")
            chunks, size = [], 0
            while True:
                line = await reader.readuntil(b"\r\n")
                try:
                    n = int(line.split(b";")[0].strip(), 16)
                except ValueError:
                    raise HttpError(400, "malformed chunk size")
                if n < 0:
                    raise HttpError(400, "malformed chunk size")
                size += n
                if size > MAX_BODY_BYTES:
                    raise HttpError(413, "request body too large")
                if n == 0:
                    while (await reader.readuntil(b"\r\n")) != b"\r\n":
                        pass  # trailers
                    break
                chunks.append(await reader.readexactly(n))
                if await reader.readexactly(2) != b"\r\n":
                    raise HttpError(400, "malformed chunk")
            req.body = b"".join(chunks)
        else:
            cl = headers.get("content-length")
            if cl is None:
                n = 0
            else:
                if not cl.isdigit():
                    raise HttpError(400, "malformed content-length")
                n = int(cl)
            if n > MAX_BODY_BYTES:
                raise HttpError(413, "request body too large")
            req.body = await reader.readexactly(n) if n else b""
    except asyncio.IncompleteReadError:
        raise HttpError(400, "the request body ended early")
    except asyncio.LimitOverrunError:
        raise HttpError(400, "malformed chunked body")
    return req


class Server:
    def __init__(self, cfg):
        self.cfg = cfg
        self.engine = Engine(cfg)
        self.stopping = False
        self.active = 0          # requests being handled
        self.idle = asyncio.Event()
        self.idle.set()
        self.conns = set()

    # -- plumbing

    def head(self, status, headers, keep_alive):
        lines = [f"HTTP/1.1 {status} {REASONS.get(status, 'Unknown')}"]
        lines += [f"{k}: {v}" for k, v in headers]
        lines.append("server: llm-engine-standin")
        if not keep_alive:
            lines.append("connection: close")
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")

    async def send(self, writer, status, body, keep_alive, ctype="application/json"):
        if isinstance(body, (dict, list)):
            body = json.dumps(body, separators=(",", ":")).encode()
        writer.write(self.head(status, [("content-type", ctype),
                                        ("content-length", str(len(body)))], keep_alive) + body)
        await writer.drain()

    async def connection(self, reader, writer):
        task = asyncio.current_task()
        self.conns.add(task)
        try:
            while not self.stopping:
                try:
                    req = await read_request(reader, writer)
                except HttpError as e:
                    err = ApiError(e.status, e.message)
                    await self.send(writer, e.status, err.body(), False)
                    break
                if req is None:
                    break
                self.active += 1
                self.idle.clear()
                try:
                    keep = await self.handle(req, reader, writer)
                finally:
                    self.active -= 1
                    if self.active == 0:
                        self.idle.set()
                if not keep:
                    break
        except (ConnectionError, ClientGone, asyncio.IncompleteReadError):
            pass
        except asyncio.CancelledError:
            pass
        except Exception as e:  # never let one connection take the server down
            print(f"llm_engine: connection error: {e!r}", file=sys.stderr)
        finally:
            self.conns.discard(task)
            try:
                writer.close()
            except Exception:
                pass

    # -- routes

    async def handle(self, req, reader, writer):
        keep = req.keep_alive and not self.stopping
        path = req.target.split("?", 1)[0]
        cfg, eng = self.cfg, self.engine
        try:
            if path == "/health":
                if req.method not in ("GET", "HEAD"):
                    raise HttpError(405, "Method Not Allowed")
                writer.write(self.head(200, [("content-length", "0")], keep))
                await writer.drain()
                return keep
            if path == "/metrics":
                if req.method != "GET":
                    raise HttpError(405, "Method Not Allowed")
                await self.send(writer, 200, eng.metrics(), keep,
                                "text/plain; version=0.0.4; charset=utf-8")
                return keep
            if path == "/v1/models":
                if req.method != "GET":
                    raise HttpError(405, "Method Not Allowed")
                data = [{"id": n, "object": "model", "created": eng.created, "owned_by": "vllm",
                         "root": cfg.model, "parent": None, "max_model_len": cfg.max_model_len}
                        for n in cfg.names]
                data += [{"id": n, "object": "model", "created": eng.created, "owned_by": "vllm",
                          "root": p, "parent": cfg.model, "max_model_len": None}
                         for n, p in eng.loras.loaded.items()]
                await self.send(writer, 200, {"object": "list", "data": data}, keep)
                return keep
            if path == "/version":
                await self.send(writer, 200, {"version": "standin"}, keep)
                return keep
            if path == "/reset_prefix_cache":
                if req.method != "POST":
                    raise HttpError(405, "Method Not Allowed")
                eng.cache.reset()
                writer.write(self.head(200, [("content-length", "0")], keep))
                await writer.drain()
                return keep
            if path in ("/collective_rpc", "/update_weight_version", "/weight_info"):
                if os.environ.get("VLLM_SERVER_DEV_MODE", "") != "1":
                    raise HttpError(404, "Not Found")
                if path == "/weight_info":
                    if req.method != "GET":
                        raise HttpError(405, "Method Not Allowed")
                    await self.send(writer, 200, {"weight_version": eng.weight_version}, keep)
                    return keep
                body = post_json(req)
                if not isinstance(body, dict):
                    raise HttpError(400, "Request body must be a JSON object")
                if path == "/update_weight_version":
                    v = body.get("new_version")
                    if not isinstance(v, str):
                        raise HttpError(422, "new_version: a string is required")
                    eng.weight_version = v
                    await self.send(writer, 200, {"success": True, "new_version": v}, keep)
                    return keep
                method = body.get("method")
                if method is None:
                    raise HttpError(400, "Missing 'method' in request body")
                if method != "reload_weights":
                    raise ApiError(500, f"the workers have no method {method!r}", "InternalServerError")
                kwargs = body.get("kwargs") or {}
                wp = kwargs.get("weights_path") if isinstance(kwargs, dict) else None
                if not isinstance(wp, str):
                    raise ApiError(500, "reload_weights needs weights_path", "InternalServerError")
                eng.reload_weights(wp)
                await self.send(writer, 200, {"results": [None]}, keep)
                return keep
            if path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
                if os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").lower() not in ("1", "true"):
                    raise HttpError(404, "Not Found")
                body = post_json(req)
                name = body.get("lora_name") if isinstance(body, dict) else None
                if not isinstance(name, str) or not name:
                    raise bad("lora_name is required", "lora_name")
                if path == "/v1/load_lora_adapter":
                    lora_path = body.get("lora_path")
                    if not isinstance(lora_path, str) or not lora_path:
                        raise bad("lora_path is required", "lora_path")
                    await eng.loras.load(name, lora_path)
                    text = f"Success: LoRA adapter '{name}' added successfully."
                else:
                    eng.loras.unload(name)
                    text = f"Success: LoRA adapter '{name}' removed successfully."
                await self.send(writer, 200, text.encode(), keep, "text/plain; charset=utf-8")
                return keep
            if path in ("/v1/completions", "/v1/chat/completions"):
                if req.method != "POST":
                    raise HttpError(405, "Method Not Allowed")
                return await self.complete(req, reader, writer, keep, chat=path.endswith("chat/completions"))
            raise HttpError(404, "Not Found")
        except HttpError as e:
            await self.send(writer, e.status, {"detail": e.message}, keep)
            return keep
        except ApiError as e:
            await self.send(writer, e.status, e.body(), keep)
            return keep
        except (ConnectionError, ClientGone, asyncio.CancelledError):
            raise
        except Exception as e:  # a bug here: answer 500 if nothing was sent yet
            print(f"llm_engine: {req.method} {path}: {e!r}", file=sys.stderr)
            if not getattr(req, "started", False):
                err = ApiError(500, f"internal error: {e!r}", "InternalServerError")
                await self.send(writer, 500, err.body(), False)
            return False

    async def complete(self, req, reader, writer, keep, chat):
        try:
            return await self._complete(req, reader, writer, keep, chat)
        finally:
            lora = getattr(req, "lora", None)
            if lora is not None:
                self.engine.loras.running[lora] -= 1

    async def _complete(self, req, reader, writer, keep, chat):
        cfg, eng = self.cfg, self.engine
        try:
            body = json.loads(req.body)
        except (ValueError, UnicodeDecodeError) as e:
            raise bad(f"the request body is not valid JSON: {e}")
        if not isinstance(body, dict):
            raise bad("the request body must be a JSON object")
        model = body.get("model")
        lora = model if model in eng.loras.loaded else None
        if model is not None and model not in cfg.names and lora is None:
            raise ApiError(404, f"The model `{model}` does not exist.", "NotFoundError", "model")
        model = cfg.model if model is None else model
        if chat:
            tokens = render_chat(body.get("messages")).split()
            n_out = want_int(body, "max_completion_tokens", None, 1)
            if n_out is None:
                n_out = want_int(body, "max_tokens", 16, 1)
        else:
            if "prompt" not in body:
                raise bad("prompt is required", "prompt")
            tokens = prompt_tokens(body["prompt"])
            n_out = want_int(body, "max_tokens", 16, 1)
        salt = body.get("cache_salt")
        if salt is not None and (not isinstance(salt, str) or not salt):
            raise bad("Parameter 'cache_salt' must be a non-empty string if provided.", "cache_salt")
        req.salt = (salt or "").encode()
        n = want_int(body, "n", 1, 1)
        if n != 1:
            raise bad("this stand-in generates one choice (n = 1)", "n")
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise bad("stream must be a boolean", "stream")
        opts = body.get("stream_options")
        if opts is not None:
            if not stream:
                raise bad("Stream options can only be defined when `stream=True`.", "stream_options")
            if not isinstance(opts, dict):
                raise bad("stream_options must be an object", "stream_options")
        opts = opts or {}
        include_usage = bool(opts.get("include_usage"))
        continuous = include_usage and bool(opts.get("continuous_usage_stats"))
        if not tokens:
            raise bad("The prompt is empty.", "prompt" if not chat else "messages")
        if len(tokens) + n_out > cfg.max_model_len:
            raise bad(f"This model's maximum context length is {cfg.max_model_len} tokens. "
                      f"However, you requested {len(tokens) + n_out} tokens ({len(tokens)} in the "
                      f"messages, {n_out} in the completion). Please reduce the length of the "
                      f"messages or completion.", "max_tokens")
        if lora is not None:
            req.lora = lora
            eng.loras.running[lora] += 1
            await eng.loras.use(lora)

        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        transport = writer.transport
        n_prompt = len(tokens)

        def gone():
            return transport.is_closing() or reader.at_eof()

        if not stream:
            out = []

            async def emit(i, word, cached):
                out.append(" " + word)

            cached = await eng.generate(tokens, n_out, gone, emit, req.salt)
            text = "".join(out)
            usage = eng.usage(n_prompt, n_out, cached)
            if chat:
                choice = {"index": 0, "message": {"role": "assistant", "content": text,
                                                  "refusal": None, "tool_calls": [],
                                                  "reasoning_content": None},
                          "logprobs": None, "finish_reason": "length", "stop_reason": None}
                resp = {"id": rid, "object": "chat.completion", "created": created, "model": model,
                        "choices": [choice], "usage": usage, "prompt_logprobs": None}
            else:
                choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": "length",
                          "stop_reason": None, "prompt_logprobs": None}
                resp = {"id": rid, "object": "text_completion", "created": created, "model": model,
                        "choices": [choice], "usage": usage}
            await self.send(writer, 200, resp, keep)
            return keep

        # Streamed: headers now, data from the first token on.
        req.started = True
        writer.write(self.head(200, [("content-type", "text/event-stream; charset=utf-8"),
                                     ("cache-control", "no-cache"),
                                     ("transfer-encoding", "chunked")], keep))
        await writer.drain()
        obj = "chat.completion.chunk" if chat else "text_completion"

        def event(payload):
            data = b"data: " + (payload if isinstance(payload, bytes) else
                                json.dumps(payload, separators=(",", ":")).encode()) + b"\n\n"
            return b"%x\r\n%s\r\n" % (len(data), data)

        async def emit(i, word, cached):
            last = i == n_out - 1
            parts = []
            if chat and i == 0:
                first = {"id": rid, "object": obj, "created": created, "model": model,
                         "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                      "logprobs": None, "finish_reason": None}]}
                if continuous:
                    first["usage"] = eng.usage(n_prompt, 0, cached)
                parts.append(event(first))
            if chat:
                choice = {"index": 0, "delta": {"content": " " + word}, "logprobs": None,
                          "finish_reason": "length" if last else None}
            else:
                choice = {"index": 0, "text": " " + word, "logprobs": None,
                          "finish_reason": "length" if last else None}
            if last:
                choice["stop_reason"] = None
            chunk = {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]}
            if continuous:
                chunk["usage"] = eng.usage(n_prompt, i + 1, cached)
            parts.append(event(chunk))
            writer.write(b"".join(parts))
            await writer.drain()

        cached = await eng.generate(tokens, n_out, gone, emit, req.salt)
        tail = []
        if include_usage:
            tail.append(event({"id": rid, "object": obj, "created": created, "model": model,
                               "choices": [], "usage": eng.usage(n_prompt, n_out, cached)}))
        tail.append(event(b"[DONE]"))
        tail.append(b"0\r\n\r\n")
        writer.write(b"".join(tail))
        await writer.drain()
        return keep


async def main(argv):
    cfg = parse_args(argv)
    if cfg.load_seconds > 0:
        await asyncio.sleep(cfg.load_seconds)  # "loading weights": not listening yet
    srv = Server(cfg)
    if cfg.uds:
        try:
            os.unlink(cfg.uds)
        except FileNotFoundError:
            pass
        server = await asyncio.start_unix_server(srv.connection, cfg.uds, limit=MAX_HEADER_BYTES)
    else:
        server = await asyncio.start_server(srv.connection, cfg.host, cfg.port,
                                            limit=MAX_HEADER_BYTES, reuse_address=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    addr = server.sockets[0].getsockname()
    where = f"unix:{cfg.uds}" if cfg.uds else f"http://{addr[0]}:{addr[1]}"
    print(f"llm_engine: {cfg.model} on {where} (slots {cfg.slots}, "
          f"prefill {cfg.prefill_ms_per_token} ms/token, decode {cfg.decode_ms_per_token} ms/token, "
          f"cache {cfg.cache_tokens} tokens in blocks of {cfg.block_tokens})", flush=True)
    await stop.wait()
    # Stop accepting, finish what is in flight, then close idle connections.
    srv.stopping = True
    server.close()
    await srv.idle.wait()
    for t in list(srv.conns):
        t.cancel()
    await asyncio.sleep(0)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(asyncio.run(main(sys.argv[1:])))
    except KeyboardInterrupt:
        sys.exit(0)
