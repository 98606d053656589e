"""The two sides of a transfer, for tests of pdhal.transfer and of transports: source
caches whose every block holds a byte saying which (layer, cache, block) it is, and a
decode process holding a KVReceiver over a transport, driven by lines of JSON, that reports
each outcome with what its caches hold."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import numpy as np

LAYERS, CACHES, BLOCKS, BLOCK_BYTES, BLOCK_TOKENS = 3, 2, 8, 64, 4


def pattern(layer: int, cache: int, block: int) -> int:
    """The byte every source block holds: different per layer, cache and block."""
    return (layer * 61 + cache * 17 + block * 5 + 1) % 251


def source_caches() -> list[list[np.ndarray]]:
    caches = []
    for layer in range(LAYERS):
        row = []
        for cache in range(CACHES):
            a = np.empty((BLOCKS, BLOCK_BYTES), np.uint8)
            for block in range(BLOCKS):
                a[block] = pattern(layer, cache, block)
            row.append(a)
        caches.append(row)
    return caches


DECODE = f"""
import json, sys
import numpy as np
import pdhal
from pdhal import ops, transfer
L, C, B = {LAYERS}, {CACHES}, {BLOCKS}
HEADS, BB, PLANES, ORDER = int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), sys.argv[6]
if sys.argv[8] != "host":  # the simulated runtime's device memory (its test support's)
    import ctypes, importlib, os
    module, support, library = {{
        "cuda": ("pdhal_cuda.testing", "CudaTestSupport", "PDHAL_CUDART"),
        "xpu": ("pdhal_xpu.testing", "XpuTestSupport", "PDHAL_XPURT"),
    }}[pdhal.current_backend()]
    device = getattr(importlib.import_module(module), support)(os.environ[library])
    allocated = []
    def alloc(n):  # "mixed": every other region host memory
        on_device = sys.argv[8] == "device" or len(allocated) % 2 == 0
        allocated.append(device.alloc(n) if on_device else ops.host_alloc(n))
        return allocated[-1]
    free = lambda buffer: None if hasattr(buffer, "data_ptr") else ops.host_free(buffer)
    def view(buffer, shape):  # (a simulated device's memory is this host's)
        if not hasattr(buffer, "data_ptr"):
            return buffer.as_numpy("uint8", shape)
        raw = (ctypes.c_uint8 * buffer.nbytes).from_address(buffer.data_ptr())
        return np.ctypeslib.as_array(raw).reshape(shape)
else:
    alloc, free = ops.host_alloc, ops.host_free
    view = lambda buffer, shape: buffer.as_numpy("uint8", shape)
if sys.argv[7] == "apart":  # each cache a region
    buffers = [[alloc(B * BB) for _ in range(C)] for _ in range(L)]
    caches = [[view(b, (B, BB)) for b in row] for row in buffers]
    specs = [[transfer.CacheSpec(l * C + c, 0, BB, BB, B, HEADS, "", PLANES, ORDER)
              for c in range(C)] for l in range(L)]
elif sys.argv[7] == "blocks":  # a layer's region, each block every cache's: [B, C, BB]
    buffers = [[alloc(B * BB * C)] for _ in range(L)]
    caches = [[view(row[0], (B, C, BB))[:, c] for c in range(C)] for row in buffers]
    specs = [[transfer.CacheSpec(l, c * BB, C * BB, BB, B, HEADS, "", PLANES, ORDER)
              for c in range(C)] for l in range(L)]
elif sys.argv[7] == "halves":  # a layer's region, each cache's blocks in turn: [C, B, BB]
    buffers = [[alloc(C * B * BB)] for _ in range(L)]
    caches = [[view(row[0], (C, B, BB))[c] for c in range(C)] for row in buffers]
    specs = [[transfer.CacheSpec(l, c * B * BB, BB, BB, B, HEADS, "", PLANES, ORDER)
              for c in range(C)] for l in range(L)]
elif sys.argv[7] == "layers":  # one region, each block every layer's caches: [B, L, C, BB]
    buffers = [[alloc(B * L * C * BB)]]
    caches = [[view(buffers[0][0], (B, L, C, BB))[:, l, c] for c in range(C)] for l in range(L)]
    specs = [[transfer.CacheSpec(0, (l * C + c) * BB, L * C * BB, BB, B, HEADS, "", PLANES,
                                 ORDER) for c in range(C)] for l in range(L)]
else:  # a layer's region, each head's part of every cache together: [B, HEADS, C, part]
    PART = BB // HEADS
    buffers = [[alloc(B * BB * C)] for _ in range(L)]
    caches = [[view(row[0], (B, HEADS, C, PART))[:, :, c] for c in range(C)]
              for row in buffers]
    specs = [[transfer.CacheSpec(l, c * PART, C * BB, BB, B, HEADS, "", PLANES, ORDER, C * PART)
              for c in range(C)] for l in range(L)]
