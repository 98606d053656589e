"""Crash and restart, repeated: a producer or a reader SIGKILLed at a random point of a
per-chunk stream. The survivor reports the death within a second, a restarted process
takes over the segment, and `pdhal cleanup` leaves nothing stale."""

from __future__ import annotations

import array
import os
import random
import signal
import subprocess
import sys
import time

import pytest

import pdhal
from pdhal import ops
from pdhal._protocol import core as _core
from pdhal._protocol import names as _names
from pdhal.testing.fixtures import python_child, segments_of

LAYERS = 4
ROUNDS = int(os.environ.get("PDHAL_CRASH_ROUNDS", "50"))

PRODUCER = f"""
from pdhal import ops
step = 0
while True:
    step += 1
    chunk = ops.init_kv_signal_per_query([step], [step], [0], 0, {LAYERS})
    for layer in range({LAYERS}):
        ops.signal_layer_ready(chunk.layer(layer))
"""

READER = f"""
import array, sys
from pdhal import ops, ProducerDiedError
out = array.array("i", [0] * 1538)
print("ready", flush=True)
last = None
while True:
    try:
        ops.get_output_kv_signal(out, 0, True, timeout=30)
    except ProducerDiedError:  # a segment its producer left; the next producer reclaims it
        last = None
        continue
    key = (out[4], out[1])  # (step, layer)
    assert last is None or key == ((last[0], last[1] + 1) if last[1] < {LAYERS} - 1
                                   else (last[0] + 1, 0)), (last, key)
    last = key
"""


def _kill_producer_round(rng: random.Random) -> None:
    producer = python_child(PRODUCER)
    out = array.array("i", [0] * 1538)
    deadline = time.monotonic() + 30
    while True:  # until the new producer streams (what is there may be the last one's)
        try:
            ops.get_output_kv_signal(out, 0, True, timeout=30)
            break
        except pdhal.ProducerDiedError:
            assert time.monotonic() < deadline
    time.sleep(rng.uniform(0, 0.05))
    producer.send_signal(signal.SIGKILL)
    killed = time.monotonic()
    with pytest.raises(pdhal.ProducerDiedError):
        while True:  # drain what it published, then learn of its death
            ops.get_output_kv_signal(out, 0, True, timeout=30)
    assert time.monotonic() - killed < 1.0
    producer.wait()


def _kill_reader_round(rng: random.Random) -> None:
    reader = python_child(READER, stdout=subprocess.PIPE, text=True)
    assert reader.stdout.readline().strip() == "ready"
    step = 0
    killed = None
    kill_at = 20 + rng.randrange(200)
    with pytest.raises(pdhal.ReaderDiedError, match="died with step"):
        while True:
            step += 1
            chunk = ops.init_kv_signal_per_query([step], [step], [0], 0, LAYERS)
            for layer in range(LAYERS):
                ops.signal_layer_ready(chunk.layer(layer))
            if step == kill_at:
                reader.send_signal(signal.SIGKILL)
                killed = time.monotonic()
    assert killed is not None and time.monotonic() - killed < 1.0
    reader.wait()


def test_random_kills_are_reported_within_a_second_and_restarts_take_over():
    rng = random.Random(int(os.environ.get("PDHAL_CRASH_SEED", "1234")))
    counts = {"producer": 0, "reader": 0}
    for _ in range(ROUNDS):
        victim = rng.choice(["producer", "reader"])
        counts[victim] += 1
        if victim == "producer":
            _kill_producer_round(rng)  # the next round's producer reclaims the segment
        else:
            _kill_reader_round(rng)  # and this process stays the producer
            from pdhal._protocol import signals as _signals

            _signals.close_producer_channels()  # hand the channel to the next round
    print(f"crash rounds: {counts}")
    assert min(counts.values()) >= 10
    # what SIGKILL left behind (a dead producer's segment) is stale: cleanup removes it
    proc = subprocess.run(
        [sys.executable, "-m", "pdhal", "cleanup", "--namespace", pdhal.namespace()],
        capture_output=True,
        text=True,
        check=True,
    )
    assert not segments_of(os.environ["PDHAL_NAMESPACE"]), proc.stdout


def test_cleanup_removes_dead_segments_only():
    live = ops.open_shm_and_get_meta_signal(0, 0)
    subprocess.run(
        [
            sys.executable,
            "-c",
            "import os; from pdhal import ops; ops.open_shm_and_get_meta_signal(1, 0); os._exit(0)",
        ],
        check=True,
    )
    dead = _names.channel_path("query", 1, 0)
    assert os.path.exists(dead)
    proc = subprocess.run(
        [sys.executable, "-m", "pdhal", "cleanup", "--namespace", pdhal.namespace()],
        capture_output=True,
        text=True,
        check=True,
    )
    assert f"removed {dead}" in proc.stdout
    assert not os.path.exists(dead)
    assert os.path.exists(_names.channel_path("query", 0, 0)) and live.step == 1


# ---- acknowledgement: what "finished" means to a restarted messager -------------------

READ_AND_DIE = """
import array, os, signal
from pdhal import ops
out = array.array("i", [0] * 1538)
with ops.open_kv_chunk_reader(0, 0, timeout=10) as reader:
    for _ in range({records}):
        reader.next(out, timeout=10)
    {then}
os.kill(os.getpid(), signal.SIGKILL)  # a messager dying right after the records came
"""


