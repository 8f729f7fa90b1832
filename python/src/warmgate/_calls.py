"""Every call of the gateway's API, written once for both clients.

Each method builds a :class:`Call` (method, path, body, which credentials,
how to read the answer) and hands it to the client's ``_call``: the
blocking :class:`warmgate.Client` sends it and answers with the value, the
:class:`warmgate.AsyncClient` answers with an awaitable of it (as redis-py's
command mixins serve its two clients). The handles (a pool, an app, a
task, a batch, a ``map``) share what does not wait in the same way. No I/O
happens here."""

from __future__ import annotations

import collections
import json as _json
from dataclasses import dataclass, field
from typing import Any, Callable, Deque, Dict, Iterable, Mapping, Optional, Tuple, Union

import httpx

from . import _core
from ._core import JSON, Duration, TaskOptions, TaskResult
from .errors import APIError, UnreachableError, WarmgateError

#: A keyword not given (``None`` may mean something).
UNSET: Any = object()

#: The states a task ends in.
ENDED = ("succeeded", "failed", "cancelled")


def _same(answer: Any) -> Any:
    return answer


@dataclass
class Call:
    """One request to the gateway, and what to make of its answer.
    ``plane``: ``"control"`` sends the admin token, ``"data"`` the API key
    (default: chosen by the path). ``then`` reads the decoded JSON answer
    (with ``raw``, the response itself)."""

    method: str
    path: str
    json: Any = UNSET
    content: Optional[bytes] = None
    params: Optional[Mapping[str, str]] = None
    headers: Mapping[str, str] = field(default_factory=dict)
    plane: Optional[str] = None
    timeout: Any = UNSET
    retry: bool = True
    stream: bool = False
    raw: bool = False
    then: Callable[[Any], Any] = _same

    def body(self) -> Optional[bytes]:
        if self.json is not UNSET:
            return _json.dumps(self.json, separators=(",", ":")).encode()
        return self.content


def plane_of(path: str) -> str:
    """Which credentials a path takes: ``data`` (the API key), ``control``
    (the admin token) or ``usage`` (either)."""
    p = path.split("?", 1)[0]
    if p.startswith("/v1/tasks/") or p.startswith("/v1/batches/"):
        return "data"
    if p.startswith("/v1/pools/") and "/tasks" in p:
        return "data"
    if p.startswith("/v1/usage"):
        return "usage"
    if p.startswith("/v1/status") or p.startswith("/v1/apps") or p.startswith("/v1/pools"):
        return "control"
    if p.startswith("/v1/weights"):
        return "control"
    return "data"


class Attempts:
    """One call's tries under the retry rule (``_core.retry_wait``),
    without I/O: the client sends :meth:`request`, then hands a transport
    error to :meth:`failed` or an error answer (its body read) to
    :meth:`refused`; each gives how long to wait before the next try, or
    raises the call's error."""

    def __init__(self, http: Union[httpx.Client, httpx.AsyncClient], s: _core.Settings, call: Call):
        self._http = http
        self._s = s
        self._call = call
        self._tries = s.max_retries + 1 if call.retry else 1
        self._attempt = 0
        headers: Dict[str, str] = {**s.auth(call.plane or plane_of(call.path)), **call.headers}
        self._content = call.body()
        if self._content is not None:
            headers.setdefault("content-type", "application/json")
        self._headers = headers

    def request(self) -> httpx.Request:
        c = self._call
        return self._http.build_request(
            c.method, c.path, content=self._content, params=c.params, headers=self._headers,
            timeout=self._http.timeout if c.timeout is UNSET else c.timeout,
        )

    def failed(self, e: httpx.TransportError) -> float:
        err = _core.unreachable(self._s.url, e)
        connected = not isinstance(e, (httpx.ConnectError, httpx.ConnectTimeout))
        # The request may have reached the gateway: a task is not sent
        # twice. A GET changes nothing, and a keep-alive connection closed
        # just as it was reused ends this way: it is sent again.
        if connected and self._call.method not in _core.IDEMPOTENT:
            raise err from None
        return self._again(err)

    def refused(self, resp: httpx.Response) -> float:
        try:
            _core.raise_for(resp, _core.decode(resp))
        except APIError as e:
            return self._again(e)
        raise AssertionError("an error answer raises")  # pragma: no cover

    def _again(self, err: WarmgateError) -> float:
        wait = _core.retry_wait(err, self._attempt)
        self._attempt += 1
        if wait is None or self._attempt >= self._tries:
            raise err
        return wait


