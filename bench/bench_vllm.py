"""vLLM served as its users serve it, several ways side by side in one run, measured by
vLLM's own benchmark client (`vllm bench serve`, its random dataset, streamed completions).
`--modes` picks them (default pdhal,nixl,plain):

- pdhal: a prefill and a decode `vllm serve` with the pdhal connector and a messager
  between them (shm), behind pdhal's router (`python -m pdhal_vllm.router`), which sends
  each request to both at once; each layer's KV goes to the decode cache as soon as the
  prefill forward wrote it;
- pdhal-nixl: the same over pdhal's NIXL transport (a messager of its own): the byte mover
  NixlConnector uses, layer by layer;
- nixl: vLLM's NixlConnector as a vLLM user runs it on this CPU build
  (`{"kv_connector": "NixlConnector", "kv_buffer_device": "cpu"}`, a
  VLLM_NIXL_SIDE_CHANNEL_PORT of each server's own), behind pdhal's router with
  `--kv-transfer-params prefill` (vLLM's proxy pattern: the decode request goes once the
  prefill answered, with the params that answer carries); the decode pulls the whole
  prompt's KV then;
- nixl-tuned: the same as a careful user runs it on a small host: NIXL's progress thread
  sleeping 10 ms between events instead of spinning a core in every server, and vLLM's
  NIXL worker not pinning itself to the last core (over the user's taskset), both by
  bench/server_site/sitecustomize.py (no vLLM option does either);
- example: a prefill and a decode `vllm serve` with vLLM's own ExampleConnector (each layer
  saved to a safetensors file inside the prefill forward, found by a hash of the prompt;
  the decode's first forward loads them all), behind the same router with `--sequential`:
  the decode request goes only once the prefill answered. Sent at once, either server can
  be scheduled while the other is writing the prompt's files: the one that comes second
  finds the prompt's folder but not every layer's file and its engine dies
  (FileNotFoundError; tried: the prefill server died, the decode having created the folder
  while computing the prompt itself, having found nothing yet);
- plain: one `vllm serve` without a connector, the client straight on it.

With --pin (the default on 2 or more cores) each prefill server runs on core 0 and each
decode server on core 1 (taskset), as a deployment gives each its own accelerator, and
plain on core 0; each messager runs on core 1 too: it moves the KV, which NixlConnector
does inside its decode server, so both movers' CPU is the decode core's (in a deployment
the messager runs on the host's CPU, never on the prefill's accelerator). The routers and
the client go where the kernel puts them.
Every server's processes start with bench/server_site/sitecustomize.py, which asks the
kernel for AMX tiles where the CPU has them: vLLM's CPU attention uses them without asking,
and a decode server that never ran a large matmul died at its first attention (pdhal's
connector asks itself; the others' servers get the same here).

For a sequential mode (nixl, nixl-tuned, example) the router's trace gives, as medians, the prefill
round trip and the time from the prefill's answer to the decode's first byte (the whole KV
moved, then the first token). For every P/D mode it gives how many requests reached the
prefill server while it was prefilling another, and how much of that other's prefill was
left then (median): with a fixed number in flight (--concurrency, no --request-rate) and a
busy prefill server, a connector that finishes requests sooner after their prefill sends
the next ones sooner, into more of the other's prefill, and waits there what it saved.
The prefilling server's own metrics (vLLM's mean queue and prefill time per request) say
whether a connector slows the prefill itself.

    .venv-vllm/bin/python bench/bench_vllm.py [--rounds 2] [--prompts 12] [--input-len 300]
    .venv-vllm/bin/python bench/bench_vllm.py --json     # everything as JSON

Every mode's servers (started as `python -m pdhal_vllm.vllm_cli serve`, vLLM's CLI), the
messagers and the routers start once, in parallel, and stay up; each server's worker runs
one unbound torch thread (VLLM_CPU_OMP_THREADS_BIND=nobind, OMP_NUM_THREADS=1: vLLM's CPU
build otherwise binds every worker's OpenMP threads to the same cores, where the servers'
threads spin-wait on each other for seconds). Two warm-up requests as long as the
benchmark's go through each front. Then each round runs the modes one after another
(the order rotating between rounds) on the same prompts (`--seed` plus the round). The
client is vLLM's `vllm bench serve` itself (its parser and main, as `python -m
pdhal_vllm.vllm_cli bench serve ARGS` runs them), in one process for every run so that
vLLM is imported once; its initial test request is skipped (it repeats the first prompt,
which the ExampleConnector would then find in its files), and the ExampleConnector's
folder is emptied before each of its runs.

Printed per mode: vllm bench serve's median and p99 TTFT, median ITL, request and output
token throughput (per mode the median over the rounds of each run's own figure), and how
many prompt tokens the decoding server computed itself (its
`vllm:prompt_tokens_by_source_total`): none with pdhal (the prefill sends every prompt
token), a few per request with the ExampleConnector (it stores whole blocks only, so the
decode computes the prompt's last partial block), all of them plain; the prefilling
server's own mean queue and prefill time per request (`vllm:request_queue_time_seconds`,
`vllm:request_prefill_time_seconds`); and the CPU time each process group (a server with
its engine core and worker, the messager, a router, the client) used during the mode's
runs, which shows where two cores went (e.g. a decode server stepping its engine while its
requests wait for their KV). Each run starts 2 s
after the last one ended (vLLM's processes spin a second after their last work). Then
pdhal / plain and pdhal / example (TTFT, throughput).

With --split, the pdhal mode runs traced and its TTFT is split per request from the traces
(every process is on this host and every time is CLOCK_MONOTONIC, which the client's
time.perf_counter reads too; the client's requests are paired with the router's by their
start and first-token times):

- router: the client sends the request -> the router forwards it to both servers (the HTTP
  hop to the router and its handling; the router's --trace).
- prefill queue: forwarded -> the prefill worker's first step table that names the request
  (the connector's trace; posted when the first layer of that step saves its KV): the
  prefill server's HTTP front end, tokenizer, engine-core queue (a step already running
  ends first), scheduling, and the step's first layer.
- prefill forward: that table -> the last layer's signal of the last prefill step that
  holds the request (chunked prompts take several steps; the gaps between them count).
- transfer: that signal -> the last layer landed in the decode cache, by the streamer's own
  record (the messager's trace: its "landed" events are the streamer's metrics records;
  the one that carried the request's last layer is matched by step or, when the decode
  side asked only after that layer was ready, it is the submit made when it asked; the
  decode worker's own "landed" record when neither matches, marked). It includes the
  messager waking on the signal and, for a late ask, the wait for it ("transfer_wait_ms",
  signal -> the streamer had the layer, printed as a median); not the layers before the
  last, which went while the forward ran.
- decode: landed -> the client's first token: the decode worker noticing the landing (it
  polls once per engine step; "decode_noticed_ms"), vLLM scheduling the request, the decode
  forward of the last prompt token, the API server's output, the router's relay
  ("relay_ms": the router's first byte from the decode -> the client's) and the client.

The parts add up to the client's TTFT of that request; the medians of the parts do not add
up to the median TTFT. Not in any part: the prefill server's answer to the router (it runs
beside the decode). The connector's and the messager's traces cost the pdhal mode a file
write per layer and per request event, and a traced decode worker asks for each layer's
progress, so a traced run is not the one to take ratios from: without --split (the default
but for BENCH_SMOKE=1) the pdhal mode runs untraced. Every router traces each request's
events, whatever its mode.

On a shared 2-core machine the absolute numbers mean little (every mode's servers,
messagers and routers and the client on two cores, and whatever else runs there; the P/D
modes have two busy servers where plain has one): read the ratios, measured in one run on the same
prompts.

BENCH_SMOKE=1 (`BENCH_SMOKE=1 make bench-vllm`): one round of 4 prompts of 100 tokens and
4 output tokens, the same servers and output; its time is mostly the servers starting.
Every process is stopped at the end (SIGTERM, then SIGKILL to its process group after a
bound), and the run's pdhal namespace in /dev/shm is emptied (what was left is named).
A server that does not come up within --start-timeout, a run past --run-timeout or any
failed request ends the run with the failing process's log tail. --keep DIR keeps every
log, trace and vllm bench serve result.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import secrets
import select
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

PY = sys.executable
SMOKE = os.environ.get("BENCH_SMOKE") == "1"  # BENCH_SMOKE=1 make bench-vllm: the same runs, small
#: Every mode there is (--modes picks; each P/D mode is a prefill and a decode server).
MODES = ("pdhal", "pdhal-nixl", "nixl", "nixl-tuned", "example", "plain")
DEFAULT_MODES = ("pdhal", "nixl", "plain")
LABELS = {
    "pdhal": "pdhal layer-wise",
    "pdhal-nixl": "pdhal over NIXL",
    "nixl": "NixlConnector",
    "nixl-tuned": "NixlConnector tuned",
    "example": "ExampleConnector",
    "plain": "plain (1 server)",
}
#: The transport of each pdhal mode's messager and decode side.
PDHAL_TRANSPORTS = {"pdhal": "shm", "pdhal-nixl": "nixl"}


def servers_of(modes) -> dict[str, str | None]:
    """role -> its kv-transfer role (plain has none), for `modes`."""
    roles: dict[str, str | None] = {}
    for mode in modes:
        if mode == "plain":
            roles["plain"] = None
        else:
            roles |= {f"{mode}-prefill": "kv_producer", f"{mode}-decode": "kv_consumer"}
    return roles


SETTLE_S = 2.0
STARTUP_FAILED = ("EngineCore failed to start", "Engine core initialization failed")
#: The modes of vLLM's NixlConnector: as shipped, and as a careful user runs it on a small
#: host (bench/server_site/sitecustomize.py).
NIXL_MODES = ("nixl", "nixl-tuned")
#: Run at the start of each server's processes (AMX tiles; NixlConnector tuned).
SERVER_SITE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "server_site")
#: Each pdhal mode's messager process.
MESSAGER_OF = {"pdhal": "messager", "pdhal-nixl": "messager-nixl"}
PARTS = ("router", "prefill_queue", "prefill_forward", "transfer", "decode")
#: The phases of a request vLLM's metrics time on the server that prefills it.
PREFILL_PHASES = ("queue", "prefill")
PART_HEADS = ("router", "queue", "forward", "transfer", "decode")


class BenchError(RuntimeError):
    """Something did not start or run: the message names it, with its log's tail."""


