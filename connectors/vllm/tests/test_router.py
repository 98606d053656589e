"""The router (`python -m pdhal_vllm.router`) in front of stand-in OpenAI servers, each its
own process (fake_openai.py): what each side is sent, what the client gets, the pick of the
least-loaded healthy instance, a failing prefill under both policies, an instance that dies
and comes back. The router against real `vllm serve` instances is in test_serve.py."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
from pdhal_vllm.wire import read_trace

from pdhal.testing.session_peers import KEY, Peer

FAKE = os.path.join(os.path.dirname(__file__), "fake_openai.py")


class Server:
    """A process printing its port on its first line."""

    def __init__(self, *command: str, env: dict | None = None, stderr=None):
        self.proc = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=stderr, text=True, env=env
        )
        line = self.proc.stdout.readline()
        assert line, f"{command} exited ({self.proc.wait()}) before it listened"
        self.port = int(line.rsplit(":", 1)[-1].strip().rstrip("/"))
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc.stdout.close()


class Fleet:
    """Stand-in instances and a router in front of them."""

    def __init__(self, tmp_path):
        self.tmp, self.servers, self.log = tmp_path, [], tmp_path / "requests.jsonl"
        self.log.touch()

    def fake(self, name: str, mode: str = "ok", port: int = 0) -> Server:
        server = Server(sys.executable, FAKE, name, mode, str(self.log), str(port))
        self.servers.append(server)
        return server

    def router(
        self, prefills, decodes, *extra: str, messagers=None, env=None, stderr=None
    ) -> Server:
        messagers = messagers or [f"127.0.0.1:{47000 + i}" for i in range(len(prefills))]
        args = [f"--prefill={p.url}={m}" for p, m in zip(prefills, messagers)]
        args += [f"--decode={d.url}" for d in decodes]
        server = Server(
            sys.executable,
            "-m",
            "pdhal_vllm.router",
            "--port",
            "0",
            "--health-interval",
            "0.2",
            *args,
            *extra,
            env=env,
            stderr=stderr,
        )
        self.servers.append(server)
        return server

    def seen(self, event: str = "request") -> list[dict]:
        lines = self.log.read_text().splitlines()
        return [e for e in map(json.loads, lines) if e["event"] == event]

    def stop(self) -> None:
        for server in reversed(self.servers):
            server.stop()


@pytest.fixture
def fleet(tmp_path):
    f = Fleet(tmp_path)
    yield f
    f.stop()


def post(router: Server, path: str, body, timeout: float = 30) -> tuple[int, bytes]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(
        router.url + path, data=data, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            return answer.status, answer.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def client(router: Server) -> subprocess.Popen:
    """A client, in a process of its own, waiting on one request through `router`."""
    return subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import urllib.request as u; u.urlopen(u.Request("
            f"'{router.url}/v1/completions', data=b'{{\"prompt\": \"x\"}}', headers="
            f"{{'Content-Type': 'application/json'}}), timeout=60)",
        ],
        stderr=subprocess.DEVNULL,
    )


def health(router: Server) -> dict:
    """The router's /health page (200 or 503): every instance's state."""
    try:
        with urllib.request.urlopen(router.url + "/health", timeout=10) as answer:
            return json.loads(answer.read())
    except urllib.error.HTTPError as e:
        assert e.code == 503
        return json.loads(e.read())


def until(condition, bound: float = 20.0):
    deadline = time.monotonic() + bound
    while not (value := condition()):
        assert time.monotonic() < deadline, "not within the bound"
        time.sleep(0.05)
    return value


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("stream", [False, True])
def test_each_request_goes_to_a_prefill_and_a_decode_paired_by_one_id(fleet, path, stream):
    prefill, decode = fleet.fake("p0"), fleet.fake("d0")
    router = fleet.router([prefill], [decode])
    body = {"model": "m", "prompt": "hi", "max_tokens": 8, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    status, answer = post(router, path, body)
    assert status == 200
    if stream:  # the decode instance's events, byte for byte
        assert answer == (
            b'data: {"choices": [{"text": "from"}]}\n\n'
            b'data: {"choices": [{"text": "d0"}]}\n\n'
            b"data: [DONE]\n\n"
        )
    else:
        assert json.loads(answer)["server"] == "d0"
    sent = {e["server"]: e for e in until(lambda: len(fleet.seen()) == 2 and fleet.seen())}
    to_prefill, to_decode = sent["p0"]["body"], sent["d0"]["body"]
    assert sent["p0"]["path"] == sent["d0"]["path"] == path
    assert to_prefill["max_tokens"] == 1 and "stream" not in to_prefill
    assert "stream_options" not in to_prefill
    tid = to_prefill["kv_transfer_params"]["pdhal_transfer_id"]
    assert to_prefill["kv_transfer_params"] == {"do_remote_decode": True, "pdhal_transfer_id": tid}
    assert to_decode["kv_transfer_params"] == {
        "do_remote_prefill": True,
        "pdhal_transfer_id": tid,
        "pdhal_messager": "127.0.0.1:47000",
    }
    assert {k: v for k, v in to_decode.items() if k != "kv_transfer_params"} == body


def test_a_request_goes_to_the_least_loaded_instances(fleet):
    """d0 holds a request (it answers after 30 s): the next two go to d1, each paired with
    a prefill, the two prefills taking turns only by load (both idle: the first listed)."""
    prefills = [fleet.fake("p0"), fleet.fake("p1")]
    slow, fast = fleet.fake("d0", "slow"), fleet.fake("d1")
    router = fleet.router(prefills, [slow, fast])
    held = client(router)
    try:
        until(lambda: any(e["server"] == "d0" for e in fleet.seen()))
        for _ in range(2):
            status, answer = post(router, "/v1/completions", {"prompt": "y", "max_tokens": 2})
            assert status == 200 and json.loads(answer)["server"] == "d1"
    finally:
        held.kill()
        held.wait()
    decodes = [e["server"] for e in fleet.seen() if e["server"].startswith("d")]
    assert decodes == ["d0", "d1", "d1"]
    # the held request's prefill answered at once: p0 was idle again each time
    assert [e["server"] for e in fleet.seen() if e["server"].startswith("p")] == ["p0"] * 3


def test_a_client_that_hangs_up_has_both_instances_abort_its_request(fleet):
    """Both instances still working on it (slow) when the client goes: the router closes
    both its requests at once (vLLM then aborts each and frees its KV), not when an answer
    finds no client to take it."""
    prefill, decode = fleet.fake("p0", "slow"), fleet.fake("d0", "slow")
    router = fleet.router([prefill], [decode])
    hung_up = client(router)
    until(lambda: len(fleet.seen()) == 2)  # both instances have it
    hung_up.kill()
    hung_up.wait()
    cancelled = until(lambda: len(fleet.seen("cancelled")) == 2 and fleet.seen("cancelled"))
    assert sorted(e["server"] for e in cancelled) == ["d0", "p0"]
    # counted out, and neither instance blamed for the client's going
    state = until(lambda: (h := health(router)) and h["decode"][0]["in_flight"] == 0 and h)
    assert all(i["in_flight"] == 0 and i["healthy"] for i in state["prefill"] + state["decode"])


@pytest.mark.parametrize("policy", ["error", "recompute"])
def test_a_failing_prefill_cancels_the_decode_and_the_policy_answers(fleet, policy):
    """The decode request (waiting for KV that never comes) is cancelled before the client
    got a byte; "error": the prefill instance's status, naming it; "recompute": the
    client's request again on a decode instance, without transfer params."""
    prefill, decode = fleet.fake("p0", "fail"), fleet.fake("d0")
    router = fleet.router([prefill], [decode], "--on-prefill-failure", policy)
    body = {"prompt": "z", "max_tokens": 3}
    status, answer = post(router, "/v1/completions", body)
    if policy == "error":
        assert status == 500  # the prefill instance's own status
        message = json.loads(answer)["error"]["message"]
        assert f"prefill instance {prefill.url}: answered 500" in message and "p0 fails" in message
    else:
        assert status == 200 and json.loads(answer)["server"] == "d0"
        asked = [e["body"] for e in fleet.seen() if e["server"] == "d0"]
        assert len(asked) == 2 and asked[1] == body  # no transfer params: it prefills itself
    cancelled = until(lambda: fleet.seen("cancelled"))
    assert [e["server"] for e in cancelled] == ["d0"]
    assert cancelled[0]["body"]["kv_transfer_params"]["do_remote_prefill"]


