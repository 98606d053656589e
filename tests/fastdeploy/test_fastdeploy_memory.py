"""pdhal.compat.fastdeploy's memory and copy ops in FastDeploy's own call shapes, on the cpu
backend and on the simulated CUDA and XPU runtimes (pdhal-cuda, pdhal-xpu), checked byte by byte:
pinned host memory as int addresses, caches shared between processes by name (bfloat16 like
float16), one layer's blocks sent into another process's caches, every layer swapped out and
back in, unset names, and bad input refused with nothing written.

FastDeploy's device caches are Paddle tensors; a simulated device's memory cannot be one
(this Paddle is built for the CPU), so a cache here is `Cache`, named like a tensor. On the
cpu backend a cache attached by name with a Paddle like tensor is a Paddle tensor, and
test_paddle_bfloat16_caches_in_pinned_memory_cross_processes shares one. Block ids, remote
pointers and sender-side tensors are Paddle CPU tensors where FastDeploy passes those (the
tests marked paddle), numpy arrays in the bad-input tests (which run without Paddle)."""

from __future__ import annotations

import ctypes
import math
import subprocess

import numpy as np
import pytest
from simulators import SimRuntime

import pdhal
from pdhal import ops
from pdhal._backends import registry as _registry
from pdhal.compat import fastdeploy as fd
from pdhal.testing.procs import child, finish

RUNTIMES = {"cuda": ("PDHAL_CUDART", "libcudart_sim.so"), "xpu": ("PDHAL_XPURT", "libxpurt.so")}
BACKENDS = [
    pytest.param("cpu"),
    pytest.param("cuda", marks=pytest.mark.simulated),
    pytest.param("xpu", marks=pytest.mark.simulated),
]
ITEMSIZE = {"float16": 2, "bfloat16": 2, "uint8": 1}
HEADS, BLOCK_SIZE, HEAD_DIM = 2, 4, 8  # a cache is [blocks, heads, block_size, head_dim]


def pattern(seed: int, nbytes: int) -> bytes:
    """Bytes no two blocks share (in practice), the same in every process for a seed."""
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8).tobytes()


def blocks_of(data: bytes, block_bytes: int) -> list[bytes]:
    return [data[i : i + block_bytes] for i in range(0, len(data), block_bytes)]


class Cache:
    """A KV cache in device memory, named like a tensor (data_ptr, numel, element_size,
    shape, dtype, device): what FastDeploy passes as a Paddle tensor."""

    def __init__(self, address: int, shape, dtype: str, device: str):
        self.address, self.shape, self.dtype, self.device = address, list(shape), dtype, device

    def data_ptr(self) -> int:
        return self.address

    def numel(self) -> int:
        return math.prod(self.shape)

    def element_size(self) -> int:
        return ITEMSIZE[self.dtype]

    @property
    def nbytes(self) -> int:
        return self.numel() * self.element_size()

    @property
    def block_bytes(self) -> int:
        return self.nbytes // self.shape[0]


class Device:
    """The selected backend's memory for tests: caches, streams, bytes in and out."""

    def __init__(self, name: str, support, sim: SimRuntime | None):
        self.name, self.support, self.sim = name, support, sim

    def cache(self, blocks: int, dtype: str = "bfloat16", seed: int | None = None) -> Cache:
        shape = [blocks, HEADS, BLOCK_SIZE, HEAD_DIM]
        nbytes = math.prod(shape) * ITEMSIZE[dtype]
        cache = Cache(self.support.alloc(nbytes).address, shape, dtype, self.support.device)
        self.write(cache.address, bytes(nbytes) if seed is None else pattern(seed, nbytes))
        return cache

    def write(self, address: int, data: bytes) -> None:
        # simulated device memory is mapped in this process, as host memory is
        ctypes.memmove(address, data, len(data))

    def read(self, cache: Cache) -> bytes:
        return self.support.read(cache.address, cache.nbytes)

    def stream(self) -> int:
        """A raw stream handle, as FastDeploy passes `stream_base.cuda_stream`."""
        return 0 if self.sim is None else self.support.new_stream()


@pytest.fixture(params=BACKENDS)
def dev(request, monkeypatch):
    name = request.param
    sim = None
    if name != "cpu":
        variable, library = RUNTIMES[name]
        sim = SimRuntime(name, library)
        monkeypatch.setenv(variable, sim.path)
    monkeypatch.setenv("PDHAL_PLATFORM", name)
    _registry.reset()
    assert pdhal.current_backend() == name
    support = _registry.selection().candidate.backend.test_support()
    yield Device(name, support, sim)
    support.release()


