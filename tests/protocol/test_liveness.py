"""Producer death is seen within a second, also while waiting; a new producer reclaims."""

from __future__ import annotations

import array
import os
import signal
import subprocess
import time

import pytest

import pdhal
from pdhal import ops
from pdhal._protocol import core as _core
from pdhal._protocol import names as _names
from pdhal.testing.fixtures import python_child

PRODUCER = """
    import os, sys, time
    from pdhal import ops
    mode = {mode!r}
    if mode == "query":
        meta = ops.open_shm_and_get_meta_signal(0, 0)
        ops.signal_layer_ready(ops.init_signal_layerwise(meta, 0))
    else:
        chunk = ops.init_kv_signal_per_query([5], [5], [0], 0, 8)
        ops.signal_layer_ready(chunk.layer(0))
    {before_ready}
    print("ready", flush=True)
    {after_ready}
"""


def _start(mode: str, before_ready: str = "", after_ready: str = "time.sleep(60)"):
    import subprocess

    child = python_child(
        PRODUCER.format(mode=mode, before_ready=before_ready, after_ready=after_ready),
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout.readline().strip() == "ready"
    return child


def _reader_wait(mode: str):
    """A blocking wait that can only end by the producer's death; returns the raiser."""
    if mode == "query":
        reader = ops.open_kv_signal_reader(0, 0, timeout=10)
        return lambda: reader.wait(reader.current(), timeout=30), reader
    out = array.array("i", [0] * 1538)
    ops.get_output_kv_signal(out, 0, True, timeout=10)  # layer 0, already signalled
    assert list(out[:5]) == [1, 0, 0, 0, 5]
    return lambda: ops.get_output_kv_signal(out, 0, True, timeout=30), None


def _assert_dead_within_a_second(wait):
    start = time.monotonic()
    with pytest.raises(pdhal.ProducerDiedError, match="died"):
        wait()
    assert time.monotonic() - start < 1.0


@pytest.mark.parametrize("mode", ["query", "chunk"])
def test_sigkill_mid_step_ends_the_wait_and_a_new_producer_reclaims(mode):
    child = _start(mode)
    wait, reader = _reader_wait(mode)
    import threading

    threading.Timer(0.3, child.send_signal, (signal.SIGKILL,)).start()
    # The child is ours and not reaped while we wait: a zombie must still count as dead.
    _assert_dead_within_a_second(wait)
    assert child.poll() is not None
    if reader:
        reader.close()
    path = _names.channel_path(mode, 0, 0)
    assert os.path.exists(path)  # killed: nobody unlinked it
    second = _start(mode)  # reclaims the dead producer's segment
    if mode == "query":
        with ops.open_kv_signal_reader(0, 0) as again:
            assert again.current() == (1, 0) and again.producer_pid == second.pid
    else:
        out = array.array("i", [0] * 1538)
        ops.get_output_kv_signal(out, 0, True, timeout=10)
        assert list(out[:5]) == [1, 0, 0, 0, 5]
    second.kill()
    second.wait()
    assert _core.reclaim(path)


def _assert_waiting_reader_sees_death(child):
    """A reader blocked on the per-query channel of `child`, which is about to end, learns
    of it within a second; afterwards the segment is gone (unlinked by a clean exit, else
    reclaimed here)."""
    reader = ops.open_kv_signal_reader(0, 0, timeout=10)
    _assert_dead_within_a_second(lambda: reader.wait(reader.current(), timeout=30))
    reader.close()
    child.wait()
    path = _names.channel_path("query", 0, 0)
    _core.reclaim(path)
    assert not os.path.exists(path)


@pytest.mark.parametrize("ending", ["os._exit(3)", "sys.exit(0)"])
def test_exit_and_clean_exit_are_seen(ending):
    _assert_waiting_reader_sees_death(_start("query", after_ready=f"time.sleep(0.3); {ending}"))


def test_forked_child_does_not_keep_the_producer_alive():
    _assert_waiting_reader_sees_death(
        _start(
            "query",
            before_ready="""
    if os.fork() == 0:
        time.sleep(5); os._exit(0)""",
            after_ready="time.sleep(0.3); os._exit(0)",
        )
    )


#: forks 200 children while a thread creates segments; prints how many inherited a lock
FORK_DURING_CREATE = """
import os, threading
from pdhal._protocol import core, names
stop = threading.Event()
def churn():  # small buffers, whose create-and-close is all windows (a close between
    i = 0     # leaving the fork registry and closing its description), and now and then a
    while not stop.is_set():  # 16 MiB one (its prefault keeps a creation open for ms)
        path = names.buffer_path(f"forkwindow{i % 2}")
        size = 16 << 20 if i % 64 == 0 else 4096
        core.Segment.create(path, core.KIND_BUFFER, body_bytes=size).close()
        i += 1
creator = threading.Thread(target=churn)
creator.start()
locked = 0
for _ in range(1000):
    pid = os.fork()
    if pid == 0:
        found = 0
        for fd in os.listdir("/proc/self/fd"):
            try:
                target = os.readlink(f"/proc/self/fd/{fd}")
                info = open(f"/proc/self/fdinfo/{fd}").read()
            except OSError:
                continue
            found |= "/pdhal." in target and "lock:" in info
        os._exit(found)
    _, status = os.waitpid(pid, 0)
    locked += os.waitstatus_to_exitcode(status)
stop.set()
creator.join()
print(locked, flush=True)
"""


def test_a_fork_while_another_thread_creates_a_segment_leaves_the_child_no_lock():
    """A process forks (a data loader, a helper) while another of its threads creates or
    closes a segment: the child must not inherit the producer lock (an open file
    description that holds it), or the segment's producer would look alive while the
    child lives. Each child looks at every pdhal file it holds open for a lock (/proc's
    fdinfo). (A close that left the fork registry before closing its description gave
    45 of 1,500 children the lock.)"""
    child = python_child(FORK_DURING_CREATE, stdout=subprocess.PIPE, text=True)
    out, _ = child.communicate(timeout=120)
    assert child.returncode == 0 and out.strip() == "0", (child.returncode, out)


def test_stopped_producer_is_alive_and_resumes():
    child = _start(
        "query",
        after_ready="""
    import signal
    signal.signal(signal.SIGUSR1, lambda *a: ops.signal_layer_ready(
        ops.init_signal_layerwise(meta, 1)))
    time.sleep(60)""",
    )
    reader = ops.open_kv_signal_reader(0, 0, timeout=10)
    child.send_signal(signal.SIGSTOP)
    with pytest.raises(pdhal.SignalTimeoutError):
        reader.wait(reader.current(), timeout=0.5)  # stalled, not dead
    assert reader.producer_alive()
    child.send_signal(signal.SIGCONT)
    child.send_signal(signal.SIGUSR1)
    assert reader.wait((1, 0), timeout=5) == (1, 1)
    reader.close()
    child.kill()
    child.wait()
    _core.reclaim(_names.channel_path("query", 0, 0))


def test_reader_in_the_producers_own_process_sees_it_alive():
    meta = ops.open_shm_and_get_meta_signal(0, 0)
    for _ in range(50):
        with ops.open_kv_signal_reader(0, 0) as reader:
            assert reader.producer_alive()
    ops.signal_layer_ready(ops.init_signal_layerwise(meta, 2))
    with ops.open_kv_signal_reader(0, 0) as reader:
        assert reader.wait((1, 1), timeout=1) == (1, 2)


def test_live_unrelated_pid_in_header_without_lock_is_dead():
    """Liveness is the lock, not the pid: a header naming a live process proves nothing."""
    import struct

    child = _start("query")
    reader = ops.open_kv_signal_reader(0, 0, timeout=10)
    with open(reader._segment.path, "r+b") as f:  # header offset 24: creator_pid
        f.seek(24)
        f.write(struct.pack("<i", os.getpid()))
    assert reader.producer_pid == os.getpid()
    child.kill()
    child.wait()
    assert not reader.producer_alive()
    reader.close()
    _core.reclaim(_names.channel_path("query", 0, 0))


def test_sigint_interrupts_a_wait_quickly():
    child = python_child("""
        import os, signal, sys, time, threading
        from pdhal import ops
        # (a shell starting the suite in the background has SIGINT ignored, and Python
        # keeps an ignored SIGINT ignored: KeyboardInterrupt would never come)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        meta = ops.open_shm_and_get_meta_signal(0, 0)
        reader = ops.open_kv_signal_reader(0, 0)
        sent = []
        def interrupt():
            sent.append(time.monotonic())
            os.kill(os.getpid(), signal.SIGINT)
        threading.Timer(0.2, interrupt).start()
        try:
            reader.wait(reader.current(), timeout=10)
        except KeyboardInterrupt:
            elapsed = time.monotonic() - sent[0]
            print(elapsed)
            sys.exit(0 if elapsed < 0.1 else 2)
        sys.exit(1)
    """)
    assert child.wait(timeout=15) == 0


def test_timeout_holds_under_a_signal_every_millisecond():
    child = python_child("""
        import signal, sys, time
        from pdhal import ops, SignalTimeoutError
        signal.signal(signal.SIGALRM, lambda *a: None)
        signal.setitimer(signal.ITIMER_REAL, 0.001, 0.001)
        meta = ops.open_shm_and_get_meta_signal(0, 0)
        reader = ops.open_kv_signal_reader(0, 0)
        start = time.monotonic()
        try:
            reader.wait(reader.current(), timeout=0.1)
        except SignalTimeoutError:
            elapsed = time.monotonic() - start
            signal.setitimer(signal.ITIMER_REAL, 0)
            sys.exit(0 if 0.1 <= elapsed < 0.15 else 2)
        sys.exit(1)
    """)
    assert child.wait(timeout=15) == 0


def test_a_per_query_producer_sees_whether_its_messager_is_attached():
    import subprocess

    meta = ops.open_shm_and_get_meta_signal(0, 0)
    assert not meta.reader_alive()
    messager = python_child(
        """
        import sys
        from pdhal import ops
        reader = ops.open_kv_signal_reader(0, 0, timeout=10)
        print("attached", flush=True)
        sys.stdin.read()
    """,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert messager.stdout.readline() == "attached\n"
    local = ops.open_kv_signal_reader(0, 0)  # a second reader shares the reader's lock
    assert meta.reader_alive()
    local.close()
    assert meta.reader_alive()
    messager.send_signal(signal.SIGKILL)
    messager.wait(timeout=10)
    assert not meta.reader_alive()
