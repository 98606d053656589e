"""The one module engine code imports: `from pdhal import ops`.

Every name below is bound, on first use, to the active backend's own function object
(selected once, see pdhal.current_platform); later `ops.X` lookups are plain module
attributes, with no plugin dispatch on the per-layer path.

Producer: open_shm_and_get_meta_signal, init_signal_layerwise, init_kv_signal_per_query,
signal_layer_ready, create_kv_signal_sender, destroy_kv_signal_sender.
Consumer: open_kv_signal_reader, open_kv_chunk_reader, get_output_kv_signal, ack_kv_signal.
Memory: host_alloc / host_free (aliases cuda_host_alloc / cuda_host_free), host_register /
host_unregister, get_peer_mem_addr, set_data_ipc, share_external_data, get_data_ptr_ipc,
unset_data_ipc.
Copies: copy_blocks (block ids to block ids, ordered on a stream), synchronize.

FastDeploy's own call shapes (int addresses, tensors for kernels) are pdhal.compat.fastdeploy.
"""

from pdhal import _registry

OP_NAMES = (
    "open_shm_and_get_meta_signal",
    "init_signal_layerwise",
    "init_kv_signal_per_query",
    "signal_layer_ready",
    "create_kv_signal_sender",
    "destroy_kv_signal_sender",
    "open_kv_signal_reader",
    "open_kv_chunk_reader",
    "get_output_kv_signal",
    "ack_kv_signal",
    "host_alloc",
    "host_free",
    "cuda_host_alloc",
    "cuda_host_free",
    "host_register",
    "host_unregister",
    "get_peer_mem_addr",
    "set_data_ipc",
    "share_external_data",
    "get_data_ptr_ipc",
    "unset_data_ipc",
    "copy_blocks",
    "synchronize",
)

__all__ = list(OP_NAMES)


def _bind() -> dict:
    table = _registry.selection().ops
    globals().update({name: table[name] for name in OP_NAMES})
    return table


def _unbind() -> None:
    for name in OP_NAMES:
        globals().pop(name, None)


def __getattr__(name: str):
    if name not in OP_NAMES:
        raise AttributeError(f"pdhal.ops has no op {name!r}; ops: {', '.join(OP_NAMES)}")
    return _bind()[name]


def __dir__():
    return sorted(set(globals()) | set(OP_NAMES))
