"""HostBuffer: host memory handed out by a backend's host_alloc."""

from __future__ import annotations

import math
import threading

from pdhal._errors import ClosedHandleError, InvalidArgumentError
from pdhal._inputs.tensors import MemoryRef
from pdhal._memory import extents as _extents
from pdhal._protocol.core import ffi


class HostBuffer:
    """Host memory from `host_alloc`; release it with `host_free` (or `close()`).

    An op given the buffer (or an address inside it) holds it while it runs, queued device
    work included: a free meanwhile waits for the op. Views (memoryview(), as_numpy()) are
    the caller's and must not outlive the buffer.
    """

    def __init__(self, address: int, nbytes: int, pinned: bool):
        self._address = address
        self._close_lock = threading.Lock()
        self.nbytes = nbytes
        #: True when the pages are locked in RAM (DMA-able without a bounce copy).
        self.pinned = pinned
        self._extent = _extents.register(address, nbytes, "cpu", f"host_alloc({nbytes})")
        self._ref = MemoryRef(address, nbytes, "cpu", extent=self._extent)

    @property
    def address(self) -> int:
        if self._address is None:
            raise ClosedHandleError("host buffer was freed")
        return self._address

    @property
    def closed(self) -> bool:
        return self._address is None

    def contains(self, address: int, nbytes: int = 1) -> bool:
        return (
            self._address is not None
            and self._address <= address
            and address + nbytes <= self._address + self.nbytes
        )

    # Named like a tensor's memory (data_ptr, numel, element_size), so every op that takes a
    # tensor takes the buffer itself.
    def data_ptr(self) -> int:
        return self.address

    def numel(self) -> int:
        return self.nbytes

    def element_size(self) -> int:
        return 1

    def _pdhal_memory_ref(self) -> MemoryRef:
        """memory_ref's fast path for pdhal's own buffers: built once, not re-derived from
        data_ptr/numel on every op (copy_blocks' fixed cost)."""
        if self._address is None:
            raise ClosedHandleError("host buffer was freed")
        return self._ref

    def memoryview(self) -> memoryview:
        return memoryview(ffi.buffer(ffi.cast("char *", self.address), self.nbytes))

    def as_numpy(self, dtype, shape):
        """A numpy array over (part of) the buffer, without a copy."""
        import numpy as np

        dtype = np.dtype(dtype)
        shape = tuple(shape)
        need = math.prod(shape) * dtype.itemsize
        if need > self.nbytes:
            raise InvalidArgumentError(
                f"shape {shape} of {dtype} needs {need} bytes, the buffer has {self.nbytes}"
            )
        return np.frombuffer(self.memoryview(), dtype=dtype, count=math.prod(shape)).reshape(shape)

    def _release(self, queued_on: set) -> None:
        """Return the memory to its allocator, once the work queued on the streams
        `queued_on` (ops that used the buffer) has run."""
        raise NotImplementedError

    def close(self) -> None:
        """Free the memory. An op using it meanwhile (from another thread) finishes first;
        one that starts later is refused (ClosedHandleError). Idempotent, also from several
        threads at once."""
        with self._close_lock:
            if self._address is not None:
                self._release(_extents.retire(self._extent))
                self._address = None

    def __enter__(self) -> HostBuffer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "freed" if self.closed else f"{self._address:#x}"
        return f"{type(self).__name__}({state}, nbytes={self.nbytes}, pinned={self.pinned})"
