"""The asyncio client: :class:`AsyncClient` has :class:`warmgate.Client`'s
calls (written once, in ``_calls``), each a coroutine; ``map`` and
``batch`` give async iterators. This module is how they wait: on the event
loop."""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterable, AsyncIterator, Iterable, List, Mapping, Optional, Union

import httpx

from . import _calls, _core
from ._core import JSON, TaskResult
from .errors import NotFoundError, WarmgateError

__all__ = ["AsyncClient", "AsyncPool", "AsyncApp", "AsyncTask", "AsyncBatch", "AsyncTaskMap"]


class AsyncClient(_calls.Calls):
    """An asyncio client for one gateway; the same settings, environment
    variables and retry rule as :class:`warmgate.Client`
    (``max_connections`` defaults to 512; ``transport`` is an
    ``httpx.AsyncBaseTransport``). Close it with ``await client.aclose()``
    or ``async with``."""

    _http_class = httpx.AsyncClient
    _max_connections = 512

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _call(self, call: _calls.Call) -> Any:
        resp = await self._send(call)
        return resp if call.raw else call.then(_core.decode(resp))

    async def _send(self, call: _calls.Call) -> httpx.Response:
        tries = _calls.Attempts(self._http, self._s, call)
        while True:
            try:
                resp = await self._http.send(tries.request(), stream=call.stream)
            except httpx.TransportError as e:
                await asyncio.sleep(tries.failed(e))
                continue
            if resp.status_code < 400:
                return resp
            if call.stream:
                await resp.aread()
                await resp.aclose()
            await asyncio.sleep(tries.refused(resp))


class AsyncPool(_calls.PoolCalls):
    """One pool of an :class:`AsyncClient`."""

    async def weights_version(self) -> int:
        """The newest weights version synced into the pool."""
        return int((await self.get()).get("weights_version") or 0)


class AsyncApp(_calls.AppCalls):
    """One app of an :class:`AsyncClient`."""


class AsyncTask(_calls.TaskCalls):
    """A task submitted with ``submit_async``."""

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


class AsyncBatch(_calls.BatchState, AsyncIterator[Any]):
    """A batch's results as an async iterator, in input order;
    :meth:`cancel` cancels what is left of it on the gateway and closes the
    stream (closing it alone cancels the rest too)."""

    _lines: Optional[AsyncIterator[str]] = None

    async def _open(self) -> AsyncIterator[str]:
        if self._lines is None:
            self._resp = await self._client._call(self._stream_call())
            self._lines = self._resp.aiter_lines()
        return self._lines

    def __aiter__(self) -> "AsyncBatch":
        return self

    async def __anext__(self) -> Any:
        if self._closed:
            raise StopAsyncIteration
        lines = await self._open()
        item = _calls.SKIP
        while item is _calls.SKIP:
            try:
                line = await lines.__anext__()
            except StopAsyncIteration:
                await self.aclose()
                raise
            except httpx.TransportError as e:
                await self.aclose()
                raise self._broke_off(e) from None
            item = self._item(line)
        if self._fatal(item):
            await self.aclose()
            raise item
        return item

    async def cancel(self) -> None:
        call = self._cancel_call()
        try:
            if call is not None:
                await self._client._call(call)
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


class AsyncTaskMap(_calls.MapState, AsyncIterator[Any]):
    """Tasks run at most ``concurrency`` at a time, outputs in input order;
    :meth:`cancel` submits nothing more and cancels the submissions in
    flight: their connections close, and the gateway cancels their tasks,
    queued or running."""

    def _take(self, inputs: Union[Iterable[JSON], AsyncIterable[JSON]]) -> None:
        self._async_inputs = inputs.__aiter__() if hasattr(inputs, "__aiter__") else None
        self._sync_inputs = None if self._async_inputs is not None else iter(inputs)  # type: ignore[arg-type]

    async def _next_input(self) -> Any:
        if self._async_inputs is not None:
            return await self._async_inputs.__anext__()
        assert self._sync_inputs is not None
        try:
            return next(self._sync_inputs)
        except StopIteration:
            raise StopAsyncIteration from None

    async def _run(self, index: int, input: JSON) -> TaskResult:
        return self._indexed(await self._client.submit(self._pool, input, **self._options), index)

    async def _fill(self) -> None:
        while self._room():
            try:
                item = await self._next_input()
            except StopAsyncIteration:
                self._exhausted = True
                return
            self._pending.append(asyncio.ensure_future(self._run(self._next_index(), item)))

    @property
    def in_flight(self) -> int:
        """Submissions sent and not answered yet."""
        return sum(1 for t in self._pending if not t.done())

    def __aiter__(self) -> "AsyncTaskMap":
        return self

    async def __anext__(self) -> Any:
        head = None
        while head is None:
            await self._fill()
            if self._cancelled or not self._pending:
                raise StopAsyncIteration
            head, running = self._wait_for()
            if running:
                await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
        try:
            return self._output(head)
        except BaseException:
            await self.cancel()
            raise

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


AsyncClient._pool_type = AsyncPool
AsyncClient._app_type = AsyncApp
AsyncClient._task_type = AsyncTask
AsyncClient._batch_type = AsyncBatch
AsyncClient._map_type = AsyncTaskMap
