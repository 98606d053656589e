"""Test-only: the shm transport with the faults a test names in PDHAL_FAULTY_TRANSPORT, a
comma-separated list of "stall:N" (the Nth submit of each link never lands: its wait times
out), "fail:N" (the Nth submit raises TransferError) and "delay:N" (the Nth submit's bytes
are copied only when it is waited for, 0.1 s later), each for every link or, as
"stall:N@NAME", for links to the endpoint NAME only; every other submit is shm's."""

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


class _Delayed(Batch):
    def __init__(self, link: Link, runs):
        self._link, self._runs, self._landed = link, runs, False

    def done(self) -> bool:
        return self._landed

    def wait(self, timeout: float) -> None:
        time.sleep(0.1)
        self._link.submit(self._runs).wait(timeout)
        self._landed = True


class FaultyLink(Link):
    def __init__(self, link: Link, endpoint: str):
        self._link, self.regions, self._submits = link, link.regions, 0
        self._faults = {}
        for fault in filter(None, os.environ.get("PDHAL_FAULTY_TRANSPORT", "").split(",")):
            fault, _, only = fault.partition("@")
            kind, _, count = fault.partition(":")
            if not only or only == endpoint:
                self._faults[int(count)] = kind

    def submit(self, runs):
        self._submits += 1
        fault = self._faults.get(self._submits)
        if fault == "fail":
            raise TransferError("injected failure")
        if fault == "stall":
            return _Stalled()
        if fault == "delay":
            return _Delayed(self._link, runs)
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
        endpoint = described["names"][0].rsplit(".", 1)[0]  # NAME of NAME.r0
        return FaultyLink(transport("shm").connect(described, sources), endpoint)


@hookimpl
def pdhal_transport():
    return FaultyTransport()
