"""The `shm` transport (built in): both sides on one host. The endpoint publishes each
region through pdhal's shared memory (set_data_ipc); a link maps them (get_data_ptr_ipc)
and copies with memmove, so a submit has landed when it returns. A peer is alive while its
process is: the endpoint's pid and start time are in its description (a recycled pid is
another process)."""

from __future__ import annotations

import ctypes
import os
import select
import threading

from pdhal import ops
from pdhal._errors import InvalidArgumentError, PdhalError, TransferError
from pdhal._transfer.contract import (
    Batch,
    Endpoint,
    Link,
    Run,
    RunChecker,
    Transport,
    region_bytes,
)


def _start_time(pid: int) -> str | None:
    """The start time of process `pid` (field 22 of /proc/PID/stat), None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


class _Landed(Batch):
    def done(self) -> bool:
        return True

    def wait(self, timeout: float) -> None:
        return None


class ShmEndpoint(Endpoint):
    """Each region published as NAME.r<i> in pdhal's shared memory."""

    def __init__(self, regions: list, name: str):
        self._sizes = region_bytes(regions)
        self._names: list[str] = []
        try:
            for index, region in enumerate(regions):
                shared = f"{name}.r{index}"
                ops.set_data_ipc(region, shared)
                self._names.append(shared)
        except BaseException:
            self.close()
            raise
        self._pid = os.getpid()

    def describe(self) -> dict:
        return {
            "transport": ShmTransport.name,
            "names": list(self._names),
            "regions": list(self._sizes),
            "pid": self._pid,
            "started": _start_time(self._pid),
        }

    def close(self) -> None:
        while self._names:
            ops.unset_data_ipc(None, self._names.pop(), False, True)


class ShmLink(Link):
    """The endpoint's regions mapped here; a submit copies at once. The destination's exit
    is watched through a pidfd (opened once, then checked to be the described process by
    its start time), or through /proc where pidfds are missing."""

    def __init__(self, described: dict, sources: list[tuple[int, int]], timeout: float):
        self._pid, self._started = described["pid"], described["started"]
        self._runs = RunChecker(described["regions"], sources)
        self.regions = list(described["regions"])
        self._names: list[str] = []
        self._bases: list[int] = []
        self._pidfd, self._exit, self._exit_lock = -1, None, threading.Lock()
        try:
            self._pidfd = os.pidfd_open(self._pid)
        except (AttributeError, OSError):  # no pidfds here, or gone already (/proc says)
            pass
        else:
            self._exit = select.poll()
            self._exit.register(self._pidfd, select.POLLIN)
        try:
            if _start_time(self._pid) != self._started:
                raise TransferError(f"the destination process (pid {self._pid}) is gone")
            for name in described["names"]:
                self._bases.append(ops.get_data_ptr_ipc(None, name, timeout))
                self._names.append(name)
        except BaseException:
            self.close()
            raise

    def problem(self) -> str | None:
        with self._exit_lock:  # a poll object refuses two threads at once
            if self._exit is not None:
                gone = bool(self._exit.poll(0))  # readable once the process exited
            else:
                gone = _start_time(self._pid) != self._started
        return f"the destination process (pid {self._pid}) is gone" if gone else None

    def submit(self, runs: list[Run]) -> Batch:
        why = self.problem()
        if why is not None:
            raise TransferError(why)
        self._runs.check(runs)  # every run, before the first byte moves
        bases, memmove = self._bases, ctypes.memmove
        for src, region, offset, nbytes in runs:
            memmove(bases[region] + offset, src, nbytes)
        return _Landed()

    def close(self) -> None:
        """Unmap the destination's regions (their records stay: the endpoint's own)."""
        self._bases = []
        while self._names:
            ops.unset_data_ipc(None, self._names.pop(), True, False)
        with self._exit_lock:
            if self._pidfd >= 0:
                os.close(self._pidfd)
                self._pidfd, self._exit = -1, None


class ShmTransport(Transport):
    name = "shm"

    def __init__(self, connect_timeout: float = 10.0):
        self._timeout = connect_timeout

    def endpoint(self, regions: list, name: str) -> Endpoint:
        return ShmEndpoint(regions, name)

    def connect(self, described: dict, sources: list[tuple[int, int]]) -> Link:
        try:
            return ShmLink(described, sources, self._timeout)
        except (KeyError, TypeError) as e:
            raise InvalidArgumentError(f"not an shm endpoint's description: {e}") from None
        except PdhalError as e:
            raise TransferError(f"cannot map the destination's memory: {e}") from None