class Procs:
    """The processes of the run, each in its own process group, with its log."""

    def __init__(self, root: str, env: dict):
        self.root, self.env = root, env
        self.procs: dict[str, subprocess.Popen] = {}
        self._logs = []

    def path(self, name: str) -> str:
        return os.path.join(self.root, name)

    def start(
        self,
        name: str,
        args: list[str],
        pipe: bool = False,
        stdin: bool = False,
        env: dict | None = None,
    ) -> subprocess.Popen:
        """Start `name` (`env`: variables of its own); with `pipe`, its stdout is read by
        first_line (then into its log); with `stdin`, its stdin is a pipe."""
        log = open(self.path(f"{name}.log"), "w")
        self._logs.append(log)
        proc = subprocess.Popen(
            args,
            env=self.env | (env or {}),
            stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
            stdout=subprocess.PIPE if pipe else log,
            stderr=log,
            text=True,
            start_new_session=True,  # its children go with it when the group is killed
        )
        self.procs[name] = proc
        return proc

    def first_line(self, name: str, bound: float, marker: str) -> str:
        """The first line `name` prints on stdout, which must contain `marker`; the rest
        goes to its log."""
        proc = self.procs[name]
        ready, _, _ = select.select([proc.stdout], [], [], bound)
        line = proc.stdout.readline() if ready else ""
        if marker not in line:
            time.sleep(0.5)
            raise BenchError(
                f"{name} did not say {marker!r} within {bound:.0f} s (got {line!r}):\n"
                f"{self.log(name)}"
            )
        log = open(self.path(f"{name}.log"), "a")
        self._logs.append(log)

        def drain():
            for rest in proc.stdout:
                log.write(rest)
                log.flush()

        threading.Thread(target=drain, daemon=True).start()
        return line

    def log(self, name: str, lines: int = 40) -> str:
        try:
            with open(self.path(f"{name}.log"), errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except FileNotFoundError:
            return ""

    def check(self, name: str) -> None:
        proc = self.procs[name]
        if proc.poll() is not None:
            raise BenchError(f"{name} exited ({proc.returncode}):\n{self.log(name)}")

    def stop(self, names: list[str], bound: float = 60.0) -> list[str]:
        """SIGTERM each of `names`, wait for all up to `bound` s, then SIGKILL the process
        group of each still there; returns those that had to be killed."""
        live = [n for n in names if n in self.procs and self.procs[n].poll() is None]
        for name in live:
            with _no_such_process():
                self.procs[name].send_signal(signal.SIGTERM)
        deadline = time.monotonic() + bound
        killed = []
        for name in live:
            proc = self.procs[name]
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                killed.append(name)
                with _no_such_process():
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(30)
        # what else is in their groups (a server's engine core, workers, and the resource
        # tracker that unlinks their shared memory): a while to go by itself, then killed
        groups = {self.procs[n].pid: n for n in names if n in self.procs}
        deadline = time.monotonic() + 30
        while groups and time.monotonic() < deadline:
            groups = {g: n for g, n in groups.items() if _group_alive(g)}
            time.sleep(0.2)
        for group, name in groups.items():
            killed.append(f"{name}'s children")
            with _no_such_process():
                os.killpg(group, signal.SIGKILL)
        return killed

    def wait_healthy(self, name: str, url: str, deadline: float, bound: float) -> None:
        """Return once server `name` answers /health at `url`; BenchError once any process
        exited, `name` failed to start, or `deadline` (the start's `bound` s) passed."""
        while True:
            for each in self.procs:
                self.check(each)
            if any(m in self.log(name, 400) for m in STARTUP_FAILED):  # its API server may
                raise BenchError(f"{name} failed to start:\n{self.log(name)}")  # wait on
            try:
                if get(url + "/health")[0] == 200:
                    return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise BenchError(f"{name} not up within {bound:.0f} s:\n{self.log(name)}")
            time.sleep(1)

    def cpu_seconds(self) -> dict[str, float]:
        """CPU time (user + system) of each process group so far, by name."""
        ticks = os.sysconf("SC_CLK_TCK")
        groups = {proc.pid: name for name, proc in self.procs.items()}
        out = dict.fromkeys(groups.values(), 0.0)
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            rest = stat[stat.rfind(")") + 2 :].split()
            name = groups.get(int(rest[2]))
            if name is not None:
                out[name] += (int(rest[11]) + int(rest[12])) / ticks
        return out

    def shm_mapped(self) -> set[str]:
        """The /dev/shm files the processes of these groups map now."""
        groups = {proc.pid for proc in self.procs.values()}
        return _mapped_anywhere(lambda pid: os.getpgid(pid) in groups)

    def states(self) -> str:
        return ", ".join(
            f"{name} " + ("running" if proc.poll() is None else f"exited ({proc.returncode})")
            for name, proc in self.procs.items()
        )

    def close(self) -> None:
        for log in self._logs:
            log.close()


class _no_such_process:
    def __enter__(self):
        return self

    def __exit__(self, kind, value, tb):
        return kind is not None and issubclass(kind, (ProcessLookupError, PermissionError))


def _mapped_anywhere(which=lambda pid: True) -> set[str]:
    """The /dev/shm files that the processes `which` accepts map."""
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if not which(int(entry)):
                continue
            with open(f"/proc/{entry}/maps") as f:
                for line in f:
                    if "/dev/shm/" in line:
                        found.add(line.split(maxsplit=5)[-1].strip())
        except OSError:  # gone, or not ours to read
            continue
    return found


def _group_alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    with urllib.request.urlopen(url, timeout=timeout) as answer:
        return answer.status, answer.read().decode()


def post(url: str, body: dict, timeout: float = 120.0) -> dict:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=timeout) as answer:
        return json.loads(answer.read().decode())


