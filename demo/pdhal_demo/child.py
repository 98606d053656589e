"""Entry point of the demo's child processes: `python -m pdhal_demo.child ROLE` (worker,
messager, decoder; with several tensor-parallel ranks, worker.R and messager.R)."""

from __future__ import annotations

import signal
import sys
import traceback
import warnings

from pdhal_demo.control import DemoError, connect


def main(role: str) -> int:
    # Paddle warns at import that it found no ccache (for building C++ extensions, unused here).
    warnings.filterwarnings("ignore", message="No ccache found")
    from pdhal_demo import decoder, messager, worker

    kind = role.split(".")[0]
    run = {"worker": worker.run, "messager": messager.run, "decoder": decoder.run}[kind]
    if kind != "messager":
        import paddle  # noqa: F401  (first: it installs a SIGTERM handler that we replace)
    # SIGTERM from the parent unwinds normally, so pdhal removes this process's segments.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    link = connect(role)
    setup = link.recv()
    try:
        run(link, setup)
    except Exception as exc:  # every failure goes to the parent, then exit 1
        error = str(exc) if isinstance(exc, DemoError) else f"{type(exc).__name__}: {exc}"
        detail = error if isinstance(exc, DemoError) else traceback.format_exc(limit=4)
        link.send(("error", {"role": role, "error": error, "detail": detail}))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
