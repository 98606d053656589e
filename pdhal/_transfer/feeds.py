"""From a signal mode's words to KVStreamer.layer_ready calls: what each mode's reader says,
and which requests a step held, become "layer L now holds T tokens of request R".

Per query, the reader gives the newest (step, layer) and the engine says which requests
each step computed; every layer up to the newest is sent, older steps whole, each layer
once, whichever comes first (the step's table or its signal). Per chunk, each record names
the batch slots a layer advanced; the engine says which request held each slot that step."""

from __future__ import annotations

import time

from pdhal._errors import InvalidArgumentError
from pdhal._transfer.streamer import KVStreamer


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
        """Step `step` computed `requests`: (request_id, tokens in the cache after it)."""
        if step in self._tables:
            raise InvalidArgumentError(f"step {step}'s requests were given already")
        self._tables[step] = [list(requests), -1]
        self._apply()

    def progress(self, seen: tuple[int, int], signal_ns: int | None = None) -> None:
        """The reader saw (step, layer): send every layer it covers."""
        self._signal_ns = time.monotonic_ns() if signal_ns is None else signal_ns
        self._seen = max(self._seen, (int(seen[0]), int(seen[1])))
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
        """Which request held each batch slot in step `step` ({slot: request_id})."""
        self._holders[step] = dict(holders)

    def record(self, step: int, record, signal_ns: int | None = None) -> None:
        """A record of step `step`: [count, layer, (slot, cached tokens, chunk tokens) *
        count]; its layer now holds cached + chunk tokens of each slot's request."""
        holders = self._holders.get(step)
        if holders is None:
            raise InvalidArgumentError(f"step {step}'s slots were not given (slots())")
        count, layer = int(record[0]), int(record[1])
        ready = []
        for i in range(count):
            slot, cached, length = (int(record[2 + 3 * i + k]) for k in range(3))
            if slot not in holders:
                raise InvalidArgumentError(f"step {step} names slot {slot}, which held no request")
            ready.append((holders[slot], cached + length))
        self.streamer.layer_ready(layer, ready, signal_ns, step=step)
        if layer == self.streamer.layout.num_layers - 1:
            del self._holders[step]
