"""Segment safety: owner-only mode, validation on open, refusal of foreign or odd files,
concurrent reclaim."""

from __future__ import annotations

import errno
import os
import stat
import struct
import subprocess
import sys

import pytest

import pdhal
from pdhal import ops
from pdhal._protocol import core as _core
from pdhal._protocol import names as _names


def _mode(path: str) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


@pytest.mark.parametrize("umask", [0o000, 0o077])
def test_segments_are_0600_whatever_the_umask(umask):
    old = os.umask(umask)
    try:
        meta = ops.open_shm_and_get_meta_signal(0, 0)
        ops.init_kv_signal_per_query([3], [3], [0], 0, 2)
        buf = ops.host_alloc(4096)
    finally:
        os.umask(old)
    for kind in ("query", "chunk"):
        assert _mode(_names.channel_path(kind, 0, 0)) == 0o600
    assert _mode(buf.path) == 0o600
    ops.host_free(buf)
    assert meta.step == 1


def _corrupt(offset: int, fmt: str, value) -> str:
    ops.open_shm_and_get_meta_signal(0, 0)
    path = _names.channel_path("query", 0, 0)
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(struct.pack(fmt, value))
    return path


@pytest.mark.parametrize(
    "offset,fmt,value,code,words",
    [
        (0, "<Q", 0x1234, errno.EBADMSG, "not a pdhal segment"),
        (8, "<I", 99, errno.EPROTONOSUPPORT, "layout version 99"),
        (16, "<Q", 12345, errno.EMSGSIZE, "header says 12345"),
        (12, "<I", 2, errno.EPROTOTYPE, "kind 2, expected kind 1"),
    ],
)
def test_bad_header_is_refused_with_its_own_error(offset, fmt, value, code, words):
    _corrupt(offset, fmt, value)
    with pytest.raises(pdhal.SegmentError, match=words) as info:
        ops.open_kv_signal_reader(0, 0, timeout=0)
    assert info.value.errno == code


def _plant(path: str, mode: int, size: int = 256) -> None:
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, mode)
    os.fchmod(fd, mode)
    os.ftruncate(fd, size)
    os.close(fd)


def test_initialising_segment_is_waited_for_then_refused():
    path = _names.channel_path("query", 0, 0)
    _plant(path, 0o200)
    with pytest.raises(pdhal.SegmentError, match="still being initialised") as info:
        ops.open_kv_signal_reader(0, 0, timeout=0.2)
    assert info.value.errno == errno.ETIMEDOUT
    os.unlink(path)


def test_missing_segment_is_a_clear_not_found():
    with pytest.raises(pdhal.SegmentError, match="does not exist") as info:
        ops.open_kv_signal_reader(0, 0, timeout=0.05)
    assert info.value.errno == errno.ENOENT


@pytest.mark.parametrize("mode", [0o666, 0o644])
def test_foreign_mode_is_refused_by_readers_and_producers(mode):
    path = _names.channel_path("query", 0, 0)
    _plant(path, mode)
    with pytest.raises(pdhal.SegmentError, match=f"mode 0{mode:o}"):
        ops.open_kv_signal_reader(0, 0, timeout=0)
    with pytest.raises(pdhal.SegmentError, match="refusing to touch it"):
        ops.open_shm_and_get_meta_signal(0, 0)  # never reclaims what is not its own
    assert os.path.exists(path)
    os.unlink(path)


def test_symlink_at_the_name_is_refused():
    path = _names.channel_path("query", 0, 0)
    target = path + ".target"
    _plant(target, 0o600)
    os.symlink(target, path)
    with pytest.raises(pdhal.SegmentError, match="symbolic link"):
        ops.open_kv_signal_reader(0, 0, timeout=0)
    with pytest.raises(pdhal.SegmentError):
        ops.open_shm_and_get_meta_signal(0, 0)
    os.unlink(path)
    os.unlink(target)


@pytest.mark.skipif(os.geteuid() != 0, reason="changing a file's owner needs root")
def test_another_uids_segment_is_refused():
    ops.open_shm_and_get_meta_signal(0, 0)
    path = _names.channel_path("query", 0, 0)
    os.chown(path, 65534, 65534)
    with pytest.raises(pdhal.SegmentError, match="belongs to uid 65534") as info:
        ops.open_kv_signal_reader(0, 0, timeout=0)
    assert info.value.errno == errno.EPERM
    os.chown(path, 0, 0)