def test_an_instance_slow_to_answer_its_health_check_is_not_failed_for_it(fleet):
    """Its /health takes 1 s (a busy server's may), five checks an interval of 0.2 s:
    it stays healthy and gets every request, as long as it answers within
    --health-timeout."""
    prefill, decode = fleet.fake("p0", "slowhealth"), fleet.fake("d0", "slowhealth")
    router = fleet.router([prefill], [decode])
    time.sleep(2.5)  # two slow checks of each have come and gone
    state = health(router)
    assert all(i["healthy"] for i in state["prefill"] + state["decode"]), state
    status, answer = post(router, "/v1/completions", {"prompt": "y", "max_tokens": 2})
    assert status == 200 and json.loads(answer)["server"] == "d0", answer


def test_a_dead_instance_gets_no_request_until_it_is_back(fleet):
    prefill, d0, d1 = fleet.fake("p0"), fleet.fake("d0"), fleet.fake("d1")
    router = fleet.router([prefill], [d0, d1])
    d0.proc.kill()
    d0.proc.wait()
    states = until(lambda: (h := health(router)) and not h["decode"][0]["healthy"] and h)
    assert "health check failed" in states["decode"][0]["why"]
    for _ in range(3):
        status, answer = post(router, "/v1/completions", {"prompt": "w"})
        assert status == 200 and json.loads(answer)["server"] == "d1"
    d1.proc.kill()
    d1.proc.wait()
    until(lambda: not any(d["healthy"] for d in health(router)["decode"]))
    status, answer = post(router, "/v1/completions", {"prompt": "w"})
    assert status == 503 and "no healthy decode instance" in json.loads(answer)["error"]["message"]
    with pytest.raises(urllib.error.HTTPError) as failed:
        urllib.request.urlopen(router.url + "/health", timeout=10)
    assert failed.value.code == 503
    fleet.fake("d0", port=d0.port)  # back, where the router knows it
    until(lambda: health(router)["decode"][0]["healthy"])
    status, answer = post(router, "/v1/completions", {"prompt": "w"})
    assert status == 200 and json.loads(answer)["server"] == "d0"


