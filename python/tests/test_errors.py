"""Every error kind the gateway answers, provoked for real and raised as its
class; ``Retry-After`` is waited out and ``x-should-retry: false`` is never
tried again."""

from __future__ import annotations

import json
import sqlite3
import sys
import time
from typing import Any, Iterator

import pytest

import warmgate
from conftest import ADMIN_TOKEN, ALPHA_KEY, BRAVO_KEY, Gateway, eventually, worker_command, worker_env
from warmgate.errors import ERRORS_BY_KIND

LIMIT = 64 * 1024


@pytest.fixture(scope="module")
def gw() -> Iterator[Gateway]:
    sleeper = json.dumps([sys.executable, "-c", "import time; time.sleep(600)"])
    config = f"""
[limits]
max_body_bytes = {LIMIT}
max_task_body_bytes = {LIMIT}

[[tenants]]
name = "alpha"
api_key_env = "ALPHA_KEY"

[[tenants]]
name = "bravo"
api_key_env = "BRAVO_KEY"
rps = 0.1
burst = 1

[[pools]]
name = "slot"
command = {worker_command()}
env = {worker_env()}
replicas = [1, 1]
concurrency = 1
retries = 0
[pools.queue]
max_pending = 1

[[apps]]
name = "crashing"
command = {worker_command()}
env = {worker_env(TASK_WORKER_EXIT_AT_START="3")}

[[apps]]
name = "stuck"
command = {sleeper}
[apps.queue]
timeout = "1s"
"""
    g = Gateway(
        config,
        {"WARMGATE_ADMIN_TOKEN": ADMIN_TOKEN, "ALPHA_KEY": ALPHA_KEY, "BRAVO_KEY": BRAVO_KEY},
    )
    try:
        g.wait_pool_ready("slot", 1)
        yield g
    finally:
        g.stop()


@pytest.fixture
def once(gw: Gateway) -> Iterator[warmgate.Client]:
    """A client that never tries again, to see each error as answered."""
    with warmgate.Client(gw.url, api_key=ALPHA_KEY, max_retries=0) as c:
        yield c


def test_the_classes_cover_every_kind_of_the_gateway() -> None:
    kinds = {
        "bad_request", "unauthorized", "not_found", "method_not_allowed", "conflict",
        "too_large", "queue_full", "quota_exceeded", "replica_failed", "no_capacity",
        "starting", "timeout", "internal", "cancelled",
    }
    assert set(ERRORS_BY_KIND) == kinds
    assert issubclass(warmgate.QueueFullError, warmgate.RateLimitError)
    assert issubclass(warmgate.StartingError, warmgate.UnavailableError)
    assert all(issubclass(c, warmgate.APIError) for c in ERRORS_BY_KIND.values())


def expect(cls: type, status: int, call: Any, *, retry: bool) -> Any:
    with pytest.raises(cls) as e:
        call()
    err = e.value
    assert type(err) is cls, repr(err)
    assert err.status == status and err.kind == cls.kind, repr(err)
    assert err.message, repr(err)
    assert err.should_retry is retry, (repr(err), err.headers)
    assert (err.headers.get("x-should-retry") == "false") is (not retry), err.headers
    return err


def test_client_errors(gw: Gateway, once: warmgate.Client) -> None:
    pool = once.pool("slot")
    e = expect(warmgate.BadRequestError, 400, lambda: pool.submit(1, timeout="soon"), retry=False)
    assert "timeout" in e.message
    expect(warmgate.BadRequestError, 400,
           lambda: once.request("POST", "/v1/pools/slot/tasks", json={"inputs": [1]}), retry=False)
    with warmgate.Client(gw.url, api_key="not-a-key", max_retries=0) as stranger:
        expect(warmgate.UnauthorizedError, 401, lambda: stranger.submit("slot", 1), retry=False)
    e = expect(warmgate.NotFoundError, 404, lambda: once.submit("nope", 1), retry=False)
    assert "nope" in e.message
    expect(warmgate.NotFoundError, 404, lambda: once.task("slot-nothing"), retry=False)
    expect(warmgate.MethodNotAllowedError, 405,
           lambda: once.request("GET", "/v1/pools/slot/tasks"), retry=False)
    e = expect(warmgate.ConflictError, 409, lambda: pool.submit(1, min_weights_version=3),
               retry=True)
    expect(warmgate.TooLargeError, 413, lambda: pool.submit("x" * LIMIT), retry=False)
    # The same limit, over a batch.
    expect(warmgate.TooLargeError, 413, lambda: list(pool.batch(["x" * 1024] * 80)), retry=False)


