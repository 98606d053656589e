"""Two network stacks on one machine, for tests of what crosses hosts: a network namespace
for one side and a veth pair to it, so only the wire is virtual. Root only (and iproute2).

    with TwoHosts() as hosts:   # hosts.prefill_ip here, hosts.decode_ip in hosts.ns
        subprocess.Popen([*hosts.there_prefix, sys.executable, ...])  # runs in the namespace
        hosts.cut()             # the cable pulled

Everything is removed on exit, pass or fail.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import uuid


def available() -> str | None:
    """None when namespaces can be made here; else why not."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return "needs root and iproute2 (`ip netns`) to put a side in a network namespace"
    return None


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


class TwoHosts:
    """A network namespace for the decode side and a veth pair to it: prefill (this
    namespace) at PREFIX.1, decode at PREFIX.2, a /30 of their own."""

    def __init__(self):
        tag = uuid.uuid4().hex[:6]
        self.ns = f"pdhal-decode-{tag}"
        self.here, self.there = f"pdP{tag}", f"pdD{tag}"  # interface names: <= 15 chars
        net = f"10.{random.randint(64, 127)}.{random.randint(0, 255)}"
        block = 4 * random.randint(0, 63)
        self.prefill_ip, self.decode_ip = f"{net}.{block + 1}", f"{net}.{block + 2}"

    def up(self) -> None:
        ip("netns", "add", self.ns)
        ip("link", "add", self.here, "type", "veth", "peer", "name", self.there)
        ip("link", "set", self.there, "netns", self.ns)
        ip("addr", "add", f"{self.prefill_ip}/30", "dev", self.here)
        ip("link", "set", self.here, "up")
        ip("-n", self.ns, "addr", "add", f"{self.decode_ip}/30", "dev", self.there)
        ip("-n", self.ns, "link", "set", self.there, "up")
        ip("-n", self.ns, "link", "set", "lo", "up")

    def cut(self) -> None:
        """The cable pulled: both ends down, nothing more crosses (no reset either)."""
        ip("link", "set", self.here, "down")
        ip("-n", self.ns, "link", "set", self.there, "down")

    @property
    def there_prefix(self) -> list[str]:
        """The command prefix that runs a program in the decode side's namespace."""
        return ["ip", "netns", "exec", self.ns]

    def __enter__(self) -> TwoHosts:
        try:
            self.up()
        except BaseException:
            self.down()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.down()
        assert self.ns not in ip("netns", "list", check=False).stdout
        assert self.here not in ip("link", "show", check=False).stdout

    def down(self) -> None:
        # Killing what still runs in the namespace, then deleting it, removes its veth end,
        # which removes this end too; each step is tried whatever the last one did.
        pids = ip("netns", "pids", self.ns, check=False).stdout.split()
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
        ip("netns", "del", self.ns, check=False)
        ip("link", "del", self.here, check=False)
