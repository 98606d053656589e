"""Find and remove this user's segments whose producer is dead."""

from __future__ import annotations

import os

from pdhal import _core, _names


def cleanup(namespace: str | None = None) -> tuple[list[str], list[str]]:
    """(removed, left) paths among this user's pdhal segments in `namespace` (default:
    every namespace)."""
    folder = _names.shm_dir()
    if namespace is not None:
        namespace = _names.validate_namespace(namespace, "namespace")
    mine = f"pdhal.{os.geteuid()}." + ("" if namespace is None else f"{namespace}.")
    removed, left = [], []
    for entry in sorted(os.listdir(folder)):
        if not entry.startswith(mine):
            continue
        path = os.path.join(folder, entry)
        if _core.reclaim(path):
            removed.append(path)
        else:
            left.append(path)
    return removed, left
