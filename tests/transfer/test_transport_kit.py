"""The transport toolkit (pdhal.transfer's EngineTransport, Registrations, LatchedLink,
PollingBatch): options refused where they are given, given ones ruling over the
environment and bound once the engine is made; registrations counted by range; a
failure latched on the link; a wait that runs out failing the batch alone."""

from __future__ import annotations

import threading
import time

import pytest

from pdhal import InvalidArgumentError, TransferError
from pdhal.transfer import (
    BatchState,
    EngineTransport,
    LatchedLink,
    Option,
    PollingBatch,
    Registrations,
    one_of,
    positive,
    transport,
)


class Toy(EngineTransport):
    name = "toy"
    options = {
        "mode": Option("how", "slow", "PDHAL_TOY_MODE", one_of("slow", "fast")),
        "depth": Option("how deep", 4, "PDHAL_TOY_DEPTH", positive(int)),
    }

    def make_engine(self, settings: dict) -> dict:
        return dict(settings)


def test_a_transport_without_options_refuses_any():
    with pytest.raises(InvalidArgumentError, match="transport 'shm' takes no options, got host"):
        transport("shm").configure(host="10.0.0.1")
    transport("shm").configure()  # nothing given: nothing to refuse


@pytest.mark.parametrize(
    "given, match",
    [
        ({"speed": 1}, r"transport 'toy' has no option 'speed' \(its options: depth, mode\)"),
        ({"mode": "warp"}, r"option mode='warp': it takes one of 'slow', 'fast'"),
        ({"depth": 0}, r"option depth=0: it takes a finite positive integer"),
        ({"depth": True}, r"option depth=True: it takes a finite positive integer"),
        ({"depth": "many"}, r"option depth='many': it takes a finite positive integer"),
        ({"depth": 1.9}, r"option depth=1.9: it takes a finite positive integer"),
        ({"depth": float("inf")}, r"option depth=inf: it takes a finite positive integer"),
        ({"depth": b"3"}, r"option depth=b'3': it takes a finite positive integer"),
    ],
)
def test_an_option_is_refused_at_configure_naming_it(given, match):
    toy = Toy()
    with pytest.raises(InvalidArgumentError, match=match):
        toy.configure(**given)
    assert toy.engine() == {"mode": "slow", "depth": 4}  # nothing of it was kept


class Hosted(EngineTransport):
    name = "hosted"
    options = {"host": Option("where", "127.0.0.1", "PDHAL_HOSTED_HOST")}


@pytest.mark.parametrize("given", [42, "", "a b", "a\n", ["h"], None, b"h"])
def test_an_option_takes_a_word_unless_it_says_otherwise(given):
    """A host given as a number, a list or with a space is refused at configure, not
    stringified into an address the engine fails on later."""
    with pytest.raises(InvalidArgumentError, match=r"it takes a non-empty string without spaces"):
        Hosted().configure(host=given)
    Hosted().configure(host="node-3.example:17000")


def test_given_options_rule_over_the_environment_which_rules_over_defaults(monkeypatch):
    monkeypatch.setenv("PDHAL_TOY_MODE", "fast")
    monkeypatch.setenv("PDHAL_TOY_DEPTH", "9")
    toy = Toy()
    toy.configure(depth="2")
    assert toy.engine() == {"mode": "fast", "depth": 2}


def test_a_wrong_environment_value_is_refused_naming_the_variable(monkeypatch):
    monkeypatch.setenv("PDHAL_TOY_DEPTH", "-3")
    with pytest.raises(
        InvalidArgumentError,
        match=r"PDHAL_TOY_DEPTH='-3': .*a finite positive integer.*'depth'",
    ):
        Toy().engine()


def test_options_bind_once_the_engine_is_made():
    toy = Toy()
    toy.configure(mode="fast")
    toy.configure(mode="slow")  # before first use the last word counts
    engine = toy.engine()
    assert engine["mode"] == "slow" and toy.engine() is engine  # one engine per transport
    toy.configure(mode="slow", depth=4)  # what it was made with: nothing to change
    with pytest.raises(InvalidArgumentError, match=r"in use already with mode='slow'.*mode='fast'"):
        toy.configure(mode="fast")


