"""The Mooncake link cut between real servers: the prefill server, its messager and one
decode server here, a second decode server in another network namespace (its own network
stack, a veth pair between: as on another host; pdhal.testing.netns), Mooncake over TCP
across it, the router in front under a steady load. The cable is pulled mid-load (both
veth ends down: no reset crosses): every request in flight ends within the bound (the
router's --timeout for one stuck on the far server), once the router saw the far server
fail every request is served by the near one, and the prefill server's and the near decode
server's metrics return to idle: the messager failed the far transfers it was streaming by
its stall timeout, and those the far server never claimed (the router sends a request to
both sides at once, so a prefill can end after the cut kept its claim from coming) when
the router's request to it timed out (the router abandons them at the messager, well
before its 120 s claim timeout), and the prefill freed their blocks. Root only
(namespaces)."""

from __future__ import annotations

import pytest
from servers import Served
from test_serve_faults import PROMPTS, TOKENS, assert_idle, under_load

from pdhal.testing import netns
from pdhal.testing.reset import remove_leftovers

pytestmark = pytest.mark.skipif(netns.available() is not None, reason=str(netns.available()))


@pytest.fixture(scope="module")
def served(tmp_path_factory, model_dir):
    with netns.TwoHosts() as hosts:
        s = Served(
            tmp_path_factory.mktemp("netns"),
            model_dir,
            "mooncake",
            decodes=2,
            plain=False,
            # a cut link refuses nothing: its health checks fail by their timeout, which
            # with the interval stays well inside the tests' settling time (8 s)
            router_args=("--timeout", "20", "--health-interval", "1", "--health-timeout", "3"),
            hosts=hosts,
            dtype="float32",  # tokens under load equal tokens one at a time
        )
        s.cut = hosts.cut
        yield s
        s.stop()
    assert remove_leftovers(s.namespace) == []


@pytest.fixture(scope="module")
def expected(served) -> dict[str, str]:
    return {p: served.complete("router", p, max_tokens=TOKENS) for p in PROMPTS}


def test_a_cut_link_ends_the_far_requests_and_the_near_server_serves_on(served, expected):
    under_load(served, expected, served.cut, "decode1")  # cut while it has a request
    assert_idle(served, ["prefill", "decode"])
