"""pdhal.h as an engine uses it: the installed header compiles as C and as C++, and a cache
messager written in C, built against pdhal.get_include() and pdhal.get_library(), reads a
Python producer's signals from another process (a process that never imports pdhal)."""

from __future__ import annotations

import ctypes
import errno
import json
import os
import subprocess
import sys
import time

import pytest

import pdhal
from pdhal import ops
from pdhal._protocol.core import pack_progress, unpack_progress

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/

# The messager process: loads the C library (which brings pdhal's C core with it) and runs
# one of its loops; prints what the loop returned.
MESSAGER = r"""
import ctypes, json, sys
lib = ctypes.CDLL(sys.argv[1])
mode, path, a, b = sys.argv[2], sys.argv[3].encode(), int(sys.argv[4]), int(sys.argv[5])
print("ready", flush=True)
if mode == "per_query":
    seen = (ctypes.c_uint64 * 4096)()
    n = lib.messager_per_query(path, ctypes.c_uint64(a), ctypes.c_uint64(b), seen, 4096)
    print(json.dumps([n] + list(seen[:max(n, 0)])))
else:
    out = (ctypes.c_int32 * (a * 1538))()
    n = lib.messager_per_chunk(path, a, out)
    print(json.dumps([n] + [list(out[i * 1538:i * 1538 + 5]) for i in range(max(n, 0))]))
assert "pdhal" not in sys.modules
"""


def test_the_installed_header_compiles_as_c_and_as_cxx(tmp_path):
    source = tmp_path / "kernel.c"
    source.write_text(
        '#include "pdhal.h"\nint check(void) { return pdhal_abi_version() == PDHAL_ABI_VERSION; }\n'
    )
    for compiler, language in (("gcc", "c"), ("g++", "c++")):
        subprocess.run(
            [
                compiler,
                "-x",
                language,
                "-fsyntax-only",
                "-Wall",
                "-Wextra",
                "-Werror",
                "-pedantic",
                f"-I{pdhal.get_include()}",
                str(source),
            ],
            check=True,
        )


@pytest.fixture(scope="module")
def messager_library(tmp_path_factory) -> str:
    library = tmp_path_factory.mktemp("c") / "libmessager.so"
    subprocess.run(
        [
            "gcc",
            "-shared",
            "-fPIC",
            "-O2",
            "-Wall",
            "-Wextra",
            "-Werror",
            f"-I{pdhal.get_include()}",
            "-o",
            str(library),
            os.path.join(TESTS, "c", "messager.c"),
            pdhal.get_library(),
        ],
        check=True,
    )
    return str(library)


