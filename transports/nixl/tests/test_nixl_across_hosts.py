"""The streamer over NIXL between two network stacks (pdhal.testing.netns: the decode
process in its own namespace, a veth pair between, UCX's TCP across it, each side's UCX
held to its veth end by PDHAL_NIXL_NET_DEVICES, as between two hosts),
then the cable cut mid-transfer: the prefill side ends the request as failed within its
stall_timeout, the decode side by its deadline, never landed. Root only (namespaces)."""

from __future__ import annotations

import base64
import os
import socket

import pytest

from pdhal.testing import netns
from pdhal.testing.transfer_peers import (
    BLOCK_TOKENS,
    LAYERS,
    Decode,
    Prefill,
    expected,
    landed_blocks,
)

pytestmark = pytest.mark.skipif(netns.available() is not None, reason=str(netns.available()))


@pytest.fixture
def hosts():
    with netns.TwoHosts() as pair:
        yield pair


def test_across_two_network_stacks_every_block_lands_then_a_cut_link_fails_both_sides(hosts):
    decode = Decode(
        "xh-decode",
        "nixl",
        prefix=hosts.there_prefix,
        env=dict(os.environ, PDHAL_NIXL_NET_DEVICES=hosts.there),
    )
    prefill = Prefill("nixl", env=dict(os.environ, PDHAL_NIXL_NET_DEVICES=hosts.here))
    try:
        # UCX advertises the decode side's veth address (PDHAL_NIXL_NET_DEVICES)
        metadata = base64.b64decode(decode.described["metadata"])
        assert socket.inet_aton(hosts.decode_ip) in metadata
        prefill.send("connect", decode.described)
        prefill.send("add", "a", [1, 2], [3, 4], decode.expect("a"))
        for layer in range(LAYERS):
            prefill.send("layer", layer, [["a", 2 * BLOCK_TOKENS]])
        assert prefill.outcomes(1) == {"a": (True, "")}
        landed, _, dump, _ = decode.wait("a")
        assert landed and landed_blocks(dump, 3) == expected(1)
        assert landed_blocks(dump, 4) == expected(2)

        prefill.send("add", "b", [5], [6], decode.expect("b", timeout=4.0))
        prefill.send("layer", 0, [["b", BLOCK_TOKENS]])
        hosts.cut()
        for layer in range(1, LAYERS):
            prefill.send("layer", layer, [["b", BLOCK_TOKENS]])
        [(landed, reason)] = prefill.outcomes(1).values()
        assert not landed and reason, "the cut link was not reported on the prefill side"
        landed, reason, _, _ = decode.wait("b")
        assert not landed and "nothing landed within 4 s" in reason
    finally:
        prefill.close()
        decode.close()