@pytest.mark.parametrize("policy", ["error", "recompute"])
def test_with_every_prefill_instance_down_the_policy_answers_at_once(fleet, policy):
    """ "recompute": the decode instances serve alone (the client's request as it came, no
    transfer params); "error": 503 naming the prefill instance and why it is down."""
    prefill, decode = fleet.fake("p0"), fleet.fake("d0")
    router = fleet.router([prefill], [decode], "--on-prefill-failure", policy)
    prefill.proc.kill()
    prefill.proc.wait()
    body = {"prompt": "v", "max_tokens": 2}

    def prefill_down():
        try:
            urllib.request.urlopen(router.url + "/health", timeout=10)
        except urllib.error.HTTPError as e:
            return e.code == 503 and not json.loads(e.read())["prefill"][0]["healthy"]
        return False

    until(prefill_down)
    status, answer = post(router, "/v1/completions", body)
    if policy == "recompute":
        assert status == 200 and json.loads(answer)["server"] == "d0"
        # the decode instance was asked once, as the client asked: nothing was cancelled
        assert [e["body"] for e in fleet.seen() if e["server"] == "d0"] == [body]
        assert fleet.seen("cancelled") == []
    else:
        message = json.loads(answer)["error"]["message"]
        assert status == 503 and f"no healthy prefill instance: {prefill.url}" in message
        assert fleet.seen() == []


