"""The warmgate worker contract for any Python server, standard library only.

Two parts, usable apart:

``stream_checkpoint(url, token, on_tensor)``
    Streams a checkpoint from the gateway (``WARMGATE_WEIGHTS_URL``) tensor
    by tensor. Each safetensors tensor is read straight into its own
    preallocated buffer (a ``bytearray``, or a numpy array when numpy is
    installed) and handed to ``on_tensor`` as soon as its last byte has
    arrived, while the rest still downloads: peak memory is one copy of the
    weights, and loading overlaps the download. Sizes, the safetensors
    header and, when the checkpoint has a ``SHA256SUMS``, every file's
    digest are checked; a short, corrupted or truncated stream raises
    ``WeightsError`` and nothing already loaded is swapped in by
    ``Worker``.

``Worker``
    A small HTTP server that follows the contract: ``GET /healthz`` with
    ``weights_version`` and ``weights_seconds``, ``POST /invoke`` (JSON in
    and out, for pools), ``POST /weights {"url", "version"}`` (new weights
    without a restart: loaded aside, swapped only when whole), listening on
    ``$WARMGATE_SOCKET`` when the gateway offers one (a Unix socket in a
    folder only the gateway's user may enter, so no other local user can
    reach the worker), else ``$PORT``, and SIGTERM (stop taking connections, finish what is in
    flight, exit). Subclass it and override ``invoke`` and ``load``.

Run ``python3 -m warmgate.worker`` for a demo worker that loads its
checkpoint and answers with what it loaded.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import signal
import stat
import struct
import sys
import threading
import time
import socketserver
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import IO, Any, Callable, Dict, List, Optional, Tuple, Union

_np: Any
try:  # numpy is used when present, never required
    import numpy as _np
except ImportError:  # pragma: no cover - depends on the environment
    _np = None

__all__ = ["Worker", "Demo", "Tensor", "WeightsError", "stream_checkpoint", "MAX_HEADER"]

#: An answer to a route of ``Worker.handle``: a status and a JSON body.
Reply = Tuple[int, Any]

# The largest safetensors header accepted (the gateway refuses larger ones).
MAX_HEADER = 100 * 1024 * 1024
# Bytes asked of the socket at once while filling a tensor.
CHUNK = 1 << 20

_NUMPY_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "I64": "int64",
    "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
    "U16": "uint16", "U32": "uint32", "U64": "uint64",
}


class WeightsError(Exception):
    """A checkpoint that could not be streamed whole and intact."""


class Tensor:
    """One tensor as it arrived: its name, dtype, shape and bytes.

    ``data`` is a numpy array of that dtype and shape when numpy is
    installed and knows the dtype (bfloat16 stays bytes), else a
    ``bytearray``; ``raw`` is always a memoryview of the same bytes.
    """

    __slots__ = ("name", "dtype", "shape", "data", "raw", "file")

    def __init__(
        self,
        name: str,
        dtype: str,
        shape: List[int],
        data: Any,
        raw: memoryview,
        file: str,
    ) -> None:
        self.name, self.dtype, self.shape = name, dtype, shape
        self.data, self.raw, self.file = data, raw, file

    def __repr__(self) -> str:
        return f"Tensor({self.name!r}, {self.dtype}, {self.shape}, {len(self.raw)} bytes)"


def _origin(url: str) -> Tuple[str, str, Optional[int]]:
    """``url``'s scheme, host and port, as browsers compare origins."""
    u = urllib.parse.urlsplit(url)
    port = u.port or {"http": 80, "https": 443}.get(u.scheme)
    return (u.scheme, (u.hostname or "").lower(), port)


def gateway_origin() -> Optional[Tuple[str, str, Optional[int]]]:
    """The origin of the gateway this worker was started by
    (``WARMGATE_GATEWAY_URL``, else ``WARMGATE_WEIGHTS_URL``'s), the one
    place its ``WARMGATE_WEIGHTS_TOKEN`` is ever sent; ``None`` without one."""
    base = os.environ.get("WARMGATE_GATEWAY_URL") or os.environ.get("WARMGATE_WEIGHTS_URL")
    return _origin(base) if base else None


def _open(
    url: str, token: Optional[str], timeout: float
) -> Tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    """A GET of ``url`` with the worker's token; the response, unread."""
    u = urllib.parse.urlsplit(url)
    if u.scheme not in ("http", "https"):
        raise WeightsError(f"{url}: only http(s) weights URLs are streamed")
    conn: http.client.HTTPConnection
    if u.scheme == "https":
        conn = http.client.HTTPSConnection(u.hostname or "", u.port, timeout=timeout)
    else:
        conn = http.client.HTTPConnection(u.hostname or "", u.port, timeout=timeout)
    path = u.path + (f"?{u.query}" if u.query else "")
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    conn.request("GET", path, headers=headers)
    resp = conn.getresponse()
    if resp.status != 200:
        body = resp.read(2048).decode("utf-8", "replace")
        conn.close()
        raise WeightsError(f"GET {url} answered {resp.status}: {body}")
    return conn, resp