for row in caches:
    for c in row:
        c[:] = 0
layout = transfer.CacheLayout([b for row in buffers for b in row], specs)
receiver = transfer.KVReceiver(layout, sys.argv[1], transport_name=sys.argv[2], slots=8)
say = lambda *m: print(json.dumps(m), flush=True)
say("described", receiver.describe())
dump = lambda: {{str(b): [[int(caches[l][c][b].flat[0]) for c in range(C)] for l in range(L)]
                 for b in range(B)}}
for line in sys.stdin:
    command = json.loads(line)
    if command[0] == "expect":
        try:
            say("ticket", receiver.expect(command[1], command[2], layerwise=command[3],
                                          blocks=command[4]))
        except pdhal.PdhalError as e:
            say("ticket", {{"error": f"{{type(e).__name__}}: {{e}}"}})
    elif command[0] == "layers":
        try:
            say("layers", receiver.layers_landed(command[1]), dump())
        except pdhal.PdhalError as e:
            say("layers", None, f"{{type(e).__name__}}: {{e}}")
    elif command[0] == "fill":  # what the engine wrote there: every block, this byte
        for row in caches:
            for c in row:
                c[:] = command[1]
        say("filled")
    elif command[0] == "read":
        say("bytes", caches[command[1]][command[2]][command[3]].reshape(-1).tolist())
    elif command[0] == "wait":
        outcome = receiver.wait(command[1])
        uniform = all(np.unique(caches[l][c][b]).size == 1
                      for l in range(L) for c in range(C) for b in range(B))
        say("outcome", outcome.landed, outcome.reason, dump(), uniform)
    elif command[0] == "outcome":
        outcome = receiver.wait(command[1])
        say("outcome", outcome.landed, outcome.reason, outcome.blocks_free)
    elif command[0] == "freed":
        say("freed", receiver.freed(), dump())
    elif command[0] == "shut":  # close the receiver, the process lives on
        say("shut", [[o.request_id, o.landed, o.blocks_free] for o in receiver.close()])
    elif command[0] == "exit":
        break
receiver.close()
for row in buffers:
    for b in row:
        free(b)
say("closed")
"""


class Decode:
    """A decode process holding a KVReceiver, driven by lines of JSON."""

    def __init__(
        self,
        name: str = "decode",
        transport: str = "shm",
        prefix=(),
        env: dict | None = None,
        *,
        heads: int = 1,
        block_bytes: int = BLOCK_BYTES,
        planes: int = 1,
        order: str = "heads",
        kv: str = "apart",
        memory: str = "host",
    ):
        """`prefix`: a command to run it under (another network namespace); `env`: its
        environment (default: this one's); `heads`: KV heads per block (CacheSpec.heads),
        `planes` per head (CacheSpec.planes), its blocks' `order` (CacheSpec.order); `kv`:
        "apart" (each cache a region of its own), "blocks" (a layer's caches in one region,
        each block every cache's: [blocks, caches, ...]), "halves" (a layer's caches in one
        region, each cache's blocks in turn: [caches, blocks, ...]), "layers" (one region,
        each block every layer's caches: [blocks, layers, caches, ...]) or "together" (a
        layer's caches in one region, each head's part of each cache next to each other,
        [blocks, heads, caches, part]: CacheSpec.head_stride); `memory`: "host"
        (host_alloc), "device" (the simulated runtime's device memory, on a process bound
        to the cuda or xpu backend: its receiver stages it through pinned host memory) or
        "mixed" (every other region device memory, the others host memory)."""
        command = [DECODE, name, transport, str(heads), str(block_bytes), str(planes), order, kv]
        command.append(memory)
        self.proc = subprocess.Popen(
            [*prefix, sys.executable, "-c", *command],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.described = self.read("described")[0]

    def read(self, kind: str):
        line = self.proc.stdout.readline()
        assert line, f"the decode process exited ({self.proc.wait()}) before {kind}"
        message = json.loads(line)
        assert message[0] == kind, message
        return message[1:]

    def send(self, *command):
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()

    def expect(
        self, request_id: str, timeout: float = 30.0, layerwise: bool = False, blocks=None
    ) -> dict:
        """The ticket of KVReceiver.expect (`blocks`: its destination blocks, which a
        receiver that stages needs), or {"error": its type and message}."""
        self.send("expect", request_id, timeout, layerwise, blocks)
        return self.read("ticket")[0]

    def layers(self, request_id: str):
        """(receiver.layers_landed, the dump as wait() gives it), or (None, the error)."""
        self.send("layers", request_id)
        return self.read("layers")

    def layers_until(self, request_id: str, count: int, bound: float = 30.0):
        """Ask until `count` layers of `request_id` landed (or `bound` s): as layers()."""
        deadline = time.monotonic() + bound
        while True:
            landed, dump = self.layers(request_id)
            if landed is None or landed >= count or time.monotonic() > deadline:
                return landed, dump
            time.sleep(0.005)

    def fill(self, value: int) -> None:
        """Write `value` into every byte of its caches (as its engine would: a decode
        side's own blocks, which no transfer may touch)."""
        self.send("fill", value)
        self.read("filled")

    def block(self, layer: int, cache: int, block: int) -> list[int]:
        """Every byte of one block of its caches."""
        self.send("read", layer, cache, block)
        return self.read("bytes")[0]

    def wait(self, request_id: str):
        """(landed, reason, first byte of each block per layer and cache, blocks uniform)."""
        self.send("wait", request_id)
        return self.read("outcome")

    def outcome(self, request_id: str):
        """(landed, reason, blocks_free) of `request_id`, once it ended."""
        self.send("outcome", request_id)
        return self.read("outcome")

    def shut(self) -> list:
        """Close its receiver (the process lives on): [request, landed, blocks_free] of
        each outcome close() returned."""
        self.send("shut")
        return self.read("shut")[0]

    def freed(self):
        """(receiver.freed(), the dump as wait() gives it)."""
        self.send("freed")
        return self.read("freed")

    def close(self):
        if self.proc.poll() is None:
            self.send("exit")
            assert self.read("closed") == []
        assert self.proc.wait(timeout=30) == 0
        self.proc.stdin.close()
        self.proc.stdout.close()

    def stop(self):
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self):
        self.proc.send_signal(signal.SIGCONT)

    def kill(self):
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)
        self.proc.stdin.close()
        self.proc.stdout.close()