def metric(url: str, name: str, **labels: str) -> float:
    """The sum of a counter's samples in a server's /metrics with these labels."""
    _, text = get(url + "/metrics", timeout=30)
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{"):
            head, value = line.rsplit(" ", 1)
            if all(f'{k}="{v}"' in head for k, v in labels.items()):
                total += float(value)
    return total


class Stack:
    """The messagers, the servers and the routers of the run's modes."""

    def __init__(
        self, procs: Procs, model: str, max_model_len: int, modes, pin: bool, traced: bool
    ):
        self.p, self.model, self.max_model_len = procs, model, max_model_len
        self.pin = pin
        self.traced = traced and "pdhal" in modes  # the pdhal mode traced (--split)
        self.modes = tuple(modes)
        self.servers = servers_of(self.modes)
        self.messagers: dict[str, str] = {}  # pdhal mode -> its messager's HOST:PORT
        self.urls: dict[str, str] = {}
        self.trace = procs.path("trace")  # the connector's: trace.prefill0.jsonl, ...
        self.storage = procs.path("example-kv")  # the ExampleConnector's files
        self.shm: set[str] = set()  # the /dev/shm files its processes mapped once up

    def start(self, bound: float) -> None:
        p = self.p
        for mode, transport in PDHAL_TRANSPORTS.items():
            if mode not in self.modes:
                continue
            name = MESSAGER_OF[mode]
            args = [PY, "-u", "-m", "pdhal_vllm.messager", "--listen", "127.0.0.1:0"]
            args += ["--transport", transport]
            if mode == "pdhal" and self.traced:
                args += ["--trace", p.path("trace.messager.jsonl")]
            if self.pin:  # on the decode's core, where NixlConnector's pull runs
                args = ["taskset", "-c", "1", *args]
            p.start(name, args, pipe=True)
            self.messagers[mode] = p.first_line(name, 120, "listening on").split()[-1]
        os.makedirs(self.storage, exist_ok=True)
        for role, kv_role in self.servers.items():
            self._serve(role, kv_role)
        p.start("client", [PY, os.path.abspath(__file__), "--client"], stdin=True)
        deadline = time.monotonic() + bound
        for role in self.servers:
            self._wait_healthy(role, deadline, bound)
        for mode in self.modes:
            if mode == "plain":
                continue
            name = f"{mode}-router"
            prefill = self.urls[mode + "-prefill"]
            args = [PY, "-u", "-m", "pdhal_vllm.router", "--port", "0"]
            args += [f"--decode={self.urls[mode + '-decode']}", "--timeout", "600"]
            args += ["--trace", p.path(f"trace.{name}.jsonl")]
            if mode in PDHAL_TRANSPORTS:
                args.append(f"--prefill={prefill}={self.messagers[mode]}")
            elif mode == "example":
                args += [f"--prefill={prefill}", "--sequential"]
            else:  # NixlConnector: its prefill's answer says where its KV is (and when)
                args += [f"--prefill={prefill}", "--kv-transfer-params", "prefill"]
            p.start(name, args, pipe=True)
            self.urls[name] = p.first_line(name, 120, "listening on").split()[-1]

    def _serve(self, role: str, kv_role: str | None) -> None:
        mode = role.rpartition("-")[0]
        port = free_port()
        args = [
            PY,
            "-m",
            "pdhal_vllm.vllm_cli",
            "serve",
            self.model,
            "--port",
            str(port),
            "--block-size",
            "32",
            "--max-model-len",
            str(self.max_model_len),
            "--enforce-eager",
            "--seed",
            "0",
            "--dtype",
            "bfloat16",
            "--no-enable-prefix-caching",
        ]
        env = None
        if mode in PDHAL_TRANSPORTS:
            from pdhal_vllm.config import (
                SLEEPING_DECODE_ARGS,
                SLEEPING_DECODE_ENV,
                kv_transfer_config,
            )

            side = (
                {"messager": self.messagers[mode]}
                if kv_role == "kv_producer"
                else {"transport": PDHAL_TRANSPORTS[mode]}
            )
            trace = self.trace if mode == "pdhal" and self.traced else None
            config = kv_transfer_config(kv_role, trace=trace, **side)
            # each pdhal prefill server on a device of its own, as on an xPyD node: two on
            # one device would signal their layers on one channel (refused at start)
            if kv_role == "kv_producer":
                env = {"PDHAL_CPU_VISIBLE_DEVICES": str(list(PDHAL_TRANSPORTS).index(mode))}
            else:  # as the connector's docs run a decode server: its engine sleeps
                args += SLEEPING_DECODE_ARGS  # while its requests wait for their KV
                env = SLEEPING_DECODE_ENV
        elif mode == "example":
            config = {
                "kv_connector": "ExampleConnector",
                "kv_role": kv_role,
                "kv_connector_extra_config": {"shared_storage_path": self.storage},
            }
        elif mode in NIXL_MODES:  # as a vLLM user runs it on a CPU build (module docstring)
            config = {"kv_connector": "NixlConnector", "kv_role": kv_role}
            config["kv_buffer_device"] = "cpu"
            env = {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())}
            if mode == "nixl-tuned":
                env["BENCH_NIXL_TUNED"] = "1"
        if kv_role is not None:
            args += ["--kv-transfer-config", json.dumps(config)]
        path = self.p.env.get("PYTHONPATH")
        env = (env or {}) | {"PYTHONPATH": SERVER_SITE + (os.pathsep + path if path else "")}
        if self.pin:  # a core of its own: a prefill on the first, a decode on the second
            args = ["taskset", "-c", "1" if kv_role == "kv_consumer" else "0", *args]
        self.p.start(role, args, env=env)
        self.urls[role] = f"http://127.0.0.1:{port}"

    def _wait_healthy(self, role: str, deadline: float, bound: float) -> None:
        self.p.wait_healthy(role, self.urls[role], deadline, bound)

    def front(self, mode: str) -> str:
        return self.urls["plain" if mode == "plain" else f"{mode}-router"]

    def check(self) -> None:
        for name in self.p.procs:
            self.p.check(name)

    def decode_tokens(self, mode: str) -> dict[str, float]:
        """Prompt tokens the server that decodes `mode` counted, by source, so far."""
        url = self.urls["plain" if mode == "plain" else f"{mode}-decode"]
        name = "vllm:prompt_tokens_by_source_total"
        return {
            "local": metric(url, name, source="local_compute"),
            "external": metric(url, name, source="external_kv_transfer"),
        }

    def prefill_phases(self, mode: str) -> dict[str, float]:
        """The seconds the server that prefills `mode` spent, over all its requests so far,
        in each phase vLLM's own metrics time (queued; prefilling: scheduled to the first
        token), and their count."""
        url = self.urls["plain" if mode == "plain" else f"{mode}-prefill"]
        out = {"count": metric(url, "vllm:request_prefill_time_seconds_count")}
        for phase in PREFILL_PHASES:
            out[phase] = metric(url, f"vllm:request_{phase}_time_seconds_sum")
        return out

    def names(self) -> list[str]:
        return list(self.p.procs)


