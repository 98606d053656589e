"""Build the simulated vendor runtimes (C, in this folder) for tests; cached by mtime."""

from __future__ import annotations

import os
import subprocess

HERE = os.path.dirname(os.path.abspath(__file__))
BUILD = os.path.join(HERE, "build")

RUNTIMES = {
    # name: (sources, extra flags)
    "libxpurt.so": (["sim_device.c", "xpurt_sim.c"], []),
    "libxpurt_old.so": (["sim_device.c", "xpurt_sim.c"], ["-DSIM_OLD_RUNTIME"]),
    "libcudart_sim.so": (["sim_device.c", "cudart_sim.c"], []),
}


def build(name: str) -> str:
    """Path of the simulated runtime `name`, compiled if missing or older than its sources.
    Under PDHAL_SANITIZE=1 (make sanitize) it is built with ASan/UBSan too, in its own
    folder, so the simulators' own memory errors are caught with pdhal's."""
    sources, flags = RUNTIMES[name]
    if os.environ.get("PDHAL_SANITIZE") == "1":
        folder = os.path.join(BUILD, "sanitize")
        flags = [*flags, "-fsanitize=address,undefined", "-fno-omit-frame-pointer"]
    else:
        folder = BUILD
    out = os.path.join(folder, name)
    inputs = [os.path.join(HERE, s) for s in sources] + [os.path.join(HERE, "sim_device.h")]
    if not os.path.exists(out) or os.path.getmtime(out) < max(map(os.path.getmtime, inputs)):
        os.makedirs(folder, exist_ok=True)
        tmp = f"{out}.{os.getpid()}.tmp"
        subprocess.run(
            [
                "gcc",
                "-std=gnu11",
                "-O1",
                "-g",
                "-Wall",
                "-Wextra",
                "-Wno-unused-parameter",
                "-shared",
                "-fPIC",
                *flags,
                "-o",
                tmp,
                *[os.path.join(HERE, s) for s in sources],
                "-lpthread",
                "-lrt",
            ],
            check=True,
        )
        os.replace(tmp, out)
    return out


if __name__ == "__main__":
    import sys

    print(build(sys.argv[1]))
