"""Progress signals between a model worker and its cache messager, on every backend.

Per query: one (step, layer) word per (namespace, rank, device). Per chunk: a ring of steps,
each with its table of prefill requests, delivered to the messager as int32 records.
Backends differ only in *when* a LayerSignal is stored (see each backend's
signal_layer_ready); everything here is shared.
"""

from __future__ import annotations

import array
import atexit
import errno
import os
import threading
import time

from pdhal._errors import (
    InvalidArgumentError,
    InvalidTypeError,
    ProducerDiedError,
    SegmentError,
)
from pdhal._inputs.tensors import int_list, memory_ref, writable_int32
from pdhal._protocol import core as _core
from pdhal._protocol import names as _names

_NO_LAYER = -1
#: The longest spin a wait accepts, in microseconds: longer is a poll loop, not a spin.
MAX_SPIN_US = 1_000_000


class LayerSignal:
    """ "Layer `layer` of step `step` is in the cache": what signal_layer_ready publishes."""

    __slots__ = ("segment", "slot", "value", "step", "layer")

    def __init__(self, segment: _core.Segment | None, slot: int, step: int, layer: int):
        self.segment = segment  # None: a step with nothing to report (no prefill request)
        self.slot = slot
        self.step = step
        self.layer = layer
        self.value = _core.pack_progress(step, layer)

    def publish(self) -> None:
        """Store the signal now (for backends whose work is already complete)."""
        if self.segment is not None:
            self.segment.publish(self.slot, self.value)

    def new_store(self):
        """A C pending store of this signal, for a device callback (None for a no-op)."""
        return None if self.segment is None else self.segment.new_store(self.slot, self.value)

    @property
    def kernel_form(self) -> array.array:
        """This signal as PDHAL_KERNEL_WORDS int64 words, for a device op that posts it
        through pdhal.h (pdhal_signal_store): the words name the channel, never point at it.
        Hand the op a tensor over them (numpy.frombuffer, paddle.to_tensor); the op reads
        them during its launch only."""
        if self.segment is None:
            return array.array("q", [_core.KERNEL_NOOP, 0, 0, 0])
        return array.array(
            "q", [_core.KERNEL_SIGNAL, self.segment.kernel_id(), self.slot, self.value]
        )

    def __repr__(self) -> str:
        return f"LayerSignal(step={self.step}, layer={self.layer})"


class KernelSignal:
    """A layer signal handed back in its kernel form (an engine passes the int64 words it
    gave its op): posted like a LayerSignal, by the same backends."""

    __slots__ = ("words", "segment")

    def __init__(self, words):
        self.words = words  # an int64_t[PDHAL_KERNEL_WORDS] copy
        #: None for a no-op signal, as LayerSignal.segment (backends skip those)
        self.segment = None if words[0] == _core.KERNEL_NOOP else self

    def new_store(self):
        return _core.kernel_store(self.words)

    def publish(self) -> None:
        _core.run_store(self.new_store())


def kernel_signal(obj: object) -> KernelSignal:
    """The KernelSignal of `obj`, the kernel form of a layer signal (4 int64 words in a
    tensor, array or buffer); a pdhal error when it is none."""
    ref = memory_ref(obj, "signal")
    if (
        ref.dtype not in ("int64", None)
        or ref.nbytes != 8 * _core.KERNEL_WORDS
        or ref.device not in ("cpu", "unknown")
    ):
        raise InvalidArgumentError(
            f"a signal in kernel form is {_core.KERNEL_WORDS} int64 words in CPU memory, got "
            f"{ref.nbytes} bytes of {ref.dtype} on {ref.device}"
        )
    words = _core.ffi.new("int64_t[]", _core.KERNEL_WORDS)
    _core.ffi.memmove(words, _core.ffi.cast("int64_t *", ref.address), 8 * _core.KERNEL_WORDS)
    if words[0] not in (_core.KERNEL_SIGNAL, _core.KERNEL_NOOP):
        raise InvalidArgumentError(
            f"these words are not a layer signal's kernel form (tag {words[0]:#x})"
        )
    return KernelSignal(words)


