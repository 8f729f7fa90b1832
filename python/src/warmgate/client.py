"""The blocking client: :class:`Client`, and the handles it gives for one
pool (:class:`Pool`) and one app (:class:`App`)."""

from __future__ import annotations

import collections
import concurrent.futures
import json as _json
import threading
import time
from typing import (
    Any,
    Deque,
    Dict,
    Iterable,
    Iterator,
    List,
    Mapping,
    Optional,
    Union,
)

import httpx

from . import _core
from ._core import JSON, Duration, TaskOptions, TaskResult
from .errors import APIError, NotFoundError, UnreachableError, WarmgateError

__all__ = ["Client", "Pool", "App", "Task", "Batch", "TaskMap"]

_UNSET: Any = object()


class Client:
    """A blocking client for one gateway.

    ``url`` defaults to ``$WARMGATE_GATEWAY`` (else
    ``http://127.0.0.1:8080``); ``token`` (the control plane's admin token)
    to ``$WARMGATE_ADMIN_TOKEN``, else the token a ``warmgate serve`` of
    this user made for itself and published for that address, as the CLI
    finds it (``token=""``: send none); ``api_key`` (a ``[[tenants]]`` key,
    for tasks) to ``$WARMGATE_API_KEY``; ``cacert`` (a PEM file of CA
    certificates trusted besides the system's, for an ``https://`` gateway
    with a private CA or a self-signed certificate) to ``$WARMGATE_CACERT``. ``max_retries`` answers that say
    ``Retry-After`` are tried again after that long; ``x-should-retry:
    false`` is never tried again. ``timeout`` is the longest wait for any
    one answer, in seconds (``None``: no limit). Safe to share between
    threads; close it (or use ``with``) to free its connections.
    """

    def __init__(
        self,
        url: Optional[str] = None,
        token: Optional[str] = None,
        *,
        api_key: Optional[str] = None,
        timeout: Optional[float] = 600.0,
        max_retries: int = 2,
        max_connections: int = 256,
        headers: Optional[Mapping[str, str]] = None,
        transport: Optional[httpx.BaseTransport] = None,
        cacert: Optional[str] = None,
    ) -> None:
        base = _core.env_url(url)
        self._s = _core.Settings(
            url=base,
            token=_core.env_token(token, base),
            api_key=_core.env_api_key(api_key),
            max_retries=max_retries,
            timeout=timeout,
            headers=dict(headers or {}),
        )
        self._http = httpx.Client(
            base_url=self._s.url,
            timeout=httpx.Timeout(timeout, connect=min(timeout or 10.0, 10.0), pool=None),
            limits=_core.limits(max_connections),
            headers={"user-agent": "warmgate-python", **self._s.headers},
            transport=transport,
            verify=_core.tls_verify(cacert),
        )

    @property
    def url(self) -> str:
        """The gateway's URL."""
        return self._s.url

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"warmgate.Client({self._s.url!r})"

    # --- the transport ----------------------------------------------------

    def request(
        self,
        method: str,
        path: str,
        *,
        json: Any = _UNSET,
        params: Optional[Mapping[str, str]] = None,
        headers: Optional[Mapping[str, str]] = None,
        plane: Optional[str] = None,
        timeout: Any = _UNSET,
        retry: bool = True,
    ) -> Any:
        """Any call to the gateway: the decoded JSON answer, or the typed
        error for an error answer. ``plane``: ``"control"`` sends the admin
        token, ``"data"`` the API key (default: chosen by the path)."""
        resp = self._send(
            method, path, json=json, params=params, headers=headers, plane=plane,
            timeout=timeout, retry=retry,
        )
        return _core.decode(resp)

    def _send(
        self,
        method: str,
        path: str,
        *,
        json: Any = _UNSET,
        content: Optional[bytes] = None,
        params: Optional[Mapping[str, str]] = None,
        headers: Optional[Mapping[str, str]] = None,
        plane: Optional[str] = None,
        timeout: Any = _UNSET,
        retry: bool = True,
        stream: bool = False,
    ) -> httpx.Response:
        plane = plane or _plane_of(path)
        h: Dict[str, str] = {**self._s.auth(plane), **(headers or {})}
        if json is not _UNSET:
            content = _json.dumps(json, separators=(",", ":")).encode()
        if content is not None:
            h.setdefault("content-type", "application/json")
        tries = self._s.max_retries + 1 if retry else 1
        for attempt in range(tries):
            err: WarmgateError
            try:
                req = self._http.build_request(
                    method, path, content=content, params=params, headers=h,
                    timeout=self._http.timeout if timeout is _UNSET else timeout,
                )
                resp = self._http.send(req, stream=stream)
            except (httpx.ConnectError, httpx.ConnectTimeout) as e:
                err = _core.unreachable(self._s.url, e)
            except httpx.TransportError as e:
                # The request may have reached the gateway: a task is not
                # sent twice. A GET changes nothing, and a keep-alive
                # connection closed just as it was reused ends this way:
                # it is sent again.
                if method not in _core.IDEMPOTENT:
                    raise _core.unreachable(self._s.url, e) from None
                err = _core.unreachable(self._s.url, e)
            else:
                if resp.status_code < 400:
                    return resp
                if stream:
                    resp.read()
                    resp.close()
                try:
                    _core.raise_for(resp, _core.decode(resp))
                except APIError as e:
                    err = e
            wait = _core.retry_wait(err, attempt)
            if wait is None or attempt + 1 >= tries:
                raise err
            time.sleep(wait)
        raise AssertionError("unreachable")  # pragma: no cover

    # --- the control plane ------------------------------------------------

    def status(self) -> Dict[str, Any]:
        """``GET /v1/status``: every app (revisions, replicas), pool and tenant."""
        return self.request("GET", "/v1/status")  # type: ignore[no-any-return]

    def apps(self) -> List[Dict[str, Any]]:
        """Every app's status (``GET /v1/apps``)."""
        return list(self.request("GET", "/v1/apps")["apps"])

    def get_app(self, name: str) -> Dict[str, Any]:
        return self.request("GET", f"/v1/apps/{_core.quote(name)}")  # type: ignore[no-any-return]

    def put_app(self, name: str, spec: Mapping[str, Any]) -> Dict[str, Any]:
        """Creates or changes an app; ``spec`` is an ``[[apps]]`` entry as a
        dict. Answers ``{"app", "change", ...}``."""
        return self.request("PUT", f"/v1/apps/{_core.quote(name)}", json=dict(spec))  # type: ignore[no-any-return]

    def delete_app(self, name: str) -> Dict[str, Any]:
        return self.request("DELETE", f"/v1/apps/{_core.quote(name)}")  # type: ignore[no-any-return]

    def pools(self) -> List[Dict[str, Any]]:
        """Every pool's status (from ``/v1/status``)."""
        return list(self.status()["pools"])

    def get_pool(self, name: str) -> Dict[str, Any]:
        return self.request("GET", f"/v1/pools/{_core.quote(name)}")  # type: ignore[no-any-return]

    def put_pool(self, name: str, spec: Mapping[str, Any]) -> Dict[str, Any]:
        """Creates a pool, or changes a running one in place; ``spec`` is a
        ``[[pools]]`` entry as a dict."""
        return self.request("PUT", f"/v1/pools/{_core.quote(name)}", json=dict(spec))  # type: ignore[no-any-return]

    def delete_pool(self, name: str) -> Dict[str, Any]:
        return self.request("DELETE", f"/v1/pools/{_core.quote(name)}")  # type: ignore[no-any-return]

    def promote(
        self,
        app: str,
        checkpoint: str,
        *,
        canary: Optional[int] = None,
        bake: Optional[Duration] = None,
        wait: bool = False,
        in_place: Optional[bool] = None,
    ) -> Dict[str, Any]:
        """Makes a revision of ``app`` from ``checkpoint`` and shifts traffic
        to it; with ``wait``, answers once the promotion has ended."""
        body = _core.promote_body(checkpoint, canary, bake, wait, in_place)
        return self.request(  # type: ignore[no-any-return]
            "POST", f"/v1/apps/{_core.quote(app)}/promote", json=body,
            timeout=None if wait else _UNSET,
        )

    def rollback(self, app: str) -> Dict[str, Any]:
        return self.request("POST", f"/v1/apps/{_core.quote(app)}/rollback", json={})  # type: ignore[no-any-return]

    def revisions(self, app: str) -> Dict[str, Any]:
        """``{"app", "revisions" (newest first), "promotion", "notes"}``."""
        return self.request("GET", f"/v1/apps/{_core.quote(app)}/revisions")  # type: ignore[no-any-return]

    def sync_weights(
        self,
        pool: str,
        checkpoint: str,
        version: int,
        *,
        timeout: Optional[Duration] = None,
        max_unavailable: Optional[Union[int, str]] = None,
    ) -> Dict[str, Any]:
        """Makes ``version`` the pool's latest and swaps ``checkpoint`` into
        its warm replicas in place; answers with one result per replica."""
        body = _core.sync_body(checkpoint, version, timeout, max_unavailable)
        return self.request(  # type: ignore[no-any-return]
            "POST", f"/v1/pools/{_core.quote(pool)}/weights", json=body, timeout=None
        )

    # --- tasks --------------------------------------------------------------

    def submit(self, pool: str, input: JSON, **options: Any) -> TaskResult:
        """Runs one task and waits for its result. ``options``: ``priority``,
        ``timeout``, ``retries``, ``min_weights_version``, ``tenant``."""
        opts = TaskOptions(**options)
        resp = self._send(
            "POST", f"/v1/pools/{_core.quote(pool)}/tasks",
            json={"input": input, **opts.body()}, headers=opts.headers(), plane="data",
        )
        return TaskResult.from_json(resp.json())

    def submit_async(self, pool: str, input: JSON, **options: Any) -> "Task":
        """Queues one task and answers at once with its handle."""
        opts = TaskOptions(**options)
        resp = self._send(
            "POST", f"/v1/pools/{_core.quote(pool)}/tasks",
            json={"input": input, **opts.body()}, params={"async": "true"},
            headers=opts.headers(), plane="data",
        )
        return Task(self, str(resp.json()["id"]), pool)

    def task(self, task_id: str) -> Dict[str, Any]:
        """A task's record: ``{"id", "pool", "state", "output", "error",
        "attempts", "replica", "weights_version"}``."""
        return self.request("GET", f"/v1/tasks/{_core.quote(task_id)}", plane="data")  # type: ignore[no-any-return]

    def cancel_task(self, task_id: str) -> Dict[str, Any]:
        """Cancels a task: a queued one never runs, a running one's call to
        its worker is dropped. Its record, ``state: "cancelled"``; a task
        that already ended raises :class:`ConflictError`."""
        return self.request(  # type: ignore[no-any-return]
            "DELETE", f"/v1/tasks/{_core.quote(task_id)}", plane="data", retry=False
        )

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
    ) -> List[Dict[str, Any]]:
        """Tokens used, as the engines counted them: a row per bucket
        (``hour``, ``day`` or ``total``) and group, each with
        ``requests``, ``prompt_tokens``, ``cached_tokens``,
        ``completion_tokens`` and ``total_tokens``. With an API key, the
        tenant's own; with the admin token, everyone's."""
        params = _core.usage_params(since, until, bucket, group_by, tenant, app, model)
        return self.request("GET", "/v1/usage", params=params, plane="usage")["data"]  # type: ignore[no-any-return]

    def batch(
        self, pool: str, inputs: Iterable[JSON], *, return_exceptions: bool = False, **options: Any
    ) -> "Batch":
        """Runs every input as a task of one batch; the results come back as
        an iterator, in input order, as the gateway streams them."""
        return Batch(self, pool, inputs, TaskOptions(**options), return_exceptions)

    def map(
        self,
        pool: str,
        inputs: Iterable[JSON],
        *,
        concurrency: int = 64,
        return_exceptions: bool = False,
        results: bool = False,
        **options: Any,
    ) -> "TaskMap":
        """Runs every input as a task, at most ``concurrency`` at a time, and
        yields their outputs in input order (``results=True``: the whole
        :class:`TaskResult`). ``inputs`` is read lazily, so it may be a
        generator of any length. A failed task raises its error there
        (``return_exceptions=True``: yields it instead)."""
        return TaskMap(self, pool, inputs, concurrency, TaskOptions(**options),
                       return_exceptions, results)

    # --- handles --------------------------------------------------------------

    def pool(self, name: str, **options: Any) -> "Pool":
        """A handle on one pool; ``options`` (``priority``, ``timeout``,
        ``retries``, ``min_weights_version``, ``tenant``) apply to each of
        its tasks."""
        return Pool(self, name, TaskOptions(**options))

    def app(self, name: str) -> "App":
        """A handle on one app."""
        return App(self, name)


