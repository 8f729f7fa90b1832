"""warmgate's Python package.

``warmgate.Client`` / ``warmgate.AsyncClient``
    Clients for the gateway's HTTP API: apps and pools, tasks (one, async,
    batches and ``map``), weight syncs, promotion and rollback, status.
    Errors are raised as the classes in :mod:`warmgate.errors`.

``warmgate.worker``
    The worker contract for any Python server (``Worker``,
    ``stream_checkpoint``), standard library only.

``warmgate.safetensors``
    Writing and reading safetensors files, for checkpoints a training loop
    writes to the store.

The clients need httpx and are imported on first use, so a worker that only
imports ``warmgate.worker`` needs nothing beyond the standard library.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .errors import (
    APIError,
    BadRequestError,
    ConflictError,
    GatewayTimeoutError,
    InternalError,
    MethodNotAllowedError,
    NoCapacityError,
    NotFoundError,
    QueueFullError,
    QuotaExceededError,
    RateLimitError,
    ReplicaFailedError,
    StartingError,
    TaskCancelledError,
    TaskFailedError,
    TooLargeError,
    UnauthorizedError,
    UnavailableError,
    UnreachableError,
    WarmgateError,
)

if TYPE_CHECKING:  # pragma: no cover
    from ._core import TaskResult
    from .aio import AsyncApp, AsyncBatch, AsyncClient, AsyncPool, AsyncTask, AsyncTaskMap
    from .client import App, Batch, Client, Pool, Task, TaskMap

__version__ = "0.1.0"

_LAZY = {
    "Client": "client",
    "Pool": "client",
    "App": "client",
    "Task": "client",
    "Batch": "client",
    "TaskMap": "client",
    "AsyncClient": "aio",
    "AsyncPool": "aio",
    "AsyncApp": "aio",
    "AsyncTask": "aio",
    "AsyncBatch": "aio",
    "AsyncTaskMap": "aio",
    "TaskResult": "_core",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'warmgate' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


__all__ = [
    "Client",
    "AsyncClient",
    "Pool",
    "AsyncPool",
    "App",
    "AsyncApp",
    "Task",
    "AsyncTask",
    "Batch",
    "AsyncBatch",
    "TaskMap",
    "AsyncTaskMap",
    "TaskResult",
    "WarmgateError",
    "UnreachableError",
    "APIError",
    "BadRequestError",
    "UnauthorizedError",
    "NotFoundError",
    "MethodNotAllowedError",
    "ConflictError",
    "TaskCancelledError",
    "TooLargeError",
    "RateLimitError",
    "QueueFullError",
    "QuotaExceededError",
    "InternalError",
    "ReplicaFailedError",
    "UnavailableError",
    "NoCapacityError",
    "StartingError",
    "GatewayTimeoutError",
    "TaskFailedError",
    "__version__",
]
