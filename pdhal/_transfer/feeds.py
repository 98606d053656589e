"""From a signal mode's words to KVStreamer.layer_ready calls: what each mode's reader says,
and which requests a step held, become "layer L now holds T tokens of request R".

Per query, the reader gives the newest (step, layer) and the engine says which requests
each step computed; every layer up to the newest is sent, older steps whole, each layer
once, whichever comes first (the step's table or its signal). Per chunk, each record names
the batch slots a layer advanced; the engine says which request held each slot that step."""

from __future__ import annotations

import time

from pdhal._errors import InvalidArgumentError
from pdhal._transfer.checks import LARGEST, LATEST_NS, integer, name
from pdhal._transfer.streamer import KVStreamer

#: The largest signal time accepted (time.monotonic_ns() of any machine's uptime fits).


def _signal_ns(signal_ns: object) -> int:
    """`signal_ns` as when the signal was seen (time.monotonic_ns()); None: now."""
    if signal_ns is None:
        return time.monotonic_ns()
    return integer(signal_ns, "signal_ns", 0, LATEST_NS)


def _pair(value: object, what: str) -> tuple:
    """`value` as the two items of a pair (a tuple or a list, not a str)."""
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise InvalidArgumentError(f"{what} must be a pair, got {value!r}")
    return value[0], value[1]


class PerQueryFeed:
    """Drive `streamer` from a per-query channel: step() each step's requests, progress()
    each (step, layer) a ProgressReader's wait returns."""

    def __init__(self, streamer: KVStreamer):
        self.streamer = streamer
        self._layers = streamer.layout.num_layers
        self._tables: dict[int, list] = {}  # step -> [(request, tokens) ..., last layer sent]
        self._seen = (-1, -1)
        self._signal_ns = 0

    def step(self, step: int, requests) -> None:
        """Step `step` computed `requests`: (request_id, tokens in the cache after it).
        Checked here, whole (an int step, each request id a non-empty str, each tokens an
        int >= 1, as layer_ready takes them): a table refused is not kept, so no table is
        kept that every later layer signal would fail on."""
        step = integer(step, "step")
        if isinstance(requests, (str, bytes, dict)) or not hasattr(requests, "__iter__"):
            raise InvalidArgumentError(
                f"requests must be a list of (request_id, tokens) pairs, got {requests!r}"
            )
        table = []
        for index, pair in enumerate(requests):
            request_id, tokens = _pair(pair, f"requests[{index}] (request_id, tokens)")
            table.append(
                (
                    name(request_id, f"requests[{index}]'s request id"),
                    integer(tokens, f"requests[{index}]'s tokens", 1),
                )
            )
        if step in self._tables:
            raise InvalidArgumentError(f"step {step}'s requests were given already")
        self._tables[step] = [table, -1]
        self._apply()

    def progress(self, seen: tuple[int, int], signal_ns: int | None = None) -> None:
        """The reader saw (step, layer) (layer -1: none of that step's yet): send every
        layer it covers."""
        step, layer = _pair(seen, "seen (step, layer)")
        seen = (integer(step, "seen's step"), integer(layer, "seen's layer", -1, self._layers - 1))
        self._signal_ns = _signal_ns(signal_ns)
        self._seen = max(self._seen, seen)
        self._apply()

    def _apply(self) -> None:
        last = self._layers - 1
        for step in sorted(self._tables):
            if step > self._seen[0]:
                break
            table = self._tables[step]
            upto = self._seen[1] if step == self._seen[0] else last
            for layer in range(table[1] + 1, upto + 1):
                self.streamer.layer_ready(layer, table[0], self._signal_ns, step=step)
            table[1] = max(table[1], upto)
            if table[1] == last:
                del self._tables[step]


class PerChunkFeed:
    """Drive `streamer` from a per-chunk channel: slots() each step's batch slots, record()
    each record a ChunkReader's next() fills."""

    def __init__(self, streamer: KVStreamer):
        self.streamer = streamer
        self._holders: dict[int, dict[int, str]] = {}

    def slots(self, step: int, holders: dict[int, str]) -> None:
        """Which request held each batch slot in step `step` ({slot: request_id}: int
        slots >= 0, non-empty str ids), checked here."""
        step = integer(step, "step")
        if not isinstance(holders, dict):
            raise InvalidArgumentError(
                f"holders must be a dict {{slot: request_id}}, got {holders!r}"
            )
        self._holders[step] = {
            integer(slot, "holders' slot"): name(request_id, f"holders[{slot!r}]")
            for slot, request_id in holders.items()
        }

    def record(self, step: int, record, signal_ns: int | None = None) -> None:
        """A record of step `step`: [count, layer, (slot, cached tokens, chunk tokens) *
        count] (a list, or the int32 array a ChunkReader fills); its layer now holds cached
        + chunk tokens of each slot's request. The whole record is checked before anything
        is sent."""
        step = integer(step, "step")
        signal_ns = _signal_ns(signal_ns)
        holders = self._holders.get(step)
        if holders is None:
            raise InvalidArgumentError(f"step {step}'s slots were not given (slots())")
        if (
            isinstance(record, (str, bytes, dict))
            or not hasattr(record, "__len__")
            or not hasattr(record, "__getitem__")
            or getattr(record, "ndim", 1) != 1
            or len(record) < 2
        ):
            raise InvalidArgumentError(
                f"record must be [count, layer, (slot, cached, chunk) * count], got {record!r}"
            )
        room = (len(record) - 2) // 3
        count = integer(
            record[0], f"record[0] (the count: the record has room for {room})", 0, room
        )
        layer = integer(record[1], "record[1] (the layer)", 0, self.streamer.layout.num_layers - 1)
        ready = []
        for i in range(count):
            slot, cached, length = (
                integer(record[2 + 3 * i + k], f"record[{2 + 3 * i + k}] ({what} {i})")
                for k, what in enumerate(("slot", "cached tokens", "chunk tokens"))
            )
            if slot not in holders:
                raise InvalidArgumentError(f"step {step} names slot {slot}, which held no request")
            if cached + length > LARGEST:
                raise InvalidArgumentError(
                    f"record slot {i}: {cached} + {length} tokens is more than {LARGEST}"
                )
            ready.append((holders[slot], cached + length))
        self.streamer.layer_ready(layer, ready, signal_ns, step=step)
        if layer == self.streamer.layout.num_layers - 1:
            del self._holders[step]