def _plane_of(path: str) -> str:
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


def _merge(base: TaskOptions, options: Mapping[str, Any]) -> Dict[str, Any]:
    merged = {k: v for k, v in vars(base).items() if v is not None}
    merged.update(options)
    return merged


class Pool:
    """One pool of a :class:`Client`: its tasks, weights and spec."""

    def __init__(self, client: Client, name: str, options: Optional[TaskOptions] = None) -> None:
        self.client = client
        self.name = name
        self.options = options or TaskOptions()

    def __repr__(self) -> str:
        return f"warmgate.Pool({self.name!r})"

    def with_options(self, **options: Any) -> "Pool":
        """The same pool with other task options (``min_weights_version``…)."""
        return Pool(self.client, self.name, TaskOptions(**_merge(self.options, options)))

    def get(self) -> Dict[str, Any]:
        return self.client.get_pool(self.name)

    def put(self, spec: Mapping[str, Any]) -> Dict[str, Any]:
        return self.client.put_pool(self.name, spec)

    def delete(self) -> Dict[str, Any]:
        return self.client.delete_pool(self.name)

    @property
    def weights_version(self) -> int:
        """The newest weights version synced into the pool."""
        return int(self.get().get("weights_version") or 0)

    def sync_weights(self, checkpoint: str, version: int, **kw: Any) -> Dict[str, Any]:
        return self.client.sync_weights(self.name, checkpoint, version, **kw)

    def submit(self, input: JSON, **options: Any) -> TaskResult:
        return self.client.submit(self.name, input, **_merge(self.options, options))

    def submit_async(self, input: JSON, **options: Any) -> "Task":
        return self.client.submit_async(self.name, input, **_merge(self.options, options))

    def batch(self, inputs: Iterable[JSON], **options: Any) -> "Batch":
        return self.client.batch(self.name, inputs, **_merge(self.options, options))

    def map(self, inputs: Iterable[JSON], concurrency: int = 64, **options: Any) -> "TaskMap":
        return self.client.map(self.name, inputs, concurrency=concurrency,
                               **_merge(self.options, options))


