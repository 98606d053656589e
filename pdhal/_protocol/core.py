"""The only module that touches the compiled C core: handles, and -errno turned into exceptions."""

from __future__ import annotations

import errno
import threading
import time

from pdhal._compiled import ffi, lib
from pdhal._errors import (
    BackPressureTimeoutError,
    ChannelBusyError,
    ClosedHandleError,
    DeviceError,
    InvalidArgumentError,
    ProducerDiedError,
    ReaderDiedError,
    SegmentError,
    SignalTimeoutError,
    SystemResourceError,
    TransferError,
)

#: The C ABI this Python code was written against; see PDHAL_ABI_VERSION in pdhal.h.
ABI_VERSION = 2
if lib.pdhal_abi_version() != ABI_VERSION:  # pragma: no cover - only on a stale build
    raise ImportError(
        f"pdhal's compiled core speaks ABI {lib.pdhal_abi_version()}, this Python code expects "
        f"{ABI_VERSION}: rebuild it with `pip install -e .` (or `make test`)"
    )

KIND_QUERY = lib.PDHAL_KIND_QUERY
KIND_CHUNK = lib.PDHAL_KIND_CHUNK
KIND_BUFFER = lib.PDHAL_KIND_BUFFER
OPEN_EXCLUSIVE_READER = lib.PDHAL_OPEN_EXCLUSIVE_READER
OPEN_LIVE_PRODUCER = lib.PDHAL_OPEN_LIVE_PRODUCER
QUERY_SLOT = lib.PDHAL_QUERY_SLOT
LAYER_BITS = lib.PDHAL_LAYER_BITS
MAX_LAYER = lib.PDHAL_MAX_LAYER
MAX_REQUESTS = lib.PDHAL_MAX_REQUESTS
SEGMENT_VERSION = lib.PDHAL_SEGMENT_VERSION
RECORD_WORDS = lib.PDHAL_RECORD_WORDS
DEFAULT_RING_SLOTS = lib.PDHAL_DEFAULT_RING_SLOTS
KERNEL_WORDS = lib.PDHAL_KERNEL_WORDS
KERNEL_SIGNAL = lib.PDHAL_KERNEL_SIGNAL
KERNEL_NOOP = lib.PDHAL_KERNEL_NOOP
KERNEL_SENDER = lib.PDHAL_KERNEL_SENDER
FOREVER_NS = 2**63 - 1
LAYER_MASK = (1 << LAYER_BITS) - 1
_EINTR = -errno.EINTR

#: Address of the C function `void pdhal_store_run(void *store)`, for device host functions
#: (an int, so a backend can cast it in its own ffi).
STORE_CALLBACK_ADDRESS = int(ffi.cast("uintptr_t", ffi.addressof(lib, "pdhal_store_run")))

_ERROR_CLASSES = {
    errno.EBUSY: ChannelBusyError,
    errno.EOWNERDEAD: ProducerDiedError,
    errno.EPIPE: ReaderDiedError,
    errno.ETIMEDOUT: SignalTimeoutError,
    errno.EINVAL: InvalidArgumentError,
    errno.E2BIG: InvalidArgumentError,
    errno.ENOBUFS: InvalidArgumentError,
    errno.ERANGE: InvalidArgumentError,
    errno.ENAMETOOLONG: InvalidArgumentError,
    errno.ECHILD: InvalidArgumentError,  # a handle used in a forked child: its parent's
    errno.ENOMEM: SystemResourceError,
    errno.EAGAIN: SystemResourceError,
    errno.ENFILE: SystemResourceError,
}


def _raise(rc: int, what: str, overrides: dict | None = None) -> None:
    """Raise the pdhal exception for -rc, prefixed by `what` (the failed action)."""
    err = -rc
    detail = ffi.string(lib.pdhal_last_error()).decode(errors="replace")
    cls = (overrides or {}).get(err) or _ERROR_CLASSES.get(err, SegmentError)
    message = f"{what}: {detail}"
    if issubclass(cls, OSError):
        raise cls(err, message)
    raise cls(message)


