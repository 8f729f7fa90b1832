"""Every call of the blocking client against a real gateway with an admin
token and tenant keys, the client configured from the variables the CLI
reads."""

from __future__ import annotations

import itertools
import threading
import time
from pathlib import Path
from typing import Any, Dict, List

import pytest

import warmgate
from conftest import (
    ADMIN_TOKEN,
    ALPHA_KEY,
    Gateway,
    eventually,
    worker_command,
    worker_env,
    write_checkpoint,
)


@pytest.fixture
def client(client_env: Gateway) -> Any:
    with warmgate.Client() as c:
        yield c


def test_the_client_reads_the_cli_s_variables(client_env: Gateway) -> None:
    c = warmgate.Client()
    assert c.url == client_env.url
    # The admin token reached the control plane, the tenant key the data plane.
    assert {t["name"] for t in c.status()["tenants"]} == {"alpha", "bravo"}
    assert c.submit("rollouts", {"hello": 1}).output["echo"] == {"hello": 1}
    c.close()
    # Explicit arguments win over the environment.
    with warmgate.Client(client_env.url, token="wrong", api_key=ALPHA_KEY) as bad:
        with pytest.raises(warmgate.UnauthorizedError):
            bad.status()
        assert bad.submit("rollouts", 1).output["echo"] == 1


def test_status_apps_and_pools_are_listed_and_read(client: warmgate.Client) -> None:
    status = client.status()
    assert {"apps", "pools", "tenants"} <= set(status)
    assert "policy" in [a["name"] for a in client.apps()]
    assert client.get_app("policy")["name"] == "policy"
    assert client.app("policy").get()["ready"] >= 0
    pools = client.pools()
    assert [p["name"] for p in pools] == ["rollouts"]
    p = client.pool("rollouts").get()
    assert p["name"] == "rollouts" and p["concurrency"] == 8 and p["max"] == 2
    assert client.get_pool("rollouts")["min"] == 2


def test_a_pool_is_put_changed_used_and_deleted(client: warmgate.Client, gateway: Gateway) -> None:
    spec = {
        "command": _command(),
        "env": _env(),
        "replicas": [1, 1],
        "concurrency": 2,
    }
    extra = client.pool("extra")
    assert extra.put(spec) == {"pool": "extra", "change": "created"}
    assert "extra" in [p["name"] for p in client.pools()]
    assert extra.put(spec)["change"] == "unchanged"
    assert extra.put({**spec, "retries": 5})["change"] == "in_place"
    r = extra.submit({"n": 7})
    assert r.output["echo"] == {"n": 7} and r.replica and r.replica.startswith("extra-")
    assert extra.delete() == {"pool": "extra", "change": "deleted"}
    with pytest.raises(warmgate.NotFoundError):
        client.get_pool("extra")
    with pytest.raises(warmgate.NotFoundError):
        client.delete_pool("extra")


def test_an_app_is_put_served_and_deleted(client: warmgate.Client) -> None:
    app = client.app("extra-app")
    created = app.put({"command": _command(), "env": _env(), "autoscale": {"min": 1, "max": 1}})
    assert created["change"] == "created" and created["app"] == "extra-app"
    assert "extra-app" in [a["name"] for a in client.apps()]
    # Its routes answer through the gateway (the data plane, with the key).
    answer = client.request("GET", "/apps/extra-app/hello")
    assert answer["path"] == "/hello"
    assert app.delete() == {"app": "extra-app", "change": "deleted"}
    with pytest.raises(warmgate.NotFoundError):
        app.get()


def test_tasks_run_sync_and_async(client: warmgate.Client) -> None:
    pool = client.pool("rollouts")
    r = pool.submit({"x": 1}, priority=0, timeout="30s", retries=0)
    assert isinstance(r, warmgate.TaskResult)
    assert r.output["echo"] == {"x": 1} and r.attempts == 1 and r.id
    assert r.replica in ("rollouts-1", "rollouts-2")
    task = pool.submit_async({"sleep_ms": 200, "y": 2})
    assert isinstance(task, warmgate.Task) and task.id
    rec = client.task(task.id)
    assert rec["state"] in ("pending", "running", "succeeded") and rec["pool"] == "rollouts"
    done = task.result(timeout=30)
    assert done.output["echo"] == {"sleep_ms": 200, "y": 2} and done.id == task.id
    assert task.done() and task.get()["state"] == "succeeded"
    # A failed async task raises its kind when waited for.
    failing = pool.submit_async({"fail": True}, retries=0)
    with pytest.raises(warmgate.ReplicaFailedError) as e:
        failing.result(timeout=30)
    assert e.value.task_id == failing.id and "asked to fail" in e.value.message


