"""The streamer's own clock: one thread that runs each job at its deadline (claim leases,
source-block leases, peer checks), sleeping until the nearest one or until a nearer one is
added, so leases expire and dead peers are found without any caller ticking the streamer
(a messager that hears outcomes through on_outcome never polls).

Deadlines are read on a Clock: time.monotonic() unless the owner was given another (a test
passes pdhal.testing.ManualClock, and a lease expires when the test moves time, exactly
then, with no sleep)."""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable

from pdhal._errors import InvalidArgumentError

log = logging.getLogger("pdhal")


class Clock:
    """The time leases and deadlines are read on: time.monotonic(), in seconds."""

    def now(self) -> float:
        return time.monotonic()

    def sleep(self, cond: threading.Condition, seconds: float) -> None:
        """Wait on `cond` (held) until it is notified or `seconds` of this clock passed."""
        cond.wait(seconds)

    def watch(self, deadlines: Deadlines) -> None:
        """`deadlines` runs on this clock (a clock moved by hand wakes it)."""


MONOTONIC = Clock()


def checked(clock: object) -> Clock:
    """`clock` if it is a Clock, MONOTONIC for None (InvalidArgumentError otherwise)."""
    if clock is None:
        return MONOTONIC
    if not isinstance(clock, Clock):
        raise InvalidArgumentError(
            f"clock must be a pdhal.transfer.Clock (e.g. pdhal.testing.ManualClock), got {clock!r}"
        )
    return clock


class Deadlines:
    """Jobs run at their deadlines (on `clock`), on one thread, in deadline order."""

    def __init__(self, name: str, clock: Clock | None = None):
        self.clock = checked(clock)
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._order = itertools.count()  # ties run in the order they were added
        self._cond = threading.Condition()
        self._closed = False
        self._running = False  # a job runs now (settle() waits for it)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.clock.watch(self)
        self._thread.start()

    def now(self) -> float:
        """The time on this clock."""
        return self.clock.now()

    def after(self, seconds: float, job: Callable[[], None]) -> None:
        """Run `job` `seconds` from now (jobs added after close() never run)."""
        self.at(self.clock.now() + seconds, job)

    def at(self, when: float, job: Callable[[], None]) -> None:
        """Run `job` at `when`, a time of this clock."""
        with self._cond:
            if self._closed:
                return
            heapq.heappush(self._heap, (when, next(self._order), job))
            if self._heap[0][2] is job:  # the nearest now: wake the thread to sleep less
                self._cond.notify_all()

    def wake(self) -> None:
        """Look at the clock again (it was moved)."""
        with self._cond:
            self._cond.notify_all()

    def settle(self, timeout: float) -> bool:
        """Wait (up to `timeout` real seconds) until no job is due or running: whether so."""
        with self._cond:
            return self._cond.wait_for(
                lambda: (
                    self._closed
                    or not (self._running or (self._heap and self._heap[0][0] <= self.clock.now()))
                ),
                timeout,
            )

    def runs_here(self) -> bool:
        """Whether the caller is this clock's thread (a job)."""
        return threading.current_thread() is self._thread

    def close(self) -> None:
        """Stop; jobs not run yet never run. Not from a job."""
        with self._cond:
            self._closed = True
            self._heap.clear()
            self._cond.notify_all()
        self._thread.join()

    def _run(self) -> None:
        while True:
            with self._cond:
                self._running = False
                self._cond.notify_all()  # settle() waits for the job to be done
                while not self._closed:
                    if not self._heap:
                        self._cond.wait()
                        continue
                    left = self._heap[0][0] - self.clock.now()
                    if left <= 0:
                        break
                    self.clock.sleep(self._cond, left)
                if self._closed:
                    return
                _, _, job = heapq.heappop(self._heap)
                self._running = True
            try:
                job()
            except Exception:  # a job's bug must not stop every later lease
                log.exception("pdhal.transfer: a deadline job raised")
