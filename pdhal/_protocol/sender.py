"""KVSignalSender: the long-lived async signal sender an engine creates once (or per step)."""

from __future__ import annotations

import array
import atexit
import os
import threading
from collections.abc import Callable

from pdhal._errors import DeviceError, InvalidTypeError
from pdhal._protocol import core as _core
from pdhal._protocol.signals import KernelSignal, LayerSignal, kernel_signal


def require_signal(signal: object) -> LayerSignal | KernelSignal:
    """`signal` as something a backend can post: a LayerSignal as it is, the kernel form of
    one (its int64 words) as a KernelSignal; a pdhal error for anything else."""
    if isinstance(signal, LayerSignal):
        return signal
    try:
        return kernel_signal(signal)
    except InvalidTypeError:
        raise InvalidTypeError(
            f"signal must be a LayerSignal (from init_signal_layerwise or ChunkSignal.layer) or "
            f"its kernel form, got {type(signal).__name__}"
        ) from None


class KVSignalSender:
    """One C thread that waits for device events and then stores their layer signals.

    The backend supplies the event wait/destroy as C function pointers, so no Python runs
    between a finished layer and its signal. `close()` (or leaving the `with` block) delivers
    every pending signal, then joins the thread.
    """

    #: How long the thread polls one queued event before the blocking wait takes over.
    POLL_NS = 50_000_000

    def __init__(self, event_wait=None, event_destroy=None, backend: str = "cpu", event_query=None):
        """`event_wait` / `event_destroy` / `event_query`: C function pointers (int
        addresses or cdata) of the backend's runtime, or None when work is complete at
        posting time. With `event_query` (non-blocking, 0 once fired) the thread polls each
        queued event, so a layer is signalled within microseconds of its event, while an
        empty queue costs no CPU (the thread sleeps)."""
        self._sender = _core.Sender(event_wait, event_destroy)
        if event_query is not None:
            self._sender.set_polling(event_query, self.POLL_NS)
        #: The backend whose device events this sender waits for.
        self.backend = backend

    @property
    def kernel_form(self) -> array.array:
        """This sender as PDHAL_KERNEL_WORDS int64 words, for a device op that posts through
        it (pdhal_kernel_sender): names the sender while it lives, never points at it."""
        return array.array("q", [_core.KERNEL_SENDER, self._sender.kernel_id(), 0, 0])

    def post(self, event, signal: LayerSignal | KernelSignal) -> None:
        """Queue `signal` to be stored once `event` (a device event handle, or None) fires.

        The sender owns `event` from here on, also if posting fails."""
        try:
            store = signal.new_store()
        except BaseException:
            self._sender.discard(event)
            raise
        if store is None:
            self._sender.discard(event)
            raise InvalidTypeError(
                "post() needs a signal that publishes something; skip no-op "
                "signals (steps without prefill requests) before recording"
            )
        self._sender.post(event, store)

    @property
    def pending(self) -> int:
        """Signals queued and not yet stored."""
        return self._sender.pending

    @property
    def closed(self) -> bool:
        return self._sender.closed

    def close(self) -> None:
        """Deliver everything pending, stop the thread. Idempotent."""
        failures = self._sender.destroy()
        if failures:
            raise DeviceError(
                f"{failures} layer signal(s) were not delivered: waiting for their "
                f"device event failed"
            )

    def __enter__(self) -> KVSignalSender:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def destroy_kv_signal_sender(sender: KVSignalSender) -> None:
    """Deliver every pending signal of `sender`, then stop its thread."""
    if not isinstance(sender, KVSignalSender):
        raise InvalidTypeError(f"sender must be a KVSignalSender, got {type(sender).__name__}")
    sender.close()


class ProcessSender:
    """The sender a backend uses when the engine passes none: one per process (a forked
    child gets its own), created on first use, flushed at exit."""

    def __init__(self, factory: Callable[[], KVSignalSender]):
        self._factory = factory
        self._senders: dict[int, KVSignalSender] = {}
        self._lock = threading.Lock()
        atexit.register(self.close)

    def get(self) -> KVSignalSender:
        pid = os.getpid()
        with self._lock:
            sender = self._senders.get(pid)
            if sender is None or sender.closed:
                sender = self._senders[pid] = self._factory()
            return sender

    def close(self) -> None:
        """Deliver what this process's default sender holds and stop it."""
        with self._lock:
            sender = self._senders.pop(os.getpid(), None)
        if sender is not None:
            sender.close()
