"""A pretend device stream: a thread that runs queued work in order.

Your runtime has real streams; what matters for pdhal is only that a layer signal is
queued *behind* the layer's work, so it is stored after that work finished."""

from __future__ import annotations

import atexit
import queue
import threading
import weakref

_streams: weakref.WeakSet = weakref.WeakSet()


class Stream:
    def __init__(self):
        self._work: queue.Queue = queue.Queue()
        threading.Thread(target=self._run, daemon=True, name="example-stream").start()
        _streams.add(self)

    def enqueue(self, fn) -> None:
        self._work.put(fn)

    def synchronize(self) -> None:
        """Return once everything queued so far has run."""
        done = threading.Event()
        self.enqueue(done.set)
        done.wait()

    def _run(self) -> None:
        while True:
            self._work.get()()


@atexit.register
def _finish_all_work() -> None:
    # A process exits only after its device work (and the signals queued behind it) ran.
    for stream in list(_streams):
        stream.synchronize()


_default: Stream | None = None


def default_stream() -> Stream:
    global _default
    if _default is None:
        _default = Stream()
    return _default
