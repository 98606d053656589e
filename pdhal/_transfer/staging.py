"""Staging through pinned host memory: caches in memory a transport cannot reach (device
memory, where shm moves host memory only) served through a mirror of the same geometry in
pinned host memory, and copied between the two by the backend's runtime.

A KVReceiver over such caches serves the mirror (its transport sees host memory, so a
prefill side on any backend pairs with it as with host caches) and copies each landed
block into the caches before it reports it landed; nothing of the caches is ever shared
with another process, so no vendor's IPC handle leaves it. The copies are the backend's
copy_blocks (a runtime copy, then synchronize): each block's own bytes only (a cache's
span of it), so the blocks around it, another request's, are never touched.

What it costs: a mirror as large as the caches (pinned host memory) and a host-to-device
copy of each landed request, on the thread that learns it landed."""

from __future__ import annotations

import contextlib
import dataclasses
from collections import defaultdict

import pdhal
from pdhal import ops
from pdhal._errors import PdhalError
from pdhal._memory.blocks import MemorySpan, resolve
from pdhal._transfer.contract import Transport
from pdhal._transfer.layout import CacheLayout


def needs_staging(transport: Transport, layout: CacheLayout) -> bool:
    """Whether `layout`'s caches go through a host mirror for `transport`: it says which
    kinds of memory it serves, host memory among them, and caches are device memory it
    does not serve, every one of this process's backend (whose runtime copies them; any
    other memory is refused as the transport refuses it)."""
    served = transport.memory
    if served is None or "cpu" not in served:
        return False
    unserved = {kind for kind in layout.kinds if kind not in served}
    return bool(unserved) and unserved == {pdhal.current_platform().device_kind}


@dataclasses.dataclass(frozen=True)
class _Stretch:
    """Bytes of block b of one or more caches of a region, at [offset + b * stride, +
    width): the pieces of block b (a head's part of a cache, or a whole block's) that
    touch, merged into one."""

    region: int
    offset: int
    stride: int
    width: int
    blocks: int


def stretches(layout: CacheLayout, layers: range) -> list[_Stretch]:
    """The stretches of `layers`' caches: per region and stride, a block's pieces (each
    head's part of a cache where its heads are apart, else the cache's whole block) merged
    where they touch (K and V of one block next to each other: one), never across a gap,
    which may hold another block's bytes."""
    pieces: dict[tuple[int, int], set[tuple[int, int, int]]] = defaultdict(set)
    for layer in layers:
        for spec in layout.layers[layer]:
            found = pieces[spec.region, spec.stride]
            if spec.head_stride:
                for head in range(spec.heads):
                    found.add((spec.offset + head * spec.head_step, spec.part_bytes, spec.blocks))
            else:
                found.add((spec.offset, spec.span, spec.blocks))
    out = []
    for (region, stride), found in pieces.items():
        merged: list[list[int]] = []
        for offset, width, blocks in sorted(found):
            last = merged[-1] if merged else None
            if last is not None and offset <= last[0] + last[1]:  # touching: one stretch
                last[1] = max(last[1], offset + width - last[0])
                last[2] = min(last[2], blocks)
            else:
                merged.append([offset, width, blocks])
        out += [_Stretch(region, o, stride, w, n) for o, w, n in merged]
    return out


class Staging:
    """A pinned host mirror of `layout`'s regions of a kind `served` (the transport's
    memory kinds) does not name (the others are served as they are), and copies of blocks
    between the caches and the mirror."""

    def __init__(self, layout: CacheLayout, served: tuple[str, ...]):
        self.layout = layout
        self._staged = [kind not in served for kind in layout.kinds]
        self._refs = [resolve(region, f"region {i}") for i, region in enumerate(layout.memory)]
        self._buffers: list = []
        try:
            regions = []
            for staged, region, (_, nbytes) in zip(self._staged, layout.memory, layout.regions):
                if staged:
                    self._buffers.append(ops.host_alloc(nbytes))
                regions.append(self._buffers[-1] if staged else region)
            #: The caches, those staged in pinned host memory: what a transport serves.
            self.mirror = CacheLayout(regions, layout.layers)
            self._mirror_refs = [resolve(r, f"mirror region {i}") for i, r in enumerate(regions)]
            self._all = self._of_staged(range(layout.num_layers))
        except BaseException:
            self.close()
            raise
        self._by_layer: dict[int, list[_Stretch]] = {}

    def to_caches(self, blocks: list[int], layers: range) -> None:
        """Copy `blocks` of `layers` from the mirror into the caches, and wait for it."""
        self._copy(blocks, layers, self._refs, self._mirror_refs)

    def to_mirror(self, blocks: list[int], layers: range) -> None:
        """Copy `blocks` of `layers` from the caches into the mirror, and wait for it."""
        self._copy(blocks, layers, self._mirror_refs, self._refs)

    def _copy(self, blocks: list[int], layers: range, dst_refs: list, src_refs: list) -> None:
        if not blocks:
            return
        every = layers == range(self.layout.num_layers)
        try:
            for stretch in self._all if every else self._stretches(layers):
                self._copy_stretch(stretch, blocks, dst_refs, src_refs)
        except BaseException:
            # the copies queued before the one that failed run on: wait for them, so that
            # none lands in blocks their owner takes back after this failure
            with contextlib.suppress(PdhalError):
                ops.synchronize()
            raise
        ops.synchronize()

    @staticmethod
    def _copy_stretch(stretch: _Stretch, blocks: list[int], dst_refs: list, src_refs: list):
        dst = _span(dst_refs[stretch.region], stretch)
        src = _span(src_refs[stretch.region], stretch)
        if stretch.width == stretch.stride:  # blocks side by side: runs of ids, one copy each
            ops.copy_blocks(dst, blocks, src, blocks, stretch.width)
            return
        for block in blocks:  # each block's bytes alone (between them: other blocks')
            start = block * stretch.stride
            ops.copy_blocks(
                _sub(dst, start, stretch.width),
                [0],
                _sub(src, start, stretch.width),
                [0],
                stretch.width,
            )

    def _stretches(self, layers: range) -> list[_Stretch]:
        if len(layers) != 1:
            return self._of_staged(layers)
        found = self._by_layer.get(layers.start)
        if found is None:
            found = self._by_layer[layers.start] = self._of_staged(layers)
        return found

    def _of_staged(self, layers: range) -> list[_Stretch]:
        return [s for s in stretches(self.layout, layers) if self._staged[s.region]]

    def close(self) -> None:
        """Free the mirror."""
        buffers, self._buffers = self._buffers, []
        for buffer in buffers:
            ops.host_free(buffer)


def _span(ref, stretch: _Stretch) -> MemorySpan:
    """The bytes of `stretch`'s blocks in the memory `ref` names."""
    nbytes = (stretch.blocks - 1) * stretch.stride + stretch.width
    return MemorySpan(dataclasses.replace(ref, address=ref.address + stretch.offset, nbytes=nbytes))


def _sub(span: MemorySpan, start: int, nbytes: int) -> MemorySpan:
    ref = span._pdhal_memory_ref()
    return MemorySpan(dataclasses.replace(ref, address=ref.address + start, nbytes=nbytes))