def _start_messager(library: str, mode: str, a: int, b: int) -> subprocess.Popen:
    messager = subprocess.Popen(
        [
            sys.executable,
            "-c",
            MESSAGER,
            library,
            mode,
            pdhal.channel_path(mode, 0),
            str(a),
            str(b),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert messager.stdout.readline() == "ready\n"
    time.sleep(0.05)  # it is in its first wait before the first signal
    return messager


def test_a_c_messager_waits_on_per_query_progress(messager_library):
    layers = 40
    meta = ops.open_shm_and_get_meta_signal(0, 0)
    messager = _start_messager(
        messager_library,
        "per_query",
        pack_progress(meta.step, -1),
        pack_progress(meta.step, layers - 1),
    )
    for layer in range(layers):
        time.sleep(0.001 * (layer % 3))  # some layers find the messager asleep
        ops.signal_layer_ready(ops.init_signal_layerwise(meta, layer))
    n, *words = json.loads(messager.communicate(timeout=60)[0])
    assert n > 0, f"messager_per_query failed: {os.strerror(-n)}"
    seen = [unpack_progress(word) for word in words]
    assert seen == sorted(set(seen)) and seen[-1] == (meta.step, layers - 1), seen


def test_a_c_messager_started_before_its_producer_waits_for_the_channel(messager_library):
    """The messager opens with PDHAL_OPEN_UNINTERRUPTED, so the core waits through its
    200 ms slices for the late producer's channel (without it, -EINTR after one slice)."""
    layers = 2
    messager = _start_messager(messager_library, "per_chunk", layers, 0)
    time.sleep(0.5)  # the messager's open outlasts at least one wait slice
    chunk = ops.init_kv_signal_per_query([0, 8], [0, 8], [0, 0], 0, layers)
    for layer in range(layers):
        ops.signal_layer_ready(chunk.layer(layer))
    n, *records = json.loads(messager.communicate(timeout=60)[0])
    assert n == layers, f"messager_per_chunk: {os.strerror(-n) if n < 0 else n}"
    assert records == [[1, layer, 1, 0, 8] for layer in range(layers)]


@pytest.mark.parametrize("uninterrupted", [False, True])
def test_an_open_of_a_missing_segment_ends_each_slice_unless_told_to_wait_through(
    uninterrupted,
):
    """Without the flag: -EINTR after one 200 ms slice, well before the deadline. With
    PDHAL_OPEN_UNINTERRUPTED: the core waits until the deadline, then -ENOENT."""
    from pdhal._protocol import names as _names
    from pdhal._protocol.core import ffi, lib

    path = _names.channel_path("query", 0, 0).encode()
    flags = lib.PDHAL_OPEN_UNINTERRUPTED if uninterrupted else 0
    out = ffi.new("pdhal_segment **")
    deadline = lib.pdhal_now_ns() + (700_000_000 if uninterrupted else 60_000_000_000)
    rc = lib.pdhal_segment_open(path, lib.PDHAL_KIND_QUERY, deadline, flags, out)
    if uninterrupted:
        assert rc == -errno.ENOENT and lib.pdhal_now_ns() >= deadline
    else:
        assert rc == -errno.EINTR and lib.pdhal_now_ns() < deadline
    assert out[0] == ffi.NULL


def test_a_c_messager_reads_every_per_chunk_record_once_in_order(messager_library):
    steps, layers = 40, 6  # more steps than the ring holds: the producer waits for C
    messager = _start_messager(messager_library, "per_chunk", steps * layers, 0)
    for step in range(1, steps + 1):
        chunk = ops.init_kv_signal_per_query([0, 64 + step], [0, 64 + step], [0, step], 0, layers)
        for layer in range(layers):
            ops.signal_layer_ready(chunk.layer(layer))
    n, *records = json.loads(messager.communicate(timeout=60)[0])
    assert n == steps * layers, f"messager_per_chunk: {n}"
    assert records == [
        [1, layer, 1, step, 64 + step] for step in range(1, steps + 1) for layer in range(layers)
    ]


def test_the_library_exports_the_header_s_functions_and_no_internals():
    from pdhal._protocol.core import lib as cffi_lib  # its cdef is the header's API region

    functions = [name for name in dir(cffi_lib) if callable(getattr(cffi_lib, name))]
    library = ctypes.CDLL(pdhal.get_library())
    assert len(functions) > 25
    assert [name for name in functions if not hasattr(library, name)] == []
    for internal in ("pdhal_fail", "pdhal_wait_change", "pdhal_segment_ref"):
        assert not hasattr(library, internal), f"{internal} is exported"


def test_a_core_of_another_abi_is_refused_at_import_with_the_fix():
    """A stale build (its PDHAL_ABI_VERSION differs from the Python code's) must not be used:
    importing pdhal's core says both versions and how to rebuild."""
    code = """
import sys, types
real = __import__("pdhal._pdhal_c", fromlist=["lib"])
class StaleLib:
    def __getattr__(self, name):
        return getattr(real.lib, name)
    def pdhal_abi_version(self):
        return 1
fake = types.ModuleType("pdhal._pdhal_c")
fake.ffi, fake.lib = real.ffi, StaleLib()
sys.modules["pdhal._pdhal_c"] = fake
try:
    import pdhal._protocol.core
except ImportError as e:
    print(e)
else:
    print("imported")
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "compiled core speaks ABI 1, this Python code expects 2" in proc.stdout
    assert "pip install -e ." in proc.stdout


@pytest.fixture(scope="module")
def standalone_messager(tmp_path_factory) -> str:
    """A messager program linked against libpdhal.so alone: no Python in its process."""
    program = str(tmp_path_factory.mktemp("c") / "messager")
    library = pdhal.get_library(standalone=True)
    subprocess.run(
        [
            "gcc",
            "-O2",
            "-Wall",
            "-Wextra",
            "-Werror",
            f"-I{pdhal.get_include()}",
            "-o",
            program,
            os.path.join(TESTS, "c", "messager_main.c"),
            os.path.join(TESTS, "c", "messager.c"),
            library,
            f"-Wl,-rpath,{os.path.dirname(library)}",
        ],
        check=True,
    )
    libraries = subprocess.run(["ldd", program], capture_output=True, text=True).stdout
    assert "libpython" not in libraries, libraries
    return program


def test_a_messager_program_without_python_reads_both_channels(standalone_messager):
    """The documented way to build a C messager that runs outside a Python process."""
    layers, steps = 20, 30
    meta = ops.open_shm_and_get_meta_signal(0, 0)
    per_query = subprocess.Popen(
        [
            standalone_messager,
            "per_query",
            pdhal.channel_path("per_query", 0),
            str(pack_progress(meta.step, -1)),
            str(pack_progress(meta.step, layers - 1)),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    per_chunk = subprocess.Popen(
        [standalone_messager, "per_chunk", pdhal.channel_path("per_chunk", 0), str(steps * 2)],
        stdout=subprocess.PIPE,
        text=True,
    )
    for layer in range(layers):
        ops.signal_layer_ready(ops.init_signal_layerwise(meta, layer))
    for step in range(1, steps + 1):
        chunk = ops.init_kv_signal_per_query([9], [9], [step], 0, 2)
        for layer in range(2):
            ops.signal_layer_ready(chunk.layer(layer))
    words = [int(w) for w in per_query.communicate(timeout=60)[0].split()]
    assert per_query.returncode == 0 and unpack_progress(words[-1]) == (meta.step, layers - 1)
    records = [
        list(map(int, line.split())) for line in per_chunk.communicate(timeout=60)[0].splitlines()
    ]
    assert per_chunk.returncode == 0
    assert records == [[1, layer, 0, step, 9] for step in range(1, steps + 1) for layer in range(2)]


def test_the_standalone_library_exports_the_same_functions():
    from pdhal._protocol.core import lib as cffi_lib

    functions = sorted(name for name in dir(cffi_lib) if callable(getattr(cffi_lib, name)))
    standalone = ctypes.CDLL(pdhal.get_library(standalone=True))
    for name in functions:
        assert hasattr(standalone, name), name
    exported = subprocess.run(
        ["nm", "-D", "--defined-only", pdhal.get_library(standalone=True)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert sorted(w for w in exported if w.startswith("pdhal_")) == functions
    assert not [w for w in exported if w.startswith(("Py", "_Py"))]
