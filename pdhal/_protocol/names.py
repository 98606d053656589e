"""Segment names: namespace, uid, kind, rank and device, validated; never ftok.

A name is `pdhal.<uid>.<namespace>.<kind>.<rest>`: the namespace has no '.', so the first
four dots always split the same way and two different (namespace, kind, rest) never share a
file (a buffer named "q.query.r0.d0" cannot be namespace "a.buf.q"'s channel).
"""

from __future__ import annotations

import os
import re

from pdhal._errors import InvalidArgumentError

_NAME_PART = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_NAMESPACE = re.compile(r"[A-Za-z0-9_-]{1,64}")


def shm_dir() -> str:
    """Folder holding pdhal segments (PDHAL_SHM_DIR, default /dev/shm)."""
    return os.environ.get("PDHAL_SHM_DIR", "/dev/shm")


def namespace() -> str:
    """The namespace (PDHAL_NAMESPACE, default "default") that keeps deployments apart."""
    return validate_namespace(os.environ.get("PDHAL_NAMESPACE", "default"))


def validate_namespace(value: object, what: str = "PDHAL_NAMESPACE") -> str:
    """Return `value` if it is a namespace: 1-64 of letters, digits, '_' or '-' (no '.')."""
    if not isinstance(value, str) or not _NAMESPACE.fullmatch(value):
        raise InvalidArgumentError(
            f"{what} must be 1-64 characters of letters, digits, '_' or '-' (no '.', which "
            f"separates the parts of a segment name), got {value!r}"
        )
    return value


def validate_name(value: object, what: str) -> str:
    """Return `value` if it is a safe name part: 1-64 of letters, digits, '_', '.', '-'."""
    if not isinstance(value, str) or not _NAME_PART.fullmatch(value) or value in (".", ".."):
        raise InvalidArgumentError(
            f"{what} must be 1-64 characters of letters, digits, '_', '.' or '-' "
            f"(no '/', NUL or spaces), got {value!r}"
        )
    return value


def validate_index(value: object, what: str, upper: int = 1 << 20) -> int:
    """Return `value` as an int in [0, upper), else raise naming `what`."""
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise InvalidArgumentError(f"{what} must be an integer in [0, {upper}), got {value!r}")
    value = value.__index__()
    if not 0 <= value < upper:
        raise InvalidArgumentError(f"{what} must be in [0, {upper}), got {value}")
    return value


def prefix() -> str:
    """Common start of every segment name of this user and namespace."""
    return f"pdhal.{os.geteuid()}.{namespace()}."


def channel_path(kind: str, rank: int, device_id: int) -> str:
    """Path of the progress channel of (namespace, rank, device), kind "query" or "chunk"."""
    rank = validate_index(rank, "rank")
    device_id = validate_index(device_id, "device_id")
    return os.path.join(shm_dir(), f"{prefix()}{kind}.r{rank}.d{device_id}")


def buffer_path(name: str) -> str:
    """Path of the shared buffer a process published as `name`."""
    return os.path.join(shm_dir(), f"{prefix()}buf.{validate_name(name, 'buffer name')}")
