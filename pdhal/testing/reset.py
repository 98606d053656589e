"""Putting a test process back as it was: what pdhal's own suite and the conformance kit
do around every test (each in a namespace of its own, nothing left in the segment folder)."""

from __future__ import annotations

import os


def release_process_state(forget_backend: bool = True) -> None:
    """Close every channel, reader and published record this process holds, and (unless
    told not to: the conformance kit selects once per session) forget the backend
    selection, so the next test starts as a fresh process would."""
    from pdhal._backends import registry as _registry
    from pdhal._memory import published as _published
    from pdhal._protocol import signals as _signals

    _signals.close_producer_channels()
    _published.unpublish_all()
    with _signals._chunk_readers_lock:
        readers = list(_signals._chunk_readers.values())
        _signals._chunk_readers.clear()
    for reader in readers:
        reader.close()
    if forget_backend:
        _registry.reset()


def segments_of(namespace: str) -> list[str]:
    """This user's segment files of `namespace` in the segment folder (PDHAL_SHM_DIR)."""
    from pdhal._protocol import names as _names

    prefix = f"pdhal.{os.geteuid()}.{namespace}."
    return sorted(n for n in os.listdir(_names.shm_dir()) if n.startswith(prefix))


def remove_leftovers(namespace: str) -> list[str]:
    """Unlink what `namespace` left in the segment folder and return the names, so a test
    can fail on them without the next test tripping over them too."""
    from pdhal._protocol import names as _names

    left = segments_of(namespace)
    for name in left:
        os.unlink(os.path.join(_names.shm_dir(), name))
    return left
