"""What the blocking and the asyncio clients share: settings from the
environment, request building, answer parsing and the retry rule. No I/O
happens here."""

from __future__ import annotations

import ipaddress
import json
import os
import ssl
import stat
import urllib.parse
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Mapping, Optional, Union

import httpx

from .errors import (
    APIError,
    UnreachableError,
    WarmgateError,
    error_from_response,
    error_from_task,
)

#: Where the CLI looks for the gateway when ``WARMGATE_GATEWAY`` is unset.
DEFAULT_GATEWAY = "http://127.0.0.1:8080"
#: The variable with the gateway's URL (as ``warmgate status`` reads it).
GATEWAY_ENV = "WARMGATE_GATEWAY"
#: The variable with the control plane's token (as the CLI reads it).
ADMIN_TOKEN_ENV = "WARMGATE_ADMIN_TOKEN"
#: The variable with a tenant's API key for the data plane (tasks).
API_KEY_ENV = "WARMGATE_API_KEY"
#: The variable with a PEM file of CA certificates to trust (as the CLI's
#: ``--cacert`` reads it).
CACERT_ENV = "WARMGATE_CACERT"

#: A duration as the gateway takes it: seconds, or text with a unit ("30s").
Duration = Union[int, float, str]
#: A JSON value.
JSON = Any

#: Longest wait between two tries, whatever ``Retry-After`` says.
MAX_RETRY_WAIT = 60.0
#: Wait before retrying an answer that said no ``Retry-After``, doubled each try.
BASE_RETRY_WAIT = 0.25


def env_url(url: Optional[str]) -> str:
    u = url or os.environ.get(GATEWAY_ENV) or DEFAULT_GATEWAY
    if "://" not in u:
        u = "http://" + u
    return u.rstrip("/")


def env_token(token: Optional[str], url: str) -> Optional[str]:
    """The admin token: the one given, else ``$WARMGATE_ADMIN_TOKEN``, else
    the one a gateway of this user made for itself and published for its
    address (as the CLI finds it)."""
    if token is not None:
        return token or None
    return os.environ.get(ADMIN_TOKEN_ENV) or published_token(url)


def runtime_dir() -> Optional[str]:
    """Where this user's gateways publish the tokens they made:
    ``$WARMGATE_RUNTIME_DIR``, else ``$XDG_RUNTIME_DIR/warmgate``, else
    ``$HOME/.warmgate/run``."""
    if os.environ.get("WARMGATE_RUNTIME_DIR"):
        return os.environ["WARMGATE_RUNTIME_DIR"]
    if os.environ.get("XDG_RUNTIME_DIR"):
        return os.path.join(os.environ["XDG_RUNTIME_DIR"], "warmgate")
    if os.environ.get("HOME"):
        return os.path.join(os.environ["HOME"], ".warmgate", "run")
    return None