def bench_argv(stack: Stack, mode: str, args, seed: int, out: str) -> list[str]:
    """`vllm bench serve`'s arguments for one run through `mode`'s front."""
    return [
        "--backend",
        "openai",
        "--base-url",
        stack.front(mode),
        "--model",
        stack.model,
        "--tokenizer",
        stack.model,
        "--dataset-name",
        "random",
        "--random-input-len",
        str(args.input_len),
        "--random-output-len",
        str(args.output_len),
        "--num-prompts",
        str(args.prompts),
        "--max-concurrency",
        str(args.concurrency),
        "--request-rate",
        str(args.request_rate),
        "--ignore-eos",
        "--temperature",
        "0",
        "--seed",
        str(seed),
        "--ready-check-timeout-sec",
        "0",
        "--disable-tqdm",
        "--save-result",
        "--save-detailed",
        "--result-dir",
        os.path.dirname(out),
        "--result-filename",
        os.path.basename(out),
    ]


def client_main() -> int:
    """The benchmark client (`bench_vllm.py --client`): `vllm bench serve` (vLLM's own
    argument parser and main, as `python -m pdhal_vllm.vllm_cli bench serve ARGS` runs
    them) once per line of stdin, [ARGS, DONE_FILE], imported once for every run (importing
    vLLM takes its 15-20 s each time on two cores); DONE_FILE gets {"error": None} or the
    traceback."""
    import importlib.metadata
    import traceback

    from pdhal_vllm import vllm_cli

    importlib.metadata.version = vllm_cli._vllm_version  # what vllm_cli.main does
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as bench_main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    for line in sys.stdin:
        argv, done = json.loads(line)
        error = None
        try:
            parser = FlexibleArgumentParser(prog="vllm bench serve")
            add_cli_args(parser)
            bench_main(parser.parse_args(argv))
        except (Exception, SystemExit):
            error = traceback.format_exc()
        sys.stdout.flush()
        with open(done + ".tmp", "w") as f:
            json.dump({"error": error}, f)
        os.replace(done + ".tmp", done)
    return 0