class Calls:
    """The gateway's API and a client's settings; the client supplies
    ``_call``, its httpx client class and the types of its handles."""

    _http_class: Any
    _max_connections: int
    _pool_type: Any
    _app_type: Any
    _task_type: Any
    _batch_type: Any
    _map_type: Any

    def __init__(
        self,
        url: Optional[str] = None,
        token: Optional[str] = None,
        *,
        api_key: Optional[str] = None,
        timeout: Optional[float] = 600.0,
        max_retries: int = 2,
        max_connections: Any = UNSET,
        headers: Optional[Mapping[str, str]] = None,
        transport: Any = None,
        cacert: Optional[str] = None,
    ) -> None:
        self._s = _core.Settings.of(url, token, api_key, max_retries, timeout, headers)
        # None: no limit, as httpx takes it; not given: the client's default.
        limit = self._max_connections if max_connections is UNSET else max_connections
        options = self._s.http_options(limit, cacert)
        self._http = self._http_class(transport=transport, **options)

    @property
    def url(self) -> str:
        """The gateway's URL."""
        return self._s.url

    def __repr__(self) -> str:
        return f"warmgate.{type(self).__name__}({self._s.url!r})"

    def _call(self, call: Call) -> Any:
        raise NotImplementedError

    def request(
        self,
        method: str,
        path: str,
        *,
        json: Any = UNSET,
        params: Optional[Mapping[str, str]] = None,
        headers: Optional[Mapping[str, str]] = None,
        plane: Optional[str] = None,
        timeout: Any = UNSET,
        retry: bool = True,
    ) -> Any:
        """Any call to the gateway: the decoded JSON answer, or the typed
        error for an error answer. ``plane``: ``"control"`` sends the admin
        token, ``"data"`` the API key (default: chosen by the path)."""
        return self._call(Call(
            method, path, json=json, params=params, headers=dict(headers or {}), plane=plane,
            timeout=timeout, retry=retry,
        ))

    # --- the control plane ------------------------------------------------

    def status(self) -> Any:
        """``GET /v1/status``: every app (revisions, replicas), pool and tenant."""
        return self._call(Call("GET", "/v1/status"))

    def apps(self) -> Any:
        """Every app's status (``GET /v1/apps``)."""
        return self._call(Call("GET", "/v1/apps", then=lambda a: list(a["apps"])))

    def get_app(self, name: str) -> Any:
        return self._call(Call("GET", f"/v1/apps/{_core.quote(name)}"))

    def put_app(self, name: str, spec: Mapping[str, Any]) -> Any:
        """Creates or changes an app; ``spec`` is an ``[[apps]]`` entry as a
        dict. Answers ``{"app", "change", ...}``."""
        return self._call(Call("PUT", f"/v1/apps/{_core.quote(name)}", json=dict(spec)))

    def delete_app(self, name: str) -> Any:
        return self._call(Call("DELETE", f"/v1/apps/{_core.quote(name)}"))

    def pools(self) -> Any:
        """Every pool's status (from ``/v1/status``)."""
        return self._call(Call("GET", "/v1/status", then=lambda s: list(s["pools"])))

    def get_pool(self, name: str) -> Any:
        return self._call(Call("GET", f"/v1/pools/{_core.quote(name)}"))

    def put_pool(self, name: str, spec: Mapping[str, Any]) -> Any:
        """Creates a pool, or changes a running one in place; ``spec`` is a
        ``[[pools]]`` entry as a dict."""
        return self._call(Call("PUT", f"/v1/pools/{_core.quote(name)}", json=dict(spec)))

    def delete_pool(self, name: str) -> Any:
        return self._call(Call("DELETE", f"/v1/pools/{_core.quote(name)}"))

    def promote(
        self,
        app: str,
        checkpoint: str,
        *,
        canary: Optional[int] = None,
        bake: Optional[Duration] = None,
        wait: bool = False,
        in_place: Optional[bool] = None,
    ) -> Any:
        """Makes a revision of ``app`` from ``checkpoint`` and shifts traffic
        to it; with ``wait``, answers once the promotion has ended."""
        body = _core.promote_body(checkpoint, canary, bake, wait, in_place)
        return self._call(Call(
            "POST", f"/v1/apps/{_core.quote(app)}/promote", json=body,
            timeout=None if wait else UNSET,
        ))

    def rollback(self, app: str) -> Any:
        return self._call(Call("POST", f"/v1/apps/{_core.quote(app)}/rollback", json={}))

    def revisions(self, app: str) -> Any:
        """``{"app", "revisions" (newest first), "promotion", "notes"}``."""
        return self._call(Call("GET", f"/v1/apps/{_core.quote(app)}/revisions"))

    def sync_weights(
        self,
        pool: str,
        checkpoint: str,
        version: int,
        *,
        timeout: Optional[Duration] = None,
        max_unavailable: Optional[Union[int, str]] = None,
    ) -> Any:
        """Makes ``version`` the pool's latest and swaps ``checkpoint`` into
        its warm replicas in place; answers with one result per replica."""
        body = _core.sync_body(checkpoint, version, timeout, max_unavailable)
        return self._call(Call(
            "POST", f"/v1/pools/{_core.quote(pool)}/weights", json=body, timeout=None
        ))

    # --- tasks --------------------------------------------------------------

    def submit(self, pool: str, input: JSON, **options: Any) -> Any:
        """Runs one task and waits for its result. ``options``: ``priority``,
        ``timeout``, ``retries``, ``min_weights_version``, ``tenant``."""
        opts = TaskOptions(**options)
        return self._call(Call(
            "POST", f"/v1/pools/{_core.quote(pool)}/tasks",
            json={"input": input, **opts.body()}, headers=opts.headers(), plane="data",
            then=TaskResult.from_json,
        ))

    def submit_async(self, pool: str, input: JSON, **options: Any) -> Any:
        """Queues one task and answers at once with its handle."""
        opts = TaskOptions(**options)
        return self._call(Call(
            "POST", f"/v1/pools/{_core.quote(pool)}/tasks",
            json={"input": input, **opts.body()}, params={"async": "true"},
            headers=opts.headers(), plane="data",
            then=lambda a: self._task_type(self, str(a["id"]), pool),
        ))

    def task(self, task_id: str) -> Any:
        """A task's record: ``{"id", "pool", "state", "output", "error",
        "attempts", "replica", "weights_version"}``."""
        return self._call(Call("GET", f"/v1/tasks/{_core.quote(task_id)}", plane="data"))

    def cancel_task(self, task_id: str) -> Any:
        """Cancels a task: a queued one never runs, a running one's call to
        its worker is dropped. Its record, ``state: "cancelled"``; a task
        that already ended raises :class:`ConflictError`."""
        return self._call(Call(
            "DELETE", f"/v1/tasks/{_core.quote(task_id)}", plane="data", retry=False
        ))

    def usage(
        self,
        *,
        since: Optional[str] = "24h",
        until: Optional[str] = None,
        bucket: str = "total",
        group_by: Iterable[str] = ("tenant", "app", "model"),
        tenant: Optional[str] = None,
        app: Optional[str] = None,
        model: Optional[str] = None,
    ) -> Any:
        """Tokens used, as the engines counted them: a row per bucket
        (``hour``, ``day`` or ``total``) and group, each with
        ``requests``, ``prompt_tokens``, ``cached_tokens``,
        ``completion_tokens`` and ``total_tokens``. With an API key, the
        tenant's own; with the admin token, everyone's."""
        params = _core.usage_params(since, until, bucket, group_by, tenant, app, model)
        return self._call(Call(
            "GET", "/v1/usage", params=params, plane="usage", then=lambda a: a["data"]
        ))

    def batch(
        self, pool: str, inputs: Iterable[JSON], *, return_exceptions: bool = False, **options: Any
    ) -> Any:
        """Runs every input as a task of one batch; the results come back as
        an iterator, in input order, as the gateway streams them."""
        return self._batch_type(self, pool, inputs, TaskOptions(**options), return_exceptions)

    def map(
        self,
        pool: str,
        inputs: Any,
        *,
        concurrency: int = 64,
        return_exceptions: bool = False,
        results: bool = False,
        **options: Any,
    ) -> Any:
        """Runs every input as a task, at most ``concurrency`` at a time, and
        yields their outputs in input order (``results=True``: the whole
        :class:`TaskResult`). ``inputs`` is read lazily, so it may be a
        generator of any length. A failed task raises its error there
        (``return_exceptions=True``: yields it instead)."""
        return self._map_type(self, pool, inputs, concurrency, TaskOptions(**options),
                              return_exceptions, results)

    # --- handles --------------------------------------------------------------

    def pool(self, name: str, **options: Any) -> Any:
        """A handle on one pool; ``options`` (``priority``, ``timeout``,
        ``retries``, ``min_weights_version``, ``tenant``) apply to each of
        its tasks."""
        return self._pool_type(self, name, TaskOptions(**options))

    def app(self, name: str) -> Any:
        """A handle on one app."""
        return self._app_type(self, name)


