"""pdhal: one hardware abstraction for prefill/decode-disaggregated LLM serving.

Engine code uses `from pdhal import ops` (see pdhal.ops); platform facts come from
`pdhal.current_platform()`. Importing pdhal loads no accelerator runtime and no paddle.
"""

from pdhal._backends.contract import Availability, Backend
from pdhal._backends.hookspecs import hookimpl
from pdhal._backends.platform import Platform
from pdhal._errors import (
    BackendLoadError,
    BackendNotFoundError,
    BackendUnavailableError,
    BackPressureTimeoutError,
    BatchFailedError,
    ChannelBusyError,
    ClosedHandleError,
    DeviceError,
    InvalidArgumentError,
    InvalidTypeError,
    MemoryPinnedError,
    PdhalError,
    ProducerDiedError,
    ReaderDiedError,
    RefusedError,
    SegmentError,
    SessionError,
    SignalTimeoutError,
    SystemResourceError,
    TransferError,
    TransportLoadError,
    UnsupportedError,
)
from pdhal._version import __version__ as __version__


def current_platform() -> Platform:
    """The Platform of the selected backend (selection happens once, on first use)."""
    from pdhal._backends import registry as _registry

    return _registry.selection().platform


def current_backend() -> str:
    """Name of the selected backend."""
    from pdhal._backends import registry as _registry

    return _registry.selection().candidate.name


def get_include() -> str:
    """Directory of pdhal.h, the C API for engine kernels and C/C++ cache messagers
    (compile with -I, link against get_library())."""
    import os

    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "include")


def get_library(standalone: bool = False) -> str:
    """Path of a shared library exporting pdhal.h's functions (link against it with
    -I get_include()).

    By default, pdhal's Python extension: what an engine's op (a C/C++ extension loaded into
    the engine's Python process) links against, so that it and pdhal's Python side share
    one C core: the kernel forms an op receives name registrations in that core.
    standalone=True: libpdhal.so, the same core without Python, for a C/C++ program that
    runs outside any Python process (a messager written in C), e.g.
    `cc messager.c -I<get_include()> <dir>/libpdhal.so -Wl,-rpath,<dir>`."""
    import importlib.util
    import os

    extension = importlib.util.find_spec("pdhal._pdhal_c").origin
    if not standalone:
        return extension
    return os.path.join(os.path.dirname(extension), "libpdhal.so")


def channel_path(mode: str, rank: int, device_id: int = 0) -> str:
    """Path of the progress channel of (PDHAL_NAMESPACE, rank, device_id), mode "per_query"
    or "per_chunk": what C code passes to pdhal_segment_open."""
    from pdhal._protocol import names as _names

    kinds = {"per_query": "query", "per_chunk": "chunk"}
    if mode not in kinds:
        raise InvalidArgumentError(f"mode must be 'per_query' or 'per_chunk', got {mode!r}")
    return _names.channel_path(kinds[mode], rank, device_id)


def namespace() -> str:
    """The effective namespace (PDHAL_NAMESPACE, default "default", validated) that keeps
    deployments on one host apart: every segment name of this process carries it."""
    from pdhal._protocol import names as _names

    return _names.namespace()


def check_environment(env: dict[str, str] | None = None) -> None:
    """Check every PDHAL_* variable set here (or in `env`, a child process's environment)
    before anything starts: an InvalidArgumentError naming each bad one and what is wrong,
    or nothing."""
    from pdhal._backends import environment as _environment

    found = _environment.problems(env)
    if found:
        raise InvalidArgumentError("; ".join(f"{name}: {why}" for name, why in found.items()))


def cleanup(namespace: str | None = None) -> tuple[list[str], list[str]]:
    """Remove this user's segments in `namespace` (default: every namespace) whose producer
    is dead, as `pdhal cleanup` does; returns (removed, left) paths."""
    from pdhal._protocol import cleanup as _cleanup

    return _cleanup.cleanup(namespace)


# Names resolved on first use, so `import pdhal` loads no library (the compiled core):
#: RECORD_WORDS: int32 words of one per-chunk record, the buffer get_output_kv_signal and
#:   reader.next fill: [count, layer, (slot, cached, length) * MAX_REQUESTS].
#: MAX_REQUESTS: the most prefill requests one per-chunk step may publish.
#: The classes ops return (importable from here for annotations and isinstance checks).
_LAZY = {
    "RECORD_WORDS": "pdhal._protocol.core",
    "MAX_REQUESTS": "pdhal._protocol.core",
    "SignalMeta": "pdhal._protocol.signals",
    "LayerSignal": "pdhal._protocol.signals",
    "ChunkSignal": "pdhal._protocol.signals",
    "ProgressReader": "pdhal._protocol.signals",
    "ChunkReader": "pdhal._protocol.signals",
    "KVSignalSender": "pdhal._protocol.sender",
    "HostBuffer": "pdhal._memory.hostmem",
    "SharedDeviceBuffer": "pdhal._memory.published",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = globals()[name] = getattr(importlib.import_module(_LAZY[name]), name)
        return value
    raise AttributeError(f"module 'pdhal' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "Availability",
    "Backend",
    "BackendLoadError",
    "BackendNotFoundError",
    "BackendUnavailableError",
    "BackPressureTimeoutError",
    "BatchFailedError",
    "ChannelBusyError",
    "ChunkReader",
    "ChunkSignal",
    "ClosedHandleError",
    "DeviceError",
    "HostBuffer",
    "InvalidArgumentError",
    "InvalidTypeError",
    "KVSignalSender",
    "LayerSignal",
    "MAX_REQUESTS",
    "MemoryPinnedError",
    "PdhalError",
    "Platform",
    "ProducerDiedError",
    "ProgressReader",
    "ReaderDiedError",
    "RECORD_WORDS",
    "RefusedError",
    "SegmentError",
    "SessionError",
    "SharedDeviceBuffer",
    "SignalMeta",
    "SignalTimeoutError",
    "SystemResourceError",
    "TransferError",
    "TransportLoadError",
    "UnsupportedError",
    "channel_path",
    "check_environment",
    "cleanup",
    "current_backend",
    "current_platform",
    "get_include",
    "get_library",
    "hookimpl",
    "namespace",
]
