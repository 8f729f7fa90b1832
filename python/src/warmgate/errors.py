"""The errors the gateway answers, as exceptions.

Every error the gateway sends is JSON with a fixed ``kind`` (the Rust
``ErrorKind``); each kind has its own class here, so callers can catch
exactly what they can handle::

    try:
        pool.submit({"seed": 1})
    except warmgate.QueueFullError as e:
        time.sleep(e.retry_after or 1)

The classes group as the HTTP statuses do: ``QueueFullError`` and
``QuotaExceededError`` are both ``RateLimitError`` (429);
``NoCapacityError`` and ``StartingError`` are both ``UnavailableError``
(503). Every one is an ``APIError``, and every error this package raises is
a ``WarmgateError``.
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Optional, Type


class WarmgateError(Exception):
    """Anything this package raises about the gateway."""


class UnreachableError(WarmgateError):
    """No answer: the gateway could not be reached, or the connection broke
    before a whole answer arrived."""


class APIError(WarmgateError):
    """An error answer from the gateway.

    ``kind`` is the gateway's error kind (``queue_full``, ``not_found``…),
    ``status`` the HTTP status, ``message`` the gateway's sentence for a
    person. ``retry_after`` is the ``Retry-After`` the gateway sent, in
    seconds (``None`` when it sent none); ``should_retry`` is ``False`` when
    the gateway said ``x-should-retry: false`` (trying again cannot help),
    else ``True``. ``param`` names the request field at fault, when there
    is one. For an error of one task of a batch, ``index`` is its input's
    position.
    """

    kind: str = "unknown"
    status: int = 0

    def __init__(
        self,
        message: str,
        *,
        kind: Optional[str] = None,
        status: Optional[int] = None,
        retry_after: Optional[float] = None,
        should_retry: Optional[bool] = None,
        param: Optional[str] = None,
        error_type: Optional[str] = None,
        headers: Optional[Mapping[str, str]] = None,
        body: Any = None,
        index: Optional[int] = None,
        task_id: Optional[str] = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        if kind is not None:
            self.kind = kind
        if status is not None:
            self.status = status
        self.retry_after = retry_after
        self.should_retry = (
            should_retry if should_retry is not None else self.kind not in _NOT_RETRYABLE
        )
        self.param = param
        self.type = error_type
        self.headers: Dict[str, str] = dict(headers or {})
        self.body = body
        self.index = index
        self.task_id = task_id

    def __str__(self) -> str:
        where = f" (input {self.index})" if self.index is not None else ""
        status = f"{self.status} " if self.status else ""
        return f"{status}{self.kind}{where}: {self.message}"

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.message!r}, kind={self.kind!r}, status={self.status})"


class BadRequestError(APIError):
    """400 ``bad_request``: the request is malformed."""

    kind, status = "bad_request", 400


class UnauthorizedError(APIError):
    """401 ``unauthorized``: the admin token or API key is missing or wrong."""

    kind, status = "unauthorized", 401


class NotFoundError(APIError):
    """404 ``not_found``: no such app, pool, task, model or route."""

    kind, status = "not_found", 404


class MethodNotAllowedError(APIError):
    """405 ``method_not_allowed``: the route exists, not for this method."""

    kind, status = "method_not_allowed", 405


class ConflictError(APIError):
    """409 ``conflict``: the request clashes with the current state (a
    weights version not synced yet, a sync or promotion already running)."""

    kind, status = "conflict", 409


class TaskCancelledError(ConflictError):
    """409 ``cancelled``: the task was cancelled before it finished
    (``task.cancel()``, its batch cancelled, or its client gone)."""

    kind, status = "cancelled", 409


class TooLargeError(APIError):
    """413 ``too_large``: the body is over the gateway's size limit."""

    kind, status = "too_large", 413


class RateLimitError(APIError):
    """429: refused at once; ``retry_after`` says when to come back."""

    status = 429


class QueueFullError(RateLimitError):
    """429 ``queue_full``: the queue (or a pool's tenant quota) is full."""

    kind = "queue_full"


class QuotaExceededError(RateLimitError):
    """429 ``quota_exceeded``: the tenant is over one of its quotas."""

    kind = "quota_exceeded"


class InternalError(APIError):
    """500 ``internal``: the gateway failed on its side; nothing the request
    asked for was done."""

    kind, status = "internal", 500


