"""FastDeploy's op names with FastDeploy's call shapes, over pdhal: the one module its
attention backends, cache messager and cache manager import instead of the per-platform
`fastdeploy.cache_manager.ops` / `fastdeploy.model_executor.ops.{gpu,xpu}` branches.

    from pdhal.compat.fastdeploy import (cuda_host_alloc, cuda_host_free, get_data_ptr_ipc,
        get_output_kv_signal, ipc_sent_key_value_cache_by_remote_ptr, ..., unset_data_ipc)

Where FastDeploy's shapes differ from pdhal.ops, these follow FastDeploy's (its 2025 sources,
the latest argument orders): host memory is an int address; a layer signal and a sender are
int64 CPU tensors a C++ op receives (their kernel form, see pdhal.h); caches and remote
pointers are Paddle tensors. A call in another order fails loudly: arguments FastDeploy
never passes positionally are keyword-only, and a flag is checked to be a flag.
docs/engines/fastdeploy.md maps each call site.

Every function is a thin wrapper over pdhal.ops, which selects the backend (cpu, cuda,
xpu, or a plugin); Paddle is imported only by the functions that return Paddle tensors.
"""

from __future__ import annotations

import importlib
import threading

from pdhal import (
    HostBuffer,
    InvalidArgumentError,
    InvalidTypeError,
    KVSignalSender,
    SignalMeta,
    UnsupportedError,
    blocks,
    current_platform,
    ops,
)
from pdhal.plugin import memory_ref, validate_index

__all__ = [
    "create_kv_signal_sender",
    "cuda_host_alloc",
    "cuda_host_free",
    "cuda_host_register",
    "cuda_host_unregister",
    "destroy_kv_signal_sender",
    "get_all_visible_devices",
    "get_data_ptr_ipc",
    "get_output_kv_signal",
    "get_peer_mem_addr",
    "init_kv_signal_per_query",
    "init_signal_layerwise",
    "ipc_sent_key_value_cache_by_remote_ptr",
    "ipc_sent_key_value_cache_by_remote_ptr_block_sync",
    "memory_allocated",
    "open_shm_and_get_meta_signal",
    "set_data_ipc",
    "set_device",
    "share_external_data",
    "share_external_data_",
    "signal_layer_ready",
    "swap_cache_all_layers",
    "swap_cache_layout",
    "swap_cache_per_layer",
    "swap_cache_per_layer_async",
    "unset_data_ipc",
]

#: swap_cache_all_layers' mode: 0 device -> host (swap out), 1 host -> device (swap in).
SWAP_TO_HOST, SWAP_TO_DEVICE = 0, 1


def _int64_tensor(words):
    """An int64 CPU Paddle tensor holding `words` (what a C++ op takes as an argument)."""
    import numpy as np
    import paddle

    return paddle.to_tensor(np.asarray(words, dtype=np.int64), place=paddle.CPUPlace())


def _flag(value: object, what: str) -> bool:
    """A bool or 0/1, as FastDeploy passes flags; anything else is an argument in the wrong
    place (e.g. a device id where a flag belongs)."""
    if isinstance(value, bool) or (isinstance(value, int) and value in (0, 1)):
        return bool(value)
    raise InvalidArgumentError(
        f"{what} must be a bool (or 0/1), got {value!r}: check the argument order (FastDeploy's "
        f"latest form; device_id, where given, is a keyword argument)"
    )


def _no_extra(op: str, form: str, extra: tuple) -> None:
    """Refuse positional arguments beyond FastDeploy's latest form (a branch's longer form
    would otherwise bind its values to the wrong parameters, or fail as a bare TypeError)."""
    if extra:
        raise InvalidArgumentError(
            f"{op} takes {form} positionally, got {len(extra)} more ({extra!r}): FastDeploy's "
            f"latest form; pass device_id as a keyword (device_id=...) instead"
        )


# ---- layer signals (attention backends, model runners) ----------------------------------


def open_shm_and_get_meta_signal(
    rank: int, device_id: int = 0, keep_pd_step_flag: bool = False
) -> SignalMeta:
    """Start this forward pass's step on (rank, device_id)'s per-query channel (a draft/MTP
    model keeps the step); pass the result to init_signal_layerwise."""
    return ops.open_shm_and_get_meta_signal(
        rank, device_id, _flag(keep_pd_step_flag, "keep_pd_step_flag")
    )