class SignalMeta:
    """The per-query channel of one forward pass: which step the layers belong to."""

    __slots__ = ("segment", "step", "rank", "device_id")

    def __init__(self, segment: _core.Segment, step: int, rank: int, device_id: int):
        self.segment = segment
        self.step = step
        self.rank = rank
        self.device_id = device_id

    def reader_alive(self) -> bool:
        """Whether a cache messager has this channel open now (a ProgressReader, in any
        process): a producer that streams into a channel nobody reads can say so."""
        return self.segment.reader_attached()

    def __repr__(self) -> str:
        return f"SignalMeta(rank={self.rank}, device_id={self.device_id}, step={self.step})"


class ChunkSignal:
    """One step's request table in per-chunk mode; `layer(i)` is the signal of layer i."""

    __slots__ = ("segment", "step", "num_layers", "requests", "_slot")

    def __init__(
        self,
        segment: _core.Segment | None,
        step: int,
        num_layers: int,
        requests: list[tuple[int, int, int]],
    ):
        self.segment = segment
        self.step = step
        self.num_layers = num_layers
        self.requests = requests  # (batch slot, tokens cached before, tokens in this chunk)
        self._slot = step % segment.ring_slots if segment is not None else 0

    def layer(self, layer_id: int) -> LayerSignal:
        layer_id = _names.validate_index(layer_id, "layer_id", self.num_layers)
        return LayerSignal(self.segment, self._slot, self.step, layer_id)

    def __repr__(self) -> str:
        return f"ChunkSignal(step={self.step}, requests={len(self.requests)})"


# ---- producer side -------------------------------------------------------------------

_producers: dict[tuple[int, str], _core.Segment] = {}
_producers_lock = threading.Lock()


def _producer_channel(kind: str, rank: int, device_id: int) -> _core.Segment:
    path = _names.channel_path(kind, rank, device_id)
    key = (os.getpid(), path)  # a forked child must create its own, never reuse ours
    with _producers_lock:
        seg = _producers.get(key)
        if seg is None or seg.closed:
            code = _core.KIND_QUERY if kind == "query" else _core.KIND_CHUNK
            seg = _producers[key] = _core.Segment.create(path, code)
        return seg


@atexit.register
def close_producer_channels() -> None:
    """Close (and unlink) every channel this process produces; runs at exit."""
    with _producers_lock:
        for seg in _producers.values():
            seg.close()
        _producers.clear()


def open_shm_and_get_meta_signal(
    rank: int, device_id: int = 0, keep_pd_step_flag: bool = False
) -> SignalMeta:
    """Open (or create) this rank/device's per-query channel and start a new step.

    With keep_pd_step_flag (a draft/MTP model sharing the main model's step) the step and
    the layer already signalled are left as they are.
    """
    seg = _producer_channel("query", rank, device_id)
    if keep_pd_step_flag:
        step, _ = _core.unpack_progress(seg.progress())
    else:
        step = seg.begin_step()
    return SignalMeta(seg, step, rank, device_id)


def init_signal_layerwise(meta: SignalMeta, layer_id: int) -> LayerSignal:
    """The signal of `layer_id` (start-layer offset already added) in meta's step."""
    if not isinstance(meta, SignalMeta):
        raise InvalidTypeError(
            f"meta must be the SignalMeta from open_shm_and_get_meta_signal, got "
            f"{type(meta).__name__}"
        )
    layer_id = _names.validate_index(layer_id, "layer_id", _core.MAX_LAYER + 1)
    return LayerSignal(meta.segment, _core.QUERY_SLOT, meta.step, layer_id)


