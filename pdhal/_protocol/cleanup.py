"""Find and remove this user's segments whose producer is dead."""

from __future__ import annotations

import os

from pdhal._errors import SegmentError
from pdhal._protocol import core as _core
from pdhal._protocol import names as _names

#: A segment's kind, from the part of its name after the namespace.
_KINDS = {"query": _core.KIND_QUERY, "chunk": _core.KIND_CHUNK, "buf": _core.KIND_BUFFER}


def _dead(path: str, entry: str) -> bool:
    """Whether the segment at `path` (file name `entry`) was left by a dead producer, judged
    without removing it."""
    kind = _KINDS.get(entry.split(".")[3]) if entry.count(".") >= 4 else None
    if kind is None:
        return False
    try:
        segment = _core.Segment.open(path, kind, 0)
    except SegmentError:
        return False  # not ours to judge (another uid, corrupt, gone meanwhile)
    try:
        return not segment.producer_alive()
    finally:
        segment.close()


def cleanup(namespace: str | None = None, dry_run: bool = False) -> tuple[list[str], list[str]]:
    """(removed, left) paths among this user's pdhal segments in `namespace` (default:
    every namespace); with dry_run, what would be removed, removing nothing."""
    folder = _names.shm_dir()
    if namespace is not None:
        namespace = _names.validate_namespace(namespace, "namespace")
    mine = f"pdhal.{os.geteuid()}." + ("" if namespace is None else f"{namespace}.")
    removed, left = [], []
    for entry in sorted(os.listdir(folder)):
        if not entry.startswith(mine):
            continue
        path = os.path.join(folder, entry)
        try:
            gone = _dead(path, entry) if dry_run else _core.reclaim(path)
        except SegmentError:  # not ours to judge (another uid's file at our prefix, say)
            gone = False
        (removed if gone else left).append(path)
    return removed, left
