"""How the cache messager moves KV blocks to the decode side: `shm` or `mooncake`.

Both move runs of consecutive blocks, one layer at a time: `write(layer, runs)` copies, for
K and V, blocks [src, src + count) of the prefill cache to [dst, dst + count) of the decode
cache. The decode side opens its end with `DecodeEndpoint` and hands the messager the
`describe()` dict it needs to connect. With tensor parallelism the decode side holds one
cache per rank, in one buffer `[tp, ...]`; rank r's messager writes into cache r only.
"""

from __future__ import annotations

import ctypes
import time

import numpy as np

from pdhal import ops
from pdhal_demo.control import DemoError

Run = tuple[int, int, int]  # (source block, destination block, count)


def block_runs(src_blocks: list[int], dst_blocks: list[int]) -> list[Run]:
    """Pair two block tables into runs that are consecutive on both sides."""
    runs: list[list[int]] = []
    for s, d in zip(src_blocks, dst_blocks):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1][2] += 1
        else:
            runs.append([s, d, 1])
    return [tuple(run) for run in runs]


def require_mooncake():
    """Mooncake's TransferEngine class, or a DemoError saying what to install."""
    try:
        from mooncake.engine import TransferEngine
    except ImportError as exc:
        if "libibverbs" in str(exc):
            raise DemoError(
                "Mooncake is installed but cannot load libibverbs.so.1: install "
                "Debian's libibverbs1 (apt-get install libibverbs1)"
            ) from None
        raise DemoError(
            "the mooncake transport needs Mooncake's transfer engine: "
            "pip install 'pdhal-demo[mooncake]' (mooncake-transfer-engine-non-cuda)"
        ) from None
    return TransferEngine


class MooncakeEngine:
    """One Mooncake transfer engine; P2PHANDSHAKE, so no metadata server is needed.

    Its RPC port listens on every interface whatever `host` says: keep it behind a firewall.
    """

    def __init__(self, host: str, protocol: str):
        self.engine = require_mooncake()()
        rc = self.engine.initialize(host, "P2PHANDSHAKE", protocol, "")
        if rc != 0:
            raise DemoError(
                f"Mooncake initialize({host!r}, P2PHANDSHAKE, {protocol!r}) failed with {rc}"
            )
        self.session = f"{host}:{self.engine.get_rpc_port()}"

    def register(self, address: int, nbytes: int) -> None:
        rc = self.engine.register_memory(address, nbytes)
        if rc != 0:
            raise DemoError(f"Mooncake could not register {nbytes} bytes at {address:#x} ({rc})")


class DecodeEndpoint:
    """The decode side's end: makes its cache reachable by the messager."""

    def __init__(self, transport: str, tensor, cache_name: str, host: str, protocol: str):
        self._describe = {"transport": transport}
        if transport == "shm":
            ops.set_data_ipc(tensor, cache_name)
            self._describe["name"] = cache_name
        else:
            self._engine = MooncakeEngine(host, protocol)
            address = ops.get_peer_mem_addr(tensor)
            self._engine.register(address, tensor.size * 4)
            self._describe |= {"session": self._engine.session, "address": address}

    def describe(self) -> dict:
        return self._describe


SHM_COPIES = ("memmove", "copy_blocks")


class ShmSender:
    """Copies blocks straight into the decode cache (rank `rank`'s, of the `[tp, ...]`
    buffer `dst_shape` describes), mapped with share_external_data.

    `copy` "memmove": one ctypes.memmove per run of consecutive blocks (a few runs per layer:
    the messager already coalesced them). "copy_blocks": one pdhal.ops.copy_blocks per layer
    (its C loop coalesces the ids again), the op an engine's own cache copies use.
    """

    def __init__(
        self,
        src: np.ndarray,
        decode: dict,
        dst_shape: tuple[int, ...],
        copy: str = "memmove",
        rank: int = 0,
    ):
        if copy not in SHM_COPIES:
            raise DemoError(f"shm copy must be one of {SHM_COPIES}, got {copy!r}")
        self.src = src
        self.dst = ops.share_external_data(src, decode["name"], dst_shape)[rank]
        self._block = int(np.prod(src.shape[3:])) * src.itemsize
        self._src_blocks, self._dst_blocks = src.shape[2], self.dst.shape[2]
        self._src_row = self._src_blocks * self._block  # bytes of one layer's K (or V)
        self._dst_row = self._dst_blocks * self._block
        self.write = self._memmove if copy == "memmove" else self._copy_blocks

    def _memmove(self, layer: int, runs: list[Run]) -> None:
        # memmove on addresses: a numpy slice assignment costs more than copying a block.
        src_base, dst_base, block = self.src.ctypes.data, self.dst.ctypes.data, self._block
        memmove = ctypes.memmove
        for kv in (0, 1):
            src = src_base + (2 * layer + kv) * self._src_row
            dst = dst_base + (2 * layer + kv) * self._dst_row
            for s, d, n in runs:
                memmove(dst + d * block, src + s * block, n * block)

    def _copy_blocks(self, layer: int, runs: list[Run]) -> None:
        src_ids, dst_ids = [], []
        for kv in (0, 1):
            src_row = (2 * layer + kv) * self._src_blocks
            dst_row = (2 * layer + kv) * self._dst_blocks
            for s, d, n in runs:
                src_ids += range(src_row + s, src_row + s + n)
                dst_ids += range(dst_row + d, dst_row + d + n)
        ops.copy_blocks(self.dst, dst_ids, self.src, src_ids, self._block)


