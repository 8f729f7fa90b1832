"""Streams a checkpoint with the worker kit and reports what a test or a
benchmark needs: peak RSS, time and bytes at the first tensor, total time,
and a digest of every tensor's bytes in file order.

    python3 stream_probe.py URL [TOKEN]

Set ``STREAM_PROBE_DIGEST=0`` to skip the digest (for timing the kit
alone: hashing a gigabyte in Python takes seconds of its own), and
``STREAM_PROBE_LOCAL=0`` to download every file even where the manifest
offers a local path.
"""

import hashlib
import json
import os
import resource
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from warmgate_worker import stream_checkpoint  # noqa: E402


def main():
    url = sys.argv[1]
    token = sys.argv[2] if len(sys.argv) > 2 else None
    digest = hashlib.sha256() if os.environ.get("STREAM_PROBE_DIGEST", "1") != "0" else None
    held = []

    def on_tensor(t):
        if digest is not None:
            digest.update(t.raw)
        held.append(t)  # kept, as a model keeps its weights

    local = os.environ.get("STREAM_PROBE_LOCAL", "1") != "0"
    stats = stream_checkpoint(url, token, on_tensor, local=local)
    stats["sha256"] = digest.hexdigest() if digest is not None else None
    stats["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    stats["held"] = sum(len(t.raw) for t in held)
    print(json.dumps(stats))


if __name__ == "__main__":
    main()
