"""TestSupport of the cpu backend: memory from its host_alloc; CPU work is done on return."""

from __future__ import annotations

import ctypes
import time

from pdhal._backends.test_support import DeviceTensor, TestSupport


class CpuTestSupport(TestSupport):
    device = "cpu"

    def __init__(self, host_alloc, host_free):
        self._host_alloc, self._host_free = host_alloc, host_free  # the backend's own ops
        self._buffers = []

    def alloc(self, nbytes: int) -> DeviceTensor:
        buf = self._host_alloc(nbytes)
        self._buffers.append(buf)
        return DeviceTensor(buf.address, nbytes, self.device)

    def delayed_write(self, stream, address: int, data: bytes, delay_us: int) -> None:
        time.sleep(delay_us / 1e6)  # the CPU "stream" is the caller: done when this returns
        ctypes.memmove(address, data, len(data))

    def shared_address(self, shared) -> int:
        return shared.ctypes.data

    def release(self) -> None:
        while self._buffers:
            self._host_free(self._buffers.pop())