class Pending:
    """Transfers submitted for one layer: Mooncake batch ids, one run each."""

    __slots__ = ("ids", "nbytes", "layer", "deadline")

    def __init__(self, ids: list[int], nbytes: int, layer: int, deadline: int):
        self.ids, self.nbytes, self.layer, self.deadline = ids, nbytes, layer, deadline


class MooncakeSender:
    """Writes blocks into the decode cache with Mooncake, from the address pdhal registers.

    Both caches are registered once. `write` submits a layer's runs and returns at once
    (one transfer_submit_write per run: a batch of one, whose status transfer_check_status
    reports exactly); `wait` checks their status, sleeping 50 us, then twice as long each
    time up to 500 us, until they are all in the decode cache. Mooncake's own blocking wait
    (get_batch_transfer_status) spins a core, which on a two-core machine is the core its TCP
    threads need. A transfer that has not completed by its deadline (`timeout_s` plus
    100 MiB/s for its bytes) is reported: the link or the decode side is gone.
    """

    POLL_S = (50e-6, 500e-6)  # the first sleep between status checks, and the longest

    def __init__(
        self,
        src: np.ndarray,
        decode: dict,
        dst_shape: tuple[int, ...],
        host: str,
        protocol: str,
        timeout_s: float = 5.0,
        rank: int = 0,
    ):
        self._engine = MooncakeEngine(host, protocol)
        self._submit = self._engine.engine.transfer_submit_write
        self._status = self._engine.engine.transfer_check_status
        self._src_base = ops.get_peer_mem_addr(src)
        self._engine.register(self._src_base, src.nbytes)
        self._target = decode["session"]
        shard = int(np.prod(dst_shape[1:])) * src.itemsize  # one rank's decode cache
        self._dst_base = decode["address"] + rank * shard
        self._src_blocks, self._dst_blocks = src.shape[2], dst_shape[3]
        self._block = int(np.prod(src.shape[3:])) * src.itemsize
        self._timeout_ns = int(timeout_s * 1e9)
        self._connect()

    def _connect(self) -> None:
        """Open the connection now (a read into scratch memory), not in the first layer."""
        self._scratch = np.zeros(4096, np.uint8)
        self._engine.register(self._scratch.ctypes.data, self._scratch.nbytes)
        rc = self._engine.engine.transfer_sync_read(
            self._target, self._scratch.ctypes.data, self._dst_base, self._scratch.nbytes
        )
        if rc != 0:
            raise DemoError(f"Mooncake could not reach the decode side at {self._target} ({rc})")

    def write(self, layer: int, runs: list[Run]) -> Pending:
        ids, nbytes, block = [], 0, self._block
        for kv in (0, 1):
            src = self._src_base + (layer * 2 + kv) * self._src_blocks * block
            dst = self._dst_base + (layer * 2 + kv) * self._dst_blocks * block
            for s, d, n in runs:
                batch = self._submit(self._target, src + s * block, dst + d * block, n * block)
                if batch <= 0:
                    raise DemoError(
                        f"Mooncake could not submit layer {layer}'s write to "
                        f"{self._target} ({batch})"
                    )
                ids.append(batch)
                nbytes += n * block
        deadline = time.monotonic_ns() + self._timeout_ns + nbytes * 10  # + 100 MiB/s
        return Pending(ids, nbytes, layer, deadline)

    def wait(self, pending: Pending) -> None:
        """Return once every transfer of `pending` is in the decode cache."""
        nap, longest = self.POLL_S
        for batch in pending.ids:
            while (status := self._status(batch)) == 0:
                if time.monotonic_ns() > pending.deadline:
                    raise DemoError(
                        f"Mooncake's write of layer {pending.layer} ({pending.nbytes} bytes) to "
                        f"{self._target} did not complete in time: the link to the decode "
                        f"side or the decode side is gone"
                    )
                time.sleep(nap)
                nap = min(2 * nap, longest)  # fewer wake-ups on a long transfer
            if status != 1:
                raise DemoError(
                    f"Mooncake's write of layer {pending.layer} to {self._target} "
                    f"{'timed out' if status == -2 else 'failed'} ({status})"
                )
