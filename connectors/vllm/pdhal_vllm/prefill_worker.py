"""The prefill half of a worker (kv_producer): per step that stores KV, it opens a pdhal
step, sends the step's table (transfer id, block ids, token range) to its rank's messager,
and after each attention layer posts that layer's pdhal signal; the messager streams the
layer's blocks to the decode sides. A finished request's blocks stay allocated until the
messager says its transfer ended (sent or failed)."""

from __future__ import annotations

import collections
import threading
import time
from typing import TYPE_CHECKING

from vllm.logger import init_logger

from pdhal import ChannelBusyError, ops
from pdhal.transfer import rank_address
from pdhal_vllm.wire import ConnectorError, connect_worker

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

    from pdhal_vllm.metadata import PdhalConnectorMetadata
    from pdhal_vllm.worker import Worker

logger = init_logger(__name__)

#: How many transfers failed for want of a messager its successor is told of.
UNSENT_KEPT = 4096
#: How often a restarted messager is looked for, once this rank's went.
MESSAGER_RETRY_S = 1.0
#: How long a messager that accepted the connection has to answer the hello.
HELLO_S = 30.0


class PrefillWorker:
    def __init__(self, worker: Worker):
        self.w = worker
        address = worker.extra.get("messager")
        if not address:
            raise ConnectorError(
                "a prefill instance needs kv_connector_extra_config "
                "['messager'] = 'HOST:PORT' of its cache messager"
            )
        self.address = rank_address(address, worker.rank)
        #: guards what the messager said (its reader thread writes, the engine's reads)
        self.lock = threading.Lock()
        self.meta = None  # the pdhal step of the current forward, once it stores
        self.sent: dict[str, str | None] = {}  # transfer id -> None (written) or the error
        self.req_of: dict[str, str] = {}  # transfer id -> request id, for stored requests
        self.finished_reqs: set[str] = set()
        #: transfers failed while no messager was there (the newest UNSENT_KEPT)
        self.unsent: collections.deque[str] = collections.deque(maxlen=UNSENT_KEPT)
        self.closing = False
        self.messager = None
        self.messager_alive = False
        self.send_lock = threading.Lock()  # messager and messager_alive change under it only
        ops.set_data_ipc(worker.buffers[0][1], worker.cache_name)
        # the channel exists, with an opening step, before the messager attaches
        try:
            ops.open_shm_and_get_meta_signal(worker.rank, worker.device)
        except ChannelBusyError as exc:
            raise ConnectorError(
                f"another prefill instance on this host signals its layers as rank "
                f"{worker.rank} of device {worker.device} ({exc}): give each prefill instance "
                f"a device of its own (CUDA_VISIBLE_DEVICES; on a CPU host "
                f"PDHAL_CPU_VISIBLE_DEVICES), or a PDHAL_NAMESPACE of its own shared only with "
                f"its decode instances"
            ) from None
        self._connect_messager(timeout=30.0)

    def _connect_messager(self, timeout: float) -> None:
        """Say hello to this rank's messager (the KV cache, its layout), and read what it
        reports on a thread of its own. `timeout`: how long one that refuses connections
        is retried (one that accepted has HELLO_S to answer)."""
        w = self.w
        link = connect_worker(
            self.address,
            w.key,
            {
                "rank": w.rank,
                "ranks": w.ranks,
                "device": w.device,
                "kv_heads": w.kv_heads,
                "cache": w.cache_name,
                "nbytes": w.buffers[0][0].nbytes,
                "layers": [[spec.to_json() for spec in specs] for specs in w.specs],
                "tokens_placed": w.tokens_placed,
                "block_size": w.block_size,
            },
            timeout=timeout,
        )
        try:
            answer = link.receive(HELLO_S)
        except ConnectorError as exc:
            link.close()  # else it would hold the messager for this worker: closed, it is free
            raise ConnectorError(f"the messager for {self.address} went: {exc}") from None
        if answer is None or answer[0] != "ready":
            link.close()
            raise ConnectorError(
                f"the messager for {self.address} refused this prefill worker: "
                + (f"no answer within {HELLO_S:.0f} s" if answer is None else f"{answer[1:]}")
            )
        with self.send_lock:
            self.messager, self.messager_alive = link, True
        with self.lock:  # (those failed from now on are told as they fail)
            self._tell_failed(list(self.unsent))
        threading.Thread(
            target=self._read_messager, args=(link,), name="pdhal-vllm-messager", daemon=True
        ).start()

    # ---- signals ------------------------------------------------------------------------

    def save_layer(self, meta: PdhalConnectorMetadata, index: int, kv_layer) -> None:
        if self.meta is None:
            self._open_step(meta)
        posted = time.monotonic_ns()
        ops.signal_layer_ready(ops.init_signal_layerwise(self.meta, index))
        self.w.trace("signal", step=self.meta.step, layer=index, t=posted)

    def _open_step(self, meta: PdhalConnectorMetadata) -> None:
        """The first layer of a step that stores KV: a new pdhal step, its table first."""
        if not self.messager_alive:
            logger.error(
                "pdhal connector: the cache messager is gone; %d request(s) of this "
                "step will not reach the decode side",
                len(meta.stores),
            )
        self.meta = ops.open_shm_and_get_meta_signal(self.w.rank, self.w.device)
        with self.lock:  # (the messager's reader walks req_of when it goes)
            for store in meta.stores:
                self.req_of[store["tid"]] = store["req"]
            # not a later chunk of a request that ended (failed while no messager was there)
            table = [
                {k: s[k] for k in ("tid", "blocks", "start", "end", "prompt_len")}
                for s in meta.stores
                if s["tid"] not in self.sent
            ]
        self._to_messager("table", self.meta.step, table)
        self.w.trace("table", step=self.meta.step, tids=[s["tid"] for s in table])
        if not self.messager_alive:
            with self.lock:
                for store in meta.stores:
                    self._messager_gone(store["tid"])

    def end_step(self) -> None:
        self.meta = None

    # ---- the messager ---------------------------------------------------------------

    def _read_messager(self, link) -> None:
        """What the messager on `link` reports: each transfer's end. Once it is gone (or
        says what it never says), the transfers it had not ended are released as failed,
        and its successor (a messager restarted at the same address) is looked for every
        MESSAGER_RETRY_S."""
        while True:
            try:
                message = link.receive()
            except ConnectorError:
                break
            kind, *items = message
            if kind == "sent" and len(items) == 1 and isinstance(items[0], str):
                why = None
            elif kind == "failed" and len(items) == 2 and all(isinstance(i, str) for i in items):
                why = items[1]
                logger.error("pdhal connector: transfer %s failed: %s", *items)
            else:
                logger.error("pdhal connector: the messager sent %.80r: not a message", message)
                break
            with self.lock:
                self.sent[items[0]] = why
            self.w.trace(kind, tid=items[0])
        link.close()
        with self.send_lock:
            if self.messager is link:  # (not a successor's, connected meanwhile)
                self.messager_alive = False
        if self.closing:
            return
        logger.error(
            "pdhal connector: the cache messager of rank %d is gone: the requests it "
            "had not written are released, their decode side reports them failed",
            self.w.rank,
        )
        self.w.trace("error", error="messager gone")
        with self.lock:
            for tid in self.req_of:
                if tid not in self.sent:
                    self._messager_gone(tid)
        said = None
        while not self.closing:
            time.sleep(MESSAGER_RETRY_S)
            try:
                self._connect_messager(timeout=MESSAGER_RETRY_S)
            except ConnectorError as exc:  # not back yet: why, each time it changes
                if str(exc) != said:
                    said = str(exc)
                    logger.warning("pdhal connector: no cache messager yet: %s", said)
                    self.w.trace("messager_missing", error=said)
                continue
            logger.warning("pdhal connector: rank %d's cache messager is back", self.w.rank)
            self.w.trace("messager_back")
            return

    def _messager_gone(self, tid: str) -> None:
        """Transfer `tid` failed for want of a messager: its blocks are released, and the
        next messager is told, so a decode rank that claims `tid` there hears so at once.
        (under self.lock)"""
        self.sent[tid] = "the cache messager is gone"
        self.unsent.append(tid)
        self._tell_failed([tid])

    def _tell_failed(self, tids: list[str]) -> None:
        """Tell the messager, if one is there (a successor), of transfers that failed for
        want of one: their decode side may claim them there, and hears so at once."""
        if tids:
            self._to_messager("failed", tids)

    def _to_messager(self, *message) -> None:
        """Send `message` to the messager, if one is there."""
        with self.send_lock:
            if self.messager_alive:
                try:
                    self.messager.send(*message)
                except ConnectorError:
                    self.messager_alive = False
                    self.messager.close()  # its reader ends, and looks for a successor

    def abandon(self, tids: list[str]) -> None:
        """vLLM aborted the requests of transfers `tids`: the messager fails them (and says
        so), so their blocks are freed now. (Without a messager they failed already.)"""
        self._to_messager("abandon", tids)

    def results(self, finished_req_ids: set[str], out: KVConnectorTransferResults) -> None:
        """A finished request is released once its transfer was written or failed."""
        with self.lock:
            self.finished_reqs |= finished_req_ids
            stored = {req: tid for tid, req in self.req_of.items()}
            for req in list(self.finished_reqs):
                tid = stored.get(req)
                if tid is None:
                    self.finished_reqs.discard(req)  # never stored: nothing to wait for
                    continue
                if tid in self.sent:
                    out.finished_sending.add(req)
                    self.finished_reqs.discard(req)
                    del self.sent[tid], self.req_of[tid]

    def shutdown(self) -> None:
        self.closing = True
        if self.messager is not None:
            self.messager.close()