def _process_start(pid: int) -> Optional[int]:
    """When process ``pid`` started, in clock ticks since boot (Linux)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            text = f.read()
        return int(text[text.rindex(")") + 1:].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def published_token(url: str) -> Optional[str]:
    """The token a ``warmgate serve`` started without
    ``WARMGATE_ADMIN_TOKEN`` published for the address of ``url``, as the
    CLI finds it: only for an IP address (a name such as ``localhost`` may
    resolve to an address another user listens on), read from a regular
    file of this user's that nobody else may read, in a folder only this
    user may write to, and only while the gateway that wrote it (its pid
    and start time are in the record) still runs."""
    folder = runtime_dir()
    if folder is None:
        return None
    try:
        dst = os.lstat(folder)
    except OSError:
        return None
    if not stat.S_ISDIR(dst.st_mode) or dst.st_uid != os.geteuid() or dst.st_mode & 0o022:
        return None
    u = urllib.parse.urlsplit(url if "://" in url else "http://" + url)
    host = u.hostname or ""
    try:
        ip = ipaddress.ip_address(host)
        port = u.port or (443 if u.scheme == "https" else 80)
    except ValueError:
        return None
    name = f"gateway-[{ip}]-{port}.token" if ip.version == 6 else f"gateway-{ip}-{port}.token"
    path = os.path.join(folder, name)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
            return None
        text = os.read(fd, 4096).decode("ascii", errors="replace")
    except OSError:
        return None
    finally:
        os.close(fd)
    lines = text.splitlines()
    if len(lines) < 2:
        return None
    token = lines[0].strip()
    try:
        pid_text, start_text = lines[1].split()
        pid, start = int(pid_text), int(start_text)
    except ValueError:
        return None
    if not (len(token) == 64 and all(c in "0123456789abcdefABCDEF" for c in token)):
        return None
    try:
        alive = os.stat(f"/proc/{pid}").st_uid == os.geteuid() and _process_start(pid) == start
    except OSError:
        alive = False
    if not alive:
        # The gateway is gone: another user may listen on its address now.
        try:
            os.unlink(path)
        except OSError:
            pass
        return None
    return token


def env_api_key(api_key: Optional[str]) -> Optional[str]:
    return api_key if api_key is not None else (os.environ.get(API_KEY_ENV) or None)


def tls_verify(cacert: Optional[str]) -> Union[bool, ssl.SSLContext]:
    """What an ``https://`` gateway's certificate is checked against: the
    system's roots, and besides them the CA certificates in the PEM file
    ``cacert`` (else ``$WARMGATE_CACERT``), as the CLI's ``--cacert`` does:
    a private CA, or a gateway's self-signed certificate. A file that
    cannot be read is an error at once, not at the first call."""
    path = cacert if cacert is not None else (os.environ.get(CACERT_ENV) or None)
    if not path:
        return True
    ctx = ssl.create_default_context()
    try:
        ctx.load_verify_locations(cafile=path)
    except (OSError, ssl.SSLError) as e:
        raise WarmgateError(f"cacert {path}: cannot read CA certificates from it ({e})") from e
    return ctx


def duration(value: Optional[Duration]) -> Optional[Union[float, str]]:
    """A duration for a JSON body: seconds as a number, or the text as is."""
    if value is None or isinstance(value, str):
        return value
    return float(value)


def quote(name: str) -> str:
    return urllib.parse.quote(name, safe="")


@dataclass
class TaskResult:
    """One finished task: its ``output`` (the worker's JSON answer), ``id``,
    the ``replica`` that ran it and its ``weights_version``, the
    ``attempts`` it took, and its ``index`` in the inputs of a batch or a
    ``map``."""

    id: str
    output: JSON
    replica: Optional[str] = None
    weights_version: Optional[int] = None
    attempts: int = 1
    index: Optional[int] = None

    @classmethod
    def from_json(cls, v: Mapping[str, Any], index: Optional[int] = None) -> "TaskResult":
        return cls(
            id=str(v.get("id", "")),
            output=v.get("output"),
            replica=v.get("replica"),
            weights_version=v.get("weights_version"),
            attempts=int(v.get("attempts") or 0),
            index=v.get("index", index),
        )


@dataclass
class TaskOptions:
    """What a submission may set, besides its input."""

    priority: Optional[int] = None
    timeout: Optional[Duration] = None
    retries: Optional[int] = None
    min_weights_version: Optional[int] = None
    tenant: Optional[str] = None

    def body(self) -> Dict[str, Any]:
        b: Dict[str, Any] = {}
        if self.priority is not None:
            b["priority"] = int(self.priority)
        if self.timeout is not None:
            b["timeout"] = duration(self.timeout)
        if self.retries is not None:
            b["retries"] = int(self.retries)
        if self.min_weights_version is not None:
            b["min_weights_version"] = int(self.min_weights_version)
        return b

    def headers(self) -> Dict[str, str]:
        return {"x-warmgate-tenant": self.tenant} if self.tenant else {}


@dataclass
class Settings:
    """A client's settings, shared by its pool and app handles."""

    url: str
    token: Optional[str]
    api_key: Optional[str]
    max_retries: int
    timeout: Optional[float]
    headers: Dict[str, str] = field(default_factory=dict)

    @classmethod
    def of(
        cls,
        url: Optional[str],
        token: Optional[str],
        api_key: Optional[str],
        max_retries: int,
        timeout: Optional[float],
        headers: Optional[Mapping[str, str]],
    ) -> "Settings":
        """A client's settings from its arguments and the environment."""
        base = env_url(url)
        return cls(
            url=base,
            token=env_token(token, base),
            api_key=env_api_key(api_key),
            max_retries=max_retries,
            timeout=timeout,
            headers=dict(headers or {}),
        )

    def http_options(self, max_connections: int, cacert: Optional[str]) -> Dict[str, Any]:
        """The httpx client's options, the same for both clients."""
        t = self.timeout
        return {
            "base_url": self.url,
            "timeout": httpx.Timeout(t, connect=min(t or 10.0, 10.0), pool=None),
            "limits": limits(max_connections),
            "headers": {"user-agent": "warmgate-python", **self.headers},
            "verify": tls_verify(cacert),
        }

    def auth(self, plane: str) -> Dict[str, str]:
        """``Authorization`` for the control plane (the admin token), the
        data plane (the tenant's API key), or usage (the tenant's key when
        given: its own usage; else the admin token: everyone's); the
        weights and public routes need neither."""
        secret = {
            "control": self.token,
            "data": self.api_key,
            "usage": self.api_key or self.token,
        }.get(plane)
        return {"authorization": f"Bearer {secret}"} if secret else {}


#: Seconds an idle connection is kept for reuse. The gateway closes a
#: connection idle for ``limits.header_read_timeout`` (30 s by default); a
#: client that kept it as long would, now and then, send a request on a
#: connection the gateway is closing and get "Server disconnected without
#: sending a response" (seen once in CI at 30 s against 30 s).
KEEPALIVE_EXPIRY = 10.0


def limits(max_connections: int) -> httpx.Limits:
    return httpx.Limits(
        max_connections=max_connections,
        max_keepalive_connections=max_connections,
        keepalive_expiry=KEEPALIVE_EXPIRY,
    )


def decode(resp: httpx.Response) -> Any:
    """The JSON of a read answer (its text when it is not JSON)."""
    if not resp.content:
        return None
    try:
        return resp.json()
    except ValueError:
        return resp.text


def raise_for(resp: httpx.Response, body: Any) -> None:
    if resp.status_code >= 400:
        raise error_from_response(resp.status_code, body, resp.headers)


#: Methods sent again after the connection broke mid-request: they change
#: nothing.
IDEMPOTENT = frozenset({"GET", "HEAD"})


def retry_wait(err: BaseException, attempt: int) -> Optional[float]:
    """Seconds to wait before trying again after ``err`` (on try number
    ``attempt``, from 0), or ``None`` when it must not be tried again.

    Tried again: an answer that says ``Retry-After`` (queue full, quota,
    no capacity, starting), after that long; a 429 or 503 without it, after
    a short backoff; a connection that could not be made. Never: an answer
    with ``x-should-retry: false``, and any other answer (a 502 for a task
    means the gateway already spent the task's own retries)."""
    if isinstance(err, UnreachableError):
        return float(min(MAX_RETRY_WAIT, BASE_RETRY_WAIT * 2.0**attempt))
    if not isinstance(err, APIError) or not err.should_retry:
        return None
    if err.retry_after is not None:
        return min(MAX_RETRY_WAIT, err.retry_after)
    if err.status in (429, 503):
        return float(min(MAX_RETRY_WAIT, BASE_RETRY_WAIT * 2.0**attempt))
    return None


def unreachable(url: str, e: Exception) -> UnreachableError:
    return UnreachableError(
        f"cannot reach the gateway at {url} (is `warmgate serve` running? set {GATEWAY_ENV}): {e}"
    )


def batch_body(inputs: Iterable[Any], opts: TaskOptions) -> bytes:
    """A batch's body: the inputs are encoded one by one, never held as one
    list of values besides the caller's."""
    parts: List[str] = [json.dumps(i, separators=(",", ":")) for i in inputs]
    extra = opts.body()
    tail = "".join(f',{json.dumps(k)}:{json.dumps(v)}' for k, v in extra.items())
    return ('{"inputs":[' + ",".join(parts) + "]" + tail + "}").encode()


def batch_line(line: bytes) -> Union[TaskResult, WarmgateError]:
    """One NDJSON line of a batch: its result or its error."""
    try:
        v = json.loads(line)
    except ValueError as e:
        return UnreachableError(f"the batch's answer broke off: a line is not JSON ({e})")
    if "error" in v:
        return error_from_task(v["error"], index=v.get("index"))
    return TaskResult.from_json(v)


def task_outcome(record: Mapping[str, Any]) -> Optional[Union[TaskResult, APIError]]:
    """A task record's end: its result, its error, or ``None`` while it
    is still pending or running."""
    state = record.get("state")
    if state == "succeeded":
        return TaskResult.from_json(record)
    if state in ("failed", "cancelled"):
        return error_from_task(record.get("error") or {}, task_id=record.get("id"))
    return None


def usage_params(
    since: Optional[str],
    until: Optional[str],
    bucket: str,
    group_by: Iterable[str],
    tenant: Optional[str],
    app: Optional[str],
    model: Optional[str],
) -> Dict[str, str]:
    """The query of ``GET /v1/usage``."""
    p = {"bucket": bucket, "group_by": ",".join(group_by)}
    for k, v in (("since", since), ("until", until), ("tenant", tenant), ("app", app), ("model", model)):
        if v is not None:
            p[k] = v
    return p


def sync_body(
    checkpoint: str,
    version: int,
    timeout: Optional[Duration],
    max_unavailable: Optional[Union[int, str]],
) -> Dict[str, Any]:
    b: Dict[str, Any] = {"checkpoint": checkpoint, "version": int(version)}
    if timeout is not None:
        b["timeout"] = duration(timeout)
    if max_unavailable is not None:
        b["max_unavailable"] = max_unavailable
    return b


def promote_body(
    checkpoint: str,
    canary: Optional[int],
    bake: Optional[Duration],
    wait: bool,
    in_place: Optional[bool],
) -> Dict[str, Any]:
    b: Dict[str, Any] = {"checkpoint": checkpoint}
    if canary is not None:
        b["canary"] = int(canary)
    if bake is not None:
        b["bake"] = duration(bake)
    if wait:
        b["wait"] = True
    if in_place is not None:
        b["in_place"] = bool(in_place)
    return b
