"""Where each layer's blocks are, on one side of a transfer: a CacheLayout lists the memory
regions (what a transport registers) and, per layer, each cache in it (K and V, or any
number per rank) as a region, an offset, a block stride and the bytes of one block.

The runs of a transfer are planned once per set of block pairs (a step's requests) and
reused for every layer: consecutive on both sides, a run is one contiguous copy per cache
when the stride is the block size."""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from dataclasses import dataclass, fields

from pdhal._errors import InvalidArgumentError
from pdhal._memory import extents as _extents
from pdhal._memory.blocks import block_bytes_of, resolve
from pdhal._protocol import core as _core
from pdhal._protocol.names import validate_index
from pdhal._transfer.checks import ADDRESS_MAX, integer, name
from pdhal._transfer.heads import HeadShard

#: The most layers a layout may have (a status slot counts the layers landed in 16 bits).
MOST_LAYERS = 0xFFFF
#: The most caches one layer may have (K and V per rank; a peer's description is bounded).
MOST_CACHES = 0xFFFF
#: The least each CacheSpec field may be (region and offset may be 0; the rest count).
_LEAST = {
    "region": 0,
    "offset": 0,
    "stride": 1,
    "block_bytes": 1,
    "blocks": 1,
    "heads": 1,
    "planes": 1,
    "head_stride": 0,
}
#: The longest element type name a CacheSpec may declare.
MOST_DTYPE_CHARS = 64
#: How a block is ordered (CacheSpec.order): its heads' parts, each its tokens in order
#: (head-major, HND), or its tokens' parts, each its heads in order (token-major, NHD).
ORDERS = ("heads", "tokens")


@dataclass(frozen=True)
class CacheSpec:
    """One cache of one layer: block b is at `offset + b * stride` of region `region`,
    `block_bytes` long, for b in [0, blocks). `heads` > 1: a block is that many equal
    parts, one per KV head, in head order (head-major), so it can be split by head for a
    tensor-parallel peer (pdhal.transfer.head_shards). `dtype`: the element type its
    engine keeps there ("bfloat16", "fp8_e4m3", ...; "" undeclared): two sides that both
    declare one must declare the same, since bytes of the same size can be of another type.
    `planes`: a head's part of a block is that many equal parts, each its tokens in order
    (a head's K tokens, then its V tokens: 2); what a transfer between blocks of two sizes
    needs to find each token. `order`: "heads" (the above: a block is its heads' parts,
    head-major, HND) or "tokens" (a block is its tokens' parts, each its heads' in head
    order: token-major, NHD; one plane); two sides of two orders are converted token by
    token on the way (each token of each head the same bytes on both). `head_stride`: the
    bytes from one head's part of a block to the next where they are not next to each
    other (0: they are): a K (or V) cache inside blocks that keep each head's K and V
    together ([blocks, heads, 2, tokens, dim]: K and V each a spec, heads 2 parts apart, V
    one part in), paired with caches that keep K and V apart, head by head.

    Every field is checked when the spec is made (by a caller or from a peer's
    description): an int (numpy ints converted), region, offset and head_stride >= 0, the
    others >= 1, the block's bytes (its heads, head_stride apart) within stride, heads x
    planes dividing block_bytes, head_stride 0 or at least a head's part (head-major
    only), dtype a name of at most 64 characters, order one of ORDERS;
    InvalidArgumentError otherwise."""

    region: int
    offset: int
    stride: int
    block_bytes: int
    blocks: int
    heads: int = 1
    dtype: str = ""
    planes: int = 1
    order: str = "heads"
    head_stride: int = 0

    def __post_init__(self) -> None:
        for field in fields(self):
            if field.name in ("dtype", "order"):
                continue
            value = integer(
                getattr(self, field.name), f"CacheSpec.{field.name}", _LEAST[field.name]
            )
            object.__setattr__(self, field.name, value)  # frozen: set once, converted
        if (
            not isinstance(self.dtype, str)
            or len(self.dtype) > MOST_DTYPE_CHARS
            or not self.dtype.isprintable()
            or self.dtype != self.dtype.strip()
        ):
            raise InvalidArgumentError(
                f"CacheSpec.dtype must be an element type's name (at most {MOST_DTYPE_CHARS} "
                f"characters) or '' (undeclared), got {self.dtype!r}"
            )
        if self.block_bytes % self.heads:
            raise InvalidArgumentError(
                f"CacheSpec.heads {self.heads} does not divide CacheSpec.block_bytes "
                f"{self.block_bytes}: a block cannot hold that many equal heads"
            )
        if self.block_bytes % (self.heads * self.planes):
            raise InvalidArgumentError(
                f"CacheSpec.planes {self.planes} does not divide a head's "
                f"{self.block_bytes // self.heads} bytes: a head cannot hold that many equal "
                f"planes"
            )
        if self.order not in ORDERS:
            raise InvalidArgumentError(
                f"CacheSpec.order must be one of {', '.join(map(repr, ORDERS))}, got {self.order!r}"
            )
        if self.order == "tokens" and self.planes != 1:
            raise InvalidArgumentError(
                f"CacheSpec.planes {self.planes} with order 'tokens': a token-major block is "
                f"its tokens' parts, each its heads' (one plane)"
            )
        if self.head_stride and self.order != "heads":
            raise InvalidArgumentError(
                f"CacheSpec.head_stride {self.head_stride} with order {self.order!r}: heads "
                f"apart are the parts of a head-major block (order 'heads')"
            )
        if self.head_stride and self.head_stride < self.part_bytes:
            raise InvalidArgumentError(
                f"CacheSpec.head_stride {self.head_stride}: each head's part must be at least "
                f"its {self.part_bytes} bytes past the last (0: next to each other)"
            )
        if self.span > self.stride:
            spans = (
                f"spans {self.span} bytes (heads {self.head_stride} apart)"
                if self.head_stride
                else "is"
            )
            raise InvalidArgumentError(
                f"CacheSpec.block_bytes {self.block_bytes} {spans} more than CacheSpec.stride "
                f"{self.stride}: blocks would overlap (need a block's bytes within a stride)"
            )

    @property
    def part_bytes(self) -> int:
        """The bytes of one head's part of a block."""
        return self.block_bytes // self.heads

    @property
    def head_step(self) -> int:
        """The bytes from one head's part of a block to the next."""
        return self.head_stride or self.part_bytes

    @property
    def span(self) -> int:
        """The bytes from a block's first byte to its last one's end."""
        return (self.heads - 1) * self.head_step + self.part_bytes

    @property
    def end(self) -> int:
        """Where its last block ends in its region."""
        return self.offset + (self.blocks - 1) * self.stride + self.span

    def to_json(self) -> list:
        """Its words; the element type, the planes, the order and the head stride only
        where they are not the defaults (a peer of the last version reads six)."""
        words = [self.region, self.offset, self.stride, self.block_bytes, self.blocks, self.heads]
        if self.head_stride:
            return [*words, self.dtype, self.planes, self.order, self.head_stride]
        if self.order != "heads":
            return [*words, self.dtype, self.planes, self.order]
        if self.planes != 1:
            return [*words, self.dtype, self.planes]
        return [*words, self.dtype] if self.dtype else words

    def head_view(self, first: int, count: int) -> CacheSpec:
        """Heads [first, first + count) of every block (of a head-major block: a
        token-major one's heads are not one stretch of it)."""
        if self.order != "heads":
            raise InvalidArgumentError(
                f"heads [{first}, {first + count}) of {self.heads} of a token-major cache "
                f"(CacheSpec.order 'tokens') are not one stretch of its blocks: a transfer "
                f"between two tensor-parallel splits needs head-major caches"
            )
        return CacheSpec(
            self.region,
            self.offset + first * self.head_step,
            self.stride,
            count * self.part_bytes,
            self.blocks,
            count,
            self.dtype,
            self.planes,
            head_stride=self.head_stride if count > 1 else 0,
        )

    @classmethod
    def from_json(cls, words, what: str = "a cache spec") -> CacheSpec:
        """The spec to_json wrote: [region, offset, stride, block_bytes, blocks(, heads(,
        dtype(, planes(, order(, head_stride)))))], from a peer (untrusted):
        InvalidArgumentError naming `what` if it is anything else."""
        if not isinstance(words, (list, tuple)) or not 5 <= len(words) <= 10:
            raise InvalidArgumentError(
                f"{what} must be [region, offset, stride, block_bytes, blocks, heads, dtype, "
                f"planes, order, head_stride], got {words!r}"
            )
        try:
            return cls(*words)
        except InvalidArgumentError as e:
            raise InvalidArgumentError(f"{what}: {e}") from e


