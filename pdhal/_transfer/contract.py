"""The transport contract: what moves a transfer's bytes between two processes' memory.

A transport plugin returns a Transport (entry-point group `pdhal.transports`, hook
`pdhal_transport`). The destination side makes its memory reachable (`endpoint`) and hands
the source side the endpoint's `describe()` (JSON-able); the source side opens a Link to it
(`connect`) and submits runs, each (source address, destination region, offset in that
region, bytes). A Batch is one submit: it completes, or fails with the reason, exactly once.
A transport declares how it knows a batch completed (Transport.completion): at the target,
the bytes in the destination's memory, or only locally; pdhal's "landed" needs the first
(require_target_completion). The transport conformance kit (`pytest --pdhal-transport
NAME`) checks every promise here, that one under load.
"""

from __future__ import annotations

import bisect
import operator
from dataclasses import dataclass
from typing import ClassVar

from pdhal._errors import InvalidArgumentError, TransferError
from pdhal._inputs.tensors import memory_ref
from pdhal._transfer.checks import ADDRESS_MAX, LARGEST, integer
from pdhal._transfer.layout import BlockRuns, LayerCopies

#: One copy: (source address, destination region index, byte offset in it, bytes).
Run = tuple[int, int, int, int]


def region_bytes(regions: list) -> list[int]:
    """The bytes of each region an endpoint serves (memory pdhal can name, with a size)."""
    sizes = [memory_ref(region, f"region {i}").nbytes for i, region in enumerate(regions)]
    if None in sizes:
        raise InvalidArgumentError("a region must be memory with a size (a tensor or buffer)")
    return sizes


def region_devices(regions: list) -> list[str]:
    """Where each region lives: "cpu", "gpu:0", "xpu:1", ... ("unknown" for a bare
    address), for a transport that registers host and device memory differently."""
    return [memory_ref(region, f"region {i}").device for i, region in enumerate(regions)]


class RunChecker:
    """What a Link's submit refuses before the first byte moves: a run that is not four
    ints (InvalidArgumentError naming the run and the field: anything with __index__ but a
    bool is an int, numpy integers included), of fewer than 1 byte or at a negative offset
    (the same), outside the destination's regions (`regions`: their bytes, from the peer's
    description: checked here, so a garbage description is refused at connect) or read from
    outside the memory the link was given to copy from (`sources`: (address, bytes)); those
    two are TransferErrors, as a peer that went away is."""

    def __init__(self, regions: list[int], sources: list[tuple[int, int]]):
        self.regions = _numbers(regions, "the destination's regions", "(its bytes)")
        spans = []
        if isinstance(sources, (str, bytes)) or not hasattr(sources, "__iter__"):
            raise InvalidArgumentError(
                f"sources must be a list of (address, bytes), got {sources!r}"
            )
        for index, span in enumerate(sources):
            what = f"sources[{index}]"
            if not isinstance(span, (tuple, list)) or len(span) != 2:
                raise InvalidArgumentError(f"{what} must be (address, bytes), got {span!r}")
            start = integer(span[0], f"{what}'s address", 0, ADDRESS_MAX)
            spans.append((start, start + integer(span[1], f"{what}'s bytes")))
        self._sources = sorted(spans)
        self._starts = [a for a, _ in self._sources]

    def spans(self) -> list[tuple[int, int]]:
        """The memory runs may be read from, as (address, bytes), checked."""
        return [(start, end - start) for start, end in self._sources]

    def check(self, runs: list[Run]) -> list[Run]:
        """`runs`, every field of every run checked; submit copies the runs this returns (a
        caller's numpy integers made ints, a caller's iterator read once)."""
        if type(runs) is not list and type(runs) is not tuple:
            if isinstance(runs, (str, bytes)) or not hasattr(runs, "__iter__"):
                raise InvalidArgumentError(f"runs must be a list of runs, got {runs!r}")
            runs = list(runs)
        sizes, starts, sources, count = self.regions, self._starts, self._sources, len(self.regions)
        is_int, kind = int, type  # locals: this loop is on the per-layer path
        low = high = 0  # the source range the last run was in: runs come grouped by cache
        try:
            for src, region, offset, nbytes in runs:
                # plain ints in bounds, else the slow path names what is wrong (a bool is
                # refused there: the type is compared, not isinstance)
                if not (
                    kind(src) is is_int
                    and kind(region) is is_int
                    and kind(offset) is is_int
                    and kind(nbytes) is is_int
                    and 0 <= region < count
                    and 0 <= offset
                    and 0 < nbytes
                    and offset + nbytes <= sizes[region]
                ):
                    break
                if not (low <= src and src + nbytes <= high):
                    at = bisect.bisect_right(starts, src) - 1
                    low, high = sources[at] if at >= 0 else (0, 0)
                    if not low <= src or src + nbytes > high:
                        break
            else:
                return runs
        except (TypeError, ValueError):  # a run that is not four values
            pass
        return self._checked(runs)

    def _checked(self, runs: list | tuple) -> list[Run]:
        """The slow path: `runs` as plain ints (numpy's integers made ints), or the first
        wrong field named (checks.integer)."""
        sizes, out = self.regions, []
        for index, run in enumerate(runs):
            if not isinstance(run, (tuple, list)) or len(run) != 4:
                raise InvalidArgumentError(
                    f"run {index} must be (source address, region, offset, bytes), got {run!r}"
                )
            fields = []
            for value, field, low, high in zip(run, _FIELDS, _LOWS, _HIGHS):
                if type(value) is not int and type(value) is not bool:
                    try:  # numpy's integers, without building a name for each
                        value = operator.index(value)
                    except TypeError:
                        pass  # named below
                if type(value) is not int or not low <= value <= high:
                    value = integer(value, f"run {index}'s {field}", low, high)
                fields.append(value)
            src, region, offset, nbytes = fields
            if region >= len(sizes) or offset + nbytes > sizes[region]:
                raise TransferError(
                    f"run {index}, of {nbytes} bytes at offset {offset} of region {region}, "
                    f"is outside the destination ({len(sizes)} regions of {sizes} bytes)"
                )
            at = bisect.bisect_right(self._starts, src) - 1
            first, end = self._sources[at] if at >= 0 else (0, 0)
            if not first <= src or src + nbytes > end:
                raise TransferError(
                    f"run {index}'s source [{src:#x}, +{nbytes}) is outside the memory this "
                    f"link was given to copy from"
                )
            out.append((src, region, offset, nbytes))
        return out


