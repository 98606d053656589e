"""Host memory in pdhal's shared segments: what host_alloc hands out on every backend, so
that set_data_ipc shares it by name and another process maps it (share_external_data)
whatever runtime it binds. (A vendor runtime's own host allocator hands out memory private
to its process: a KV cache in it could not be shared with a cache messager, nor served by
the shm transport. The pages are pinned by the runtime that allocated them; an importer's
own runtime copies into its mapping as into pageable memory.)

A backend pins a buffer its own way, in a subclass: the cpu backend locks its pages
(mlock), a runtime backend registers them with its runtime (what that runtime's DMA
needs), and unpins before the segment goes."""

from __future__ import annotations

import atexit
import bisect
import ctypes
import itertools
import os
import re
import threading
from collections.abc import Callable

from pdhal._errors import InvalidArgumentError, UnsupportedError
from pdhal._inputs.tensors import is_paddle_tensor
from pdhal._memory import extents as _extents
from pdhal._memory import published as _published
from pdhal._memory.hostmem import HostBuffer
from pdhal._protocol import core as _core
from pdhal._protocol import names as _names

_counter = itertools.count()
_live: dict[int, SharedHostBuffer] = {}  # address -> buffer, for set_data_ipc
_live_lock = threading.Lock()


class SharedHostBuffer(HostBuffer):
    """Host memory in a pdhal shared-memory segment, pinned by `_pin` (True when it could
    be) and unpinned by `_unpin` once the work queued on it ran."""

    def __init__(self, nbytes: int):
        name = f"host.{os.getpid()}.{next(_counter)}"
        self._segment = _core.Segment.create(
            _names.buffer_path(name), _core.KIND_BUFFER, body_bytes=nbytes
        )
        address = self._segment.body_address()
        try:
            pinned = self._pin(address, nbytes)
        except BaseException:
            self._segment.close()
            raise
        super().__init__(address, nbytes, pinned)
        self.path = self._segment.path
        self._creator_pid = os.getpid()
        with _live_lock:
            _live[address] = self

    def _pin(self, address: int, nbytes: int) -> bool:
        raise NotImplementedError

    def _unpin(self, queued_on: set) -> None:
        raise NotImplementedError

    def _release(self, queued_on: set) -> None:
        self._unpin(queued_on)  # first: a failure leaves the buffer whole, to free again
        with _live_lock:
            _live.pop(self._address, None)
        _published.unpublish_where(lambda record: record.get("path") == self.path)
        self._segment.close()


@atexit.register
def _unlink_unfreed_buffers() -> None:
    """At a normal exit, remove the files of buffers never freed (an engine's KV cache lives
    as long as the process), so none is left in the shm folder. Only the file: the memory
    stays mapped, for a thread still using it, until the process ends; a process that
    already mapped the buffer keeps its mapping."""
    with _live_lock:
        buffers = list(_live.values())
    for buf in buffers:
        if buf._creator_pid == os.getpid():  # a forked child's exit leaves its parent's
            try:
                os.unlink(buf.path)
            except FileNotFoundError:
                pass


def owning(address: int, nbytes: int) -> SharedHostBuffer | None:
    """The live buffer [address, +nbytes) lies in, if any."""
    with _live_lock:
        starts = sorted(_live)
        i = bisect.bisect_right(starts, address) - 1
        if i >= 0 and _live[starts[i]].contains(address, nbytes):
            return _live[starts[i]]
    return None


def publish(ref, name: str, backend: str) -> None:
    """Share the memory of `ref` (inside a live host_alloc buffer) as `name`: its buffer's
    segment and where in it; UnsupportedError naming `backend` for other memory."""
    owner = owning(ref.address, ref.nbytes)
    if owner is None:
        raise UnsupportedError(
            f"the {backend} backend shares host memory allocated by pdhal only: allocate "
            f"the KV cache with pdhal.ops.host_alloc and view it as a tensor (address "
            f"{ref.address:#x} is not inside any live host_alloc buffer)"
        )
    if owner._creator_pid != os.getpid():
        raise UnsupportedError(
            f"address {ref.address:#x} is in a host_alloc buffer of pid {owner._creator_pid}, "
            f"this process's parent: the process that allocated a buffer shares it"
        )
    _published.publish(
        name, {"path": owner.path, "offset": ref.address - owner.address, "nbytes": ref.nbytes}
    )


def is_host_record(record: dict) -> bool:
    """Whether a published record names host memory (publish's), not a runtime's handle."""
    return "path" in record