def _rows(layers: object, what: str) -> list[list]:
    """`layers` as a list of lists (list or tuple at each level), bounded in size; an
    InvalidArgumentError naming `what` for any other shape."""
    if not isinstance(layers, (list, tuple)):
        raise InvalidArgumentError(f"{what} must be a list of layers, got {layers!r}")
    if not layers:
        raise InvalidArgumentError(f"{what} must have at least one layer")
    if len(layers) > MOST_LAYERS:
        raise InvalidArgumentError(
            f"{what}: a cache layout has at most {MOST_LAYERS} layers, got {len(layers)}"
        )
    rows = []
    for layer, caches in enumerate(layers):
        if not isinstance(caches, (list, tuple)):
            raise InvalidArgumentError(
                f"{what}: layer {layer} must be a list of caches, got {caches!r}"
            )
        if not caches:
            raise InvalidArgumentError(f"{what}: layer {layer} has no cache (need at least one)")
        if len(caches) > MOST_CACHES:
            raise InvalidArgumentError(
                f"{what}: layer {layer} has {len(caches)} caches, at most {MOST_CACHES}"
            )
        rows.append(list(caches))
    return rows


class CacheLayout:
    """Regions (memory pdhal can name: tensors, arrays, pdhal buffers) and, per layer, its
    caches.

    The layout keeps each region's object (`memory`): memory Python owns (a numpy array, a
    torch or Paddle tensor) lives as long as the layout. Memory pdhal hands out (host_alloc,
    a shared buffer, a registered range) is freed explicitly; an object that copies from
    the layout for its whole life pins it (`pin`), and a free meanwhile is refused."""

    def __init__(self, regions: list, layers: list[list[CacheSpec]]):
        if not isinstance(regions, (list, tuple)) or not regions:
            raise InvalidArgumentError(
                f"regions must be a non-empty list of memory (tensors, arrays, pdhal "
                f"buffers), got {regions!r}"
            )
        #: The memory objects, for a transport to register or share.
        self.memory = list(regions)
        #: (address, bytes) of each region.
        self.regions = []
        #: The kind of memory each region is ("cpu", "gpu", "xpu": its device before ":").
        self.kinds = []
        # The pdhal memory each region lies in (what pin() pins): a region's own extent, or
        # the one an array over pdhal memory (HostBuffer.as_numpy) lies in.
        self._extents = []
        for index, region in enumerate(self.memory):
            ref = resolve(region, f"region {index}")
            self.regions.append((ref.address, ref.nbytes))
            self.kinds.append(ref.device.split(":")[0])
            if ref.extent is not None:
                self._extents.append(ref.extent)
        self.layers = _rows(layers, "layers")
        sizes = [n for _, n in self.regions]
        for layer, caches in enumerate(self.layers):
            for index, spec in enumerate(caches):
                if not isinstance(spec, CacheSpec):
                    raise InvalidArgumentError(
                        f"layers[{layer}][{index}] must be a CacheSpec, got {spec!r}"
                    )
                _fits(spec, sizes, f"layer {layer}'s cache", "the layout")
        _refuse_overlaps(self.layers)
        self._pin_lock = threading.Lock()

    def pin(self, owner: str) -> Callable[[], None]:
        """Refuse to free the pdhal memory of this layout's regions (host_free, close,
        unset_data_ipc: MemoryPinnedError naming `owner`) until the returned callable is
        called; ops on that memory go on as before. For an object that copies from or into
        the layout for its whole life (KVStreamer, KVReceiver): pin in its constructor,
        unpin in close(). Calling the unpin twice is harmless; thread-safe.
        ClosedHandleError if a region's memory was freed already."""
        owner = name(owner, "owner")
        pinned = _extents.pin(self._extents, owner)
        done = False

        def unpin() -> None:
            nonlocal done
            with self._pin_lock:
                if done:
                    return
                done = True
            _extents.unpin(pinned, owner)

        return unpin

    @classmethod
    def from_caches(cls, layers, heads: int = 1, dtype: str = "") -> CacheLayout:
        """The layout of `layers`: per layer, a list of [blocks, ...] caches (tensors,
        arrays, pdhal buffers), each its own region; `heads`: each block is that many KV
        heads, head-major (CacheSpec.heads); `dtype`: the element type the engine keeps in
        them (CacheSpec.dtype; a tensor's own may be only its storage, uint8 for fp8)."""
        regions, specs = [], []
        for layer, caches in enumerate(_rows(layers, "layers")):
            row = []
            for index, cache in enumerate(caches):
                what = f"layer {layer} cache {index}"
                block = block_bytes_of(cache, what)
                nbytes = resolve(cache, what).nbytes
                row.append(CacheSpec(len(regions), 0, block, block, nbytes // block, heads, dtype))
                regions.append(cache)
            specs.append(row)
        return cls(regions, specs)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def num_blocks(self) -> int:
        """The blocks every cache has (the fewest any has): the block ids valid here."""
        return min(spec.blocks for caches in self.layers for spec in caches)

    def describe(self) -> dict:
        """The layout as JSON-able data, without addresses (a peer has its own), with the
        kind of memory each region is (a transport may move some pairs of kinds only)."""
        return {
            "regions": [n for _, n in self.regions],
            "memory": list(self.kinds),
            "layers": [[spec.to_json() for spec in caches] for caches in self.layers],
        }

    def head_view(self, first: int, count: int) -> CacheLayout:
        """The same regions, every cache restricted to heads [first, first + count)."""
        first, count = integer(first, "first"), integer(count, "count", 1)
        return CacheLayout(self.memory, _head_view(self.layers, first, count, "here"))

    def check_peer(
        self, peer: dict, heads: HeadShard | None = None, tokens: tuple[int, int] | None = None
    ) -> list[list[CacheSpec]]:
        """A peer's described layout (its describe(): untrusted), checked to pair with this
        one cache by cache: as many layers and caches, blocks of the same bytes, each cache
        inside the region size the peer gives. With `heads`, the shard's heads of each (this
        side's and the peer's) must pair: a head the same bytes on both. With `tokens`
        (this side's block tokens, the peer's) of two sizes, a token of each head must be
        the same bytes on both instead (a head's part of a block is its tokens in order).
        Its layers, or InvalidArgumentError saying what is wrong."""
        if heads is not None and not isinstance(heads, HeadShard):
            raise InvalidArgumentError(f"heads must be a HeadShard or None, got {heads!r}")
        if not isinstance(peer, dict):
            raise InvalidArgumentError(
                f"the peer's layout must be a CacheLayout.describe() dict, got {peer!r}"
            )
        missing = [key for key in ("regions", "layers") if key not in peer]
        if missing:
            raise InvalidArgumentError(
                f"the peer's layout lacks {', '.join(map(repr, missing))} (got the keys "
                f"{sorted(map(str, peer))}): it must be a CacheLayout.describe()"
            )
        sizes = peer["regions"]
        if not isinstance(sizes, (list, tuple)) or not sizes:
            raise InvalidArgumentError(
                f"the peer's layout 'regions' must be a non-empty list of sizes, got {sizes!r}"
            )
        sizes = [
            integer(n, f"the peer's layout region {index}'s size") for index, n in enumerate(sizes)
        ]
        rows = _rows(peer["layers"], "the peer's layout 'layers'")
        CacheLayout._pair_shape(self.layers, rows)
        layers = []
        for layer, caches in enumerate(rows):
            row = []
            for index, words in enumerate(caches):
                what = f"the peer's layer {layer} cache {index}"
                spec = CacheSpec.from_json(words, what)
                _fits(spec, sizes, what, "the peer's layout")
                row.append(spec)
            layers.append(row)
        mine = self.layers
        if heads is not None:
            mine = _head_view(self.layers, heads.src_first, heads.count, "here")
            layers = _head_view(layers, heads.dst_first, heads.count, "on the peer")
        _pair_heads_apart(mine, layers)  # (of the same shape: checked above)
        if _piecewise(mine, layers, tokens):
            if tokens is None:
                raise InvalidArgumentError(
                    "caches of two orders (CacheSpec.order) pair token by token: give both "
                    "sides' block tokens"
                )
            return CacheLayout._pair_tokens(mine, layers, tokens)
        if tokens is not None and tokens[0] != tokens[1]:
            return CacheLayout._pair_tokens(mine, layers, tokens)
        return CacheLayout._pair(mine, layers, heads.count if heads is not None else 0)

    @staticmethod
    def _pair_shape(ours, layers) -> None:
        if [len(c) for c in layers] != [len(c) for c in ours]:
            raise InvalidArgumentError(
                f"the peer's cache has {len(layers)} layers of {[len(c) for c in layers]} "
                f"caches, this side {len(ours)} of {[len(c) for c in ours]}"
            )

    @staticmethod
    def _pair(ours, layers, heads: int = 0) -> list[list[CacheSpec]]:
        CacheLayout._pair_shape(ours, layers)
        for layer, (mine, theirs) in enumerate(zip(ours, layers)):
            for index, (a, b) in enumerate(zip(mine, theirs)):
                _same_dtype(a, b, f"layer {layer} cache {index}")
                if a.planes != b.planes:
                    raise InvalidArgumentError(
                        f"layer {layer} cache {index}: a head's part of a block is "
                        f"{a.planes} plane(s) here, {b.planes} on the peer: the two sides lay "
                        f"out a block's bytes otherwise (CacheSpec.planes)"
                    )
                if a.block_bytes == b.block_bytes:
                    continue
                if heads:
                    raise InvalidArgumentError(
                        f"layer {layer} cache {index}: a head's part of a block is "
                        f"{a.block_bytes // heads} bytes here, {b.block_bytes // heads} on "
                        f"the peer (head size, block tokens or dtype differ)"
                    )
                raise InvalidArgumentError(
                    f"layer {layer} cache {index}: blocks of {a.block_bytes} bytes here, "
                    f"{b.block_bytes} on the peer"
                )
        return layers

    @staticmethod
    def _pair_tokens(ours, layers, tokens: tuple[int, int]) -> list[list[CacheSpec]]:
        """Caches of blocks of `tokens` (here, on the peer) tokens: each plane of each
        head's part of a block holds its tokens in order, of the same bytes on both
        sides."""
        CacheLayout._pair_shape(ours, layers)
        for layer, (mine, theirs) in enumerate(zip(ours, layers)):
            for index, (a, b) in enumerate(zip(mine, theirs)):
                what = f"layer {layer} cache {index}"
                if (a.heads, a.planes) != (b.heads, b.planes):
                    raise InvalidArgumentError(
                        f"{what}: {a.heads} KV head(s) of {a.planes} plane(s) per block here, "
                        f"{b.heads} of {b.planes} on the peer"
                    )
                parts = a.heads * a.planes
                for spec, count, where in ((a, tokens[0], "here"), (b, tokens[1], "on the peer")):
                    if spec.block_bytes % (parts * count):
                        raise InvalidArgumentError(
                            f"{what}: a block of {spec.block_bytes} bytes {where} is not "
                            f"{spec.heads} head(s) of {spec.planes} plane(s) of {count} tokens "
                            f"each"
                        )
                if a.block_bytes * tokens[1] != b.block_bytes * tokens[0]:
                    raise InvalidArgumentError(
                        f"{what}: a token of a head is {a.block_bytes // (parts * tokens[0])} "
                        f"bytes here (blocks of {tokens[0]} tokens), "
                        f"{b.block_bytes // (parts * tokens[1])} on the peer (blocks of "
                        f"{tokens[1]}): head size or dtype differ"
                    )
                _same_dtype(a, b, what)
        return layers


def _piecewise(ours, theirs, tokens: tuple[int, int] | None) -> bool:
    """Whether two paired layouts' blocks must be copied token by token and head by head:
    a cache of another order on each side, or a token-major one in blocks of two sizes
    (a stretch of one head's tokens is not one piece of it)."""
    sizes_differ = tokens is not None and tokens[0] != tokens[1]
    return any(
        a.order != b.order or (sizes_differ and "tokens" in (a.order, b.order))
        for mine, peer in zip(ours, theirs)
        for a, b in zip(mine, peer)
    )


def _pair_heads_apart(ours, theirs) -> None:
    """Refuse a cache whose heads are apart (CacheSpec.head_stride) on either side unless
    both are head-major with as many heads: such a pair is copied head by head."""
    for layer, (mine, peer) in enumerate(zip(ours, theirs)):
        for index, (a, b) in enumerate(zip(mine, peer)):
            if (a.head_stride or b.head_stride) and (
                a.order != "heads" or b.order != "heads" or a.heads != b.heads
            ):
                raise InvalidArgumentError(
                    f"layer {layer} cache {index}: heads apart (CacheSpec.head_stride "
                    f"{a.head_stride} here, {b.head_stride} on the peer) pair head by head "
                    f"with a head-major cache of as many heads; here {a.heads} head(s), "
                    f"{a.order!r} order, on the peer {b.heads}, {b.order!r}"
                )


def _head_by_head(mine: list[CacheSpec], theirs: list[CacheSpec]) -> list[tuple]:
    """The pairs of caches of one layer, a pair whose heads are apart on either side as
    one pair per head (_pair_heads_apart checked they pair so), in the destination's order
    (a block is copied cache by cache in this order: where each head keeps its K and V
    together, K and V of a head in turn, so the block is written front to back); caches
    that fill whole blocks alike on both sides as one pair."""
    whole = _whole_blocks(mine, theirs)
    if whole is not None:
        return [whole]
    pairs = []
    for a, b in zip(mine, theirs):
        if a.head_stride or b.head_stride:
            pairs += [(a.head_view(h, 1), b.head_view(h, 1)) for h in range(a.heads)]
        else:
            pairs.append((a, b))
    return sorted(pairs, key=lambda pair: (pair[1].region, pair[1].offset))


def _whole_blocks(mine: list[CacheSpec], theirs: list[CacheSpec]) -> tuple | None:
    """One pair of whole blocks for a layer's caches that, on both sides, lie in one region
    at one stride and fill each block's bytes without a gap, laid out alike (K and V
    together head by head on both sides: a copy per block run, not per head); None where
    they do not. Paired caches of the same block bytes, head-major, hold the same tokens
    (check_peer: a token of a head is the same bytes on both sides)."""
    if len(mine) < 2:
        return None

    def shape(caches: list[CacheSpec]) -> tuple | None:
        first = min(spec.offset for spec in caches)
        pieces = sorted(
            (spec.offset - first + h * spec.head_step, spec.part_bytes)
            for spec in caches
            for h in range(spec.heads)
        )
        if len({(s.region, s.stride) for s in caches}) != 1 or any(
            start != sum(n for _, n in pieces[:i]) for i, (start, _) in enumerate(pieces)
        ):
            return None
        return (
            first,
            sum(n for _, n in pieces),
            [(s.offset - first, s.heads, s.head_step) for s in caches],
        )

    here, there = shape(mine), shape(theirs)
    if here is None or there is None or here[1:] != there[1:]:
        return None
    if here[1] > mine[0].stride or there[1] > theirs[0].stride:
        return None  # (a peer's caches over each other's bytes: each copied as it says)
    if any(
        "tokens" in (a.order, b.order) or a.planes != b.planes or a.block_bytes != b.block_bytes
        for a, b in zip(mine, theirs)
    ):
        return None
    a, b = mine[0], theirs[0]
    return (
        CacheSpec(a.region, here[0], a.stride, here[1], min(s.blocks for s in mine)),
        CacheSpec(b.region, there[0], b.stride, there[1], min(s.blocks for s in theirs)),
    )


def _same_dtype(a: CacheSpec, b: CacheSpec, what: str) -> None:
    """Refuse two caches that both declare an element type, of two types."""
    if a.dtype and b.dtype and a.dtype != b.dtype:
        raise InvalidArgumentError(
            f"{what}: elements of {a.dtype!r} here, {b.dtype!r} on the peer (the same bytes "
            f"would be read as another type; pdhal converts no element type)"
        )


def _fits(spec: CacheSpec, sizes: list[int], what: str, where: str) -> None:
    """`spec`'s region is one of `sizes` (the bytes of each region of `where`), and its
    blocks end within it."""
    if spec.region >= len(sizes):
        raise InvalidArgumentError(f"{what} names region {spec.region}; {where} has {len(sizes)}")
    if spec.end > sizes[spec.region]:
        raise InvalidArgumentError(
            f"{what} ends at byte {spec.end} of region {spec.region}, which holds "
            f"{sizes[spec.region]}"
        )


#: The most heads apart a cache's parts are looked at one by one when overlaps are looked
#: for; a cache of more is taken as the whole of its span.
MOST_PARTS_APART = 4096


def _refuse_overlaps(layers: list[list[CacheSpec]]) -> None:
    """Refuse two caches of a layout whose bytes overlap (InvalidArgumentError naming
    both): a transfer into one would land over the other's, reported landed. Caches whose
    spans (first block to last) meet at one stride must keep their parts of a block apart
    (K and V together); at two strides they are not looked into."""
    by_region: dict[int, list] = {}
    for layer, caches in enumerate(layers):
        for index, spec in enumerate(caches):
            by_region.setdefault(spec.region, []).append(
                (spec.offset, spec.end, layer, index, spec)
            )
    for extents in by_region.values():
        extents.sort(key=lambda extent: extent[0])
        open_: list = []
        for extent in extents:
            open_ = [other for other in open_ if other[1] > extent[0]]
            for other in open_:
                a, b = other[4], extent[4]
                if a.stride == b.stride and _meet(_pieces(a), _pieces(b)):
                    raise InvalidArgumentError(
                        f"layer {other[2]} cache {other[3]} and layer {extent[2]} cache "
                        f"{extent[3]} overlap in region {a.region} (offsets {a.offset} and "
                        f"{b.offset}, stride {a.stride}): one would land over the other"
                    )
            open_.append(extent)


def _pieces(spec: CacheSpec) -> list[tuple[int, int]]:
    """The [start, end) of `spec`'s bytes within a stride, from its offset modulo the
    stride (a piece past the stride's end split in two), sorted."""
    if spec.head_stride and spec.heads <= MOST_PARTS_APART:
        spans = [(spec.offset + h * spec.head_step, spec.part_bytes) for h in range(spec.heads)]
    else:
        spans = [(spec.offset, spec.span)]
    pieces = []
    for start, length in spans:
        start %= spec.stride
        pieces.append((start, min(start + length, spec.stride)))
        if start + length > spec.stride:
            pieces.append((0, start + length - spec.stride))
    return sorted(pieces)


def _meet(ours: list[tuple[int, int]], theirs: list[tuple[int, int]]) -> bool:
    """Whether two sorted lists of [start, end) share a byte."""
    i = j = 0
    while i < len(ours) and j < len(theirs):
        if ours[i][0] < theirs[j][1] and theirs[j][0] < ours[i][1]:
            return True
        if ours[i][1] <= theirs[j][1]:
            i += 1
        else:
            j += 1
    return False


def _head_view(layers, first: int, count: int, where: str) -> list[list[CacheSpec]]:
    """`layers` with every cache restricted to heads [first, first + count); refused
    where a cache does not hold those heads."""
    for layer, caches in enumerate(layers):
        for index, spec in enumerate(caches):
            if not (0 <= first and 1 <= count and first + count <= spec.heads):
                raise InvalidArgumentError(
                    f"layer {layer} cache {index} holds {spec.heads} head(s) {where}: it has "
                    f"no heads [{first}, {first + count}) (a tensor-parallel transfer needs "
                    f"head-major caches with CacheSpec.heads counted)"
                )
    if all(first == 0 and count == spec.heads for caches in layers for spec in caches):
        return [list(caches) for caches in layers]  # every head: the whole blocks
    return [[spec.head_view(first, count) for spec in caches] for caches in layers]


#: The most a block id or a run's block count may be.
MOST_BLOCKS = 1 << 40
#: The most units (the tokens two block sizes are multiples of) a block may be: what the
#: copier expands (pdhal_copier_post_units).
MOST_UNITS = 1 << 24


def block_runs(src_blocks: list[int], dst_blocks: list[int]) -> list[tuple[int, int, int]]:
    """(first source block, first destination block, count) of each run of pairs that are
    consecutive on both sides."""
    if len(src_blocks) != len(dst_blocks):
        raise InvalidArgumentError(
            f"source and destination blocks must pair up, got {len(src_blocks)} and "
            f"{len(dst_blocks)}"
        )
    runs: list[list[int]] = []
    for s, d in zip(src_blocks, dst_blocks):
        validate_index(s, "source block", MOST_BLOCKS)
        validate_index(d, "destination block", MOST_BLOCKS)
        extend_runs(runs, s, d, 1)
    return [tuple(r) for r in runs]


def extend_runs(runs: list[list[int]], src: int, dst: int, count: int) -> None:
    """Append the run [src, dst, count] to `runs`, as part of the last one where it goes on
    from it on both sides."""
    if runs and runs[-1][0] + runs[-1][2] == src and runs[-1][1] + runs[-1][2] == dst:
        runs[-1][2] += count
    else:
        runs.append([src, dst, count])


#: LayerCopies' fields per cache, and the least each may be.
_CACHE_FIELDS = (
    "source address",
    "source stride",
    "region",
    "offset",
    "destination stride",
    "block bytes",
)
_CACHE_LEAST = (0, 1, 0, 0, 1, 1)
#: BlockRuns' fields per run.
_RUN_FIELDS = ("first source block", "first destination block", "count")


def _rows_of(values, what: str, each: str, item: str, fields: tuple[str, ...]) -> list:
    """`values` as a list, each a tuple or list of len(fields) values: InvalidArgumentError
    naming `what` (a list of `each`) or the first `item` that is not."""
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise InvalidArgumentError(f"{what} must be a list of {each}, got {values!r}")
    rows = list(values)
    for index, row in enumerate(rows):
        if not isinstance(row, (tuple, list)) or len(row) != len(fields):
            raise InvalidArgumentError(f"{item} {index} must be ({', '.join(fields)}), got {row!r}")
    return rows


class BlockRuns:
    """The block runs of one step's requests to one destination (block_runs' tuples:
    first source block, first destination block, count), planned once and sent in every
    layer; `words` packs them for a transport that takes them whole (Link.submit_blocks).
    Each field is checked when made (an int, ids in [0, 2**40), a count in [1, 2**40]:
    InvalidArgumentError naming it); the runs cannot change after."""

    __slots__ = ("_runs", "_words")

    def __init__(self, runs):
        checked = []
        for index, run in enumerate(_rows_of(runs, "block runs", "runs", "block run", _RUN_FIELDS)):
            src, dst, count = run
            if not (  # plain ints in bounds, else the slow path names what is wrong
                type(src) is int
                and type(dst) is int
                and type(count) is int
                and 0 <= src < MOST_BLOCKS
                and 0 <= dst < MOST_BLOCKS
                and 1 <= count <= MOST_BLOCKS
            ):
                src = integer(src, f"block run {index}'s source block", 0, MOST_BLOCKS - 1)
                dst = integer(dst, f"block run {index}'s destination block", 0, MOST_BLOCKS - 1)
                count = integer(count, f"block run {index}'s count", 1, MOST_BLOCKS)
            checked.append((src, dst, count))
        self._runs = tuple(checked)
        self._words = None

    @property
    def runs(self) -> tuple[tuple[int, int, int], ...]:
        return self._runs

    @property
    def words(self):
        """The runs as C's int64_t[3 * len(runs)] (made on first use)."""
        if self._words is None:
            self._words = _core.block_run_words(self._runs)
        return self._words

    def __len__(self) -> int:
        return len(self._runs)


class LayerCopies:
    """One layer's caches, paired across the two sides: how block runs become byte copies
    in it (copies(), in Python; `caches`, for a transport that expands them in C). Each
    cache is (source address, source stride, destination region, its offset, its stride,
    block bytes), checked when made (ints; strides and block bytes at least 1, block bytes
    at most either stride: InvalidArgumentError naming the field)."""

    __slots__ = ("_caches", "_packed")

    def __init__(self, caches):
        checked = []
        for index, cache in enumerate(_rows_of(caches, "caches", "caches", "cache", _CACHE_FIELDS)):
            values = [
                integer(value, f"cache {index}'s {field}", low, ADDRESS_MAX)
                for value, field, low in zip(cache, _CACHE_FIELDS, _CACHE_LEAST)
            ]
            block = values[-1]
            if block > values[1] or block > values[4]:
                raise InvalidArgumentError(
                    f"cache {index}'s blocks of {block} bytes are longer than its strides "
                    f"({values[1]} here, {values[4]} there): blocks would overlap"
                )
            checked.append(tuple(values))
        self._caches = tuple(checked)
        self._packed = None

    @property
    def caches(self):
        """The caches as C's pdhal_copy_cache[] (made on first use)."""
        if self._packed is None:
            self._packed = _core.copy_caches(self._caches)
        return self._packed

    @property
    def count(self) -> int:
        return len(self._caches)

    def copies(self, runs) -> list[tuple[int, int, int, int]]:
        """The byte copies (source address, region, offset, bytes) of block `runs`: one per
        run and cache where both strides are the block size, else one per block."""
        out = []
        for base, s_stride, region, offset, d_stride, block in self._caches:
            if s_stride == block == d_stride:
                out += [
                    (base + s * s_stride, region, offset + d * d_stride, n * block)
                    for s, d, n in runs
                ]
            else:
                out += [
                    (base + (s + i) * s_stride, region, offset + (d + i) * d_stride, block)
                    for s, d, n in runs
                    for i in range(n)
                ]
        return out


def units_of(here: int, there: int) -> tuple[int, tuple[int, int]]:
    """The unit of blocks of `here` and `there` tokens (the tokens both are multiples of)
    and how many of them each block is; InvalidArgumentError past MOST_UNITS."""
    unit = math.gcd(here, there)
    units = (here // unit, there // unit)
    if max(units) > MOST_UNITS:
        raise InvalidArgumentError(
            f"blocks of {here} tokens here and {there} there are {units[0]} and {units[1]} "
            f"units of {unit} tokens: at most {MOST_UNITS} units a block"
        )
    return unit, units


class UnitCopies(LayerCopies):
    """One layer's caches paired across sides whose blocks hold different numbers of
    tokens: the runs are of units of the tokens both block sizes are multiples of, named
    by virtual ids (block * units per block + the unit's place in it) on each side, so
    block_runs coalesces them as it does blocks. A unit is, per KV head, a stretch of that
    head's tokens in its block; copies() makes one copy per head and per stretch of a run
    that stays in one block on both sides. Made by RunPlanner from checked layouts; its
    copies are expanded by copies() (Link.submit_blocks' default), or in C from `caches`,
    `heads` and `units` (shm)."""

    __slots__ = ("units", "_unit_caches", "_heads", "_heads_packed")

    def __init__(self, caches, heads: list[int], src_units: int, dst_units: int):
        """`caches` as LayerCopies takes them, with a unit's bytes (all its heads) as the
        block bytes; `heads`: each cache's parts (KV heads x planes), each its tokens in
        order; a source block is `src_units` units, a
        destination block `dst_units`."""
        super().__init__(caches)
        self.units = (src_units, dst_units)
        self._heads, self._heads_packed = tuple(heads), None
        self._unit_caches = tuple(
            (base, s_stride, region, offset, d_stride, n, unit // n)
            for (base, s_stride, region, offset, d_stride, unit), n in zip(self._caches, heads)
        )

    @property
    def heads(self):
        """Each cache's parts (KV heads x planes) as C's uint32_t[] (made on first use)."""
        if self._heads_packed is None:
            self._heads_packed = _core.head_counts(self._heads)
        return self._heads_packed

    def copies(self, runs) -> list[tuple[int, int, int, int]]:
        """The byte copies of unit `runs`: per cache, per stretch of a run inside one
        block on both sides, one per head."""
        src_units, dst_units = self.units
        out = []
        for base, s_stride, region, offset, d_stride, heads, unit in self._unit_caches:
            s_head, d_head = unit * src_units, unit * dst_units  # a head's part of a block
            for s, d, n in runs:
                while n:
                    s_block, s_unit = divmod(s, src_units)
                    d_block, d_unit = divmod(d, dst_units)
                    k = min(n, src_units - s_unit, dst_units - d_unit)
                    src = base + s_block * s_stride + s_unit * unit
                    dst = offset + d_block * d_stride + d_unit * unit
                    out += [
                        (src + h * s_head, region, dst + h * d_head, k * unit) for h in range(heads)
                    ]
                    s, d, n = s + k, d + k, n - k
        return out


class PieceCopies(UnitCopies):
    """One layer's caches paired across sides of two orders inside a block (CacheSpec.order:
    head-major on one, token-major on the other), or token-major ones of two block sizes:
    UnitCopies whose units are single tokens, each token of each part (a head's plane)
    copied from where this side's order keeps it to where the other's does; pieces next to
    each other on both sides go as one copy. Made by RunPlanner from checked layouts; its
    copies are expanded by copies() (Link.submit_blocks' default), or in C from `caches`,
    `heads` (each cache's parts), `units` and `orders` (shm)."""

    __slots__ = ("_orders", "_strides", "_packed_orders")

    def __init__(
        self,
        caches,
        parts: list[int],
        orders: list[tuple[str, str]],
        src_tokens: int,
        dst_tokens: int,
    ):
        """`caches` as LayerCopies takes them, with a token's bytes (all its parts) as the
        block bytes; `parts`: each cache's heads x planes; `orders`: each cache's (source
        order, destination order); blocks of `src_tokens` and `dst_tokens`."""
        super().__init__(caches, parts, src_tokens, dst_tokens)
        self._packed_orders = None
        self._orders = tuple(
            (src == "tokens") * _core.SRC_TOKEN_MAJOR + (dst == "tokens") * _core.DST_TOKEN_MAJOR
            for src, dst in orders
        )
        # each cache's (source, destination) steps: from one part to the next, and from one
        # token to the next
        self._strides = tuple(
            (_strides(src, n, src_tokens, piece), _strides(dst, n, dst_tokens, piece))
            for (*_, n, piece), (src, dst) in zip(self._unit_caches, orders)
        )

    @property
    def orders(self):
        """Each cache's orders as C's uint8_t[] of PDHAL_*_TOKEN_MAJOR (made on first use)."""
        if self._packed_orders is None:
            self._packed_orders = _core.order_masks(self._orders)
        return self._packed_orders

    def copies(self, runs) -> list[tuple[int, int, int, int]]:
        """The byte copies of token `runs`: per cache, per token, per part, merged where
        the next piece follows the last on both sides."""
        src_tokens, dst_tokens = self.units
        out: list[tuple[int, int, int, int]] = []
        for (base, s_stride, region, offset, d_stride, parts, piece), (s_at, d_at) in zip(
            self._unit_caches, self._strides
        ):
            start = len(out)
            for s, d, n in runs:
                for i in range(n):
                    s_block, s_token = divmod(s + i, src_tokens)
                    d_block, d_token = divmod(d + i, dst_tokens)
                    src = base + s_block * s_stride + s_token * s_at[1]
                    dst = offset + d_block * d_stride + d_token * d_at[1]
                    for part in range(parts):
                        a, b = src + part * s_at[0], dst + part * d_at[0]
                        if len(out) > start:
                            last = out[-1]
                            if last[0] + last[3] == a and last[2] + last[3] == b:
                                out[-1] = (last[0], region, last[2], last[3] + piece)
                                continue
                        out.append((a, region, b, piece))
        return out


def _strides(order: str, parts: int, tokens: int, piece: int) -> tuple[int, int]:
    """(bytes from one part, a head's plane, to the next; from one token to the next) in
    a block of `order` of `parts` parts and `tokens` tokens, `piece` bytes each."""
    return (tokens * piece, piece) if order == "heads" else (piece, parts * piece)


class RunPlanner:
    """The byte copies of block runs from a source layout into a destination's layers:
    (source address, destination region, destination offset, bytes), one per run and
    cache (one per block where a stride is not the block size). What each layer needs is
    worked out once; src_blocks and dst_blocks are the fewest blocks of any layer's cache
    on each side, which block ids are checked against (KVStreamer, before they are sent).

    `tokens`: the tokens of a block here and on the destination; of two sizes, the runs
    are of units (UnitCopies) of `unit_tokens`, `units` = (units per source block, per
    destination block); else units are blocks, (1, 1). Caches of two orders (or
    token-major ones of two block sizes) are copied token by token (PieceCopies: units of
    one token). A cache whose heads are apart on either side (CacheSpec.head_stride) is
    copied head by head, each head's part a cache of its own."""

    def __init__(
        self,
        src: CacheLayout,
        dst_layers: list[list[CacheSpec]],
        tokens: tuple[int, int] | None = None,
    ):
        tokens = tokens or (1, 1)
        self.piecewise = _piecewise(src.layers, dst_layers, tokens)
        if self.piecewise:
            units_of(*tokens)  # (bounded as units are)
            self.unit_tokens, self.units = 1, tokens
        else:
            self.unit_tokens, self.units = units_of(*tokens)
        self._layers = []
        for mine, theirs in zip(src.layers, dst_layers):
            pairs = _head_by_head(mine, theirs)
            caches = [
                (
                    src.regions[s.region][0] + s.offset,
                    s.stride,
                    d.region,
                    d.offset,
                    d.stride,
                    s.block_bytes,
                )
                for s, d in pairs
            ]
            self._layers.append(
                self._copies(
                    caches,
                    [s.heads * s.planes for s, _ in pairs],
                    [(s.order, d.order) for s, d in pairs],
                )
            )
        self.src_blocks = min(s.blocks for caches in src.layers for s in caches)
        self.dst_blocks = min(d.blocks for caches in dst_layers for d in caches)
        #: Bytes one unit (block) is in each layer, all its caches together.
        self.block_bytes = [
            sum(s.block_bytes for s in caches) // self.units[0] for caches in src.layers
        ]

    def _copies(
        self, caches: list[tuple], heads: list[int], orders: list[tuple[str, str]]
    ) -> LayerCopies:
        if self.units == (1, 1) and not self.piecewise:
            return LayerCopies(caches)
        unit = [(*cache[:5], cache[5] // self.units[0]) for cache in caches]  # a unit's bytes
        if self.piecewise:
            return PieceCopies(unit, heads, orders, *self.units)
        return UnitCopies(unit, heads, *self.units)

    def layer(self, layer: int) -> LayerCopies:
        """How block runs become copies in `layer`."""
        return self._layers[layer]

    def copies(self, layer: int, runs) -> list[tuple[int, int, int, int]]:
        """The copies of `runs` in `layer` (ids within src_blocks and dst_blocks)."""
        return self._layers[layer].copies(runs)