def bench_serve(stack: Stack, mode: str, args, seed: int, out: str, bound: float) -> dict:
    """One `vllm bench serve` run through `mode`'s front, by the client; its saved result
    (detailed)."""
    argv = bench_argv(stack, mode, args, seed, out)
    done = out + ".done"
    client = stack.p.procs["client"]
    client.stdin.write(json.dumps([argv, done]) + "\n")
    client.stdin.flush()
    deadline = time.monotonic() + bound
    while not os.path.exists(done):
        stack.p.check("client")
        if time.monotonic() > deadline:
            raise BenchError(
                f"vllm bench serve ({mode}) ran past {bound:.0f} s:\n{stack.p.log('client')}"
            )
        time.sleep(0.2)
    with open(done) as f:
        error = json.load(f)["error"]
    if error is not None or not os.path.exists(out):
        raise BenchError(f"vllm bench serve ({mode}) failed:\n{error}\n{stack.p.log('client')}")
    with open(out) as f:
        result = json.load(f)
    if result.get("failed") or result.get("completed") != args.prompts:
        errors = [e for e in result.get("errors", []) if e][:3]
        raise BenchError(
            f"vllm bench serve ({mode}): {result.get('completed')} of {args.prompts} "
            f"completed, {result.get('failed')} failed: {errors}"
        )
    return result


# ---- the pdhal TTFT split --------------------------------------------------------------


def _events(path: str) -> list[dict]:
    from pdhal_vllm.wire import read_trace

    return read_trace(path)


def split_pdhal(stack: Stack, results: list[dict]) -> list[dict]:
    """Per request of the pdhal runs `results`: its TTFT in parts (module docstring)."""
    prefill = _events(stack.trace + ".prefill0.jsonl")
    decode = _events(stack.trace + ".decode0.jsonl")
    messager = _events(stack.p.path("trace.messager.jsonl"))
    router: dict[str, dict[str, int]] = {}
    for e in _events(stack.p.path("trace.pdhal-router.jsonl")):
        router.setdefault(e["tid"], {}).setdefault(e["kind"], e["t"])
    signals = {(e["step"], e["layer"]): e["t"] for e in prefill if e["kind"] == "signal"}
    if not signals:
        raise BenchError("the pdhal prefill worker traced no layer signal")
    last = max(layer for _, layer in signals)
    steps: dict[str, list[int]] = {}  # tid -> the prefill steps that hold it
    table_t: dict[str, int] = {}
    for e in prefill:
        if e["kind"] == "table":
            for tid in e["tids"]:
                steps.setdefault(tid, []).append(e["step"])
                table_t.setdefault(tid, e["t"])
    decode_landed = {
        e["tid"]: e["t"] for e in decode if e["kind"] == "landed" and e["layer"] == last
    }
    # when each request was claimed (the decode worker's "want") and its table came
    want: dict[str, int] = {}
    for e in decode:
        if e["kind"] == "want":
            want.setdefault(e["tid"], e["t"])
    mtable: dict[str, int] = {}
    for e in messager:
        if e["kind"] == "table":
            for tid in e["tids"]:
                mtable.setdefault(tid, e["t"])
    records = [e for e in messager if e["kind"] == "landed" and e["layer"] == last]

    def streamer_landed(tid: str, step: int) -> dict | None:
        """The streamer's record of `tid`'s last layer: the first of its step submitted
        once both its claim and its table were there (on its signal, or with the claim
        when that came later; a claim reaches the messager a moment after the decode
        worker traced it, so this may be another request's of that step, as early)."""
        if tid not in want or tid not in mtable:
            return None
        ready = max(want[tid], mtable[tid])
        ends = [r for r in records if r.get("step") == step and r["submit_ns"] >= ready]
        return min(ends, key=lambda r: r["submit_ns"]) if ends else None

    client = []
    for result in results:
        for start, ttft in zip(result["start_times"], result["ttfts"]):
            if ttft:
                client.append((int(start * 1e9), int((start + ttft) * 1e9)))
    lo, hi = min(c[0] for c in client) - 10**9, max(c[1] for c in client) + 10**9
    served = [
        (tid, ev)
        for tid, ev in router.items()
        if "forwarded" in ev and "first" in ev and lo <= ev["received"] <= hi
    ]
    pairs = sorted(
        (abs(ev["received"] - c[0]) + abs(c[1] - ev["first"]), ci, tid)
        for ci, c in enumerate(client)
        for tid, ev in served
        if ev["received"] >= c[0] - 10**6 and c[1] >= ev["first"] - 10**6
    )
    matched, used = {}, set()
    for _, ci, tid in pairs:
        if ci not in matched and tid not in used:
            matched[ci] = tid
            used.add(tid)
    rows = []
    for ci, (start, first) in enumerate(client):
        tid = matched.get(ci)
        if tid is None or tid not in steps:
            continue
        ev, step = router[tid], steps[tid][-1]
        signal_t = signals.get((step, last))
        record = streamer_landed(tid, step)
        if record is not None:
            landed, source = record["t"], "streamer"
        else:
            landed, source = decode_landed.get(tid), "decode"
        if signal_t is None or landed is None:
            continue
        times = [start, ev["forwarded"], table_t[tid], signal_t, landed, first]
        row = {"tid": tid, "ttft_ms": (first - start) / 1e6}
        row |= {part: (b - a) / 1e6 for part, a, b in zip(PARTS, times, times[1:])}
        row["landed_from"] = source
        if record is not None:  # the signal -> the streamer handed the layer on
            row["transfer_wait_ms"] = (record["signal_ns"] - signal_t) / 1e6
        row["prefill_steps"] = len(steps[tid])
        if tid in decode_landed:
            row["decode_noticed_ms"] = (decode_landed[tid] - landed) / 1e6
        row["relay_ms"] = (first - ev["first"]) / 1e6
        rows.append(row)
    return rows


#: The modes whose router sends the decode request once the prefill answered.
SEQUENTIAL = (*NIXL_MODES, "example")


def sequential_split(stack: Stack, mode: str, since_ns: int) -> dict | None:
    """`mode`'s router's medians over the requests it got from `since_ns` on (not the
    warm-ups): its prefill round trip, then the decode's first byte (the whole KV moved,
    then the first token)."""
    router: dict[str, dict[str, int]] = {}
    for e in _events(stack.p.path(f"trace.{mode}-router.jsonl")):
        router.setdefault(e["tid"], {}).setdefault(e["kind"], e["t"])
    done = [
        ev
        for ev in router.values()
        if {"forwarded", "prefilled", "first"} <= set(ev) and ev["forwarded"] >= since_ns
    ]
    if not done:
        return None
    return {
        "prefill_round_trip_ms": statistics.median(
            (ev["prefilled"] - ev["forwarded"]) / 1e6 for ev in done
        ),
        "decode_first_byte_after_prefill_ms": statistics.median(
            (ev["first"] - ev["prefilled"]) / 1e6 for ev in done
        ),
        "requests": len(done),
    }