def test_map_yields_outputs_in_input_order_within_its_concurrency(
    client: warmgate.Client, gateway: Gateway
) -> None:
    pool = client.pool("rollouts")
    # Later inputs finish first.
    inputs = [{"i": i, "sleep_ms": (12 - i) * 15} for i in range(12)]
    outs = list(pool.map(inputs, concurrency=6))
    assert [o["echo"]["i"] for o in outs] == list(range(12))
    # At most `concurrency` tasks at once on the gateway, and that many
    # reached.
    peak = _watch_peak(gateway, lambda: list(pool.map(
        ({"sleep_ms": 150, "k": k} for k in range(16)), concurrency=4)))
    assert peak == 4, peak
    # Whole results, and errors in place.
    results = list(pool.map([{"a": 1}, {"fail": True}, {"a": 3}], concurrency=2,
                            results=True, return_exceptions=True, retries=0))
    assert isinstance(results[0], warmgate.TaskResult) and results[0].index == 0
    assert isinstance(results[1], warmgate.ReplicaFailedError)
    assert results[2].output["echo"] == {"a": 3} and results[2].index == 2
    with pytest.raises(warmgate.ReplicaFailedError):
        list(pool.map([{"a": 1}, {"fail": True}], concurrency=2, retries=0))


def test_map_reads_its_inputs_lazily_and_cancel_stops_it(
    client: warmgate.Client, gateway: Gateway
) -> None:
    drawn: List[int] = []

    def endless() -> Any:
        for k in itertools.count():
            drawn.append(k)
            yield {"k": k, "sleep_ms": 20}

    m = client.pool("rollouts").map(endless(), concurrency=4)
    got = [next(m)["echo"]["k"] for _ in range(10)]
    assert got == list(range(10))
    m.cancel()
    assert len(drawn) <= 10 + 4 * 4, len(drawn)
    with pytest.raises(StopIteration):
        next(m)
    n = len(drawn)
    eventually("the pool is idle", lambda: _idle(gateway, "rollouts"))
    assert len(drawn) == n, "nothing was drawn after cancel"


def test_a_batch_streams_in_order_and_cancel_stops_its_submissions(
    client: warmgate.Client, gateway: Gateway
) -> None:
    pool = client.pool("rollouts")
    inputs: List[Any] = [{"i": i, "sleep_ms": (20 - i) * 5} for i in range(20)]
    inputs[7] = {"fail": True}
    with pool.batch(inputs, retries=0, return_exceptions=True) as batch:
        items = list(batch)
    assert len(items) == 20
    for i, item in enumerate(items):
        if i == 7:
            assert isinstance(item, warmgate.ReplicaFailedError) and item.index == 7
        else:
            assert item.index == i and item.output["echo"]["i"] == i
    # Without return_exceptions the error is raised at its place.
    seen = []
    with pytest.raises(warmgate.ReplicaFailedError):
        for item in pool.batch([{"i": 0}, {"fail": True}, {"i": 2}], retries=0):
            seen.append(item.index)
    assert seen == [0]

    # Cancelled after 5 of 400 slow tasks: the gateway submits no more of
    # them than its window held.
    before = gateway.metric('warmgate_tasks_total{pool="rollouts",outcome="ok"}')
    batch = pool.batch([{"j": j, "sleep_ms": 50} for j in range(400)])
    first = [next(batch).index for _ in range(5)]
    batch.cancel()
    assert first == [0, 1, 2, 3, 4]
    assert list(batch) == []
    eventually("the pool is idle", lambda: _idle(gateway, "rollouts"))
    ran = gateway.metric('warmgate_tasks_total{pool="rollouts",outcome="ok"}') - before
    assert 5 <= ran < 100, ran


def test_weights_sync_and_min_weights_version(
    client: warmgate.Client, checkpoints: Path
) -> None:
    pool = client.pool("rollouts")
    start = pool.weights_version
    v1, v2 = start + 1, start + 2
    ck1 = write_checkpoint(checkpoints / f"pool-v{v1}", 0.5)
    ck2 = write_checkpoint(checkpoints / f"pool-v{v2}", 0.25)
    synced = pool.sync_weights(ck1, v1)
    assert synced["version"] == v1 and synced["synced"] == 2 and synced["replaced"] == 0
    assert {r["action"] for r in synced["replicas"]} == {"synced"}
    assert pool.weights_version == v1
    r = pool.submit({}, min_weights_version=v1)
    assert r.weights_version == v1 and r.output["w"] == 0.5
    # The latest's checkpoint under an older number is the latest again;
    # a version not synced yet is refused.
    again = client.sync_weights("rollouts", ck1, v1 - 1)
    assert again["version"] == v1 and again["asked_version"] == v1 - 1, again
    assert pool.weights_version == v1
    with pytest.raises(warmgate.ConflictError):
        pool.submit({}, min_weights_version=v2)
    client.sync_weights("rollouts", ck2, v2, timeout="60s", max_unavailable=1)
    pinned = pool.with_options(min_weights_version=v2)
    outs = list(pinned.map([{}] * 8, concurrency=8))
    assert {o["w"] for o in outs} == {0.25} and {o["weights_version"] for o in outs} == {v2}
    assert {r.weights_version for r in pinned.batch([{}] * 4)} == {v2}


