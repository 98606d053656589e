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


__all__ = [
    "Availability", "Backend", "BackendLoadError", "BackendNotFoundError",
    "BackendUnavailableError", "BackPressureTimeoutError", "ChannelBusyError",
    "ClosedHandleError", "DeviceError", "InvalidArgumentError", "InvalidTypeError",
    "PdhalError", "Platform", "ProducerDiedError", "ReaderDiedError", "SegmentError",
    "SignalTimeoutError", "UnsupportedError", "current_backend", "current_platform", "hookimpl",
]
