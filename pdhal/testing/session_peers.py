"""The two sides of a session (pdhal.transfer.PrefillService, DecodeClient) as processes,
for tests: `python -m pdhal.testing.session_peers prefill|decode [options]`, driven by JSON
lines on stdin, answering JSON lines on stdout. A Peer runs one and talks to it.

The model has KV_HEADS heads of HEAD_BYTES bytes per block, LAYERS layers of CACHES caches
(K and V) of BLOCKS blocks, split over a rank's tensor-parallel share of the heads. Every
byte of a prefill block holds value(layer, cache, block, head) for the model's head, so a
decode side can say, head by head, what landed where."""

from __future__ import annotations

import argparse
import json
import os
import selectors
import signal
import subprocess
import sys
import threading
import time

LAYERS, CACHES, BLOCKS, KV_HEADS, HEAD_BYTES, BLOCK_TOKENS = 3, 2, 8, 4, 16, 4
KEY = b"pdhal-session-test-key"


def value(layer: int, cache: int, block: int, head: int) -> int:
    """The byte of a prefill block: different per layer, cache, block and model head."""
    return (layer * 61 + cache * 17 + block * 5 + head * 29 + 1) % 251


def _caches(rank: int, size: int, head_bytes: int, fill: bool, dtype: str = ""):
    """This rank's caches (host memory) and their layout, each block head-major, of
    element type `dtype` (CacheSpec.dtype)."""
    from pdhal import ops, transfer

    heads = transfer.rank_heads(KV_HEADS, size, rank)
    block = len(heads) * head_bytes
    buffers = [ops.host_alloc(BLOCKS * block) for _ in range(LAYERS * CACHES)]
    arrays = [b.as_numpy("uint8", (BLOCKS, len(heads), head_bytes)) for b in buffers]
    for layer in range(LAYERS):
        _compute(arrays, heads, layer, fill)
    layout = transfer.CacheLayout(
        buffers,
        [
            [
                transfer.CacheSpec(layer * CACHES + c, 0, block, block, BLOCKS, len(heads), dtype)
                for c in range(CACHES)
            ]
            for layer in range(LAYERS)
        ],
    )
    return layout, arrays, heads


def _compute(arrays, heads, layer: int, fill: bool = True) -> None:
    """Write `layer` of every cache, each block's bytes value(...) (or zeros)."""
    for cache in range(CACHES):
        array = arrays[layer * CACHES + cache]
        for b in range(BLOCKS):
            for local, head in enumerate(heads):
                array[b, local] = value(layer, cache, b, head) if fill else 0


_SAY = threading.Lock()


def _say(*message) -> None:
    """One line to the test (whole: outcomes are said on the service's thread)."""
    with _SAY:
        sys.stdout.write(json.dumps(message) + "\n")
        sys.stdout.flush()


