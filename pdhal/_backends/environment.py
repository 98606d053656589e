"""Every PDHAL_* environment variable: what it means, and whether its value can work, so a
bad one is reported before anything starts (by `pdhal info`, or a launcher calling
pdhal.check_environment()) rather than from a child process seconds into a run."""

from __future__ import annotations

import os
from collections.abc import Callable

from pdhal._errors import PdhalError

#: name -> what it does (the README's table says the same).
VARIABLES = {
    "PDHAL_PLATFORM": "use exactly this backend; fail loudly if it is missing, broken or has "
    "no device",
    "PDHAL_PLUGINS": "comma-separated allow-list of backend plugins to load (cpu is always there)",
    "PDHAL_NAMESPACE": "keeps deployments on one host apart (default 'default')",
    "PDHAL_SHM_DIR": "folder of pdhal's segments (default /dev/shm)",
    "PDHAL_BACKPRESSURE_TIMEOUT": "seconds a per-chunk step waits for the messager (default 60)",
    "PDHAL_CPU_VISIBLE_DEVICES": "logical devices of the cpu backend this process sees",
    "PDHAL_CPU_DEVICE_COUNT": "logical devices of the cpu backend (default 1)",
    "PDHAL_CUDART": "path of the CUDA runtime to bind (else the nvidia-cuda-runtime wheel, else "
    "libcudart.so.13/.12)",
    "PDHAL_XPURT": "path of the XPU runtime to bind (else paddle/libs/libxpurt.so of a Paddle "
    "XPU wheel, else libxpurt.so)",
    "PDHAL_DEBUG": "`pdhal` commands print tracebacks (1)",
    "PDHAL_WAIT_SLICE_MS": "how long one wait sleeps at most between liveness probes, and so "
    "how soon a dead producer is noticed and Ctrl-C runs (default 200; tests lengthen it so "
    "that a lost wake runs to the wait's timeout)",
}


def _namespace(value: str) -> None:
    from pdhal._protocol import names as _names

    _names.validate_namespace(value)


def _shm_dir(value: str) -> None:
    if not os.path.isdir(value):
        raise ValueError(f"{value!r} is not a folder")
    mode = os.stat(value).st_mode
    if mode & 0o002 and not mode & 0o1000:
        raise ValueError(f"{value!r} is writable by every user and has no sticky bit")


def _timeout(value: str) -> None:
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ValueError(f"must be a positive number of seconds, got {value!r}")


def _slice(value: str) -> None:
    if not (value.isascii() and value.isdigit()) or not 1 <= int(value) <= 3_600_000:
        raise ValueError(f"must be milliseconds from 1 to 3600000, got {value!r}")


def _device_count(value: str) -> None:
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"must be an integer >= 1, got {value!r}")


def _visible(value: str) -> None:
    from pdhal._backends.platform import parse_visible_devices

    parse_visible_devices(value, "PDHAL_CPU_VISIBLE_DEVICES")


def _library(value: str) -> None:
    if os.sep in value and not os.path.exists(value):
        raise ValueError(f"{value!r} does not exist")


def _plugins(value: str) -> None:
    from pdhal._backends import registry as _registry

    unknown = sorted(
        {n.strip() for n in value.split(",") if n.strip()} - set(_registry.installed_names())
    )
    if unknown:
        raise ValueError(
            f"names no installed backend: {', '.join(unknown)} (installed: "
            f"{', '.join(_registry.installed_names())})"
        )


def _platform(value: str) -> None:
    from pdhal._backends import registry as _registry

    if value.strip() not in _registry.installed_names():
        raise ValueError(
            f"no backend {value.strip()!r} is installed (installed: "
            f"{', '.join(_registry.installed_names())}; a pdhal backend "
            f"distribution is named pdhal-<name>)"
        )


_CHECKS: dict[str, Callable[[str], None]] = {
    "PDHAL_PLATFORM": _platform,
    "PDHAL_PLUGINS": _plugins,
    "PDHAL_NAMESPACE": _namespace,
    "PDHAL_SHM_DIR": _shm_dir,
    "PDHAL_BACKPRESSURE_TIMEOUT": _timeout,
    "PDHAL_CPU_DEVICE_COUNT": _device_count,
    "PDHAL_CPU_VISIBLE_DEVICES": _visible,
    "PDHAL_CUDART": _library,
    "PDHAL_XPURT": _library,
    "PDHAL_WAIT_SLICE_MS": _slice,
}


def in_effect(env: dict[str, str] | None = None) -> dict[str, str | None]:
    """Every PDHAL_* variable pdhal knows, with its value here (None: not set), plus any
    other PDHAL_* variable set (a typo is worth seeing)."""
    env = os.environ if env is None else env
    values = {name: env.get(name) for name in VARIABLES}
    values.update({k: v for k, v in env.items() if k.startswith("PDHAL_") and k not in values})
    return values


def problems(env: dict[str, str] | None = None) -> dict[str, str]:
    """{variable: what is wrong with its value} for the PDHAL_* variables set."""
    env = os.environ if env is None else env
    found = {}
    for name, value in in_effect(env).items():
        check = _CHECKS.get(name)
        if value is None:
            continue
        if check is None:
            continue
        try:
            check(value)
        except (ValueError, PdhalError) as e:
            found[name] = str(e)
    return found