def init_signal_layerwise(kv_signal_metadata: SignalMeta, layer_id: int):
    """The signal of `layer_id` (start-layer offset included) as the int64 CPU tensor an
    attention op takes as kv_signal_data and posts through pdhal.h after the layer's cache
    writes; signal_layer_ready accepts it too."""
    return _int64_tensor(ops.init_signal_layerwise(kv_signal_metadata, layer_id).kernel_form)


def init_kv_signal_per_query(
    seq_lens_encoder,
    seq_lens_this_time,
    seq_lens_decoder,
    rank: int,
    num_layers: int,
    *extra,
    device_id: int = 0,
) -> None:
    """Publish this step's prefill table (per-chunk mode) and make it the process's current
    step: an attention op then posts "the next layer" with pdhal_next_chunk_layer_store().
    FastDeploy's latest order is (..., rank, num_layers); device_id is keyword-only, so the
    (..., rank, device_id, num_layers) order of a branch fails instead of swapping them."""
    _no_extra(
        "init_kv_signal_per_query",
        "(seq_lens_encoder, seq_lens_this_time, seq_lens_decoder, rank, num_layers)",
        extra,
    )
    ops.init_kv_signal_per_query(
        seq_lens_encoder, seq_lens_this_time, seq_lens_decoder, rank, num_layers, device_id
    )


def get_output_kv_signal(
    x, rank_id: int, wait_flag, *extra, device_id: int = 0, timeout: float | None = None
) -> None:
    """Fill the int32 CPU tensor `x` ([512 * 3 + 2]) with the next per-chunk record:
    [count, layer, (slot, cached tokens, chunk tokens) * count], or [-1, -1, ...]. The
    (x, rank_id, device_id, wait_flag) order of a branch fails (device_id is keyword-only)."""
    _no_extra("get_output_kv_signal", "(x, rank_id, wait_flag)", extra)
    ops.get_output_kv_signal(x, rank_id, _flag(wait_flag, "wait_flag"), device_id, timeout=timeout)


def signal_layer_ready(kv_signal_data, stream=None, sender=None) -> None:
    """Post a layer signal from Python (what the attention op does from C++)."""
    ops.signal_layer_ready(kv_signal_data, stream, None if sender is None else _live_sender(sender))


_senders: dict[int, KVSignalSender] = {}  # kernel id -> the sender those words name
_senders_lock = threading.Lock()


def create_kv_signal_sender():
    """A sender as the int64 CPU tensor an XPU attention op takes (cachekv_signal_thread);
    the op posts through it with pdhal_kernel_sender / pdhal_sender_post."""
    sender = ops.create_kv_signal_sender()
    words = sender.kernel_form
    with _senders_lock:
        _senders[words[1]] = sender
    return _int64_tensor(words)


def _live_sender(sender_tensor) -> KVSignalSender:
    if isinstance(sender_tensor, KVSignalSender):
        return sender_tensor
    words = memory_ref(sender_tensor, "sender")
    if words.nbytes != 32:
        raise InvalidArgumentError(
            "a sender's tensor holds 4 int64 words (from create_kv_signal_sender)"
        )
    ident = int(sender_tensor.tolist()[1]) if hasattr(sender_tensor, "tolist") else None
    with _senders_lock:
        sender = _senders.get(ident)
    if sender is None:
        raise InvalidArgumentError(
            "this tensor names no sender alive in this process "
            "(destroyed already, or not from create_kv_signal_sender)"
        )
    return sender


def destroy_kv_signal_sender(sender_tensor) -> None:
    """Deliver every signal the sender still holds, then stop it."""
    sender = _live_sender(sender_tensor)
    with _senders_lock:
        _senders.pop(sender.kernel_form[1], None)
    ops.destroy_kv_signal_sender(sender)


# ---- host memory -------------------------------------------------------------------------

_host_buffers: dict[int, HostBuffer] = {}  # address cuda_host_alloc returned -> its buffer
_host_lock = threading.Lock()


