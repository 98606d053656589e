"""The backend interface every pdhal plugin implements."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

from pdhal._platform import Platform

#: Ops a backend must provide; the device-independent ones come from pdhal itself.
BACKEND_OPS = (
    "signal_layer_ready",
    "create_kv_signal_sender",
    "destroy_kv_signal_sender",
    "host_alloc",
    "host_free",
    "get_peer_mem_addr",
    "set_data_ipc",
    "share_external_data",
)


@dataclass(frozen=True)
class Availability:
    """Whether a backend can run here, and why not."""

    available: bool
    reason: str = ""


class Backend:
    """One accelerator backend. Constructing it (and `availability()`) must be cheap and
    must not raise; `load()` binds the vendor runtime and is called only once selected."""

    #: Name used by PDHAL_PLATFORM / PDHAL_PLUGINS.
    name: ClassVar[str] = ""
    #: Among available backends the highest priority wins; the cpu default has 0.
    priority: ClassVar[int] = 0

    def availability(self) -> Availability:
        """Is the hardware (and runtime) here? Never raises: the reason says why not."""
        raise NotImplementedError

    def load(self) -> None:
        """Bind the runtime; raises BackendUnavailableError with the cause."""

    def platform(self) -> Platform:
        """The Platform of this backend (valid after load())."""
        raise NotImplementedError

    def ops(self) -> dict[str, Callable]:
        """The backend's implementations of BACKEND_OPS (valid after load()): by default the
        functions of those names in the module defining this class (or, for a subclass
        living elsewhere, the nearest base class's module that has them all)."""
        for cls in type(self).__mro__:
            module = sys.modules[cls.__module__]
            if all(callable(getattr(module, name, None)) for name in BACKEND_OPS):
                return {name: getattr(module, name) for name in BACKEND_OPS}
        return {}

    def info(self) -> dict[str, object]:
        """Runtime facts for `pdhal info` (library path, versions, ...)."""
        return {}

    def test_support(self):
        """The pdhal.testing.TestSupport the conformance kit uses (None: not supported)."""
        return None