def merge(base: TaskOptions, options: Mapping[str, Any]) -> Dict[str, Any]:
    """A handle's task options, overridden by a call's."""
    merged = {k: v for k, v in vars(base).items() if v is not None}
    merged.update(options)
    return merged


class PoolCalls:
    """One pool of a client: its tasks, weights and spec."""

    def __init__(self, client: Any, name: str, options: Optional[TaskOptions] = None) -> None:
        self.client = client
        self.name = name
        self.options = options or TaskOptions()

    def __repr__(self) -> str:
        return f"warmgate.{type(self).__name__}({self.name!r})"

    def with_options(self, **options: Any) -> Any:
        """The same pool with other task options (``min_weights_version``…)."""
        return type(self)(self.client, self.name, TaskOptions(**merge(self.options, options)))

    def get(self) -> Any:
        return self.client.get_pool(self.name)

    def put(self, spec: Mapping[str, Any]) -> Any:
        return self.client.put_pool(self.name, spec)

    def delete(self) -> Any:
        return self.client.delete_pool(self.name)

    def sync_weights(self, checkpoint: str, version: int, **kw: Any) -> Any:
        return self.client.sync_weights(self.name, checkpoint, version, **kw)

    def submit(self, input: JSON, **options: Any) -> Any:
        return self.client.submit(self.name, input, **merge(self.options, options))

    def submit_async(self, input: JSON, **options: Any) -> Any:
        return self.client.submit_async(self.name, input, **merge(self.options, options))

    def batch(self, inputs: Iterable[JSON], **options: Any) -> Any:
        return self.client.batch(self.name, inputs, **merge(self.options, options))

    def map(self, inputs: Any, concurrency: int = 64, **options: Any) -> Any:
        return self.client.map(self.name, inputs, concurrency=concurrency,
                               **merge(self.options, options))