def cuda_host_alloc(size: int, flags: int = 0) -> int:
    """Pinned host memory of `size` bytes from the backend's runtime, as an int address (the
    backend frees it, through cuda_host_free). `flags` is accepted for FastDeploy's calls."""
    validate_index(flags, "flags", 1 << 32)
    buf = ops.host_alloc(size)
    with _host_lock:
        _host_buffers[buf.address] = buf
    return buf.address


def cuda_host_free(ptr: int) -> None:
    """Free an address cuda_host_alloc returned (anything else is refused)."""
    if isinstance(ptr, bool) or not isinstance(ptr, int):
        raise InvalidTypeError(
            f"ptr must be the int cuda_host_alloc returned, got {type(ptr).__name__}"
        )
    with _host_lock:
        buf = _host_buffers.pop(ptr, None)
    if buf is None:
        raise InvalidArgumentError(
            f"{ptr:#x} is not an address cuda_host_alloc returned (or it was freed already)"
        )
    ops.host_free(buf)


def cuda_host_register(ptr, size: int | None = None, flags: int = 0) -> None:
    """Pin existing host memory through the accelerator runtime (for a NIC to register)."""
    validate_index(flags, "flags", 1 << 32)
    ops.host_register(ptr, size)


def cuda_host_unregister(ptr) -> None:
    ops.host_unregister(ptr)


def get_peer_mem_addr(ptr) -> int:
    """The address a NIC registers for this memory (on XPU, the device memory's peer alias)."""
    return ops.get_peer_mem_addr(ptr)


# ---- KV caches shared between processes ----------------------------------------------------


def set_data_ipc(tensor, shm_name: str) -> None:
    """Share a KV-cache tensor with the cache processes on this host under `shm_name`."""
    ops.set_data_ipc(tensor, shm_name)


def share_external_data(
    input,
    shm_name: str,
    shape,
    use_ipc: bool = True,
    *,  # noqa: A002
    timeout: float | None = 60.0,
):
    """A tensor of `input`'s dtype and `shape` over the cache shared as `shm_name`:
    FastDeploy's GPU form (3 arguments) and XPU form (use_ipc, 4th). pdhal always maps by
    IPC, so use_ipc=False (XPU's same-process pointer) is refused rather than ignored.
    Waits up to `timeout` s for the name to be shared (FastDeploy's op fails at once)."""
    if not _flag(use_ipc, "use_ipc"):
        raise InvalidArgumentError(
            "use_ipc=False (a raw pointer valid in one process only) is "
            "not supported: pdhal shares caches between processes"
        )
    shared = ops.share_external_data(input, shm_name, list(shape), timeout)
    if _is_paddle(input) and not _is_paddle(shared):
        import paddle

        device = shared.device
        if not device.startswith("gpu") or not paddle.is_compiled_with_cuda():
            raise UnsupportedError(
                f"{shm_name!r} is mapped as {device} memory, which this Paddle cannot wrap as a "
                f"tensor (DLPack reaches CUDA memory only, and only in a Paddle built with "
                f"CUDA): pass a non-Paddle `input` (a numpy array or dtype name) for the mapping "
                f"itself, or use get_data_ptr_ipc's address"
            )
        return paddle.from_dlpack(shared)  # a device tensor over the mapping (DLPack)
    return shared


def share_external_data_(
    cache, cache_name: str, cache_shape, use_ipc: bool = True, *, timeout: float | None = 60.0
):
    """cache_manager.ops' helper of the same name."""
    return share_external_data(cache, cache_name, cache_shape, use_ipc, timeout=timeout)


def get_data_ptr_ipc(tmp_input, shm_name: str, *, timeout: float | None = 60.0):
    """The address of the cache another process shares as `shm_name`, mapped here, as the
    int64[1] CPU tensor FastDeploy keeps and passes to ipc_sent_key_value_cache_by_remote_ptr.
    Waits up to `timeout` s for the name to be shared."""
    return _int64_tensor([ops.get_data_ptr_ipc(tmp_input, shm_name, timeout)])


def unset_data_ipc(
    tmp_input, shm_name: str, close_ipc: bool = True, unlink_shm: bool = True
) -> None:
    """Stop sharing `shm_name`: close this process's mapping of it (close_ipc) and remove
    the record (unlink_shm, the publisher's own)."""
    ops.unset_data_ipc(
        tmp_input, shm_name, _flag(close_ipc, "close_ipc"), _flag(unlink_shm, "unlink_shm")
    )


