"""A pool (and app) worker for the tests, built on ``warmgate.worker``.

``POST /invoke`` takes a JSON object and answers ``{"echo", "pid",
"replica", "weights_version", "w"}`` (``w``: the value of the loaded
checkpoint's tensor ``w``), after:

* ``sleep_ms``: sleeping that long;
* ``wait_for``: waiting (60 s at most) until that file exists;
* ``fail``: failing in user code (500, which spends a retry);
* ``big``: answering that many bytes of padding besides.

Any other route answers 200 with the method and path (the app's routes).
``TASK_WORKER_EXIT_AT_START=N`` exits with N before listening.
"""

import os
import struct
import sys
import time
from typing import Any, Dict, Optional, Tuple

from warmgate.worker import Tensor, Worker


class TaskWorker(Worker):
    def load(self, tensors: Dict[str, Tensor], version: int) -> Any:
        t = tensors.get("w")
        if t is None:
            return {"w": None}
        return {"w": struct.unpack("<f", bytes(t.raw[:4]))[0]}

    def invoke(self, payload: Any) -> Any:
        p = payload if isinstance(payload, dict) else {}
        if p.get("sleep_ms"):
            time.sleep(float(p["sleep_ms"]) / 1000)
        if p.get("wait_for"):
            deadline = time.monotonic() + 60
            while not os.path.exists(p["wait_for"]) and time.monotonic() < deadline:
                time.sleep(0.01)
        if p.get("fail"):
            raise RuntimeError("asked to fail")
        out = {
            "echo": payload,
            "pid": os.getpid(),
            "replica": os.environ.get("WARMGATE_REPLICA"),
            "weights_version": self.weights_version,
            "w": (self.model or {}).get("w"),
        }
        if p.get("big"):
            out["padding"] = "x" * int(p["big"])
        return out

    def handle(self, method: str, path: str, payload: Any) -> Optional[Tuple[int, Any]]:
        return 200, {"method": method, "path": path, "pid": os.getpid()}


if __name__ == "__main__":
    code = os.environ.get("TASK_WORKER_EXIT_AT_START")
    if code:
        sys.stderr.write(f"task_worker: exiting with {code} before listening\n")
        sys.exit(int(code))
    TaskWorker().serve()
