"""Named records that let another process on this host find a shared buffer.

`set_data_ipc(tensor, name)` publishes a small record (a backing segment path, or a device
IPC handle, plus offset and size) under `name`; `share_external_data` looks it up. Records
are owner-only segments like every other pdhal segment, removed when their publisher frees
the memory or exits.
"""

from __future__ import annotations

import atexit
import json
import math
import os
import threading
from dataclasses import dataclass

from pdhal import _core, _names
from pdhal._errors import InvalidArgumentError, InvalidTypeError, UnsupportedError

_published: dict[tuple[int, str], _core.Segment] = {}
_lock = threading.Lock()


def publish(name: str, record: dict) -> None:
    """Publish `record` (JSON-able) under `name`, replacing our own earlier one."""
    path = _names.buffer_path(name)
    body = json.dumps(record).encode()
    key = (os.getpid(), name)
    with _lock:
        old = _published.pop(key, None)
        if old is not None:
            old.close()
        seg = _core.Segment.create(path, _core.KIND_BUFFER, body_bytes=len(body))
        seg.body()[:] = body
        _published[key] = seg


def lookup(name: str, timeout: float | None) -> dict:
    """The record published under `name`, waiting up to `timeout` s for it to appear."""
    seg = _core.Segment.open(_names.buffer_path(name), _core.KIND_BUFFER, timeout)
    try:
        return json.loads(bytes(seg.body()))
    finally:
        seg.close()


def unpublish_where(predicate) -> None:
    """Remove our records for which predicate(record) is true."""
    with _lock:
        for key, seg in list(_published.items()):
            if key[0] == os.getpid() and predicate(json.loads(bytes(seg.body()))):
                seg.close()
                del _published[key]


@atexit.register
def unpublish_all() -> None:
    """Remove every record this process published; runs at exit."""
    unpublish_where(lambda record: True)


@dataclass(frozen=True)
class SharedDeviceBuffer:
    """Device memory mapped from another process (the address is valid in this one)."""

    address: int
    shape: tuple[int, ...]
    dtype: str
    nbytes: int


_ITEMSIZE_BEYOND_NUMPY = {"bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}


def request(like, name: str, shape, timeout: float | None) -> tuple[dict, tuple, str, int]:
    """Validate a share_external_data request: (record, shape, dtype name, bytes needed).

    `like` gives the dtype; the record published under `name` must hold enough bytes."""
    dtype = str(getattr(like, "dtype", "")).split(".")[-1]
    if not dtype:
        raise InvalidTypeError(f"like must be a tensor or array with a dtype, got "
                               f"{type(like).__name__}")
    itemsize = _ITEMSIZE_BEYOND_NUMPY.get(dtype)
    if itemsize is None:
        import numpy as np

        try:
            itemsize = np.dtype(dtype).itemsize
        except TypeError:
            raise UnsupportedError(f"share_external_data cannot size dtype {dtype}") from None
    shape = tuple(_names.validate_index(n, "shape entry", 1 << 46) for n in shape)
    need = math.prod(shape) * itemsize
    record = lookup(name, timeout)
    if need > record["nbytes"]:
        raise InvalidArgumentError(f"shape {shape} of {dtype} needs {need} bytes, but {name!r} "
                                   f"shares {record['nbytes']}")
    return record, shape, dtype, need