def backpressure_timeout() -> float:
    """Seconds a new per-chunk step waits for the messager (PDHAL_BACKPRESSURE_TIMEOUT)."""
    raw = os.environ.get("PDHAL_BACKPRESSURE_TIMEOUT", "60")
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise InvalidArgumentError(
            f"PDHAL_BACKPRESSURE_TIMEOUT must be a positive number of seconds, got {raw!r}"
        )
    return value


def init_kv_signal_per_query(
    seq_lens_encoder,
    seq_lens_this_time,
    seq_lens_decoder,
    rank: int,
    num_layers: int,
    device_id: int = 0,
) -> ChunkSignal:
    """Publish this step's table of prefill requests (per-chunk mode).

    For every batch slot with seq_lens_encoder > 0 the record holds (slot, tokens cached
    before this chunk = seq_lens_decoder, tokens in this chunk = seq_lens_encoder). A step
    without prefill requests publishes nothing and its layer signals are no-ops.
    """
    encoder = int_list(seq_lens_encoder, "seq_lens_encoder")
    this_time = int_list(seq_lens_this_time, "seq_lens_this_time")
    decoder = int_list(seq_lens_decoder, "seq_lens_decoder")
    if not len(encoder) == len(this_time) == len(decoder):
        raise InvalidArgumentError(
            f"seq_lens_encoder, seq_lens_this_time and seq_lens_decoder must have one entry per "
            f"batch slot, got lengths {len(encoder)}, {len(this_time)}, {len(decoder)}"
        )
    num_layers = _names.validate_index(num_layers, "num_layers", _core.MAX_LAYER + 2)
    if num_layers == 0:
        raise InvalidArgumentError("num_layers must be at least 1, got 0")
    path = _names.channel_path("chunk", rank, device_id)  # checked even for an empty step
    timeout = backpressure_timeout()
    requests = []
    for slot, (enc, dec) in enumerate(zip(encoder, decoder)):
        if enc < 0 or dec < 0:
            raise InvalidArgumentError(
                f"sequence lengths must be >= 0, got encoder {enc}, decoder {dec} at slot {slot}"
            )
        if enc > 0:
            requests.append((slot, dec, enc))
    if len(requests) > _core.MAX_REQUESTS:
        raise InvalidArgumentError(
            f"{len(requests)} prefill requests in one step, at most {_core.MAX_REQUESTS} fit"
        )
    if not requests:
        # a device op's "next layer" posts nothing this step (this channel's only)
        seg = _producers.get((os.getpid(), path))
        if seg is not None and not seg.closed:
            seg.clear_current_chunk()
        return ChunkSignal(None, 0, num_layers, requests)
    seg = _producer_channel("chunk", rank, device_id)
    table = [word for request in requests for word in request]
    step = seg.ring_begin_step(table, num_layers, timeout)  # and makes it the current step
    return ChunkSignal(seg, step, num_layers, requests)


# ---- consumer side -------------------------------------------------------------------


