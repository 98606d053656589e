"""Where each layer's blocks are, on one side of a transfer: a CacheLayout lists the memory
regions (what a transport registers) and, per layer, each cache in it (K and V, or any
number per rank) as a region, an offset, a block stride and the bytes of one block.

The runs of a transfer are planned once per set of block pairs (a step's requests) and
reused for every layer: consecutive on both sides, a run is one contiguous copy per cache
when the stride is the block size."""

from __future__ import annotations

from dataclasses import dataclass

from pdhal._errors import InvalidArgumentError
from pdhal._memory.blocks import block_bytes_of, resolve
from pdhal._protocol.names import validate_index
from pdhal._transfer.heads import HeadShard

#: The longest timeout pdhal.transfer takes (a day): beyond it, a bound means nothing.
LONGEST_S = 86400.0
#: The most layers a layout may have (a status slot counts the layers landed in 16 bits).
MOST_LAYERS = 0xFFFF


def seconds(value: object, what: str) -> float:
    """`value` as a timeout in seconds: a number > 0 and at most a day."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidArgumentError(f"{what} must be a number of seconds, got {value!r}")
    if not 0 < value <= LONGEST_S:
        raise InvalidArgumentError(f"{what} must be in (0, {LONGEST_S:g}] seconds, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class CacheSpec:
    """One cache of one layer: block b is at `offset + b * stride` of region `region`,
    `block_bytes` long, for b in [0, blocks). `heads` > 1: a block is that many equal
    parts, one per KV head, in head order (head-major), so it can be split by head for a
    tensor-parallel peer (pdhal.transfer.head_shards)."""

    region: int
    offset: int
    stride: int
    block_bytes: int
    blocks: int
    heads: int = 1

    def to_json(self) -> list[int]:
        return [self.region, self.offset, self.stride, self.block_bytes, self.blocks, self.heads]

    def head_view(self, first: int, count: int) -> CacheSpec:
        """Heads [first, first + count) of every block."""
        per_head = self.block_bytes // self.heads
        return CacheSpec(
            self.region,
            self.offset + first * per_head,
            self.stride,
            count * per_head,
            self.blocks,
            count,
        )

    @classmethod
    def from_json(cls, words) -> CacheSpec:
        return cls(*(int(w) for w in words))


class CacheLayout:
    """Regions (memory pdhal can name: tensors, arrays, pdhal buffers) and, per layer, its
    caches."""

    def __init__(self, regions: list, layers: list[list[CacheSpec]]):
        #: The memory objects, for a transport to register or share.
        self.memory = list(regions)
        #: (address, bytes) of each region.
        self.regions = []
        for index, region in enumerate(self.memory):
            ref = resolve(region, f"region {index}")
            self.regions.append((ref.address, ref.nbytes))
        self.layers = [list(caches) for caches in layers]
        if not self.layers or any(not caches for caches in self.layers):
            raise InvalidArgumentError("a cache layout needs at least one cache in every layer")
        if len(self.layers) > MOST_LAYERS:
            raise InvalidArgumentError(
                f"a cache layout has at most {MOST_LAYERS} layers, got {len(self.layers)}"
            )
        for layer, caches in enumerate(self.layers):
            for spec in caches:
                self._check(layer, spec)

    def _check(self, layer: int, spec: CacheSpec) -> None:
        if not 0 <= spec.region < len(self.regions):
            raise InvalidArgumentError(
                f"layer {layer} names region {spec.region}; the layout has {len(self.regions)}"
            )
        if spec.block_bytes < 1 or spec.stride < spec.block_bytes or spec.blocks < 1:
            raise InvalidArgumentError(
                f"layer {layer}: blocks of {spec.block_bytes} bytes every {spec.stride} bytes, "
                f"{spec.blocks} of them: need 1 <= block bytes <= stride and blocks >= 1"
            )
        if spec.heads < 1 or spec.block_bytes % spec.heads:
            raise InvalidArgumentError(
                f"layer {layer}: blocks of {spec.block_bytes} bytes cannot hold {spec.heads} "
                f"equal heads: need heads >= 1 dividing the block bytes"
            )
        end = spec.offset + (spec.blocks - 1) * spec.stride + spec.block_bytes
        if spec.offset < 0 or end > self.regions[spec.region][1]:
            raise InvalidArgumentError(
                f"layer {layer}'s cache ends at byte {end} of region {spec.region}, which "
                f"holds {self.regions[spec.region][1]}"
            )

    @classmethod
    def from_caches(cls, layers) -> CacheLayout:
        """The layout of `layers`: per layer, a list of [blocks, ...] caches (tensors,
        arrays, pdhal buffers), each its own region."""
        regions, specs = [], []
        for layer, caches in enumerate(layers):
            row = []
            for index, cache in enumerate(caches):
                what = f"layer {layer} cache {index}"
                block = block_bytes_of(cache, what)
                nbytes = resolve(cache, what).nbytes
                row.append(CacheSpec(len(regions), 0, block, block, nbytes // block))
                regions.append(cache)
            specs.append(row)
        return cls(regions, specs)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def describe(self) -> dict:
        """The layout as JSON-able data, without addresses (a peer has its own)."""
        return {
            "regions": [n for _, n in self.regions],
            "layers": [[spec.to_json() for spec in caches] for caches in self.layers],
        }

    def head_view(self, first: int, count: int) -> CacheLayout:
        """The same regions, every cache restricted to heads [first, first + count)."""
        return CacheLayout(self.memory, _head_view(self.layers, first, count, "here"))

    def check_peer(self, peer: dict, heads: HeadShard | None = None) -> list[list[CacheSpec]]:
        """A peer's described layers, checked to pair with these cache by cache: as many
        layers and caches, blocks of the same bytes. With `heads`, the shard's heads of
        each (this side's and the peer's) must pair: a head the same bytes on both."""
        layers = [[CacheSpec.from_json(w) for w in caches] for caches in peer["layers"]]
        if heads is not None:
            mine = _head_view(self.layers, heads.src_first, heads.count, "here")
            layers = _head_view(layers, heads.dst_first, heads.count, "on the peer")
            return CacheLayout._pair(mine, layers, heads.count)
        return CacheLayout._pair(self.layers, layers)

    @staticmethod
    def _pair(ours, layers, heads: int = 0) -> list[list[CacheSpec]]:
        if [len(c) for c in layers] != [len(c) for c in ours]:
            raise InvalidArgumentError(
                f"the peer's cache has {len(layers)} layers of {[len(c) for c in layers]} "
                f"caches, this side {len(ours)} of {[len(c) for c in ours]}"
            )
        for layer, (mine, theirs) in enumerate(zip(ours, layers)):
            for index, (a, b) in enumerate(zip(mine, theirs)):
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
        validate_index(s, "source block", 1 << 40)
        validate_index(d, "destination block", 1 << 40)
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1][2] += 1
        else:
            runs.append([s, d, 1])
    return [tuple(r) for r in runs]


class RunPlanner:
    """The byte copies of block runs from a source layout into a destination's layers:
    (source address, destination region, destination offset, bytes), one per run and
    cache (one per block where a stride is not the block size). What each layer needs is
    worked out once; src_blocks and dst_blocks are the fewest blocks of any layer's cache
    on each side, which block ids are checked against (KVStreamer, before they are sent)."""

    def __init__(self, src: CacheLayout, dst_layers: list[list[CacheSpec]]):
        self._layers = [
            [
                (
                    src.regions[s.region][0] + s.offset,
                    s.stride,
                    d.region,
                    d.offset,
                    d.stride,
                    s.block_bytes,
                    s.stride == s.block_bytes == d.stride,
                )
                for s, d in zip(mine, theirs)
            ]
            for mine, theirs in zip(src.layers, dst_layers)
        ]
        self.src_blocks = min(s.blocks for caches in src.layers for s in caches)
        self.dst_blocks = min(d.blocks for caches in dst_layers for d in caches)
        #: Bytes one block is in each layer, all its caches together.
        self.block_bytes = [sum(s.block_bytes for s in caches) for caches in src.layers]

    def copies(self, layer: int, runs) -> list[tuple[int, int, int, int]]:
        """The copies of `runs` in `layer` (ids within src_blocks and dst_blocks)."""
        out = []
        for base, s_stride, region, offset, d_stride, block, contiguous in self._layers[layer]:
            if contiguous:
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