@pytest.fixture
def copies(dev, monkeypatch):
    """The return of every pdhal.ops.copy_blocks call the compat ops make: the copies each
    issued (a run of consecutive ids is one)."""
    made = []
    real = ops.copy_blocks

    def counting(*args, **kwargs):
        made.append(real(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(ops, "copy_blocks", counting)
    return made


def live_host_buffers(dev: Device) -> int | None:
    return None if dev.sim is None else dev.sim.lib.sim_live_host_buffers()


# ---- cuda_host_alloc / cuda_host_free ---------------------------------------------------


def test_host_memory_is_an_int_address_with_pointer_arithmetic(dev):
    live = live_host_buffers(dev)
    n = 1 << 16
    ptr = fd.cuda_host_alloc(n)
    assert type(ptr) is int and ptr > 0
    if dev.sim is not None:  # from the runtime's own allocator, returned to it
        assert live_host_buffers(dev) == live + 1
    half = ptr + n // 2  # FastDeploy's storage buffer: read_buffer + total_bytes // 2
    ctypes.memmove(ptr, b"first half", 10)
    ctypes.memmove(half, b"second half", 11)
    assert ctypes.string_at(ptr, 10) == b"first half"
    assert ctypes.string_at(half, 11) == b"second half"
    with pytest.raises(pdhal.InvalidArgumentError, match="not an address cuda_host_alloc returned"):
        fd.cuda_host_free(half)  # inside the buffer, not its start: refused, nothing freed
    assert ctypes.string_at(ptr, 10) == b"first half"
    fd.cuda_host_free(ptr)
    if dev.sim is not None:
        assert live_host_buffers(dev) == live
    with pytest.raises(pdhal.InvalidArgumentError, match="freed already"):
        fd.cuda_host_free(ptr)


@pytest.mark.parametrize(
    "bad, error, words",
    [
        (0x1000, pdhal.InvalidArgumentError, "0x1000 is not an address cuda_host_alloc returned"),
        ("0x1000", pdhal.InvalidTypeError, "ptr must be the int cuda_host_alloc returned, got str"),
        (1.5, pdhal.InvalidTypeError, "got float"),
        (True, pdhal.InvalidTypeError, "got bool"),
    ],
)
def test_freeing_what_cuda_host_alloc_did_not_return_is_refused(dev, bad, error, words):
    ptr = fd.cuda_host_alloc(4096)
    with pytest.raises(error, match=words):
        fd.cuda_host_free(bad)
    fd.cuda_host_free(ptr)


@pytest.mark.parametrize(
    "size, flags, words",
    [
        (0, 0, "nbytes must be at least 1"),
        (-1, 0, "nbytes must be in"),
        ("4096", 0, "nbytes must be an integer"),
        (4096, -1, "flags must be in"),
    ],
)
def test_cuda_host_alloc_refuses_bad_sizes_and_flags(dev, size, flags, words):
    live = live_host_buffers(dev)
    with pytest.raises(pdhal.InvalidArgumentError, match=words):
        fd.cuda_host_alloc(size, flags)
    assert live_host_buffers(dev) == live


# ---- cuda_host_register / cuda_host_unregister ----------------------------------------


def test_registered_host_memory_serves_as_swap_space_until_unregistered(dev):
    cache = dev.cache(4, "float16", seed=1)
    host = np.zeros(4 * cache.block_bytes, np.uint8)
    fd.cuda_host_register(host.ctypes.data, host.nbytes, 0)  # (ptr, size, flags) as on XPU
    try:
        fd.swap_cache_all_layers([cache], [host.ctypes.data], 4, [2], [1], 0, 0)
        got = blocks_of(host.tobytes(), cache.block_bytes)
        assert got == [
            bytes(cache.block_bytes),
            blocks_of(dev.read(cache), cache.block_bytes)[2],
            bytes(cache.block_bytes),
            bytes(cache.block_bytes),
        ]
    finally:
        fd.cuda_host_unregister(host.ctypes.data)
    host[:] = 0
    with pytest.raises(pdhal.InvalidArgumentError, match="does not lie in memory pdhal handed out"):
        fd.swap_cache_all_layers([cache], [host.ctypes.data], 4, [3], [0], 0, 0)
    assert not host.any(), "a refused swap wrote host memory"
    with pytest.raises(pdhal.InvalidArgumentError, match="was not registered"):
        fd.cuda_host_unregister(host.ctypes.data)
    with pytest.raises(pdhal.InvalidArgumentError, match="flags"):
        fd.cuda_host_register(host.ctypes.data, host.nbytes, -1)


def test_a_swap_holds_the_host_memory_it_copies_through(dev, monkeypatch):
    """The swaps name host memory by int address (FastDeploy's form): each copy they make
    holds that memory's extent, so a cuda_host_free from another thread waits for the swap
    (and one after it is refused), as it does for ops.copy_blocks."""
    from pdhal._memory import extents

    cache = dev.cache(4, "float16", seed=1)
    address = fd.cuda_host_alloc(4 * cache.block_bytes)
    held: list = []
    real_hold = extents.hold
    monkeypatch.setattr(extents, "hold", lambda e: held.append(real_hold(e)) or held[-1])
    fd.swap_cache_all_layers([cache], [address], 4, [2], [1], 0, 0)
    fd.swap_cache_layout([cache], address, list(cache.shape), [2], [1], 0, 0)
    assert held and all(extents.find(address) in h for h in held), held
    fd.cuda_host_free(address)


def test_a_tensor_registers_with_its_own_size(dev):
    host = np.zeros(4096, np.uint8)
    fd.cuda_host_register(host)
    fd.cuda_host_unregister(host)


# ---- set_data_ipc / share_external_data across processes --------------------------------


def _like(dev: Device, dtype: str):
    """The "like" tensor FastDeploy passes: paddle.empty([], dtype=...) where Paddle can wrap
    the mapping (the cpu backend); a 0-d numpy array or the dtype's name on a simulated
    device (numpy has no bfloat16)."""
    if dev.name == "cpu":
        return f'paddle.empty([], dtype="{dtype}")'
    return "np.zeros((), np.float16)" if dtype == "float16" else '"bfloat16"'


CACHE_ATTACH = [
    pytest.param("cpu", marks=pytest.mark.paddle),
    pytest.param("cuda", marks=pytest.mark.simulated),
    pytest.param("xpu", marks=pytest.mark.simulated),
]


@pytest.mark.parametrize("dev", CACHE_ATTACH, indirect=True)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_the_cache_transfer_manager_attaches_swaps_and_detaches(dev, dtype, tmp_path):
    """A worker publishes layer 0's K and V caches; another process attaches them by name
    (3-argument GPU form and 4-argument XPU helper form), swaps blocks out to pinned host
    memory and back into other blocks, then closes its mappings (unset_data_ipc(..., True,
    False), the RL cache clear). Every byte of both caches is checked in the worker."""
    if dev.name == "cpu":
        pytest.importorskip("paddle")
    blocks, cpu_blocks = 8, 4
    k, v = dev.cache(blocks, dtype, seed=1), dev.cache(blocks, dtype, seed=2)
    fd.set_data_ipc(k, "key_caches_0_rank0.device0")
    fd.set_data_ipc(v, "value_caches_0_rank0.device0")
    before_k, before_v = dev.read(k), dev.read(v)
    shape = k.shape
    bb = k.block_bytes
    manager = child(f"""
        import ctypes
        import numpy as np
        import pdhal
        from pdhal.compat import fastdeploy as fd
        if {dev.name == "cpu"}:
            import paddle
        like = {_like(dev, dtype)}
        k = fd.share_external_data(like, "key_caches_0_rank0.device0", {shape}, timeout=30)
        v = fd.share_external_data_(like, "value_caches_0_rank0.device0", {shape}, True)
        assert "{dtype}" in str(k.dtype) and list(k.shape) == {shape}, (k.dtype, k.shape)
        assert "{dtype}" in str(v.dtype) and list(v.shape) == {shape}, (v.dtype, v.shape)
        try:
            fd.share_external_data(like, "key_caches_0_rank0.device0", {shape}, False)
            raise AssertionError("use_ipc=False was accepted")
        except pdhal.InvalidArgumentError as e:
            assert "use_ipc=False" in str(e), e
        n = 2 * {cpu_blocks * bb}
        ptr = fd.cuda_host_alloc(n)
        ctypes.memset(ptr, 0, n)
        k_ptrs, v_ptrs = [ptr], [ptr + n // 2]
        fd.swap_cache_all_layers([k], k_ptrs, {cpu_blocks}, [1, 2, 6], [3, 0, 1], 0, 0)
        fd.swap_cache_all_layers([v], v_ptrs, {cpu_blocks}, [1, 2, 6], [3, 0, 1], 0, 0)
        host = ctypes.string_at(ptr, n)
        with open({str(tmp_path / "host.bin")!r}, "wb") as f:
            f.write(host)
        fd.swap_cache_all_layers([k], k_ptrs, {cpu_blocks}, [4, 5, 7], [3, 0, 1], 0, 1)
        fd.swap_cache_all_layers([v], v_ptrs, {cpu_blocks}, [4, 5, 7], [3, 0, 1], 0, 1)
        fd.unset_data_ipc(k, "key_caches_0_rank0.device0", True, False)
        fd.unset_data_ipc(v, "value_caches_0_rank0.device0", True, False)
        fd.cuda_host_free(ptr)
    """)
    finish(manager)
    host = blocks_of((tmp_path / "host.bin").read_bytes(), bb)
    old_k, old_v = blocks_of(before_k, bb), blocks_of(before_v, bb)
    # swapped out: device blocks 1, 2, 6 -> host blocks 3, 0, 1 (block 2 untouched)
    assert host == [
        old_k[2],
        old_k[6],
        bytes(bb),
        old_k[1],
        old_v[2],
        old_v[6],
        bytes(bb),
        old_v[1],
    ]
    # swapped in: host blocks 3, 0, 1 -> device blocks 4, 5, 7; every other block as it was
    for old, cache in ((old_k, k), (old_v, v)):
        want = list(old)
        want[4], want[5], want[7] = old[1], old[2], old[6]
        assert blocks_of(dev.read(cache), bb) == want
    # the attaching process closed its mappings only: the names are still shared
    assert (
        ops.share_external_data(np.zeros(1, np.uint8), "key_caches_0_rank0.device0", [1], timeout=0)
        is not None
    )


@pytest.mark.paddle
@pytest.mark.simulated
@pytest.mark.parametrize("backend", ["cuda", "xpu"])
def test_a_paddle_like_over_memory_paddle_cannot_wrap_is_refused_clearly(backend, monkeypatch):
    """This Paddle is built for the CPU: a Paddle tensor over simulated device memory would
    crash it (CUDA via DLPack) or cannot exist (XPU: DLPack has no Kunlunxin device). The
    compat op says so instead of crashing."""
    paddle = pytest.importorskip("paddle")
    variable, library = RUNTIMES[backend]
    sim = SimRuntime(backend, library)
    monkeypatch.setenv(variable, sim.path)
    monkeypatch.setenv("PDHAL_PLATFORM", backend)
    _registry.reset()
    support = _registry.selection().candidate.backend.test_support()
    try:
        fd.set_data_ipc(support.alloc(256), "key_caches_0_rank0.device0")
        like = paddle.empty([], dtype="bfloat16")
        with pytest.raises(pdhal.UnsupportedError, match="cannot wrap as a tensor"):
            fd.share_external_data(like, "key_caches_0_rank0.device0", [2, 64])
    finally:
        support.release()


@pytest.mark.paddle
def test_paddle_bfloat16_caches_in_pinned_memory_cross_processes():
    """The cpu backend shares memory from cuda_host_alloc: a bfloat16 Paddle view of it is
    shared, and attached elsewhere by a 0-d bfloat16 like tensor, as FastDeploy does."""
    paddle = pytest.importorskip("paddle")
    shape = [4, HEADS, BLOCK_SIZE, HEAD_DIM]
    n = math.prod(shape) * 2
    ptr = fd.cuda_host_alloc(n)
    data = pattern(5, n)
    ctypes.memmove(ptr, data, n)
    # a Paddle tensor over the pinned buffer (FastDeploy's caches come from paddle.full)
    words = np.ctypeslib.as_array(
        ctypes.cast(ptr, ctypes.POINTER(ctypes.c_int16)), shape=(n // 2,)
    ).reshape(shape)
    cache = paddle.from_dlpack(words).view(paddle.bfloat16)
    assert cache.dtype == paddle.bfloat16 and cache.data_ptr() == ptr
    fd.set_data_ipc(cache, "key_caches_0_rank0.device0")
    proc = child(f"""
        import ctypes
        import paddle
        from pdhal.compat import fastdeploy as fd
        like = paddle.empty(shape=[], dtype="bfloat16")
        k = fd.share_external_data(like, "key_caches_0_rank0.device0", {shape}, timeout=30)
        assert isinstance(k, paddle.Tensor) and k.dtype == paddle.bfloat16, k.dtype
        assert ctypes.string_at(k.data_ptr(), {n}) == {data!r}
        k[1] = paddle.full([{HEADS}, {BLOCK_SIZE}, {HEAD_DIM}], 1.5, dtype="bfloat16")
    """)
    finish(proc)
    after = blocks_of(ctypes.string_at(ptr, n), n // 4)
    assert after[0] == data[: n // 4] and after[2:] == blocks_of(data, n // 4)[2:]
    assert np.all(cache[1].astype("float32").numpy() == 1.5)
    fd.cuda_host_free(ptr)


# ---- get_data_ptr_ipc + ipc_sent_key_value_cache_by_remote_ptr ---------------------------


@pytest.mark.paddle
def test_one_layer_s_blocks_land_in_another_process_s_caches(dev, copies, tmp_path):
    """The decode side publishes its K and V caches; the prefill side maps them by name
    (get_data_ptr_ipc's int64[1] tensors) and sends a layer's blocks, block ids as int32 CPU
    tensors, in the 10- and the 11-argument form, then waits (_block_sync). Every byte of
    the remote caches is checked; runs of consecutive ids are one copy."""
    paddle = pytest.importorskip("paddle")
    remote_blocks, local_blocks = 8, 6
    bb = HEADS * BLOCK_SIZE * HEAD_DIM * 2
    n = remote_blocks * bb
    receiver = child(
        f"""
        import ctypes, sys
        import numpy as np
        from pdhal.compat import fastdeploy as fd
        caches = []
        for seed, name in ((1, "key_caches_0_rank0.device3"), (2, "value_caches_0_rank0.device3")):
            cache = support.alloc({n})
            data = np.random.default_rng(seed).integers(0, 256, {n}, dtype=np.uint8).tobytes()
            ctypes.memmove(cache.address, data, {n})
            fd.set_data_ipc(cache, name)
            caches.append(cache)
        print("published", flush=True)
        sys.stdin.readline()
        with open({str(tmp_path / "remote.bin")!r}, "wb") as f:
            for cache in caches:
                f.write(support.read(cache.address, {n}))
    """,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert receiver.stdout.readline() == "published\n"
        local_k, local_v = dev.cache(local_blocks, seed=11), dev.cache(local_blocks, seed=12)
        local_before = dev.read(local_k), dev.read(local_v)
        tmp = paddle.ones([1, 1])  # FastDeploy's dummy input
        remote_k = fd.get_data_ptr_ipc(tmp, "key_caches_0_rank0.device3", timeout=30)
        remote_v = fd.get_data_ptr_ipc(tmp, "value_caches_0_rank0.device3")
        for ptr in (remote_k, remote_v):
            assert ptr.dtype == paddle.int64 and list(ptr.shape) == [1] and ptr.place.is_cpu_place()

        def ids(values):
            return paddle.to_tensor(values, dtype="int32", place="cpu")

        stream = dev.stream()
        local_ids, remote_ids = ids([2, 3, 4, 0]), ids([5, 6, 7, 1])
        fd.ipc_sent_key_value_cache_by_remote_ptr(
            local_k,
            local_v,
            local_ids,
            remote_ids,
            remote_k,
            remote_v,
            len(local_ids),
            0,
            3,
            stream,
        )
        fd.ipc_sent_key_value_cache_by_remote_ptr(
            local_k, local_v, ids([5]), ids([3]), remote_k, remote_v, 1, 0, 3, stream, False
        )
        fd.ipc_sent_key_value_cache_by_remote_ptr_block_sync(local_k, local_v, stream)
        # One copy_blocks per send, K and V its two layers: 2..4 -> 5..7 is one run of each.
        assert copies == [4, 2], f"copies per send (K and V): {copies}"
        receiver.stdin.write("sent\n")
        receiver.stdin.flush()
        finish(receiver)
    finally:
        receiver.kill()
    remote = (tmp_path / "remote.bin").read_bytes()
    for i, (seed, local) in enumerate(((1, local_before[0]), (2, local_before[1]))):
        want = blocks_of(pattern(seed, n), bb)
        sent = blocks_of(local, bb)
        for src, dst in ((2, 5), (3, 6), (4, 7), (0, 1), (5, 3)):
            want[dst] = sent[src]
        assert blocks_of(remote[i * n : (i + 1) * n], bb) == want, "K" if i == 0 else "V"
    assert (dev.read(local_k), dev.read(local_v)) == local_before, "the sender's caches changed"


# ---- swap_cache_all_layers ---------------------------------------------------------------


def test_swap_all_layers_out_and_back_in(dev, copies):
    layers, blocks, cpu_blocks = 3, 8, 6
    caches = [dev.cache(blocks, "bfloat16", seed=20 + i) for i in range(layers)]
    bb = caches[0].block_bytes
    before = [dev.read(c) for c in caches]
    n = layers * cpu_blocks * bb
    base = fd.cuda_host_alloc(n)
    ctypes.memset(base, 0, n)
    ptrs = [base + i * cpu_blocks * bb for i in range(layers)]  # one buffer, per-layer offsets
    gpu_ids, cpu_ids = [1, 2, 3, 6], [4, 5, 0, 2]
    fd.swap_cache_all_layers(caches, ptrs, cpu_blocks, gpu_ids, cpu_ids, 0, 0)  # SWAP2CPU
    # One copy_blocks for all layers, 3 runs in each: 1, 2 -> 4, 5; 3 -> 0; 6 -> 2.
    assert copies == [3 * layers], copies
    del copies[:]
    host = blocks_of(ctypes.string_at(base, n), bb)
    for layer in range(layers):
        old = blocks_of(before[layer], bb)
        got = host[layer * cpu_blocks : (layer + 1) * cpu_blocks]
        assert got == [old[3], bytes(bb), old[6], bytes(bb), old[1], old[2]], f"layer {layer}"
    for cache in caches:  # the device blocks are reused meanwhile
        dev.write(cache.address, bytes(cache.nbytes))
    fd.swap_cache_all_layers(caches, ptrs, cpu_blocks, [7, 0, 5, 4], cpu_ids, 0, 1)  # SWAP2GPU
    assert copies == [4 * layers], copies
    for layer, cache in enumerate(caches):
        old = blocks_of(before[layer], bb)
        want = [bytes(bb)] * blocks
        want[7], want[0], want[5], want[4] = old[1], old[2], old[3], old[6]
        assert blocks_of(dev.read(cache), bb) == want, f"layer {layer}: not a round trip"
    fd.cuda_host_free(base)


def test_swap_of_layers_with_different_block_sizes_checks_all_before_copying(dev, copies):
    """FastDeploy's op takes each layer's block size from its own shape. Layers of two sizes
    are two copies; a device id inside the small layers but past the large layer's cache
    leaves every layer unwritten."""
    small, large = dev.cache(8, "uint8", seed=50), dev.cache(4, seed=51)
    sb, lb = small.block_bytes, large.block_bytes
    assert lb == 2 * sb
    n = 2 * sb + 2 * lb + 2 * sb  # two host blocks per layer
    base = fd.cuda_host_alloc(n)
    ctypes.memset(base, 0, n)
    caches, hosts = [small, large, small], [base, base + 2 * sb, base + 2 * sb + 2 * lb]
    with pytest.raises(pdhal.InvalidArgumentError, match="source block id 5"):
        fd.swap_cache_all_layers(caches, hosts, 2, [5], [1], 0, 0)
    ops.synchronize()
    assert ctypes.string_at(base, n) == bytes(n), "a refused swap wrote host memory"
    assert copies == []
    fd.swap_cache_all_layers(caches, hosts, 2, [2], [1], 0, 0)
    assert sorted(copies) == [1, 2], copies  # the two small layers in one copy, the large alone
    host, small_before, large_before = ctypes.string_at(base, n), dev.read(small), dev.read(large)
    for layer, (at, size, cache) in enumerate(
        [(base, sb, small_before), (base + 2 * sb, lb, large_before), (hosts[2], sb, small_before)]
    ):
        got = host[at - base : at - base + 2 * size]
        assert got == bytes(size) + cache[2 * size : 3 * size], f"layer {layer}"
    fd.cuda_host_free(base)


@pytest.mark.parametrize("dev", BACKENDS[1:], indirect=True)
def test_swap_of_shared_caches_counts_block_bytes_from_their_dtype(dev):
    """share_external_data's SharedDeviceBuffer names its bytes with element_size() 1: a
    float16 block is still heads * block_size * head_dim * 2 bytes. (The cpu backend maps
    shared caches as numpy arrays or Paddle tensors.)"""
    cache = dev.cache(4, "float16", seed=3)
    fd.set_data_ipc(cache, "key_caches_0_rank0.device0")
    shared = fd.share_external_data(
        np.zeros((), np.float16), "key_caches_0_rank0.device0", cache.shape, True
    )
    assert list(shared.shape) == cache.shape and shared.nbytes == cache.nbytes
    ptr = fd.cuda_host_alloc(2 * cache.block_bytes)
    fd.swap_cache_all_layers([shared], [ptr], 2, [3], [1], 0, 0)
    assert (
        ctypes.string_at(ptr + cache.block_bytes, cache.block_bytes)
        == blocks_of(dev.read(cache), cache.block_bytes)[3]
    )
    fd.cuda_host_free(ptr)


# ---- unset_data_ipc ------------------------------------------------------------------------


def test_unset_takes_the_record_away_and_readers_are_told(dev):
    cache = dev.cache(2, "float16", seed=4)
    name = "key_caches_0_rank0.device0"
    fd.set_data_ipc(cache, name)
    attach = child(f"""
        import numpy as np
        import pdhal
        from pdhal.compat import fastdeploy as fd
        shared = fd.share_external_data(np.zeros((), np.float16), "{name}", {cache.shape})
        try:  # an attaching process may close its own mapping, not remove the publisher's
            fd.unset_data_ipc(shared, "{name}")
            raise AssertionError("unset another live process's record")
        except pdhal.InvalidArgumentError as e:
            assert "which is alive: only its publisher unsets it" in str(e), e
        fd.unset_data_ipc(shared, "{name}", True, False)
    """)
    finish(attach)
    fd.unset_data_ipc(cache, name)  # the publisher: close_ipc, unlink_shm
    reader = child(f"""
        import numpy as np
        import pdhal
        from pdhal.compat import fastdeploy as fd
        for call in (lambda: fd.share_external_data(np.zeros((), np.float16), "{name}", [1],
                                                    timeout=0),
                     lambda: ops.get_data_ptr_ipc(None, "{name}", 0)):
            try:
                call()
                raise AssertionError("an unset name was mapped")
            except pdhal.SegmentError as e:
                assert "does not exist" in str(e) and "{name}" in str(e), e
    """)
    finish(reader)
    with pytest.raises(pdhal.InvalidArgumentError, match=f"no buffer is shared as '{name}'"):
        fd.unset_data_ipc(cache, name)
    with pytest.raises(pdhal.InvalidArgumentError, match="close_ipc must be a bool"):
        fd.unset_data_ipc(cache, name, 3, False)


# ---- bad input: a pdhal error naming what was wrong, nothing written -----------------------


@pytest.fixture
def sending(dev):
    """Local K/V caches of 4 blocks and remote ones of 6 (V's: 3) mapped by name in this
    process, as numpy stand-ins for FastDeploy's tensors; `snapshot()` reads all four."""

    class Sending:
        pass

    s = Sending()
    s.local_k, s.local_v = dev.cache(4, seed=31), dev.cache(4, seed=32)
    s.remote_k_cache, s.remote_v_cache = dev.cache(6, seed=33), dev.cache(3, seed=34)
    fd.set_data_ipc(s.remote_k_cache, "key_caches_0_rank0.device1")
    fd.set_data_ipc(s.remote_v_cache, "value_caches_0_rank0.device1")
    s.remote_k = np.array([ops.get_data_ptr_ipc(None, "key_caches_0_rank0.device1")], np.int64)
    s.remote_v = np.array([ops.get_data_ptr_ipc(None, "value_caches_0_rank0.device1")], np.int64)
    s.snapshot = lambda: [
        dev.read(c) for c in (s.local_k, s.local_v, s.remote_k_cache, s.remote_v_cache)
    ]
    return s


def _ids(values):
    return np.array(values, np.int32)


SEND_BAD = [
    # (what is wrong, changes to the arguments, the error's words)
    ("local id past the cache", dict(local_ids=_ids([0, 4])), "source block id 4"),
    ("negative remote id", dict(remote_ids=_ids([-1, 0])), "destination block id -1"),
    (
        "remote id in K's cache but past V's",
        dict(remote_ids=_ids([0, 4])),
        "destination block id 4 .* blocks 0..2",
    ),
    ("block_num beyond the ids", dict(block_num=3), "block_num 3 exceeds the block ids"),
    ("negative block_num", dict(block_num=-1), "block_num must be in"),
    ("float block ids", dict(local_ids=np.array([0.0, 1.0])), "integer block ids"),
    ("block ids as a string", dict(local_ids="0,1"), "must be a list or 1-D tensor"),
    ("V's shape differs from K's", dict(local_v="short"), "differ in shape"),
    (
        "remote pointer pdhal never mapped",
        dict(remote_v=np.array([0x1000], np.int64)),
        "did not hand out",
    ),
    (
        "remote pointer of two words",
        dict(remote_k=np.array([1, 2], np.int64)),
        "must be an address",
    ),
    ("is_scale given a device id", dict(is_scale=3), "is_scale must be a bool"),
]


@pytest.mark.parametrize("what, change, words", SEND_BAD, ids=[w for w, _, _ in SEND_BAD])
def test_a_bad_send_is_refused_with_nothing_written(dev, sending, what, change, words):
    s = sending
    args = dict(
        local_k=s.local_k,
        local_v=s.local_v,
        local_ids=_ids([1, 2]),
        remote_ids=_ids([0, 1]),
        remote_k=s.remote_k,
        remote_v=s.remote_v,
        block_num=2,
        is_scale=False,
    )
    args.update(change)
    if args["local_v"] == "short":
        args["local_v"] = dev.cache(3, seed=35)
    before = s.snapshot()
    stream = dev.stream()
    with pytest.raises(pdhal.PdhalError, match=words):
        fd.ipc_sent_key_value_cache_by_remote_ptr(
            args["local_k"],
            args["local_v"],
            args["local_ids"],
            args["remote_ids"],
            args["remote_k"],
            args["remote_v"],
            args["block_num"],
            0,
            1,
            stream,
            args["is_scale"],
        )
    fd.ipc_sent_key_value_cache_by_remote_ptr_block_sync(s.local_k, s.local_v, stream)
    assert s.snapshot() == before, f"{what}: a refused send wrote blocks"


SWAP_BAD = [
    ("gpu id past the cache", dict(gpu_ids=[0, 4]), "block id 4"),
    ("cpu id past max_block_num_cpu", dict(cpu_ids=[0, 2]), "block id 2 .* blocks 0..1"),
    ("negative gpu id", dict(gpu_ids=[-1, 0]), "block id -1"),
    ("ids that do not pair up", dict(cpu_ids=[0]), "must pair up, got 2 and 1"),
    (
        "host pointer too small for max_block_num_cpu",
        dict(max_blocks=3),
        "does not hold .* bytes of the memory pdhal handed out",
    ),
    (
        "a layer's host pointer past the buffer's end",
        dict(layer1_offset=1),
        "host pointer .* does not hold",
    ),
    ("a freed host pointer", dict(freed=True), "does not lie in memory pdhal handed out"),
    (
        "a host pointer pdhal never handed out",
        dict(hosts=[0x1000, 0x2000]),
        "does not lie in memory pdhal handed out",
    ),
    ("fewer host pointers than layers", dict(hosts="one"), "2 device caches but 1 host"),
    ("mode 2", dict(mode=2), "mode must be 0 .* or 1"),
    ("mode True", dict(mode=True), "mode must be 0"),
    ("float block ids", dict(gpu_ids=[0.0, 1.0]), "integer block ids"),
    ("rank that is not a device id", dict(rank="gpu:0"), "rank \\(device id\\) must be"),
    ("a layer that is no cache", dict(caches="flat"), "must be a \\[blocks, \\.\\.\\.\\] cache"),
]


@pytest.mark.parametrize("what, change, words", SWAP_BAD, ids=[w for w, _, _ in SWAP_BAD])
@pytest.mark.parametrize("mode", [0, 1])
def test_a_bad_swap_is_refused_with_nothing_written(dev, what, change, words, mode):
    """Layer 0 is always valid: a bad argument of layer 1 must not let layer 0 copy."""
    caches = [dev.cache(4, seed=40), dev.cache(4, seed=41)]
    bb = caches[0].block_bytes
    n = 2 * 2 * bb
    base = fd.cuda_host_alloc(n)
    ctypes.memmove(base, pattern(42, n), n)
    hosts = [base, base + n // 2 + change.get("layer1_offset", 0) * bb]
    if change.get("freed"):
        other = fd.cuda_host_alloc(n)
        fd.cuda_host_free(other)
        hosts[1] = other
    if "hosts" in change:
        hosts = hosts[:1] if change["hosts"] == "one" else change["hosts"]
    if change.get("caches") == "flat":
        caches[1] = Cache(caches[1].address, [caches[1].nbytes], "uint8", caches[1].device)

    def snapshot():
        return [ctypes.string_at(base, n)] + [dev.read(c) for c in caches]

    before = snapshot()
    with pytest.raises(pdhal.InvalidArgumentError, match=words):
        fd.swap_cache_all_layers(
            caches,
            hosts,
            change.get("max_blocks", 2),
            change.get("gpu_ids", [0, 1]),
            change.get("cpu_ids", [1, 0]),
            change.get("rank", 0),
            change.get("mode", mode),
        )
    ops.synchronize()
    assert snapshot() == before, f"{what}: a refused swap wrote blocks"
    fd.cuda_host_free(base)


@pytest.mark.parametrize(
    "call, words",
    [
        (
            lambda: fd.share_external_data(
                np.zeros((), np.float16), "never_shared", [1], timeout=0
            ),
            "does not exist",
        ),
        (lambda: fd.share_external_data(np.zeros((), np.float16), "kv", [1], 3), "use_ipc must be"),
        (lambda: fd.share_external_data(np.zeros((), np.float16), "a/b", [1]), "buffer name"),
        (lambda: fd.share_external_data(np.zeros((), np.float16), "kv", [-1]), "shape entry"),
        (lambda: ops.get_data_ptr_ipc(None, "never_shared", 0), "does not exist"),
        (lambda: fd.set_data_ipc(12345, "kv"), "not a raw address"),
        (lambda: fd.unset_data_ipc(None, "never_shared"), "no buffer is shared as 'never_shared'"),
    ],
)
def test_unknown_names_and_bad_sharing_are_refused(dev, call, words):
    with pytest.raises(pdhal.PdhalError, match=words):
        call()


def test_mapping_more_than_was_shared_is_refused(dev):
    cache = dev.cache(2, "float16")
    fd.set_data_ipc(cache, "key_caches_0_rank0.device0")
    with pytest.raises(pdhal.InvalidArgumentError, match=f"shares {cache.nbytes}"):
        fd.share_external_data(
            np.zeros((), np.float16), "key_caches_0_rank0.device0", [3] + cache.shape[1:]
        )


@pytest.mark.paddle
def test_get_data_ptr_ipc_of_an_unknown_name_is_an_error_not_a_tensor(dev):
    paddle = pytest.importorskip("paddle")
    with pytest.raises(pdhal.SegmentError, match="does not exist"):
        fd.get_data_ptr_ipc(paddle.ones([1, 1]), "key_caches_9_rank0.device0", timeout=0)


# ---- calls in another argument order ------------------------------------------------------


def test_a_branch_s_argument_order_is_a_pdhal_error_and_publishes_nothing():
    """FastDeploy's latest forms only: the device_id branch's longer forms name the problem
    instead of binding device_id to num_layers (or failing as a bare TypeError)."""
    out = np.full(1538, 7, np.int32)
    with pytest.raises(
        pdhal.InvalidArgumentError,
        match=r"init_kv_signal_per_query takes "
        r"\(seq_lens_encoder, .*rank, num_layers\) positionally, got 1 more",
    ):
        fd.init_kv_signal_per_query([4], [4], [0], 0, 0, 2)  # (..., rank, device_id, layers)
    with pytest.raises(
        pdhal.InvalidArgumentError,
        match=r"get_output_kv_signal takes "
        r"\(x, rank_id, wait_flag\) positionally.*device_id=\.\.\.",
    ):
        fd.get_output_kv_signal(out, 0, 0, 0)  # (x, rank_id, device_id, wait_flag)
    assert (out == 7).all(), "a refused call wrote the record"
    with pytest.raises(pdhal.InvalidArgumentError, match="wait_flag must be a bool"):
        fd.get_output_kv_signal(out, 0, 3)  # a device id where the flag belongs
    with pytest.raises(pdhal.InvalidArgumentError, match="device_id must be an integer"):
        fd.open_shm_and_get_meta_signal(0, True)  # the older (rank, keep_pd_step_flag) form
    with pytest.raises(pdhal.InvalidArgumentError, match="keep_pd_step_flag must be a bool"):
        fd.open_shm_and_get_meta_signal(0, 0, 5)
    # no refused call began a step or published a table: the first valid one is step 1
    assert ops.init_kv_signal_per_query([4], [4], [0], 0, 2).step == 1
    fd.get_output_kv_signal(out, 0, 0)
    assert out[:2].tolist() == [-1, -1], "a record no layer signalled"


# ---- set_device, memory_allocated ----------------------------------------------------------


@pytest.mark.paddle
def test_set_device_and_memory_allocated_reach_the_platform_s_paddle_device(dev, monkeypatch):
    """FastDeploy's cache processes call set_device(device_id) and log memory_allocated().
    This Paddle is built for the CPU: on the simulated runtimes the test records what pdhal
    asks Paddle for (the device "gpu:3" / "xpu:3", the platform's memory module)."""
    import paddle

    if dev.name == "cpu":
        fd.set_device(3)
        assert paddle.get_device() == "cpu"
        no_stats = "no memory statistics for devices of the cpu platform"
        with pytest.raises(pdhal.UnsupportedError, match=no_stats):
            fd.memory_allocated()
        return
    asked = []
    monkeypatch.setattr(paddle, "set_device", asked.append)
    module = {"cuda": paddle.device.cuda, "xpu": paddle.device.xpu}[dev.name]
    monkeypatch.setattr(module, "memory_allocated", lambda device=None: asked.append(device) or 7)
    fd.set_device(3)
    assert fd.memory_allocated() == 7
    assert fd.memory_allocated(2) == 7
    assert asked == [{"cuda": "gpu", "xpu": "xpu"}[dev.name] + ":3", None, 2]
    with pytest.raises(pdhal.InvalidArgumentError, match="device must be"):
        fd.set_device("gpu:3")


# ---- swap_cache_per_layer(_async), swap_cache_layout ----------------------------------------


@pytest.mark.parametrize("wait", [True, False], ids=["sync", "async"])
def test_swap_one_layer_out_and_back_in(dev, copies, wait):
    """FastDeploy's per-layer swaps (its v1 transfer manager loads layer by layer): the same
    copies as swap_cache_all_layers for one cache; the async form waits for nothing, and
    synchronize() waits for it."""
    swap = fd.swap_cache_per_layer if wait else fd.swap_cache_per_layer_async
    cache = dev.cache(6, seed=60)
    bb, before = cache.block_bytes, dev.read(cache)
    host = fd.cuda_host_alloc(4 * bb)
    ctypes.memset(host, 0, 4 * bb)
    swap(cache, host, 4, [4, 5, 0], [1, 2, 3], 0, 0)
    if not wait:
        ops.synchronize()
    old = blocks_of(before, bb)
    assert blocks_of(ctypes.string_at(host, 4 * bb), bb) == [bytes(bb), old[4], old[5], old[0]]
    dev.write(cache.address, bytes(cache.nbytes))
    swap(cache, host, 4, [1, 2], [3, 1], 0, 1)
    if not wait:
        ops.synchronize()
    got = blocks_of(dev.read(cache), bb)
    assert got == [bytes(bb), old[0], old[4]] + [bytes(bb)] * 3
    assert copies == [2, 2], copies  # 4, 5 -> 1, 2 one run; then two single blocks
    with pytest.raises(pdhal.InvalidArgumentError, match="block id 4"):
        swap(cache, host, 4, [0], [4], 0, 1)
    fd.cuda_host_free(host)


def test_swap_cache_layout_moves_blocks_to_and_from_a_block_major_host_buffer(dev, copies):
    """The storage path's host layout is [block, layer, ...]: block c of layer l lies at
    (c * layers + l) * block bytes. One copy call for all layers; consecutive cpu ids are
    not consecutive in any layer's view, so they stay separate copies."""
    layers, blocks, host_blocks = 3, 4, 3
    caches = [dev.cache(blocks, seed=70 + i) for i in range(layers)]
    bb = caches[0].block_bytes
    before = [blocks_of(dev.read(c), bb) for c in caches]
    n = host_blocks * layers * bb
    base = fd.cuda_host_alloc(n)
    ctypes.memset(base, 0, n)
    shape = caches[0].shape
    fd.swap_cache_layout(caches, base, shape, [3, 1], [0, 1], 0, 0)
    host = blocks_of(ctypes.string_at(base, n), bb)
    for layer in range(layers):
        assert host[0 * layers + layer] == before[layer][3], f"layer {layer}, cpu block 0"
        assert host[1 * layers + layer] == before[layer][1], f"layer {layer}, cpu block 1"
        assert host[2 * layers + layer] == bytes(bb), f"layer {layer}, cpu block 2"
    assert copies == [2 * layers], copies
    for cache in caches:
        dev.write(cache.address, bytes(cache.nbytes))
    fd.swap_cache_layout(caches, base, shape, [0, 2], [1, 0], 0, 1)
    for layer, cache in enumerate(caches):
        want = [before[layer][1], bytes(bb), before[layer][3], bytes(bb)]
        assert blocks_of(dev.read(cache), bb) == want, f"layer {layer}"
    snapshot = ctypes.string_at(base, n), [dev.read(c) for c in caches]
    bad = [
        (dict(cpu=[3]), "cpu block id 3 .* holds 3 blocks of 3 layers"),
        (dict(gpu=[4]), "source block id 4"),
        (dict(shape=[blocks, 1, 2]), "not blocks of \\[1, 2\\]"),
        (dict(base=0x1000), "cache_cpu_ptrs 0x1000 does not lie in memory pdhal handed out"),
        (dict(mode=2), "mode must be 0"),
    ]
    for change, words in bad:
        with pytest.raises(pdhal.InvalidArgumentError, match=words):
            fd.swap_cache_layout(
                caches,
                change.get("base", base),
                change.get("shape", shape),
                change.get("gpu", [0]),
                change.get("cpu", [0]),
                0,
                change.get("mode", 0),
            )
    ops.synchronize()
    assert (ctypes.string_at(base, n), [dev.read(c) for c in caches]) == snapshot
    fd.cuda_host_free(base)
