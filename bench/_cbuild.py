"""The benches' C helpers, built the way an engine builds its op: against pdhal's installed
header and linked against pdhal's C library, so a bench measures the core pdhal ships and
breaks, as an engine's build would, when that API changes."""

from __future__ import annotations

import os
import subprocess

BUILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "build")


def build(source: str, output: str, *extra: str) -> str:
    """Compile `source` into bench/build/`output` and return its path. A name ending in .so
    is a shared library for this process to load (it links pdhal's Python extension, so it
    shares this process's C core); any other name is a program, linked against libpdhal.so
    with an rpath to it. `extra`: more flags, sources or libraries for gcc."""
    import pdhal

    path = os.path.join(BUILD, output)
    os.makedirs(BUILD, exist_ok=True)
    if output.endswith(".so"):
        link = ["-shared", "-fPIC", pdhal.get_library()]
    else:
        library = pdhal.get_library(standalone=True)
        link = [library, f"-Wl,-rpath,{os.path.dirname(library)}"]
    subprocess.run(
        ["gcc", "-O2", "-Wall", "-Wextra", "-Werror", f"-I{pdhal.get_include()}"]
        + ["-o", path, source, *extra, *link, "-lpthread"],
        check=True,
    )
    return path