def check(rc: int, what: str, *args, overrides: dict | None = None) -> int:
    """Return rc if it is not negative, else raise the pdhal exception for -rc.

    `what % args` names the action; it is formatted only on failure, since checks sit on the
    per-layer path. `overrides` maps an errno to the exception class a call gives it."""
    if rc < 0:
        _raise(rc, what % args if args else what, overrides)
    return rc


def deadline_ns(timeout: float | None) -> int:
    """Absolute CLOCK_MONOTONIC deadline for `timeout` seconds (None or inf: no deadline)."""
    if timeout is None:
        return FOREVER_NS
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout >= 0:
        raise InvalidArgumentError(
            f"timeout must be a number of seconds >= 0 or None, got {timeout!r}"
        )
    timeout_ns = min(timeout * 1e9, FOREVER_NS)  # inf, or past any clock: no deadline
    return min(FOREVER_NS, time.monotonic_ns() + int(timeout_ns))


def pack_progress(step: int, layer: int) -> int:
    """The 64-bit progress word of (step, layer); layer -1 means "no layer yet"."""
    return (step << LAYER_BITS) | (layer + 1)


def unpack_progress(word: int) -> tuple[int, int]:
    """(step, layer) of a progress word; layer is -1 when no layer is ready."""
    return word >> LAYER_BITS, (word & LAYER_MASK) - 1


def _retry_interrupted(call, *args):
    """Run a blocking C call that returns -EINTR on signals: Python runs its handlers between
    attempts (so Ctrl-C raises KeyboardInterrupt), then the call resumes with the same
    absolute deadline."""
    while True:
        rc = call(*args)
        if rc != _EINTR:
            return rc


