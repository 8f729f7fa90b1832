#!/usr/bin/env python3
"""A stand-in for stock model servers, for tests that cannot run the real
ones (they need GPUs). Run under the name of the server it plays, it takes
its flags and answers its health and inference paths as that server does:

- ``vllm serve MODEL --port P``: ``GET /health`` (200, empty), the OpenAI
  routes ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``;
- ``text-generation-launcher --model-id M --port P``: ``GET /health`` (503
  while loading), ``POST /generate``, ``/v1/chat/completions``;
- ``tritonserver --model-repository=DIR --http-port=P``:
  ``GET /v2/health/ready`` (400 while loading), ``POST /v2/models/M/infer``;
- ``uvicorn MODULE:app --host H --port P``: a plain FastAPI-style app with
  ``GET /health`` and ``POST /predict``.

Knobs for tests, from the environment:
- ``STANDIN_LOAD_SECONDS``: time spent "loading weights" before the server
  is ready (vLLM does not listen meanwhile; TGI and Triton listen and
  answer not-ready);
- ``STANDIN_BLOCK_SECONDS``: each inference request holds the server's one
  event loop this long, so nothing else (health included) is answered
  meanwhile, as a Python server busy in synchronous code.

Standard library only.
"""

import json
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

FLAVOR = os.path.basename(sys.argv[0])
if FLAVOR.endswith(".py"):
    FLAVOR = sys.argv[1]
    ARGS = sys.argv[2:]
else:
    ARGS = sys.argv[1:]

LOAD = float(os.environ.get("STANDIN_LOAD_SECONDS", "0"))
BLOCK = float(os.environ.get("STANDIN_BLOCK_SECONDS", "0"))
class FifoLock:
    """A lock taken in arrival order, like events on one event loop."""

    def __init__(self):
        self.cv = threading.Condition()
        self.next = 0
        self.serving = 0

    def __enter__(self):
        with self.cv:
            ticket = self.next
            self.next += 1
            while self.serving != ticket:
                self.cv.wait()

    def __exit__(self, *exc):
        with self.cv:
            self.serving += 1
            self.cv.notify_all()


# One event loop: every request runs under it, in arrival order.
LOOP = FifoLock()
STARTED = time.monotonic()


def flag(names, default=None):
    """The value of ``--name V`` or ``--name=V``."""
    for i, a in enumerate(ARGS):
        for n in names:
            if a == n and i + 1 < len(ARGS):
                return ARGS[i + 1]
            if a.startswith(n + "="):
                return a[len(n) + 1:]
    return default


def die(msg):
    print(f"{FLAVOR}: {msg}", file=sys.stderr)
    sys.exit(2)


if FLAVOR == "vllm":
    if not ARGS or ARGS[0] != "serve" or len(ARGS) < 2:
        die("usage: vllm serve MODEL --port PORT")
    MODEL = flag(["--served-model-name"], ARGS[1])
    UDS = flag(["--uds"])
    PORT = flag(["--port"], "8000")
    HOST = flag(["--host"], "0.0.0.0")
    HEALTH = "/health"
elif FLAVOR == "text-generation-launcher":
    MODEL = flag(["--model-id"])
    PORT = flag(["--port", "-p"], "3000")
    HOST = flag(["--hostname"], "0.0.0.0")
    HEALTH = "/health"
elif FLAVOR == "tritonserver":
    repo = flag(["--model-repository", "--model-store"])
    if repo is None:
        die("--model-repository is required")
    MODEL = "simple"
    PORT = flag(["--http-port"], "8000")
    HOST = flag(["--http-address"], "0.0.0.0")
    HEALTH = "/v2/health/ready"
elif FLAVOR == "uvicorn":
    if not ARGS or ":" not in ARGS[0]:
        die("usage: uvicorn MODULE:app --port PORT")
    MODEL = ARGS[0]
    UDS = flag(["--uds"])
    PORT = flag(["--port"], "8000")
    HOST = flag(["--host"], "127.0.0.1")
    HEALTH = "/health"
