"""FastDeploy-shaped scaffolding for tests/fastdeploy/test_fastdeploy_signals.py: the schedule of
waves and chunks, the C attention op (tests/c/attention_op.c) and its device, FastDeploy-shaped
attention backends and a prefill worker, and the messager process that checks every layer.
The test module says what is tested; this one is how FastDeploy's code is imitated."""

from __future__ import annotations

import array
import contextlib
import ctypes
import json
import os
import subprocess
import sys
from dataclasses import dataclass, field

import numpy as np
from simulators import DeviceTensor, SimRuntime

import pdhal
from pdhal import ops
from pdhal._protocol import core as _core
from pdhal.compat import fastdeploy as fd

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/
RUNTIMES = {
    "cuda": ("PDHAL_CUDART", "libcudart_sim.so", "gpu:0"),
    "xpu": ("PDHAL_XPURT", "libxpurt.so", "xpu:0"),
}

NUM_LAYERS, NUM_LAYERS_DRAFT = 6, 1  # the main model; the MTP draft (FastDeploy: 1 for mtp)
LAYERS = NUM_LAYERS + NUM_LAYERS_DRAFT
BATCH, BLOCK_TOKENS, CHUNK_TOKENS = 3, 8, 16
#: Prompt lengths of each wave of requests, one per batch slot: 20 prefill steps, more than
#: a per-chunk ring holds (16), so the producer also waits for the messager.
WAVES = ((40, 24, 56), (16, 48, 32), (56, 8, 40), (24, 40, 16), (32, 56, 48))
WRITE_DELAY_US = 300  # each K/V write lands this long after the stream reaches it
RANK, DEVICE_ID = 1, 3  # per query names (rank, device_id); per chunk (rank, device 0)
DRAIN_TIMEOUT_NS = 30_000_000_000

# Shared by the producer (this process) and the messager (a child): what the op writes.
COMMON = r'''
import struct
BLOCK_BYTES = 128  # one block of one layer's K (or V) cache


def block_pattern(layer, kv, block):
    """The bytes the op writes into `block` of `layer`'s K (kv 0) or V (kv 1) cache."""
    return struct.pack("<IHBB", block, layer, kv, 0xA5) * (BLOCK_BYTES // 8)


def cache_name(kv, layer, rank, device_id):
    """FastDeploy's names of the caches a worker shares with its cache messager."""
    return f"{('key', 'value')[kv]}_caches_{layer}_rank{rank}.device{device_id}"
'''
_common: dict = {}
exec(COMMON, _common)
BLOCK_BYTES, block_pattern, cache_name = (
    _common[name] for name in ("BLOCK_BYTES", "block_pattern", "cache_name")
)


