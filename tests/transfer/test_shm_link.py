"""The shm link's copies run on a copier thread after submit returns: memory they read or
write that this process frees meanwhile waits for them (a HostQueue on its extents), and a
copy from memory already freed is refused. Each case runs in a process of its own (a copy
from unmapped memory would kill it)."""

from __future__ import annotations

from pdhal.testing.fixtures import run_child

#: An endpoint and a link in one process: its regions and a source, all host_alloc memory.
SETUP = """
import json, os
from pdhal import ops, TransferError
from pdhal.transfer import transport
N = 32 << 20
shm = transport("shm")
region = ops.host_alloc(N)
endpoint = shm.endpoint([region], "freeing")
source = ops.host_alloc(N)
source.as_numpy("uint8", (N,))[:] = 7
address = source.as_numpy("uint8", (N,)).ctypes.data
link = shm.connect(endpoint.describe(), [(address, N)])
"""


def test_freeing_a_source_waits_for_the_copies_queued_from_it(namespace):
    """host_free of a source with copies queued from it returns once they ran: every one
    landed (none read unmapped memory), and a submit from it afterwards is refused."""
    run_child(
        SETUP
        + """
batches = [link.submit([(address, 0, 0, N)]) for _ in range(8)]
ops.host_free(source)
assert all(batch.done() for batch in batches)  # ran before the free returned
assert (region.as_numpy("uint8", (N,))[:: 1 << 20] == 7).all()
try:
    link.submit([(address, 0, 0, 8)])
except TransferError as e:
    assert "freed" in str(e), e
else:
    raise AssertionError("a copy from freed memory was queued")
link.close()
endpoint.close()
ops.host_free(region)
"""
    )


def test_freeing_a_region_the_link_maps_waits_for_the_copies_into_it(namespace):
    """The destination's memory as mapped here, unmapped by hand (unset_data_ipc on its
    name) with copies queued into it: the unmap waits for them, and later submits fail."""
    run_child(
        SETUP
        + """
batches = [link.submit([(address, 0, 0, N)]) for _ in range(8)]
ops.unset_data_ipc(None, "freeing.r0", True, False)  # this process's mapping of it
assert all(batch.done() for batch in batches)
try:
    link.submit([(address, 0, 0, 8)])
except TransferError:
    pass
else:
    raise AssertionError("a copy into an unmapped region was queued")
link.close()
endpoint.close()
ops.host_free(region)
ops.host_free(source)
"""
    )


def test_a_batch_is_done_only_once_its_bytes_are_in_the_destination(namespace):
    """done() polled until True: every byte of the copy is there by then (the last MiB of
    32 included), three times over."""
    run_child(
        SETUP
        + """
import time
view = region.as_numpy("uint8", (N,))
for fill in (1, 2, 3):
    source.as_numpy("uint8", (N,))[:] = fill
    batch = link.submit([(address, 0, 0, N)])
    deadline = time.monotonic() + 60
    while not batch.done():
        assert time.monotonic() < deadline, "never done"
    assert (view[-(1 << 20):] == fill).all() and (view[:: 1 << 16] == fill).all()
link.close()
endpoint.close()
ops.host_free(region)
ops.host_free(source)
"""
    )


def test_a_link_refuses_at_connect_sources_this_process_cannot_read(namespace):
    """A link's sources are the caller's word (a transport kit's caller passes addresses):
    one at address 0, in a reserved range (PROT_NONE), unmapped, or running past readable
    memory is refused at connect naming it, where the copier would fault on it at the first
    submit; readable memory is taken, read-only memory too (ipc's host sources:
    test_ipc)."""
    run_child(
        """
import ctypes
from pdhal import ops, InvalidArgumentError
from pdhal.transfer import transport
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                      ctypes.c_int, ctypes.c_long]
PAGE = 4096
pages = libc.mmap(None, 3 * PAGE, 3, 0x22, -1, 0)  # read/write, private, anonymous
assert libc.mprotect(ctypes.c_void_p(pages + PAGE), PAGE, 0) == 0  # PROT_NONE
assert libc.munmap(ctypes.c_void_p(pages + 2 * PAGE), PAGE) == 0
region = ops.host_alloc(PAGE)
shm = transport("shm")
endpoint = shm.endpoint([region], "unreadable")
for address, nbytes in ((0, 64), (pages + PAGE, 64), (pages + 2 * PAGE, 64),
                        (pages + PAGE - 8, 16)):
    try:
        shm.connect(endpoint.describe(), [(address, nbytes)])
    except InvalidArgumentError as e:
        assert f"source [{address:#x}, +{nbytes}) is not memory this process can read" in (
            str(e)), e
    else:
        raise AssertionError(f"the unreadable source {address:#x}+{nbytes} was taken")
ctypes.memset(pages, 5, PAGE)
assert libc.mprotect(ctypes.c_void_p(pages), PAGE, 1) == 0  # PROT_READ: a link only reads it
link = shm.connect(endpoint.describe(), [(pages, PAGE)])
link.submit([(pages, 0, 0, PAGE)]).wait(10)
assert (region.as_numpy("uint8", (PAGE,)) == 5).all()
link.close()
endpoint.close()
ops.host_free(region)
"""
    )
