"""The streamer's own clock: one thread that runs each job at its deadline (claim leases,
source-block leases, peer checks), sleeping until the nearest one or until a nearer one is
added, so leases expire and dead peers are found without any caller ticking the streamer
(a messager that hears outcomes through on_outcome never polls)."""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger("pdhal")


class Deadlines:
    """Jobs run at their deadlines (time.monotonic()), on one thread, in deadline order."""

    def __init__(self, name: str):
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._order = itertools.count()  # ties run in the order they were added
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def at(self, when: float, job: Callable[[], None]) -> None:
        """Run `job` at `when` (jobs added after close() never run)."""
        with self._cond:
            if self._closed:
                return
            heapq.heappush(self._heap, (when, next(self._order), job))
            if self._heap[0][2] is job:  # the nearest now: wake the thread to sleep less
                self._cond.notify()

    def runs_here(self) -> bool:
        """Whether the caller is this clock's thread (a job)."""
        return threading.current_thread() is self._thread

    def close(self) -> None:
        """Stop; jobs not run yet never run. Not from a job."""
        with self._cond:
            self._closed = True
            self._heap.clear()
            self._cond.notify()
        self._thread.join()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._closed:
                    if not self._heap:
                        self._cond.wait()
                        continue
                    left = self._heap[0][0] - time.monotonic()
                    if left <= 0:
                        break
                    self._cond.wait(left)
                if self._closed:
                    return
                _, _, job = heapq.heappop(self._heap)
            try:
                job()
            except Exception:  # a job's bug must not stop every later lease
                log.exception("pdhal.transfer: a deadline job raised")
