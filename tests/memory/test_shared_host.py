"""Host memory from host_alloc is shared by name on every backend, between processes bound
to different backends (simulated cuda and xpu runtimes: no GPU or XPU here): a KV cache in
one runtime's pinned host memory is what a cache messager or a decode side on another maps.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from pdhal_cuda.testing import CudaTestSupport
from pdhal_xpu.testing import XpuTestSupport
from simulators import DeviceTensor, SimRuntime

import pdhal
from pdhal import ops
from pdhal._backends import registry as _registry
from pdhal.testing.fixtures import run_child

pytestmark = pytest.mark.simulated

NBYTES = 1 << 16


@pytest.fixture
def runtimes(monkeypatch):
    """Both simulated runtimes, found by any process this test starts."""
    monkeypatch.setenv("PDHAL_CUDART", CudaTestSupport.simulator())
    monkeypatch.setenv("PDHAL_XPURT", XpuTestSupport.simulator())


def _select(monkeypatch, backend: str) -> None:
    monkeypatch.setenv("PDHAL_PLATFORM", backend)
    _registry.reset()
    assert pdhal.current_backend() == backend


@pytest.mark.parametrize(
    "publisher, mapper", [("xpu", "cuda"), ("cuda", "xpu"), ("cuda", "cpu"), ("cpu", "xpu")]
)
def test_host_memory_one_backend_allocates_is_mapped_by_a_process_on_another(
    runtimes, monkeypatch, publisher, mapper
):
    """The mapper sees the publisher's bytes and writes into the same memory; freeing the
    buffer withdraws its name, and the runtime's pinning is undone."""
    _select(monkeypatch, publisher)
    live = SimRuntime(publisher).lib.sim_live_host_buffers() if publisher != "cpu" else None
    buf = ops.host_alloc(NBYTES)
    view = buf.as_numpy(np.uint8, (NBYTES,))
    view[:] = np.arange(NBYTES) % 251
    ops.set_data_ipc(view[1024:], "kv")  # a tensor inside the buffer: its bytes only
    run_child(
        f"""
        import numpy as np
        import pdhal
        from pdhal import ops
        assert pdhal.current_backend() == {mapper!r}
        shared = ops.share_external_data("uint8", "kv", [{NBYTES - 1024}])
        got = np.asarray(shared)
        assert (got == np.arange(1024, {NBYTES}) % 251).all(), "other bytes"
        got[:4] = [9, 8, 7, 6]  # into the publisher's memory
        ops.unset_data_ipc(None, "kv", True, False)
        """,
        env={**os.environ, "PDHAL_PLATFORM": mapper},
    )
    assert list(view[1024:1028]) == [9, 8, 7, 6]
    ops.host_free(buf)
    with pytest.raises(pdhal.SegmentError, match=r"\.kv does not exist"):
        ops.get_data_ptr_ipc(None, "kv", 0)
    if live is not None:
        assert SimRuntime(publisher).lib.sim_live_host_buffers() == live


def test_a_runtime_that_cannot_register_host_memory_says_its_host_memory_stays_private(
    monkeypatch,
):
    """An XPU runtime without the CUDA-compatible host registration: host_alloc comes from
    its own allocator, which no other process can map, and set_data_ipc says so."""
    monkeypatch.setenv("PDHAL_XPURT", XpuTestSupport.simulator("libxpurt_old.so"))
    _select(monkeypatch, "xpu")
    buf = ops.host_alloc(NBYTES)
    try:
        with pytest.raises(pdhal.UnsupportedError, match="has no cudaHostRegister"):
            ops.set_data_ipc(buf.as_numpy(np.uint8, (NBYTES,)), "kv")
    finally:
        ops.host_free(buf)


@pytest.mark.parametrize("publisher, mapper", [("xpu", "cuda"), ("cuda", "xpu"), ("cuda", "cpu")])
def test_a_device_handle_is_never_opened_by_another_backend_s_runtime(
    runtimes, monkeypatch, publisher, mapper
):
    """Device memory shared by one runtime's IPC handle: a process on another backend is
    refused, naming both backends, before its runtime is handed the handle."""
    _select(monkeypatch, publisher)
    sim = SimRuntime(publisher)
    device = {"cuda": "gpu:0", "xpu": "xpu:0"}[publisher]
    ops.set_data_ipc(DeviceTensor(sim.malloc(4096), 4096, device), "kv")
    try:
        run_child(
            f"""
            import pdhal
            from pdhal import ops
            try:
                ops.share_external_data("uint8", "kv", [4096])
            except pdhal.UnsupportedError as e:
                assert "shared by the {publisher} backend's runtime" in str(e), e
                assert {mapper!r} in str(e), e
            else:
                raise AssertionError("a {publisher} handle was opened on {mapper}")
            """,
            env={**os.environ, "PDHAL_PLATFORM": mapper},
        )
    finally:
        ops.unset_data_ipc(None, "kv", False, True)