#: A run's fields, as _checked names them, and the least and most each may be.
_FIELDS = ("source address", "region", "offset", "bytes")
_LOWS = (0, 0, 0, 1)
_HIGHS = (ADDRESS_MAX, LARGEST, LARGEST, LARGEST)


def described_numbers(described: dict, key: str, count: int | None = None) -> list[int]:
    """The ints listed under `key` in a peer's description (region addresses or sizes),
    `count` of them where given: InvalidArgumentError naming the key otherwise."""
    values = _numbers(described.get(key), f"the description's {key}", "", ADDRESS_MAX)
    if count is not None and len(values) != count:
        raise InvalidArgumentError(
            f"the description's {key} lists {len(values)} values for {count} regions"
        )
    return values


def _numbers(values: object, what: str, each: str = "", high: int = LARGEST) -> list[int]:
    if not isinstance(values, (list, tuple)):
        raise InvalidArgumentError(f"{what} must be a list of ints, got {values!r}")
    return [
        integer(v, f"{what}[{i}]{' ' + each if each else ''}", 0, high)
        for i, v in enumerate(values)
    ]


class Batch:
    """The runs of one submit, in flight."""

    def done(self) -> bool:
        """True once every run landed; False while in flight. Raises TransferError (with
        the reason) once it failed."""
        raise NotImplementedError

    def wait(self, timeout: float) -> None:
        """Return once every run landed; TransferError if it failed, or is still in flight
        after `timeout` seconds (a stalled peer or link)."""
        raise NotImplementedError

    def started_ns(self) -> int:
        """When its copies started (gated: when the link saw the signal), as
        time.monotonic_ns(); 0 while not, or if the transport does not say."""
        return 0

    def cancel(self) -> None:
        """Give a gated batch up: unless its copies started, it fails without waiting for
        its signal, and they never start. Nothing for any other."""


@dataclass(frozen=True)
class Gate:
    """The engine's layer signal a gated submit waits for (Link.submit_blocks)."""

    signals: object  # the per-query channel's segment (ProgressReader.segment)
    until: int  # the progress word of that layer of that step (step, layer + 1 packed)
    timeout: float  # seconds, from when the link reaches it

    def came(self) -> bool:
        """Whether the engine signalled it (the layer is in the caches, whole), whether or
        not the link saw it yet."""
        return self.signals.progress() >= self.until


