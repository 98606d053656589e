"""TestSupport: the device primitives a backend lends the conformance kit."""

from __future__ import annotations

import ctypes


class DeviceTensor:
    """A minimal tensor over device memory: what ops accept through data_ptr()."""

    def __init__(self, address: int, nbytes: int, device: str):
        self.address, self.nbytes, self.device = address, nbytes, device

    def data_ptr(self) -> int:
        return self.address

    def numel(self) -> int:
        return self.nbytes

    def element_size(self) -> int:
        return 1


class TestSupport:
    """Device primitives for the kit. Subclass per backend; everything is in bytes."""

    __test__ = False  # not a pytest test class

    #: Device string of DeviceTensor, e.g. "gpu:0".
    device = "cpu"
    #: True when delayed_write returns before its write is done (work queued on a stream).
    #: The kit then also checks that a signal posted behind pending work is not visible
    #: yet, so the ordering checks cannot pass merely because the work was already done.
    asynchronous = False

    def alloc(self, nbytes: int) -> DeviceTensor:
        """Device memory that set_data_ipc and get_peer_mem_addr accept, zero-filled."""
        raise NotImplementedError

    def stream(self):
        """A stream handle for signal_layer_ready (None: the default)."""
        return None

    def delayed_write(self, stream, address: int, data: bytes, delay_us: int) -> None:
        """Enqueue on `stream` work that sleeps delay_us, then writes `data` at `address`."""
        raise NotImplementedError

    def read(self, address: int, nbytes: int) -> bytes:
        """Bytes at a device address (of alloc() or of a share_external_data mapping)."""
        return ctypes.string_at(address, nbytes)

    def shared_address(self, shared) -> int:
        """The address of what share_external_data returned."""
        return int(shared.address)

    def release(self) -> None:
        """Free everything alloc() handed out (called after each test)."""
