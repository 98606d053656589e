"""The transport toolkit: what transport plugins built on an engine (Mooncake's transfer
engine, a NIXL agent) all need, written once.

- Options: a transport's settings as arguments (`Transport.configure`), each with the
  environment variable that gives it otherwise and a default, checked where they are given.
- EngineTransport: one engine per process, made from those options on first use.
- Registrations: memory registered with the engine, reference-counted by range.
- LatchedLink: a link that keeps the first failure its engine reported.
- PollingBatch: a batch whose state is asked of the engine, waited on with short naps that
  grow (an engine's own blocking wait spins a core, one a small host's transport threads
  need).
"""

from __future__ import annotations

import enum
import math
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import ClassVar

from pdhal._errors import InvalidArgumentError, TransferError
from pdhal._transfer.contract import Batch, Link, Transport

#: The first nap between two looks at an engine's state, and the longest (it doubles).
NAPS_S = (50e-6, 500e-6)


def nap_until(ready: Callable[[], bool], deadline: float) -> bool:
    """Call `ready` until it is true (True) or time.monotonic() passes `deadline` (False),
    napping NAPS_S between calls."""
    nap, longest = NAPS_S
    while not ready():
        if time.monotonic() > deadline:
            return False
        time.sleep(nap)
        nap = min(2 * nap, longest)
    return True


def word(value: object) -> str:
    """An Option parser taking a non-empty string of printable characters without spaces
    (a host, a device list): what an Option takes unless it says otherwise."""
    if isinstance(value, str) and value and all(c.isprintable() and c != " " for c in value):
        return value
    raise ValueError("a non-empty string without spaces")


@dataclass(frozen=True)
class Option:
    """One setting a transport takes: `parse` turns a given value (or the environment
    variable `env`'s text) into the setting, raising ValueError saying what it accepts."""

    help: str
    default: object = None
    env: str | None = None
    parse: Callable[[object], object] = word


def one_of(*allowed: str) -> Callable[[object], str]:
    """An Option parser taking one of `allowed`."""

    def parse(value: object) -> str:
        if value not in allowed:
            raise ValueError(f"one of {', '.join(map(repr, allowed))}")
        return str(value)

    return parse


def positive(kind: type) -> Callable[[object], float]:
    """An Option parser taking a number > 0 (or its text), made a `kind` (int or float)."""

    def parse(value: object) -> float:
        try:
            number = kind(value)
        except (TypeError, ValueError, OverflowError):  # (int(inf) overflows)
            number = 0
        truncated = kind is int and isinstance(value, float) and value != number
        if isinstance(value, (bool, bytes)) or truncated or not 0 < number < math.inf:
            raise ValueError(f"a finite positive {'integer' if kind is int else 'number'}")
        return number

    return parse


class EngineTransport(Transport):
    """A transport with one engine per process, made by `make_engine(settings)` when the
    transport is first used, from its options: each one given to `configure`, else its
    environment variable, else its default."""

    #: The settings it takes, by name (Transport.configure).
    options: ClassVar[Mapping[str, Option]] = {}

    def __init__(self):
        self._given: dict[str, object] = {}
        self._engine = None
        self._settings: dict[str, object] | None = None
        self._lock = threading.Lock()

    def make_engine(self, settings: dict[str, object]):
        """The process's engine, from every option's value."""
        raise NotImplementedError

    def configure(self, **values: object) -> None:
        given = {key: self._parse(key, value) for key, value in values.items()}
        with self._lock:
            if self._settings is not None:
                changed = {k: v for k, v in given.items() if self._settings[k] != v}
                if changed:
                    made = ", ".join(f"{k}={self._settings[k]!r}" for k in changed)
                    asked = ", ".join(f"{k}={v!r}" for k, v in changed.items())
                    raise InvalidArgumentError(
                        f"transport {self.name!r} is in use already with {made}: configure it "
                        f"before its first endpoint or link (asked now: {asked})"
                    )
                return
            self._given.update(given)

    def settings(self) -> dict[str, object]:
        """Every option's value: as configured, else from its environment variable, else
        its default (InvalidArgumentError naming a variable that holds a wrong value)."""
        out = {}
        for key, option in self.options.items():
            if key in self._given:
                out[key] = self._given[key]
            elif option.env and os.environ.get(option.env):
                raw = os.environ[option.env]
                try:
                    out[key] = option.parse(raw)
                except ValueError as e:
                    raise InvalidArgumentError(
                        f"{option.env}={raw!r}: transport {self.name!r} takes {e} there "
                        f"(its option {key!r})"
                    ) from None
            else:
                out[key] = option.default
        return out

    def engine(self):
        """The process's engine, made on the first call."""
        with self._lock:
            if self._engine is None:
                settings = self.settings()
                self._engine = self.make_engine(settings)
                self._settings = settings
            return self._engine

    def _parse(self, key: str, value: object) -> object:
        option = self.options.get(key)
        if option is None:
            known = ", ".join(sorted(self.options)) or "none"
            raise InvalidArgumentError(
                f"transport {self.name!r} has no option {key!r} (its options: {known})"
            )
        try:
            return option.parse(value)
        except ValueError as e:
            raise InvalidArgumentError(
                f"transport {self.name!r} option {key}={value!r}: it takes {e}"
            ) from None


