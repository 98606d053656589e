"""Block copies between paged KV caches, the part every backend shares: which memory each
side is and how far it extends, the block ids as engines pass them, and the C loop
(pdhal_copy_blocks) that checks every id and coalesces runs. A backend adds its runtime's
asynchronous copy and the stream.

BlockIds, check_copy, block_bytes_of and memory_span are public (pdhal.blocks): what an
adapter or a transfer loop needs to name blocks and memory the way copy_blocks does."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from pdhal._errors import InvalidArgumentError, InvalidTypeError, PdhalError
from pdhal._inputs.tensors import MemoryRef, memory_ref
from pdhal._memory import extents as _extents
from pdhal._protocol import core as _core
from pdhal._protocol.names import validate_index


def resolve(obj: object, what: str, writable: bool = False) -> MemoryRef:
    """The memory `obj` names, with its extent: a tensor or buffer says its own, or is a view
    of pdhal memory (an array over a host_alloc buffer or a shared mapping), whose extent it
    lies in, so an op on it holds that memory as on the buffer itself; a raw int address
    must lie in memory pdhal handed out (host_alloc, cuda_host_alloc, a shared buffer, a
    registered range), which bounds it."""
    ref = memory_ref(obj, what, writable=writable)
    if ref.nbytes is not None:
        if ref.extent is None:
            extent = _extents.find(ref.address)
            if (
                extent is not None
                and extent.device == ref.device
                and ref.address + ref.nbytes <= extent.start + extent.nbytes
            ):
                return dataclasses.replace(ref, extent=extent)
        return ref
    extent = _extents.find(ref.address)
    if extent is None:
        raise InvalidArgumentError(
            f"{what} is the address {ref.address:#x}, which pdhal did not hand out, so how far "
            f"it extends is unknown: pass a tensor, or memory from host_alloc, "
            f"cuda_host_alloc, get_data_ptr_ipc or host_register"
        )
    return MemoryRef(
        ref.address, extent.start + extent.nbytes - ref.address, extent.device, extent=extent
    )


_INT64_ARRAY = _core.ffi.typeof("int64_t[]")


def block_ids_array(obj: object, what: str):
    """Block ids as an int64_t[] for the C loop, with no Python per id in the common cases:
    a list or tuple converts in C, a contiguous 1-D int64 array (numpy) is used in place, an
    int64_t[] this function returned (or a slice of it) and BlockIds are themselves.
    Anything else, or ids cffi refuses, takes block_ids (which says which entry is wrong)."""
    if isinstance(obj, BlockIds):
        return obj._array
    if isinstance(obj, _core.ffi.CData) and _core.ffi.typeof(obj) is _INT64_ARRAY:
        return obj
    if isinstance(obj, (list, tuple)):
        try:
            return _core.ffi.new("int64_t[]", obj)
        except (TypeError, OverflowError):
            pass
    elif not isinstance(obj, (bytes, bytearray, str)):
        try:
            view = memoryview(obj)
        except TypeError:
            view = None
        if view is not None:
            with view:
                if (
                    view.ndim == 1
                    and view.itemsize == 8
                    and view.c_contiguous
                    and view.format.lstrip("@=<") in ("l", "q")
                ):
                    return _core.ffi.from_buffer("int64_t[]", obj)
    return _core.ffi.new("int64_t[]", block_ids(obj, what))


class BlockIds:
    """Block ids converted once, for several copies of the same blocks (K and V, one layer
    after another): copy_blocks and check_copy take them as they are, with no conversion.
    Built from anything copy_blocks takes as ids; a slice is BlockIds of its own."""

    __slots__ = ("_array",)

    def __init__(self, ids: object, what: str = "block_ids"):
        self._array = block_ids_array(ids, what)

    def __len__(self) -> int:
        return len(self._array)

    def __getitem__(self, index):
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self._array))
            if step != 1:
                return BlockIds(list(self._array)[index])
            part = BlockIds.__new__(BlockIds)  # its own memory: a cffi slice keeps no owner
            part._array = _core.ffi.new("int64_t[]", max(stop - start, 0))
            _core.ffi.memmove(part._array, self._array + start, len(part._array) * 8)
            return part
        return list(self._array)[index] if index < 0 else self._array[index]

    def __iter__(self):
        return iter(self._array)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, BlockIds) and list(self._array) == list(other._array)

    def tolist(self) -> list[int]:
        return list(self._array)

    def __repr__(self) -> str:
        return f"BlockIds({self.tolist()!r})"


def block_ids(obj: object, what: str) -> list[int]:
    """Block ids as engines pass them: a list, tuple, or 1-D integer tensor or array."""
    if hasattr(obj, "tolist") and not isinstance(obj, (list, tuple)):
        obj = obj.tolist()
    if not isinstance(obj, (list, tuple)):
        raise InvalidTypeError(
            f"{what} must be a list or 1-D tensor of block ids, got {type(obj).__name__}"
        )
    ids = []
    for value in obj:
        if isinstance(value, list) and len(value) == 1:
            value = value[0]
        if isinstance(value, bool) or not isinstance(value, int):
            raise InvalidArgumentError(f"{what} must hold integer block ids, found {value!r}")
        if not -(2**63) <= value < 2**63:
            raise InvalidArgumentError(f"{what} holds {value}, beyond any block id")
        ids.append(value)
    return ids


def _plan(dst, dst_block_ids, src, src_block_ids, block_bytes: int):
    """What copy_blocks needs, checked: (dst, src, their ids, block_bytes)."""
    block_bytes = validate_index(block_bytes, "block_bytes", 1 << 46)
    if block_bytes == 0:
        raise InvalidArgumentError("block_bytes must be at least 1")
    dst_ids = list(block_ids_array(dst_block_ids, "dst_block_ids"))
    src_ids = list(block_ids_array(src_block_ids, "src_block_ids"))
    if len(dst_ids) != len(src_ids):
        raise InvalidArgumentError(
            f"dst_block_ids and src_block_ids must pair up, got "
            f"{len(dst_ids)} and {len(src_ids)} ids"
        )
    return resolve(dst, "dst", writable=True), resolve(src, "src"), dst_ids, src_ids, block_bytes


def check_copy(dst, dst_block_ids, src, src_block_ids, block_bytes: int) -> None:
    """Refuse what copy_blocks would refuse (the memory, the ids, a block id outside its
    side's extent), copying nothing: an op made of several copies (K then V, one layer after
    another) checks them all first, so a bad argument of the last leaves the first unmade."""
    d, s, dst_ids, src_ids, block_bytes = _plan(dst, dst_block_ids, src, src_block_ids, block_bytes)
    _extents.release(_extents.hold([d.extent, s.extent]))  # freed memory: refused, as there
    for side, ref, ids in (("destination", d, dst_ids), ("source", s, src_ids)):
        blocks = ref.nbytes // block_bytes
        if ids and (min(ids) < 0 or max(ids) >= blocks):
            entry = next(i for i, b in enumerate(ids) if not 0 <= b < blocks)
            raise InvalidArgumentError(
                f"{side} block id {ids[entry]} (entry {entry}) is outside "
                f"the cache's blocks 0..{blocks - 1}"
            )


def copy_blocks(
    copy_fn: int,
    kind_of: Callable[[str, str], int],
    stream: int,
    dst,
    dst_block_ids,
    src,
    src_block_ids,
    block_bytes: int,
    fence: Callable[[int, list], None] | None = None,
) -> int:
    """Copy block src_block_ids[i] of `src` to block dst_block_ids[i] of `dst` through the
    runtime's copy (its C address; 0: memmove now). kind_of(dst device, src device) gives
    the runtime's copy kind. `dst` and `src` may be equal-length lists of memory (layers):
    the same ids are copied in each pair, converted and checked once. Returns the number of
    copies made (runs of consecutive ids, in all layers). The C loop checks every id
    against its side's extent before the first byte moves.

    pdhal's own memory on either side is held for the copy (a free meanwhile waits); with
    a runtime copy, `fence(stream, held extents)` (required then) marks where the queued
    copies end, and a free of that memory waits for them to run too."""
    if copy_fn and fence is None:
        raise TypeError("a runtime copy (copy_fn) needs its backend's fence")
    block_bytes = validate_index(block_bytes, "block_bytes", 1 << 46)
    if block_bytes == 0:
        raise InvalidArgumentError("block_bytes must be at least 1")
    dst_ids = block_ids_array(dst_block_ids, "dst_block_ids")
    src_ids = block_ids_array(src_block_ids, "src_block_ids")
    if len(dst_ids) != len(src_ids):
        raise InvalidArgumentError(
            f"dst_block_ids and src_block_ids must pair up, got "
            f"{len(dst_ids)} and {len(src_ids)} ids"
        )
    if isinstance(dst, (list, tuple)) or isinstance(src, (list, tuple)):
        dst, dst_blocks, src, src_blocks, kind, refs = _layers(kind_of, dst, src, block_bytes)
    else:
        d = resolve(dst, "dst", writable=True)
        s = resolve(src, "src")
        dst, dst_blocks = d.address, d.nbytes // block_bytes
        src, src_blocks = s.address, s.nbytes // block_bytes
        kind = kind_of(d.device, s.device)
        refs = (d, s)
    held = []
    try:
        held = _extents.hold([ref.extent for ref in refs])
        return _core.copy_blocks(
            copy_fn, kind, stream, dst, dst_blocks, src, src_blocks, block_bytes, dst_ids, src_ids
        )
    finally:
        # a runtime copy queues its runs (a failed one may have queued some before its
        # error): their fence goes on the stream before the hold ends, so a free that
        # comes next waits for them to run
        try:
            if copy_fn and held:
                fence(stream, held)
        finally:
            _extents.release(held)


def _layers(kind_of: Callable[[str, str], int], dst, src, block_bytes: int):
    """(dst addresses, blocks of the smallest, src addresses, blocks of the smallest, copy
    kind, every MemoryRef) of equal-length lists of memory, one pair per layer, all pairs
    of one kind."""
    if not isinstance(dst, (list, tuple)) or not isinstance(src, (list, tuple)):
        raise InvalidArgumentError(
            "dst and src must both be memory, or both lists of memory (one per layer), "
            f"got {type(dst).__name__} and {type(src).__name__}"
        )
    if len(dst) != len(src):
        raise InvalidArgumentError(
            f"dst and src must pair up layer by layer, got {len(dst)} and {len(src)} layers"
        )
    dsts = _resolve_layers(dst, "dst", writable=True)
    srcs = _resolve_layers(src, "src")
    directions = {(d.device, s.device) for d, s in zip(dsts, srcs)}
    kinds = {kind_of(*direction) for direction in directions}
    if len(kinds) > 1:
        raise InvalidArgumentError(
            "the layers of one block copy must all copy between the same kinds of memory, "
            "got " + ", ".join(sorted(f"{s} -> {d}" for d, s in directions))
        )
    return (
        [d.address for d in dsts],
        min((d.nbytes for d in dsts), default=0) // block_bytes,
        [s.address for s in srcs],
        min((s.nbytes for s in srcs), default=0) // block_bytes,
        kinds.pop() if kinds else 0,
        dsts + srcs,
    )


def _resolve_layers(layers, side: str, writable: bool = False) -> list[MemoryRef]:
    """resolve() of every layer; an error names the layer (its name is built only then: a
    call's layers are many, and formatting a name for each costs more than resolving it)."""
    refs = []
    for memory in layers:
        try:
            refs.append(resolve(memory, side, writable=writable))
        except PdhalError:
            resolve(memory, f"{side}[{len(refs)}]", writable=writable)
            raise
    return refs


def block_bytes_of(cache: object, what: str = "cache") -> int:
    """Bytes of one block of a [blocks, ...] cache (a tensor, array or pdhal buffer with a
    shape): its bytes over its blocks, from its memory (a shared buffer's element size is
    1 whatever its dtype)."""
    shape = list(getattr(cache, "shape", ()))
    if len(shape) < 2 or shape[0] < 1:
        raise InvalidArgumentError(f"{what} must be a [blocks, ...] cache, got shape {shape}")
    nbytes = memory_ref(cache, what).nbytes
    if nbytes is None or nbytes % shape[0]:
        raise InvalidArgumentError(
            f"{what} of shape {shape} holds {nbytes} bytes, not whole blocks"
        )
    return nbytes // shape[0]


class MemorySpan:
    """A range of memory pdhal handed out (host_alloc, cuda_host_alloc, a shared buffer's
    mapping, a registered range), as copy_blocks takes memory: a copy from or to it holds
    the memory it lies in, so a free meanwhile waits for the copy."""

    __slots__ = ("_ref",)

    def __init__(self, ref: MemoryRef):
        self._ref = ref

    @property
    def address(self) -> int:
        return self._ref.address

    @property
    def nbytes(self) -> int:
        return self._ref.nbytes

    @property
    def device(self) -> str:
        return self._ref.device

    def _pdhal_memory_ref(self) -> MemoryRef:
        return self._ref

    def __repr__(self) -> str:
        return f"MemorySpan({self.address:#x}, {self.nbytes}, {self.device!r})"


def memory_span(address: int, nbytes: int | None = None, what: str = "address") -> MemorySpan:
    """[address, +nbytes) inside memory pdhal handed out (nbytes None: to that memory's
    end), checked to lie there; an int address pdhal does not know is refused."""
    validate_index(address, what, 1 << 64)
    extent = _extents.find(address)
    if extent is None:
        raise InvalidArgumentError(
            f"{what} {address:#x} does not lie in memory pdhal handed out (host_alloc, "
            f"cuda_host_alloc, get_data_ptr_ipc, host_register), or that memory was freed"
        )
    have = extent.start + extent.nbytes - address
    if nbytes is None:
        nbytes = have
    elif validate_index(nbytes, "nbytes", 1 << 64) > have:
        raise InvalidArgumentError(
            f"{what} {address:#x} does not hold {nbytes} bytes of the memory pdhal handed out "
            f"there (it holds {have})"
        )
    return MemorySpan(MemoryRef(address, nbytes, extent.device, extent=extent))