# What this process mapped of other processes' buffers. One mapping per buffer (a segment
# path), shared by every name inside it; each name's extent bounds raw addresses into it.
# forget(name) retires its extents and drops the mapping once no name in it is left; an
# array import() returned holds the mapping itself (a numpy view over unmapped memory would
# crash), so the mapping goes with the last of them.
_imported: dict[str, _core.Segment] = {}  # path -> its mapping
_imported_names: dict[str, list[tuple[str, _extents.Extent]]] = {}  # name -> (path, extent)
_imported_lock = threading.Lock()


def import_shared(like, name: str, record: dict, shape: tuple, dtype: str, need: int):
    """The host memory `record` (published as `name`: published.lookup checked its fields)
    names, mapped here: a numpy array of `dtype` and `shape` (`need` bytes), or a Paddle
    tensor when `like` is one (bfloat16 included). A record naming bytes outside its
    buffer is refused before the mapping is kept."""
    import numpy as np

    # numpy has no bfloat16: map it as int16 and let Paddle view it as what it is
    numpy_dtype = "int16" if dtype == "bfloat16" else dtype
    try:
        numpy_dtype = np.dtype(numpy_dtype)
    except TypeError:
        raise UnsupportedError(
            f"shared host buffers map through numpy, which has no dtype {dtype}"
        ) from None
    path = record["path"]
    # the record is its publisher's word: it may name a host_alloc buffer of this namespace
    # only (not a record, nor another deployment's memory)
    prefix = _names.buffer_path("host.")
    if not path.startswith(prefix) or not re.fullmatch(r"\d+\.\d+", path[len(prefix) :]):
        raise InvalidArgumentError(
            f"the record of {name!r} names {path!r}, which is not a host_alloc buffer of "
            f"namespace {_names.namespace()!r}"
        )
    with _imported_lock:
        seg = kept = _imported.get(path)
    if seg is None:  # its buffer exists while its record does: no waiting for it
        seg = _core.Segment.open(path, _core.KIND_BUFFER, 0)
    # ... of its publisher's own, as the buffer's header says who made it (not its file's
    # name, which another link to the file may give any pid): a peer must not have this
    # process write into a third process's memory, or its own
    owner, publisher = seg.creator_pid, _published.publisher(name)
    # the record is its publisher's word: what it names must lie inside what was mapped
    offset, nbytes, size = record["offset"], record["nbytes"], len(seg.body())
    why = None
    if owner != publisher:
        why = (
            f"the record of {name!r} names a host_alloc buffer of pid {owner}, not one of its "
            f"publisher (pid {publisher}): a process shares the buffers it allocated only"
        )
    elif not 0 <= offset <= size - nbytes:
        why = (
            f"the record of {name!r} names bytes [{offset}, +{nbytes}) of a buffer of "
            f"{size}: not what set_data_ipc shares"
        )
    if why is not None:
        if kept is None:
            seg.close()  # opened for this record alone
        raise InvalidArgumentError(why)
    with _imported_lock:
        seg = _imported.setdefault(path, seg)  # one mapping per buffer: a racing opener's
        # own goes with its last reference
    # What was shared is the tensor, not the whole buffer behind it: an address inside the
    # mapping is bounded by the tensor's bytes.
    address = seg.body_address() + offset
    extent = _extents.register(address, nbytes, "cpu", f"shared buffer {name!r}")
    with _imported_lock:
        known = _imported_names.setdefault(name, [])
        if not any(p == path and e is extent for p, e in known):
            known.append((path, extent))
    view = (ctypes.c_char * need).from_address(address)
    view.segment = seg  # the array keeps the mapping: see _imported
    array = np.frombuffer(view, dtype=numpy_dtype).reshape(shape)
    if is_paddle_tensor(like):
        import paddle

        tensor = paddle.from_dlpack(array)
        return tensor.view(paddle.bfloat16) if dtype == "bfloat16" else tensor
    if dtype == "bfloat16":
        raise UnsupportedError(
            "a bfloat16 buffer maps as a Paddle tensor only (numpy has no "
            "bfloat16): pass a Paddle tensor as `like`"
        )
    return array


def forget(name: str, retire: Callable[[_extents.Extent], None]) -> None:
    """Unmap this process's import of `name` once no other name in its buffer is imported
    and no array over it is left; first `retire` each of its extents (which waits for the
    copies queued on it, where a backend queues any, and refuses new ones)."""
    with _imported_lock:
        forgotten = _imported_names.pop(name, [])
    for _, extent in forgotten:
        retire(extent)
    with _imported_lock:
        still = {path for known in _imported_names.values() for path, _ in known}
        for path, _ in forgotten:
            if path not in still:
                _imported.pop(path, None)  # unmapped with the last reference to it
