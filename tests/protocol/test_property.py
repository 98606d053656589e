"""Property-based: random sequences of ops, mixed with random garbage, against a model.

Valid calls must behave exactly as the model says (no signal lost, duplicated or out of
order); garbage must raise a PdhalError. Anything else, a crash or a hang, fails. Each call
that could block is given a timeout of 0, so a hang cannot hide."""

from __future__ import annotations

import array
import os

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import pdhal
from pdhal import ops
from pdhal._protocol import signals as _signals

LAYERS = 6
RING = 16
CALLS = {"valid": 0, "garbage": 0}

garbage = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(),
    st.text(max_size=8),
    st.binary(max_size=8),
    st.lists(st.integers(-5, 5), max_size=4),
    st.just(object()),
)
OPS_WITH_ARITY = [
    ("open_shm_and_get_meta_signal", 2),
    ("init_signal_layerwise", 2),
    ("init_kv_signal_per_query", 5),
    ("signal_layer_ready", 1),
    ("get_output_kv_signal", 3),
    ("host_alloc", 1),
    ("host_free", 1),
    ("get_peer_mem_addr", 1),
    ("set_data_ipc", 2),
    ("share_external_data", 3),
    ("destroy_kv_signal_sender", 1),
    ("copy_blocks", 5),
    ("synchronize", 1),
    ("host_register", 2),
    ("host_unregister", 1),
    ("unset_data_ipc", 2),
    ("get_data_ptr_ipc", 2),
]
#: Ops that wait for a name to appear: garbage calls pass them timeout=0.
WAITING_OPS = {"share_external_data", "get_data_ptr_ipc"}