class Registrations:
    """Memory registered with an engine, reference-counted: a range inside one registered
    already counts as another user of that one, and the last user's release unregisters
    it. `register(address, nbytes)` registers (TransferError if the engine refuses) and
    returns what `unregister(address, token)` needs."""

    def __init__(
        self,
        register: Callable[[int, int], object],
        unregister: Callable[[int, object], None],
    ):
        self._register, self._unregister = register, unregister
        self._held: dict[int, list] = {}  # start -> [bytes, users, token]
        self._lock = threading.Lock()

    def add(self, address: int, nbytes: int) -> int:
        """Register [address, +nbytes) for one more user; the key to release() it with."""
        with self._lock:
            for start, entry in self._held.items():
                if start <= address and address + nbytes <= start + entry[0]:
                    entry[1] += 1
                    return start
            self._held[address] = [nbytes, 1, self._register(address, nbytes)]
            return address

    def release(self, key: int) -> None:
        """One user less of the registration `key`; unregistered with its last.
        InvalidArgumentError for a key not held: released more often than added, which
        would otherwise take the count of another user of it and unregister its memory
        under it."""
        with self._lock:
            entry = self._held.get(key)
            if entry is None:
                raise InvalidArgumentError(
                    f"no registration is held at {key!r}: released more often than added "
                    f"(each add() is released once, with the key it returned)"
                )
            entry[1] -= 1
            if entry[1] == 0:
                del self._held[key]
                self._unregister(key, entry[2])


class LatchedLink(Link):
    """A link that keeps the first failure its engine reported: problem() says it from then
    on, and submit() refuses (refuse_if_failed)."""

    #: The destination, as failures name it.
    target: str = ""
    _failure: str | None = None

    def failed(self, why: str) -> str:
        """Latch `why` (the first failure stays) and return it."""
        if self._failure is None:
            self._failure = why
        return why

    def problem(self) -> str | None:
        return self._failure

    def refuse_if_failed(self) -> None:
        if self._failure is not None:
            raise TransferError(self._failure)


class LandedBatch(Batch):
    """A batch with nothing in flight: a submit of no runs, or one done when made."""

    def done(self) -> bool:
        return True

    def wait(self, timeout: float) -> None:
        return None


class BatchState(enum.Enum):
    IN_FLIGHT = "in flight"
    LANDED = "landed"
    FAILED = "failed"


class PollingBatch(Batch):
    """The runs of one submit to a LatchedLink, their state asked of the engine (`poll`).
    A failure the engine reports fails the link too; a wait that runs out fails only this
    batch (a stall may pass: the link stays usable) and calls `abandon`."""

    def __init__(self, link: LatchedLink, nbytes: int):
        self.link, self.nbytes = link, nbytes
        self._state = BatchState.IN_FLIGHT
        self._failure = ""
        self._lock = threading.Lock()

    def poll(self) -> tuple[BatchState, str]:
        """The engine's word on these runs now, and when FAILED why (e.g. "failed (3)")."""
        raise NotImplementedError

    def abandon(self) -> None:
        """The caller stopped waiting on runs still in flight (drop or park them)."""

    def done(self) -> bool:
        with self._lock:
            if self._state is BatchState.IN_FLIGHT:
                state, why = self.poll()
                if state is BatchState.FAILED:
                    self._failure = self.link.failed(
                        f"a write of {self.nbytes} bytes to {self.link.target} {why}"
                    )
                self._state = state
            if self._state is BatchState.FAILED:
                raise TransferError(self._failure)
            return self._state is BatchState.LANDED

    def wait(self, timeout: float) -> None:
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout >= 0:
            raise InvalidArgumentError(f"timeout must be a number of seconds >= 0, got {timeout!r}")
        if nap_until(self.done, time.monotonic() + timeout):
            return
        with self._lock:
            if self._state is BatchState.IN_FLIGHT:
                self.abandon()
                self._state = BatchState.FAILED
                self._failure = (
                    f"a write of {self.nbytes} bytes to {self.link.target} did not land "
                    f"within {timeout:.3g} s: the link or the destination is gone or stalled"
                )
        self.done()  # raises the failure (or returns: it landed just now)