def test_promote_revisions_and_rollback(client: warmgate.Client, checkpoints: Path) -> None:
    app = client.app("policy")
    before = app.get()["revision"]
    ck = write_checkpoint(checkpoints / "app-v2", 2.0)
    done = app.promote(ck, wait=True)
    assert done["app"] == "policy" and done["revision"] != before
    assert done["promotion"]["phase"] == "done", done
    new = done["revision"]
    revs = app.revisions()
    ids = [r["id"] for r in revs["revisions"]]
    assert ids[0] == new and before in ids, revs
    assert revs["promotion"]["to"] == new
    eventually("the new revision serves", lambda: app.get()["revision"] == new or None)
    back = client.rollback("policy")
    assert back["app"] == "policy" and back["revision"], back
    eventually("the rollback serves", lambda: app.get()["revision"] == back["revision"] or None)
    assert client.revisions("policy")["revisions"][0]["id"] in (back["revision"], new)
    # A promotion that is not waited for answers with its revision at once.
    started = client.promote("policy", ck)
    assert started["app"] == "policy" and started["revision"]
    eventually("it ends", lambda: app.revisions()["promotion"]["phase"] in ("done", "failed") or None)
    with pytest.raises(warmgate.NotFoundError):
        client.promote("policy", "file://" + str(checkpoints / "missing"))


def test_the_control_plane_needs_the_admin_token(gateway: Gateway) -> None:
    with warmgate.Client(gateway.url, token="", api_key=ALPHA_KEY) as anonymous:
        for call in (anonymous.status, anonymous.apps, lambda: anonymous.get_pool("rollouts")):
            with pytest.raises(warmgate.UnauthorizedError) as e:
                call()
            assert e.value.status == 401 and e.value.should_retry is False
    with warmgate.Client(gateway.url, token=ADMIN_TOKEN, api_key=None) as no_key:
        assert no_key.status()["pools"]
        with pytest.raises(warmgate.UnauthorizedError):
            no_key.submit("rollouts", 1)


def _command() -> List[str]:
    import json

    return json.loads(worker_command())  # type: ignore[no-any-return]


def _env() -> Dict[str, str]:
    import conftest

    return {"PYTHONPATH": str(conftest.SRC)}


def _idle(gateway: Gateway, pool: str) -> Any:
    s = gateway.pool_status(pool)
    return True if s["pending"] == 0 and s["inflight"] == 0 else None


def _watch_peak(gateway: Gateway, work: Any) -> int:
    """Runs ``work`` while watching the pool's tasks pending plus running;
    the most seen at once."""
    peak = 0
    stop = threading.Event()

    def watch() -> None:
        nonlocal peak
        while not stop.is_set():
            s = gateway.pool_status("rollouts")
            peak = max(peak, s["pending"] + s["inflight"])
            time.sleep(0.01)

    t = threading.Thread(target=watch)
    t.start()
    try:
        work()
    finally:
        stop.set()
        t.join()
    return peak


def test_without_a_token_the_client_finds_the_one_the_gateway_made(
    make_gateway: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    gw = make_gateway(f"""
[[pools]]
name = "p"
command = {worker_command()}
env = {worker_env()}
replicas = [1, 1]
""")
    monkeypatch.delenv("WARMGATE_ADMIN_TOKEN", raising=False)
    monkeypatch.setenv("WARMGATE_RUNTIME_DIR", str(gw.runtime_dir))
    with warmgate.Client(gw.url) as c:
        assert [p["name"] for p in c.pools()] == ["p"]
        assert c.submit("p", 3).output["echo"] == 3
    # Another user's folder (or none) gives no token: refused.
    monkeypatch.setenv("WARMGATE_RUNTIME_DIR", str(gw.dir / "elsewhere"))
    with warmgate.Client(gw.url) as c:
        with pytest.raises(warmgate.UnauthorizedError):
            c.pools()