def prefill_overlap(stack: Stack, mode: str, since_ns: int) -> dict | None:
    """From `mode`'s router trace (the requests it got from `since_ns` on): how many
    reached the prefill server while it was prefilling another (forwarded -> answered), and
    the median of what that other's prefill had left then: what such a request waits
    before its own. With a fixed number in flight and a busy prefill server, a connector
    that finishes a request sooner after its prefill sends the next one sooner, into more
    of the other's prefill: the time it saved is waited there."""
    router: dict[str, dict[str, int]] = {}
    for e in _events(stack.p.path(f"trace.{mode}-router.jsonl")):
        router.setdefault(e["tid"], {}).setdefault(e["kind"], e["t"])
    spans = [
        (ev["forwarded"], ev["prefilled"])
        for ev in router.values()
        if {"forwarded", "prefilled"} <= set(ev) and ev["forwarded"] >= since_ns
    ]
    left = []
    for start, end in spans:
        busy = [e for s, e in spans if s < start < e and (s, e) != (start, end)]
        if busy:
            left.append((max(busy) - start) / 1e6)
    if not spans:
        return None
    return {
        "requests": len(spans),
        "arrived_while_prefilling_another": len(left),
        "others_prefill_left_ms": statistics.median(left) if left else None,
    }


# ---- the run ---------------------------------------------------------------------------


def warm_up(stack: Stack, length: int) -> None:
    """Two requests through each front, their prompts (token ids, not the benchmark's) as
    long as the benchmark's: a server's first forwards of a shape cost more."""
    for mode in stack.modes:
        for i in range(2):
            prompt = [(7 * j + 13 * i) % 990 + 2 for j in range(length)]
            body = {"model": stack.model, "prompt": prompt, "max_tokens": 4, "temperature": 0}
            try:
                post(stack.front(mode) + "/v1/completions", body)
            except OSError as exc:
                stack.check()
                raise BenchError(f"a warm-up request through {mode} failed: {exc}") from None


def server_env(namespace: str) -> dict:
    """The environment of a run's processes: its key and pdhal namespace, and vLLM's CPU
    build set for several servers on a few cores."""
    return dict(
        os.environ,
        PDHAL_VLLM_KEY=secrets.token_hex(16),
        PDHAL_NAMESPACE=namespace,
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_ENABLE_V1_MULTIPROCESSING="1",
        # one torch thread per worker, unbound: vLLM's CPU build otherwise binds every
        # worker's OpenMP threads to the same cores, where they spin-wait on each other
        VLLM_CPU_OMP_THREADS_BIND="nobind",
        OMP_NUM_THREADS="1",
    )