def _prefill(args) -> None:
    from pdhal import ops, transfer

    # --blank: its layers computed by "signal" commands, as an engine's steps compute them
    layout, arrays, heads = _caches(
        args.tp_rank, args.tp_size, args.head_bytes, not args.blank, args.dtype
    )
    meta = reader = None
    service = transfer.PrefillService(
        layout,
        args.block_tokens,
        key=KEY,
        kv_heads=KV_HEADS,
        tp_rank=args.tp_rank,
        tp_size=args.tp_size,
        listen=args.listen,
        keepalive=args.keepalive,
        claim_timeout=args.claim_timeout,
        on_outcome=lambda o: _say("outcome", o.request_id, o.landed, o.reason),
        on_session_end=lambda facts, why: _say("session_end", facts.pid, why),
    )
    _say("listening", service.address)
    for line in sys.stdin:
        command = json.loads(line)
        try:
            if command[0] == "add":  # request, source blocks, tokens(, computed?)
                service.add_request(command[1], command[2], command[3])
                if command[4:5] != [False]:  # its layers computed: every one ready
                    for layer in range(LAYERS):
                        service.layer_ready(layer, [(command[1], command[3])])
                _say("added", command[1])
            elif command[0] == "ready":  # request, tokens: every layer holds them now
                for layer in range(LAYERS):
                    service.layer_ready(layer, [(command[1], command[2])])
                _say("ready", command[1])
            elif command[0] == "fail":
                service.fail(command[1], command[2])
                _say("failed", command[1])
            elif command[0] == "follow":  # request, tokens(, ahead): a step that computes them
                if command[3:] != [True]:  # a new step; ahead: the one after it, not begun
                    meta = ops.open_shm_and_get_meta_signal(0, 0)
                reader = reader or ops.open_kv_signal_reader(0, 0, timeout=30)
                step = meta.step + (command[3:] == [True])
                service.follow(reader, step, [(command[1], command[2])])
                _say("followed", step)
            elif command[0] == "unread":  # the messager closes its reader (its loop ended)
                reader.close()
                reader = None
                _say("unread")
            elif command[0] == "step":  # the next step begins
                meta = ops.open_shm_and_get_meta_signal(0, 0)
                _say("stepped", meta.step)
            elif command[0] == "signal":  # layer: computed (its bytes written), signalled
                _compute(arrays, heads, command[1])
                ops.signal_layer_ready(ops.init_signal_layerwise(meta, command[1]))
                _say("signalled", command[1])
            elif command[0] == "claimed":  # request, bound: once a decode rank claimed it
                deadline = time.monotonic() + command[2]
                while transfer.part_id(command[1], args.tp_rank, 0) not in service.streamer:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"{command[1]} not claimed in {command[2]} s")
                    time.sleep(0.002)
                _say("claimed", command[1])
            elif command[0] == "exit":
                break
        except Exception as e:  # the test reads it
            _say("error", type(e).__name__, str(e))
    service.close()
    if meta is not None:  # the step channel, as an engine's exit closes it
        from pdhal.testing.reset import release_process_state

        if reader is not None:
            reader.close()
        release_process_state(forget_backend=False)
    _say("closed")
    _exit_at_once(layout)


def _decode(args) -> None:
    from pdhal import PdhalError, transfer

    layout, arrays, heads = _caches(args.tp_rank, args.tp_size, args.head_bytes, False, args.dtype)
    receiver = transfer.KVReceiver(layout, f"session-decode-{os.getpid()}", slots=16)
    client = transfer.DecodeClient(
        receiver,
        key=KEY,
        kv_heads=KV_HEADS,
        block_tokens=args.block_tokens,
        tp_rank=args.tp_rank,
        tp_size=args.tp_size,
        keepalive=args.keepalive,
    )
    ended = {}
    for line in sys.stdin:
        command = json.loads(line)
        try:
            if command[0] == "claim":  # request, prefill, blocks, tokens, timeout(, cached)
                client.claim(
                    command[1],
                    command[2],
                    command[3],
                    tokens=command[4],
                    timeout=command[5],
                    cached_blocks=command[6] if len(command) > 6 else 0,
                )
                _say("claimed", command[1])
            elif command[0] == "connect":  # prefill
                client.connect(command[1])
                _say("connected", command[1])
            elif command[0] == "cancel":
                client.cancel(command[1])
                _say("cancelled", command[1])
            elif command[0] == "wait":  # request, blocks, bound: its outcome
                deadline = time.monotonic() + command[3]
                while command[1] not in ended and (left := deadline - time.monotonic()) > 0:
                    for outcome in client.poll(timeout=left):
                        ended[outcome.request_id] = outcome
                outcome = ended.pop(command[1], None)
                if outcome is None:
                    _say("outcome", None)
                else:
                    _say(
                        "outcome",
                        outcome.landed,
                        outcome.reason,
                        outcome.blocks_free,
                        _blocks(arrays, heads, command[2]),
                    )
            elif command[0] == "poll":  # bound: one poll waiting up to it, and its seconds
                said = []

                def poll(bound=command[1], said=said):
                    start = time.monotonic()
                    got = client.poll(timeout=bound)
                    said.extend([[o.request_id for o in got], time.monotonic() - start])

                polling = threading.Thread(target=poll)
                polling.start()
                while not client._bell.waiting and polling.is_alive():  # (asleep in it: what
                    time.sleep(0.001)  # happens next must wake it, or it sleeps its bound)
                _say("polling")
                polling.join()
                _say("polled", *said)
            elif command[0] == "freed":  # bound: the requests freed within it
                deadline, freed = time.monotonic() + command[1], []
                while not freed and time.monotonic() < deadline:
                    freed = client.freed()
                    time.sleep(0.002)
                _say("freed", freed)
            elif command[0] == "exit":
                break
        except PdhalError as e:
            _say("error", type(e).__name__, str(e))
    client.close()
    receiver.close()
    _say("closed")
    _exit_at_once(layout)


