"""The sender thread's polling (pdhal_sender_set_polling): while an event is queued the
thread asks the runtime's non-blocking query whether it fired; when the query says fired the
layer is stored without the blocking wait; when polling gives up, the blocking wait takes
over and decides (it also tells a failure from "not yet"). The device is played by C
callbacks over Python events; a reader in another process sees what was stored.

A backend over a runtime with an event query (the XPU one here, on the simulated runtime)
hands its query to every sender it creates."""

from __future__ import annotations

import subprocess
import threading

import pytest
from simulators import SimRuntime

import pdhal
from pdhal import ops
from pdhal._backends import registry as _registry
from pdhal._protocol import core as _core
from pdhal._protocol.core import ffi
from pdhal.testing.fixtures import python_child

#: What the reader process prints: the first progress it sees past "no layer" of step 1.
READER = """
from pdhal import ops
with ops.open_kv_signal_reader(0, 0, timeout=30) as reader:
    print("ready", flush=True)
    print(reader.wait((1, -1), timeout=60), flush=True)
"""


class Device:
    """One device event, as the sender's C callbacks see it: the query says 0 once `fired`
    is set (1 before); the blocking wait records that it was entered, then waits for
    `fired` and returns `wait_result`."""

    def __init__(self, wait_result: int = 0):
        self.fired = threading.Event()
        self.waiting = threading.Event()
        self.queries = 0
        self.wait_result = wait_result

        @ffi.callback("int(void *)")
        def query(event):
            self.queries += 1
            return 0 if self.fired.is_set() else 1

        @ffi.callback("int(void *)")
        def wait(event):
            self.waiting.set()
            self.fired.wait()
            return self.wait_result

        self.query, self.wait = query, wait


def _post_layer_0(sender: _core.Sender) -> tuple[subprocess.Popen, int]:
    """Layer 0 of a new step posted through `sender`; a reader in another process."""
    meta = ops.open_shm_and_get_meta_signal(0, 0)
    reader = python_child(READER, stdout=subprocess.PIPE, text=True)
    assert reader.stdout.readline() == "ready\n"
    sender.post(1, ops.init_signal_layerwise(meta, 0).new_store())  # event: any non-NULL
    return reader, meta.step


def test_an_event_still_pending_when_polling_gives_up_is_waited_for():
    """Polling for 1 us finds the event pending: the blocking wait takes over, and nothing
    is stored until the event fires."""
    device = Device()
    sender = _core.Sender(device.wait, ffi.NULL)
    sender.set_polling(device.query, 1_000)
    try:
        reader, step = _post_layer_0(sender)
        while not device.waiting.wait(0.01):  # the thread polls, then waits
            assert reader.poll() is None, "stored although its event never fired"
        assert device.queries >= 1, "the query was never asked"
        assert sender.pending == 1 and reader.poll() is None
        device.fired.set()
        assert reader.communicate(timeout=60)[0].splitlines() == [f"({step}, 0)"]
    finally:
        device.fired.set()
        assert sender.destroy() == 0


def test_an_event_the_query_says_fired_is_stored_without_the_blocking_wait():
    device = Device()
    device.fired.set()
    sender = _core.Sender(device.wait, ffi.NULL)
    sender.set_polling(device.query, 60_000_000_000)
    reader, step = _post_layer_0(sender)
    assert reader.communicate(timeout=60)[0].splitlines() == [f"({step}, 0)"]
    assert sender.destroy() == 0
    assert device.queries >= 1 and not device.waiting.is_set()


def test_a_failed_blocking_wait_after_polling_stores_nothing_and_is_counted():
    device = Device(wait_result=719)  # a device fault, reported by the wait
    sender = _core.Sender(device.wait, ffi.NULL)
    sender.set_polling(device.query, 1_000)
    meta = ops.open_shm_and_get_meta_signal(0, 0)
    sender.post(1, ops.init_signal_layerwise(meta, 0).new_store())
    assert device.waiting.wait(60)
    device.fired.set()
    assert sender.destroy() == 1
    with ops.open_kv_signal_reader(0, 0) as reader:
        assert reader.current() == (meta.step, -1)


def test_polling_without_a_blocking_wait_is_refused():
    """The blocking wait is what takes over when polling gives up: without one, an event
    that is slow to fire would be signalled unfired."""
    device = Device()
    sender = _core.Sender(ffi.NULL, ffi.NULL)
    try:
        with pytest.raises(pdhal.InvalidArgumentError, match="polling needs the blocking wait"):
            sender.set_polling(device.query, 1_000)
    finally:
        sender.destroy()


@pytest.mark.simulated
def test_the_xpu_backend_s_senders_poll_with_the_runtime_s_event_query(monkeypatch):
    """Every sender the backend creates polls with xpu_event_query: made to fail (as "not
    ready"), the query is seen to be asked, and the blocking wait still delivers."""
    sim = SimRuntime("xpu", "libxpurt.so")
    monkeypatch.setenv("PDHAL_XPURT", sim.path)
    monkeypatch.setenv("PDHAL_PLATFORM", "xpu")
    _registry.reset()
    assert pdhal.current_backend() == "xpu"
    try:
        sim.fail("xpu_event_query")
        meta = ops.open_shm_and_get_meta_signal(0, 0)
        with ops.create_kv_signal_sender() as sender:
            ops.signal_layer_ready(ops.init_signal_layerwise(meta, 0), sim.stream(), sender)
        assert sim.failed_calls("xpu_event_query") >= 1, "the sender never asked the query"
        with ops.open_kv_signal_reader(0, 0) as reader:
            assert reader.current() == (meta.step, 0)
    finally:
        sim.clear_failures()
