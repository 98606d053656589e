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
from dataclasses import dataclass, field

from pdhal._errors import (
    ClosedHandleError,
    InvalidArgumentError,
    InvalidTypeError,
    SegmentError,
    UnsupportedError,
)
from pdhal._inputs.tensors import MemoryRef, memory_ref
from pdhal._memory import extents as _extents
from pdhal._protocol import core as _core
from pdhal._protocol import names as _names
from pdhal._protocol.names import validate_name

_published: dict[tuple[int, str], _core.Segment] = {}
_lock = threading.Lock()


#: Names of pdhal's own host_alloc buffers (sharedhost): no record may take one.
RESERVED_PREFIX = "host."


def publish(name: str, record: dict) -> None:
    """Publish `record` (JSON-able) under `name`, replacing our own earlier one; a name
    of RESERVED_PREFIX is refused (InvalidArgumentError)."""
    if name.startswith(RESERVED_PREFIX):
        raise InvalidArgumentError(
            f"{name!r}: names beginning {RESERVED_PREFIX!r} are pdhal's own (host_alloc's "
            f"buffers); share under another name"
        )
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


def unpublish(name: str) -> bool:
    """Remove our own record of `name`; whether there was one."""
    with _lock:
        seg = _published.pop((os.getpid(), name), None)
    if seg is None:
        return False
    seg.close()
    return True


def unset(name: str, unlink: bool = True) -> None:
    """unset_data_ipc's record part: remove this process's record of `name`. A record of
    another process is its publisher's to remove (refused while that process lives); with
    `unlink` False, nothing is removed (an importer closing only its own mapping)."""
    validate_name(name, "buffer name")
    if not unlink or unpublish(name):
        return
    path = _names.buffer_path(name)
    try:
        seg = _core.Segment.open(path, _core.KIND_BUFFER, 0)
    except SegmentError:
        raise InvalidArgumentError(
            f"no buffer is shared as {name!r} (never shared, or unset already)"
        ) from None
    pid = seg.creator_pid
    seg.close()
    if not _core.reclaim(path):
        raise InvalidArgumentError(
            f"{name!r} was shared by pid {pid}, which is alive: only its publisher unsets it"
        )


def lookup(name: str, timeout: float | None) -> dict:
    """The record published under `name`, waiting up to `timeout` s for it to appear,
    checked to be what set_data_ipc writes (a record is another process's word):
    InvalidArgumentError naming what is wrong with it otherwise."""
    seg = _core.Segment.open(
        _names.buffer_path(name), _core.KIND_BUFFER, timeout, _core.OPEN_LIVE_PRODUCER
    )  # a dead publisher's memory is gone
    try:
        body = bytes(seg.body())
    finally:
        seg.close()
    try:
        record = json.loads(body)
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        record = None
    why = _malformed(record)
    if why is not None:
        raise InvalidArgumentError(
            f"the record shared as {name!r} is not what set_data_ipc writes: {why}"
        )
    return record


#: The fields of a record, by what it shares: host memory (a segment) or device memory.
_HOST_FIELDS = {"path", "offset", "nbytes"}
_DEVICE_FIELDS = {"handle", "backend", "offset", "nbytes"}
_TEXT_FIELDS = ("path", "handle", "backend")


def _malformed(record: object) -> str | None:
    """What is wrong with a record read back, or None."""
    if not isinstance(record, dict):
        return "not a JSON object"
    if set(record) not in (_HOST_FIELDS, _DEVICE_FIELDS):
        expected = f"{sorted(_HOST_FIELDS)} or {sorted(_DEVICE_FIELDS)}"
        return f"fields {sorted(record)}, expected {expected}"
    for key, least in (("offset", 0), ("nbytes", 1)):
        value = record[key]
        if type(value) is not int or not least <= value < 1 << 62:
            return f"{key} {value!r} is not an int >= {least}"
    for key in _TEXT_FIELDS:
        if key in record and not (isinstance(record[key], str) and record[key].isprintable()):
            return f"{key} {record[key]!r} is not a string of printable characters"
    return None