class AppCalls:
    """One app of a client: its spec, promotions and revisions."""

    def __init__(self, client: Any, name: str) -> None:
        self.client = client
        self.name = name

    def __repr__(self) -> str:
        return f"warmgate.{type(self).__name__}({self.name!r})"

    def get(self) -> Any:
        return self.client.get_app(self.name)

    def put(self, spec: Mapping[str, Any]) -> Any:
        return self.client.put_app(self.name, spec)

    def delete(self) -> Any:
        return self.client.delete_app(self.name)

    def promote(self, checkpoint: str, **kw: Any) -> Any:
        return self.client.promote(self.name, checkpoint, **kw)

    def rollback(self) -> Any:
        return self.client.rollback(self.name)

    def revisions(self) -> Any:
        return self.client.revisions(self.name)


class TaskCalls:
    """A task submitted with ``submit_async``: poll it, or wait for it."""

    def __init__(self, client: Any, id: str, pool: str) -> None:
        self.client = client
        self.id = id
        self.pool = pool

    def __repr__(self) -> str:
        return f"warmgate.{type(self).__name__}({self.id!r}, pool={self.pool!r})"

    def get(self) -> Any:
        """Its record as the gateway has it now."""
        return self.client.task(self.id)

    def done(self) -> Any:
        """Whether it has ended (succeeded, failed or cancelled)."""
        return self.client._call(Call(
            "GET", f"/v1/tasks/{_core.quote(self.id)}", plane="data",
            then=lambda r: r.get("state") in ENDED,
        ))

    def cancel(self) -> Any:
        """Cancels it (see :meth:`warmgate.Client.cancel_task`): its record."""
        return self.client.cancel_task(self.id)


