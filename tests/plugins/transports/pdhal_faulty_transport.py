"""Test-only: the shm transport with the faults a test names in PDHAL_FAULTY_TRANSPORT, a
comma-separated list of "stall:N" (the Nth submit to an endpoint never lands: its wait times
out), "stalls:N" (every submit from the Nth on stalls: a decode side that stopped
answering), "fail:N" (the Nth submit raises TransferError), "delay:N" (the Nth submit's
bytes are copied only when it is waited for, 0.1 s later), "problem:N" (problem()
raises from its Nth call on: a transport's bug) and "hangs:N" (the Nth connect to an
endpoint and those after it never return: Mooncake's connect to a cut-off peer), each for
every endpoint or, as "stall:N@NAME", for the endpoint NAME only; and "held" (the
transport gates, as shm does, and a gated batch settles only once `release` is set: its
signal came, its copies may have run, and the streamer has not seen it yet) or
"held-open" (the same, and a gated submit returns once its gate opened: copies started,
not landed). Submits are
counted per endpoint (its process and name), over every link to it: a link made anew
after a fault goes on counting. Every other submit is shm's."""

import collections
import os
import threading
import time

from pdhal import TransferError, hookimpl
from pdhal.transfer import Batch, Link, Transport, transport


class _Stalled(Batch):
    def done(self) -> bool:
        return False

    def wait(self, timeout: float) -> None:
        time.sleep(timeout)
        raise TransferError(f"injected stall: not landed after {timeout:g} s")


class _Delayed(Batch):
    def __init__(self, link: Link, runs):
        self._link, self._runs, self._landed = link, runs, False

    def done(self) -> bool:
        return self._landed

    def wait(self, timeout: float) -> None:
        time.sleep(0.1)
        self._link.submit(self._runs).wait(timeout)
        self._landed = True


class _Held(Batch):
    def __init__(self, batch: Batch, opened: bool):
        self._batch = batch
        deadline = time.monotonic() + 30
        while opened and not batch.started_ns() and time.monotonic() < deadline:
            time.sleep(0.001)

    def done(self) -> bool:
        return release.is_set() and self._batch.done()

    def wait(self, timeout: float) -> None:
        if not release.wait(timeout):
            raise TransferError(f"injected hold: not released after {timeout:g} s")
        self._batch.wait(timeout)

    def started_ns(self) -> int:
        return self._batch.started_ns()

    def cancel(self) -> None:
        self._batch.cancel()


release = threading.Event()  # what "held" batches wait for


def _faults() -> list[str]:
    return os.environ.get("PDHAL_FAULTY_TRANSPORT", "").split(",")


_counts: collections.Counter = collections.Counter()  # (endpoint, "submit"/"problem") -> calls
_lock = threading.Lock()


class FaultyLink(Link):
    def __init__(self, link: Link, endpoint: str, pid: int):
        self._link, self.regions, self._key = link, link.regions, (pid, endpoint)
        self._faults, self._from = {}, {}
        for fault in filter(None, os.environ.get("PDHAL_FAULTY_TRANSPORT", "").split(",")):
            fault, _, only = fault.partition("@")
            kind, _, count = fault.partition(":")
            if not only or only == endpoint:
                if kind in ("stalls", "problem"):
                    self._from[kind] = int(count)
                elif kind not in ("held", "held-open"):  # the transport's: gates
                    self._faults[int(count)] = kind

    def _count(self, what: str) -> int:
        with _lock:
            _counts[self._key, what] += 1
            return _counts[self._key, what]

    def submit(self, runs):
        n = self._count("submit")
        fault = self._faults.get(n)
        if n >= self._from.get("stalls", n + 1):
            fault = "stall"
        if fault == "fail":
            raise TransferError("injected failure")
        if fault == "stall":
            return _Stalled()
        if fault == "delay":
            return _Delayed(self._link, runs)
        return self._link.submit(runs)

    def submit_blocks(self, layer, runs, gate=None):
        if gate is None:
            return super().submit_blocks(layer, runs)  # through submit(), and its faults
        opened = "held-open" in _faults()
        return _Held(self._link.submit_blocks(layer, runs, gate), opened)

    def problem(self):
        if self._count("problem") >= self._from.get("problem", float("inf")):
            raise RuntimeError("injected: problem() has a bug")
        return self._link.problem()

    def close(self):
        self._link.close()


class FaultyTransport(Transport):
    name = "faulty"
    completion = "target"  # shm's, with faults

    @property
    def gates(self) -> bool:
        return bool({"held", "held-open"} & set(_faults()))

    def endpoint(self, regions, name):
        return transport("shm").endpoint(regions, name)

    def connect(self, described, sources):
        endpoint = described["names"][0].rsplit(".", 1)[0]  # NAME of NAME.r0
        with _lock:
            _counts[(described["pid"], endpoint), "connect"] += 1
            n = _counts[(described["pid"], endpoint), "connect"]
        for fault in filter(None, os.environ.get("PDHAL_FAULTY_TRANSPORT", "").split(",")):
            kind, _, count = fault.partition("@")[0].partition(":")
            if kind == "hangs" and n >= int(count):
                threading.Event().wait()  # never returns
        return FaultyLink(transport("shm").connect(described, sources), endpoint, described["pid"])


@hookimpl
def pdhal_transport():
    return FaultyTransport()