def publisher(name: str) -> int:
    """The pid of the live process that published `name` (SegmentError if none does)."""
    seg = _core.Segment.open(_names.buffer_path(name), _core.KIND_BUFFER, 0, 0)
    try:
        return seg.creator_pid
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
    """Device memory mapped from another process (the address is valid in this one). It
    names its memory like a tensor does (data_ptr, numel, element_size, device), so every
    op that takes a tensor takes it; an op holds the mapping while it uses it (an
    unset_data_ipc meanwhile waits), and one after the unmap is refused."""

    address: int
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    device: str = "gpu"  # "gpu:0", "xpu:1", ... (the importing process's view)
    extent: _extents.Extent | None = field(default=None, compare=False, repr=False)

    def _pdhal_memory_ref(self) -> MemoryRef:
        if self.extent is not None and self.extent.retired:
            raise ClosedHandleError(f"{self.extent.what} was unmapped (unset_data_ipc)")
        return MemoryRef(self.address, self.nbytes, self.device, self.dtype, extent=self.extent)

    def data_ptr(self) -> int:
        return self.address

    def numel(self) -> int:
        return self.nbytes

    def element_size(self) -> int:
        return 1

    def __dlpack__(self, stream=None):
        """A DLPack capsule over the mapping (shape and dtype as requested): e.g.
        paddle.from_dlpack(buffer) gives a tensor over the other process's memory."""
        from pdhal._inputs import dlpack as _dlpack

        return _dlpack.export(self, self.address, self.shape, self.dtype, self.device)

    def __dlpack_device__(self) -> tuple[int, int]:
        from pdhal._inputs import dlpack as _dlpack

        kind, _, index = self.device.partition(":")
        if kind not in _dlpack.DEVICE_TYPES:
            raise UnsupportedError(f"DLPack has no device type for {self.device} memory")
        return _dlpack.DEVICE_TYPES[kind], int(index or 0)


def mapped(
    address: int, shape: tuple, dtype: str, nbytes: int, device: str, name: str
) -> SharedDeviceBuffer:
    """A SharedDeviceBuffer over what share_external_data mapped, its extent known to pdhal
    (so raw addresses inside it are bounds-checked, and ops hold it) until it is unmapped."""
    extent = _extents.register(address, nbytes, device, f"shared buffer {name!r}")
    return SharedDeviceBuffer(address, shape, dtype, nbytes, device, extent)


def data_ptr_op(share_external_data):
    """The get_data_ptr_ipc op over a backend's share_external_data."""

    def get_data_ptr_ipc(tensor, name: str, timeout: float | None = 60.0) -> int:
        """The address, in this process, of the whole buffer shared as `name` (mapped on
        first use): what a copy into another process's KV cache targets. `tensor` is unused
        (FastDeploy's op takes one)."""
        record = lookup(name, timeout)
        shared = share_external_data("uint8", name, [record["nbytes"]], timeout)
        return memory_ref(shared, "shared buffer").address

    return get_data_ptr_ipc


_ITEMSIZE_BEYOND_NUMPY = {"bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}


def request(like, name: str, shape, timeout: float | None) -> tuple[dict, tuple, str, int]:
    """Validate a share_external_data request: (record, shape, dtype name, bytes needed).

    `like` gives the dtype (a tensor, an array, or a dtype name); the record published under
    `name` must hold enough bytes."""
    if isinstance(like, str):
        dtype = like
    elif isinstance(like, type):  # numpy.float16 and the like: a scalar type names a dtype
        dtype = like.__name__
    else:
        dtype = str(getattr(like, "dtype", ""))
    dtype = dtype.split(".")[-1]
    if not dtype:
        raise InvalidTypeError(
            f"like must be a tensor or array with a dtype, got {type(like).__name__}"
        )
    itemsize = _ITEMSIZE_BEYOND_NUMPY.get(dtype)
    if itemsize is None:
        import numpy as np

        try:
            itemsize = np.dtype(dtype).itemsize
        except Exception:  # numpy raises TypeError, ValueError, even SyntaxError for junk
            raise UnsupportedError(
                f"share_external_data cannot size dtype {dtype!r}: like "
                f"must be a tensor or array (or a dtype name such as "
                f"'float16')"
            ) from None
    if isinstance(shape, (str, bytes)) or not hasattr(shape, "__iter__"):
        raise InvalidArgumentError(f"shape must be a list of sizes, got {shape!r}")
    shape = tuple(_names.validate_index(n, "shape entry", 1 << 46) for n in shape)
    need = math.prod(shape) * itemsize
    record = lookup(name, timeout)
    if need > record["nbytes"]:
        raise InvalidArgumentError(
            f"shape {shape} of {dtype} needs {need} bytes, but {name!r} shares {record['nbytes']}"
        )
    return record, shape, dtype, need