def _read_exact(resp: Any, view: memoryview, what: str, digest: Optional[Any]) -> None:
    """Fills ``view`` from ``resp``; raises on a short body."""
    got = 0
    n = len(view)
    while got < n:
        k = resp.readinto(view[got:min(n, got + CHUNK)])
        if not k:
            raise WeightsError(f"{what}: the stream ended after {got} of {n} bytes")
        got += k
    if digest is not None:
        digest.update(view)


def _buffer(dtype: str, shape: List[int], nbytes: int) -> Tuple[Any, memoryview]:
    """A zeroed buffer for one tensor, and a writable byte view of it."""
    if _np is not None and dtype in _NUMPY_DTYPES:
        arr = _np.empty(shape if shape else (), dtype=_NUMPY_DTYPES[dtype])
        if arr.nbytes == nbytes:
            return arr, memoryview(arr.reshape(-1).view(_np.uint8))
    buf = bytearray(nbytes)
    return buf, memoryview(buf)


def _check_header(
    header: Dict[str, Any], data_len: int, file: str
) -> List[Tuple[int, int, str, str, List[int]]]:
    """Tensors in file order; raises unless they tile the data exactly."""
    tensors = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            start, end = info["data_offsets"]
            dtype, shape = info["dtype"], list(info["shape"])
        except (KeyError, TypeError, ValueError) as e:
            raise WeightsError(f"{file}: tensor {name!r} has a bad header entry: {e}") from None
        if not (isinstance(start, int) and isinstance(end, int) and 0 <= start <= end):
            raise WeightsError(f"{file}: tensor {name!r} has bad offsets {start}..{end}")
        tensors.append((start, end, name, dtype, shape))
    tensors.sort()
    at = 0
    for start, end, name, _, _ in tensors:
        if start != at:
            raise WeightsError(f"{file}: tensor {name!r} starts at {start}, expected {at}")
        at = end
    if at != data_len:
        raise WeightsError(f"{file}: the tensors cover {at} bytes but the file holds {data_len}")
    return tensors


def _sha256sums(text: str) -> Dict[str, str]:
    sums: Dict[str, str] = {}
    for line in text.splitlines():
        parts = line.strip().split(None, 1)
        if len(parts) == 2:
            sums[parts[1].lstrip("*").lstrip("./")] = parts[0].lower()
    return sums


def stream_checkpoint(
    url: str,
    token: Optional[str] = None,
    on_tensor: Optional[Callable[[Tensor], None]] = None,
    timeout: float = 60.0,
    local: bool = True,
) -> Dict[str, Any]:
    """Streams every ``.safetensors`` file of the checkpoint at ``url``.

    Calls ``on_tensor(Tensor)`` for each tensor as soon as it is whole, in
    file order, and returns ``{"tensors", "bytes", "first_tensor_s",
    "first_tensor_bytes", "seconds", "files", "local_files"}``
    (``first_tensor_bytes``: bytes downloaded when the first tensor was
    handed on; ``local_files``: files read straight from the gateway's
    machine). Raises ``WeightsError`` on anything short, malformed or not
    matching ``SHA256SUMS``.

    A file the manifest offers a ``path`` for (the gateway's cached copy,
    when the worker runs on the gateway's machine) is read from that path
    at page-cache speed, checked the same way; one that cannot be opened,
    or is not the size the manifest says, is downloaded instead, and so is
    one whose local read fails its checks (its tensors are then handed to
    ``on_tensor`` a second time). ``local=False``: every file is
    downloaded.
    """
    if token is None:
        # The worker's own token goes to the gateway that started it and
        # nowhere else: a URL handed to ``POST /weights`` by anyone else
        # must not make it leak.
        token = os.environ.get("WARMGATE_WEIGHTS_TOKEN")
        if token and gateway_origin() != _origin(url):
            raise WeightsError(
                f"{url}: not the gateway this worker was started by "
                f"(WARMGATE_GATEWAY_URL); its weights token is sent nowhere else")
    t0 = time.monotonic()
    conn, resp = _open(url, token, timeout)
    try:
        manifest = json.loads(resp.read(16 * 1024 * 1024))
    except ValueError as e:
        raise WeightsError(f"{url}: the manifest is not JSON: {e}") from None
    finally:
        conn.close()
    files = manifest.get("files") or []
    names = {f.get("name") for f in files}
    sums: Dict[str, str] = {}
    if "SHA256SUMS" in names:
        conn, resp = _open(f"{url}/SHA256SUMS", token, timeout)
        try:
            sums = _sha256sums(resp.read(1024 * 1024).decode("utf-8", "replace"))
        finally:
            conn.close()
    stats: Dict[str, Any] = {
        "tensors": 0, "bytes": 0, "first_tensor_s": None, "files": [], "local_files": 0,
    }
    for f in files:
        name, size = f.get("name", ""), int(f.get("size", 0))
        if not name.endswith(".safetensors"):
            continue
        here = _open_local(f.get("path"), size) if local else None
        read_here = False
        if here is not None:
            try:
                _read_file(here, name, size, sums.get(name), on_tensor, stats, t0)
                read_here = True
            except (OSError, WeightsError) as e:
                # The copy here is not what it should be (changed, or
                # corrupt on disk): the gateway's own read checks it again,
                # drops a bad cache entry and fetches the file anew. Its
                # tensors are handed on a second time.
                sys.stderr.write(f"warmgate.worker: {name}: the local copy failed ({e}); downloading it\n")
            finally:
                here.close()
        if read_here:
            stats["local_files"] += 1
        else:
            _stream_file(f"{url}/{urllib.parse.quote(name)}", name, size, token, timeout,
                         sums.get(name), on_tensor, stats, t0)
        stats["files"].append(name)
    stats["seconds"] = time.monotonic() - t0
    return stats


