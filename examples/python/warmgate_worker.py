"""The warmgate worker kit's demo worker.

The kit itself now lives in the Python package, as ``warmgate.worker``
(``python/src/warmgate/worker.py``; ``pip install ./python``). This script
stays for the tests and docs that run it by path: it runs the demo worker
(loads its checkpoint from ``$WARMGATE_WEIGHTS_URL`` and answers
``POST /invoke`` with what it loaded), and re-exports the kit's names for
scripts that import them from here (``stream_probe.py``).

    PORT=8001 python3 examples/python/warmgate_worker.py

A worker of your own imports the package instead::

    from warmgate.worker import Worker

    class Policy(Worker):
        def load(self, tensors, version): ...
        def invoke(self, payload): ...

    Policy().serve()
"""

import os
import sys

try:
    import warmgate.worker  # noqa: F401  (installed with pip install ./python)
except ImportError:  # run from a checkout: use the package beside it
    sys.path.insert(
        0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python", "src")
    )

from warmgate.worker import (  # noqa: E402,F401
    MAX_HEADER,
    Demo,
    Tensor,
    WeightsError,
    Worker,
    main,
    stream_checkpoint,
)

if __name__ == "__main__":
    main()