class Segment:
    """A handle on one shared-memory segment (a progress channel or a shared buffer).

    Thread-safe to use from several threads; close() while another thread is inside a call
    (a wait) lets that call finish on the mapping, which is released after it."""

    __slots__ = ("_ptr", "path", "kind", "is_producer", "ring_slots", "__weakref__")

    def __init__(self, ptr, path: str, kind: int, is_producer: bool):
        self._ptr = ffi.gc(ptr, lib.pdhal_segment_close)
        self.path = path
        self.kind = kind
        self.is_producer = is_producer
        self.ring_slots = lib.pdhal_segment_ring_slots(ptr)

    @classmethod
    def create(
        cls, path: str, kind: int, body_bytes: int = 0, ring_slots: int = DEFAULT_RING_SLOTS
    ) -> Segment:
        """Create (or reclaim from a dead producer) the segment at `path` as its producer."""
        out = ffi.new("pdhal_segment **")
        check(
            lib.pdhal_segment_create(path.encode(), kind, body_bytes, ring_slots, out),
            "creating %s",
            path,
        )
        return cls(out[0], path, kind, True)

    @classmethod
    def open(cls, path: str, kind: int, timeout: float | None, flags: int = 0) -> Segment:
        """Open an existing segment, waiting up to `timeout` seconds for it to appear.

        `flags`: OPEN_EXCLUSIVE_READER (the per-chunk reader), OPEN_LIVE_PRODUCER (a
        segment whose producer died counts as missing: wait for a new producer)."""
        out = ffi.new("pdhal_segment **")
        rc = _retry_interrupted(
            lib.pdhal_segment_open, path.encode(), kind, deadline_ns(timeout), flags, out
        )
        # a wait for the file that ran out, or a file that is no segment (EINVAL: not a
        # regular file): what is wrong is the segment, not an argument
        check(
            rc,
            "opening %s",
            path,
            overrides={errno.ETIMEDOUT: SegmentError, errno.EINVAL: SegmentError},
        )
        return cls(out[0], path, kind, False)

    @property
    def ptr(self):
        ptr = self._ptr
        if ptr is None:
            raise ClosedHandleError(f"segment {self.path} is closed")
        return ptr

    @property
    def closed(self) -> bool:
        return self._ptr is None

    def dup(self) -> Segment:
        """Another handle on this mapping, as dup(2) gives another descriptor: closed on
        its own, the mapping living while either is open (a link's gate reads the signals
        of a reader its owner may close meanwhile)."""
        other = Segment.__new__(Segment)
        other._ptr = self.ptr  # the same released-when-unreferenced pointer (close())
        for name in ("path", "kind", "is_producer", "ring_slots"):
            setattr(other, name, getattr(self, name))
        return other

    def close(self) -> None:
        """Release the handle; the producer's close unlinks the name. Idempotent.

        Dropping the reference (rather than freeing) is what makes a concurrent call safe:
        a call in progress holds the pointer, and the handle is freed when the last holder
        lets go, which without one is right here."""
        self._ptr = None

    def producer_alive(self) -> bool:
        return bool(check(lib.pdhal_segment_producer_alive(self.ptr), "probing %s", self.path))

    def reader_attached(self) -> bool:
        return bool(
            check(
                lib.pdhal_segment_reader_attached(self.ptr), "probing the reader of %s", self.path
            )
        )

    @property
    def creator_pid(self) -> int:
        return lib.pdhal_segment_creator_pid(self.ptr)

    # per-query progress
    def progress(self) -> int:
        return lib.pdhal_progress_load(self.ptr)

    def begin_step(self) -> int:
        step = ffi.new("uint64_t *")
        check(lib.pdhal_progress_begin_step(self.ptr, step), "starting a step on %s", self.path)
        return step[0]

    def publish(self, slot: int, value: int) -> None:
        lib.pdhal_progress_publish(self.ptr, slot, value)

    def wait(self, since: int, timeout: float | None, spin_ns: int = 0) -> int:
        """Block until the per-query progress word exceeds `since`; return the word."""
        # The messager's per-layer loop: kept to the fewest Python steps between the wake-up
        # and the caller (bench/bench_signals.py measures it).
        ptr, now = self.ptr, ffi.new("uint64_t *")
        deadline = FOREVER_NS if timeout is None else deadline_ns(timeout)
        rc = lib.pdhal_progress_wait(ptr, since, deadline, spin_ns, now)
        while rc == _EINTR:  # handlers ran; resume with the same deadline
            rc = lib.pdhal_progress_wait(ptr, since, deadline, spin_ns, now)
        if rc < 0:
            _raise(rc, "waiting for progress")
        return now[0]

    # per-chunk ring
    def ring_begin_step(self, table: list[int], num_layers: int, timeout: float | None) -> int:
        count = len(table) // 3
        words = ffi.new("int32_t[]", table) if table else ffi.NULL
        step = ffi.new("uint64_t *")
        rc = _retry_interrupted(
            lib.pdhal_ring_begin_step,
            self.ptr,
            words,
            count,
            num_layers,
            deadline_ns(timeout),
            step,
        )
        check(
            rc,
            "publishing a step on %s",
            self.path,
            overrides={errno.ETIMEDOUT: BackPressureTimeoutError},
        )
        return step[0]

    def ring_next(self, out, capacity: int, timeout: float | None, spin_ns: int = 0) -> int | None:
        """Write the next record into the int32 cdata `out`; its step, or None if none came.

        timeout 0 means "do not wait". Acknowledges the records delivered before."""
        step = ffi.new("uint64_t *")
        deadline = 0 if timeout == 0 else deadline_ns(timeout)
        rc = _retry_interrupted(
            lib.pdhal_ring_next, self.ptr, out, capacity, deadline, spin_ns, step
        )
        check(rc, "reading %s", self.path)
        return step[0] if rc == 1 else None

    def ring_ack(self) -> None:
        """Acknowledge every record delivered so far (see pdhal_ring_ack)."""
        check(lib.pdhal_ring_ack(self.ptr), "acknowledging records of %s", self.path)

    # buffers
    def body(self):
        """The payload of a buffer segment as a writable cffi buffer."""
        ptr = self.ptr
        return ffi.buffer(lib.pdhal_segment_body(ptr), lib.pdhal_segment_body_bytes(ptr))

    def body_address(self) -> int:
        return int(ffi.cast("uintptr_t", lib.pdhal_segment_body(self.ptr)))

    def kernel_id(self) -> int:
        """This producer channel's id in kernel forms (registered on first use)."""
        channel = lib.pdhal_kernel_channel(self.ptr)
        if channel == 0:
            _raise(-errno.ENFILE, f"registering {self.path} for kernel forms")
        return channel

    def clear_current_chunk(self) -> None:
        """If this channel's step is the process's current per-chunk step, none is now (a
        step of this channel without prefill requests)."""
        check(lib.pdhal_chunk_set_current(self.ptr, 0, 0), "clearing the current step")

    # deferred stores
    def new_store(self, slot: int, value: int):
        """A pending store (C `pdhal_store *`) for a device callback; caller hands it off."""
        store = lib.pdhal_store_new(self.ptr, slot, value)
        if store == ffi.NULL:
            detail = ffi.string(lib.pdhal_last_error()).decode(errors="replace")
            if detail == "out of memory":
                raise MemoryError(f"preparing a layer signal: {detail}")
            raise InvalidArgumentError(f"preparing a layer signal: {detail}")
        return store


