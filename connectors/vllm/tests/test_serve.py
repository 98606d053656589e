"""vLLM as its users run it, over shm and over Mooncake: `vllm serve` processes (API
server, engine core and worker each their own process; started as `python -m
pdhal_vllm.vllm_cli serve`, vLLM's own CLI, whose `vllm` script cannot start with vLLM's CPU
build), a messager, the router in front, and vLLM's own `vllm bench serve` client on its
random dataset. Beside them a plain server (no connector) gives the reference outputs. The
last test stops the servers as their users do (SIGTERM, vLLM's default shutdown
force-killing its workers) and counts /dev/shm."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.request

import pytest
from conftest import PY, Cluster, free_ports

from pdhal.testing.reset import remove_leftovers, segments_of

PROMPTS = [
    "prefill and decode run on different machines",
    "the quick brown fox jumps over the lazy dog and the cache moves between them " * 3,
    "0123456789 abcdefghijklmnopqrstuvwxyz",
]
MAX_TOKENS = 8


class Served:
    """The servers, each with its port and log."""

    def __init__(self, root, model: str, transport: str):
        self.cluster = Cluster(root, model, os.urandom(16).hex())
        self.namespace = f"serve{os.getpid()}{transport}"
        env = self.cluster.env
        env |= {"PDHAL_NAMESPACE": self.namespace, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
        self.model, self.urls, self.procs = model, {}, {}
        messager = self.cluster.start_messager("--transport", transport)
        for role, config in (
            ("plain", None),
            ("prefill", {"kv_role": "kv_producer", "extra": {"messager": messager}}),
            ("decode", {"kv_role": "kv_consumer", "extra": {"transport": transport}}),
        ):
            self._serve(role, config)
        for role in self.urls:
            self._wait_healthy(role)
        router_log = open(self.cluster.path("router.log"), "w")
        self.router = subprocess.Popen(
            [
                PY,
                "-m",
                "pdhal_vllm.router",
                "--port",
                "0",
                f"--prefill={self.urls['prefill']}={messager}",
                f"--decode={self.urls['decode']}",
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=router_log,
            text=True,
        )
        line = self.router.stdout.readline()
        assert "listening on" in line, line + self.log("router")
        self.urls["router"] = line.split()[-1]

    def _serve(self, role: str, config: dict | None) -> None:
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
            "32",
            "--max-model-len",
            "512",
            "--enforce-eager",
            "--seed",
            "0",
            "--dtype",
            "bfloat16",
            "--no-enable-prefix-caching",
        ]
        if config is not None:
            args += [
                "--kv-transfer-config",
                json.dumps(
                    {
                        "kv_connector": "PdhalConnector",
                        "kv_connector_module_path": "pdhal_vllm.connector",
                        "kv_role": config["kv_role"],
                        "kv_load_failure_policy": "fail",
                        "kv_connector_extra_config": config["extra"]
                        | {"trace": self.cluster.path("trace")},
                    }
                ),
            ]
        log = open(self.cluster.path(f"{role}.log"), "w")
        self.procs[role] = subprocess.Popen(
            args, env=self.cluster.env, stdout=log, stderr=subprocess.STDOUT
        )
        self.urls[role] = f"http://127.0.0.1:{port}"

    def _wait_healthy(self, role: str, bound: float = 600) -> None:
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

    def complete(self, role: str, prompt: str, stream: bool = False) -> str:
        body = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "stream": stream,
        }
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

    def metric(self, role: str, name: str, **labels: str) -> float:
        """The sum of a counter's samples in `role`'s /metrics with these labels."""
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

    def stop(self) -> None:
        for proc in [self.router, *self.procs.values()]:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in [self.router, *self.procs.values()]:
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.cluster.stop()


@pytest.fixture(scope="module", params=["shm", "mooncake"])
def served(request, tmp_path_factory, model_dir):
    s = Served(tmp_path_factory.mktemp("serve"), model_dir, request.param)
    yield s
    s.stop()
    remove_leftovers(s.namespace)


@pytest.mark.parametrize("stream", [False, True])
def test_outputs_through_the_router_equal_a_plain_server_s(served, stream):
    for prompt in PROMPTS:
        assert served.complete("router", prompt, stream) == served.complete("plain", prompt)


def test_vllm_s_own_benchmark_client_completes_every_request(served, tmp_path):
    """`vllm bench serve` on its random dataset through the router: every request
    completes, and the decode server computed no prompt token but the last of each (vLLM
    always computes that one itself): the rest came from the prefill server."""
    local = served.metric("decode", "vllm:prompt_tokens_by_source_total", source="local_compute")
    requests = served.metric("decode", "vllm:request_success_total")
    run = subprocess.run(
        [
            PY,
            "-m",
            "pdhal_vllm.vllm_cli",
            "bench",
            "serve",
            "--backend",
            "openai",
            "--base-url",
            served.urls["router"],
            "--model",
            served.model,
            "--tokenizer",
            served.model,
            "--dataset-name",
            "random",
            "--random-input-len",
            "100",
            "--random-output-len",
            "4",
            "--num-prompts",
            "12",
            "--max-concurrency",
            "3",
            "--ignore-eos",
            "--save-result",
            "--result-dir",
            str(tmp_path),
            "--result-filename",
            "bench.json",
        ],
        env=served.cluster.env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads((tmp_path / "bench.json").read_text())
    assert result["completed"] == 12 and result.get("failed", 0) == 0, result
    done = served.metric("decode", "vllm:request_success_total") - requests
    computed = (
        served.metric("decode", "vllm:prompt_tokens_by_source_total", source="local_compute")
        - local
    )
    assert done == 12 and computed <= done, (done, computed)
    moved = served.metric(
        "decode", "vllm:prompt_tokens_by_source_total", source="external_kv_transfer"
    )
    assert moved >= 12 * 99, moved


def test_sigterm_leaves_nothing_behind(served):
    """Stopped as users stop them (SIGTERM; vLLM's default shutdown force-kills the
    workers, so their own clean-up never runs): the messager removes what the dead
    workers left, and the namespace is empty once everything stopped."""
    assert segments_of(served.namespace)  # the servers' KV caches, while they run
    for role in ("prefill", "decode", "plain"):
        served.procs[role].send_signal(signal.SIGTERM)
    for role in ("prefill", "decode", "plain"):
        assert served.procs[role].wait(120) is not None
    deadline = time.monotonic() + 30
    while (left := segments_of(served.namespace)) and time.monotonic() < deadline:
        time.sleep(0.2)
    messager_pid = str(served.cluster.procs["messager"].pid)
    assert all(f".{messager_pid}." in name for name in left), left  # only the messager's own
    served.stop()
    assert segments_of(served.namespace) == []