def _is_paddle(obj) -> bool:
    return type(obj).__module__.startswith("paddle")


# ---- block transfers ---------------------------------------------------------------------


def _address(pointer, what: str) -> int:
    """An address given as an int or as FastDeploy's int64[1] tensor."""
    if hasattr(pointer, "tolist"):
        values = pointer.tolist()
        pointer = values[0] if isinstance(values, list) and len(values) == 1 else values
    if isinstance(pointer, bool) or not isinstance(pointer, int):
        raise InvalidArgumentError(
            f"{what} must be an address (int, or an int64 tensor of one), got {pointer!r}"
        )
    return pointer


def ipc_sent_key_value_cache_by_remote_ptr(
    local_key_tensor,
    local_value_tensor,
    local_block_ids,
    remote_block_ids,
    remote_key_tensor,
    remote_value_tensor,
    block_num: int,
    local_device_id: int,
    remote_device_id: int,
    cuda_stream_raw: int,
    is_scale: bool = False,
) -> None:
    """Copy one layer's blocks local_block_ids[:block_num] of the local K and V caches into
    blocks remote_block_ids[:block_num] of another process's caches on this host (their
    addresses from get_data_ptr_ipc), ordered on the stream; runs of consecutive ids are one
    copy. The remote extent is what pdhal mapped, so no id can reach past it."""
    block_num = validate_index(block_num, "block_num", 1 << 31)
    _flag(is_scale, "is_scale")  # the scales' block size follows from their tensor's shape
    local_ids = blocks.BlockIds(local_block_ids, "local_block_ids")
    remote_ids = blocks.BlockIds(remote_block_ids, "remote_block_ids")
    if block_num > min(len(local_ids), len(remote_ids)):
        raise InvalidArgumentError(
            f"block_num {block_num} exceeds the block ids given "
            f"({len(local_ids)} local, {len(remote_ids)} remote)"
        )
    if list(local_value_tensor.shape) != list(local_key_tensor.shape):
        raise InvalidArgumentError(
            f"the local K and V caches differ in shape: "
            f"{list(local_key_tensor.shape)} and "
            f"{list(local_value_tensor.shape)}"
        )
    remote = [
        _address(remote_key_tensor, "remote key cache pointer"),
        _address(remote_value_tensor, "remote value cache pointer"),
    ]
    local = [local_key_tensor, local_value_tensor]
    block_bytes = blocks.block_bytes_of(local_key_tensor, "local key cache")
    local_ids, remote_ids = local_ids[:block_num], remote_ids[:block_num]
    # K and V as two layers of one copy: every id is checked for both before either is
    # written, and the ids are converted once.
    ops.copy_blocks(remote, remote_ids, local, local_ids, block_bytes, cuda_stream_raw)


def ipc_sent_key_value_cache_by_remote_ptr_block_sync(
    local_key_tensor, local_value_tensor, cuda_stream_raw: int
) -> None:
    """Wait until the transfers queued on the stream are done."""
    ops.synchronize(cuda_stream_raw)


def swap_cache_all_layers(
    cache_gpu_tensors,
    cache_cpu_ptrs,
    max_block_num_cpu: int,
    swap_block_ids_gpu,
    swap_block_ids_cpu,
    rank: int,
    mode: int,
) -> None:
    """Move blocks between each layer's device cache and its pinned host buffer
    (cache_cpu_ptrs[i], max_block_num_cpu blocks): mode 0 device -> host, 1 host -> device;
    then wait for the copies. `rank` is FastDeploy's device id, checked only as an int."""
    caches, hosts = list(cache_gpu_tensors), list(cache_cpu_ptrs)
    if len(caches) != len(hosts):
        raise InvalidArgumentError(
            f"{len(caches)} device caches but {len(hosts)} host pointers: one host buffer per layer"
        )
    _swap(caches, hosts, max_block_num_cpu, swap_block_ids_gpu, swap_block_ids_cpu, rank, mode)
    ops.synchronize()