def kernel_store(words):
    """The pending store that the kernel-form `words` (int64_t[4] cdata) name."""
    store = lib.pdhal_signal_store(words)
    if store == ffi.NULL:
        detail = ffi.string(lib.pdhal_last_error()).decode(errors="replace")
        raise InvalidArgumentError(f"posting a signal given in kernel form: {detail}")
    return store


def run_store(store) -> None:
    """Run a pending store now, on this thread, and free it."""
    lib.pdhal_store_run(store)


def copy_blocks(
    copy_fn,
    kind: int,
    stream: int,
    dst,
    dst_blocks: int,
    src,
    src_blocks: int,
    block_bytes: int,
    dst_ids,
    src_ids,
) -> int:
    """pdhal_copy_blocks: copy_fn a C function address (0: memmove now); dst and src an
    address each, or equal-length lists of addresses (layers, the same ids copied in each:
    pdhal_copy_blocks_layers); the ids int64_t[] cdata of equal length; returns the copies
    made."""
    count = len(dst_ids)
    fn = ffi.NULL if not copy_fn else ffi.cast("pdhal_copy_fn", copy_fn)
    if isinstance(dst, list):
        dsts, srcs = ffi.new("uintptr_t[]", dst), ffi.new("uintptr_t[]", src)
        rc = lib.pdhal_copy_blocks_layers(
            fn,
            kind,
            ffi.cast("void *", stream),
            ffi.cast("void *const *", dsts),
            dst_blocks,
            ffi.cast("const void *const *", srcs),
            src_blocks,
            len(dst),
            block_bytes,
            dst_ids,
            src_ids,
            count,
        )
    else:
        rc = lib.pdhal_copy_blocks(
            fn,
            kind,
            ffi.cast("void *", stream),
            ffi.cast("void *", dst),
            dst_blocks,
            ffi.cast("void *", src),
            src_blocks,
            block_bytes,
            dst_ids,
            src_ids,
            count,
        )
    return check(rc, "copying %d blocks", count, overrides={errno.EIO: DeviceError})


def store_address(store) -> int:
    """The int address of a pending store, to hand to a device callback."""
    return int(ffi.cast("uintptr_t", store))


def free_store(store) -> None:
    """Free a pending store that will never run."""
    lib.pdhal_store_free(store)


def reclaim(path: str) -> bool:
    """Unlink `path` if it is our segment and its producer is dead; True if removed."""
    return bool(check(lib.pdhal_segment_reclaim(path.encode()), "reclaiming %s", path))