else:
    die(f"unknown server {FLAVOR!r}")

UDS = globals().get("UDS")
try:
    PORT = int(PORT)
except ValueError:
    die(f"the port {PORT!r} is not a number (was $PORT expanded?)")


def ready():
    return time.monotonic() - STARTED >= LOAD


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt, *args):
        pass

    def send_json(self, status, body):
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def body(self):
        n = int(self.headers.get("content-length") or 0)
        raw = self.rfile.read(n) if n else b""
        try:
            return json.loads(raw or b"{}")
        except ValueError:
            return None

    def do_GET(self):
        with LOOP:
            if self.path == HEALTH:
                if not ready():
                    code = 400 if FLAVOR == "tritonserver" else 503
                    return self.send_json(code, {"error": "loading"})
                self.send_response(200)
                self.send_header("content-length", "0")
                return self.end_headers()
            if self.path == "/v1/models" and FLAVOR in ("vllm", "text-generation-launcher"):
                return self.send_json(200, {"object": "list", "data": [{"id": MODEL, "object": "model"}]})
            self.send_json(404, {"error": f"no route {self.path}"})

    def do_POST(self):
        body = self.body()
        with LOOP:
            if body is None:
                return self.send_json(400, {"error": "not JSON"})
            if BLOCK:
                # Synchronous work on the event loop: nothing else runs.
                time.sleep(BLOCK)
            served = {"server": FLAVOR, "model": MODEL, "pid": os.getpid()}
            if self.path == "/v1/chat/completions" and FLAVOR in ("vllm", "text-generation-launcher"):
                last = (body.get("messages") or [{}])[-1].get("content", "")
                return self.send_json(200, {
                    "id": "chatcmpl-standin", "object": "chat.completion", "model": body.get("model", MODEL),
                    "choices": [{"index": 0, "finish_reason": "stop",
                                 "message": {"role": "assistant", "content": f"echo: {last}"}}],
                    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
                    "standin": served,
                })
            if self.path == "/v1/completions" and FLAVOR == "vllm":
                return self.send_json(200, {
                    "id": "cmpl-standin", "object": "text_completion", "model": body.get("model", MODEL),
                    "choices": [{"index": 0, "text": f"echo: {body.get('prompt', '')}", "finish_reason": "stop"}],
                    "standin": served,
                })
            if self.path == "/generate" and FLAVOR == "text-generation-launcher":
                return self.send_json(200, {"generated_text": f"echo: {body.get('inputs', '')}", "standin": served})
            if self.path == f"/v2/models/{MODEL}/infer" and FLAVOR == "tritonserver":
                outputs = [{"name": i.get("name", "x"), "datatype": i.get("datatype", "FP32"),
                            "shape": i.get("shape", []), "data": i.get("data", [])}
                           for i in body.get("inputs", [])]
                return self.send_json(200, {"model_name": MODEL, "outputs": outputs, "standin": served})
            if self.path == "/predict" and FLAVOR == "uvicorn":
                return self.send_json(200, {"prediction": body, "standin": served})
            self.send_json(404, {"error": f"no route {self.path}"})


def main():
    if FLAVOR == "vllm" and LOAD:
        # vLLM loads the model before it binds its port.
        time.sleep(LOAD)
    if UDS:
        # vLLM's and uvicorn's --uds: a Unix socket; host and port unused.
        import os
        import socketserver

        class UnixServer(socketserver.ThreadingUnixStreamServer):
            daemon_threads = True

        if os.path.exists(UDS):
            os.unlink(UDS)
        server = UnixServer(UDS, Handler)
    else:
        server = ThreadingHTTPServer((HOST, PORT), Handler)
        server.daemon_threads = True
    import signal

    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown).start())
    server.serve_forever()


if __name__ == "__main__":
    main()