def swap_cache_per_layer(
    cache_gpu,
    cache_cpu_ptr,
    max_block_num_cpu: int,
    swap_block_ids_gpu,
    swap_block_ids_cpu,
    rank: int,
    mode: int,
) -> None:
    """swap_cache_all_layers for one layer: its device cache and its host pointer."""
    swap_cache_per_layer_async(
        cache_gpu,
        cache_cpu_ptr,
        max_block_num_cpu,
        swap_block_ids_gpu,
        swap_block_ids_cpu,
        rank,
        mode,
    )
    ops.synchronize()


def swap_cache_per_layer_async(
    cache_gpu,
    cache_cpu_ptr,
    max_block_num_cpu: int,
    swap_block_ids_gpu,
    swap_block_ids_cpu,
    rank: int,
    mode: int,
) -> None:
    """swap_cache_per_layer without the wait: the copies are queued on Paddle's current
    stream (where FastDeploy's op queues them: the tensor's), else the runtime's default
    stream; synchronize() waits for them."""
    _swap(
        [cache_gpu],
        [cache_cpu_ptr],
        max_block_num_cpu,
        swap_block_ids_gpu,
        swap_block_ids_cpu,
        rank,
        mode,
    )


def _swap_direction(rank: int, mode: int) -> bool:
    """True for device -> host (mode 0), False for host -> device (1); rank checked as an
    int (FastDeploy's device id)."""
    validate_index(rank, "rank (device id)")
    if mode not in (SWAP_TO_HOST, SWAP_TO_DEVICE) or isinstance(mode, bool):
        raise InvalidArgumentError(
            f"mode must be 0 (device to host) or 1 (host to device), got {mode!r}"
        )
    return mode == SWAP_TO_HOST


def _swap(caches: list, hosts: list, max_block_num_cpu, gpu_block_ids, cpu_block_ids, rank, mode):
    """Queue the copies of a swap between device caches and per-layer host buffers."""
    to_host = _swap_direction(rank, mode)
    max_blocks = validate_index(max_block_num_cpu, "max_block_num_cpu", 1 << 40)
    gpu_ids = blocks.BlockIds(gpu_block_ids, "swap_block_ids_gpu")
    cpu_ids = blocks.BlockIds(cpu_block_ids, "swap_block_ids_cpu")
    if len(gpu_ids) != len(cpu_ids):
        raise InvalidArgumentError(
            f"swap_block_ids_gpu and swap_block_ids_cpu must pair up, "
            f"got {len(gpu_ids)} and {len(cpu_ids)} ids"
        )
    layers: dict[int, tuple[list, list]] = {}  # block bytes -> (device caches, host spans)
    for layer, (cache, host) in enumerate(zip(caches, hosts)):
        block_bytes = blocks.block_bytes_of(cache, f"device cache of layer {layer}")
        host = blocks.memory_span(
            _address(host, f"host pointer of layer {layer}"),
            max_blocks * block_bytes,
            f"host pointer of layer {layer}",
        )
        on_device, on_host = layers.setdefault(block_bytes, ([], []))
        on_device.append(cache)
        on_host.append(host)
    # One copy per block size (every layer, as a rule), its ids converted once; layers of
    # several sizes are all checked before the first is copied.
    copies = [
        (on_host, cpu_ids, on_device, gpu_ids, block_bytes)
        if to_host
        else (on_device, gpu_ids, on_host, cpu_ids, block_bytes)
        for block_bytes, (on_device, on_host) in layers.items()
    ]
    if len(copies) > 1:
        for dsts, dst_ids, srcs, src_ids, block_bytes in copies:
            for dst, src in zip(dsts, srcs):
                blocks.check_copy(dst, dst_ids, src, src_ids, block_bytes)
    for copy in copies:
        ops.copy_blocks(*copy)


