"""Faults with real servers: a prefill `vllm serve` server and its messager, two decode
servers and the router (recomputing on a decode server when the prefill fails, and while
no prefill server is up) under a steady load of clients. One part dies mid-load: the
messager (then restarted), a decode server, the prefill server (each server killed whole:
API server, engine core and worker). Every request in flight ends within a bound, with the
right tokens or an error, never a hang; once the router saw the fault the survivors serve
every request; and vLLM's own metrics of every surviving server return to idle (no
request running or waiting, no KV block held): no block leaks on either side. The tests
run in order on the same servers."""

from __future__ import annotations

import threading
import time

import pytest
from servers import Served

from pdhal.testing.reset import remove_leftovers

PROMPTS = [
    f"request {i}: the decode side waits for the prefill side's cache " * 2 for i in range(8)
]

CLIENTS = 3
#: seconds within which a request in flight when the fault hit has ended
BOUND = 30.0
#: seconds after the fault (and any restart) by which the router routes around it (health
#: checks every 1 s) and a restarted messager serves again
SETTLE = 8.0
TOKENS = 24  # long enough that requests are decoding when the fault hits


@pytest.fixture(scope="module")
def served(tmp_path_factory, model_dir):
    s = Served(
        tmp_path_factory.mktemp("faults"),
        model_dir,
        "shm",
        decodes=2,
        plain=False,
        router_args=("--on-prefill-failure", "recompute", "--health-interval", "1"),
        dtype="float32",  # tokens under load equal tokens one at a time
    )
    yield s
    s.stop()
    assert remove_leftovers(s.namespace) == []  # nothing of a killed process stayed


@pytest.fixture(scope="module")
def expected(served) -> dict[str, str]:
    """Each prompt's tokens through the router before any fault."""
    return {p: served.complete("router", p, max_tokens=TOKENS) for p in PROMPTS}


class Load:
    """CLIENTS threads sending PROMPTS through the router, one request at a time each,
    until stopped: (prompt, start, end, outcome, text) of every request."""

    def __init__(self, served: Served):
        self.served, self.done = served, threading.Event()
        self.results: list[tuple] = []
        self.threads = [threading.Thread(target=self._client, args=(i,)) for i in range(CLIENTS)]
        for t in self.threads:
            t.start()

    def _client(self, i: int) -> None:
        n = i
        while not self.done.is_set():
            prompt = PROMPTS[n % len(PROMPTS)]
            n += CLIENTS
            start = time.monotonic()
            outcome, text = self.served.attempt(prompt, max_tokens=TOKENS)
            self.results.append((prompt, start, time.monotonic(), outcome, text))

    def stop(self) -> list[tuple]:
        self.done.set()
        for t in self.threads:
            t.join(150)
            assert not t.is_alive(), "a client hung"
        return self.results


def wait_running(served: Served, role: str, bound: float = 60) -> None:
    """Until `role` has a request running (the fault then hits one mid-flight)."""
    deadline = time.monotonic() + bound
    while served.metric(role, "vllm:num_requests_running") < 1:
        assert time.monotonic() < deadline, f"{role} never had a request running"
        time.sleep(0.05)


def under_load(served: Served, expected: dict, fault, busy: str) -> float:
    """Run the load, apply `fault` once `busy` has a request running, keep the load on past
    SETTLE; check every request's end and outcome. Returns when the fault hit."""
    load = Load(served)
    try:
        wait_running(served, busy)
        hit = time.monotonic()
        fault()
        done = time.monotonic()  # a restart is part of the fault
        time.sleep(SETTLE + 6)
    finally:
        results = load.stop()
    late = [r for r in results if r[1] > done + SETTLE]
    assert late, "no request was sent after the fault settled"
    for prompt, start, end, outcome, text in results:
        if start < hit:  # in flight when it hit: ended within the bound
            assert end - hit < BOUND, (prompt, end - hit, outcome, text)
        if outcome == "ok":
            assert text == expected[prompt], (prompt, text)
    failed = [r for r in late if r[3] != "ok"]
    assert not failed, (
        f"{len(failed)} of {len(late)} requests after the fault failed: {failed[0]}\n"
        f"--- the messager's and the prefill worker's links, s from the fault\n"
        + links(served, hit)
        + "".join(f"--- {role}.log (pdhal)\n{pdhal_lines(served, role)}" for role in PARTS)
    )
    return hit


