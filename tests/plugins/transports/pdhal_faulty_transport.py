"""Test-only: the shm transport with the faults a test names in PDHAL_FAULTY_TRANSPORT,
"stall:N" (the Nth submit of each link never lands: its wait times out) or "fail:N" (the
Nth submit raises TransferError); every other submit is shm's."""

import os
import time

from pdhal import TransferError, hookimpl
from pdhal.transfer import Batch, Link, Transport, transport


class _Stalled(Batch):
    def done(self) -> bool:
        return False

    def wait(self, timeout: float) -> None:
        time.sleep(timeout)
        raise TransferError(f"injected stall: not landed after {timeout:g} s")


class FaultyLink(Link):
    def __init__(self, link: Link):
        self._link, self.regions, self._submits = link, link.regions, 0
        kind, _, count = os.environ.get("PDHAL_FAULTY_TRANSPORT", "").partition(":")
        self._fault, self._at = kind, int(count or 0)

    def submit(self, runs):
        self._submits += 1
        if self._submits == self._at and self._fault == "fail":
            raise TransferError("injected failure")
        if self._submits == self._at and self._fault == "stall":
            return _Stalled()
        return self._link.submit(runs)

    def problem(self):
        return self._link.problem()

    def close(self):
        self._link.close()


class FaultyTransport(Transport):
    name = "faulty"

    def endpoint(self, regions, name):
        return transport("shm").endpoint(regions, name)

    def connect(self, described, sources):
        return FaultyLink(transport("shm").connect(described, sources))


@hookimpl
def pdhal_transport():
    return FaultyTransport()