class Sender:
    """A C sender thread: posts (event, store) pairs, runs stores after their events fire.

    Thread-safe: posts from several threads queue in the order they get the lock, and
    destroy() waits for posts in progress (then refuses later ones)."""

    __slots__ = ("_ptr", "_lock", "_destroy_event", "__weakref__")

    def __init__(self, wait_fn=ffi.NULL, destroy_fn=ffi.NULL):
        """`wait_fn` / `destroy_fn`: C function pointers (cdata or int addresses) or NULL."""
        out = ffi.new("pdhal_sender **")
        self._destroy_event = _fn(destroy_fn, "pdhal_event_destroy_fn")
        check(
            lib.pdhal_sender_create(_fn(wait_fn, "pdhal_event_wait_fn"), self._destroy_event, out),
            "creating the KV signal sender",
        )
        self._ptr = ffi.gc(out[0], lib.pdhal_sender_destroy)
        self._lock = threading.Lock()

    @property
    def ptr(self):
        if self._ptr is None:
            raise ClosedHandleError("the KV signal sender was destroyed")
        return self._ptr

    @property
    def closed(self) -> bool:
        return self._ptr is None

    def set_polling(self, query_fn, poll_ns: int) -> None:
        """Poll queued events with the C function `query_fn` for up to poll_ns each."""
        check(
            lib.pdhal_sender_set_polling(self.ptr, _fn(query_fn, "pdhal_event_query_fn"), poll_ns),
            "turning on polling",
        )

    def kernel_id(self) -> int:
        """This sender's id in kernel forms."""
        return lib.pdhal_sender_kernel_id(self.ptr)

    def post(self, event, store) -> None:
        """Queue (event, store); ownership of both passes to the sender, even on failure."""
        with self._lock:
            ptr = self._ptr
            if ptr is None:
                lib.pdhal_store_free(store)
                self.discard(event)
                raise ClosedHandleError("the KV signal sender was destroyed")
            check(lib.pdhal_sender_post(ptr, _event(event), store), "posting a layer signal")

    def discard(self, event) -> None:
        """Destroy a device event that will never be posted (what post does on failure)."""
        if event is not None and self._destroy_event != ffi.NULL:
            self._destroy_event(_event(event))

    @property
    def pending(self) -> int:
        with self._lock:
            return lib.pdhal_sender_pending(self.ptr)

    @property
    def failures(self) -> int:
        with self._lock:
            return lib.pdhal_sender_failures(self.ptr)

    def destroy(self) -> int:
        """Deliver everything queued, join the thread; returns the failed event waits."""
        with self._lock:
            ptr, self._ptr = self._ptr, None
        if ptr is None:
            return 0
        ffi.gc(ptr, None)  # detach the safety-net destructor: we destroy it here
        return check(lib.pdhal_sender_destroy(ptr), "destroying the KV signal sender")


def _fn(fn, ctype: str):
    return ffi.NULL if fn is None else ffi.cast(ctype, fn)


def _event(event):
    if event is None:
        return ffi.NULL
    if isinstance(event, int):
        return ffi.cast("void *", event)
    return event


#: What a copier's post raises for each errno: a run outside what the link may touch is a
#: TransferError (a peer's description or a caller's run); a closed copier is one too.
_COPIER_ERRORS = {
    errno.ERANGE: TransferError,
    errno.EPIPE: TransferError,
    errno.ECHILD: TransferError,
}