class Link:
    """The source side's connection to one endpoint."""

    #: The endpoint's regions, as many as it described (their bytes).
    regions: list[int]
    #: The kind of memory ("cpu", "gpu", ...) each region is, where the link can tell
    #: (shm and ipc map the regions); None where it cannot. The streamer compares it with
    #: what the destination's description claims (require_claimed_kinds).
    region_kinds: list[str] | None = None

    def submit(self, runs: list[Run]) -> Batch:
        """Start the copies; InvalidArgumentError for a run that is not four ints, of at
        least 1 byte, at an offset >= 0 (naming the run and the field); TransferError if they
        cannot be started (a dead peer, a run outside a region or outside the memory
        registered on this side). Either before the first byte moves: a RunChecker's
        check(runs), whose runs (plain ints) are the ones to copy. Runs in flight
        together (of one submit, or of submits not yet landed) must not overlap in the
        destination: the order they land in is the transport's. A submit made after
        another landed lands after it."""
        raise NotImplementedError

    def submit_blocks(self, layer: LayerCopies, runs: BlockRuns, gate: Gate | None = None) -> Batch:
        """Start the copies of block `runs` in one `layer` of the destination's caches, as
        submit(layer.copies(runs.runs)) does (what this default does); a transport may
        expand and check them itself instead (shm does, in C: no Python per run).
        InvalidArgumentError unless `layer` is a LayerCopies and `runs` a BlockRuns.

        `gate` (only where Transport.gates says so): the copies wait on the link for the
        engine's layer signal the Gate names and start at it, with nothing of the caller's
        in between; the batch's started_ns() says when, and cancel() gives them up unless
        they started. If the signal does not come within the gate's timeout of the link
        reaching it, or the link closes first, the batch fails with its copies unstarted
        (started_ns() 0), and the submits after it go on."""
        require_blocks(layer, runs)
        if gate is not None:
            raise InvalidArgumentError(f"this link does not gate (Transport.gates): {gate!r}")
        return self.submit(layer.copies(runs.runs))

    def problem(self) -> str | None:
        """None while the peer looks alive; else why not (checked before each submit)."""
        return None

    def close(self) -> None:
        """Forget the peer; batches still in flight may fail."""


def require_blocks(layer: object, runs: object) -> None:
    """Refuse a submit_blocks of anything but a LayerCopies and a BlockRuns (each checks its
    fields when made), naming the one that is not (InvalidArgumentError)."""
    for value, kind, what in ((layer, LayerCopies, "layer"), (runs, BlockRuns, "runs")):
        if not isinstance(value, kind):
            raise InvalidArgumentError(
                f"submit_blocks' {what} must be a {kind.__name__}, got {value!r}"
            )


class Endpoint:
    """The destination side: its regions, reachable by the transport's links."""

    def describe(self) -> dict:
        """What a source side needs to connect (JSON-able; "transport" names this one)."""
        raise NotImplementedError

    def close(self) -> None:
        """Make the regions unreachable again."""


class Transport:
    """Moves bytes between processes. One per process and name (`pdhal.transfer.transport`)."""

    #: The name plugins register under ("shm", "mooncake", ...).
    name: ClassVar[str] = ""
    #: How a Batch knows it is done, one of COMPLETIONS. "target": only once every byte of
    #: its runs is in the destination's memory, so that a run submitted after it is done (the
    #: streamer's "landed" word) cannot be read there before them. "local": once this side
    #: handed the bytes on (a socket's buffer, a send queue), which they may still be in.
    #: A transport that does not say is taken at the weaker word: "local", which the
    #: streamer refuses (require_target_completion); the transport kit proves "target"
    #: under load.
    completion: ClassVar[str] = "local"
    #: The kinds of memory ("cpu", "gpu", "xpu": a device's name before its ":") its
    #: endpoints serve and its links copy from; None: it does not say (nothing is checked).
    memory: ClassVar[tuple[str, ...] | None] = None
    #: The (source kind, destination kind) pairs it moves between, where that is not every
    #: pair of its `memory` kinds (one vendor's device memory into another's only through
    #: registered host memory, say); None: every pair. Checked when a destination is
    #: connected, which a session does at the decode side's hello (refused naming both).
    pairs: ClassVar[tuple[tuple[str, str], ...] | None] = None
    #: Its version ("" if it does not say): a session's hello refuses two sides whose
    #: transports differ in it (their wire formats may).
    version: ClassVar[str] = ""
    #: True when a Link's submit only queues the copies (for a thread that is not the
    #: caller's) and returns at once: the streamer then submits on the caller's thread,
    #: not handing each write to a thread of its own first. False (the default): a submit
    #: may take its time, and runs on the destination's submitting thread.
    posts: ClassVar[bool] = False
    #: True when its links can hold a submit until an engine's layer signal
    #: (Link.submit_blocks' gate), which KVStreamer.follow needs: the signal then starts
    #: the copies without a Python call per layer. A gated submit only queues (as `posts`)
    #: and holds up no other submit of its link. False (the default): the messager calls
    #: layer_ready per signal.
    gates: ClassVar[bool] = False
    #: True when its connect takes each source as (address, bytes, kind of memory: "cpu",
    #: "gpu", "xpu"), for links whose copy depends on its direction (a runtime's copy
    #: between device and host memory); False (the default): as (address, bytes).
    source_kinds: ClassVar[bool] = False

    def configure(self, **options: object) -> None:
        """Set the transport's options (each plugin documents its own: an address to
        advertise, a protocol) before its first endpoint or link; InvalidArgumentError for
        one it does not take or a value it refuses, naming it. Takes none by default."""
        if options:
            raise InvalidArgumentError(
                f"transport {self.name!r} takes no options, got {', '.join(sorted(options))}"
            )

    def endpoint(self, regions: list, name: str) -> Endpoint:
        """Make `regions` (memory objects pdhal knows: tensors, host buffers) reachable
        under `name` (unique on this host)."""
        raise NotImplementedError

    def connect(self, described: dict, sources: list[tuple[int, int]]) -> Link:
        """A Link to the endpoint `described`, copying from `sources` ((address, bytes) of
        this side's memory, registered with the transport here; (address, bytes, kind)
        where the transport's source_kinds says so)."""
        raise NotImplementedError