class ProgressReader:
    """The messager's view of a per-query channel: current() and wait().

    Safe to share between threads. While it is open the producer sees a reader attached
    (SignalMeta.reader_alive)."""

    def __init__(self, rank: int, device_id: int = 0, timeout: float | None = 60.0):
        """Open the channel of (rank, device_id), waiting up to `timeout` s for a live
        producer's channel (one left by a dead producer is waited past, for its successor)."""
        path = _names.channel_path("query", rank, device_id)
        self._segment = _core.Segment.open(
            path, _core.KIND_QUERY, timeout, _core.OPEN_LIVE_PRODUCER
        )
        self.rank = rank
        self.device_id = device_id

    def current(self) -> tuple[int, int]:
        """(step, layer) now; layer -1 while the step has no layer yet."""
        return _core.unpack_progress(self._segment.progress())

    def wait(
        self,
        since: tuple[int, int] = (0, _NO_LAYER),
        timeout: float | None = None,
        spin_us: int = 0,
    ) -> tuple[int, int]:
        """Block until progress passes `since` and return it.

        Spins `spin_us` microseconds (at most a second) before it sleeps: worth it only
        when layers come faster than the spin. Raises SignalTimeoutError after `timeout`
        seconds and ProducerDiedError (within a wait slice, 200 ms unless
        PDHAL_WAIT_SLICE_MS says) if the producer dies. Ctrl-C interrupts the wait (within a
        slice).
        """
        word = self._segment.wait(since_word(since), timeout, spin_ns(spin_us))
        return word >> _core.LAYER_BITS, (word & _core.LAYER_MASK) - 1

    def producer_alive(self) -> bool:
        return self._segment.producer_alive()

    @property
    def producer_pid(self) -> int:
        return self._segment.creator_pid

    def dup(self) -> ProgressReader:
        """Another reader of this channel, on the same mapping, closed on its own
        (Segment.dup): for whoever reads it after this one's owner closed it."""
        other = ProgressReader.__new__(ProgressReader)
        other._segment = self.segment.dup()
        other.rank, other.device_id = self.rank, self.device_id
        return other

    @property
    def segment(self) -> _core.Segment:
        """The channel's segment (for a link's gate: KVStreamer.follow); ClosedHandleError
        once the reader was closed."""
        self._segment.ptr  # noqa: B018 (raises once closed)
        return self._segment

    def close(self) -> None:
        self._segment.close()

    def __enter__(self) -> ProgressReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def since_word(since) -> int:
    """The progress word a wait must pass: `since` as (step, layer), layer -1 for none."""
    try:
        step, layer = since
        step, layer = step.__index__(), layer.__index__()
    except (AttributeError, TypeError, ValueError):
        raise InvalidArgumentError(
            f"since must be a (step, layer) pair of integers, got {since!r}"
        ) from None
    if not (0 <= step < 1 << (64 - _core.LAYER_BITS) and _NO_LAYER <= layer <= _core.MAX_LAYER):
        raise InvalidArgumentError(
            f"since must have 0 <= step < 2**{64 - _core.LAYER_BITS} and "
            f"-1 <= layer <= {_core.MAX_LAYER}, got {since!r}"
        )
    return _core.pack_progress(step, layer)


def spin_ns(spin_us) -> int:
    """`spin_us`, checked, in nanoseconds (the unit of the C waits)."""
    if type(spin_us) is int and spin_us == 0:  # the usual case, on the per-layer path
        return 0
    return _names.validate_index(spin_us, "spin_us", MAX_SPIN_US + 1) * 1000


def open_kv_signal_reader(
    rank: int, device_id: int = 0, timeout: float | None = 60.0
) -> ProgressReader:
    """Open the per-query progress of (rank, device_id) for reading."""
    return ProgressReader(rank, device_id, timeout)


class ChunkReader:
    """The single reader of a per-chunk channel: each (step, layer) once, in order.

    A step is finished once its last record was delivered and acknowledged: by ack(), or by
    asking for the next record. The producer never overwrites an unfinished step, so a
    reader that attaches late, or restarts after a crash, resumes at the first unfinished
    step, from layer 0: delivery is exactly once while the reader lives and at least once
    across its crash. One thread at a time may read (another gets ChannelBusyError).
    """

    def __init__(self, rank: int, device_id: int = 0, timeout: float | None = 60.0):
        """Attach as the reader of (rank, device_id), waiting up to `timeout` s for a live
        producer's channel (one left by a dead producer is waited past, for its successor)."""
        path = _names.channel_path("chunk", rank, device_id)
        self._segment = _core.Segment.open(
            path, _core.KIND_CHUNK, timeout, _core.OPEN_EXCLUSIVE_READER | _core.OPEN_LIVE_PRODUCER
        )

    def next(
        self, out, wait: bool = True, timeout: float | None = None, spin_us: int = 0
    ) -> int | None:
        """Write the next record into `out`; returns its step, or None (and -1, -1) if none.

        Without `wait` it returns at once; with it, it blocks until a record comes, the
        timeout passes (None: no limit) or the producer dies (ProducerDiedError), spinning
        `spin_us` microseconds before it sleeps.
        """
        words, capacity = writable_int32(out, "out", minimum=2)
        return self._next_into(words, capacity, wait, timeout, spin_ns(spin_us))

    def _next_into(
        self, words, capacity: int, wait: bool, timeout: float | None, spin: int
    ) -> int | None:
        step = self._segment.ring_next(words, capacity, timeout if wait else 0, spin)
        if step is None:
            words[0] = words[1] = -1
        return step

    def ack(self) -> None:
        """Acknowledge every record delivered so far, without asking for another (e.g.
        before a clean shutdown: close() alone leaves the last step to a successor)."""
        self._segment.ring_ack()

    def close(self) -> None:
        """Detach. A step whose last record was delivered but not acknowledged is delivered
        again, from layer 0, to the next reader."""
        self._segment.close()

    def __enter__(self) -> ChunkReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_chunk_readers: dict[tuple[int, str], ChunkReader] = {}
