"""Cancelling tasks from the client (``task.cancel()``, cancelling the
``asyncio`` task that awaits one) and reading usage, against the real
gateway."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import List

import pytest

import warmgate
from conftest import ADMIN_TOKEN, ALPHA_KEY, Gateway, eventually


def test_a_task_is_cancelled_queued_or_running(gateway: Gateway, tmp_path: Path) -> None:
    never = str(tmp_path / "never")
    with warmgate.Client(gateway.url, token=ADMIN_TOKEN, api_key=ALPHA_KEY) as c:
        pool = c.pool("rollouts")
        # The pool's 16 slots taken by tasks that wait, then one queued.
        running: List[warmgate.Task] = [
            pool.submit_async({"wait_for": never, "n": i}) for i in range(16)
        ]
        try:
            eventually(
                "16 running",
                lambda: all(t.get()["state"] == "running" for t in running) or None,
            )
            queued = pool.submit_async({"n": "queued"})
            assert queued.get()["state"] == "pending"
            record = queued.cancel()
            assert (record["state"], record["cancelled"]) == ("cancelled", "queued")
            with pytest.raises(warmgate.TaskCancelledError) as e:
                queued.result(timeout=10)
            assert e.value.status == 409 and e.value.should_retry is False
            assert queued.done()
            record = running[0].cancel()
            assert (record["state"], record["cancelled"]) == ("cancelled", "running")
            # A task that ended cannot be cancelled again into another end.
            assert running[0].cancel()["state"] == "cancelled"
        finally:
            for t in running[1:]:
                t.cancel()
            Path(never).touch()


def test_cancelling_the_asyncio_task_awaiting_a_task_cancels_it(
    gateway: Gateway, tmp_path: Path
) -> None:
    never = str(tmp_path / "never")

    async def main() -> str:
        async with warmgate.AsyncClient(gateway.url, token=ADMIN_TOKEN, api_key=ALPHA_KEY) as c:
            task = await c.submit_async("rollouts", {"wait_for": never})
            waiter = asyncio.ensure_future(task.result())
            # Let it begin waiting (one turn of the loop), then give up on it.
            await asyncio.sleep(0)
            waiter.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiter
            return str((await c.task(task.id))["state"])

    try:
        assert asyncio.run(main()) == "cancelled"
    finally:
        Path(never).touch()


def test_usage_is_each_tenant_s_own(gateway: Gateway) -> None:
    with warmgate.Client(gateway.url, api_key=ALPHA_KEY) as c:
        # The test worker's answer carries no usage: counted as such.
        c.request(
            "POST", "/v1/chat/completions", json={"model": "policy", "messages": []}, plane="data"
        )
        rows = c.usage(group_by=["tenant", "app"])
        assert rows and all(r["tenant"] == "alpha" for r in rows), rows
        policy = [r for r in rows if r["app"] == "policy"]
        assert policy and policy[0]["requests_without_usage"] >= 1, rows
        with pytest.raises(warmgate.UnauthorizedError):
            c.usage(tenant="bravo")
    with warmgate.Client(gateway.url, token=ADMIN_TOKEN) as admin:
        rows = admin.usage(bucket="hour", group_by=["tenant"])
        assert any(r["tenant"] == "alpha" and r["start"].endswith(":00:00Z") for r in rows), rows
