"""The decode half of a worker (kv_consumer): vLLM's KV cache behind a pdhal.transfer
KVReceiver, and each load a claim on a pdhal.transfer.DecodeClient, at the prefill
instance's messager (the session protocol: one part per prefill rank holding heads this
rank holds, whatever the two splits). A load's outcome is the client's; with load_mode
"sync" each attention layer waits for that layer only (DecodeClient.layers_landed).

Everything here runs on vLLM's worker thread (the client is thread-safe and calls nothing
back): no lock. A failed async load is reported to vLLM only once nothing can write its
blocks any more (DecodeClient.freed()), so no late write meets blocks vLLM gave to another
request; a sync load's blocks are vLLM's as soon as it fails (load errors, recomputed in
that very step)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from vllm.logger import init_logger

from pdhal import InvalidArgumentError, PdhalError
from pdhal.transfer import DecodeClient, KVReceiver, transport
from pdhal_vllm.wire import ConnectorError

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

    from pdhal_vllm.metadata import PdhalConnectorMetadata
    from pdhal_vllm.worker import Worker

logger = init_logger(__name__)

#: How long a session with a prefill rank's messager may take to make (in the background:
#: a claim never waits on it; a loaded messager's hello can take seconds). One that
#: refuses connections fails the loads that need it at once.
CONNECT_S = 10.0
#: The longest sleep between two looks at a layer's progress (sync loads: a layer's
#: landing rings nothing).
LAYER_POLL_S = 1e-3
#: The first of those sleeps (each next one twice as long, up to LAYER_POLL_S).
FIRST_NAP_S = 50e-6


@dataclass(eq=False)
class _Load:
    """A decode request's KV on its way: the claim of its transfer id."""

    req: str
    tid: str
    sync: bool
    blocks: list[int]
    cached: int  # the prompt's first blocks, in this cache already (a prefix it cached)
    layers: int = 0  # layers landed in every part, from the first
    landed: bool = False
    error: str | None = None
    held: bool = False  # failed while its prefill side may still write its blocks
    went: bool = False  # trace: its claim went ("want"; sessions are made in the background)
    flagged: bool = False  # sync: its blocks were reported as load errors

    @property
    def done(self) -> bool:
        return self.landed or self.error is not None