def require_memory(transport: Transport, regions: list, what: str) -> None:
    """Refuse `regions` (memory objects) of a kind `transport` does not move, naming the
    first (InvalidArgumentError): shm's memmove from device memory would crash."""
    kinds = getattr(transport, "memory", None)
    if kinds is None:
        return
    for index, device in enumerate(region_devices(regions)):
        if device.split(":")[0] not in kinds:
            raise InvalidArgumentError(
                f"{what} region {index} is {device} memory; transport {transport.name!r} moves "
                f"{', '.join(kinds)} memory only"
            )


def moves(transport: Transport, source: str, destination: str) -> bool:
    """Whether `transport` moves `source` memory into `destination` memory (kinds)."""
    if transport.pairs is not None:
        return (source, destination) in transport.pairs
    return transport.memory is None or (
        source in transport.memory and destination in transport.memory
    )


def require_claimed_kinds(link: Link, claimed: list[str] | None) -> None:
    """Refuse a link whose destination regions are not the kinds of memory the
    destination's description claims (`claimed`, checked by require_pairs: one per region
    of its layout), naming the first (InvalidArgumentError), where the link can tell: a
    pair refused at connect must not pass on a false claim and fail at the first submit."""
    real = link.region_kinds
    if real is None or claimed is None:
        return
    for index, (kind, mapped) in enumerate(zip(claimed, real)):
        if kind != mapped:
            raise InvalidArgumentError(
                f"the destination's region {index} is said to be {kind} memory, but what the "
                f"link maps there is {mapped} memory: its description does not match its memory"
            )


def require_pairs(transport: Transport, here: list[str], there: object, regions: int) -> None:
    """Refuse a destination whose memory kinds (`there`, from its description: untrusted,
    one per region of its `regions`) `transport` does not move this side's (`here`) into,
    naming both kinds (InvalidArgumentError); a description that does not say (None) is
    not checked."""
    if there is None:
        return
    if (
        not isinstance(there, list)
        or len(there) != regions
        or not all(
            isinstance(kind, str) and 0 < len(kind) <= 64 and kind.isprintable() for kind in there
        )
    ):
        raise InvalidArgumentError(
            f"the destination's memory must be a list of {regions} memory kinds, one per "
            f"region, got {there!r}"
        )
    for source in dict.fromkeys(here):
        for destination in dict.fromkeys(there):
            if not moves(transport, source, destination):
                said = (
                    ", ".join(f"{s} to {d}" for s, d in transport.pairs)
                    if transport.pairs is not None
                    else f"{', '.join(transport.memory)} memory only"
                )
                raise InvalidArgumentError(
                    f"this side's caches are {source} memory and the destination's "
                    f"{destination} memory: transport {transport.name!r} moves {said or 'none'}"
                )


#: The values of Transport.completion, the promise first.
COMPLETIONS = ("target", "local")


def require_target_completion(transport: Transport) -> None:
    """Refuse a transport whose batches are done before their bytes are in the
    destination's memory (TransferError naming it and what it declares): a word written
    once they are done, as "landed" is, could be read there before the bytes."""
    declared = getattr(transport, "completion", None)
    if declared == "target":
        return
    name = getattr(transport, "name", "") or type(transport).__qualname__
    why = (
        "reports a batch done once it is handed on here, before its bytes are in the "
        "destination's memory"
        if declared == "local"
        else f"does not declare one of {', '.join(map(repr, COMPLETIONS))}"
    )
    raise TransferError(
        f"transport {name!r} declares completion {declared!r} (Transport.completion): it "
        f"{why}, so a 'landed' word written after a batch is done could be read before the "
        f"batch's bytes; use a transport whose completion is 'target' (shm's is), or make "
        f"{name!r} know completion at the target and declare it"
    )
