"""`pdhal demo --decoder remote` across two network stacks: the decode receiver runs in its own
network namespace, joined to the prefill side by a veth pair, and Mooncake carries the
blocks over TCP between the two addresses, as between two hosts (only the wire is virtual).

Then the faults a two-host deployment has: the link cut mid-run, the remote decoder killed
mid-run. The prefill side must report each within seconds and exit non-zero, never hang,
and never report a block as verified.

Root only (network namespaces); skipped with the reason otherwise. Every namespace and link
is removed when the test ends, pass or fail.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
from pdhal_demo.control import require_mooncake

from pdhal.testing.netns import TwoHosts

pytestmark = [
    pytest.mark.paddle,
    pytest.mark.skipif(
        os.geteuid() != 0 or shutil.which("ip") is None,
        reason="needs root and iproute2 (`ip netns`) to put the decoder in a network namespace",
    ),
]

SMALL = [
    "--layers",
    "4",
    "--prompt-lens",
    "64,100,200,333",
    "--batch",
    "2",
    "--mode",
    "per_query",
    "--decode-steps",
    "3",
]


@pytest.fixture
def hosts():
    try:
        require_mooncake()
    except Exception as exc:  # DemoError: what to install
        pytest.skip(str(exc))
    with TwoHosts() as pair:
        yield pair


class Run:
    """The prefill side (this namespace) and the decode receiver started, from the command
    the prefill side prints, in the decode namespace."""

    def __init__(self, hosts: TwoHosts, *args: str):
        self.hosts = hosts
        self.prefill = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "pdhal",
                "demo",
                *SMALL,
                "--transport",
                "mooncake",
                "--decoder",
                "remote",
                "--control-host",
                hosts.prefill_ip,
                "--host",
                hosts.prefill_ip,
                *args,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.err: list[str] = []
        self.decoder = None
        try:
            self._start_decoder()
        except BaseException:
            self.close()
            raise

    def _start_decoder(self) -> None:
        for line in self.prefill.stderr:
            self.err.append(line)
            if line.rstrip().endswith("python -m pdhal_demo.child decoder"):
                break
        else:
            raise AssertionError("no decoder command printed:\n" + "".join(self.err))
        assignments = dict(a.split("=", 1) for a in line.split(" python -m")[0].split())
        assert assignments["PDHAL_DEMO_HOST"] == "<decode-host-ip>"
        assert assignments["PDHAL_DEMO_CONTROL"].startswith(f"{self.hosts.prefill_ip}:")
        env = dict(os.environ) | assignments | {"PDHAL_DEMO_HOST": self.hosts.decode_ip}
        self.decoder = subprocess.Popen(
            [
                "ip",
                "netns",
                "exec",
                self.hosts.ns,
                sys.executable,
                "-m",
                "pdhal_demo.child",
                "decoder",
            ],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )

    def wait_for_arrival(self, timeout: float = 120) -> None:
        """Until the first request is on decode (its progress line), mid-run."""
        deadline = time.monotonic() + timeout
        for line in self.prefill.stderr:
            self.err.append(line)
            if "on decode at" in line:
                return
            assert time.monotonic() < deadline, "".join(self.err)
        raise AssertionError(
            "the prefill side ended before a request arrived:\n" + "".join(self.err)
        )

    def finish(self, timeout: float) -> tuple[int, str, str]:
        try:
            out, err = self.prefill.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.prefill.kill()
            out, err = self.prefill.communicate()
            raise AssertionError(f"the prefill side hung:\n{''.join(self.err)}{err}") from None
        return self.prefill.returncode, out, "".join(self.err) + err

    def close(self) -> None:
        for process in (self.prefill, self.decoder):
            if process is None:
                continue
            if process.poll() is None:
                process.kill()
            process.wait()


def test_remote_decoder_in_another_network_namespace_receives_every_byte(hosts):
    run = Run(hosts, "--json")
    try:
        code, out, err = run.finish(timeout=240)
        assert run.decoder.wait(60) == 0, run.decoder.stderr.read()
    finally:
        run.close()
    assert code == 0, err
    printed = json.loads(out)  # one object: the versions, and a summary per run
    assert printed["schema_version"] == 2
    [summary] = printed["runs"]
    assert summary["ok"] and summary["transport"] == "mooncake"
    assert summary["verified_bytes"] == sum([64, 100, 200, 333]) * 2 * 4 * 32768 // 64
    assert summary["causality_violations"] == 0


@pytest.mark.parametrize("fault", ["cut the link", "kill the decoder"])
def test_a_lost_link_or_decoder_is_reported_within_seconds_and_never_verified(hosts, fault):
    # 16 layers: the run is still moving blocks when the first request arrives
    run = Run(hosts, "--layers", "16")
    try:
        run.wait_for_arrival()
        struck = time.monotonic()
        if fault == "cut the link":
            hosts.cut()
        else:
            run.decoder.send_signal(signal.SIGKILL)  # `ip netns exec` is the decoder itself
        code, out, err = run.finish(timeout=60)
        reported = time.monotonic() - struck
    finally:
        run.close()
    assert code == 1, err
    # the control link's keepalive 5 s, the others' grace to report it 5 s (Mooncake's TCP
    # calls a write done once the local socket took it: the cut link fills the buffers
    # before any transfer stalls)
    assert reported < 20, err
    assert "every byte verified" not in out and "verified" not in out.lower(), out
    if fault == "cut the link":
        stalled = "did not land within" in err and "the link or the destination is gone" in err
        silent = "its decode side's session ended: the peer said nothing for 5 s" in err
        assert stalled or silent or "decoder exited (disconnected)" in err, err
    else:  # a control link's keepalive, or the messager's next write, says it first
        killed = re.search(
            r"the messager failed: request \d+ failed: (a write of \d+ bytes|its decode "
            r"side's session ended)",
            err,
        )
        assert killed or "the decoder exited (disconnected)" in err, err
