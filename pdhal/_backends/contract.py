"""The backend interface every pdhal plugin implements, and the check of what it declares."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

from pdhal._backends.optable import BACKEND_OPS
from pdhal._backends.platform import Platform
from pdhal._errors import BackendLoadError


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
        """The backend's implementation of each op in BACKEND_OPS, by name (valid after
        load()). pdhal.ops binds these very objects: no dispatch on the per-layer path."""
        raise NotImplementedError

    def info(self) -> dict[str, object]:
        """Runtime facts for `pdhal info` (library path, versions, ...)."""
        return {}

    def test_support(self):
        """The pdhal.testing.TestSupport the conformance kit uses (None: not supported)."""
        return None


def check_ops(table: object, who: str) -> dict[str, Callable]:
    """`table` if it maps every name of BACKEND_OPS, and nothing else, to a callable; else a
    BackendLoadError naming exactly what is missing, not callable or unknown."""
    if not isinstance(table, dict):
        raise BackendLoadError(
            f"{who}: ops() returned {type(table).__name__}, expected a dict of op name -> callable"
        )
    missing = [name for name in BACKEND_OPS if name not in table]
    broken = [name for name in BACKEND_OPS if name in table and not callable(table[name])]
    unknown = sorted(set(table) - set(BACKEND_OPS))
    problems = []
    if missing:
        problems.append(f"does not implement {', '.join(missing)}")
    if broken:
        problems.append(f"gives non-callables for {', '.join(broken)}")
    if unknown:
        problems.append(
            f"offers ops pdhal does not know: {', '.join(unknown)} (backend ops "
            f"are {', '.join(BACKEND_OPS)})"
        )
    if problems:
        raise BackendLoadError(f"{who} " + "; ".join(problems))
    return table