@pytest.mark.skipif(os.geteuid() != 0, reason="dropping privileges needs root")
def test_another_uid_cannot_open_or_write_our_segment():
    ops.open_shm_and_get_meta_signal(0, 0)
    path = _names.channel_path("query", 0, 0)
    code = f"""
import os
os.setgid(65534); os.setuid(65534)
for flags in (os.O_RDONLY, os.O_RDWR, os.O_WRONLY):
    try:
        os.open({path!r}, flags)
    except PermissionError:
        continue
    raise SystemExit("opened with flags %d" % flags)
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_second_live_producer_is_refused():
    ops.open_shm_and_get_meta_signal(0, 0)
    code = "from pdhal import ops; ops.open_shm_and_get_meta_signal(0, 0)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode != 0
    assert f"already has a live producer (pid {os.getpid()})" in proc.stderr


def test_eight_concurrent_reclaimers_unlink_each_dead_segment_once():
    dead = [_names.channel_path("query", r, 0) for r in range(4)]
    for r in range(4):  # producers that die without unlinking
        subprocess.run(
            [
                sys.executable,
                "-c",
                f"import os; from pdhal import ops; "
                f"ops.open_shm_and_get_meta_signal({r}, 0); os._exit(0)",
            ],
            check=True,
        )
    live = ops.open_shm_and_get_meta_signal(7, 0)
    live_path = _names.channel_path("query", 7, 0)
    code = f"""
import json
from pdhal._protocol import core as _core
paths = {dead + [live_path]!r}
print(json.dumps([_core.reclaim(p) for p in paths]))
"""
    procs = [
        subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        for _ in range(8)
    ]
    import json

    results = [json.loads(p.communicate()[0]) for p in procs]
    for i in range(4):
        assert sum(r[i] for r in results) == 1, f"dead segment {i} unlinked {results}"
        assert not os.path.exists(dead[i])
    assert not any(r[4] for r in results)
    assert os.path.exists(live_path) and live.step == 1


def test_unlinked_from_outside_keeps_existing_mappings_working():
    meta = ops.open_shm_and_get_meta_signal(0, 0)
    reader = ops.open_kv_signal_reader(0, 0)
    os.unlink(_names.channel_path("query", 0, 0))  # what systemd RemoveIPC does
    ops.signal_layer_ready(ops.init_signal_layerwise(meta, 5))
    assert reader.wait((1, 4), timeout=1) == (1, 5)
    with pytest.raises(pdhal.SegmentError, match="does not exist"):
        ops.open_kv_signal_reader(0, 0, timeout=0)
    reader.close()


# ---- shared memory is input: a full tmpfs, a hostile writer, impossible layouts -------

FULL_TMPFS = """
import errno, os, subprocess, sys, tempfile
folder = tempfile.mkdtemp()
subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", folder], check=True)
os.environ["PDHAL_SHM_DIR"] = folder
import pdhal
from pdhal import ops
filler = os.open(os.path.join(folder, "filler"), os.O_CREAT | os.O_WRONLY)
try:  # another user's files, say
    while True:
        os.write(filler, b"x" * 4096)
except OSError:
    os.close(filler)
for what, call in [("per query", lambda: ops.open_shm_and_get_meta_signal(0, 0)),
                   ("per chunk", lambda: ops.init_kv_signal_per_query([3], [3], [0], 0, 2)),
                   ("host memory", lambda: ops.host_alloc(1 << 20))]:
    try:
        call()
    except pdhal.SegmentError as e:
        assert e.errno == errno.ENOSPC, (what, e)
        assert f"no space in {folder}: need " in str(e) and ", have " in str(e), (what, e)
    else:
        raise AssertionError(f"{what}: no error on a full tmpfs")
    assert os.listdir(folder) == ["filler"], (what, os.listdir(folder))
os.remove(os.path.join(folder, "filler"))
# Room for the header but not the ring: every byte is reserved at creation, so the steps
# that reach the ring's far pages fail up front (they once died of SIGBUS at step 2).
with open(os.path.join(folder, "filler"), "wb") as filler:
    filler.write(b"x" * (64 - 24) * 1024)
try:
    ops.init_kv_signal_per_query([3], [3], [0], 0, 2)
except pdhal.SegmentError as e:
    assert e.errno == errno.ENOSPC, e
else:
    raise AssertionError("a per-chunk channel bigger than the free space was created")