def mapped_from(pid: int) -> list[str]:
    """This process's mappings of host_alloc buffers of process `pid` (a decode side's
    caches a link maps)."""
    with open("/proc/self/maps") as maps:
        return [line.split()[-1] for line in maps if f".buf.host.{pid}." in line]


def landed_blocks(dump: dict, dst_block: int) -> list[list[int]]:
    return dump[str(dst_block)]


def expected(src_block: int) -> list[list[int]]:
    return [
        [pattern(layer, cache, src_block) for cache in range(CACHES)] for layer in range(LAYERS)
    ]


def outcomes_until(streamer, count: int, bound: float = 60.0) -> list:
    """The streamer's outcomes, polled until `count` arrived (failing after `bound` s: each
    is promised within far less)."""
    got, deadline = [], time.monotonic() + bound
    while len(got) < count:
        left = deadline - time.monotonic()
        assert left > 0, f"only {got} of {count} outcomes"
        got += streamer.poll(timeout=left)
    return got


def layers_until(streamer, count: int, bound: float = 60.0) -> list:
    """The streamer's layer records once `count` writes settled (their submits run on the
    destination's threads, after layer_ready returned)."""
    deadline = time.monotonic() + bound
    while len(records := streamer.metrics.layers()) < count:
        assert time.monotonic() < deadline, f"only {len(records)} of {count} layers settled"
        time.sleep(0.002)
    return records


#: A prefill process holding a KVStreamer (over the transport argv[1], stall_timeout 2 s),
#: driven by JSON lines: "connect", "add", "layer", "outcomes", "exit".
PREFILL = f"""
import json, sys, time
from pdhal import transfer
from pdhal.testing.transfer_peers import source_caches
streamer = transfer.KVStreamer(
    transfer.CacheLayout.from_caches(source_caches()), {BLOCK_TOKENS},
    transport_name=sys.argv[1], stall_timeout=2.0,
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
            ended += streamer.poll(timeout=60)
        print(json.dumps([[o.request_id, o.landed, o.reason] for o in ended]), flush=True)
    elif command[0] == "exit":
        break
streamer.close()
print("closed", flush=True)
"""


class Prefill:
    """A prefill process holding a KVStreamer of source_caches() over `transport`."""

    def __init__(self, transport: str = "shm", env: dict | None = None):
        self.proc = subprocess.Popen(
            [sys.executable, "-c", PREFILL, transport],
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

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)
        self.proc.stdin.close()
        self.proc.stdout.close()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.send("exit")
            assert self.proc.stdout.readline().strip() == "closed"
        assert self.proc.wait(timeout=60) == 0
        self.proc.stdin.close()
        self.proc.stdout.close()