class CopyJob:
    """One posted job of a Copier: wait for it, or ask whether it ran."""

    __slots__ = ("_ptr",)

    def __init__(self, ptr):
        self._ptr = ffi.gc(ptr, lib.pdhal_copy_job_free)

    def done(self) -> bool:
        return bool(lib.pdhal_copy_job_done(self._ptr))

    def started_ns(self) -> int:
        """When the job started, a gate when it opened (time.monotonic_ns()); 0 until."""
        return lib.pdhal_copy_job_started_ns(self._ptr)

    def cancel(self) -> None:
        """Give a gate up: unless it opened, it fails (at once if the copier waits on it, else
        when the copier reaches it, its signal come or not), with the job posted after it."""
        lib.pdhal_copy_job_cancel(self._ptr)

    def wait(self, timeout: float) -> None:
        """Return once every copy of the job ran; TransferError if one met memory its owner
        took away (SIGBUS), a gate's signal did not come (or one before it), or if the job
        had not run within `timeout` seconds."""
        rc = lib.pdhal_copy_job_wait(self._ptr, deadline_ns(timeout))
        if rc == -errno.ETIMEDOUT:
            raise TransferError(f"the copies did not run within {timeout:g} s")
        if rc == -errno.EFAULT:  # the job's own reason, which says what failed
            raise TransferError(ffi.string(lib.pdhal_last_error()).decode(errors="replace"))
        if rc < 0:
            _raise(rc, "the copies failed")


class HostQueue:
    """Work queued on a host thread (not a device stream): an op marks the extents it reads
    or writes with it (extents.mark_queued), and a retire of them returns only once drain()
    did."""

    def drain(self) -> None:
        """Return once everything queued so far ran."""
        raise NotImplementedError


class Copier(HostQueue):
    """A C copier thread (copier.c): host copies into one destination's regions mapped here
    (`bases`, `sizes`), from the memory in `sources` ((address, bytes) pairs), run in order
    off the caller's thread and without the GIL. Thread-safe; destroy() runs what was
    posted, then refuses more (TransferError). A HostQueue: extents marked with it are freed
    only once what was posted ran (drain)."""

    __slots__ = ("_ptr", "_lock", "_last")

    def __init__(self, bases: list[int], sizes: list[int], sources: list[tuple[int, int]]):
        out = ffi.new("pdhal_copier **")
        flat = [word for span in sources for word in span]
        check(
            lib.pdhal_copier_create(
                ffi.new("uint64_t[]", bases),
                ffi.new("uint64_t[]", sizes),
                len(bases),
                ffi.new("uint64_t[]", flat),
                len(sources),
                out,
            ),
            "starting the copier",
        )
        self._ptr = ffi.gc(out[0], lib.pdhal_copier_destroy)
        self._lock = threading.Lock()
        self._last: CopyJob | None = None  # the job posted last: jobs run in order

    def post_gate(self, signals: Segment, until: int, timeout: float) -> CopyJob:
        """Queue a gate: the job posted next starts once the per-query progress word of
        `signals` reaches `until`; a gate whose word does not within `timeout` seconds of
        the thread reaching it fails, with that job (copier.c)."""
        timeout_ns = max(int(timeout * 1e9), 1)
        return self._post(lib.pdhal_copier_post_gate, signals.ptr, until, timeout_ns)

    def post_runs(self, runs: list[tuple[int, int, int, int]]) -> CopyJob:
        """Queue `runs` ((source address, region, offset, bytes), plain ints) as one job."""
        packed = ffi.new("uint64_t[]", [word for run in runs for word in run])
        return self._post(lib.pdhal_copier_post_runs, packed, len(runs))

    def post_blocks(self, caches, ncaches: int, block_runs, nruns: int) -> CopyJob:
        """Queue the byte copies of `block_runs` (cdata int64_t[3 * nruns]) in each of
        `caches` (cdata pdhal_copy_cache[ncaches]) as one job."""
        return self._post(lib.pdhal_copier_post_blocks, caches, ncaches, block_runs, nruns)

    def post_units(
        self, caches, heads, ncaches: int, units: tuple[int, int], unit_runs, nruns: int
    ) -> CopyJob:
        """Queue the byte copies of `unit_runs` (cdata int64_t[3 * nruns]) between caches of
        two block sizes (`units`: per source block, per destination block; `caches`' block
        bytes one unit's, of `heads` (cdata uint32_t[ncaches]) heads each) as one job."""
        return self._post(
            lib.pdhal_copier_post_units, caches, heads, ncaches, *units, unit_runs, nruns
        )

    def post_pieces(
        self,
        caches,
        parts,
        orders,
        ncaches: int,
        tokens: tuple[int, int],
        token_runs,
        nruns: int,
    ) -> CopyJob:
        """Queue the byte copies of `token_runs` (cdata int64_t[3 * nruns]) between caches
        ordered differently inside a block (`orders`, cdata uint8_t[ncaches] of
        SRC_TOKEN_MAJOR | DST_TOKEN_MAJOR; `caches`' block bytes one token's, of `parts`
        parts each; `tokens`: per source block, per destination block) as one job."""
        return self._post(
            lib.pdhal_copier_post_pieces, caches, parts, orders, ncaches, *tokens, token_runs,
            nruns,
        )  # fmt: skip

    def _post(self, post, *args) -> CopyJob:
        out = ffi.new("pdhal_copy_job **")
        with self._lock:  # destroy() frees the copier: not while a post is inside it
            if self._ptr is None:
                raise TransferError("the link was closed")
            check(post(self._ptr, *args, out), "posting copies", overrides=_COPIER_ERRORS)
            self._last = job = CopyJob(out[0])
        return job

    def drain(self) -> None:
        """Return once every job posted so far ran (done or failed)."""
        with self._lock:
            last = self._last
        if last is not None:
            lib.pdhal_copy_job_wait(last._ptr, FOREVER_NS)  # 0 or -EFAULT: it ran either way

    def destroy(self) -> None:
        """Run every job posted, then stop the thread. Idempotent."""
        with self._lock:
            ptr, self._ptr = self._ptr, None
        if ptr is not None:
            ffi.gc(ptr, None)
            lib.pdhal_copier_destroy(ptr)