def run(args, root: str, model: str) -> dict:
    namespace = f"benchvllm{os.getpid()}"
    procs = Procs(root, server_env(namespace))
    max_len = max(512, -(-(args.input_len + args.output_len + 64) // 32) * 32)
    modes = args.modes
    stack = Stack(procs, model, max_len, modes, args.pin, args.split)
    out: dict = {"runs": {m: [] for m in modes}}
    out |= {"decode_tokens": {m: [] for m in modes}, "cpu_s": {m: [] for m in modes}}
    out["prefill_phases"] = {m: [] for m in modes}
    times = {}
    try:
        t = time.monotonic()
        stack.start(args.start_timeout)
        warm_up(stack, args.input_len)
        stack.shm = procs.shm_mapped()
        times["start_s"] = time.monotonic() - t
        _say(args, f"servers up and warm in {times['start_s']:.0f} s")
        t, since_ns = time.monotonic(), time.monotonic_ns()
        for r in range(args.rounds):
            turn = r % len(modes)
            order = modes[turn:] + modes[:turn]
            for mode in order:
                if mode == "example":  # nothing of an earlier run to find
                    shutil.rmtree(stack.storage, ignore_errors=True)
                    os.makedirs(stack.storage)
                time.sleep(SETTLE_S)  # vLLM's processes spin a second after their last work
                before = stack.decode_tokens(mode)
                phases = stack.prefill_phases(mode)
                cpu = procs.cpu_seconds()
                result = bench_serve(
                    stack,
                    mode,
                    args,
                    seed=args.seed + r,
                    out=procs.path(f"{mode}{r}.json"),
                    bound=args.run_timeout,
                )
                after = stack.decode_tokens(mode)
                used = {k: v - cpu.get(k, 0.0) for k, v in procs.cpu_seconds().items()}
                out["cpu_s"][mode].append({k: v for k, v in used.items() if v >= 0.05})
                out["runs"][mode].append(result)
                out["decode_tokens"][mode].append({k: after[k] - before[k] for k in after})
                now = stack.prefill_phases(mode)
                out["prefill_phases"][mode].append({k: now[k] - phases[k] for k in now})
                _say(
                    args,
                    f"round {r} {mode:8s} TTFT median {result['median_ttft_ms']:8.2f} ms  "
                    f"req/s {result['request_throughput']:.2f}",
                )
                stack.check()
        times["bench_s"] = time.monotonic() - t
        out["split"] = None
        if stack.traced:
            time.sleep(1.0)  # the messager traces the streamer's records twice a second
            out["split"] = split_pdhal(stack, out["runs"]["pdhal"])
        out["sequential"] = {
            m: sequential_split(stack, m, since_ns) for m in modes if m in SEQUENTIAL
        }
        out["overlap"] = {m: prefill_overlap(stack, m, since_ns) for m in modes if m != "plain"}
    except BenchError as exc:
        raise BenchError(f"{exc}\nthe processes then: {procs.states()}") from None
    finally:
        out["stop"] = stop(stack, namespace)
        procs.close()
    out["times"] = times
    return out


def stop(stack: Stack, namespace: str) -> dict:
    """Routers, then servers (SIGTERM, bounded), then the messager once it removed what the
    servers' workers left in the namespace; then the namespace emptied."""
    from pdhal.testing.reset import remove_leftovers, segments_of

    p = stack.p
    client = p.procs.get("client")
    if client is not None and client.poll() is None:
        with contextlib.suppress(OSError):
            client.stdin.close()  # it ends at the end of its input
        try:
            client.wait(10)
        except subprocess.TimeoutExpired:
            pass
    vllm_shm = stack.shm | p.shm_mapped()  # vLLM's own (its executor's message queues)
    killed = p.stop(["client"], bound=10)
    killed += p.stop([n for n in p.procs if n.endswith("router")], bound=20)
    killed += p.stop([n for n in p.procs if n in stack.servers], bound=60)
    messagers = [p.procs[n] for n in MESSAGER_OF.values() if n in p.procs]
    deadline = time.monotonic() + 20
    while any(m.poll() is None for m in messagers) and time.monotonic() < deadline:
        owners = [f".{m.pid}." for m in messagers]
        if all(any(o in name for o in owners) for name in segments_of(namespace)):
            break
        time.sleep(0.2)
    killed += p.stop([n for n in MESSAGER_OF.values() if n in p.procs], bound=20)
    removed = remove_leftovers(namespace)
    in_use = _mapped_anywhere()
    for path in sorted(vllm_shm - in_use):  # a killed process's, nobody else's
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
            removed.append(path)
    return {"killed": killed, "leftovers_removed": removed, "shm_mapped": sorted(vllm_shm)}


def _say(args, text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def summarize(args, out: dict) -> dict:
    keys = (
        "median_ttft_ms",
        "p99_ttft_ms",
        "median_itl_ms",
        "request_throughput",
        "output_throughput",
    )
    modes = {}
    for mode in args.modes:
        runs = out["runs"][mode]
        modes[mode] = {k: statistics.median(r[k] for r in runs) for k in keys}
        tokens = out["decode_tokens"][mode]
        modes[mode]["decode_computed_prompt_tokens"] = sum(t["local"] for t in tokens)
        modes[mode]["decode_external_prompt_tokens"] = sum(t["external"] for t in tokens)
        modes[mode]["prompt_tokens"] = sum(r["total_input_tokens"] for r in runs)
        modes[mode]["per_round"] = [{k: r[k] for k in keys} for r in runs]
        phases = out["prefill_phases"][mode]
        count = sum(p["count"] for p in phases)
        modes[mode]["prefill_server_mean_ms"] = {
            phase: 1e3 * sum(p[phase] for p in phases) / count if count else None
            for phase in PREFILL_PHASES
        }
        cpu: dict[str, float] = {}
        for used in out["cpu_s"][mode]:
            for name, seconds in used.items():
                cpu[name] = cpu.get(name, 0.0) + seconds
        modes[mode]["cpu_s"] = {k: round(v, 2) for k, v in sorted(cpu.items())}
        modes[mode]["bench_duration_s"] = sum(r["duration"] for r in runs)
    ratios = {}
    for mine in (m for m in args.modes if m in PDHAL_TRANSPORTS):
        pd = modes[mine]
        for other in (m for m in args.modes if m not in PDHAL_TRANSPORTS):
            o = modes[other]
            ratios[f"{mine}/{other}"] = {
                "median_ttft": pd["median_ttft_ms"] / o["median_ttft_ms"],
                "request_throughput": pd["request_throughput"] / o["request_throughput"],
                "output_throughput": pd["output_throughput"] / o["output_throughput"],
            }
    return {
        "setup": {
            "layers": args.layers,
            "hidden": args.hidden,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "prompts": args.prompts,
            "concurrency": args.concurrency,
            "rounds": args.rounds,
            "kv_bytes_per_request": args.layers * args.input_len * 2 * args.hidden * 2,
            "smoke": SMOKE,
            "pdhal_traced": out["split"] is not None,
        },
        "modes": modes,
        "ratios": ratios,
        "pdhal_ttft_split": None if out["split"] is None else _summarize_split(out["split"]),
        "sequential_router": out["sequential"],
        "prefill_overlap": out["overlap"],
        "times": out["times"],
        "stop": out["stop"],
        "note": "absolute numbers on a shared 2-core machine mean little; ratios measured "
        "in one run do",
    }


def _summarize_split(rows: list[dict]) -> dict:
    """The pdhal mode's TTFT split: its requests and the median of each part."""
    split = {
        "requests": rows,
        "median": {k: statistics.median(r[k] for r in rows) for k in ("ttft_ms", *PARTS) if rows},
        "landed_from_streamer": sum(r["landed_from"] == "streamer" for r in rows),
    }
    for key in ("transfer_wait_ms", "decode_noticed_ms"):
        values = [r[key] for r in rows if key in r]
        if values:
            split["median"][key] = statistics.median(values)
    if rows:
        split["median"]["relay_ms"] = statistics.median(r["relay_ms"] for r in rows)
    return split


def _report_split(split: dict) -> None:
    """The pdhal mode's TTFT split, per request and its medians."""
    rows = split["requests"]
    print(
        "pdhal TTFT split per request (ms): router = client -> router forwards; queue = -> "
        "prefill step table; forward = -> last layer's signal; transfer = -> last layer "
        "landed in the decode cache; decode = -> the client's first token"
    )
    print(f"  {'request':14s} {'TTFT':>7s} " + " ".join(f"{h:>8s}" for h in PART_HEADS))
    for r in rows:
        mark = "" if r["landed_from"] == "streamer" else "  (landed: decode's record)"
        print(
            f"  {r['tid'][6:18]:14s} {r['ttft_ms']:7.1f} "
            + " ".join(f"{r[p]:8.2f}" for p in PARTS)
            + mark
        )
    if rows:
        med = split["median"]
        print(
            f"  {'median':14s} {med['ttft_ms']:7.1f} " + " ".join(f"{med[p]:8.2f}" for p in PARTS)
        )
        nan = float("nan")
        print(
            f"  of transfer: {med.get('transfer_wait_ms', nan):.2f} ms before the streamer "
            "was handed the last layer (the messager waking on its signal, or the decode "
            "side's late ask)"
        )
        print(
            f"  of decode: the decode worker noticed the landing "
            f"{med.get('decode_noticed_ms', nan):.2f} ms after it; the router's relay to the "
            f"client {med['relay_ms']:.2f} ms"
        )
    else:
        print("  no pdhal request could be paired with its traces")


def report(s: dict) -> None:
    st = s["setup"]
    print(
        f"vllm bench serve, random dataset: {st['prompts']} prompts x {st['input_len']} tokens "
        f"-> {st['output_len']} tokens, concurrency {st['concurrency']}, {st['rounds']} "
        f"round(s); tiny Llama, {st['layers']} layers, hidden {st['hidden']} "
        f"({st['kv_bytes_per_request'] / 2**20:.1f} MiB of KV per request); per mode the "
        "median over rounds of each run's own figures"
    )
    print(
        f"  {'mode':18s} {'TTFT med':>9s} {'TTFT p99':>9s} {'ITL med':>8s} {'req/s':>7s} "
        f"{'out tok/s':>9s}  decode computed"
    )
    for mode in s["modes"]:
        m = s["modes"][mode]
        print(
            f"  {LABELS[mode]:18s} {m['median_ttft_ms']:6.1f} ms {m['p99_ttft_ms']:6.1f} ms "
            f"{m['median_itl_ms']:5.1f} ms {m['request_throughput']:7.2f} "
            f"{m['output_throughput']:9.1f}  {m['decode_computed_prompt_tokens']:.0f} of "
            f"{m['prompt_tokens']} prompt tokens"
        )
    print(
        "  the prefilling server's own metrics, mean per request (vllm:request_queue_time and "
        "_prefill_time: queued, then scheduled -> first token):"
    )
    for mode in s["modes"]:
        m = s["modes"][mode]["prefill_server_mean_ms"]
        if m["queue"] is not None:
            print(
                f"    {LABELS[mode]:18s} queue {m['queue']:7.1f} ms  prefill {m['prefill']:7.1f} ms"
            )
    print("  CPU seconds each process group used during the mode's runs (all rounds):")
    for mode in s["modes"]:
        m = s["modes"][mode]
        used = ", ".join(f"{name} {sec:.1f}" for name, sec in m["cpu_s"].items())
        print(f"    {LABELS[mode]:18s} ({m['bench_duration_s']:.0f} s of runs): {used}")
    for key, r in s["ratios"].items():
        print(
            f"  {key:18s} TTFT {r['median_ttft']:.2f}x   request throughput "
            f"{r['request_throughput']:.2f}x   output throughput {r['output_throughput']:.2f}x"
        )
    if s["pdhal_ttft_split"] is not None:
        _report_split(s["pdhal_ttft_split"])
    elif "pdhal" in s["modes"]:
        print("pdhal ran untraced (--split traces it and splits its TTFT)")
    for mode, o in s["prefill_overlap"].items():
        if o and o["others_prefill_left_ms"] is not None:
            print(
                f"{LABELS[mode]} (its router's clock): {o['arrived_while_prefilling_another']} "
                f"of {o['requests']} requests reached the prefill server while it prefilled "
                f"another, which then had {o['others_prefill_left_ms']:.1f} ms left (median)"
            )
    for mode, ex in s["sequential_router"].items():
        if ex:
            print(
                f"{LABELS[mode]} (its router's clock, medians): prefill round trip "
                f"{ex['prefill_round_trip_ms']:.1f} ms, then the decode's first byte "
                f"{ex['decode_first_byte_after_prefill_ms']:.1f} ms later (the whole KV "
                "moved, then the first token)"
            )
    t = s["times"]
    print(
        f"servers up and warm in {t.get('start_s', 0):.0f} s, benchmark runs "
        f"{t.get('bench_s', 0):.0f} s"
    )
    if s["stop"]["killed"] or s["stop"]["leftovers_removed"]:
        print(
            f"at the end: killed after the bound: {s['stop']['killed']}; left in /dev/shm "
            f"and removed: {s['stop']['leftovers_removed']}"
        )
    print(
        "Absolute numbers on a shared 2-core machine mean little (every process of every mode "
        "and the client share two cores); the ratios, measured in one run on the same "
        "prompts, do."
    )


def _modes(text: str) -> tuple[str, ...]:
    modes = tuple(dict.fromkeys(m.strip() for m in text.split(",") if m.strip()))
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        raise argparse.ArgumentTypeError(f"modes are some of {', '.join(MODES)}; got {text!r}")
    return modes


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=1 if SMOKE else 2)
    parser.add_argument("--prompts", type=int, default=4 if SMOKE else 12)
    parser.add_argument("--input-len", type=int, default=100 if SMOKE else 300)
    parser.add_argument("--output-len", type=int, default=4 if SMOKE else 16)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="requests sent per second (Poisson, vllm bench serve's; default inf: each as "
        "soon as fewer than --concurrency are in flight)",
    )
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0, help="round r uses seed + r")
    parser.add_argument("--start-timeout", type=float, default=420.0, help="servers up, s")
    parser.add_argument("--run-timeout", type=float, default=300.0, help="one bench run, s")
    parser.add_argument(
        "--modes",
        type=_modes,
        default=DEFAULT_MODES,
        help=f"comma-separated, of {', '.join(MODES)} (default {','.join(DEFAULT_MODES)})",
    )
    parser.add_argument(
        "--pin",
        action=argparse.BooleanOptionalAction,
        default=(os.cpu_count() or 1) >= 2,
        help="each prefill server on core 0 and each decode server and messager on core 1 "
        "(taskset), as a deployment gives each its own accelerator; plain on core 0 "
        "(default: on, with 2 or more cores)",
    )
    parser.add_argument(
        "--split",
        action=argparse.BooleanOptionalAction,
        default=SMOKE,
        help="trace the pdhal mode (connector, messager) and split its TTFT; its ratios "
        "then carry the traces' cost, so they come from a run without (default: only "
        "with BENCH_SMOKE=1)",
    )
    parser.add_argument("--keep", default=None, help="keep logs and traces in this folder")
    parser.add_argument("--json", action="store_true", help="print everything as JSON")
    parser.add_argument("--client", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.client:  # the benchmark client this starts (client_main)
        return client_main()
    if args.input_len < 34 or (args.input_len - 1) % 32 == 0:
        # the ExampleConnector stores floor((n-1)/32)*32 tokens but looks for
        # floor((n-2)/32)*32: with n-1 a multiple of 32 its decode never finds them
        parser.error("--input-len must be at least 34 and not 1 more than a multiple of 32")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the finally blocks stop all
    from pdhal_vllm.testing import tiny

    cache = os.environ.get("PDHAL_VLLM_CACHE") or os.path.join(
        tempfile.gettempdir(), "pdhal-vllm-models"
    )
    model = tiny.cached(cache, layers=args.layers, hidden=args.hidden, heads=4, kv_heads=4)
    t = time.monotonic()
    try:
        if args.keep:
            os.makedirs(args.keep, exist_ok=True)
            out = run(args, args.keep, model)
        else:
            with tempfile.TemporaryDirectory(prefix="bench-vllm-") as root:
                out = run(args, root, model)
    except BenchError as exc:
        print(f"bench_vllm: {exc}", file=sys.stderr)
        return 1
    summary = summarize(args, out)
    summary["times"]["total_s"] = time.monotonic() - t
    if args.json:
        print(json.dumps(summary, indent=1))
    else:
        report(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