@pytest.mark.parametrize("backend", ["cpu", "cuda"])
def test_a_record_that_is_not_what_set_data_ipc_writes_is_refused_naming_what_is_wrong(
    runtimes, monkeypatch, backend
):
    """A record is another process's word: one that names anything but a host_alloc buffer
    of this namespace (another name's record, another deployment's buffer), or whose fields
    are not set_data_ipc's, is refused with a pdhal error naming it, nothing mapped."""
    from pdhal._memory import published, sharedhost
    from pdhal._protocol import names

    _select(monkeypatch, backend)
    buf = ops.host_alloc(NBYTES)
    ops.set_data_ipc(buf.as_numpy(np.uint8, (NBYTES,)), "honest")
    ours = published.lookup("honest", 0)
    other_namespace = ours["path"].replace(f".{names.namespace()}.", ".elsewhere.")
    hostile = {
        "a record": ({**ours, "path": names.buffer_path("honest")}, "not a host_alloc buffer"),
        "another namespace": ({**ours, "path": other_namespace}, "not a host_alloc buffer"),
        "a NUL": ({**ours, "path": ours["path"] + "\x00x"}, "is not a string of printable"),
        "bytes past its buffer": ({**ours, "offset": NBYTES - 8}, "of a buffer of"),
        "no size": ({"path": ours["path"], "offset": 0}, "fields"),
        "a text size": ({**ours, "nbytes": "16"}, "nbytes '16' is not an int"),
        "a bool offset": ({**ours, "offset": True}, "offset True is not an int"),
        "both kinds": ({**ours, "handle": "00"}, "fields"),
    }
    if backend == "cuda":
        device = {"handle": "zz", "backend": "cuda", "offset": 0, "nbytes": 64}
        hostile["a handle of no hex"] = (device, "holds no cudaIpcMemHandle_t")
    wants = dict.fromkeys(hostile, 16)
    if backend == "cuda":  # a real handle, of 4096 bytes, with a lying offset or size
        ops.set_data_ipc(DeviceTensor(SimRuntime("cuda").malloc(4096), 4096, "gpu:0"), "dev")
        real, beyond = published.lookup("dev", 0), "of an allocation of 4096 bytes"
        hostile["an offset beyond"] = ({**real, "offset": 1 << 40}, beyond)
        hostile["a size beyond"] = ({**real, "nbytes": 1 << 30}, beyond)
        wants["a size beyond"] = 1 << 24
    mapped = set(sharedhost._imported)  # (earlier tests' imports may stay)
    try:
        for what, (record, says) in hostile.items():
            published.publish("evil", record)
            with pytest.raises(pdhal.InvalidArgumentError, match=says):
                ops.share_external_data("uint8", "evil", [wants.get(what, 16)])
            ops.unset_data_ipc(None, "evil", True, True)
            assert set(sharedhost._imported) == mapped, f"{what}: a refused record stays mapped"
        with pytest.raises(pdhal.InvalidArgumentError, match="are pdhal's own"):
            ops.set_data_ipc(buf.as_numpy(np.uint8, (NBYTES,)), "host.1.2")  # a buffer's name
    finally:
        ops.host_free(buf)
        if backend == "cuda":
            ops.unset_data_ipc(None, "dev", True, True)


def test_a_record_naming_a_buffer_its_publisher_did_not_allocate_is_refused():
    """A peer's record that names another process's host_alloc buffer (here this one's:
    it would have the importer write into its own memory, or a third process's) is refused
    naming both pids, nothing mapped, whether it names the buffer's file or another link to
    that file named for the publisher's pid; and a forked child cannot share its parent's
    buffer (set_data_ipc says who allocated it)."""
    import subprocess
    import sys

    from pdhal._memory import sharedhost

    buf = ops.host_alloc(NBYTES)
    ours = buf.path
    publisher = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import os, sys\n"
            "from pdhal._memory import published\n"
            f"published.publish('stolen', {{'path': {ours!r}, 'offset': 0, 'nbytes': 16}})\n"
            f"alias = {ours!r}.rsplit('host.', 1)[0] + f'host.{{os.getpid()}}.999'\n"
            f"os.link({ours!r}, alias)\n"
            "published.publish('aliased', {'path': alias, 'offset': 0, 'nbytes': 16})\n"
            "print('ready', flush=True)\n"
            "sys.stdin.read()\n"
            "os.unlink(alias)\n",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    mapped = set(sharedhost._imported)
    try:
        assert publisher.stdout.readline() == "ready\n"
        for record in ("stolen", "aliased"):
            with pytest.raises(
                pdhal.InvalidArgumentError,
                match=rf"host_alloc buffer of pid {os.getpid()}, not one of its publisher "
                rf"\(pid {publisher.pid}\)",
            ):
                ops.share_external_data("uint8", record, [16])
        assert set(sharedhost._imported) == mapped
        child = os.fork()
        if child == 0:  # a forked child sharing what its parent allocated
            try:
                ops.set_data_ipc(buf.as_numpy(np.uint8, (NBYTES,)), "inherited")
            except pdhal.UnsupportedError as e:
                os._exit(0 if f"buffer of pid {os.getppid()}" in str(e) else 2)
            os._exit(1)
        assert os.waitpid(child, 0)[1] == 0, "a forked child shared its parent's buffer"
    finally:
        publisher.stdin.close()
        publisher.wait(30)
        ops.host_free(buf)