def _open_local(path: Any, size: int) -> Optional[IO[bytes]]:
    """The file at ``path`` opened for reading, when it is a regular file
    of ``size`` bytes; otherwise None (download it instead)."""
    if not isinstance(path, str) or not path:
        return None
    try:
        f = open(path, "rb", buffering=0)
    except OSError:
        return None
    try:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_size != size:
            f.close()
            return None
    except OSError:
        f.close()
        return None
    return f


def _stream_file(
    url: str,
    name: str,
    size: int,
    token: Optional[str],
    timeout: float,
    expected: Optional[str],
    on_tensor: Optional[Callable[[Tensor], None]],
    stats: Dict[str, Any],
    t0: float,
) -> None:
    conn, resp = _open(url, token, timeout)
    try:
        length = resp.getheader("content-length")
        if length is not None and int(length) != size:
            raise WeightsError(f"{name}: the manifest says {size} bytes, the answer {length}")
        _read_file(resp, name, size, expected, on_tensor, stats, t0)
    except (OSError, http.client.HTTPException) as e:
        raise WeightsError(f"{name}: the download failed: {e}") from None
    finally:
        conn.close()


def _read_file(
    resp: Any,
    name: str,
    size: int,
    expected: Optional[str],
    on_tensor: Optional[Callable[[Tensor], None]],
    stats: Dict[str, Any],
    t0: float,
) -> None:
    """Reads one safetensors file of ``size`` bytes from ``resp`` (an HTTP
    answer or a file), tensor by tensor."""
    digest = hashlib.sha256() if expected else None
    head = bytearray(8)
    _read_exact(resp, memoryview(head), f"{name} header length", digest)
    (hlen,) = struct.unpack("<Q", head)
    if hlen > MAX_HEADER or 8 + hlen > size:
        raise WeightsError(f"{name}: a header of {hlen} bytes does not fit a file of {size}")
    hbuf = bytearray(hlen)
    _read_exact(resp, memoryview(hbuf), f"{name} header", digest)
    try:
        header = json.loads(hbuf)
    except ValueError as e:
        raise WeightsError(f"{name}: the header is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise WeightsError(f"{name}: the header is not a JSON object")
    for start, end, tname, dtype, shape in _check_header(header, size - 8 - hlen, name):
        data, view = _buffer(dtype, shape, end - start)
        _read_exact(resp, view, f"{name}: tensor {tname!r}", digest)
        stats["tensors"] += 1
        stats["bytes"] += end - start
        if stats["first_tensor_s"] is None:
            # How far the download was when the first tensor was whole:
            # the rest streams while the caller loads this one.
            stats["first_tensor_s"] = time.monotonic() - t0
            stats["first_tensor_bytes"] = 8 + hlen + end
        if on_tensor is not None:
            on_tensor(Tensor(tname, dtype, shape, data, view, name))
    if resp.read(1):
        raise WeightsError(f"{name}: bytes follow the last tensor")
    if expected and digest is not None and digest.hexdigest() != expected:
        raise WeightsError(f"{name}: sha256 {digest.hexdigest()} does not match SHA256SUMS ({expected})")


class Worker:
    """A worker that follows warmgate's contract. Override ``load`` (turn a
    dict of ``Tensor`` into your model) and ``invoke`` (one task), or
    ``handle`` for routes of your own."""

    def __init__(self) -> None:
        self.model: Any = None
        self.weights_version: int = 0
        self.weights_seconds: Optional[float] = None
        self.last_error: Optional[str] = None
        self._swap = threading.Lock()
        #: LoRA adapters loaded, by name: what ``load_adapter`` returned.
        self.adapters: Dict[str, Any] = {}
        self._inflight = 0
        self._idle = threading.Condition()
        self.server: Optional[socketserver.BaseServer] = None

    # --- override these ---------------------------------------------------

    def load(self, tensors: Dict[str, Tensor], version: int) -> Any:
        """Builds the model from ``{name: Tensor}``; the default keeps them."""
        return tensors

    def invoke(self, payload: Any) -> Any:
        """Runs one task (``POST /invoke``); the default echoes it."""
        return {"echo": payload}

    def handle(self, method: str, path: str, payload: Any) -> Optional[Reply]:
        """Other routes: return ``(status, json)`` or ``None`` for 404."""
        return None

    def load_adapter(self, name: str, path: str) -> Any:
        """Loads a LoRA adapter from the folder ``path`` (``POST
        /v1/load_lora_adapter``, vLLM's runtime API, which warmgate calls
        where it routes a request for ``name``); what it returns is kept in
        ``self.adapters[name]`` for ``handle`` to use. The default reads
        ``adapter_config.json`` and fails without it."""
        with open(os.path.join(path, "adapter_config.json")) as f:
            return {"path": path, "config": json.load(f)}

    def unload_adapter(self, name: str) -> None:
        """Frees what ``load_adapter`` made (``POST /v1/unload_lora_adapter``)."""

    # --- the contract -------------------------------------------------------

    def load_weights(self, url: str, version: int) -> None:
        """Streams and loads a checkpoint aside, then swaps it in; on any
        error the old model stays and the error is kept for ``/healthz``."""
        t0 = time.monotonic()
        tensors: Dict[str, Tensor] = {}
        try:
            stream_checkpoint(url, on_tensor=lambda t: tensors.__setitem__(t.name, t))
            model = self.load(tensors, version)
        except Exception as e:
            self.last_error = f"weights version {version}: {e}"
            raise
        with self._swap:
            self.model, self.weights_version = model, version
            self.weights_seconds = time.monotonic() - t0
            self.last_error = None

    def _adapter_route(self, path: str, payload: Any) -> Reply:
        """vLLM's answers to its two runtime LoRA routes."""
        name = payload.get("lora_name") if isinstance(payload, dict) else None
        if not isinstance(name, str) or not name:
            return 400, {"error": {"message": "lora_name is required", "type": "BadRequestError",
                                   "code": 400}}
        if path.endswith("unload_lora_adapter"):
            with self._swap:
                if name not in self.adapters:
                    return 404, {"error": {"message": f"The lora adapter '{name}' cannot be found.",
                                           "type": "NotFoundError", "code": 404}}
                del self.adapters[name]
            self.unload_adapter(name)
            return 200, f"Success: LoRA adapter '{name}' removed successfully."
        lora_path = payload.get("lora_path")
        if not isinstance(lora_path, str) or not lora_path:
            return 400, {"error": {"message": "lora_path is required", "type": "BadRequestError",
                                   "code": 400}}
        if name in self.adapters:
            return 400, {"error": {"message": f"The lora adapter '{name}' has already been loaded.",
                                   "type": "InvalidUserInput", "code": 400}}
        try:
            loaded = self.load_adapter(name, lora_path)
        except Exception as e:
            return 400, {"error": {"message": f"Loading lora {name} failed: {e}",
                                   "type": "BadRequestError", "code": 400}}
        with self._swap:
            self.adapters[name] = loaded
        return 200, f"Success: LoRA adapter '{name}' added successfully."

    def health(self) -> Dict[str, Any]:
        body: Dict[str, Any] = {"status": "ok", "weights_version": self.weights_version}
        if self.weights_seconds is not None:
            body["weights_seconds"] = round(self.weights_seconds, 3)
        if self.last_error:
            body["last_error"] = self.last_error
        return body

    def serve(self, port: Optional[Union[int, str]] = None, host: str = "127.0.0.1") -> None:
        """Loads ``WARMGATE_WEIGHTS_URL`` if set, then serves until SIGTERM."""
        url = os.environ.get("WARMGATE_WEIGHTS_URL")
        if url:
            self.load_weights(url, int(os.environ.get("WARMGATE_WEIGHTS_VERSION", "0")))
        worker = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, fmt: str, *args: Any) -> None:
                pass

            def address_string(self) -> str:
                # A Unix socket's peer has no address.
                return str(self.client_address[0]) if self.client_address else "unix"

            def _reply(self, status: int, body: Any) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _payload(self) -> Any:
                n = int(self.headers.get("content-length") or 0)
                raw = self.rfile.read(n) if n else b""
                return json.loads(raw) if raw else None

            def _route(self, method: str) -> None:
                with worker._idle:
                    worker._inflight += 1
                try:
                    if method == "GET" and self.path == "/healthz":
                        return self._reply(200, worker.health())
                    try:
                        payload = self._payload() if method == "POST" else None
                    except ValueError as e:
                        return self._reply(400, {"error": f"the body is not JSON: {e}"})
                    if method == "POST" and self.path == "/invoke":
                        try:
                            out = worker.invoke(payload)
                        except Exception as e:
                            # A failure in user code: the gateway spends
                            # one of the task's retries on it.
                            return self._reply(500, {"error": f"{type(e).__name__}: {e}"})
                        return self._reply(200, out)
                    if method == "POST" and self.path in ("/v1/load_lora_adapter",
                                                          "/v1/unload_lora_adapter"):
                        return self._reply(*worker._adapter_route(self.path, payload))
                    if method == "POST" and self.path == "/weights":
                        if not isinstance(payload, dict) or not isinstance(payload.get("url"), str):
                            return self._reply(400, {"error": "expected {\"url\", \"version\"}"})
                        if (os.environ.get("WARMGATE_WEIGHTS_TOKEN")
                                and gateway_origin() != _origin(payload["url"])):
                            return self._reply(400, {
                                "error": "the weights URL is not on the gateway this worker was "
                                         "started by; its weights token is sent nowhere else",
                                "weights_version": worker.weights_version})
                        version = int(payload.get("version", 0))
                        try:
                            worker.load_weights(payload["url"], version)
                        except Exception as e:
                            return self._reply(500, {"error": str(e),
                                                     "weights_version": worker.weights_version})
                        return self._reply(200, {"weights_version": worker.weights_version})
                    out = worker.handle(method, self.path, payload)
                    if out is None:
                        return self._reply(404, {"error": f"no route {method} {self.path}"})
                    return self._reply(*out)
                finally:
                    with worker._idle:
                        worker._inflight -= 1
                        worker._idle.notify_all()

            def do_GET(self) -> None:
                self._route("GET")

            def do_POST(self) -> None:
                self._route("POST")

        socket_path = os.environ.get("WARMGATE_SOCKET") if port is None else None
        server: socketserver.BaseServer
        if socket_path:
            # Replaced if an earlier worker of the same name left it.
            try:
                os.unlink(socket_path)
            except FileNotFoundError:
                pass
            server = self.server = _UnixHTTPServer(socket_path, Handler)
        else:
            port = int(port if port is not None else os.environ.get("PORT", "8000"))
            server = self.server = ThreadingHTTPServer((host, port), Handler)
            server.daemon_threads = True

        def stop(*_: Any) -> None:
            # Stop taking connections, let in-flight requests finish.
            threading.Thread(target=server.shutdown, daemon=True).start()

        signal.signal(signal.SIGTERM, stop)
        server.serve_forever()
        with self._idle:
            self._idle.wait_for(lambda: self._inflight == 0, timeout=60)
        server.server_close()


class _UnixHTTPServer(socketserver.ThreadingUnixStreamServer):
    """HTTP on a Unix socket, a thread a connection."""

    daemon_threads = True


class Demo(Worker):
    """Loads its checkpoint and answers with what it holds: tensor count,
    bytes, and a digest of every tensor's bytes in file order."""

    def load(self, tensors: Dict[str, Tensor], version: int) -> Any:
        digest = hashlib.sha256()
        total = 0
        for t in tensors.values():
            digest.update(t.raw)
            total += len(t.raw)
        return {"tensors": len(tensors), "bytes": total, "sha256": digest.hexdigest()}

    def invoke(self, payload: Any) -> Any:
        return {"model": self.model, "echo": payload}


# The name the example script used before the kit became a package.
_Demo = Demo


def main() -> None:
    """Runs the demo worker on ``$PORT``."""
    if len(sys.argv) > 1 and sys.argv[1] == "--demo":
        sys.argv.pop(1)
    Demo().serve()


if __name__ == "__main__":
    main()
