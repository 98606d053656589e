"""The streamer over Mooncake between two network stacks (pdhal.testing.netns: the decode
process in its own namespace, a veth pair between, TCP across it, as between two hosts),
then the cable cut mid-transfer: the prefill side ends the request as failed within its
stall_timeout, the decode side by its deadline, never landed. Root only (namespaces)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pdhal.testing import netns
from pdhal.testing.transfer_peers import BLOCK_TOKENS, LAYERS, Decode, expected, landed_blocks

pytestmark = pytest.mark.skipif(netns.available() is not None, reason=str(netns.available()))

#: The prefill side, a child (its Mooncake engine on the prefill address): commands on
#: stdin ("connect", "add", "layer", "outcomes"), answers as JSON lines.
PREFILL = f"""
import json, sys, time
from pdhal import transfer
from pdhal.testing.transfer_peers import source_caches
streamer = transfer.KVStreamer(
    transfer.CacheLayout.from_caches(source_caches()), {BLOCK_TOKENS},
    transport_name="mooncake", stall_timeout=2.0,
)
dest = None
for line in sys.stdin:
    command = json.loads(line)
    if command[0] == "connect":
        dest = streamer.connect(command[1])
    elif command[0] == "add":
        _, request, src, dst, ticket = command
        streamer.add_request(request, src, len(src) * {BLOCK_TOKENS})
        streamer.set_destination(request, dest, dst, ticket)
    elif command[0] == "layer":
        streamer.layer_ready(command[1], [(r, t) for r, t in command[2]])
    elif command[0] == "outcomes":
        ended = []
        while len(ended) < command[1]:
            ended += streamer.poll()
            time.sleep(0.01)
        print(json.dumps([[o.request_id, o.landed, o.reason] for o in ended]), flush=True)
    elif command[0] == "exit":
        break
streamer.close()
print("closed", flush=True)
"""


class Prefill:
    def __init__(self, host: str):
        env = dict(os.environ, PDHAL_MOONCAKE_HOST=host)
        self.proc = subprocess.Popen(
            [sys.executable, "-c", PREFILL],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
        )

    def send(self, *command) -> None:
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()

    def outcomes(self, count: int) -> dict:
        self.send("outcomes", count)
        line = self.proc.stdout.readline()
        assert line, f"the prefill side exited ({self.proc.wait()})"
        return {request: (landed, reason) for request, landed, reason in json.loads(line)}

    def close(self) -> None:
        if self.proc.poll() is None:
            self.send("exit")
            assert self.proc.stdout.readline().strip() == "closed"
        assert self.proc.wait(timeout=60) == 0
        self.proc.stdin.close()
        self.proc.stdout.close()


@pytest.fixture
def hosts():
    with netns.TwoHosts() as pair:
        yield pair


def test_across_two_network_stacks_every_block_lands_then_a_cut_link_fails_both_sides(hosts):
    decode = Decode(
        "xh-decode",
        "mooncake",
        prefix=hosts.there_prefix,
        env=dict(os.environ, PDHAL_MOONCAKE_HOST=hosts.decode_ip),
    )
    prefill = Prefill(hosts.prefill_ip)
    try:
        assert decode.described["session"].startswith(hosts.decode_ip + ":")
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
