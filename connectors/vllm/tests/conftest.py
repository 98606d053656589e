"""The pdhal-vllm tests: real vLLM instances (vLLM's CPU build) on a tiny local Llama.

`make test-vllm` creates .venv-vllm with what they need and runs them with
PDHAL_VLLM_TESTS=1. Without that variable (the main suite's `make test`, whose venv has no
vLLM) this folder is not collected; with it, a missing vLLM, Mooncake or pdhal-vllm is an
error, never a skip.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time

import pytest

if not os.environ.get("PDHAL_VLLM_TESTS"):
    collect_ignore_glob = ["test_*.py"]  # the main suite: run by `make test-vllm` instead
else:
    import importlib.util

    missing = [
        name
        for name in ("vllm", "pdhal_vllm", "mooncake", "pdhal_mooncake")
        if importlib.util.find_spec(name) is None
    ]
    if missing:
        raise pytest.UsageError(
            f"PDHAL_VLLM_TESTS is set but {', '.join(missing)} cannot be "
            f"imported: run `make test-vllm` (it installs them)"
        )

PY = sys.executable
LAYERS = 4
KV_HEADS = 4  # the tiny Llama's
PROMPT_LENS = (40, 100, 65)  # 2, 4 and 3 blocks of 32 tokens
MAX_TOKENS = 8
LONG_PROMPT_LENS = (300,)  # chunked prefill: several steps of 64 tokens


def prompts(lens=PROMPT_LENS, seed: int = 0) -> list[dict]:
    return [
        {"tid": f"r{seed}-{i}", "tokens": [(7 * i + 3 * j + seed) % 990 + 2 for j in range(n)]}
        for i, n in enumerate(lens)
    ]


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> str:
    """The tiny Llama, built once per run (or reused from PDHAL_VLLM_CACHE)."""
    root = os.environ.get("PDHAL_VLLM_CACHE") or str(tmp_path_factory.mktemp("models"))
    out = subprocess.run(
        [
            PY,
            "-c",
            f"from pdhal_vllm.testing import tiny; print(tiny.cached({root!r}, layers={LAYERS}))",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().splitlines()[-1]


class Cluster:
    """One test's processes: a messager, a decode and a prefill instance, and their files."""

    def __init__(self, root, model: str, key: str):
        self.root, self.model = root, model
        self.env = dict(
            os.environ,
            PDHAL_VLLM_KEY=key,
            VLLM_ENABLE_V1_MULTIPROCESSING="0",
            VLLM_CPU_KVCACHE_SPACE="1",
        )
        self.procs: dict[str, subprocess.Popen] = {}
        self.messager_address = None

    def path(self, name: str) -> str:
        return str(self.root / name)

    def start_messager(
        self,
        *extra: str,
        env: dict | None = None,
        rank: int = 0,
        listen: str = "127.0.0.1:0",
        name: str | None = None,
        module: str = "pdhal_vllm.testing.crc",
    ) -> str:
        """The messager of prefill rank `rank` (named "messager", then "messager1", ...,
        unless `name` says); the address of the one named "messager" is the one the
        instances are given."""
        name = name or f"messager{rank or ''}"
        log = open(self.path(f"{name}.log"), "a")  # (a restarted one's after its predecessor's)
        proc = subprocess.Popen(
            [
                PY,
                "-u",
                "-m",
                module,
                "--listen",
                listen,
                "--rank",
                str(rank),
                "--trace",
                self.path(f"trace.{name}.jsonl"),
                *extra,
            ],
            env=dict(self.env, **(env or {})),
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            # its own session, as a deployed service's and each server's here: the kernel
            # shares CPU out by session (autogroup), and in this one a loaded run's busy
            # loops left it 2% of a core, so that a restarted one took 10 s to listen
            start_new_session=True,
        )
        self.procs[name] = proc
        line = proc.stdout.readline()
        assert "listening on" in line, f"{name} did not start: {line!r} {self.log(name)}"
        address = line.split()[-1]
        if name == "messager":
            self.messager_address = address
        return address

    def start(
        self, role: str, prompt_file: str, *extra: str, name: str | None = None
    ) -> subprocess.Popen:
        """Instance `role` (plain, prefill or decode) on `prompt_file`, known as `name`
        (default: its role; another name also prefixes its traces: trace.NAME.ROLE0)."""
        name = name or role
        log = open(self.path(f"{name}.log"), "w")
        args = [
            PY,
            "-m",
            "pdhal_vllm.testing.instance",
            role,
            "--model",
            self.model,
            "--prompts",
            prompt_file,
            "--out",
            self.path(f"{name}.json"),
            "--max-tokens",
            str(MAX_TOKENS),
            "--timeout",
            "150",
            *extra,
        ]
        if role != "plain":
            args += [
                "--messager",
                self.messager_address,
                "--trace",
                self.path("trace" if name == role else f"trace.{name}"),
                "--trace-blocks",
            ]
        proc = subprocess.Popen(args, env=self.env, stdout=log, stderr=subprocess.STDOUT)
        self.procs[name] = proc
        return proc

    def wait(self, role: str, timeout: float = 200) -> dict:
        proc = self.procs[role]
        try:
            rc = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            pytest.fail(f"the {role} instance hung:\n{self.log(role)}")
        assert rc == 0, f"the {role} instance failed ({rc}):\n{self.log(role)}"
        with open(self.path(f"{role}.json")) as f:
            return json.load(f)

    def wait_file(self, name: str, timeout: float = 150) -> None:
        deadline = time.monotonic() + timeout
        while not os.path.exists(self.path(name)):
            for role, proc in self.procs.items():
                if proc.poll() is not None and not role.startswith("messager"):
                    pytest.fail(
                        f"the {role} exited ({proc.returncode}) before {name}:\n{self.log(role)}"
                    )
            assert time.monotonic() < deadline, f"{name} never appeared"
            time.sleep(0.05)

    def log(self, role: str, lines: int = 40) -> str:
        try:
            with open(self.path(f"{role}.log"), errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except FileNotFoundError:
            return ""

    def trace(self, who: str) -> list[dict]:
        from pdhal_vllm.wire import read_trace

        return read_trace(self.path(f"trace.{who}.jsonl"))

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture
def cluster(tmp_path, model_dir):
    c = Cluster(tmp_path, model_dir, secrets.token_hex(16))
    yield c
    c.stop()


def plain_run(root, model: str, items: list[dict], *extra: str) -> dict[tuple, list[int]]:
    """Greedy tokens of a plain vLLM run (no connector) of `items`, by prompt tokens."""
    c = Cluster(root, model, secrets.token_hex(16))
    with open(c.path("prompts.json"), "w") as f:
        json.dump(items, f)
    c.start("plain", c.path("prompts.json"), *extra)
    result = c.wait("plain")
    c.stop()
    by_tid = {p["tid"]: tuple(p["tokens"]) for p in items}
    return {by_tid[r["tid"]]: r["tokens"] for r in result["results"]}


@pytest.fixture(scope="session")
def plain_tokens(tmp_path_factory, model_dir) -> dict[tuple, list[int]]:
    """Greedy tokens of a plain vLLM run, by prompt tokens."""
    every = prompts() + prompts(seed=1) + prompts(LONG_PROMPT_LENS, seed=2)
    return plain_run(tmp_path_factory.mktemp("plain"), model_dir, every)


def free_ports(count: int = 1) -> int:
    """A port p of 127.0.0.1 such that p .. p + count - 1 are free now."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            first = s.getsockname()[1]
        if first + count > 65536:
            continue
        try:
            with contextlib.ExitStack() as held:
                for port in range(first, first + count):
                    held.enter_context(socket.socket()).bind(("127.0.0.1", port))
        except OSError:
            continue
        return first


def prefill_first(cluster: Cluster) -> tuple[str, ...]:
    """A prefill instance's arguments: say when it is up (its workers connected to their
    messagers, which then serve decode claims), for a decode instance started beside it."""
    return ("--ready-file", cluster.path("prefill.ready"))


def after_prefill(cluster: Cluster) -> tuple[str, ...]:
    """A decode instance's arguments: ask for KV only once the prefill instance is up (a
    claim to a messager whose prefill worker is not there fails at once)."""
    return ("--wait-file", cluster.path("prefill.ready"))


def head_crcs(events: list[dict]) -> dict[tuple, int]:
    """(transfer, layer, block index, KV head of the model) -> crc32 of that head's part of
    the block, from a trace's "block" events (the last one recorded)."""
    return {
        (e["tid"], e["layer"], e["i"], e["head0"] + h): crc
        for e in events
        if e["kind"] == "block"
        for h, crc in enumerate(e["crcs"])
    }


def write_prompts(cluster: Cluster, items: list[dict], name: str = "prompts.json") -> str:
    path = cluster.path(name)
    with open(path, "w") as f:
        json.dump(items, f)
    return path