def copy_caches(caches: list[tuple[int, int, int, int, int, int]]):
    """A cdata pdhal_copy_cache[] of (source address, source stride, region, destination
    offset, destination stride, block bytes) per cache, for Copier.post_blocks."""
    return ffi.new("pdhal_copy_cache[]", caches)


def head_counts(heads: list[int]):
    """A cdata uint32_t[] of each cache's KV heads, for Copier.post_units."""
    return ffi.new("uint32_t[]", heads)


#: A PieceCopies order mask: the source's (destination's) blocks are token-major.
SRC_TOKEN_MAJOR = lib.PDHAL_SRC_TOKEN_MAJOR
DST_TOKEN_MAJOR = lib.PDHAL_DST_TOKEN_MAJOR


def order_masks(orders: list[int]):
    """A cdata uint8_t[] of each cache's order mask, for Copier.post_pieces."""
    return ffi.new("uint8_t[]", orders)


def block_run_words(runs: list[tuple[int, int, int]]):
    """A cdata int64_t[] of `runs` ((first source block, first destination block, count))."""
    return ffi.new("int64_t[]", [word for run in runs for word in run])


class Bell:
    """A doorbell between threads of this process (pdhal_bell): ring() wakes every thread
    inside wait(); a waiter passes seen(), read before it decided to wait, so a ring between
    that read and the wait is not missed. The wait runs without the GIL."""

    __slots__ = ("_bell",)

    def __init__(self):
        self._bell = ffi.new("pdhal_bell *")

    def seen(self) -> int:
        return self._bell.seq

    def ring(self) -> None:
        lib.pdhal_bell_ring(self._bell)

    def wait(self, seen: int, timeout: float | None = None) -> bool:
        """Wait until a ring after `seen`, at most `timeout` seconds (None: no limit): True
        if one came."""
        deadline = deadline_ns(timeout)
        while self._bell.seq == seen:
            rc = lib.pdhal_bell_wait(self._bell, seen, deadline)
            if rc == -errno.ETIMEDOUT:
                return False
            check(rc, "waiting on a doorbell")
        return True