def test_sequential_sends_the_decode_once_the_prefill_answered_and_the_trace_says_so(fleet):
    prefill, decode = fleet.fake("p0"), fleet.fake("d0")
    trace = fleet.tmp / "router.jsonl"
    router = fleet.router([prefill], [decode], "--sequential", "--trace", str(trace))
    status, answer = post(router, "/v1/completions", {"prompt": "u", "max_tokens": 2})
    assert status == 200 and json.loads(answer)["server"] == "d0"
    events = [json.loads(line) for line in fleet.log.read_text().splitlines()]
    order = [(e["server"], e["event"]) for e in events]
    assert order.index(("p0", "prefilled")) < order.index(("d0", "request")), order

    def traced():  # "done" is written once the answer went, maybe after the client read it
        lines = [json.loads(line) for line in trace.read_text().splitlines()]
        return lines if lines and lines[-1]["kind"] == "done" else None

    steps = until(traced)
    assert [e["kind"] for e in steps] == ["received", "forwarded", "prefilled", "first", "done"]
    assert len({e["tid"] for e in steps}) == 1
    assert [e["t"] for e in steps] == sorted(e["t"] for e in steps)


def test_a_body_that_is_not_a_json_object_is_refused(fleet):
    router = fleet.router([fleet.fake("p0")], [fleet.fake("d0")])
    for body in (b"not json", b"[1, 2]"):
        status, answer = post(router, "/v1/completions", body)
        assert status == 400 and b"must be a JSON object" in answer
    assert fleet.seen() == []


def test_bad_instances_on_the_command_line_are_refused():
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pdhal_vllm.router",
            "--prefill",
            "http://h:1",
            "--decode",
            "http://h:2",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 2 and "a prefill instance is URL=MESSAGER" in run.stderr


def test_params_from_the_prefill_go_to_the_decode_as_vllms_proxy_does(fleet):
    """--kv-transfer-params prefill (any vLLM connector, NixlConnector's way): the prefill
    is asked for do_remote_decode alone, and its answer's kv_transfer_params go to the
    decode once it answered; no messager is needed."""
    prefill, decode = fleet.fake("p0"), fleet.fake("d0")
    bare = Server(
        sys.executable, "-m", "pdhal_vllm.router", "--port", "0", "--prefill", prefill.url,
        "--decode", decode.url, "--kv-transfer-params", "prefill",
    )  # fmt: skip
    fleet.servers.append(bare)
    for stream in (False, True):
        status, answer = post(bare, "/v1/completions", {"prompt": "a", "stream": stream})
        assert status == 200 and b"d0" in answer
    sent = fleet.seen()
    to_prefill = [e["body"] for e in sent if e["server"] == "p0"]
    to_decode = [e["body"] for e in sent if e["server"] == "d0"]
    assert [b["kv_transfer_params"] for b in to_prefill] == [{"do_remote_decode": True}] * 2
    assert [b["kv_transfer_params"] for b in to_decode] == [
        {"do_remote_prefill": True, "remote_engine_id": "p0", "remote_request_id": f"p0-{i}"}
        for i in (0, 1)
    ]
    events = [json.loads(line) for line in fleet.log.read_text().splitlines()]
    order = [(e["server"], e["event"], e.get("tid")) for e in events]
    for i in (0, 1):  # each decode request went once its prefill answered
        assert (
            order.index(("p0", "prefilled", f"p0-{i}"))
            < [n for n, e in enumerate(events) if e["server"] == "d0"][i]
        )


def test_a_prefill_answer_without_params_meets_the_policy(fleet, tmp_path):
    """A prefill instance whose connector is no kv_producer answers without
    kv_transfer_params: that is its failure, and the policy answers."""
    plain, decode = fleet.fake("p0", "noparams"), fleet.fake("d0")
    router = Server(
        sys.executable, "-m", "pdhal_vllm.router", "--port", "0", "--prefill", plain.url,
        "--decode", decode.url, "--kv-transfer-params", "prefill",
        "--on-prefill-failure", "error",
    )  # fmt: skip
    fleet.servers.append(router)
    status, answer = post(router, "/v1/completions", {"prompt": "a"})
    message = json.loads(answer)["error"]["message"]
    assert status == 502 and "answered without kv_transfer_params" in message, message
    assert [e["server"] for e in fleet.seen()] == ["p0"]  # the decode was never asked


