"""The parent of `pdhal demo`: plans, starts the three processes, routes events, reports.

decoder, then worker, then messager are started (each needs what the previous one made),
the decoder is told where each rank's messager serves (it claims the requests from them in
pdhal.transfer's session, with a key this parent makes), then the worker is told to go. A
request is handed to the decoder once the messager has sent its last block and the worker
has produced its first token.
"""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from multiprocessing.connection import wait

import pdhal
from pdhal_demo.control import DemoError, Hub, require_mooncake
from pdhal_demo.plan import Plan
from pdhal_demo.report import Timeline, summarize

SILENCE_TIMEOUT_S = 120.0  # no event from any process for this long: report a hang
REPORT_GRACE_S = 5.0  # after a process dies, how long the others get to report it
REMOTE_WAIT_S = 300.0  # how long to wait for a decoder started by hand
CONNECT_WAIT_S = 120.0  # how long a process launched here may take to connect


@dataclass
class Options:
    host: str = "127.0.0.1"
    protocol: str = "tcp"
    #: Start no decoder here: wait for one started by hand (on another host) to connect.
    remote_decoder: bool = False
    control_host: str = "127.0.0.1"  # where the control listener binds (remote decoder)
    fault: str | None = None  # "kill-messager" / "kill-worker" / "kill-decoder": mid first step
    progress: bool = True
    inflight: int = 4  # layers in flight at once (the streamer's max_layers_in_flight)
    transfer_timeout_s: float = 5.0  # a transfer not landed by then fails (stall_timeout)
    slow_ms: dict[int, float] = field(default_factory=dict)  # rank -> a slow link's delay
    #: The backend the decoder runs on (PDHAL_PLATFORM there); None: the prefill's.
    decode_platform: str | None = None
    #: per_query: each step one PrefillService.follow, no call per layer (shm only)
    follow: bool = False


class Progress:
    """A live line per request: how far its prefill got (tokens, layers of its current
    chunk), how far sending it got, and when it was on decode.

    The two counts come from two processes over two connections, which the parent reads in
    whatever order they become readable: a transfer may be read before the worker's event
    for the layer it sent. The messager sends only what a layer signal made ready, so a sent
    layer was computed: `sent` advances `prefilled` too, and no line ever shows a request
    sent further than it was prefilled. Both only move forward.
    """

    def __init__(self, plan: Plan, enabled: bool):
        self.plan = plan
        self.enabled = enabled
        self.tty = enabled and sys.stderr.isatty()
        self.computed = {r.id: (0, 0) for r in plan.requests}  # (tokens, layers)
        self.sent = {r.id: (0, 0) for r in plan.requests}
        self.arrived: dict[int, float] = {}
        self._drawn = 0
        self._last_draw = 0.0

    def _reached(self, index: int, layer: int):
        """(request, (tokens, layers)) once layer `layer` of plan step `index` is done."""
        for c in self.plan.steps[index]:
            yield c.request, (c.start + c.length, layer + 1)

    def layer_computed(self, index: int, layer: int) -> None:
        for request, at in self._reached(index, layer):
            self.computed[request] = max(self.computed[request], at)

    def layer_sent(self, index: int, layer: int) -> None:
        for request, at in self._reached(index, layer):
            self.sent[request] = max(self.sent[request], at)
            self.computed[request] = max(self.computed[request], at)  # its signal came first

    def line(self, request) -> str:
        layers = self.plan.model.layers
        (ct, cl), (st, sl) = self.computed[request.id], self.sent[request.id]
        where = (
            f"on decode at {1e3 * self.arrived[request.id]:6.0f} ms"
            if request.id in self.arrived
            else ""
        )
        return (
            f"  request {request.id:3d} {request.prompt_len:5d} tokens | prefilled "
            f"{ct:5d} tok, layer {cl:2d}/{layers} | sent {st:5d} tok, layer {sl:2d}/{layers}"
            f" | {where}"
        )

    def update(self, force: bool = False) -> None:
        if not self.tty or (not force and time.monotonic() - self._last_draw < 0.1):
            return
        if self._drawn:
            sys.stderr.write(f"\x1b[{self._drawn}F")
        lines = [self.line(r) for r in self.plan.requests]
        sys.stderr.write("".join(f"\x1b[2K{line}\n" for line in lines))
        sys.stderr.flush()
        self._drawn, self._last_draw = len(lines), time.monotonic()

    def request_arrived(self, request_id: int, after: float) -> None:
        self.arrived[request_id] = after
        if self.enabled and not self.tty:
            print(self.line(self.plan.request(request_id)), file=sys.stderr, flush=True)