_chunk_readers_lock = threading.Lock()


def _process_chunk_reader(
    rank_id: int, device_id: int, timeout: float | None
) -> tuple[tuple[int, str], ChunkReader]:
    """This process's reader of (rank_id, device_id), attached on first use."""
    key = (os.getpid(), _names.channel_path("chunk", rank_id, device_id))
    with _chunk_readers_lock:  # two threads' first calls must not both attach
        reader = _chunk_readers.get(key)
        if reader is None:
            reader = _chunk_readers[key] = ChunkReader(rank_id, device_id, timeout)
    return key, reader


def get_output_kv_signal(
    out,
    rank_id: int,
    wait_flag: bool,
    device_id: int = 0,
    timeout: float | None = None,
    spin_us: int = 0,
) -> None:
    """Fill `out` (int32, >= 2 + 3 * requests words) with the next per-chunk record.

    Layout: out[0] request count, out[1] layer, then (slot, cached tokens, chunk tokens)
    triples; -1, -1 when nothing is pending. Every (step, layer) comes exactly once, in order
    (a call acknowledges the record before it; see ChunkReader). With `wait_flag`, spins
    `spin_us` microseconds before it sleeps, and waits up to `timeout` s (None: no limit) for
    a record, or for a producer when none is running. One thread at a time.
    """
    words, capacity = writable_int32(out, "out", minimum=2)  # bad input: fail before waiting
    spin = spin_ns(spin_us)
    started = time.monotonic()
    try:
        key, reader = _process_chunk_reader(rank_id, device_id, timeout if wait_flag else 0)
    except SegmentError as e:
        if wait_flag or e.errno != errno.ENOENT:
            raise
        words[0] = words[1] = -1
        return
    if timeout is not None:  # one deadline for attaching and reading, not one each
        timeout = max(0.0, timeout - (time.monotonic() - started))
    try:
        reader._next_into(words, capacity, wait_flag, timeout, spin)
    except ProducerDiedError:
        # The next call waits for the restarted producer's channel and resumes there.
        with _chunk_readers_lock:
            if _chunk_readers.get(key) is reader:
                del _chunk_readers[key]
        reader.close()
        raise


def ack_kv_signal(rank_id: int, device_id: int = 0) -> None:
    """Acknowledge every record get_output_kv_signal delivered on (rank_id, device_id), as
    ChunkReader.ack() does: call it before a clean shutdown, or a restarted messager gets
    the last step again (at least once). Nothing to acknowledge is no error."""
    key = (os.getpid(), _names.channel_path("chunk", rank_id, device_id))
    with _chunk_readers_lock:
        reader = _chunk_readers.get(key)
    if reader is not None:
        reader.ack()


def open_kv_chunk_reader(
    rank: int, device_id: int = 0, timeout: float | None = 60.0
) -> ChunkReader:
    """Open the per-chunk channel of (rank, device_id) as its single reader."""
    return ChunkReader(rank, device_id, timeout)
