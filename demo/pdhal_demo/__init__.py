"""`pdhal demo`: prefill worker → cache messager → decode receiver, layer by layer.

A small Paddle model computes a batch of prompts on the prefill worker and posts a pdhal
layer signal after each layer's K/V is written to its paged cache. The cache messager,
woken by those signals, ships each finished layer's blocks to the decode receiver (through
shared memory or Mooncake) while later layers are still being computed. The decode side
verifies every byte against its own recomputation and decodes a few tokens from the
received cache, which must match a single-process reference.

A client of pdhal's public API only, in its own distribution (pdhal-demo). Modules: `cli`
(the `pdhal demo` command, registered in the `pdhal.commands` entry-point group), `model`
(the Paddle model and paged cache), `plan` (requests, blocks, steps), `worker`, `messager`,
`decoder` (the three processes, started as `python -m pdhal_demo.child ROLE`), `transport`
(shm and Mooncake), `control` (the parent's loopback control channel: plans and timing
events; the messagers and the decoder talk through pdhal.transfer's session), `pipeline`
(the parent), `report` (summary, overlap efficiency, plot).
"""

MODES = ("per_query", "per_chunk")
TRANSPORTS = ("shm", "mooncake")
DEFAULT_PROMPTS = "64,96,128,200,256,320,384,512"
