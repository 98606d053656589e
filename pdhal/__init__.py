"""pdhal: one hardware abstraction for prefill/decode-disaggregated LLM serving.

Engine code uses `from pdhal import ops` (see pdhal.ops); platform facts come from
`pdhal.current_platform()`. Importing pdhal loads no accelerator runtime and no paddle.
"""

__version__ = "0.1.0"

from pdhal._backend import Availability, Backend
from pdhal._errors import (
    BackendLoadError,
    BackendNotFoundError,
    BackendUnavailableError,
    BackPressureTimeoutError,
    ChannelBusyError,
    ClosedHandleError,
    DeviceError,
    InvalidArgumentError,
    InvalidTypeError,
    PdhalError,
    ProducerDiedError,
    ReaderDiedError,
    SegmentError,
    SignalTimeoutError,
    UnsupportedError,
)
from pdhal._hookspecs import hookimpl
from pdhal._platform import Platform


def current_platform() -> Platform:
    """The Platform of the selected backend (selection happens once, on first use)."""
    from pdhal import _registry

    return _registry.selection().platform


def current_backend() -> str:
    """Name of the selected backend."""
    from pdhal import _registry

    return _registry.selection().candidate.name


def get_include() -> str:
    """Directory of pdhal.h, the C API for engine kernels and C/C++ cache messagers
    (compile with -I, link against get_library())."""
    import os

    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "include")


def get_library() -> str:
    """Path of the shared library that exports pdhal.h's functions (link against it, e.g.
    `gcc ... /path/from/get_library`; load the result into a Python process)."""
    import importlib.util

    return importlib.util.find_spec("pdhal._pdhal_c").origin


def channel_path(mode: str, rank: int, device_id: int = 0) -> str:
    """Path of the progress channel of (PDHAL_NAMESPACE, rank, device_id), mode "per_query"
    or "per_chunk": what C code passes to pdhal_segment_open."""
    from pdhal import _names

    kinds = {"per_query": "query", "per_chunk": "chunk"}
    if mode not in kinds:
        raise InvalidArgumentError(f"mode must be 'per_query' or 'per_chunk', got {mode!r}")
    return _names.channel_path(kinds[mode], rank, device_id)


__all__ = [
    "Availability", "Backend", "BackendLoadError", "BackendNotFoundError",
    "BackendUnavailableError", "BackPressureTimeoutError", "ChannelBusyError",
    "ClosedHandleError", "DeviceError", "InvalidArgumentError", "InvalidTypeError",
    "PdhalError", "Platform", "ProducerDiedError", "ReaderDiedError", "SegmentError",
    "SignalTimeoutError", "UnsupportedError", "channel_path", "current_backend",
    "current_platform", "get_include", "get_library", "hookimpl",
]