def swap_cache_layout(
    cache_gpu_tensors,
    cache_cpu_ptrs,
    cache_shape,
    gpu_block_ids,
    cpu_block_ids,
    rank: int,
    mode: int,
) -> None:
    """Move blocks between each layer's device cache and one pinned host buffer laid out
    [block, layer, ...] (the storage path's layout: block c of layer l at cache_cpu_ptrs +
    (c * layers + l) * block bytes, cache_shape[1:] the shape of a block): mode 0 device ->
    host, 1 host -> device; then wait. The host buffer's blocks are as many as fit in the
    memory pdhal handed out at cache_cpu_ptrs."""
    to_host = _swap_direction(rank, mode)
    caches = list(cache_gpu_tensors)
    if not caches:
        raise InvalidArgumentError("cache_gpu_tensors is empty: give one device cache per layer")
    block_shape = list(cache_shape.tolist() if hasattr(cache_shape, "tolist") else cache_shape)[1:]
    for layer, cache in enumerate(caches):
        if list(cache.shape)[1:] != block_shape:
            raise InvalidArgumentError(
                f"the device cache of layer {layer} has shape {list(cache.shape)}, "
                f"not blocks of {block_shape} as cache_shape says"
            )
    block_bytes = blocks.block_bytes_of(caches[0], "device cache of layer 0")
    base = _address(cache_cpu_ptrs, "cache_cpu_ptrs")
    row = len(caches) * block_bytes  # one block of every layer
    host = blocks.memory_span(base, None, "cache_cpu_ptrs")
    host_blocks = host.nbytes // row
    gpu_ids = blocks.BlockIds(gpu_block_ids, "gpu_block_ids")
    cpu_ids = blocks.BlockIds(cpu_block_ids, "cpu_block_ids").tolist()
    if len(gpu_ids) != len(cpu_ids):
        raise InvalidArgumentError(
            f"gpu_block_ids and cpu_block_ids must pair up, got {len(gpu_ids)} and "
            f"{len(cpu_ids)} ids"
        )
    for entry, block in enumerate(cpu_ids):
        if not 0 <= block < host_blocks:
            raise InvalidArgumentError(
                f"cpu block id {block} (entry {entry}) is outside the host buffer at "
                f"{base:#x}, which holds {host_blocks} blocks of {len(caches)} layers "
                f"in memory from cuda_host_alloc"
            )
    # Layer l's blocks, seen from base + l * block_bytes, are every len(caches)-th block.
    hosts = [
        blocks.memory_span(base + layer * block_bytes, host_blocks * row - layer * block_bytes)
        for layer in range(len(caches))
    ]
    host_ids = [block * len(caches) for block in cpu_ids]
    if to_host:
        ops.copy_blocks(hosts, host_ids, caches, gpu_ids, block_bytes)
    else:
        ops.copy_blocks(caches, gpu_ids, hosts, host_ids, block_bytes)
    ops.synchronize()


# ---- devices -------------------------------------------------------------------------------


#: Paddle's module with the memory statistics of each kind of device pdhal names ("gpu:0"
#: is paddle.device.cuda's); Paddle's device names are pdhal's (paddle.set_device("xpu:1")).
_PADDLE_MEMORY_STATS = {"gpu": "paddle.device.cuda", "xpu": "paddle.device.xpu"}


def set_device(device: int) -> None:
    """paddle.set_device for this platform's device `device` ("gpu:3" on cuda, "xpu:3" on
    xpu); Paddle's CPU on a platform without devices (cpu)."""
    import paddle

    validate_index(device, "device")
    kind = current_platform().device_kind
    paddle.set_device(f"{kind}:{device}" if kind else "cpu")


def memory_allocated(device=None) -> int:
    """Bytes Paddle's allocator holds on `device` (default: the current one), from Paddle's
    module for the platform's devices (paddle.device.cuda, paddle.device.xpu)."""
    platform = current_platform()
    module = _PADDLE_MEMORY_STATS.get(platform.device_kind)
    if module is None:
        raise UnsupportedError(
            f"memory_allocated reports an accelerator's memory, and Paddle has no memory "
            f"statistics for devices of the {platform.name} platform "
            f"({platform.device_kind or 'none'!r}; it has them for "
            f"{', '.join(sorted(_PADDLE_MEMORY_STATS))})"
        )
    return importlib.import_module(module).memory_allocated(device)


def get_all_visible_devices() -> str:
    """The shell prefix FastDeploy puts before a cache process's command so its physical
    --device_id is valid there: every device visible (the platform's visibility variable
    unset), whatever this process inherited. No device count is assumed."""
    return f"env -u {current_platform().device_control_env_var}"
