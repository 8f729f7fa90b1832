"""The blocking client: :class:`Client`, and the handles it gives for one
pool (:class:`Pool`), one app (:class:`App`), one task (:class:`Task`), a
batch (:class:`Batch`) and a ``map`` (:class:`TaskMap`). The calls
themselves are written once, in ``_calls``, for this client and the
asyncio one; this module is how they wait: on a socket, a thread pool,
``time.sleep``."""

from __future__ import annotations

import concurrent.futures
import time
from typing import Any, Iterable, Iterator, Mapping, Optional

import httpx

from . import _calls, _core
from ._core import JSON, TaskResult
from .errors import NotFoundError

__all__ = ["Client", "Pool", "App", "Task", "Batch", "TaskMap"]


class Client(_calls.Calls):
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
    one answer, in seconds (``None``: no limit). ``max_connections``
    defaults to 256; ``transport`` is an ``httpx.BaseTransport``. Safe to
    share between threads; close it (or use ``with``) to free its
    connections.
    """

    _http_class = httpx.Client
    _max_connections = 256

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, call: _calls.Call) -> Any:
        resp = self._send(call)
        return resp if call.raw else call.then(_core.decode(resp))

    def _send(self, call: _calls.Call) -> httpx.Response:
        tries = _calls.Attempts(self._http, self._s, call)
        while True:
            try:
                resp = self._http.send(tries.request(), stream=call.stream)
            except httpx.TransportError as e:
                time.sleep(tries.failed(e))
                continue
            if resp.status_code < 400:
                return resp
            if call.stream:
                resp.read()
                resp.close()
            time.sleep(tries.refused(resp))


class Pool(_calls.PoolCalls):
    """One pool of a :class:`Client`: its tasks, weights and spec."""

    @property
    def weights_version(self) -> int:
        """The newest weights version synced into the pool."""
        return int(self.get().get("weights_version") or 0)


class App(_calls.AppCalls):
    """One app of a :class:`Client`: its spec, promotions and revisions."""


class Task(_calls.TaskCalls):
    """A task submitted with ``submit_async``: poll it, or wait for it."""

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


class Batch(_calls.BatchState, Iterator[Any]):
    """The results of a batch, in input order, read as the gateway streams
    them: a :class:`TaskResult` per input, or its error (raised, or yielded
    with ``return_exceptions``). :meth:`cancel` cancels what is left of it
    on the gateway (``DELETE /v1/batches/{id}``: no input not taken yet is
    submitted, the tasks queued or running are cancelled) and closes the
    stream; leaving a ``with`` block, or closing it, closes the stream,
    which cancels the rest too."""

    _lines: Optional[Iterator[str]] = None

    def _open(self) -> Iterator[str]:
        if self._lines is None:
            self._resp = self._client._call(self._stream_call())
            self._lines = self._resp.iter_lines()
        return self._lines

    def __iter__(self) -> "Batch":
        return self

    def __next__(self) -> Any:
        if self._closed:
            raise StopIteration
        lines = self._open()
        item = _calls.SKIP
        while item is _calls.SKIP:
            try:
                line = next(lines)
            except StopIteration:
                self.close()
                raise
            except httpx.TransportError as e:
                self.close()
                raise self._broke_off(e) from None
            item = self._item(line)
        if self._fatal(item):
            self.close()
            raise item
        return item

    def cancel(self) -> None:
        """Stops the batch: its remaining tasks cancelled, its stream
        closed."""
        call = self._cancel_call()
        try:
            if call is not None:
                self._client._call(call)
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


class TaskMap(_calls.MapState, Iterator[Any]):
    """Tasks run at most ``concurrency`` at a time, their outputs yielded in
    input order. :meth:`cancel` (or leaving a ``with`` block) submits
    nothing more; tasks already sent run to their end on the gateway."""

    def _take(self, inputs: Iterable[JSON]) -> None:
        self._inputs = iter(inputs)
        self._exec = concurrent.futures.ThreadPoolExecutor(
            max_workers=self._concurrency, thread_name_prefix="warmgate-map"
        )

    def _run(self, index: int, input: JSON) -> TaskResult:
        return self._indexed(self._client.submit(self._pool, input, **self._options), index)

    def _fill(self) -> None:
        while self._room():
            try:
                item = next(self._inputs)
            except StopIteration:
                self._exhausted = True
                return
            self._pending.append(self._exec.submit(self._run, self._next_index(), item))

    def __iter__(self) -> "TaskMap":
        return self

    def __next__(self) -> Any:
        head = None
        while head is None:
            self._fill()
            if self._cancelled or not self._pending:
                self._exec.shutdown(wait=False)
                raise StopIteration
            head, running = self._wait_for()
            if running:
                concurrent.futures.wait(running, return_when=concurrent.futures.FIRST_COMPLETED)
        try:
            return self._output(head)
        except BaseException:
            self.cancel()
            raise

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


Client._pool_type = Pool
Client._app_type = App
Client._task_type = Task
Client._batch_type = Batch
Client._map_type = TaskMap

