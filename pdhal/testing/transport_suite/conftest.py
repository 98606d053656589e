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
