"""The `ipc` transport: prefill and decode on one vendor's device memory on one host (the
simulated cuda and xpu runtimes: no GPU or XPU here). The decode side publishes its device
caches as its runtime's IPC handles; the prefill side opens them and copies each run
device to device with its runtime, nothing staged through host memory on either side. Real
processes: this one prefills, bound to the simulated runtime; the decode process is bound
to it too. Pairs the transport cannot move (two vendors, device memory into host memory)
are refused when the destination is connected, naming both."""

from __future__ import annotations

import copy
import os
import threading
import time

import pytest
from device_peers import COPY, ENGINE, KIND, device_sources, lands_alone, on_device

import pdhal
from pdhal import InvalidArgumentError, TransferError, UnsupportedError, transfer
from pdhal._backends import registry as _registry
from pdhal._transfer import plugins as _transports
from pdhal.testing.transfer_peers import BLOCK_TOKENS, LAYERS, outcomes_until

pytestmark = pytest.mark.simulated


def decode_on(backend: str, kv: str = "apart", memory: str = "device"):
    """A decode process bound to `backend`'s simulated runtime, its receiver over ipc."""
    return on_device(backend, kv, memory=memory, transport="ipc")


def refused_at_connect(runtime, decode: str, error: type, memory: str = "device") -> str:
    """Why an ipc streamer over `runtime`'s device caches is refused (`error`) when it
    connects a decode process bound to `decode`'s runtime (its caches `memory`)."""
    streamer = ipc_streamer(runtime)
    there = decode_on(decode, memory=memory)
    try:
        with pytest.raises(error) as e:
            streamer.connect(there.described)
        return str(e.value)
    finally:
        there.close()
        streamer.close()


def ipc_streamer(runtime) -> transfer.KVStreamer:
    return transfer.KVStreamer(
        device_sources(runtime), BLOCK_TOKENS, transport_name="ipc", claim_timeout=30
    )


#: The backends whose runtime can say how large an opened IPC allocation is (the link
#: checks a description's sizes against it): cuda's. xpu's cannot (refused below).
LINKS = ["cuda"]


@pytest.mark.parametrize("backend", LINKS)
@pytest.mark.parametrize("kv", ["apart", "halves"])
def test_one_vendor_s_device_caches_land_device_to_device(bind, backend, kv):
    """Every block of the request is in the decode side's device caches once it landed,
    every other block holds what its engine wrote there; neither side staged (the decode
    side serves its device caches as they are)."""
    streamer = ipc_streamer(bind(backend))
    decode = decode_on(backend, kv)
    try:
        assert "staged" not in decode.described
        assert set(decode.described["layout"]["memory"]) == {KIND[backend]}
        decode.fill(ENGINE)
        lands_alone(streamer, decode, [0, 6, 3], [7, 1, 2], 10)
    finally:
        decode.close()
        streamer.close()


@pytest.mark.parametrize("backend", LINKS)
def test_the_runtime_copies_every_run_and_a_copy_it_fails_fails_the_request(bind, backend):
    """The device runs go through this process's runtime (its copy told to fail fails
    them): the request fails with why, and the decode side reads that why at once, over the
    same link (a runtime's copy error is the batch's own: BatchFailedError), well before
    its deadline; the next request lands over that link."""
    runtime = bind(backend)
    streamer = ipc_streamer(runtime)
    decode = decode_on(backend)
    try:
        ticket = decode.expect("a", timeout=10.0)
        streamer.add_request("a", [2], 4)
        streamer.set_destination("a", streamer.connect(decode.described), [5], ticket)
        runtime.fail(COPY[backend])
        try:
            for layer in range(LAYERS):
                streamer.layer_ready(layer, [("a", 4)])
            [outcome] = outcomes_until(streamer, 1)
        finally:
            runtime.clear_failures()
        assert not outcome.landed
        assert "the runtime's copy into the destination failed" in outcome.reason
        landed, reason, _ = decode.outcome("a")
        assert not landed and "the runtime's copy into the destination failed" in reason
        dest = streamer.connect(decode.described)
        link = dest._channel.link
        decode.fill(ENGINE)
        lands_alone(streamer, decode, [4], [6], 4, request="b")
        assert dest._channel.link is link, "the link was broken and connected anew"
    finally:
        decode.close()
        streamer.close()


