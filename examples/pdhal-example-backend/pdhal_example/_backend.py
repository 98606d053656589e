"""The `example` backend: what a vendor writes. Each op says what to replace."""

from __future__ import annotations

import ctypes
import os
import time

from pdhal import InvalidTypeError
from pdhal.plugin import (
    Availability,
    Backend,
    KVSignalSender,
    Platform,
    reference_ops,
    require_signal,
)
from pdhal.testing import DeviceTensor, TestSupport

from pdhal_example._stream import Stream, default_stream


class ExamplePlatform(Platform):
    name = "example"
    #: Your runtime's visibility variable.
    device_control_env_var = "EXAMPLE_VISIBLE_DEVICES"

    def device_count(self) -> int:
        # Replace: ask your runtime (and report 0 rather than raise).
        visible = self.visible_devices()
        return 2 if visible is None else len(visible)

    @property
    def capabilities(self) -> dict[str, object]:
        return {"host_function": True, "async_sender": True, "ipc": "shm (reference)",
                "pinned_host_memory": "reference", "peer_address": "reference"}


def _stream_of(stream) -> Stream:
    if stream is None:
        return default_stream()
    if isinstance(stream, Stream):
        return stream
    raise InvalidTypeError(f"stream must be an example Stream or None, got "
                           f"{type(stream).__name__}")


def signal_layer_ready(signal, stream=None, sender: KVSignalSender | None = None) -> None:
    """Replace: queue the store behind the layer's work on your stream. With a host-function
    launch (like CUDA), hand it pdhal.plugin.STORE_CALLBACK_ADDRESS and signal.new_store();
    with events only (like XPU), record an event and sender.post(event, signal)."""
    signal = require_signal(signal)
    if signal.segment is None:
        return
    target = _stream_of(stream)
    if sender is None:
        target.enqueue(signal.publish)
        return
    if not isinstance(sender, ExampleSender):
        raise InvalidTypeError(f"sender must come from the example backend, got {sender!r}")
    sender.used.add(target)
    target.enqueue(lambda: sender.post(None, signal))


class ExampleSender(KVSignalSender):
    """Replace: a real backend passes its runtime's event wait / destroy (C function
    pointers) to KVSignalSender and posts (event, signal) pairs; it needs no subclass. This
    pretend device has no events, so the sender drains the streams it was used with."""

    def __init__(self):
        super().__init__(backend="example")
        self.used: set[Stream] = set()

    def close(self) -> None:
        for stream in self.used:
            stream.synchronize()  # destroy delivers every pending signal first
        self.used.clear()
        super().close()


def create_kv_signal_sender() -> KVSignalSender:
    return ExampleSender()


def copy_blocks(dst, dst_block_ids, src, src_block_ids, block_bytes: int, stream=None) -> int:
    """Replace: issue each run through your runtime's asynchronous copy on the stream
    (pdhal.plugin.RuntimeBackend.copy_blocks does, given the copy's symbol name). This
    pretend device waits for its stream, then copies at once: still after the work queued
    before, which is the ordering the kit checks."""
    _stream_of(stream).synchronize()
    return reference_ops()["copy_blocks"](dst, dst_block_ids, src, src_block_ids, block_bytes)


def synchronize(stream=None) -> None:
    """Replace: your runtime's stream synchronize."""
    _stream_of(stream).synchronize()


class ExampleTestSupport(TestSupport):
    """What the conformance kit needs from your device. Replace with real allocations,
    streams and a kernel that writes memory after a delay."""

    device = "example:0"

    def __init__(self):
        self._buffers = []

    def alloc(self, nbytes: int) -> DeviceTensor:
        buf = reference_ops()["host_alloc"](nbytes)
        self._buffers.append(buf)
        return DeviceTensor(buf.address, nbytes, "cpu")

    def stream(self):
        return Stream()

    def delayed_write(self, stream, address: int, data: bytes, delay_us: int) -> None:
        def kernel():
            time.sleep(delay_us / 1e6)
            ctypes.memmove(address, data, len(data))
        _stream_of(stream).enqueue(kernel)

    def shared_address(self, shared) -> int:
        return shared.ctypes.data

    def release(self) -> None:
        while self._buffers:
            self._buffers.pop().close()


class ExampleBackend(Backend):
    name = "example"
    priority = 10  # above cpu (0), below real accelerators (100)

    def availability(self) -> Availability:
        # Replace: dlopen your runtime and count devices; say why not, never raise.
        if os.environ.get("EXAMPLE_DISABLED"):
            return Availability(False, "EXAMPLE_DISABLED is set")
        return Availability(True, "the example device is simulated in Python")

    def platform(self) -> Platform:
        return ExamplePlatform()

    def ops(self):
        # Replace the memory ops with your runtime's (pinned host memory, the address a NIC
        # registers, IPC handles); the template borrows pdhal's reference implementations.
        # Over a vendor runtime, pdhal.plugin.RuntimeBackend gives host memory, events and
        # the sender from the names of the runtime's functions.
        return {
            **reference_ops(),
            "signal_layer_ready": signal_layer_ready,
            "create_kv_signal_sender": create_kv_signal_sender,
            "copy_blocks": copy_blocks,
            "synchronize": synchronize,
        }

    def test_support(self):
        return ExampleTestSupport()
