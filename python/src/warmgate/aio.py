"""The asyncio client: :class:`AsyncClient` mirrors :class:`warmgate.Client`
call for call, each call a coroutine (``map`` and ``batch`` give async
iterators)."""

from __future__ import annotations

import asyncio
import collections
import json as _json
from typing import (
    Any,
    AsyncIterable,
    AsyncIterator,
    Deque,
    Dict,
    Iterable,
    List,
    Mapping,
    Optional,
    Union,
)

import httpx

from . import _core
from ._core import JSON, Duration, TaskOptions, TaskResult
from .client import _merge, _plane_of
from .errors import APIError, NotFoundError, UnreachableError, WarmgateError

__all__ = ["AsyncClient", "AsyncPool", "AsyncApp", "AsyncTask", "AsyncBatch", "AsyncTaskMap"]

_UNSET: Any = object()


class AsyncClient:
    """An asyncio client for one gateway; the same settings, environment
    variables and retry rule as :class:`warmgate.Client`. Close it with
    ``await client.aclose()`` or ``async with``."""

    def __init__(
        self,
        url: Optional[str] = None,
        token: Optional[str] = None,
        *,
        api_key: Optional[str] = None,
        timeout: Optional[float] = 600.0,
        max_retries: int = 2,
        max_connections: int = 512,
        headers: Optional[Mapping[str, str]] = None,
        transport: Optional[httpx.AsyncBaseTransport] = None,
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
        self._http = httpx.AsyncClient(
            base_url=self._s.url,
            timeout=httpx.Timeout(timeout, connect=min(timeout or 10.0, 10.0), pool=None),
            limits=_core.limits(max_connections),
            headers={"user-agent": "warmgate-python", **self._s.headers},
            transport=transport,
            verify=_core.tls_verify(cacert),
        )

    @property
    def url(self) -> str:
        return self._s.url

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        return f"warmgate.AsyncClient({self._s.url!r})"

    # --- the transport ----------------------------------------------------

    async def request(
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
        resp = await self._send(
            method, path, json=json, params=params, headers=headers, plane=plane,
            timeout=timeout, retry=retry,
        )
        return _core.decode(resp)

    async def _send(
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
                resp = await self._http.send(req, stream=stream)
            except (httpx.ConnectError, httpx.ConnectTimeout) as e:
                err = _core.unreachable(self._s.url, e)
            except httpx.TransportError as e:
                # As the blocking client: only a GET is sent again.
                if method not in _core.IDEMPOTENT:
                    raise _core.unreachable(self._s.url, e) from None
                err = _core.unreachable(self._s.url, e)
            else:
                if resp.status_code < 400:
                    return resp
                if stream:
                    await resp.aread()
                    await resp.aclose()
                try:
                    _core.raise_for(resp, _core.decode(resp))
                except APIError as e:
                    err = e
            wait = _core.retry_wait(err, attempt)
            if wait is None or attempt + 1 >= tries:
                raise err
            await asyncio.sleep(wait)
        raise AssertionError("unreachable")  # pragma: no cover

    # --- the control plane ------------------------------------------------

    async def status(self) -> Dict[str, Any]:
        return await self.request("GET", "/v1/status")  # type: ignore[no-any-return]

    async def apps(self) -> List[Dict[str, Any]]:
        return list((await self.request("GET", "/v1/apps"))["apps"])

    async def get_app(self, name: str) -> Dict[str, Any]:
        return await self.request("GET", f"/v1/apps/{_core.quote(name)}")  # type: ignore[no-any-return]

    async def put_app(self, name: str, spec: Mapping[str, Any]) -> Dict[str, Any]:
        return await self.request("PUT", f"/v1/apps/{_core.quote(name)}", json=dict(spec))  # type: ignore[no-any-return]

    async def delete_app(self, name: str) -> Dict[str, Any]:
        return await self.request("DELETE", f"/v1/apps/{_core.quote(name)}")  # type: ignore[no-any-return]

    async def pools(self) -> List[Dict[str, Any]]:
        return list((await self.status())["pools"])

    async def get_pool(self, name: str) -> Dict[str, Any]:
        return await self.request("GET", f"/v1/pools/{_core.quote(name)}")  # type: ignore[no-any-return]

    async def put_pool(self, name: str, spec: Mapping[str, Any]) -> Dict[str, Any]:
        return await self.request("PUT", f"/v1/pools/{_core.quote(name)}", json=dict(spec))  # type: ignore[no-any-return]

    async def delete_pool(self, name: str) -> Dict[str, Any]:
        return await self.request("DELETE", f"/v1/pools/{_core.quote(name)}")  # type: ignore[no-any-return]

    async def promote(
        self,
        app: str,
        checkpoint: str,
        *,
        canary: Optional[int] = None,
        bake: Optional[Duration] = None,
        wait: bool = False,
        in_place: Optional[bool] = None,
    ) -> Dict[str, Any]:
        body = _core.promote_body(checkpoint, canary, bake, wait, in_place)
        return await self.request(  # type: ignore[no-any-return]
            "POST", f"/v1/apps/{_core.quote(app)}/promote", json=body,
            timeout=None if wait else _UNSET,
        )

    async def rollback(self, app: str) -> Dict[str, Any]:
        return await self.request("POST", f"/v1/apps/{_core.quote(app)}/rollback", json={})  # type: ignore[no-any-return]

    async def revisions(self, app: str) -> Dict[str, Any]:
        return await self.request("GET", f"/v1/apps/{_core.quote(app)}/revisions")  # type: ignore[no-any-return]

    async def sync_weights(
        self,
        pool: str,
        checkpoint: str,
        version: int,
        *,
        timeout: Optional[Duration] = None,
        max_unavailable: Optional[Union[int, str]] = None,
    ) -> Dict[str, Any]:
        body = _core.sync_body(checkpoint, version, timeout, max_unavailable)
        return await self.request(  # type: ignore[no-any-return]
            "POST", f"/v1/pools/{_core.quote(pool)}/weights", json=body, timeout=None
        )

    # --- tasks --------------------------------------------------------------

    async def submit(self, pool: str, input: JSON, **options: Any) -> TaskResult:
        opts = TaskOptions(**options)
        resp = await self._send(
            "POST", f"/v1/pools/{_core.quote(pool)}/tasks",
            json={"input": input, **opts.body()}, headers=opts.headers(), plane="data",
        )
        return TaskResult.from_json(resp.json())

    async def submit_async(self, pool: str, input: JSON, **options: Any) -> "AsyncTask":
        opts = TaskOptions(**options)
        resp = await self._send(
            "POST", f"/v1/pools/{_core.quote(pool)}/tasks",
            json={"input": input, **opts.body()}, params={"async": "true"},
            headers=opts.headers(), plane="data",
        )
        return AsyncTask(self, str(resp.json()["id"]), pool)

    async def task(self, task_id: str) -> Dict[str, Any]:
        return await self.request("GET", f"/v1/tasks/{_core.quote(task_id)}", plane="data")  # type: ignore[no-any-return]

    async def cancel_task(self, task_id: str) -> Dict[str, Any]:
        """See :meth:`warmgate.Client.cancel_task`."""
        return await self.request(  # type: ignore[no-any-return]
            "DELETE", f"/v1/tasks/{_core.quote(task_id)}", plane="data", retry=False
        )

    async def usage(
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
        """See :meth:`warmgate.Client.usage`."""
        params = _core.usage_params(since, until, bucket, group_by, tenant, app, model)
        answer = await self.request("GET", "/v1/usage", params=params, plane="usage")
        return answer["data"]  # type: ignore[no-any-return]

    def batch(
        self, pool: str, inputs: Iterable[JSON], *, return_exceptions: bool = False, **options: Any
    ) -> "AsyncBatch":
        return AsyncBatch(self, pool, inputs, TaskOptions(**options), return_exceptions)

    def map(
        self,
        pool: str,
        inputs: Union[Iterable[JSON], AsyncIterable[JSON]],
        *,
        concurrency: int = 64,
        return_exceptions: bool = False,
        results: bool = False,
        **options: Any,
    ) -> "AsyncTaskMap":
        return AsyncTaskMap(self, pool, inputs, concurrency, TaskOptions(**options),
                            return_exceptions, results)

    def pool(self, name: str, **options: Any) -> "AsyncPool":
        return AsyncPool(self, name, TaskOptions(**options))

    def app(self, name: str) -> "AsyncApp":
        return AsyncApp(self, name)


class AsyncPool:
    """One pool of an :class:`AsyncClient`."""

    def __init__(
        self, client: AsyncClient, name: str, options: Optional[TaskOptions] = None
    ) -> None:
        self.client = client
        self.name = name
        self.options = options or TaskOptions()

    def __repr__(self) -> str:
        return f"warmgate.AsyncPool({self.name!r})"

    def with_options(self, **options: Any) -> "AsyncPool":
        return AsyncPool(self.client, self.name, TaskOptions(**_merge(self.options, options)))

    async def get(self) -> Dict[str, Any]:
        return await self.client.get_pool(self.name)

    async def put(self, spec: Mapping[str, Any]) -> Dict[str, Any]:
        return await self.client.put_pool(self.name, spec)

    async def delete(self) -> Dict[str, Any]:
        return await self.client.delete_pool(self.name)

    async def weights_version(self) -> int:
        return int((await self.get()).get("weights_version") or 0)

    async def sync_weights(self, checkpoint: str, version: int, **kw: Any) -> Dict[str, Any]:
        return await self.client.sync_weights(self.name, checkpoint, version, **kw)

    async def submit(self, input: JSON, **options: Any) -> TaskResult:
        return await self.client.submit(self.name, input, **_merge(self.options, options))

    async def submit_async(self, input: JSON, **options: Any) -> "AsyncTask":
        return await self.client.submit_async(self.name, input, **_merge(self.options, options))

    def batch(self, inputs: Iterable[JSON], **options: Any) -> "AsyncBatch":
        return self.client.batch(self.name, inputs, **_merge(self.options, options))

    def map(
        self,
        inputs: Union[Iterable[JSON], AsyncIterable[JSON]],
        concurrency: int = 64,
        **options: Any,
    ) -> "AsyncTaskMap":
        return self.client.map(self.name, inputs, concurrency=concurrency,
                               **_merge(self.options, options))


class AsyncApp:
    """One app of an :class:`AsyncClient`."""

    def __init__(self, client: AsyncClient, name: str) -> None:
        self.client = client
        self.name = name

    async def get(self) -> Dict[str, Any]:
        return await self.client.get_app(self.name)

    async def put(self, spec: Mapping[str, Any]) -> Dict[str, Any]:
        return await self.client.put_app(self.name, spec)

    async def delete(self) -> Dict[str, Any]:
        return await self.client.delete_app(self.name)

    async def promote(self, checkpoint: str, **kw: Any) -> Dict[str, Any]:
        return await self.client.promote(self.name, checkpoint, **kw)

    async def rollback(self) -> Dict[str, Any]:
        return await self.client.rollback(self.name)

    async def revisions(self) -> Dict[str, Any]:
        return await self.client.revisions(self.name)


class AsyncTask:
    """A task submitted with ``submit_async``."""

    def __init__(self, client: AsyncClient, id: str, pool: str) -> None:
        self.client = client
        self.id = id
        self.pool = pool

    def __repr__(self) -> str:
        return f"warmgate.AsyncTask({self.id!r}, pool={self.pool!r})"

    async def get(self) -> Dict[str, Any]:
        return await self.client.task(self.id)

    async def done(self) -> bool:
        return (await self.get()).get("state") in ("succeeded", "failed", "cancelled")

    async def cancel(self) -> Dict[str, Any]:
        """Cancels it on the gateway: its record."""
        return await self.client.cancel_task(self.id)

    async def result(self, timeout: Optional[float] = None) -> TaskResult:
        """Waits for its end (wrap in ``asyncio.wait_for`` to bound it, or
        give ``timeout``). Cancelling the ``asyncio`` task that awaits it
        cancels the gateway's task too."""

        async def poll() -> TaskResult:
            delay = 0.01
            while True:
                end = _core.task_outcome(await self.get())
                if isinstance(end, TaskResult):
                    return end
                if end is not None:
                    raise end
                await asyncio.sleep(delay)
                delay = min(delay * 2, 0.5)

        try:
            return await asyncio.wait_for(poll(), timeout)
        except asyncio.CancelledError:
            # Nobody waits for it any more: neither should a worker.
            try:
                await asyncio.shield(self.cancel())
            except WarmgateError:
                pass
            raise


class AsyncBatch(AsyncIterator[Any]):
    """A batch's results as an async iterator, in input order;
    :meth:`cancel` cancels what is left of it on the gateway and closes the
    stream (closing it alone cancels the rest too)."""

    def __init__(
        self,
        client: AsyncClient,
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
        self._lines: Optional[AsyncIterator[str]] = None
        self._count = 0
        self._closed = False

    async def _open(self) -> AsyncIterator[str]:
        if self._lines is None:
            self._resp = await self._client._send(
                "POST", f"/v1/pools/{_core.quote(self._pool)}/tasks/batch",
                content=self._body, headers=self._headers, plane="data", stream=True,
            )
            self._lines = self._resp.aiter_lines()
        return self._lines

    def __aiter__(self) -> "AsyncBatch":
        return self

    async def __anext__(self) -> Any:
        if self._closed:
            raise StopAsyncIteration
        lines = await self._open()
        while True:
            try:
                line = await lines.__anext__()
            except StopAsyncIteration:
                await self.aclose()
                raise
            except httpx.TransportError as e:
                await self.aclose()
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
            await self.aclose()
            raise item
        return item

    @property
    def id(self) -> Optional[str]:
        """The batch's id on the gateway, once it is streaming."""
        if self._resp is None:
            return None
        return self._resp.headers.get("x-warmgate-batch-id")

    async def cancel(self) -> None:
        if self.id is not None and not self._closed:
            try:
                await self._client.request(
                    "DELETE", f"/v1/batches/{_core.quote(self.id)}", plane="data", retry=False
                )
            except NotFoundError:
                pass  # it ended meanwhile
        await self.aclose()

    async def aclose(self) -> None:
        self._closed = True
        if self._resp is not None:
            await self._resp.aclose()

    async def __aenter__(self) -> "AsyncBatch":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class AsyncTaskMap(AsyncIterator[Any]):
    """Tasks run at most ``concurrency`` at a time, outputs in input order;
    :meth:`cancel` submits nothing more and cancels the submissions in
    flight: their connections close, and the gateway cancels their tasks,
    queued or running."""

    def __init__(
        self,
        client: AsyncClient,
        pool: str,
        inputs: Union[Iterable[JSON], AsyncIterable[JSON]],
        concurrency: int,
        options: TaskOptions,
        return_exceptions: bool,
        results: bool,
    ) -> None:
        if concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        self._client = client
        self._pool = pool
        self._sync_inputs = iter(inputs) if not hasattr(inputs, "__aiter__") else None
        self._async_inputs = (
            inputs.__aiter__() if hasattr(inputs, "__aiter__") else None
        )
        self._concurrency = concurrency
        self._held = 4 * concurrency
        self._options = vars(options).copy()
        self._return_exceptions = return_exceptions
        self._results = results
        self._pending: Deque["asyncio.Task[TaskResult]"] = collections.deque()
        self._exhausted = False
        self._cancelled = False
        self._index = 0

    async def _next_input(self) -> Any:
        if self._async_inputs is not None:
            return await self._async_inputs.__anext__()
        assert self._sync_inputs is not None
        try:
            return next(self._sync_inputs)
        except StopIteration:
            raise StopAsyncIteration from None

    async def _run(self, index: int, input: JSON) -> TaskResult:
        r = await self._client.submit(self._pool, input, **self._options)
        r.index = index
        return r

    async def _fill(self) -> None:
        while not self._exhausted and not self._cancelled:
            running = sum(1 for t in self._pending if not t.done())
            if running >= self._concurrency or len(self._pending) >= self._held:
                return
            try:
                item = await self._next_input()
            except StopAsyncIteration:
                self._exhausted = True
                return
            self._pending.append(asyncio.ensure_future(self._run(self._index, item)))
            self._index += 1

    @property
    def in_flight(self) -> int:
        """Submissions sent and not answered yet."""
        return sum(1 for t in self._pending if not t.done())

    def __aiter__(self) -> "AsyncTaskMap":
        return self

    async def __anext__(self) -> Any:
        while True:
            if self._cancelled:
                raise StopAsyncIteration
            await self._fill()
            if not self._pending:
                raise StopAsyncIteration
            head = self._pending[0]
            if head.done():
                break
            running = [t for t in self._pending if not t.done()]
            await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
        self._pending.popleft()
        try:
            r = head.result()
        except APIError as e:
            if self._return_exceptions:
                return e
            await self.cancel()
            raise
        except BaseException:
            await self.cancel()
            raise
        return r if self._results else r.output

    async def cancel(self) -> None:
        self._cancelled = True
        tasks = list(self._pending)
        self._pending.clear()
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    aclose = cancel

    async def __aenter__(self) -> "AsyncTaskMap":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.cancel()

    async def collect(self) -> List[Any]:
        """Every output, in input order."""
        return [x async for x in self]