def test_a_full_queue_and_a_quota_are_429_with_retry_after(
    gw: Gateway, once: warmgate.Client
) -> None:
    pool = once.pool("slot")
    running = pool.submit_async({"sleep_ms": 1500})
    eventually("one running", lambda: gw.pool_status("slot")["inflight"] == 1 or None)
    queued = pool.submit_async({"q": 1})
    e = expect(warmgate.QueueFullError, 429, lambda: pool.submit({"r": 1}), retry=True)
    assert e.retry_after is not None and e.retry_after >= 1
    # Waited out: the default client tries again after Retry-After, and
    # gets in once the running task is done.
    with warmgate.Client(gw.url, api_key=ALPHA_KEY) as patient:
        t0 = time.monotonic()
        r = patient.submit("slot", {"late": 1})
        assert r.output["echo"] == {"late": 1}
        assert time.monotonic() - t0 >= 0.9
    assert running.result(30).output["echo"] == {"sleep_ms": 1500}
    assert queued.result(30).output["echo"] == {"q": 1}

    with warmgate.Client(gw.url, api_key=BRAVO_KEY, max_retries=0) as bravo:
        bravo.submit("slot", 1)  # the burst of one
        e = expect(warmgate.QuotaExceededError, 429, lambda: bravo.submit("slot", 2), retry=True)
        assert e.retry_after is not None and 1 <= e.retry_after <= 10
        assert isinstance(e, warmgate.RateLimitError)


def test_a_task_that_fails_or_runs_too_long(gw: Gateway, once: warmgate.Client) -> None:
    e = expect(warmgate.ReplicaFailedError, 502, lambda: once.submit("slot", {"fail": True}),
               retry=True)
    assert "asked to fail" in e.message
    # 504 says x-should-retry: false, so even a client that may retry sends
    # it once.
    before = gw.metric('warmgate_tasks_total{pool="slot",outcome="timeout"}')
    with warmgate.Client(gw.url, api_key=ALPHA_KEY, max_retries=3) as retrying:
        expect(warmgate.GatewayTimeoutError, 504,
               lambda: retrying.submit("slot", {"sleep_ms": 1500}, timeout=0.3), retry=False)
    assert gw.metric('warmgate_tasks_total{pool="slot",outcome="timeout"}') == before + 1
    eventually("the slot is free", lambda: gw.pool_status("slot")["inflight"] == 0 or None)


def test_apps_that_cannot_start(gw: Gateway, once: warmgate.Client) -> None:
    # The worker exits at start: the waiting request fails with the cause...
    e = expect(warmgate.ReplicaFailedError, 502, lambda: once.request("GET", "/apps/crashing/x"),
               retry=True)
    assert "status 3" in e.message, e.message
    # ...and while it crash-loops, requests are refused at once.
    e = eventually("no capacity during the backoff", lambda: _error(
        lambda: once.request("GET", "/apps/crashing/x"), warmgate.NoCapacityError))
    assert e.status == 503 and e.should_retry and e.retry_after and e.retry_after >= 1
    # A replica that never gets ready: 503 starting after the queue timeout.
    e = expect(warmgate.StartingError, 503, lambda: once.request("GET", "/apps/stuck/x"),
               retry=True)
    assert e.retry_after is not None and e.retry_after >= 1
    assert isinstance(e, warmgate.UnavailableError)


def test_an_async_task_the_gateway_cannot_record_is_internal(
    gw: Gateway, once: warmgate.Client
) -> None:
    # Every insert into the task journal fails, as on a full disk.
    db = sqlite3.connect(str(gw.dir / "state" / "state.db"), timeout=5)
    db.execute(
        "CREATE TRIGGER full_disk BEFORE INSERT ON tasks "
        "BEGIN SELECT RAISE(ABORT, 'database or disk is full'); END;"
    )
    db.commit()
    try:
        e = expect(warmgate.InternalError, 500, lambda: once.submit_async("slot", 1), retry=True)
        assert "record" in e.message
    finally:
        db.execute("DROP TRIGGER full_disk")
        db.commit()
        db.close()
    assert once.submit_async("slot", 2).result(30).output["echo"] == 2


def test_an_unreachable_gateway_is_its_own_error() -> None:
    with warmgate.Client("http://127.0.0.1:9", max_retries=1) as c:
        with pytest.raises(warmgate.UnreachableError) as e:
            c.status()
    assert "127.0.0.1:9" in str(e.value)


def _error(call: Any, cls: type) -> Any:
    try:
        call()
    except cls as e:
        return e
    except warmgate.APIError:
        return None
    return None


