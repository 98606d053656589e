"""Transports by name: `shm` and `ipc` built in, the others plugins of entry-point group
`pdhal.transports` (hook `pdhal_transport`), registered with the process's one pluggy
PluginManager as backends are. One instance per name and process."""

from __future__ import annotations

import threading
from importlib import metadata

from pdhal._backends import plugins
from pdhal._errors import InvalidArgumentError, TransportLoadError, UnsupportedError
from pdhal._transfer.checks import name as _name
from pdhal._transfer.contract import Transport

ENTRY_POINT_GROUP = "pdhal.transports"
_instances: dict[str, Transport] = {}
_lock = threading.Lock()


def _builtin() -> dict[str, type[Transport]]:
    from pdhal._transfer.ipc import IpcTransport
    from pdhal._transfer.shm import ShmTransport

    return {ShmTransport.name: ShmTransport, IpcTransport.name: IpcTransport}


def _entry_points() -> dict[str, metadata.EntryPoint]:
    return {ep.name: ep for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)}


def names() -> list[str]:
    """Every transport this process can use by name, built in or installed."""
    return sorted(set(_builtin()) | set(_entry_points()))


def transport(name: str) -> Transport:
    """The process's transport `name`; a plugin is imported and validated on first use."""
    name = _name(name, "a transport name")
    with _lock:
        found = _instances.get(name)
        if found is not None:
            return found
        builtin = _builtin()
        if name in builtin:
            found = builtin[name]()
        else:
            found = _load(name)
        _instances[name] = found
        return found


def _load(name: str) -> Transport:
    ep = _entry_points().get(name)
    if ep is None:
        raise InvalidArgumentError(
            f"no transport named {name!r}: this process has {', '.join(names())} (a transport "
            f"plugin registers in entry-point group {ENTRY_POINT_GROUP})"
        )
    origin = f"{ep.value} (entry point {name!r} in {ENTRY_POINT_GROUP})"
    try:
        found = plugins.provide(ENTRY_POINT_GROUP, name, ep.load)
    except Exception as e:
        raise TransportLoadError(
            f"transport plugin {origin} failed to load: {type(e).__name__}: {e}"
        ) from e
    if not isinstance(found, Transport) or found.name != name:
        raise TransportLoadError(
            f"transport plugin {origin} returned {found!r}, not a pdhal.transfer.Transport "
            f"named {name!r}"
        )
    return found


def _options(kind: type[Transport] | Transport) -> dict:
    """A transport's options (Transport.configure): what each sets, its default and the
    environment variable that gives it otherwise."""
    return {
        name: {"help": option.help, "default": option.default, "env": option.env}
        for name, option in sorted(getattr(kind, "options", {}).items())
    }


def describe() -> list[dict]:
    """Each transport: its name, where it comes from, whether it loads, how it knows a
    write completed (KVStreamer takes only "target"), and its options (`pdhal info`)."""
    out = []
    for name, kind in sorted(_builtin().items()):
        entry = {
            "name": name,
            "source": "built in",
            "status": "ok",
            "completion": kind.completion,
            "options": _options(kind),
        }
        try:
            transport(name)
        except UnsupportedError as e:  # (ipc in a process without device memory)
            entry["status"], entry["error"] = "unavailable", str(e)
        out.append(entry)
    for name, ep in sorted(_entry_points().items()):
        if name in _builtin():
            continue
        dist = ep.dist
        entry = {
            "name": name,
            "source": f"{dist.name} {dist.version}" if dist is not None else ep.value,
            "status": "ok",
        }
        try:
            found = transport(name)
            entry["completion"], entry["options"] = found.completion, _options(found)
        except (TransportLoadError, InvalidArgumentError) as e:
            entry["status"], entry["error"] = "broken", str(e)
        out.append(entry)
    return out


def forget() -> None:
    """Drop the instances (tests)."""
    with _lock:
        _instances.clear()
