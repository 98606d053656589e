"""`vllm serve` processes as their users run them, for the tests: a prefill and decode
servers with the pdhal connector (API server, engine core and worker each their own process,
but for a decode server's worker, which runs in its engine core's process as the connector's
docs advise: SLEEPING_DECODE_ARGS; started as `python -m pdhal_vllm.vllm_cli serve`, vLLM's own
CLI, whose `vllm` script cannot start with vLLM's CPU build), the prefill server's
messager, an optional plain server, and the router in front. Each server is a process
group of its own, so a test can kill one whole, as a machine or a container dies."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from conftest import PY, Cluster, free_ports
from pdhal_vllm.config import SLEEPING_DECODE_ARGS, SLEEPING_DECODE_ENV, kv_transfer_config

from pdhal.testing.reset import segments_of

MAX_TOKENS = 8


class Served:
    """The servers, each with its URL and log: "prefill", "prefill1", ... each with its
    messager ("messager", "messager1", ..., each on a port of its own that a restarted one
    takes again), "decode", "decode1", ... and "plain"; all in one pdhal namespace, as an
    xPyD node runs them: prefill server i on device i (PDHAL_CPU_VISIBLE_DEVICES, as
    CUDA_VISIBLE_DEVICES gives each GPU server its own), whose layer-signal channel is
    named by it. Each server's worker runs one unbound torch thread
    (vLLM's CPU build otherwise binds every server's OpenMP threads to the same cores,
    where they spin-wait on each other: steps of 15-40 s were seen here with four servers
    on two cores)."""

    def __init__(
        self,
        root,
        model: str,
        transport: str,
        *,
        prefills: int = 1,
        decodes: int = 1,
        plain: bool = True,
        router_args: tuple[str, ...] = (),
        hosts=None,
        dtype: str = "bfloat16",
        messager_args: tuple[str, ...] = (),
        block_sizes: dict[str, int] | None = None,
    ):
        """`hosts` (pdhal.testing.netns.TwoHosts): the last decode server runs in the
        other network namespace, as on another host (Mooncake across the veth pair).
        `dtype`: the model's and the KV cache's; float32 where tokens under concurrent load
        are compared with tokens computed one request at a time (in bfloat16 a batch rounds
        differently, and the tiny model's greedy tokens of one prompt already differ on a
        plain server). `messager_args`: more of the messager's options. `block_sizes`: a
        server's --block-size where it is not 32 (by role: "prefill1", "decode1")."""
        self.cluster = Cluster(root, model, os.urandom(16).hex())
        self.namespace = f"serve{os.getpid()}{transport}{prefills}{decodes}"
        self.cluster.env |= {
            "PDHAL_NAMESPACE": self.namespace,
            "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
            "VLLM_CPU_OMP_THREADS_BIND": "nobind",
            "OMP_NUM_THREADS": "1",
        }
        self.model, self.transport, self.dtype = model, transport, dtype
        self.messager_args = messager_args
        self.block_sizes = block_sizes or {}
        self.urls: dict[str, str] = {}
        self.procs: dict[str, subprocess.Popen] = {}
        self.hosts = hosts
        here = hosts.prefill_ip if hosts else "127.0.0.1"
        self.prefills = [f"prefill{i or ''}" for i in range(prefills)]
        self.decodes = [f"decode{i or ''}" for i in range(decodes)]
        self.messagers = [f"{here}:{free_ports()}" for _ in self.prefills]
        self.messager = self.messagers[0]
        self.router: subprocess.Popen | None = None
        try:
            self._start(plain, router_args)
        except BaseException:
            self.stop()  # what started: no server outlives a failed start
            raise

    def _start(self, plain: bool, router_args) -> None:
        decoders = self.decodes
        for index in range(len(self.prefills)):
            self.start_messager(index)
        if plain:
            self._serve("plain", None)
        for index, (role, messager) in enumerate(zip(self.prefills, self.messagers)):
            config = {"kv_role": "kv_producer", "extra": {"messager": messager}}
            env = {"PDHAL_CPU_VISIBLE_DEVICES": str(index)}
            self._serve(role, config, env=env, options=("--enable-log-requests",))
        for role in decoders:
            extra = {"transport": self.transport}
            there = self.hosts is not None and role == decoders[-1]
            if there:
                extra["transport_options"] = {"host": self.hosts.decode_ip}
            config = {"kv_role": "kv_consumer", "extra": extra}
            self._serve(role, config, there, SLEEPING_DECODE_ENV, SLEEPING_DECODE_ARGS)
        for role in self.urls:
            self.wait_healthy(role)
        router_log = open(self.cluster.path("router.log"), "w")
        self.router = subprocess.Popen(
            [
                PY,
                "-m",
                "pdhal_vllm.router",
                "--port",
                "0",
                *(f"--prefill={self.urls[r]}={m}" for r, m in zip(self.prefills, self.messagers)),
                *(f"--decode={self.urls[r]}" for r in decoders),
                *router_args,
            ],
            env=self.cluster.env,
            stdout=subprocess.PIPE,
            stderr=router_log,
            text=True,
        )
        line = self.router.stdout.readline()
        assert "listening on" in line, line + self.log("router")
        self.urls["router"] = line.split()[-1]

    def start_messager(self, index: int = 0) -> None:
        """(Re)start prefill server `index`'s messager, at its address."""
        host = ("--transport-option", f"host={self.hosts.prefill_ip}") if self.hosts else ()
        self.cluster.start_messager(
            "--transport",
            self.transport,
            *host,
            *self.messager_args,
            listen=self.messagers[index],
            name=f"messager{index or ''}",
        )

    def _serve(
        self,
        role: str,
        config: dict | None,
        there: bool = False,
        env: dict | None = None,
        options: tuple[str, ...] = (),
    ) -> None:
        port = free_ports()
        args = [
            PY,
            "-m",
            "pdhal_vllm.vllm_cli",
            "serve",
            self.model,
            "--port",
            str(port),
            "--block-size",
            str(self.block_sizes.get(role, 32)),
            "--max-model-len",
            "512",
            "--enforce-eager",
            "--seed",
            "0",
            "--dtype",
            self.dtype,
            "--no-enable-prefix-caching",
            *options,
        ]
        if config is not None:
            args += [
                "--kv-transfer-config",
                json.dumps(
                    kv_transfer_config(
                        config["kv_role"], **config["extra"], trace=self.cluster.path("trace")
                    )
                ),
            ]
        if there:
            args = [*self.hosts.there_prefix, *args]
        log = open(self.cluster.path(f"{role}.log"), "w")
        self.procs[role] = subprocess.Popen(
            args,
            env=self.cluster.env | (env or {}),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        host = self.hosts.decode_ip if there else "127.0.0.1"
        self.urls[role] = f"http://{host}:{port}"

    def wait_healthy(self, role: str, bound: float = 600) -> None:
        deadline = time.monotonic() + bound
        while True:
            assert self.procs[role].poll() is None, f"{role} exited:\n{self.log(role)}"
            try:
                with urllib.request.urlopen(self.urls[role] + "/health", timeout=5) as answer:
                    if answer.status == 200:
                        return
            except OSError:
                pass
            assert time.monotonic() < deadline, f"{role} not up in {bound} s:\n{self.log(role)}"
            time.sleep(1)

    def log(self, role: str) -> str:
        return self.cluster.log(role, 60)

    def aborts(self, role: str) -> int:
        """How many aborts `role`'s API server logged (a prefill server logs its requests)."""
        with open(self.cluster.path(f"{role}.log"), errors="replace") as log:
            return log.read().count("Aborted request")

    def engine_core(self, role: str) -> int:
        """The pid of `role`'s engine core: the process of its group vLLM titled so."""
        group = self.procs[role].pid
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
                    title = cmdline.read()
                if title.startswith(b"VLLM::EngineCore") and os.getpgid(int(pid)) == group:
                    return int(pid)
            except (FileNotFoundError, ProcessLookupError):
                continue  # a process that ended while we looked
        raise AssertionError(f"{role} has no engine core process:\n{self.log(role)}")

    def complete(
        self,
        role: str,
        prompt: str,
        stream: bool = False,
        max_tokens: int = MAX_TOKENS,
        kv_transfer_params: dict | None = None,
    ) -> str:
        body = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": stream,
        }
        if kv_transfer_params is not None:
            body["kv_transfer_params"] = kv_transfer_params
        request = urllib.request.Request(
            self.urls[role] + "/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=120) as answer:
            raw = answer.read().decode()
        if not stream:
            return json.loads(raw)["choices"][0]["text"]
        events = [line[6:] for line in raw.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]", raw
        return "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])

    def pair(self, prefill: int, decode: str, prompt: str, tid: str) -> str:
        """`prompt` prefilled on prefill server `prefill` (its index) and decoded on server
        `decode`, both asked at once with the kv_transfer_params a router sends: the text."""
        to_prefill = {"do_remote_decode": True, "pdhal_transfer_id": tid}
        to_decode = {
            "do_remote_prefill": True,
            "pdhal_transfer_id": tid,
            "pdhal_messager": self.messagers[prefill],
        }
        with ThreadPoolExecutor(1) as pool:
            prefilled = pool.submit(
                self.complete,
                self.prefills[prefill],
                prompt,
                max_tokens=1,
                kv_transfer_params=to_prefill,
            )
            text = self.complete(decode, prompt, kv_transfer_params=to_decode)
            prefilled.result()
        return text

    def attempt(self, prompt: str, max_tokens: int = MAX_TOKENS) -> tuple[str, str]:
        """("ok", text) or ("error", why) of one request through the router."""
        try:
            return "ok", self.complete("router", prompt, max_tokens=max_tokens)
        except urllib.error.HTTPError as e:
            return "error", f"HTTP {e.code}: {e.read().decode(errors='replace')[:300]}"
        except (OSError, ValueError, KeyError, AssertionError) as e:
            return "error", f"{type(e).__name__}: {e}"

    def metric(self, role: str, name: str, **labels: str) -> float:
        """The sum of a metric's samples in `role`'s /metrics with these labels."""
        with urllib.request.urlopen(self.urls[role] + "/metrics", timeout=30) as answer:
            text = answer.read().decode()
        total = 0.0
        for line in text.splitlines():
            if not line.startswith(name + "{"):
                continue
            head, value = line.rsplit(" ", 1)
            if all(f'{k}="{v}"' in head for k, v in labels.items()):
                total += float(value)
        return total

    def kill(self, role: str) -> None:
        """SIGKILL server `role` whole: its API server, engine core and workers."""
        proc = self.procs[role]
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)

    def stop(self) -> None:
        every = [p for p in (self.router, *self.procs.values()) if p is not None]
        for proc in every:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in every:
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for proc in self.procs.values():  # what a server's group may have left
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self._wait_reclaimed()
        self.cluster.stop()

    def _messagers(self) -> list[subprocess.Popen]:
        return [p for name, p in self.cluster.procs.items() if name.startswith("messager")]

    def messagers_own(self, segments: list[str]) -> bool:
        """Whether each of `segments` is one of the messagers' own."""
        pids = [proc.pid for proc in self._messagers()]
        return all(any(f".{pid}." in name for pid in pids) for name in segments)

    def _wait_reclaimed(self, bound: float = 30.0) -> None:
        """Until the messagers removed what the servers' force-killed workers left (once
        each worker they served exits), before they stop too."""
        messagers = self._messagers()
        deadline = time.monotonic() + bound
        while messagers and all(m.poll() is None for m in messagers):
            if time.monotonic() > deadline:
                return
            if self.messagers_own(segments_of(self.namespace)):
                return
            time.sleep(0.2)