class DecodeWorker:
    def __init__(self, worker: Worker):
        self.w = worker
        name = worker.extra["transport"]
        try:
            transport(name).configure(**worker.extra["transport_options"])
            self.receiver = KVReceiver(
                worker.cache_layout(), worker.cache_name, transport_name=name
            )
        except PdhalError as exc:
            raise ConnectorError(f"the decode worker cannot receive over {name!r}: {exc}") from None
        self.client = DecodeClient(
            self.receiver,
            key=worker.key,
            block_tokens=worker.block_size,
            kv_heads=worker.kv_heads,
            tp_rank=worker.rank,
            tp_size=worker.ranks,
            connect_timeout=CONNECT_S,
            keepalive=float(worker.extra["keepalive_s"]),
        )
        self.timeout = float(worker.extra["load_timeout_s"])
        self.idle_wait = float(worker.extra["idle_wait_s"])
        self.loads: dict[str, _Load] = {}  # vLLM's request id -> its load, until reported
        self.claims: dict[str, _Load] = {}  # transfer id -> its load, until its outcome
        self.held: dict[str, _Load] = {}  # transfer id -> a failed load whose blocks are held
        self.step_loads: list[_Load] = []  # sync: this step's
        self.load_error_blocks: set[int] = set()

    def start_load(self, meta: PdhalConnectorMetadata) -> None:
        """Claim each new load (and tell the prefill side of those cached here already);
        stop the loads vLLM finished meanwhile."""
        w = self.w
        self.step_loads = []
        for req in meta.cancelled:
            load = self.loads.get(req)
            if load is not None and not load.done:
                w.trace("cancelled", tid=load.tid)
                self.client.cancel(load.tid)
        for spec in meta.unneeded:
            whole = -(-spec["num_tokens"] // w.block_size)
            try:
                self.client.claim(
                    spec["tid"],
                    spec["messager"],
                    [],
                    tokens=spec["num_tokens"],
                    timeout=self.timeout,
                    cached_blocks=whole,
                )
                w.trace("unneeded", tid=spec["tid"])
            except PdhalError as exc:  # its prefill side's claim lease frees the blocks
                logger.error("pdhal connector: %s", exc)
        for spec in meta.loads:
            cached = spec["first_token"] // w.block_size
            whole = -(-spec["num_tokens"] // w.block_size)
            load = _Load(spec["req"], spec["tid"], spec["sync"], spec["blocks"], cached)
            self.loads[load.req] = load
            if load.sync:
                self.step_loads.append(load)
            try:
                self.client.claim(
                    load.tid,
                    spec["messager"],
                    load.blocks[cached:whole],
                    tokens=spec["num_tokens"],
                    timeout=self.timeout,
                    cached_blocks=cached,
                    layerwise=load.sync or w.trace.on,
                )
            except PdhalError as exc:
                self._fail(load, str(exc))
                continue
            self.claims[load.tid] = load
        self._trace_claims()

    def _trace_claims(self) -> None:
        """trace: "want" once a load's claim went (the client makes its sessions in the
        background)."""
        if not self.w.trace.on:
            return
        unsent = set(self.client.unsent())
        for load in self.claims.values():
            if load.tid not in unsent:
                self._went(load)

    def _went(self, load: _Load) -> None:
        if not load.went:
            load.went = True
            self.w.trace("want", tid=load.tid, req=load.req)

    def _collect(self, wait: float = 0.0) -> None:
        """The client's outcomes, and the held loads it freed; with nothing to report,
        after waiting up to `wait` s for a word that something may be (DecodeClient.poll)."""
        for outcome in self.client.poll(timeout=wait):
            load = self.claims.pop(outcome.request_id, None)
            if load is None:
                continue  # (a claim of blocks cached here)
            if outcome.landed:
                self._went(load)  # (its claim went, if it was not seen going)
                self._landed(load, self.w.num_layers)
                load.landed = True
            else:
                self._fail(load, outcome.reason)
                if not outcome.blocks_free:
                    load.held = True
                    self.held[load.tid] = load
        for tid in self.client.freed():
            load = self.held.pop(tid, None)
            if load is not None:
                load.held = False

    def _progress(self, load: _Load) -> None:
        """How many layers of `load` landed (its status slots)."""
        if load.done:
            return
        try:
            layers = self.client.layers_landed(load.tid)
        except InvalidArgumentError:
            return  # its outcome is the client's poll's: _collect ends it
        self._landed(load, layers)

    def _landed(self, load: _Load, layers: int) -> None:
        for layer in range(load.layers, layers):
            self.w.trace("landed", tid=load.tid, layer=layer)
        load.layers = max(load.layers, layers)

    def _fail(self, load: _Load, why: str) -> None:
        if load.done:
            return
        load.error = why
        logger.error("pdhal connector: loading request %s failed: %s", load.req, why)
        self.w.trace("load_failed", tid=load.tid, error=why)

    def wait_layer(self, index: int) -> None:
        """Sync loads: return once layer `index` of each of this step's loads is in the
        cache, or its load failed (its blocks then go to vLLM as load errors)."""
        for load in self.step_loads:
            nap = FIRST_NAP_S
            while not load.done and load.layers <= index:
                self._collect()
                self._progress(load)
                if load.done or load.layers > index:
                    break
                time.sleep(nap)  # bounded: the receiver fails the load by its timeout
                nap = min(2 * nap, LAYER_POLL_S)
            if load.error is not None and not load.flagged:
                load.flagged = True
                self.load_error_blocks.update(load.blocks[load.cached :])

    def results(self, out: KVConnectorTransferResults, idle: bool = False) -> None:
        """The async loads that ended (landed, or failed with their blocks free) go to
        vLLM; sync ones were reported per layer (load_errors). In an `idle` step, first
        wait for one to end (_await_a_load)."""
        self._collect()
        if idle:
            self._await_a_load()
        self._trace_claims()
        if self.w.trace.on:  # each layer of an async load as it lands
            for load in [x for x in self.loads.values() if not x.done]:
                self._progress(load)
        for req, load in list(self.loads.items()):
            if not load.done or (load.held and not load.sync):
                continue
            del self.loads[req]
            if load.sync:
                continue
            out.finished_recving.add(req)
            if load.error is not None:
                out.failed_recving.add(req)

    def _await_a_load(self) -> None:
        """vLLM scheduled nothing this step, and returning now would only start another
        empty one (the engine steps while any request waits for its KV): return once an
        async load can be reported, or after idle_wait_s, which bounds what a request
        arriving meanwhile waits. The wait sleeps until the client hears that a load may
        have ended (the prefill side's word that a part ended, a session's end): no nap
        loop, and a landing is noticed as its word comes."""
        waiting = [x for x in self.loads.values() if not x.sync]
        if not waiting or any(x.done and not x.held for x in waiting):
            return  # nothing to wait for, or something to report now
        deadline = time.monotonic() + self.idle_wait
        while (left := deadline - time.monotonic()) > 0:
            self._collect(wait=left)
            if any(x.done and not x.held for x in waiting):
                return

    def load_errors(self) -> set[int]:
        errors, self.load_error_blocks = self.load_error_blocks, set()
        return errors

    def shutdown(self) -> None:
        self.client.close()
        try:
            self.receiver.close()
        except PdhalError:
            pass