@pytest.mark.parametrize(
    "then, resumes_at",
    [
        ("pass", (1, 0)),  # the last layer of step 1 came, unacknowledged: step 1 again
        ("reader.ack()", (2, 0)),  # acknowledged: step 1 is finished
    ],
)
def test_a_messager_dying_after_a_steps_last_layer_gets_it_again_unless_acknowledged(
    then, resumes_at
):
    for step in (1, 2):
        chunk = ops.init_kv_signal_per_query([step], [step], [0], 0, 2)
        ops.signal_layer_ready(chunk.layer(0))
        ops.signal_layer_ready(chunk.layer(1))
    dead = python_child(READ_AND_DIE.format(records=2, then=then))
    assert dead.wait(timeout=30) == -signal.SIGKILL
    out = array.array("i", [0] * 1538)
    with ops.open_kv_chunk_reader(0, 0, timeout=10) as reader:
        step = reader.next(out, timeout=10)
        assert (step, out[1]) == resumes_at and out[4] == resumes_at[0]


def test_asking_for_the_next_record_acknowledges_the_last():
    chunk = ops.init_kv_signal_per_query([1], [1], [0], 0, 1)
    ops.signal_layer_ready(chunk.layer(0))
    chunk = ops.init_kv_signal_per_query([2], [2], [0], 0, 1)
    dead = python_child(READ_AND_DIE.format(records=2, then="pass"))  # 2nd: no record, waits
    ops.signal_layer_ready(chunk.layer(0))
    assert dead.wait(timeout=30) == -signal.SIGKILL
    out = array.array("i", [0] * 1538)
    with ops.open_kv_chunk_reader(0, 0, timeout=10) as reader:
        assert reader.next(out, timeout=10) == 2  # step 1 was acknowledged by the 2nd call


PRODUCE_ONE = """
import sys
from pdhal import ops
c = ops.init_kv_signal_per_query([{tokens}], [{tokens}], [0], 0, 1)
ops.signal_layer_ready(c.layer(0))
print("published", flush=True)
sys.stdin.read()
"""


def test_a_messager_outliving_its_producer_waits_for_the_next_one():
    """After ProducerDiedError, the next call waits (up to its timeout) for a new producer
    instead of attaching to the dead one's file again and failing at once, over and over."""
    first = python_child(
        PRODUCE_ONE.format(tokens=1), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert first.stdout.readline() == "published\n"
    out = array.array("i", [0] * 1538)
    ops.get_output_kv_signal(out, 0, True, timeout=5)
    assert list(out[:5]) == [1, 0, 0, 0, 1]
    first.kill()
    first.wait()
    with pytest.raises(pdhal.ProducerDiedError):
        ops.get_output_kv_signal(out, 0, True, timeout=5)
    start = time.monotonic()
    with pytest.raises(pdhal.SegmentError, match="left by a producer that died"):
        ops.get_output_kv_signal(out, 0, True, timeout=0.3)
    assert 0.3 <= time.monotonic() - start < 1.0
    ops.get_output_kv_signal(out, 0, False)  # no wait: nothing pending, no error
    assert list(out[:2]) == [-1, -1]
    second = python_child(PRODUCE_ONE.format(tokens=7), stdin=subprocess.PIPE)
    ops.get_output_kv_signal(out, 0, True, timeout=30)  # waits for it, then reads
    assert list(out[:5]) == [1, 0, 0, 0, 7]
    second.stdin.close()
    assert second.wait(timeout=30) == 0


READ_ACK_AND_DIE = """
import array, os, signal
from pdhal import ops
out = array.array("i", [0] * 1538)
for _ in range(2):
    ops.get_output_kv_signal(out, 0, True, timeout=10)
ops.ack_kv_signal(0)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_ack_kv_signal_finishes_what_get_output_kv_signal_delivered():
    for step in (1, 2):
        chunk = ops.init_kv_signal_per_query([step], [step], [0], 0, 2)
        ops.signal_layer_ready(chunk.layer(0))
        ops.signal_layer_ready(chunk.layer(1))
    assert python_child(READ_ACK_AND_DIE).wait(timeout=30) == -signal.SIGKILL
    out = array.array("i", [0] * 1538)
    with ops.open_kv_chunk_reader(0, 0, timeout=10) as reader:
        assert reader.next(out, timeout=10) == 2 and out[1] == 0
    ops.ack_kv_signal(0, 0)  # nothing delivered in this process: nothing to do, no error


CLOSE_CLEANLY = """
import array, sys
from pdhal import ops
out = array.array("i", [0] * 1538)
with ops.open_kv_chunk_reader(0, 0, timeout=10) as reader:
    reader.next(out, timeout=10)
    reader.ack()
print("closed", flush=True)
sys.stdin.read()  # alive, attached to nothing
"""


def test_a_messager_closing_its_reader_is_not_reported_dead(monkeypatch):
    """A reader that detaches cleanly (a messager restarting its reader, or stopping) leaves
    the producer waiting for the next reader: back-pressure, not ReaderDiedError."""
    chunk = ops.init_kv_signal_per_query([1], [1], [0], 0, 1)
    ops.signal_layer_ready(chunk.layer(0))
    child = python_child(CLOSE_CLEANLY, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline() == "closed\n"
    monkeypatch.setenv("PDHAL_BACKPRESSURE_TIMEOUT", "0.3")
    with pytest.raises(pdhal.BackPressureTimeoutError, match="no cache messager is attached"):
        for step in range(2, 2 + _core.DEFAULT_RING_SLOTS + 1):  # one more than fits
            chunk = ops.init_kv_signal_per_query([step], [step], [0], 0, 1)
            ops.signal_layer_ready(chunk.layer(0))
    out = array.array("i", [0] * 1538)
    with ops.open_kv_chunk_reader(0, 0, timeout=10) as reader:  # the next reader resumes
        assert reader.next(out, timeout=10) == 2
    child.stdin.close()
    assert child.wait(timeout=30) == 0