#: whose logs a failure shows
PARTS = ("messager", "prefill", "decode")


def pdhal_lines(served: Served, role: str, most: int = 30) -> str:
    """The last `most` lines pdhal wrote in `role`'s log."""
    lines = [x for x in served.cluster.log(role, 100000).splitlines() if "pdhal" in x]
    return "\n".join(lines[-most:]) + "\n"


#: what the messager and the prefill worker trace of their link
LINK_EVENTS = {"listening", "hello", "ready", "refused", "messager_missing", "messager_back"}


def links(served: Served, since: float) -> str:
    """The messager's and the prefill worker's link events after `since` (a monotonic
    time: the traces' clock), in seconds from it: whether, and when, a restarted messager
    took the worker back, and if not, why."""
    events = sorted(
        (e["t"] / 1e9 - since, who, e["kind"], e.get("error", ""))
        for who in ("messager", "prefill0")
        for e in served.cluster.trace(who)
        if e["kind"] in LINK_EVENTS and e["t"] / 1e9 > since
    )
    return "".join(f"{t:+7.2f} {who} {kind} {why}\n" for t, who, kind, why in events)


def assert_idle(served: Served, roles, bound: float = 60) -> None:
    """vLLM's metrics of `roles` at their idle values: nothing running or waiting, no KV
    block in use."""
    deadline = time.monotonic() + bound
    for role in roles:
        while True:
            state = {
                name: served.metric(role, name)
                for name in (
                    "vllm:num_requests_running",
                    "vllm:num_requests_waiting",
                    "vllm:kv_cache_usage_perc",
                )
            }
            if not any(state.values()):
                break
            assert time.monotonic() < deadline, f"{role} never went idle: {state}"
            time.sleep(0.5)


def test_a_killed_messager_ends_its_transfers_and_a_restarted_one_is_served_again(served, expected):
    """The messager is SIGKILLed mid-load and restarted at once: the prefill worker
    releases what it held, reconnects, and streams through it again."""

    def fault():
        proc = served.cluster.procs["messager"]
        proc.kill()
        proc.wait(10)
        served.start_messager()

    under_load(served, expected, fault, "decode")
    assert_idle(served, ["prefill", "decode", "decode1"])
    streamed = moved(served)
    for prompt in PROMPTS[:2]:
        assert served.complete("router", prompt, max_tokens=TOKENS) == expected[prompt]
    assert moved(served) > streamed  # through the restarted messager
    assert [e for e in served.cluster.trace("prefill0") if e["kind"] == "messager_back"]


def moved(served: Served) -> float:
    """Prompt tokens the decode servers took from the prefill side."""
    return sum(
        served.metric(role, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
        for role in ("decode", "decode1")
    )


def test_a_killed_decode_server_ends_its_requests_and_the_other_serves_on(served, expected):
    """The prefill side frees the blocks of the killed server's requests: those it claimed
    when their session drops, those it had not claimed yet when the router saw their
    decode request fail (the router sends a request to both sides at once, so a prefill can
    end before its decode server, killed meanwhile, claimed it: the router abandons it at
    the messager), well before the messager's 120 s claim timeout."""
    under_load(served, expected, lambda: served.kill("decode1"), "decode1")
    assert_idle(served, ["prefill", "decode"])  # (within 60 s: the claim timeout is 120 s)


def test_a_killed_prefill_server_ends_its_requests_and_the_decode_side_serves_alone(
    served, expected
):
    """The router recomputes on the decode server: what it answers is the same tokens."""
    computed = served.metric("decode", "vllm:prompt_tokens_by_source_total", source="local_compute")
    under_load(served, expected, lambda: served.kill("prefill"), "decode")
    assert_idle(served, ["decode"])
    local = served.metric("decode", "vllm:prompt_tokens_by_source_total", source="local_compute")
    # whole prompts computed there now (through the P/D path, at most the last token each)
    assert local - computed > 2 * TOKENS