print("ok")
"""


def test_a_full_tmpfs_is_a_clear_error_never_a_sigbus():
    """In a mount namespace of its own (so nothing is left mounted), with a 64 KiB tmpfs."""
    probe = subprocess.run(["unshare", "-rm", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"needs user and mount namespaces (unshare -rm): {probe.stderr!r}")
    proc = subprocess.run(
        ["unshare", "-rm", sys.executable, "-c", FULL_TMPFS],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0 and proc.stdout == "ok\n", (proc.returncode, proc.stderr)


HOSTILE_WRITER = """
import array, os, struct
from pdhal import ops
from pdhal._protocol import names as _names
chunk = ops.init_kv_signal_per_query([3], [3], [0], 0, 2)
reader = ops.open_kv_chunk_reader(0, 0)
path = _names.channel_path("chunk", 0, 0)
out = array.array("i", [0] * 1538)
for ring_slots in (0, 2**31, 1):  # the header's ring_slots, rewritten behind both handles
    with open(path, "r+b") as f:
        f.seek(32)
        f.write(struct.pack("<I", ring_slots))
    ops.signal_layer_ready(chunk.layer(0))
    ops.signal_layer_ready(chunk.layer(1))
    got = [(reader.next(out, timeout=5), list(out[:5])) for _ in range(2)]
    assert got == [(chunk.step, [1, 0, 0, 0, 3]), (chunk.step, [1, 1, 0, 0, 3])], got
    chunk = ops.init_kv_signal_per_query([3], [3], [0], 0, 2)
# A record count beyond any table, written into the slot being read: refused, not copied.
slot = 256 + (chunk.step % 16) * 6208
with open(path, "r+b") as f:
    f.seek(slot + 8)
    f.write(struct.pack("<I", 600))
ops.signal_layer_ready(chunk.layer(0))
try:
    reader.next(out, timeout=5)
except Exception as e:
    assert "corrupt" in str(e), e
else:
    raise AssertionError("a count of 600 was delivered")