@pytest.mark.parametrize("backend", LINKS)
def test_a_request_is_reported_landed_only_once_the_runtime_ran_its_copies(bind, backend):
    """The runtime's copies are asynchronous: queued behind a slow kernel on the stream,
    they have not run when the copy calls return. The request is reported landed (its
    word written after its layers' submits returned) only once they ran: every block is
    there when the decode side reads it."""
    runtime = bind(backend)
    streamer = ipc_streamer(runtime)
    decode = decode_on(backend)
    try:
        decode.fill(ENGINE)
        runtime.launch_write(0, runtime.malloc(64), b"x", 300_000)  # 0.3 s on the stream
        lands_alone(streamer, decode, [1, 2], [3, 0], 8)
    finally:
        decode.close()
        streamer.close()


@pytest.mark.parametrize("prefill, decode", [("cuda", "xpu"), ("xpu", "cuda")])
def test_two_vendors_are_refused_at_connect_naming_both(bind, prefill, decode):
    """A vendor's IPC handle is never handed to another's runtime: the pair is refused
    when the destination is connected, before any handle is opened."""
    why = refused_at_connect(bind(prefill), decode, InvalidArgumentError)
    assert f"{KIND[prefill]} memory" in why
    assert f"destination's {KIND[decode]} memory" in why


def test_a_description_of_another_backend_s_handles_is_refused_naming_both(bind):
    """A description that says its handles are another backend's (a peer's word) is
    refused at connect, naming both backends."""
    streamer = ipc_streamer(bind("cuda"))
    there = decode_on("cuda")
    try:
        with pytest.raises(InvalidArgumentError, match="'xpu' backend's runtime.*'cuda'"):
            streamer.connect(dict(there.described, backend="xpu"))
        with pytest.raises(InvalidArgumentError, match="None backend's runtime"):
            streamer.connect({k: v for k, v in there.described.items() if k != "backend"})
    finally:
        there.close()
        streamer.close()


def test_device_caches_into_host_caches_are_refused_at_connect(bind):
    """ipc moves device memory to device memory and host to host: device caches into a
    decode side's host caches are refused at connect, naming both kinds (shm stages them)."""
    why = refused_at_connect(bind("cuda"), "cuda", InvalidArgumentError, memory="host")
    assert "gpu memory and the destination's cpu" in why


def test_a_description_claiming_device_caches_that_are_host_memory_is_refused_at_connect(bind):
    """A decode side whose description says its caches are device memory, where what its
    names map is host memory, is refused at connect naming the region and both kinds (the
    link knows what it mapped), not at the first submit with the decode side left to find
    out at its deadline."""
    streamer = ipc_streamer(bind("cuda"))
    there = decode_on("cuda", memory="host")
    forged = copy.deepcopy(there.described)
    forged["layout"]["memory"] = ["gpu"] * len(forged["layout"]["memory"])
    try:
        with pytest.raises(
            InvalidArgumentError,
            match="region 0 is said to be gpu memory, but what the link maps there is cpu",
        ):
            streamer.connect(forged)
    finally:
        there.close()
        streamer.close()


def test_a_run_across_kinds_of_memory_is_refused_at_submit(bind):
    """A link's caller (not the streamer) that submits a host source into a device region
    is refused before any copy: the runtime would be told the wrong direction."""
    runtime = bind("cuda")
    there = decode_on("cuda")
    host = pdhal.ops.host_alloc(64)
    link = _transports.transport("ipc").connect(
        there.described, [(host.address, host.nbytes, "cpu")]
    )
    try:
        runtime.fail(COPY["cuda"])  # (counts the copies tried)
        with pytest.raises(TransferError, match="run 0 copies cpu memory into gpu memory"):
            link.submit([(host.address, 0, 0, 64)])
        assert runtime.failed_calls(COPY["cuda"]) == 0
    finally:
        runtime.clear_failures()
        link.close()
        pdhal.ops.host_free(host)
        there.close()


def test_a_description_naming_regions_nobody_publishes_is_refused_at_connect(bind):
    """A link that cannot map what a description names fails its connect with why (and
    leaves nothing mapped or open)."""
    bind("cuda")
    there = decode_on("cuda")
    names = [f"nobody-{os.getpid()}.r{i}" for i in range(len(there.described["names"]))]
    try:
        with pytest.raises(TransferError, match="cannot map the destination's memory"):
            _transports.transport("ipc").connect(dict(there.described, names=names), [])
    finally:
        there.close()


def test_a_source_without_its_kind_of_memory_is_refused_naming_it(bind):
    bind("cuda")
    there = decode_on("cuda")
    try:
        with pytest.raises(InvalidArgumentError, match=r"sources\[0\] must be \(address, bytes"):
            _transports.transport("ipc").connect(there.described, [(4096, 64)])
    finally:
        there.close()