class Channels(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.meta = None
        self.query = (0, -1)  # model of the per-query word
        self.steps = []  # per-chunk model: [table, signalled layers]
        self.delivered = 0  # records the reader has had, in order
        self.finished = 0  # steps delivered whole and acknowledged (what a restart skips)
        self.out = array.array("i", [0] * 1538)
        self.reader = None

    # ---- per query ----
    @rule(keep=st.booleans())
    def start_step(self, keep):
        self.meta = ops.open_shm_and_get_meta_signal(0, 0, keep_pd_step_flag=keep)
        if not keep:
            self.query = (self.query[0] + 1, -1)
        CALLS["valid"] += 1

    @precondition(lambda self: self.meta is not None)
    @rule(layer=st.integers(0, 40))
    def signal_query_layer(self, layer):
        ops.signal_layer_ready(ops.init_signal_layerwise(self.meta, layer))
        self.query = max(self.query, (self.meta.step, layer))
        CALLS["valid"] += 1

    @precondition(lambda self: self.meta is not None)
    @invariant()
    def reader_sees_the_model(self):
        if self.reader is None:
            self.reader = ops.open_kv_signal_reader(0, 0, timeout=0)
        assert self.reader.current() == self.query

    # ---- per chunk ----
    def _undelivered_steps(self) -> int:
        # the producer may run ahead of what the reader finished by the ring's size
        return len(self.steps) - self.finished

    @precondition(lambda self: self._undelivered_steps() < RING)
    @rule(
        encoder=st.lists(st.integers(0, 3000), min_size=1, max_size=8), decoder=st.integers(0, 100)
    )
    def publish_table(self, encoder, decoder):
        chunk = ops.init_kv_signal_per_query(encoder, encoder, [decoder] * len(encoder), 0, LAYERS)
        table = [(slot, decoder, n) for slot, n in enumerate(encoder) if n > 0]
        if table:
            self.steps.append([table, -1, chunk])
        CALLS["valid"] += 1

    @precondition(lambda self: self.steps)
    @rule(data=st.data())
    def signal_chunk_layer(self, data):
        entry = data.draw(st.sampled_from(self.steps))
        layer = data.draw(st.integers(0, LAYERS - 1))
        ops.signal_layer_ready(entry[2].layer(layer))
        entry[1] = max(entry[1], layer)
        CALLS["valid"] += 1

    @rule()
    def read_record(self):
        if not self.steps:
            return
        ops.get_output_kv_signal(self.out, 0, False)
        self.finished = self.delivered // LAYERS  # asking for a record acknowledges the last
        step, layer = divmod(self.delivered, LAYERS)
        expected = None
        if step < len(self.steps) and layer <= self.steps[step][1]:
            table = self.steps[step][0]
            expected = [len(table), layer] + [w for t in table for w in t]
        if expected is None:
            assert list(self.out[:2]) == [-1, -1]
        else:
            assert list(self.out[: len(expected)]) == expected, (step, layer)
            self.delivered += 1
        CALLS["valid"] += 1

    @precondition(lambda self: _signals._chunk_readers)
    @rule()
    def acknowledge(self):
        for reader in _signals._chunk_readers.values():
            reader.ack()
        self.finished = self.delivered // LAYERS
        CALLS["valid"] += 1

    @precondition(lambda self: _signals._chunk_readers)
    @rule()
    def restart_messager(self):
        """The messager's reader goes away (as in a crash) and a new one attaches: delivery
        resumes at the first step not finished, from layer 0 (at least once)."""
        for reader in list(_signals._chunk_readers.values()):
            reader.close()
        _signals._chunk_readers.clear()
        self.delivered = self.finished * LAYERS
        CALLS["valid"] += 1

    # ---- garbage ----
    @rule(op=st.sampled_from(OPS_WITH_ARITY), args=st.data())
    def garbage_call(self, op, args):
        name, arity = op
        values = [args.draw(garbage) for _ in range(arity)]
        if name == "host_alloc" and type(values[0]) is int and 1 << 24 < values[0] < 1 << 46:
            values[0] = 1 << 46  # a valid but giant allocation tests RAM, not pdhal
        # Garbage that happens to be valid must not touch the model's channels, nor wait
        # out a back-pressure timeout: its own namespace, and a short timeout.
        saved = {k: os.environ.get(k) for k in ("PDHAL_NAMESPACE", "PDHAL_BACKPRESSURE_TIMEOUT")}
        os.environ["PDHAL_NAMESPACE"] = saved["PDHAL_NAMESPACE"] + "g"
        os.environ["PDHAL_BACKPRESSURE_TIMEOUT"] = "0.01"
        try:
            timeout = {"timeout": 0} if name in WAITING_OPS else {}
            result = getattr(ops, name)(*values, **timeout)
        except pdhal.PdhalError:
            return
        finally:
            CALLS["garbage"] += 1
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
        if hasattr(result, "close"):  # garbage that happened to be valid (host_alloc(5))
            result.close()

    @rule(method=st.sampled_from(["wait", "next", "poll"]), args=st.data())
    def garbage_wait(self, method, args):
        """A reader's waits with garbage since / timeout / spin_us: a PdhalError, or (garbage
        that happens to be valid) a wait bounded by a short timeout."""
        since, spin_us, timeout = (
            args.draw(st.one_of(garbage, st.tuples(garbage, garbage))) for _ in range(3)
        )
        if timeout is None or type(timeout) in (int, float) and not timeout < 0.01:
            timeout = 0.01  # valid, but long enough to slow the run down
        if type(spin_us) is int and spin_us > 1000:
            spin_us = 1000
        try:
            if method == "wait":
                if self.meta is None:
                    return
                with ops.open_kv_signal_reader(0, 0, timeout=0) as reader:
                    reader.wait(since, timeout=timeout, spin_us=spin_us)
            else:  # rank 1 has no producer: valid garbage must not eat the model's records
                ops.get_output_kv_signal(
                    self.out, 1, method == "next", timeout=timeout, spin_us=spin_us
                )
        except pdhal.PdhalError:
            pass
        finally:
            CALLS["garbage"] += 1

    def teardown(self):
        if self.reader is not None:
            self.reader.close()
        _signals.close_producer_channels()
        for reader in list(_signals._chunk_readers.values()):
            reader.close()
        _signals._chunk_readers.clear()


TestChannels = Channels.TestCase
TestChannels.settings = settings(
    max_examples=150,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def test_zz_report_how_many_calls_ran():
    """Runs after the machine (file order): says how many cases it drove."""
    print(f"property test drove {CALLS['valid']} valid and {CALLS['garbage']} garbage calls")
    assert CALLS["valid"] > 500 and CALLS["garbage"] > 100