#: A blank line of a batch's stream.
SKIP: Any = object()


class BatchState:
    """What a batch's two iterators share: its body, its id, and what each
    line of the stream gives."""

    def __init__(
        self,
        client: Any,
        pool: str,
        inputs: Iterable[JSON],
        options: TaskOptions,
        return_exceptions: bool,
    ) -> None:
        self._client = client
        self._body = _core.batch_body(inputs, options)
        self._headers = options.headers()
        self._path = f"/v1/pools/{_core.quote(pool)}/tasks/batch"
        self._return_exceptions = return_exceptions
        self._resp: Optional[httpx.Response] = None
        self._count = 0
        self._closed = False

    def _stream_call(self) -> Call:
        return Call("POST", self._path, content=self._body, headers=self._headers,
                    plane="data", stream=True, raw=True)

    @property
    def id(self) -> Optional[str]:
        """The batch's id on the gateway, once it is streaming."""
        if self._resp is None:
            return None
        return self._resp.headers.get("x-warmgate-batch-id")

    def _cancel_call(self) -> Optional[Call]:
        """``DELETE /v1/batches/{id}``, while there is a batch to cancel."""
        if self.id is None or self._closed:
            return None
        return Call("DELETE", f"/v1/batches/{_core.quote(self.id)}", plane="data", retry=False)

    def _broke_off(self, e: Exception) -> UnreachableError:
        return UnreachableError(f"the batch broke off after {self._count} results: {e}")

    def _item(self, line: str) -> Any:
        """What one line gives: ``SKIP`` for a blank one, a result, or an
        error (to raise when :meth:`_fatal`)."""
        if not line.strip():
            return SKIP
        self._count += 1
        return _core.batch_line(line.encode())

    def _fatal(self, item: Any) -> bool:
        """Whether the item is an error that ends the iteration (raised)."""
        return isinstance(item, WarmgateError) and not (
            self._return_exceptions and isinstance(item, APIError)
        )


class MapState:
    """What a ``map``'s two iterators share: the window of submissions in
    flight, in input order, and what a finished one gives."""

    def __init__(
        self,
        client: Any,
        pool: str,
        inputs: Any,
        concurrency: int,
        options: TaskOptions,
        return_exceptions: bool,
        results: bool,
    ) -> None:
        if concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        self._client = client
        self._pool = pool
        self._concurrency = concurrency
        # Finished results held behind a slower earlier one, at most.
        self._held = 4 * concurrency
        self._options = vars(options).copy()
        self._return_exceptions = return_exceptions
        self._results = results
        self._pending: Deque[Any] = collections.deque()
        self._exhausted = False
        self._cancelled = False
        self._index = 0
        self._take(inputs)

    def _take(self, inputs: Any) -> None:
        """Keeps the inputs, to read them lazily (and what runs them)."""
        raise NotImplementedError

    def _room(self) -> bool:
        """Whether another input may be submitted now."""
        if self._exhausted or self._cancelled:
            return False
        running = sum(1 for f in self._pending if not f.done())
        return running < self._concurrency and len(self._pending) < self._held

    def _next_index(self) -> int:
        i = self._index
        self._index += 1
        return i

    def _wait_for(self) -> Tuple[Any, list]:
        """The head of the window when it is done, else ``None`` and the
        submissions still running (to wait for one of)."""
        head = self._pending[0]
        if head.done():
            self._pending.popleft()
            return head, []
        return None, [f for f in self._pending if not f.done()]

    def _output(self, done: Any) -> Any:
        """A finished submission's output as the caller asked for it; its
        error raised (returned, with ``return_exceptions``)."""
        try:
            r = done.result()
        except APIError as e:
            if self._return_exceptions:
                return e
            raise
        return r if self._results else r.output

    @staticmethod
    def _indexed(r: TaskResult, index: int) -> TaskResult:
        r.index = index
        return r