print("ok")
"""


def test_a_layout_rewritten_after_validation_is_never_trusted():
    """Another process of our uid rewrites ring_slots (0 once gave SIGFPE, 2**31 SIGSEGV, in
    the reader and the producer) and a slot's count: both sides go on from their own copy."""
    proc = subprocess.run(
        [sys.executable, "-c", HOSTILE_WRITER], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0 and proc.stdout == "ok\n", (proc.returncode, proc.stderr)


WRAPPING_BUFFER = """
import errno, os, struct
import numpy as np
import pdhal
from pdhal import ops
from pdhal._protocol import core as _core
from pdhal._protocol import names as _names
path = _names.buffer_path("evil")
size = 2048
header = struct.pack("<QIIQiIIIQ", 0x4745534C41484450, _core.SEGMENT_VERSION, 3, size,
                     os.getpid(), os.geteuid(), 0, 512, 2**64 - 4096 + size)
fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
os.write(fd, header.ljust(size, b"\\0"))
os.close(fd)
try:
    ops.share_external_data(np.zeros(1, np.uint8), "evil", [1], timeout=0)
except pdhal.SegmentError as e:
    assert e.errno == errno.EMSGSIZE and "impossible layout" in str(e), e
else:
    raise AssertionError("accepted")
finally:
    os.unlink(path)
print("ok")
"""


def test_a_buffer_whose_size_wraps_is_refused():
    """4096 + body_bytes once wrapped to the file's size and passed validation, handing out
    a body that starts past the mapping and is nearly 2**64 bytes long (in a child: that was
    a crash)."""
    proc = subprocess.run(
        [sys.executable, "-c", WRAPPING_BUFFER], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0 and proc.stdout == "ok\n", (proc.returncode, proc.stderr)


def test_a_folder_anyone_may_write_needs_the_sticky_bit(tmp_path, monkeypatch):
    folder = tmp_path / "shm"
    folder.mkdir()
    folder.chmod(0o777)
    monkeypatch.setenv("PDHAL_SHM_DIR", str(folder))
    with pytest.raises(pdhal.SegmentError, match="writable by every user and has no sticky"):
        ops.open_shm_and_get_meta_signal(0, 0)
    with pytest.raises(pdhal.SegmentError, match="no sticky"):
        ops.open_kv_signal_reader(0, 0, timeout=0)
    assert os.listdir(folder) == []
    folder.chmod(0o1777)
    meta = ops.open_shm_and_get_meta_signal(0, 0)
    assert meta.step == 1
    from pdhal._protocol import signals as _signals

    _signals.close_producer_channels()
    assert os.listdir(folder) == []


def test_names_of_different_namespaces_never_meet(monkeypatch):
    """Buffer "q.query.r0.d0" of namespace "a" and namespace "a.buf.q"'s rank-0 channel once
    named the same file."""
    monkeypatch.setenv("PDHAL_NAMESPACE", "a")
    buffer = _names.buffer_path("q.query.r0.d0")
    monkeypatch.setenv("PDHAL_NAMESPACE", "a.buf.q")
    with pytest.raises(pdhal.InvalidArgumentError, match="PDHAL_NAMESPACE must be .*no '.'"):
        _names.channel_path("query", 0, 0)
    monkeypatch.setenv("PDHAL_NAMESPACE", "a-buf-q")
    assert _names.channel_path("query", 0, 0) != buffer


def test_a_file_grown_or_shrunk_behind_a_valid_header_is_refused():
    ops.open_shm_and_get_meta_signal(0, 0)
    path = _names.channel_path("query", 0, 0)
    for size in (4096, 200):  # header untouched; the file around it is not what it says
        os.truncate(path, size)
        with pytest.raises(pdhal.SegmentError, match="size|smaller than a pdhal header") as e:
            ops.open_kv_signal_reader(0, 0, timeout=0)
        assert e.value.errno == errno.EMSGSIZE


@pytest.mark.skipif(os.geteuid() != 0, reason="changing a file's owner needs root")
def test_a_dead_segment_of_another_uid_is_never_reclaimed():
    subprocess.run(
        [
            sys.executable,
            "-c",
            "import os; from pdhal import ops; ops.open_shm_and_get_meta_signal(0, 0); os._exit(0)",
        ],
        check=True,
    )
    path = _names.channel_path("query", 0, 0)
    os.chown(path, 65534, 65534)
    try:
        with pytest.raises(pdhal.SegmentError, match="belongs to uid 65534.*refusing to touch"):
            ops.open_shm_and_get_meta_signal(0, 0)
        assert os.path.exists(path)
    finally:
        os.unlink(path)


def test_a_path_of_256_bytes_is_refused_not_truncated(tmp_path, monkeypatch):
    """The handle keeps 255 bytes: a longer name would be created but never unlinked."""
    name_len = len(os.path.basename(_names.channel_path("query", 0, 0)))
    folder = tmp_path / ("f" * (256 - len(str(tmp_path)) - 2 - name_len))
    folder.mkdir()
    monkeypatch.setenv("PDHAL_SHM_DIR", str(folder))
    assert len(_names.channel_path("query", 0, 0)) == 256
    with pytest.raises(pdhal.InvalidArgumentError, match="1..255 bytes, got 256"):
        ops.open_shm_and_get_meta_signal(0, 0)
    assert os.listdir(folder) == []


def test_a_store_for_a_slot_outside_the_ring_is_refused():
    from pdhal._protocol import core as _core

    chunk = ops.init_kv_signal_per_query([3], [3], [0], 0, 2)
    with pytest.raises(pdhal.InvalidArgumentError, match="slot 99 is not a progress slot"):
        chunk.segment.new_store(99, 1)
    assert chunk.segment.ring_slots == 16
    query = ops.open_shm_and_get_meta_signal(0, 0).segment
    with pytest.raises(pdhal.InvalidArgumentError, match="slot 0 is not a progress slot"):
        query.new_store(0, 1)  # a per-query channel has no ring
    store = query.new_store(_core.QUERY_SLOT, 1)
    _core.free_store(store)


def test_only_the_reader_handle_reads_the_ring():
    from pdhal._protocol import core as _core

    ops.init_kv_signal_per_query([3], [3], [0], 0, 1)
    path = _names.channel_path("chunk", 0, 0)
    other = _core.Segment.open(path, _core.KIND_CHUNK, 1)  # not as the reader
    out = _core.ffi.new("int32_t[]", 1538)
    with pytest.raises(pdhal.SegmentError, match="not opened as its reader") as e:
        other.ring_next(out, 1538, 0)
    assert e.value.errno == errno.EPERM
    other.close()


def test_a_dup_of_a_handle_reads_on_after_the_first_is_closed_and_closes_on_its_own():
    """Segment.dup(): a followed gate's signals outlive the messager's reader."""
    meta = ops.open_shm_and_get_meta_signal(0, 0)
    reader = ops.open_kv_signal_reader(0, 0)
    dup = reader.segment.dup()
    reader.close()
    with pytest.raises(pdhal.ClosedHandleError):
        reader.current()
    ops.signal_layer_ready(ops.init_signal_layerwise(meta, 2))
    assert dup.progress() == _core.pack_progress(meta.step, 2)
    again = ops.open_kv_signal_reader(0, 0)
    again.segment.dup().close()
    assert again.current() == (meta.step, 2)
    again.close()
    dup.close()
    with pytest.raises(pdhal.ClosedHandleError):
        dup.progress()
