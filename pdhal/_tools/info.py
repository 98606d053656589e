"""What `pdhal info` reports, in the spirit of `vllm collect-env`: the machine, the
selection, every discovered backend, the segment folder, the limits that matter (pinned
memory), every PDHAL_* variable in effect, and the packages around pdhal."""

from __future__ import annotations

import ctypes.util
import os
import platform as _os_platform
import resource
import sys
from importlib import metadata

from pdhal._backends import environment as _environment
from pdhal._backends import registry as _registry
from pdhal._errors import PdhalError
from pdhal._protocol import names as _names
from pdhal._transfer import plugins as _transports

NOT_SET = "not set"
#: Distributions worth naming next to pdhal (Paddle's builds are three distributions).
_PACKAGES = (
    "cffi",
    "pluggy",
    "numpy",
    "paddlepaddle",
    "paddlepaddle-gpu",
    "paddlepaddle-xpu",
    "mooncake-transfer-engine-non-cuda",
    "mooncake-transfer-engine",
)


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _limit(value: int) -> str:
    return "unlimited" if value == resource.RLIM_INFINITY else f"{value // 1024} KiB"


def _paddle_build() -> str:
    """Which Paddle is installed and for what, from its distribution's name (no import)."""
    for dist, build in (
        ("paddlepaddle-gpu", "CUDA"),
        ("paddlepaddle-xpu", "XPU"),
        ("paddlepaddle", "CPU"),
    ):
        version = _version(dist)
        if version:
            return f"{version} ({build} build, distribution {dist})"
    return "not installed"


def _segment_folder() -> dict:
    folder = _names.shm_dir()
    out: dict = {"path": folder}
    try:
        vfs = os.statvfs(folder)
    except OSError as e:
        out["error"] = e.strerror
        return out
    out["size_bytes"] = vfs.f_blocks * vfs.f_frsize
    out["free_bytes"] = vfs.f_bavail * vfs.f_frsize
    mine = f"pdhal.{os.geteuid()}."
    out["pdhal_segments_of_this_user"] = sum(1 for n in os.listdir(folder) if n.startswith(mine))
    return out


def _machine() -> dict:
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return {
        "os": _os_platform.platform(),
        "kernel": os.uname().release,
        "python": sys.version.split()[0],
        "memlock_limit": {"soft": _limit(soft), "hard": _limit(hard)},
        "libibverbs": ctypes.util.find_library("ibverbs")
        or "not found (Mooncake's RDMA and its non-CUDA wheel need it)",
        "paddle": _paddle_build(),
    }


def _platform_facts(sel) -> dict:
    platform = sel.platform
    facts: dict = {"name": platform.name, "device_control_env_var": platform.device_control_env_var}
    try:  # a report must not fail on a half-working runtime
        facts["visible_devices"] = platform.visible_devices()
        facts["device_count"] = platform.device_count()
        facts["capabilities"] = platform.capabilities
    except PdhalError as e:
        facts["error"] = f"{type(e).__name__}: {e}"
    return facts


def report() -> dict:
    """A JSON-able description of this process's pdhal set-up (never raises PdhalError)."""
    from pdhal._version import __version__

    out: dict = {
        "pdhal": __version__,
        "machine": _machine(),
        "packages": {dist: _version(dist) for dist in _PACKAGES},
        "segment_folder": _segment_folder(),
        "environment": _environment.in_effect(),
        "environment_problems": _environment.problems(),
    }
    try:
        sel = _registry.selection()
    except PdhalError as e:
        out["selected"] = None
        out["error"] = f"{type(e).__name__}: {e}"
        candidates = _registry.discover()
    else:
        out["selected"] = sel.candidate.name
        out["reason"] = sel.reason
        out["platform"] = _platform_facts(sel)
        candidates = sel.candidates
    out["backends"] = []
    for cand in candidates:
        entry = {
            "name": cand.name,
            "distribution": cand.distribution,
            "version": cand.version,
            "source": cand.source,
        }
        if cand.error:
            entry["status"] = "broken"
            entry["error"] = cand.error
        else:
            avail = cand.availability or _registry._check_availability(cand)
            entry["status"] = "available" if avail.available else "unavailable"
            entry["reason"] = avail.reason
            if cand.backend is not None:
                entry["runtime"] = cand.backend.info()
        out["backends"].append(entry)
    out["transports"] = _transports.describe()
    return out


def _text(value) -> str:
    return NOT_SET if value is None else str(value)


def format_text(info: dict) -> str:
    m = info["machine"]
    lines = [
        f"pdhal {info['pdhal']} on {m['os']} (kernel {m['kernel']}), Python {m['python']}",
        f"selected: {info['selected'] or '(none)'}",
    ]
    if info.get("error"):
        lines.append(f"  error: {info['error']}")
    else:
        lines.append(f"  why: {info['reason']}")
        p = info["platform"]
        if "error" in p:
            lines.append(f"  devices: cannot be counted: {p['error']}")
        else:
            visible = p["visible_devices"]
            lines.append(
                f"  devices: {p['device_count']} ({p['device_control_env_var']}="
                f"{NOT_SET if visible is None else ','.join(map(str, visible))})"
            )
            caps = ", ".join(f"{k}={v}" for k, v in p["capabilities"].items())
            lines.append(f"  capabilities: {caps}")
    lines.append("backends:")
    for b in info["backends"]:
        detail = b.get("error") or b.get("reason", "")
        lines.append(
            f"  {b['name']:<8} {b['status']:<12} {b['distribution']} {b['version']}  {detail}"
        )
        for key, value in (b.get("runtime") or {}).items():
            lines.append(f"           {key}: {_text(value)}")
    lines.append("transports:")
    for t in info["transports"]:
        detail = f"  {t['error']}" if "error" in t else f"  completion at {t['completion']}"
        lines.append(f"  {t['name']:<8} {t['status']:<12} {t['source']}{detail}")
        for key, option in (t.get("options") or {}).items():
            given = [f"${option['env']}"] if option["env"] else []
            given += [] if option["default"] is None else [f"default {option['default']!r}"]
            lines.append(f"           option {key}: {option['help']} ({', '.join(given)})")
    f = info["segment_folder"]
    if "error" in f:
        lines.append(f"segment folder: {f['path']}: {f['error']}")
    else:
        lines.append(
            f"segment folder: {f['path']}, {f['free_bytes'] / 2**30:.1f} GiB free of "
            f"{f['size_bytes'] / 2**30:.1f} GiB, {f['pdhal_segments_of_this_user']} pdhal "
            f"segment(s) of this user"
        )
    lines.append(
        f"pinned memory (RLIMIT_MEMLOCK): soft {m['memlock_limit']['soft']}, hard "
        f"{m['memlock_limit']['hard']}"
    )
    lines.append(f"libibverbs: {m['libibverbs']}")
    lines.append(f"paddle: {m['paddle']}")
    lines.append(
        "packages: "
        + ", ".join(
            f"{k} {_text(v)}"
            for k, v in info["packages"].items()
            if v is not None or not k.startswith("paddle")
        )
    )
    lines.append("environment:")
    for name, value in info["environment"].items():
        problem = info["environment_problems"].get(name)
        lines.append(f"  {name}={_text(value)}" + (f"   <- {problem}" if problem else ""))
    return "\n".join(lines)
