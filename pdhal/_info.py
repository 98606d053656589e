"""What `pdhal info` reports: the selection, every discovered backend, versions."""

from __future__ import annotations

from importlib import metadata

from pdhal import _registry
from pdhal._errors import PdhalError


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def report() -> dict:
    """A JSON-able description of this process's pdhal set-up (never raises PdhalError)."""
    out: dict = {
        "versions": {name: _version(name) for name in ("pdhal", "cffi", "pluggy",
                                                       "paddlepaddle")},
    }
    try:
        sel = _registry.selection()
    except PdhalError as e:
        out["selected"] = None
        out["error"] = f"{type(e).__name__}: {e}"
        candidates = _registry.discover()
    else:
        platform = sel.platform
        out["selected"] = sel.candidate.name
        out["reason"] = sel.reason
        out["platform"] = {
            "name": platform.name,
            "device_control_env_var": platform.device_control_env_var,
            "visible_devices": platform.visible_devices(),
            "device_count": platform.device_count(),
            "capabilities": platform.capabilities,
        }
        candidates = sel.candidates
    out["backends"] = []
    for cand in candidates:
        entry = {"name": cand.name, "distribution": cand.distribution, "version": cand.version,
                 "source": cand.source}
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
    return out


def format_text(info: dict) -> str:
    lines = [f"selected: {info['selected'] or '(none)'}"]
    if info.get("error"):
        lines.append(f"  error: {info['error']}")
    else:
        lines.append(f"  why: {info['reason']}")
        p = info["platform"]
        lines.append(f"  devices: {p['device_count']} ({p['device_control_env_var']}="
                     f"{p['visible_devices']})")
        caps = ", ".join(f"{k}={v}" for k, v in p["capabilities"].items())
        lines.append(f"  capabilities: {caps}")
    lines.append("backends:")
    for b in info["backends"]:
        detail = b.get("error") or b.get("reason", "")
        lines.append(f"  {b['name']:<8} {b['status']:<12} {b['distribution']} {b['version']}"
                     f"  {detail}")
        for key, value in (b.get("runtime") or {}).items():
            lines.append(f"           {key}: {value}")
    lines.append("versions: " + ", ".join(f"{k} {v or '-'}" for k, v in info["versions"].items()))
    return "\n".join(lines)
