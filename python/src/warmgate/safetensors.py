"""Writing and reading safetensors files, the format warmgate streams
weights in, with numpy arrays (or raw bytes without numpy).

A training loop writes each version of its policy with :func:`save` into
its own folder of the store (``<store>/v<N>/policy.safetensors``) and syncs
the folder into a pool; workers read it back with
:func:`warmgate.worker.stream_checkpoint`.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Any, Dict, List, Mapping, Optional, Tuple

__all__ = ["save", "save_bytes", "load", "DTYPES"]

#: safetensors dtype names by numpy dtype name.
DTYPES: Dict[str, str] = {
    "float64": "F64", "float32": "F32", "float16": "F16", "int64": "I64", "int32": "I32",
    "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL", "uint16": "U16",
    "uint32": "U32", "uint64": "U64",
}
_NUMPY = {v: k for k, v in DTYPES.items()}


def _entry(value: Any) -> Tuple[str, List[int], bytes]:
    """``(dtype, shape, bytes)`` of a numpy array, or of a tuple of those."""
    if isinstance(value, tuple) and len(value) == 3:
        dtype, shape, data = value
        return str(dtype), [int(d) for d in shape], bytes(data)
    dtype_name = str(getattr(value, "dtype", ""))
    if dtype_name not in DTYPES:
        raise TypeError(f"cannot store {type(value).__name__} of dtype {dtype_name!r} as safetensors")
    import numpy as np  # only reached with numpy arrays

    arr = np.ascontiguousarray(value)
    if arr.dtype.byteorder == ">":
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    return DTYPES[dtype_name], list(arr.shape), arr.tobytes()


def save_bytes(
    tensors: Mapping[str, Any], metadata: Optional[Mapping[str, str]] = None
) -> bytes:
    """The bytes of a safetensors file holding ``tensors`` (name to numpy
    array, or to ``(dtype, shape, bytes)``), in name order."""
    header: Dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    chunks = []
    at = 0
    for name in sorted(tensors):
        dtype, shape, data = _entry(tensors[name])
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [at, at + len(data)]}
        chunks.append(data)
        at += len(data)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    return struct.pack("<Q", len(head)) + head + b"".join(chunks)


def save(
    path: "os.PathLike[str] | str",
    tensors: Mapping[str, Any],
    metadata: Optional[Mapping[str, str]] = None,
) -> None:
    """Writes ``tensors`` to ``path`` atomically (a temporary file renamed
    into place), creating its folder."""
    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(save_bytes(tensors, metadata))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load(path: "os.PathLike[str] | str") -> Dict[str, Any]:
    """Reads a safetensors file into numpy arrays (numpy required)."""
    import numpy as np

    with open(os.fspath(path), "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    out: Dict[str, Any] = {}
    base = 8 + n
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        arr = np.frombuffer(data[base + start : base + end], dtype=_NUMPY[info["dtype"]])
        out[name] = arr.reshape(info["shape"]).copy()
    return out