def test_a_process_without_device_memory_is_told_to_use_shm(monkeypatch):
    monkeypatch.setenv("PDHAL_PLATFORM", "cpu")
    _registry.reset()
    _transports.forget()
    try:
        with pytest.raises(UnsupportedError, match=r"platform \(cpu\) has no device memory"):
            _transports.transport("ipc")
    finally:
        _transports.forget()
        _registry.reset()


def test_a_link_from_a_runtime_that_cannot_size_its_ipc_allocations_is_refused(bind):
    """xpu's runtime cannot say how large an opened IPC allocation is: a peer's word on a
    region's size could not be checked (a lying one would have the link copy past it), so
    an xpu process may serve an ipc endpoint but links from none, told why."""
    why = refused_at_connect(bind("xpu"), "xpu", UnsupportedError)
    assert "xpu runtime cannot say how large" in why


def test_a_stalled_device_fails_its_request_by_the_stall_timeout(bind):
    """A submit only queues its copies (the link's copy thread makes them and waits for
    the runtime): work on the stream that does not end for 6 s holds up that thread, not
    the streamer, and the request fails by its stall_timeout (0.5 s), naming why. A stall
    is not the batch's own failure: the link is retired, the next request connects anew."""
    runtime = bind("cuda")
    streamer = transfer.KVStreamer(
        device_sources(runtime), BLOCK_TOKENS, transport_name="ipc", stall_timeout=0.5
    )
    decode = decode_on("cuda")
    try:
        ticket = decode.expect("a", timeout=30)
        streamer.add_request("a", [2], 4)
        dest = streamer.connect(decode.described)
        streamer.set_destination("a", dest, [5], ticket)
        runtime.launch_write(0, runtime.malloc(64), b"x", 6_000_000)
        start = time.monotonic()
        for layer in range(LAYERS):
            streamer.layer_ready(layer, [("a", 4)])
        [outcome] = outcomes_until(streamer, 1)
        assert time.monotonic() - start < 5.0, "failed only once the stream's work ended"
        assert not outcome.landed
        assert "copies into the destination did not finish in the" in outcome.reason
        assert dest._channel is None, "the stalled link was kept for the next request"
    finally:
        decode.close()
        streamer.close()
        # the link's close was left to its copy thread (the stream's work had not ended):
        # it unmaps once that ends, within this test's namespace
        for thread in threading.enumerate():
            if thread.name == "pdhal-ipc-copies":
                thread.join(30)


def test_each_link_takes_its_own_transport_s_descriptions_only(bind):
    """An ipc endpoint's description (device memory) handed to an shm link, whose memmove
    cannot reach device memory, is refused naming the transport; so is one relabelled shm
    (what its names map to is device memory); and an shm description to an ipc link."""
    bind("cuda")
    host = pdhal.ops.host_alloc(64)
    there = decode_on("cuda")
    shm_there = on_device("cuda", transport="shm", name="decode-shm")
    shm, ipc = _transports.transport("shm"), _transports.transport("ipc")
    try:
        with pytest.raises(InvalidArgumentError, match="of transport 'ipc', not 'shm'"):
            shm.connect(there.described, [(host.address, 64)])
        with pytest.raises(InvalidArgumentError, match="is gpu:0 memory; the shm transport moves"):
            shm.connect(dict(there.described, transport="shm"), [(host.address, 64)])
        with pytest.raises(InvalidArgumentError, match="of transport 'shm', not 'ipc'"):
            ipc.connect(shm_there.described, [(host.address, 64, "cpu")])
    finally:
        shm_there.close()
        there.close()
        pdhal.ops.host_free(host)


def test_a_source_s_kind_must_be_one_ipc_moves_and_what_pdhal_knows_it_is(bind):
    bind("cuda")
    host = pdhal.ops.host_alloc(64)
    there = decode_on("cuda")
    ipc = _transports.transport("ipc")
    try:
        with pytest.raises(
            InvalidArgumentError, match=r"one the ipc transport moves here \(gpu, cpu\), got 'xpu'"
        ):
            ipc.connect(there.described, [(host.address, 64, "xpu")])
        with pytest.raises(
            InvalidArgumentError, match="said to be gpu memory, but it lies in pdhal's cpu"
        ):
            ipc.connect(there.described, [(host.address, 64, "gpu")])
        # host memory is read by shm's copier: it must be readable here (device memory is
        # read by the runtime, which checks its own pointers)
        with pytest.raises(InvalidArgumentError, match=r"source \[0x0, \+64\) is not memory"):
            ipc.connect(there.described, [(0, 64, "cpu")])
    finally:
        there.close()
        pdhal.ops.host_free(host)