def make_schedule() -> tuple[list[dict], int]:
    """The prefill instance's steps and the cache's block count. A step: its seq_lens_*
    (one entry per batch slot) and its chunks [slot, cached tokens, chunk tokens, first
    block]; a decode-only step has no chunk."""
    steps, next_block = [], 0
    for wave in WAVES:
        bases = []
        for prompt in wave:
            bases.append(next_block)
            next_block += prompt // BLOCK_TOKENS
        done = [0] * BATCH
        while any(d < p for d, p in zip(done, wave)):
            step = {"encoder": [], "this_time": [], "decoder": [], "chunks": []}
            for slot, prompt in enumerate(wave):
                chunk = min(CHUNK_TOKENS, prompt - done[slot])
                step["chunks"] += (
                    [[slot, done[slot], chunk, bases[slot] + done[slot] // BLOCK_TOKENS]]
                    if chunk
                    else []
                )
                step["encoder"].append(chunk)
                step["this_time"].append(chunk or 1)  # a slot done prefilling decodes
                step["decoder"].append(done[slot])
                done[slot] += chunk
            steps.append(step)
        steps.append(
            {
                "encoder": [0] * BATCH,
                "this_time": [1] * BATCH,
                "decoder": [p + 1 for p in wave],
                "chunks": [],
            }
        )
    return steps, next_block


STEPS, BLOCKS = make_schedule()
PREFILL_STEPS = [i + 1 for i, step in enumerate(STEPS) if step["chunks"]]  # step numbers


# ---- the C op --------------------------------------------------------------------------


class KVWrite(ctypes.Structure):
    _fields_ = [("dst", ctypes.c_void_p), ("src", ctypes.c_void_p), ("bytes", ctypes.c_uint64)]


_built: dict[str, str] = {}


def build_op(kind: str, runtime_path: str, folder) -> str:
    """tests/c/attention_op.c for `kind`, built as an engine builds its op: the installed
    header, pdhal.get_library() (the core pdhal's Python shares) and the runtime's .so."""
    if kind not in _built:
        library = str(folder / f"libattention_op_{kind}.so")
        subprocess.run(
            [
                "gcc",
                "-shared",
                "-fPIC",
                "-O2",
                "-Wall",
                "-Wextra",
                "-Werror",
                f"-DATTENTION_OP_{kind.upper()}",
                f"-I{pdhal.get_include()}",
                "-o",
                library,
                os.path.join(TESTS, "c", "attention_op.c"),
                pdhal.get_library(),
                runtime_path,
                "-lpthread",
            ],
            check=True,
        )
        _built[kind] = library
    return _built[kind]


class AttentionOp:
    """The op library as its Python binding calls it: a tensor argument goes in as its data
    pointer (what the C++ op gets from tensor.data<int64_t>())."""

    def __init__(self, kind: str, path: str):
        self.kind = kind
        lib, holding_gil = ctypes.CDLL(path), ctypes.PyDLL(path)
        P, Int, W = ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(KVWrite)
        signatures = {"gate_new": (P, []), "gate_close": (Int, [P, P]), "gate_free": (None, [P])}
        if kind == "cuda":
            signatures.update(
                attention_cuda_per_query=(Int, [P, W, Int, ctypes.c_uint32, P]),
                attention_cuda_per_chunk=(Int, [P, W, Int, ctypes.c_uint32]),
                attention_cuda_unchecked=(Int, [P, P]),
            )
        else:
            signatures.update(
                attention_xpu_per_query=(Int, [P, W, Int, ctypes.c_uint32, P, P]),
                attention_xpu_per_chunk=(Int, [P, W, Int, ctypes.c_uint32, P]),
                attention_xpu_post_line=(Int, [P, P, P]),
            )
        for name, (restype, argtypes) in signatures.items():
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = restype, argtypes
        self.lib = lib
        #: Called holding the GIL (ctypes.PyDLL): see attention_op.c.
        self.gate_open_and_drain = holding_gil.gate_open_and_drain
        self.gate_open_and_drain.restype = Int
        self.gate_open_and_drain.argtypes = [P, P, P, ctypes.c_int64]
        core = ctypes.CDLL(pdhal.get_library())
        self._last_error = core.pdhal_last_error
        self._last_error.restype = ctypes.c_char_p

    def per_query(
        self, stream: int, writes, kv_signal_data: int | None, sender_words: int | None = None
    ) -> int:
        if self.kind == "cuda":
            return self.lib.attention_cuda_per_query(
                stream, writes, len(writes), WRITE_DELAY_US, kv_signal_data
            )
        return self.lib.attention_xpu_per_query(
            stream, writes, len(writes), WRITE_DELAY_US, kv_signal_data, sender_words
        )

    def per_chunk(self, stream: int, writes, sender_words: int | None = None) -> int:
        if self.kind == "cuda":
            return self.lib.attention_cuda_per_chunk(stream, writes, len(writes), WRITE_DELAY_US)
        return self.lib.attention_xpu_per_chunk(
            stream, writes, len(writes), WRITE_DELAY_US, sender_words
        )

    def last_error(self) -> str:
        """pdhal_last_error() of this thread: ctypes calls run on the calling thread."""
        return self._last_error().decode()


@dataclass
class Device:
    kind: str
    sim: SimRuntime
    op: AttentionOp

    def stream(self) -> int:
        return self.sim.stream()

    def live_events(self) -> int:
        return self.sim.lib.sim_live_events()


# ---- kernel-form words an engine drops right after the launch ------------------------

_libc = ctypes.CDLL(None)
_libc.malloc.restype, _libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
_libc.free.restype, _libc.free.argtypes = None, [ctypes.c_void_p]


class DroppedWords:
    """Kernel-form words in memory from libc's malloc, for one launch: overwritten and
    freed right after it. Under ASan (make sanitize) a later read is a use-after-free;
    without it a later read sees garbage, which pdhal would refuse (and the layer would go
    missing)."""

    def __init__(self, words):
        self.address = _libc.malloc(8 * _core.KERNEL_WORDS)
        assert self.address
        ctypes.memmove(self.address, array.array("q", words).tobytes(), 8 * _core.KERNEL_WORDS)

    def drop(self) -> None:
        ctypes.memset(self.address, 0xA5, 8 * _core.KERNEL_WORDS)
        _libc.free(self.address)
        self.address = None


# ---- the producer: FastDeploy's attention backend and model runner, reduced ------------


@dataclass
class ForwardMeta:
    seq_lens_encoder: object
    seq_lens_this_time: object
    seq_lens_decoder: object
    kv_signal_sender: object = None
    #: test side: the step's chunks, [slot, cached tokens, chunk tokens, first block]
    chunks: list = field(default_factory=list)
    step: int = 0


@dataclass
class Layer:
    layer_id: int


class Metadata:
    kv_signal_metadata = None
    kv_signal_data_list: list


class AttentionBackend:
    """The signal handling of FastDeploy's AppendAttentionBackend / XPUAttentionBackend:
    init_attention_metadata once per forward pass, forward_mixed per layer."""

    def __init__(
        self, worker: PrefillWorker, num_layers: int, *, mtp_draft: bool, start_layer_index: int
    ):
        self.worker = worker
        self.keep_pd_step_flag = mtp_draft  # speculative model_type == "mtp"
        self.num_layers_draft_model = NUM_LAYERS_DRAFT  # int(method in ["mtp"])
        self.num_layers = num_layers
        self.start_layer_index = start_layer_index
        self.pd_disaggregation_mode = worker.mode
        self.rank, self.device_id = worker.rank, str(worker.device_id)  # a string there
        self.metadata = Metadata()

    def init_attention_metadata(self, forward_meta: ForwardMeta) -> None:
        metadata = self.metadata = Metadata()
        metadata.kv_signal_data_list = [None] * self.num_layers
        if self.pd_disaggregation_mode == "per_chunk":
            if not self.keep_pd_step_flag:
                fd.init_kv_signal_per_query(
                    forward_meta.seq_lens_encoder,
                    forward_meta.seq_lens_this_time,
                    forward_meta.seq_lens_decoder,
                    self.rank,
                    self.num_layers + self.num_layers_draft_model,
                )
        elif self.pd_disaggregation_mode == "per_query":
            metadata.kv_signal_metadata = fd.open_shm_and_get_meta_signal(
                self.rank, int(self.device_id), self.keep_pd_step_flag
            )

    def forward_mixed(self, layer: Layer, forward_meta: ForwardMeta) -> None:
        metadata = self.metadata
        if self.pd_disaggregation_mode == "per_query":
            metadata.kv_signal_data_list[layer.layer_id] = self.worker.flavor.signal(
                metadata.kv_signal_metadata, layer.layer_id + self.start_layer_index
            )
        self.worker.append_attention(
            forward_meta,
            layer.layer_id + self.start_layer_index,
            metadata.kv_signal_data_list[layer.layer_id],
        )
        if self.worker.flavor.drops:  # the engine lets the tensor go right after the launch
            metadata.kv_signal_data_list[layer.layer_id] = None


class Kept:
    """pdhal.compat.fastdeploy as FastDeploy uses it: kernel forms are Paddle CPU tensors,
    kept in kv_signal_data_list until the next step."""

    drops = False

    def __init__(self):
        import paddle

        self.paddle = paddle

    def seq_lens(self, values):
        return self.paddle.to_tensor(np.asarray(values, np.int32), place=self.paddle.CPUPlace())

    def signal(self, meta, layer_id: int):
        return fd.init_signal_layerwise(meta, layer_id)

    def create_kv_signal_sender(self):
        return fd.create_kv_signal_sender()

    def destroy_kv_signal_sender(self, sender) -> None:
        fd.destroy_kv_signal_sender(sender)

    @contextlib.contextmanager
    def words(self, tensor):
        yield None if tensor is None else tensor.data_ptr()

    def step_start(self, worker, forward_meta) -> None:
        pass

    def step_end(self, worker, forward_meta) -> None:
        pass


class Dropped:
    """No Paddle: the kernel forms are the ops-level words (array.array), copied into
    malloc'd memory for each launch, overwritten and freed right after it (the list entry
    dropped too); the step's seq_lens arrays are overwritten once the step is published. A
    gate holds the stream for the whole step, so every post runs after all that; the gate
    opens from C holding the GIL."""

    drops = True

    def __init__(self):
        self.gate = None

    def seq_lens(self, values):
        return np.asarray(values, np.int32)

    def signal(self, meta, layer_id: int):
        return ops.init_signal_layerwise(meta, layer_id).kernel_form

    def create_kv_signal_sender(self):
        return ops.create_kv_signal_sender()  # bound at call time: the backend of the test

    def destroy_kv_signal_sender(self, sender) -> None:
        ops.destroy_kv_signal_sender(sender)

    @contextlib.contextmanager
    def words(self, form):
        if form is None:
            yield None
            return
        if not isinstance(form, array.array):
            form = form.kernel_form  # a sender
        scratch = DroppedWords(form)
        try:
            yield scratch.address
        finally:
            scratch.drop()

    def step_start(self, worker, forward_meta) -> None:
        self.gate = worker.op.lib.gate_new()
        assert worker.op.lib.gate_close(self.gate, worker.stream) == 0

    def step_end(self, worker, forward_meta) -> None:
        """Nothing of this step is visible while the gate holds the stream; then open it
        and wait, holding the GIL, until every post of the step has run."""
        if worker.mode == "per_query" and forward_meta.chunks:
            if worker.reader is None:  # this process's view (the channel exists by now)
                worker.reader = ops.open_kv_signal_reader(worker.rank, worker.device_id)
            assert worker.reader.current() == (forward_meta.step, -1)
        sender = forward_meta.kv_signal_sender
        words = None if sender is None else np.frombuffer(sender.kernel_form, np.int64)
        rc = worker.op.gate_open_and_drain(
            self.gate, worker.stream, None if words is None else words.ctypes.data, DRAIN_TIMEOUT_NS
        )
        assert rc == 0, f"the posts of step {forward_meta.step} did not run: {rc}"
        worker.op.lib.gate_free(self.gate)
        if worker.mode == "per_query" and forward_meta.chunks:
            assert worker.reader.current() == (forward_meta.step, LAYERS - 1)


class PrefillWorker:
    """A prefill instance's worker: its KV caches (device memory, shared by FastDeploy's
    names), one stream, the main model and its MTP draft, the C op."""

    def __init__(self, device: Device, mode: str, flavor):
        self.device, self.op, self.mode, self.flavor = device, device.op, mode, flavor
        self.rank = RANK
        self.device_id = DEVICE_ID if mode == "per_query" else 0
        self.stream = device.stream()
        nbytes = BLOCKS * BLOCK_BYTES
        self.caches = [[device.sim.malloc(nbytes) for _ in range(LAYERS)] for _ in (0, 1)]
        for kv in (0, 1):
            for layer in range(LAYERS):
                fd.set_data_ipc(
                    DeviceTensor(self.caches[kv][layer], nbytes, RUNTIMES[device.kind][2]),
                    cache_name(kv, layer, self.rank, self.device_id),
                )
        self.main = AttentionBackend(self, NUM_LAYERS, mtp_draft=False, start_layer_index=0)
        self.draft = AttentionBackend(
            self, NUM_LAYERS_DRAFT, mtp_draft=True, start_layer_index=NUM_LAYERS
        )
        self.reader = None  # per query with a gate: this process's view of the progress

    @contextlib.contextmanager
    def kv_signal_sender_context_manager(self):
        """The newer xpu_model_runner's: a sender per step, destroyed at its end (the GPU
        runner has none: cudaLaunchHostFunc does the job)."""
        sender = None
        if self.device.kind == "xpu" and self.mode in ("per_chunk", "per_query"):
            sender = self.flavor.create_kv_signal_sender()
        try:
            yield sender
        finally:
            if sender is not None:
                self.flavor.destroy_kv_signal_sender(sender)

    def execute_model(self, step: int) -> None:
        """One forward pass: the main model, then the MTP draft model."""
        schedule = STEPS[step - 1]
        with self.kv_signal_sender_context_manager() as sender:
            forward_meta = ForwardMeta(
                self.flavor.seq_lens(schedule["encoder"]),
                self.flavor.seq_lens(schedule["this_time"]),
                self.flavor.seq_lens(schedule["decoder"]),
                kv_signal_sender=sender,
                chunks=schedule["chunks"],
                step=step,
            )
            self.flavor.step_start(self, forward_meta)
            for backend in (self.main, self.draft):
                backend.init_attention_metadata(forward_meta)
                if self.flavor.drops:  # published: the engine may reuse its step buffers
                    for name in ("seq_lens_encoder", "seq_lens_this_time", "seq_lens_decoder"):
                        getattr(forward_meta, name)[:] = -1
                for layer_id in range(backend.num_layers):
                    backend.forward_mixed(Layer(layer_id), forward_meta)
            self.flavor.step_end(self, forward_meta)

    def append_attention(self, forward_meta: ForwardMeta, layer: int, kv_signal_data) -> None:
        """The op, on the encoder write path only (a decode-only step posts nothing)."""
        if not forward_meta.chunks:
            return
        sources, writes = [], []
        for _slot, _cached, chunk, first in forward_meta.chunks:
            for kv in (0, 1):
                data = b"".join(
                    block_pattern(layer, kv, block)
                    for block in range(first, first + chunk // BLOCK_TOKENS)
                )
                sources.append(ctypes.create_string_buffer(data, len(data)))
                writes.append(
                    KVWrite(
                        self.caches[kv][layer] + first * BLOCK_BYTES,
                        ctypes.addressof(sources[-1]),
                        len(data),
                    )
                )
        writes = (KVWrite * len(writes))(*writes)
        with (
            self.flavor.words(kv_signal_data) as signal,
            self.flavor.words(forward_meta.kv_signal_sender) as sender,
        ):
            if self.mode == "per_query":
                rc = self.op.per_query(self.stream, writes, signal, sender)
            else:
                rc = self.op.per_chunk(self.stream, writes, sender)
        assert rc == 0, f"the op failed at layer {layer}: {rc} ({self.op.last_error()})"

    def synchronize(self) -> None:
        ops.synchronize(self.stream)


# ---- the messager: FastDeploy's CacheMessager (per query) / CacheMessagerV1 (per chunk) -

MESSAGER = (
    COMMON
    + r'''
import ctypes, json, sys, time
import numpy as np
from pdhal import ops
from pdhal.compat import fastdeploy as fd

cfg = json.loads(sys.argv[1])
mode, rank, device_id, layers, steps = (cfg["mode"], cfg["rank"], cfg["device_id"],
                                        cfg["layers"], cfg["steps"])
if cfg["paddle"]:
    import paddle
    paddle.device.set_device("cpu")
like = np.zeros((), np.uint8)
caches = [[fd.share_external_data(like, cache_name(kv, layer, rank, device_id),
                                  [cfg["blocks"], BLOCK_BYTES], timeout=60).address
           for layer in range(layers)] for kv in (0, 1)]


def check_layer(step, layer):
    """Every block the chunks of `step` wrote into `layer`'s K and V caches holds its bytes
    (the cache is zero until the op's write lands)."""
    for slot, cached, chunk, first in steps[step - 1]["chunks"]:
        for kv in (0, 1):
            for block in range(first, first + chunk // cfg["block_tokens"]):
                got = ctypes.string_at(caches[kv][layer] + block * BLOCK_BYTES, BLOCK_BYTES)
                if got != block_pattern(layer, kv, block):
                    raise AssertionError(
                        f"step {step} layer {layer} was signalled before its bytes: block "
                        f"{block} of its {'KV'[kv]} cache holds {got[:8].hex()}...")


sent = []  # (step, layer) in the order the messager would send them
if mode == "per_query":
    # CacheMessager: (step, layer) progress. pdhal's ProgressReader replaces the two int32
    # shm words: one word, and a wait instead of a 1 ms poll.
    prefill = [i + 1 for i, s in enumerate(steps) if s["chunks"]]
    seen = []
    print("ready", flush=True)  # the caches are mapped; the channel comes with step 1
    with ops.open_kv_signal_reader(rank, device_id, timeout=60) as reader:
        since = (0, -1)
        while prefill:
            step, layer = since = reader.wait(since, timeout=60)
            seen.append([step, layer])
            if layer < 0:
                continue  # a step began (decode-only steps show nothing else)
            assert step == prefill[0], f"layer {layer} of step {step}, expected step {prefill}"
            first = sent[-1][1] + 1 if sent and sent[-1][0] == step else 0
            assert layer >= first, (step, layer, sent[-3:])
            for l in range(first, layer + 1):  # send layers [layer_idx, layer + 1)
                check_layer(step, l)
                sent.append([step, l])
            if layer == layers - 1:
                prefill.pop(0)
                print(f"done {step}", flush=True)
    print(json.dumps({"sent": sent, "seen": seen}), flush=True)
else:
    # CacheMessagerV1: get_output_kv_signal on an int32 [512 * 3 + 2] CPU tensor; a record
    # with layer 0 begins a step's chunk.
    wait_flag = cfg["wait_flag"]
    if cfg["paddle"]:
        kv_signal_data = paddle.full(shape=[512 * 3 + 2], fill_value=-1, dtype="int32")
        values = lambda: kv_signal_data.numpy()
    else:
        kv_signal_data = np.full(512 * 3 + 2, -1, np.int32)
        values = lambda: kv_signal_data
    expected = [(i + 1, layer) for i, s in enumerate(steps) if s["chunks"]
                for layer in range(layers)]
    print("ready", flush=True)
    deadline = time.monotonic() + 120
    while len(sent) < len(expected):
        fd.get_output_kv_signal(kv_signal_data, rank, wait_flag, timeout=5)
        x = values()
        tasks_count = int(x[0])
        if tasks_count == -1:
            assert time.monotonic() < deadline, f"no record after {sent[-1:]}"
            if not wait_flag:
                time.sleep(0.001)  # CacheMessagerV1's poll; correctness does not hang on it
            continue
        layer_id = int(x[1])
        step, want_layer = expected[len(sent)]
        triples = [[int(v) for v in x[2 + 3 * i:5 + 3 * i]] for i in range(tasks_count)]
        want = [chunk[:3] for chunk in steps[step - 1]["chunks"]]
        assert (layer_id, triples) == (want_layer, want), \
            f"record {len(sent)}: layer {layer_id} {triples}, expected step {step} layer " \
            f"{want_layer} {want}"
        check_layer(step, layer_id)
        sent.append([step, layer_id])
    print("all", flush=True)
    assert sys.stdin.readline() == "end\n"  # the producer's stream has run every post
    fd.get_output_kv_signal(kv_signal_data, rank, 0)
    assert int(values()[0]) == -1, "a record came twice, or one too many"
    print(json.dumps({"sent": sent}), flush=True)
'''
)


def start_messager(worker: PrefillWorker, paddle: bool, wait_flag: int = 1) -> subprocess.Popen:
    config = {
        "mode": worker.mode,
        "rank": worker.rank,
        "device_id": worker.device_id,
        "layers": LAYERS,
        "steps": STEPS,
        "blocks": BLOCKS,
        "paddle": paddle,
        "wait_flag": wait_flag,
        "block_tokens": BLOCK_TOKENS,
    }
    messager = subprocess.Popen(
        [sys.executable, "-c", MESSAGER, json.dumps(config)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert messager.stdout.readline() == "ready\n", "the messager did not start"
    return messager


def run_steps(worker: PrefillWorker, messager: subprocess.Popen) -> dict:
    """Every step of the schedule, then the messager's report. Per query the worker waits,
    after each prefill step, for the messager to have sent its last layer (so no step's
    last layer is overtaken by the next step's start); per chunk the ring holds steps, and
    the worker only waits for it when the ring is full."""
    try:
        for step in range(1, len(STEPS) + 1):
            worker.execute_model(step)
            if worker.mode == "per_query" and step in PREFILL_STEPS:
                line = messager.stdout.readline()
                assert line == f"done {step}\n", f"step {step}: the messager said {line!r}"
        worker.synchronize()
        if worker.mode == "per_chunk":
            assert messager.stdout.readline() == "all\n"
            messager.stdin.write("end\n")
            messager.stdin.flush()
        report = json.loads(messager.stdout.readline())
        assert messager.wait(timeout=60) == 0
    finally:
        if messager.poll() is None:
            messager.kill()
            messager.wait()
    assert report["sent"] == [[step, layer] for step in PREFILL_STEPS for layer in range(LAYERS)]
    if worker.mode == "per_query":
        seen = [tuple(word) for word in report["seen"]]
        assert seen == sorted(set(seen)), "progress went back"
    return report