class ReplicaFailedError(APIError):
    """502 ``replica_failed``: the worker failed the task (after its
    retries), crashed, or could not start."""

    kind, status = "replica_failed", 502


class UnavailableError(APIError):
    """503: no capacity now; ``retry_after`` says when to come back."""

    status = 503


class NoCapacityError(UnavailableError):
    """503 ``no_capacity``: no capacity can be had now (replicas failing to
    start, the gateway shutting down)."""

    kind = "no_capacity"


class StartingError(UnavailableError):
    """503 ``starting``: the app is starting and cannot hold more requests."""

    kind = "starting"


class GatewayTimeoutError(APIError):
    """504 ``timeout``: the task or request ran past its timeout."""

    kind, status = "timeout", 504


class TaskFailedError(APIError):
    """A task that failed for a reason outside the fixed kinds (for example
    ``gateway_restarted``: it was cut by a restart of the gateway)."""


#: The kinds the gateway marks ``x-should-retry: false``.
_NOT_RETRYABLE = frozenset(
    [
        "bad_request",
        "unauthorized",
        "not_found",
        "method_not_allowed",
        "too_large",
        "timeout",
        "cancelled",
    ]
)

#: Every error kind the gateway sends, and its class.
ERRORS_BY_KIND: Dict[str, Type[APIError]] = {
    cls.kind: cls
    for cls in (
        BadRequestError,
        UnauthorizedError,
        NotFoundError,
        MethodNotAllowedError,
        ConflictError,
        TooLargeError,
        QueueFullError,
        QuotaExceededError,
        InternalError,
        ReplicaFailedError,
        NoCapacityError,
        StartingError,
        GatewayTimeoutError,
        TaskCancelledError,
    )
}

_BY_STATUS: Dict[int, Type[APIError]] = {
    400: BadRequestError,
    401: UnauthorizedError,
    404: NotFoundError,
    405: MethodNotAllowedError,
    409: ConflictError,
    413: TooLargeError,
    429: RateLimitError,
    500: InternalError,
    502: ReplicaFailedError,
    503: UnavailableError,
    504: GatewayTimeoutError,
}


def _retry_after(value: Optional[str]) -> Optional[float]:
    if value is None:
        return None
    try:
        return max(0.0, float(value.strip()))
    except ValueError:
        return None  # an HTTP date: the gateway never sends one


def error_from_response(
    status: int, body: Any, headers: Optional[Mapping[str, str]] = None
) -> APIError:
    """The exception for an error answer: its class from the body's
    ``error.kind`` (or the status when the body has none)."""
    h = {k.lower(): v for k, v in (headers or {}).items()}
    err = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, dict):
        kind = str(err.get("kind") or err.get("code") or "")
        message = str(err.get("message") or "")
        param = err.get("param")
        error_type = err.get("type")
    else:
        kind, param, error_type = "", None, None
        message = body if isinstance(body, str) else (str(body) if body is not None else "")
    cls = ERRORS_BY_KIND.get(kind) or _BY_STATUS.get(status) or APIError
    should_retry_header = h.get("x-should-retry")
    should_retry: Optional[bool] = None
    if should_retry_header is not None:
        should_retry = should_retry_header.strip().lower() != "false"
    return cls(
        message or f"HTTP {status}",
        kind=kind or None,
        status=status,
        retry_after=_retry_after(h.get("retry-after")),
        should_retry=should_retry,
        param=param if isinstance(param, str) else None,
        error_type=error_type if isinstance(error_type, str) else None,
        headers=h,
        body=body,
    )


def error_from_task(
    error: Any, *, index: Optional[int] = None, task_id: Optional[str] = None
) -> APIError:
    """The exception for a task that ended with ``{"kind", "message"}``
    (a batch line's ``error``, or a failed task's record)."""
    kind = str(error.get("kind", "")) if isinstance(error, dict) else ""
    message = str(error.get("message", "")) if isinstance(error, dict) else str(error)
    cls = ERRORS_BY_KIND.get(kind, TaskFailedError)
    return cls(
        message or kind or "the task failed",
        kind=kind or None,
        status=cls.status or None,
        body=error,
        index=index,
        task_id=task_id,
    )


__all__ = [
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
    "ERRORS_BY_KIND",
    "error_from_response",
    "error_from_task",
]
