"""cffi build script for pdhal's C core (API mode, out of line); not installed.

The cdef is the region of pdhal.h between PDHAL_CDEF_BEGIN and PDHAL_CDEF_END, so the
compiler and cffi read the very same prototypes.
"""

import hashlib
import os
import pathlib
import re
import tempfile

from cffi import FFI

HERE = pathlib.Path(__file__).resolve().parent
#: The public header ships inside the package (pdhal.get_include()) for engine kernels.
INCLUDE = HERE.parent / "pdhal" / "include"
SOURCES = [
    "errors.c",
    "wait.c",
    "segment.c",
    "progress.c",
    "ring.c",
    "sender.c",
    "kernel.c",
    "copy.c",
    "fault.c",
    "copier.c",
    "worker.c",
]


def read_cdef() -> str:
    header = (INCLUDE / "pdhal.h").read_text()
    start = header.index("/* PDHAL_CDEF_BEGIN */") + len("/* PDHAL_CDEF_BEGIN */")
    return header[start : header.index("/* PDHAL_CDEF_END */")]


def compile_args() -> list[str]:
    args = ["-std=gnu11", "-O2", "-Wall", "-Wextra", "-Wno-unused-parameter"]
    if os.environ.get("PDHAL_SANITIZE"):
        args += ["-fsanitize=address,undefined", "-fno-omit-frame-pointer", "-O1"]
    return args


def export_map(cdef: str, python_module: bool = True) -> str:
    """A linker version script exporting the functions the header declares (and the Python
    module's init, for the extension), nothing else: the C core's internals stay out of
    engines' symbol tables."""
    functions = sorted(set(re.findall(r"\b(pdhal_\w+)\s*\(", cdef)))
    if python_module:
        functions.insert(0, "PyInit__pdhal_c")
    script = f"{{ global: {'; '.join(functions)}; local: *; }};\n"
    digest = hashlib.sha256(script.encode()).hexdigest()[:16]
    path = pathlib.Path(tempfile.gettempdir()) / f"pdhal-exports-{digest}.map"
    path.write_text(script)
    return str(path)


def link_args(cdef: str, python_module: bool = True) -> list[str]:
    args = [f"-Wl,--version-script={export_map(cdef, python_module)}"]
    if os.environ.get("PDHAL_SANITIZE"):
        args.append("-fsanitize=address,undefined")
    return args


CDEF = read_cdef()
ffibuilder = FFI()
ffibuilder.cdef(CDEF)
ffibuilder.set_source(
    "pdhal._pdhal_c",
    '#include "pdhal.h"',
    sources=[os.path.relpath(HERE / s) for s in SOURCES],
    include_dirs=[os.path.relpath(INCLUDE)],
    extra_compile_args=compile_args(),
    extra_link_args=link_args(CDEF),
    libraries=["pthread"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