class App:
    """One app of a :class:`Client`: its spec, promotions and revisions."""

    def __init__(self, client: Client, name: str) -> None:
        self.client = client
        self.name = name

    def __repr__(self) -> str:
        return f"warmgate.App({self.name!r})"

    def get(self) -> Dict[str, Any]:
        return self.client.get_app(self.name)

    def put(self, spec: Mapping[str, Any]) -> Dict[str, Any]:
        return self.client.put_app(self.name, spec)

    def delete(self) -> Dict[str, Any]:
        return self.client.delete_app(self.name)

    def promote(self, checkpoint: str, **kw: Any) -> Dict[str, Any]:
        return self.client.promote(self.name, checkpoint, **kw)

    def rollback(self) -> Dict[str, Any]:
        return self.client.rollback(self.name)

    def revisions(self) -> Dict[str, Any]:
        return self.client.revisions(self.name)


class Task:
    """A task submitted with ``submit_async``: poll it, or wait for it."""

    def __init__(self, client: Client, id: str, pool: str) -> None:
        self.client = client
        self.id = id
        self.pool = pool

    def __repr__(self) -> str:
        return f"warmgate.Task({self.id!r}, pool={self.pool!r})"

    def get(self) -> Dict[str, Any]:
        """Its record as the gateway has it now."""
        return self.client.task(self.id)

    def done(self) -> bool:
        return self.get().get("state") in ("succeeded", "failed", "cancelled")

    def cancel(self) -> Dict[str, Any]:
        """Cancels it (see :meth:`Client.cancel_task`): its record."""
        return self.client.cancel_task(self.id)

    def result(self, timeout: Optional[float] = None) -> TaskResult:
        """Waits for its end: its result, or its error raised. ``timeout``
        (seconds) bounds the wait here (``TimeoutError`` past it); the
        task's own timeout is the gateway's."""
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 0.01
        while True:
            end = _core.task_outcome(self.get())
            if isinstance(end, TaskResult):
                return end
            if end is not None:
                raise end
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"task {self.id} did not end within {timeout} s")
            time.sleep(delay)
            delay = min(delay * 2, 0.5)


