"""Backend discovery and selection, done once per process.

Plugins are distributions with an entry point in group `pdhal.backends` pointing at a module
(or object) that implements the `pdhal_backend` hook. Listing them reads metadata only;
importing a plugin module must be cheap (no runtime is loaded until `Backend.load()`).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import metadata

from pdhal._backends import optable, plugins
from pdhal._backends.contract import Availability, Backend, check_ops
from pdhal._backends.platform import Platform
from pdhal._errors import (
    BackendLoadError,
    BackendNotFoundError,
    BackendUnavailableError,
    PdhalError,
)

log = logging.getLogger("pdhal")

ENTRY_POINT_GROUP = "pdhal.backends"
EMBEDDED = "cpu"


@dataclass
class Candidate:
    """A backend plugin as discovered: where it comes from and what became of it."""

    name: str
    distribution: str
    version: str
    source: str  # entry point value, e.g. "pdhal_cuda.plugin"
    backend: Backend | None = None
    error: str | None = None  # import or hook failure
    availability: Availability | None = None

    def describe(self) -> str:
        return f"backend {self.name!r} (distribution {self.distribution} {self.version})"


@dataclass
class Selection:
    """The backend in use, why it was chosen, and its resolved ops table."""

    candidate: Candidate
    reason: str
    ops: dict[str, Callable] = field(repr=False)
    platform: Platform = field(repr=False)
    candidates: list[Candidate] = field(repr=False)


def _embedded_candidate() -> Candidate:
    from pdhal._version import __version__

    return Candidate(EMBEDDED, "pdhal", __version__, "pdhal._backends.cpu.backend")


def _entry_points() -> list[tuple[Candidate, metadata.EntryPoint]]:
    found = []
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        dist = ep.dist
        cand = Candidate(
            ep.name, dist.name if dist else "?", dist.version if dist else "?", ep.value
        )
        found.append((cand, ep))
    return found


def _import_plugin(cand: Candidate, load: Callable[[], object]) -> None:
    """Import a plugin and ask it for its Backend; record (never raise) any failure."""
    try:
        backend = plugins.provide(ENTRY_POINT_GROUP, cand.name, load)
        if not isinstance(backend, Backend):
            raise BackendLoadError(f"pdhal_backend returned {backend!r}, expected a Backend")
        if backend.name != cand.name:
            raise BackendLoadError(
                f"its Backend is named {backend.name!r}, but its entry point is {cand.name!r}"
            )
        cand.backend = backend
    except Exception as e:  # a broken plugin must never take the others down
        cand.error = f"{type(e).__name__}: {e}"
        log.warning("%s failed to load and is ignored: %s", cand.describe(), cand.error)


def _load_embedded():
    from pdhal._backends.cpu import backend as _cpu

    return _cpu


def discover(only: str | None = None) -> list[Candidate]:
    """Import the allowed plugins (just `only` if given) and return them, cpu first."""
    allowed = _allow_list()
    found: list[Candidate] = []
    if only in (None, EMBEDDED):
        cand = _embedded_candidate()
        _import_plugin(cand, _load_embedded)
        found.append(cand)
    for cand, ep in _entry_points():
        if cand.name == EMBEDDED or (only is not None and cand.name != only):
            continue
        if allowed is not None and cand.name not in allowed:
            continue
        _import_plugin(cand, ep.load)
        found.append(cand)
    return found


def _allow_list() -> set[str] | None:
    raw = os.environ.get("PDHAL_PLUGINS")
    if raw is None:
        return None
    allowed = {n.strip() for n in raw.split(",") if n.strip()}
    unknown = sorted(allowed - set(installed_names()))
    if unknown:
        log.warning(
            "PDHAL_PLUGINS names backends that are not installed: %s (installed: %s)",
            ", ".join(unknown),
            ", ".join(installed_names()),
        )
    return allowed


def installed_names() -> list[str]:
    """Names of every backend installed, loaded or not (metadata only)."""
    return sorted({EMBEDDED} | {cand.name for cand, _ in _entry_points()})


def _check_availability(cand: Candidate) -> Availability:
    try:
        cand.availability = cand.backend.availability()
    except Exception as e:  # detection must say "no" with a reason, not raise
        cand.availability = Availability(
            False, f"availability check raised {type(e).__name__}: {e}"
        )
    return cand.availability


def _choose() -> tuple[Candidate, str, list[Candidate]]:
    forced = os.environ.get("PDHAL_PLATFORM")
    if forced:
        forced = forced.strip()
        candidates = discover(only=forced)
        if not candidates:
            raise BackendNotFoundError(
                f"no backend {forced!r} (PDHAL_PLATFORM); installed: "
                f"{', '.join(installed_names())} (a pdhal backend {forced!r} would come from "
                f"`pip install pdhal-{forced}`)"
            )
        cand = candidates[0]
        if cand.backend is None:
            raise BackendLoadError(
                f"{cand.describe()} (PDHAL_PLATFORM) failed to load: {cand.error}"
            )
        avail = _check_availability(cand)
        if not avail.available:
            raise BackendUnavailableError(
                f"{cand.describe()} (PDHAL_PLATFORM) is not available here: {avail.reason}"
            )
        return cand, f"PDHAL_PLATFORM={forced}", candidates
    candidates = discover()
    usable = [c for c in candidates if c.backend is not None and _check_availability(c).available]
    if not usable:
        raise BackendUnavailableError(
            "no pdhal backend is usable: "
            + "; ".join(f"{c.name}: {c.error or c.availability.reason}" for c in candidates)
        )
    best = max(c.backend.priority for c in usable)
    top = [c for c in usable if c.backend.priority == best]
    if len(top) > 1:
        raise BackendLoadError(
            f"backends {', '.join(repr(c.name) for c in top)} are all available with priority "
            f"{best}: set PDHAL_PLATFORM to choose one"
        )
    cand = top[0]
    skipped = [
        f"{c.name}: {c.error or c.availability.reason}"
        for c in candidates
        if c is not cand and (c.error or not c.availability.available)
    ]
    reason = f"highest-priority available backend (priority {best})"
    if skipped:
        reason += "; not usable: " + "; ".join(skipped)
    return cand, reason, candidates


def _resolve() -> Selection:
    cand, reason, candidates = _choose()
    backend = cand.backend
    try:
        backend.load()
        platform = backend.platform()
        backend_ops = check_ops(backend.ops(), cand.describe())
    except PdhalError:
        raise
    except Exception as e:
        raise BackendLoadError(
            f"{cand.describe()} failed to load its runtime: {type(e).__name__}: {e}"
        ) from e
    return Selection(cand, reason, optable.bind(backend_ops), platform, candidates)


_selection: Selection | None = None
_lock = threading.Lock()


def selection() -> Selection:
    """The process's backend selection, made on first call."""
    global _selection
    if _selection is None:
        with _lock:
            if _selection is None:
                _selection = _resolve()
    return _selection


_on_reset: list[Callable[[], None]] = []


def on_reset(forget: Callable[[], None]) -> None:
    """Call `forget` whenever the selection is forgotten: what pdhal.ops bound from it
    (the registry sits below ops, so it is told rather than importing it)."""
    _on_reset.append(forget)


def reset() -> None:
    """Forget the selection (tests; a process normally selects once)."""
    global _selection
    with _lock:
        _selection = None
        plugins.forget()
        for forget in _on_reset:
            forget()
