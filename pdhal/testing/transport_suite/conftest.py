"""Fixtures of the transport conformance suite: the transport under test, a namespace per
test (nothing may be left in /dev/shm), and a destination in another process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid

import pytest

from pdhal.testing.reset import release_process_state, remove_leftovers
from pdhal.transfer import transport as _transport


@pytest.fixture(autouse=True)
def namespace(monkeypatch):
    ns = f"tkit{uuid.uuid4().hex[:12]}"
    monkeypatch.setenv("PDHAL_NAMESPACE", ns)
    yield ns
    release_process_state(forget_backend=False)
    left = remove_leftovers(ns)
    assert not left, f"segments left behind: {left}"


@pytest.fixture(scope="session")
def transport():
    return _transport(os.environ["PDHAL_KIT_TRANSPORT"])


#: A destination process: REGIONS host buffers made reachable through the transport, then
#: commands on stdin: "sum" (each region's bytes, hex-digested), "zero", "exit".
DESTINATION = """
import hashlib, json, os, sys
from pdhal import ops
from pdhal.transfer import transport
sizes = json.loads(sys.argv[1])
buffers = [ops.host_alloc(n) for n in sizes]
views = [b.as_numpy("uint8", (n,)) for b, n in zip(buffers, sizes)]
for v in views:
    v[:] = 0
endpoint = transport(os.environ["PDHAL_KIT_TRANSPORT"]).endpoint(buffers, sys.argv[2])
print(json.dumps(endpoint.describe()), flush=True)
for line in sys.stdin:
    if line.strip() == "sum":
        print(json.dumps([hashlib.sha256(v.tobytes()).hexdigest() for v in views]), flush=True)
    elif line.strip() == "exit":
        break
endpoint.close()
for b in buffers:
    ops.host_free(b)
print("closed", flush=True)
"""


class Destination:
    """A process whose host buffers (`sizes` bytes each) an endpoint serves."""

    def __init__(self, sizes: list[int], name: str = "kitdest"):
        self.sizes = sizes
        self.proc = subprocess.Popen(
            [sys.executable, "-c", DESTINATION, json.dumps(sizes), name],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        line = self.proc.stdout.readline()
        assert line, f"the destination process failed ({self.proc.wait()})"
        self.described = json.loads(line)

    def digests(self) -> list[str]:
        self.proc.stdin.write("sum\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)
        self._close_pipes()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.write("exit\n")
            self.proc.stdin.flush()
            assert self.proc.stdout.readline().strip() == "closed"
        assert self.proc.wait(timeout=30) == 0
        self._close_pipes()

    def _close_pipes(self) -> None:
        self.proc.stdin.close()
        self.proc.stdout.close()


#: A destination that checks every byte as it is declared landed: two data areas of AREA
#: bytes and a region of marker words (one per area), then for each request k in turn: spin
#: until area k % 2's marker is k + 1 (written by the source in a submit of its own, made
#: once the data's batch was done, as the streamer writes "landed"), then compare every
#: word of that area with what request k wrote there ((k + 1) << 40 | word index) and
#: print {"request": k, "missing": bytes not there yet, "first": the first one's offset}.
#: Argv: AREA, REQUESTS, the endpoint's name, the seconds a marker may take.
WATCHING = """
import json, os, sys, time
import numpy as np
from pdhal import ops
from pdhal.transfer import transport
area, requests, name, bound = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], float(sys.argv[4])
buffers = [ops.host_alloc(n) for n in (area, area, 64)]
areas = [b.as_numpy("uint64", (area // 8,)) for b in buffers[:2]]
markers = buffers[2].as_numpy("uint64", (8,))
for v in areas + [markers]:
    v[:] = 0
words = np.arange(area // 8, dtype=np.uint64)
endpoint = transport(os.environ["PDHAL_KIT_TRANSPORT"]).endpoint(buffers, name)
print(json.dumps(endpoint.describe()), flush=True)
for k in range(requests):
    slot, mark = k % 2, k + 1
    expected = words + np.uint64(mark << 40)  # made before: the data is read at once
    deadline = time.monotonic() + bound
    while markers[slot] != mark:  # yield: the transport's receiving threads need the CPUs
        if time.monotonic() > deadline:
            print(json.dumps({"request": k, "missing": None}), flush=True)
            sys.exit(1)
        os.sched_yield()
    wrong = np.flatnonzero(areas[slot] != expected)
    first = int(wrong[0]) * 8 if wrong.size else None
    print(json.dumps({"request": k, "missing": int(wrong.size) * 8, "first": first}), flush=True)
sys.stdin.readline()
endpoint.close()
for b in buffers:
    ops.host_free(b)
print("closed", flush=True)
"""


class WatchingDestination:
    """The WATCHING process: `area` bytes a data area, `requests` requests to watch."""

    def __init__(self, area: int, requests: int, bound: float, name: str = "kitwatch"):
        self.area, self.requests = area, requests
        self.proc = subprocess.Popen(
            [sys.executable, "-c", WATCHING, str(area), str(requests), name, str(bound)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        line = self.proc.stdout.readline()
        assert line, f"the watching destination failed ({self.proc.wait()})"
        self.described = json.loads(line)

    def verdict(self) -> dict:
        """The next request's: what was missing when its marker was there."""
        line = self.proc.stdout.readline()
        assert line, f"the watching destination exited ({self.proc.wait()})"
        verdict = json.loads(line)
        assert verdict["missing"] is not None, f"request {verdict['request']}'s marker never came"
        return verdict

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.write("exit\n")
            self.proc.stdin.flush()
            assert self.proc.stdout.readline().strip() == "closed"
        self.proc.wait(timeout=30)
        self.proc.stdin.close()
        self.proc.stdout.close()


@pytest.fixture
def watching_destination():
    made = []

    def make(area: int, requests: int, bound: float) -> WatchingDestination:
        made.append(WatchingDestination(area, requests, bound))
        return made[-1]

    yield make
    for d in made:
        if not d.proc.stdin.closed:  # a test that failed before closing it
            d.proc.kill()
            d.proc.wait(timeout=30)
            d.proc.stdin.close()
            d.proc.stdout.close()


@pytest.fixture
def busy_cpu():
    """A process spinning on a CPU while the test runs (the source side loaded, as a prefill
    side's compute loads it). One, not one per CPU: on 2 CPUs, Mooncake 0.3.11's early
    completions showed in 11-38 of 96 requests with one, 0-1 of 100 with two (the source's
    completion checks slowed as much as the destination's receiving)."""
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    yield
    spinner.kill()
    spinner.wait(timeout=30)


def pytest_terminal_summary(terminalreporter):
    """Say what completion the transport under test declares (Transport.completion)."""
    name = os.environ.get("PDHAL_KIT_TRANSPORT")
    if name:
        declared = getattr(_transport(name), "completion", None)
        terminalreporter.write_line(
            f"pdhal transport kit: {name!r} declares completion {declared!r}"
        )


@pytest.fixture
def destination():
    made = []

    def make(sizes: list[int], name: str = "kitdest") -> Destination:
        made.append(Destination(sizes, name))
        return made[-1]

    yield make
    for d in made:
        if d.proc.returncode is None:
            d.resume()
            d.close()