def test_a_messager_that_cannot_be_told_is_warned_about_once_per_outage(fleet, tmp_path):
    """Every decode request fails while the prefill's messager is down: the router warns
    once that it could not tell it, not once per request; once a messager listens there
    again and is told, it says how many it missed, and the next outage is warned about
    again."""
    with socket.socket() as probe:  # an address nobody listens on, for now
        probe.bind(("127.0.0.1", 0))
        messager = f"127.0.0.1:{probe.getsockname()[1]}"
    trace, errors = tmp_path / "trace.jsonl", open(tmp_path / "router.err", "w")
    env = dict(os.environ, PDHAL_VLLM_KEY=KEY.hex())
    router = fleet.router(
        [fleet.fake("p0")], [fleet.fake("d0", "fail")], "--trace", str(trace),
        messagers=[messager], env=env, stderr=errors,
    )  # fmt: skip

    def fail_requests(count: int, told: bool) -> None:
        before = len(_abandoned(trace))
        for _ in range(count):
            assert post(router, "/v1/completions", {"prompt": "w", "max_tokens": 2})[0] == 500
        until(lambda: len(_abandoned(trace)) == before + count)
        assert [e["told"] for e in _abandoned(trace)[before:]] == [told] * count

    def said(text: str) -> int:
        return (tmp_path / "router.err").read_text().count(text)

    fail_requests(4, told=False)
    assert said(f"could not tell the messager at {messager}") == 1
    service = Peer("prefill", "--listen", messager)
    try:
        service.read("listening")
        fail_requests(1, told=True)
        assert said(f"told the messager at {messager} again; 4 abandons could not be told") == 1
    finally:
        service.close()
    fail_requests(2, told=False)
    assert said(f"could not tell the messager at {messager}") == 2
    errors.close()


def _abandoned(trace) -> list[dict]:
    """The router's "abandoned" events, in order."""
    return [e for e in read_trace(str(trace)) if e["kind"] == "abandoned"]


@pytest.mark.parametrize("decode_mode", ["fail", "killed"])
def test_a_failed_decode_has_the_prefills_messager_abandon_its_transfer(fleet, decode_mode):
    """The decode instance answers 500, or is killed while it has the request, after the
    prefill instance answered: the router (holding the deployment's key) tells the
    prefill's messager, a real pdhal.transfer.PrefillService in a process of its own, that
    the transfer's decode side will never claim it. It fails at once, naming the decode
    instance, not at its 600 s claim lease."""
    service = Peer("prefill", "--claim-timeout", "600")
    try:
        [messager] = service.read("listening")
        prefill = fleet.fake("p0")
        decode = fleet.fake("d0", "fail" if decode_mode == "fail" else "slow")
        env = dict(os.environ, PDHAL_VLLM_KEY=KEY.hex())
        router = fleet.router([prefill], [decode], messagers=[messager], env=env)
        if decode_mode == "fail":
            status, _ = post(router, "/v1/completions", {"prompt": "w", "max_tokens": 2})
            assert status == 500
        else:
            waiting = client(router)
            until(lambda: len(fleet.seen()) == 2 and fleet.seen("prefilled"))
            decode.proc.kill()  # its connection drops with the request on it
            assert waiting.wait(30) != 0
        [asked] = [e["body"] for e in fleet.seen() if e["server"] == "p0"]
        tid = asked["kv_transfer_params"]["pdhal_transfer_id"]
        service.send("add", tid, [5], 4)  # (the word may come before or after it: both end it)
        assert service.read("added") == [tid]
        request, landed, why = service.read("outcome", bound=30)
        assert (request, landed) == (tid, False)
        assert f"will never claim it (decode instance {decode.url}" in why, why
    finally:
        service.close()
