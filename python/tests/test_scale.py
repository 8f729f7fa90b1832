"""Load through the client: a batch of 1,000 tasks read in order while a
replica is killed under it, and the asyncio client with 256 tasks in
flight at once."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from typing import Any, Iterator, List, Set

import pytest

import warmgate
from conftest import Gateway, eventually, worker_command, worker_env


@pytest.fixture(scope="module")
def gw() -> Iterator[Gateway]:
    config = f"""
[[pools]]
name = "rollouts"
command = {worker_command()}
env = {worker_env()}
replicas = [2, 2]
concurrency = 8

[[pools]]
name = "wide"
command = {worker_command()}
env = {worker_env()}
replicas = [2, 2]
concurrency = 8
"""
    g = Gateway(config)
    try:
        g.wait_pool_ready("rollouts", 2)
        g.wait_pool_ready("wide", 2)
        yield g
    finally:
        g.stop()


def test_a_batch_of_1000_reads_in_order_with_a_replica_killed_midway(gw: Gateway) -> None:
    pids = gw.replica_pids("rollouts")
    assert len(pids) == 2, pids
    victim = pids[0]
    inputs = [{"i": i, "sleep_ms": 8} for i in range(1000)]
    client = warmgate.Client(gw.url, gw.admin_token)
    seen_pids: Set[int] = set()
    t0 = time.monotonic()
    with client.pool("rollouts").batch(inputs) as batch:
        got: List[warmgate.TaskResult] = []
        for r in batch:
            got.append(r)
            seen_pids.add(r.output["pid"])
            if len(got) == 300:
                os.kill(victim, signal.SIGKILL)
    took = time.monotonic() - t0
    assert [r.index for r in got] == list(range(1000))
    assert [r.output["echo"]["i"] for r in got] == list(range(1000))
    assert all(isinstance(r, warmgate.TaskResult) for r in got)
    # The killed replica served before the kill and was replaced after it;
    # the tasks it held were run again elsewhere, none lost.
    assert victim in seen_pids
    after = {r.output["pid"] for r in got[400:]}
    assert victim not in after
    replacement = eventually("a replacement replica", lambda: (
        lambda ps: ps if len(ps) == 2 and victim not in ps else None)(gw.replica_pids("rollouts")))
    print(f"BATCH 1000 tasks in {took:.2f} s, replica {victim} killed at line 300, "
          f"retried {sum(1 for r in got if r.attempts > 1)}, pids now {replacement}")
    client.close()


def test_the_async_client_holds_256_tasks_in_flight(gw: Gateway, tmp_path: Any) -> None:
    peak = {"submitted": 0, "gateway": 0}
    stop = threading.Event()
    # The 256 submitted tasks hold until the gateway has seen all of them
    # at once (or 60 s pass, and the assertion below fails): how long the
    # client takes to send them on a busy machine does not matter.
    release = tmp_path / "release"

    def watch() -> None:
        while not stop.is_set():
            s = gw.pool_status("wide")
            peak["gateway"] = max(peak["gateway"], s["pending"] + s["inflight"])
            if peak["gateway"] >= 256 and not release.exists():
                release.touch()
            time.sleep(0.02)

    async def main() -> List[Any]:
        async with warmgate.AsyncClient(gw.url, gw.admin_token) as client:
            pool = client.pool("wide")
            # 256 submissions at once, each waiting for its task.
            results = await asyncio.gather(*(
                pool.submit({"i": i, "wait_for": str(release)}) for i in range(256)
            ))
            # map with the same bound keeps 256 in flight, in order.
            m = pool.map(({"j": j, "sleep_ms": 50} for j in range(300)), concurrency=256)
            outs = []

            async def sample() -> None:
                # The most the map has had in flight at once, sampled while
                # it runs (not only when an output is taken, which a busy
                # machine may reach after many tasks ended).
                while True:
                    peak["submitted"] = max(peak["submitted"], m.in_flight)
                    await asyncio.sleep(0.005)

            sampler = asyncio.create_task(sample())
            try:
                async for o in m:
                    outs.append(o["echo"]["j"])
            finally:
                sampler.cancel()
            assert outs == list(range(300))
            # The rest of the API mirrors the blocking client.
            assert [p["name"] for p in await client.pools()] == ["rollouts", "wide"]
            assert (await pool.get())["concurrency"] == 8
            task = await pool.submit_async({"a": 1})
            assert (await task.result(30)).output["echo"] == {"a": 1}
            items = [r async for r in pool.batch([{"b": k} for k in range(10)])]
            assert [r.index for r in items] == list(range(10))
            return list(results)

    t = threading.Thread(target=watch)
    t.start()
    try:
        results = asyncio.run(main())
    finally:
        stop.set()
        t.join()
    assert [r.output["echo"]["i"] for r in results] == list(range(256))
    print(f"ASYNC peak in flight at the gateway {peak['gateway']}, in the map {peak['submitted']}")
    assert peak["gateway"] == 256, peak
    assert peak["submitted"] >= 250, peak