def _child_env(namespace: str, device, isolate: bool = True, devices: int = 1) -> dict[str, str]:
    """A child's environment on physical device `device`: seeing only it (a worker) or every
    device (a messager, as FastDeploy's cache processes do)."""
    platform = pdhal.current_platform()
    base = dict(os.environ)
    if platform.name == "cpu" and platform.device_count() < devices:
        base["PDHAL_CPU_DEVICE_COUNT"] = str(devices)  # logical devices stand in for chips
    env = platform.child_env([device], base, isolate=isolate)
    # One math thread per process: the processes share the cores, and identical threading
    # is what makes the decode side's recomputation bit-identical to the worker's.
    env |= {
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "PDHAL_NAMESPACE": namespace,
        "GLOG_minloglevel": env.get("GLOG_minloglevel", "2"),
    }
    return env


class Pipeline:
    """One run of the demo for one plan."""

    def __init__(self, plan: Plan, options: Options):
        self.plan, self.options = plan, options
        self.hub = Hub(options.control_host)
        self.timeline = Timeline()
        self.progress = Progress(plan, options.progress)
        self.first_token: dict[int, int] = {}
        self.sent: dict[int, set[int]] = {}  # request -> ranks that sent its last block
        self.devices: dict[int, int] = {}  # rank -> the device id its channels are named by
        self.backends: dict[str, str] = {}  # side -> the pdhal backend its processes ran on
        self.freed: set[int] = set()  # requests every rank sent: their prefill blocks are free
        self.handed_over: set[int] = set()  # requests the decoder was given
        self.recycles = plan.recycles
        self.verification: dict | None = None
        self.finished: set[str] = set()
        self.killed_at: int | None = None  # ns, from the worker's "fault" event
        self.victim: str | None = None
        # A namespace of its own inside the caller's, so runs never meet each other's segments.
        self.namespace = f"{pdhal.namespace()}-demo{os.getpid()}-{plan.mode}"

    def role(self, kind: str, rank: int) -> str:
        """A process's name: "worker", "messager" with one rank; "worker.1" with several."""
        return kind if self.plan.tp == 1 else f"{kind}.{rank}"

    # -- start-up ----------------------------------------------------------------------

    def _expect(self, role: str, kind: str, timeout: float = SILENCE_TIMEOUT_S) -> dict:
        link = self.hub.links[role]
        if not link.poll(timeout):
            raise DemoError(f"the {role} did not report {kind!r} within {timeout:.0f} s")
        try:
            got, payload = link.recv()
        except (EOFError, OSError):
            raise DemoError(
                f"the {role} exited ({self._exit_status(role)}) before {kind!r}"
            ) from None
        if got == "error":
            raise DemoError(f"the {role} failed: {payload['detail']}")
        if got != kind:
            raise DemoError(f"the {role} sent {got!r}, expected {kind!r}")
        return payload

    def _exit_status(self, role: str) -> str:
        process = self.hub.processes.get(role)
        if process is None:
            return "disconnected"  # it ran on another host
        try:
            code = process.wait(2)
        except subprocess.TimeoutExpired:
            return "still running"
        return f"killed by signal {-code}" if code < 0 else f"exit status {code}"

    def start(self) -> None:
        platform, tp = pdhal.current_platform(), self.plan.tp
        physical = [platform.physical_device_id(rank) for rank in range(tp)]
        common = {
            "plan": self.plan.to_json(),
            "host": self.options.host,
            "protocol": self.options.protocol,
            "inflight": self.options.inflight,
            "transfer_timeout_s": self.options.transfer_timeout_s,
            "session_key": secrets.token_hex(16),  # the control sessions' (pdhal.transfer)
        }
        # The workers' all-reduce: a socketpair between every two ranks.
        pairs = {(a, b): socket.socketpair() for a in range(tp) for b in range(a + 1, tp)}
        ends = {rank: {} for rank in range(tp)}
        for (a, b), (sa, sb) in pairs.items():
            ends[a][b], ends[b][a] = sa.fileno(), sb.fileno()
        # every process is launched at once (their imports overlap), then set up in order
        try:
            if not self.options.remote_decoder:
                self.hub.launch("decoder", self._decoder_env(physical[0]))
            for rank in range(tp):
                self.hub.launch(
                    self.role("worker", rank),
                    _child_env(self.namespace, physical[rank], devices=tp),
                    pass_fds=list(ends[rank].values()),
                )
                self.hub.launch(
                    self.role("messager", rank),
                    _child_env(self.namespace, physical[rank], isolate=False, devices=tp),
                )
        finally:
            for sa, sb in pairs.values():  # the workers hold their ends now
                sa.close()
                sb.close()
        if self.options.remote_decoder:
            self._await_remote_decoder()
        ready = self._set_up("decoder", common | {"rank": 0, "cache_name": "decode_cache"})
        self.backends["decode"] = ready["backend"]
        wanted = self.options.decode_platform
        if wanted is not None and self.backends["decode"] != wanted:
            raise DemoError(
                f"the decoder runs on the {self.backends['decode']} backend, not on "
                f"{wanted} (--decode-platform)"
            )
        for rank in range(tp):
            ready = self._set_up(
                self.role("worker", rank),
                common
                | {
                    "rank": rank,
                    "cache_name": f"prefill_cache.{rank}",
                    "fault": self.options.fault,
                    "tp_fds": ends[rank],
                },
            )
            self.devices[rank], self.backends["prefill"] = ready["device"], ready["backend"]
        pids, addresses = {}, {}
        for rank in range(tp):
            ready = self._set_up(
                self.role("messager", rank),
                common
                | {
                    "rank": rank,
                    "device": self.devices[rank],
                    "prefill_cache": f"prefill_cache.{rank}",
                    "slow_ms": self.options.slow_ms.get(rank, 0),
                    "follow": self.options.follow,
                },
            )
            pids[rank], addresses[rank] = ready["pid"], ready["address"]
        # the decoder claims each request whose blocks are free from the messagers, by their
        # sessions, before the first layer is computed (so each layer goes as it is done)
        self.hub.links["decoder"].send(("serve", {"prefill": [addresses[r] for r in range(tp)]}))
        self._expect("decoder", "claimed")
        self.timeline.start = time.monotonic_ns()
        decoder = self.hub.processes.get("decoder")  # None: it runs on another host
        for rank in range(tp):
            self.hub.links[self.role("worker", rank)].send(
                ("go", {"messager_pid": pids[rank], "decoder_pid": decoder and decoder.pid})
            )

    def _set_up(self, role: str, setup: dict) -> dict:
        """Send `role` its setup once it connected (accepted here unless it already is: a
        decoder started by hand) and return what it reports when ready."""
        if role not in self.hub.links:
            self.hub.accept(role, CONNECT_WAIT_S)
        self.hub.links[role].send(setup)
        return self._expect(role, "ready")

    def _decoder_env(self, device) -> dict[str, str]:
        """The decoder's environment: on the prefill's platform, seeing only `device`; on
        another (--decode-platform), that backend selected and every device of it visible
        (this process cannot ask another backend's platform which variable hides its
        devices; the decoder computes on the host)."""
        if self.options.decode_platform in (None, pdhal.current_backend()):
            return _child_env(self.namespace, device, devices=self.plan.tp)
        return _child_env(self.namespace, device, isolate=False, devices=self.plan.tp) | {
            "PDHAL_PLATFORM": self.options.decode_platform
        }

    def _await_remote_decoder(self) -> None:
        env = self.hub.child_env() | {
            "PDHAL_NAMESPACE": self.namespace,
            "PDHAL_DEMO_HOST": "<decode-host-ip>",
        }
        if self.options.decode_platform is not None:
            env["PDHAL_PLATFORM"] = self.options.decode_platform
        command = " ".join(f"{k}={v}" for k, v in env.items())
        print(
            f"pdhal demo: waiting {REMOTE_WAIT_S:.0f} s for the decode receiver; on the decode "
            f"host (pdhal-demo[mooncake] installed) run, with its address for "
            f"<decode-host-ip>:\n  {command} python -m pdhal_demo.child decoder",
            file=sys.stderr,
            flush=True,
        )
        self.hub.accept("decoder", REMOTE_WAIT_S)

    # -- events ------------------------------------------------------------------------

    def _on_worker(self, kind: str, m: dict) -> None:
        if kind == "step":
            self.timeline.step_index[m["rank"], m["step"]] = m["index"]
            self.timeline.step_start[m["rank"], m["step"]] = m["start"]
        elif kind == "layer":
            self.timeline.layer_end[m["rank"], m["step"], m["layer"]] = m["end"]
            if "signal" in m:  # posted right after the end was read
                self.timeline.signal[m["rank"], m["step"], m["layer"]] = m["signal"]
                self.timeline.signalled[m["rank"], m["step"], m["layer"]] = m["end"]
            if m["rank"] == 0:
                self.progress.layer_computed(m["index"], m["layer"])
        elif kind == "signals":  # every layer's, after the forward pass (--signal-at-end)
            for layer in range(self.plan.model.layers):
                self.timeline.signal[m["rank"], m["step"], layer] = m["at"]
                self.timeline.signalled[m["rank"], m["step"], layer] = m["signalled"]
        elif kind == "fault":
            self.killed_at = m["at"]
            self.victim = "decoder" if m["victim"] == "decoder" else self.role(m["victim"], 0)
        elif kind == "first_token":
            token = self.first_token.setdefault(m["request"], m["token"])
            if token != m["token"]:  # every rank holds the whole hidden state: same token
                raise DemoError(
                    f"rank {m['rank']}'s first token of request {m['request']} is "
                    f"{m['token']}, another rank's {token}"
                )
            self._maybe_hand_over(m["request"])

    def _on_messager(self, kind: str, m: dict) -> None:
        if kind == "landed":  # before its "sent"
            self.timeline.landed[m["rank"], m["request"]] = (m["first_submit"], m["end"])
        elif kind == "xfer":
            self.timeline.transfers.append(m)
            if m["rank"] == 0:
                self.progress.layer_sent(m["index"], m["layer"])
        elif kind == "sent":
            self.sent.setdefault(m["request"], set()).add(m["rank"])
            self._maybe_hand_over(m["request"])

    def _on_decoder(self, kind: str, m: dict) -> None:
        if kind == "inserted":  # timed here: the decoder's clock may be another host's
            now = time.monotonic_ns()
            self.timeline.inserted[m["request"]] = now
            self.progress.request_arrived(m["request"], (now - self.timeline.start) / 1e9)
            if len(self.timeline.inserted) == len(self.plan.requests):
                self.hub.links["decoder"].send(("verify", {}))
        elif kind == "verified":
            self.verification = m

    def _maybe_hand_over(self, request: int) -> None:
        """Once every rank sent the request's last block and its first token is known."""
        if len(self.sent.get(request, ())) == self.plan.tp and request not in self.freed:
            self.freed.add(request)
            if self.recycles:  # its prefill blocks are free: a worker may wait for that
                for rank in range(self.plan.tp):
                    self.hub.links[self.role("worker", rank)].send(("freed", {"request": request}))
        if (
            request in self.first_token
            and request in self.freed
            and request not in self.handed_over
        ):
            self.handed_over.add(request)
            self.hub.links["decoder"].send(
                ("request", {"request": request, "token": self.first_token[request]})
            )

    def _failed(self, role: str, message: dict) -> None:
        """`role` reported an error: name the process that died under it, if one did."""
        dead = [
            other
            for other, process in self.hub.processes.items()
            if other != role and process.poll() is not None
        ]
        if self.victim not in (None, role) and self.victim not in dead:
            dead.append(self.victim)  # killed on purpose; its exit may not be reaped yet
        if not dead:
            raise DemoError(f"the {role} failed: {message['detail']}")
        after = (
            ""
            if self.killed_at is None
            else f" {(time.monotonic_ns() - self.killed_at) / 1e6:.0f} ms after the kill"
        )
        raise DemoError(
            f"the {dead[0]} exited ({self._exit_status(dead[0])}); the {role} "
            f"reported it{after}: {message['error']}"
        )

    def _died(self, role: str) -> None:
        """A process exited early: give the others a moment to report it, then fail."""
        status = self._exit_status(role)
        deadline = time.monotonic() + REPORT_GRACE_S
        others = {r: link for r, link in self.hub.links.items() if r != role}
        while time.monotonic() < deadline:
            for link in wait(list(others.values()), deadline - time.monotonic()):
                who = next(r for r, other in others.items() if other is link)
                try:
                    kind, m = link.recv()
                except (EOFError, OSError):
                    del others[who]
                    continue
                if kind == "error":
                    after = (
                        ""
                        if self.killed_at is None
                        else f" {(time.monotonic_ns() - self.killed_at) / 1e6:.0f} ms after the "
                        f"kill"
                    )
                    raise DemoError(
                        f"the {role} exited ({status}); the {who} reported it{after}: {m['error']}"
                    )
        raise DemoError(f"the {role} exited ({status}) and nothing else reported it")

    def run(self) -> dict:
        try:
            self.start()
            handlers = {
                role: {
                    "worker": self._on_worker,
                    "messager": self._on_messager,
                    "decoder": self._on_decoder,
                }[role.split(".")[0]]
                for role in self.hub.links
            }
            roles = {id(link): role for role, link in self.hub.links.items()}
            open_links = list(self.hub.links.values())
            while self.verification is None:
                ready = wait(open_links, SILENCE_TIMEOUT_S)
                if not ready:
                    raise DemoError(f"no process reported anything for {SILENCE_TIMEOUT_S} s")
                for link in ready:
                    role = roles[id(link)]
                    try:
                        kind, message = link.recv()
                    except (EOFError, OSError):  # OSError: a remote peer's host went silent
                        if role not in self.finished:
                            self._died(role)
                        open_links.remove(link)
                        continue
                    if kind == "error":
                        self._failed(role, message)
                    if kind == "done":
                        self.finished.add(role)
                        if role.startswith("messager"):  # its worker may go now
                            self.hub.links[role.replace("messager", "worker")].send(("exit", {}))
                    batch = message if kind == "events" else [(kind, message)]
                    for event_kind, event in batch:
                        handlers[role](event_kind, event)
                self.progress.update()
            self.progress.update(force=True)
        except DemoError as exc:
            tails = {role: self.hub.log_tail(role) for role in self.hub.processes}
            logs = "".join(
                f"\n--- {role}'s stderr (last lines) ---\n{tail}"
                for role, tail in tails.items()
                if tail.strip()
            )
            raise DemoError(f"{exc}{logs}") from None
        finally:
            self.hub.stop(grace=10.0)
            # A process killed outright (the fault demos) leaves its segments: reclaim them.
            pdhal.cleanup(self.namespace)
        return summarize(self.timeline, self.plan, self.verification, self.devices, self.backends)


def run(plan: Plan, options: Options) -> tuple[dict, Timeline]:
    """Run the demo for `plan`; the summary (see report.summarize) and the timeline."""
    if not plan.requests:
        raise DemoError(
            "no request fits the cache: "
            + "; ".join(f"{n} tokens: {why}" for n, why in plan.rejected)
        )
    if plan.transport == "mooncake":
        require_mooncake()
    pipeline = Pipeline(plan, options)
    return pipeline.run(), pipeline.timeline