def test_registrations_count_users_by_range_and_unregister_with_the_last():
    made, dropped = [], []
    held = Registrations(
        lambda a, n: made.append((a, n)) or f"token{a}", lambda a, t: dropped.append((a, t))
    )
    whole = held.add(0x1000, 0x1000)
    inner = held.add(0x1800, 0x100)  # inside the first: another user of it
    outer = held.add(0x3000, 0x10)
    assert (whole, inner, outer) == (0x1000, 0x1000, 0x3000)
    assert made == [(0x1000, 0x1000), (0x3000, 0x10)]
    held.release(whole)
    assert dropped == []
    held.release(inner)
    assert dropped == [(0x1000, "token4096")]
    with pytest.raises(InvalidArgumentError, match="no registration is held at 4096"):
        held.release(inner)  # released already: a plugin's bug, said, not swallowed
    assert dropped == [(0x1000, "token4096")]


def test_a_refused_registration_is_not_counted():
    def refuse(address, nbytes):
        raise TransferError("no")

    held = Registrations(refuse, lambda a, t: None)
    with pytest.raises(TransferError):
        held.add(0x1000, 16)
    with pytest.raises(TransferError):  # tried again, not taken as registered
        held.add(0x1000, 16)


class Toylink(LatchedLink):
    target = "toy:1"


class Scripted(PollingBatch):
    """A batch whose engine says each of `states` in turn, then the last one for good."""

    def __init__(self, link, states):
        super().__init__(link, 64)
        self.states, self.abandoned = list(states), 0

    def poll(self):
        return self.states.pop(0) if len(self.states) > 1 else self.states[0]

    def abandon(self):
        self.abandoned += 1


IN_FLIGHT = (BatchState.IN_FLIGHT, "")
LANDED = (BatchState.LANDED, "")


def test_a_batch_lands_after_its_engine_says_so():
    batch = Scripted(Toylink(), [IN_FLIGHT, IN_FLIGHT, LANDED])
    assert not batch.done()
    batch.wait(5.0)
    assert batch.done() and batch.states == [LANDED]


def test_a_failure_the_engine_reports_fails_the_batch_and_latches_the_link():
    link = Toylink()
    batch = Scripted(link, [IN_FLIGHT, (BatchState.FAILED, "failed (3)")])
    with pytest.raises(TransferError, match=r"a write of 64 bytes to toy:1 failed \(3\)"):
        batch.wait(5.0)
    with pytest.raises(TransferError, match=r"failed \(3\)"):  # asked again: the same word
        batch.done()
    assert link.problem() == "a write of 64 bytes to toy:1 failed (3)"
    link.failed("later")  # the first failure stays the link's
    with pytest.raises(TransferError, match=r"failed \(3\)"):
        link.refuse_if_failed()


def test_a_wait_that_runs_out_fails_the_batch_only_and_abandons_its_runs():
    link = Toylink()
    batch = Scripted(link, [IN_FLIGHT])
    started = time.monotonic()
    with pytest.raises(TransferError, match=r"did not land within 0.05 s"):
        batch.wait(0.05)
    assert time.monotonic() - started < 5.0
    assert batch.abandoned == 1 and link.problem() is None  # a stall may pass
    batch.states = [LANDED]  # landing later changes nothing: the caller was told
    with pytest.raises(TransferError, match="did not land"):
        batch.done()


@pytest.mark.parametrize("timeout", [float("nan"), -1, "1", None, True])
def test_a_wait_of_no_timeout_is_refused_at_the_call(timeout):
    """NaN napped forever; a string or None raised a builtin TypeError."""
    batch = Scripted(Toylink(), [IN_FLIGHT])
    with pytest.raises(InvalidArgumentError, match="timeout must be a number of seconds"):
        batch.wait(timeout)
    assert batch.abandoned == 0 and not batch.done()  # nothing happened to it


def test_threads_asking_one_batch_at_once_see_one_landing():
    polls = []

    class Counted(PollingBatch):
        def poll(self):
            polls.append(1)
            time.sleep(0.001)
            return LANDED

    batch = Counted(Toylink(), 8)
    threads = [threading.Thread(target=batch.wait, args=(5.0,)) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(polls) == 1  # the engine is asked until it said landed, never after
