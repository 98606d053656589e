"""A clock a test moves by hand, for the leases and deadlines of pdhal.transfer: give it to
a KVStreamer, PrefillService or DecodeClient (`clock=`), then `advance(seconds)`: every job
due by then has run when it returns, and none before. A lease test needs no sleep and says
exactly when the lease ends, however loaded the machine."""

from __future__ import annotations

import threading
import weakref

from pdhal._errors import InvalidArgumentError
from pdhal._transfer.keeper import Clock, Deadlines


class ManualClock(Clock):
    """Time that moves only when advance() is called; starts at `start` seconds."""

    def __init__(self, start: float = 1000.0):
        self._now = float(start)
        self._lock = threading.Lock()
        self._watched: weakref.WeakSet[Deadlines] = weakref.WeakSet()

    def now(self) -> float:
        with self._lock:
            return self._now

    def sleep(self, cond: threading.Condition, seconds: float) -> None:
        cond.wait()  # until advance() (or a nearer deadline, or close) wakes it

    def watch(self, deadlines: Deadlines) -> None:
        with self._lock:
            self._watched.add(deadlines)

    def advance(self, seconds: float, settle_timeout: float = 30.0) -> None:
        """Move time on by `seconds`, and return once every job due by then has run (each
        within `settle_timeout` real seconds, else TimeoutError: a job that hangs)."""
        if not isinstance(seconds, (int, float)) or not seconds >= 0:
            raise InvalidArgumentError(f"seconds must be a number >= 0, got {seconds!r}")
        with self._lock:
            self._now += seconds
            watched = list(self._watched)
        for deadlines in watched:
            deadlines.wake()
        while True:  # a job may add a job due now to another owner's deadlines
            for deadlines in watched:
                if not deadlines.settle(settle_timeout):
                    raise TimeoutError(f"a job still runs after {settle_timeout} s")
            if all(deadlines.settle(0) for deadlines in watched):
                return