def _exit_at_once(layout) -> None:
    """Exit as an engine's process may once it closed what it holds: at once, its daemon
    threads stopped where they are (what close() left to them unsaid is lost). The files
    of its caches are removed first, as the exit handlers would; the caches stay mapped."""
    for buffer in layout.memory:
        os.unlink(buffer.path)
    sys.stdout.flush()
    os._exit(0)


def _blocks(arrays, heads, blocks: list[int]) -> list:
    """[[[[model head, first byte, all its bytes that byte] per head] per cache] per layer]
    per block of `blocks`."""
    out = []
    for b in blocks:
        layers = []
        for layer in range(LAYERS):
            caches = []
            for c in range(CACHES):
                a = arrays[layer * CACHES + c]
                caches.append(
                    [
                        [h, int(a[b, i, 0]), bool((a[b, i] == a[b, i, 0]).all())]
                        for i, h in enumerate(heads)
                    ]
                )
            layers.append(caches)
        out.append(layers)
    return out


def main(argv=None) -> None:
    import faulthandler

    faulthandler.register(signal.SIGUSR1)
    parser = argparse.ArgumentParser(prog="python -m pdhal.testing.session_peers")
    parser.add_argument("role", choices=("prefill", "decode"))
    parser.add_argument("--listen", default="127.0.0.1:0")
    parser.add_argument("--tp-rank", type=int, default=0)
    parser.add_argument("--tp-size", type=int, default=1)
    parser.add_argument("--head-bytes", type=int, default=HEAD_BYTES)
    parser.add_argument("--block-tokens", type=int, default=BLOCK_TOKENS)
    parser.add_argument("--keepalive", type=float, default=5.0)
    parser.add_argument("--claim-timeout", type=float, default=60.0)
    parser.add_argument("--dtype", default="", help="the caches' element type (CacheSpec.dtype)")
    parser.add_argument("--blank", action="store_true", help="prefill: caches zero till signal")
    args = parser.parse_args(argv)
    (_prefill if args.role == "prefill" else _decode)(args)


class Peer:
    """One side as a process: send() a command, read() its next answer (within a bound)."""

    def __init__(self, role: str, *options: str, env: dict | None = None):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pdhal.testing.session_peers", role, *options],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        self._select = selectors.DefaultSelector()
        self._select.register(self.proc.stdout, selectors.EVENT_READ)
        self._inbox: list[list] = []
        self._partial = b""  # read, not a whole line yet

    def send(self, *command) -> None:
        self.proc.stdin.write(json.dumps(command).encode() + b"\n")
        self.proc.stdin.flush()

    def read(self, kind: str, bound: float = 60.0) -> list:
        """The fields of its next answer of `kind` (those of other kinds met meanwhile are
        kept for their own read: outcomes come on the peer's threads, in their own time)."""
        deadline = time.monotonic() + bound
        while True:
            for index, message in enumerate(self._inbox):
                if message[0] == kind:
                    return self._inbox.pop(index)[1:]
            if b"\n" in self._partial:
                line, self._partial = self._partial.split(b"\n", 1)
                self._inbox.append(json.loads(line))
                continue
            if not self._select.select(max(0.0, deadline - time.monotonic())):
                self.proc.send_signal(signal.SIGUSR1)  # its threads' stacks, to stderr
                time.sleep(0.5)
                raise AssertionError(
                    f"no {kind!r} from the {self.proc.args[3]} within {bound} s "
                    f"(it said {self._inbox})"
                )
            chunk = os.read(self.proc.stdout.fileno(), 1 << 16)  # (select sees the fd only)
            assert chunk, f"the peer exited ({self.proc.wait()}) before {kind!r}"
            self._partial += chunk

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(30)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.resume()
            self.send("exit")
            self.read("closed")
            assert self.proc.wait(30) == 0
        self.proc.stdin.close()
        self.proc.stdout.close()
        self._select.close()


if __name__ == "__main__":
    main()