class Batch(Iterator[Any]):
    """The results of a batch, in input order, read as the gateway streams
    them: a :class:`TaskResult` per input, or its error (raised, or yielded
    with ``return_exceptions``). :meth:`cancel` cancels what is left of it
    on the gateway (``DELETE /v1/batches/{id}``: no input not taken yet is
    submitted, the tasks queued or running are cancelled) and closes the
    stream; leaving a ``with`` block, or closing it, closes the stream,
    which cancels the rest too."""

    def __init__(
        self,
        client: Client,
        pool: str,
        inputs: Iterable[JSON],
        options: TaskOptions,
        return_exceptions: bool,
    ) -> None:
        self._client = client
        self._pool = pool
        self._body = _core.batch_body(inputs, options)
        self._headers = options.headers()
        self._return_exceptions = return_exceptions
        self._resp: Optional[httpx.Response] = None
        self._lines: Optional[Iterator[str]] = None
        self._count = 0
        self._closed = False

    def _open(self) -> Iterator[str]:
        if self._lines is None:
            self._resp = self._client._send(
                "POST", f"/v1/pools/{_core.quote(self._pool)}/tasks/batch",
                content=self._body, headers=self._headers, plane="data", stream=True,
            )
            self._lines = self._resp.iter_lines()
        return self._lines

    def __iter__(self) -> "Batch":
        return self

    def __next__(self) -> Any:
        if self._closed:
            raise StopIteration
        lines = self._open()
        while True:
            try:
                line = next(lines)
            except StopIteration:
                self.close()
                raise
            except httpx.TransportError as e:
                self.close()
                raise UnreachableError(
                    f"the batch broke off after {self._count} results: {e}"
                ) from None
            if line.strip():
                break
        item = _core.batch_line(line.encode())
        self._count += 1
        if isinstance(item, WarmgateError) and not (
            self._return_exceptions and isinstance(item, APIError)
        ):
            self.close()
            raise item
        return item

    @property
    def id(self) -> Optional[str]:
        """The batch's id on the gateway, once it is streaming."""
        if self._resp is None:
            return None
        return self._resp.headers.get("x-warmgate-batch-id")

    def cancel(self) -> None:
        """Stops the batch: its remaining tasks cancelled, its stream
        closed."""
        if self.id is not None and not self._closed:
            try:
                self._client.request(
                    "DELETE", f"/v1/batches/{_core.quote(self.id)}", plane="data", retry=False
                )
            except NotFoundError:
                pass  # it ended meanwhile
        self.close()

    def close(self) -> None:
        self._closed = True
        if self._resp is not None:
            self._resp.close()

    def __enter__(self) -> "Batch":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class TaskMap(Iterator[Any]):
    """Tasks run at most ``concurrency`` at a time, their outputs yielded in
    input order. :meth:`cancel` (or leaving a ``with`` block) submits
    nothing more; tasks already sent run to their end on the gateway."""

    def __init__(
        self,
        client: Client,
        pool: str,
        inputs: Iterable[JSON],
        concurrency: int,
        options: TaskOptions,
        return_exceptions: bool,
        results: bool,
    ) -> None:
        if concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        self._client = client
        self._pool = pool
        self._inputs = iter(inputs)
        self._concurrency = concurrency
        # Finished results held behind a slower earlier one, at most.
        self._held = 4 * concurrency
        self._options = vars(options).copy()
        self._return_exceptions = return_exceptions
        self._results = results
        self._pending: Deque["concurrent.futures.Future[TaskResult]"] = collections.deque()
        self._exhausted = False
        self._cancelled = False
        self._index = 0
        self._lock = threading.Lock()
        self._exec = concurrent.futures.ThreadPoolExecutor(
            max_workers=concurrency, thread_name_prefix="warmgate-map"
        )

    def _run(self, index: int, input: JSON) -> TaskResult:
        r = self._client.submit(self._pool, input, **self._options)
        r.index = index
        return r

    def _fill(self) -> None:
        while not self._exhausted and not self._cancelled:
            running = sum(1 for f in self._pending if not f.done())
            if running >= self._concurrency or len(self._pending) >= self._held:
                return
            try:
                item = next(self._inputs)
            except StopIteration:
                self._exhausted = True
                return
            self._pending.append(self._exec.submit(self._run, self._index, item))
            self._index += 1

    def __iter__(self) -> "TaskMap":
        return self

    def __next__(self) -> Any:
        while True:
            if self._cancelled:
                raise StopIteration
            self._fill()
            if not self._pending:
                self._exec.shutdown(wait=False)
                raise StopIteration
            head = self._pending[0]
            if head.done():
                break
            running = [f for f in self._pending if not f.done()]
            concurrent.futures.wait(running, return_when=concurrent.futures.FIRST_COMPLETED)
        self._pending.popleft()
        try:
            r = head.result()
        except APIError as e:
            if self._return_exceptions:
                return e
            self.cancel()
            raise
        except BaseException:
            self.cancel()
            raise
        return r if self._results else r.output

    def cancel(self) -> None:
        """Submits nothing more and stops waiting."""
        self._cancelled = True
        for f in self._pending:
            f.cancel()
        self._pending.clear()
        self._exec.shutdown(wait=False, cancel_futures=True)

    close = cancel

    def __enter__(self) -> "TaskMap":
        return self

    def __exit__(self, *exc: object) -> None:
        self.cancel()
