"""Every value that crosses pdhal.transfer's layout, head-split, feed and transport-name
API is checked once, at the call that brings it, into an InvalidArgumentError naming it:
a NaN, a float, a bool, a string or a wrong shape where an int or a list belongs is refused
there, never carried into a later step (nor a TypeError, KeyError or IndexError). numpy
integers are ints, converted once."""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest

import pdhal
from pdhal import transfer
from pdhal._transfer import checks

BLOCKS, BLOCK_BYTES, LAYERS = 4, 64, 3
GOOD = dict(region=0, offset=0, stride=64, block_bytes=64, blocks=4, heads=1)


# ---- CacheSpec ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field, bad",
    [
        ("region", math.nan),
        ("region", True),
        ("region", -1),
        ("offset", 1.5),
        ("offset", -64),
        ("offset", "0"),
        ("stride", math.nan),
        ("stride", 0),
        ("block_bytes", False),
        ("block_bytes", 64.0),
        ("blocks", None),
        ("blocks", 0),
        ("heads", True),
        ("heads", 0),
        ("heads", np.float32(1)),
    ],
)
def test_a_cache_spec_field_that_is_not_a_count_is_refused(field, bad):
    with pytest.raises(pdhal.InvalidArgumentError, match=rf"CacheSpec\.{field} must be an int"):
        transfer.CacheSpec(**{**GOOD, field: bad})


def test_a_cache_spec_takes_numpy_ints_as_ints():
    spec = transfer.CacheSpec(*(np.int64(v) for v in GOOD.values()))
    assert spec == transfer.CacheSpec(**GOOD)
    assert all(type(word) is int for word in spec.to_json()[:-1])
    json.dumps(spec.to_json())  # a peer can read it
    assert transfer.CacheSpec.from_json(spec.to_json()) == spec


@pytest.mark.parametrize("bad", [None, 16, b"bf16", "x" * 65, " ", "bf16\n", "bfloat16 "])
def test_a_cache_spec_dtype_that_is_not_a_name_is_refused(bad):
    with pytest.raises(pdhal.InvalidArgumentError, match=r"CacheSpec\.dtype must be an element"):
        transfer.CacheSpec(**GOOD, dtype=bad)
    with pytest.raises(pdhal.InvalidArgumentError, match="peer's cache: CacheSpec.dtype"):
        transfer.CacheSpec.from_json([*GOOD.values(), bad], "the peer's cache")


def test_cache_specs_that_both_declare_their_element_type_pair_only_if_it_is_the_same():
    """bfloat16 and float16 are the same bytes per element: only the declared types tell
    them apart. A peer that declares none (an older one: six words) pairs with either."""
    ours = transfer.CacheLayout.from_caches(caches(), dtype="bfloat16")
    for theirs, error in (
        ("float16", "layer 0 cache 0: elements of 'bfloat16' here, 'float16' on the peer"),
        ("bfloat16", None),
        ("", None),
    ):
        peer = transfer.CacheLayout.from_caches(caches(), dtype=theirs).describe()
        if error is None:
            ours.check_peer(peer)
        else:
            with pytest.raises(pdhal.InvalidArgumentError, match=error):
                ours.check_peer(peer)
    older = transfer.CacheLayout.from_caches(caches()).describe()  # (undeclared: six words)
    assert all(len(words) == 6 for layer in older["layers"] for words in layer)
    assert all(spec.dtype == "" for layer in ours.check_peer(older) for spec in layer)


def test_a_cache_spec_whose_blocks_overlap_or_split_unevenly_is_refused():
    with pytest.raises(pdhal.InvalidArgumentError, match="CacheSpec.block_bytes 65 is more than"):
        transfer.CacheSpec(**{**GOOD, "block_bytes": 65})
    with pytest.raises(pdhal.InvalidArgumentError, match="CacheSpec.heads 3 does not divide"):
        transfer.CacheSpec(**{**GOOD, "heads": 3})


@pytest.mark.parametrize(
    "words",
    ["0,0,64,64,4,1", [0, 0, 64], [0, 0, 64, 64, "4", 1], [0, 0, 64, 64, 4.0, 1], None],
)
def test_a_cache_spec_from_json_is_refused_unless_it_is_six_counts(words):
    with pytest.raises(pdhal.InvalidArgumentError, match="peer's cache"):
        transfer.CacheSpec.from_json(words, "the peer's cache")


# ---- CacheLayout -------------------------------------------------------------------------


def caches() -> list[list[np.ndarray]]:
    return [[np.zeros((BLOCKS, BLOCK_BYTES), np.uint8) for _ in range(2)] for _ in range(LAYERS)]


@pytest.mark.parametrize(
    "layers, says",
    [
        ("layers", "layers must be a list of layers"),
        (3, "layers must be a list of layers"),
        ([transfer.CacheSpec(**GOOD)], "layer 0 must be a list of caches"),
        ([[(0, 0, 64, 64, 4)]], r"layers\[0\]\[0\] must be a CacheSpec"),
        ([[transfer.CacheSpec(**GOOD)], []], "layer 1 has no cache"),
        ([], "at least one layer"),
    ],
)
def test_a_layout_s_layers_must_be_lists_of_cache_specs(layers, says):
    region = np.zeros((BLOCKS, BLOCK_BYTES), np.uint8)
    with pytest.raises(pdhal.InvalidArgumentError, match=says):
        transfer.CacheLayout([region], layers)


def test_a_layout_s_regions_must_be_a_list():
    region = np.zeros((BLOCKS, BLOCK_BYTES), np.uint8)  # list() would make each row a region
    with pytest.raises(pdhal.InvalidArgumentError, match="regions must be a non-empty list"):
        transfer.CacheLayout(region, [[transfer.CacheSpec(**GOOD)]])
    with pytest.raises(pdhal.InvalidArgumentError, match="layers must be a list of layers"):
        transfer.CacheLayout.from_caches(region.ctypes.data)


@pytest.mark.parametrize(
    "specs, says",
    [
        # K and V together head by head, V's offset forgotten: V would land over K
        ([(0, 0, 128, 64, 4, 2, "", 1, "heads", 64)] * 2, "layer 0 cache 0 and layer 0 cache 1"),
        # V one part in, but K's heads next to each other: V's first head is K's second
        ([(0, 0, 128, 64, 4, 2), (0, 32, 128, 64, 4, 2, "", 1, "heads", 64)], "offsets 0 and 32"),
        # V's block b is K's block b + 1
        ([(0, 0, 64, 64, 4), (0, 64, 64, 64, 3)], "overlap in region 0"),
    ],
)
def test_caches_whose_bytes_overlap_are_refused_naming_both(specs, says):
    """A transfer into one would land over the other's bytes and be reported landed."""
    region = np.zeros(512, np.uint8)
    with pytest.raises(pdhal.InvalidArgumentError, match=re.escape(says)):
        transfer.CacheLayout([region], [[transfer.CacheSpec(*s) for s in specs]])


def test_caches_apart_in_one_region_are_not_overlaps():
    """K and V together head by head (V one part in), together block by block, and two
    layers one after the other in one region: accepted."""
    region = np.zeros(2048, np.uint8)
    for specs in (
        [(0, 0, 128, 64, 4, 2, "", 1, "heads", 64), (0, 32, 128, 64, 4, 2, "", 1, "heads", 64)],
        [(0, 0, 128, 64, 4), (0, 64, 128, 64, 4)],
        [(0, 0, 64, 64, 4), (0, 256, 64, 64, 4)],
    ):
        transfer.CacheLayout([region], [[transfer.CacheSpec(*s) for s in specs]])


def test_a_head_view_takes_counts_only():
    layout = transfer.CacheLayout.from_caches(caches())
    with pytest.raises(pdhal.InvalidArgumentError, match="first must be an int"):
        layout.head_view(0.0, 1)
    with pytest.raises(pdhal.InvalidArgumentError, match="count must be an int"):
        layout.head_view(0, True)


def broken(change) -> dict:
    peer = transfer.CacheLayout.from_caches(caches()).describe()
    change(peer)
    return peer


def _set(key, value):
    return lambda peer: peer.__setitem__(key, value)


@pytest.mark.parametrize(
    "peer, says",
    [
        ([1, 2], "must be a CacheLayout.describe"),
        (broken(lambda p: p.pop("layers")), "lacks 'layers'"),
        (broken(lambda p: p.pop("regions")), "lacks 'regions'"),
        (broken(_set("layers", "abc")), "'layers' must be a list of layers"),
        (broken(_set("layers", [["x", "y"]] * LAYERS)), "layer 0 cache 0 must be"),
        (broken(_set("layers", [["x"]] * 5)), "5 layers of"),  # the shape first
        (
            broken(lambda p: p["layers"].__setitem__(1, ["junk"])),
            r"3 layers of \[2, 1, 2\] caches",
        ),
        (broken(lambda p: p["layers"][2][1].__setitem__(4, math.nan)), "CacheSpec.blocks"),
        (broken(lambda p: p["layers"][0][0].__setitem__(3, True)), "CacheSpec.block_bytes"),
        (broken(lambda p: p["layers"][0][0].__setitem__(1, 2.5)), "CacheSpec.offset"),
        (broken(_set("regions", "256")), "'regions' must be a non-empty list"),
        (broken(lambda p: p["regions"].__setitem__(3, -1)), "region 3's size must be an int"),
        (broken(lambda p: p["layers"][1][0].__setitem__(0, 6)), "names region 6; the peer's"),
        (broken(lambda p: p["layers"][1][1].__setitem__(4, 5)), "ends at byte 320 of region 3"),
        (broken(lambda p: p["regions"].__setitem__(5, 255)), "ends at byte 256 of region 5"),
    ],
)
def test_a_malformed_peer_layout_is_refused_naming_what_is_wrong(peer, says):
    layout = transfer.CacheLayout.from_caches(caches())
    with pytest.raises(pdhal.InvalidArgumentError, match=says):
        layout.check_peer(peer)


def test_a_well_formed_peer_layout_pairs():
    layout = transfer.CacheLayout.from_caches(caches())
    peer = json.loads(json.dumps(layout.describe()))
    assert layout.check_peer(peer) == layout.layers
    with pytest.raises(pdhal.InvalidArgumentError, match="heads must be a HeadShard"):
        layout.check_peer(peer, (0, 0, 1))


def test_seconds_refuse_nan_and_ints_too_large_for_a_float():
    """A timeout is a real number of seconds in (0, a day]: NaN, and an int a peer's JSON
    may carry that no float holds, are refused naming the argument (not OverflowError)."""
    for bad in (math.nan, 10**400, -(10**400), math.inf):
        with pytest.raises(pdhal.InvalidArgumentError, match=r"timeout must be in \(0, 86400\]"):
            checks.seconds(bad, "timeout")
    assert checks.seconds(3, "timeout") == 3.0


# ---- head splits -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, says",
    [
        ((4, 2, True), "rank must be an int"),
        ((4, 1 << 20, 0), r"ranks must be an int in \[1, 65536\]"),
        ((4, np.int64(2), np.int64(-1)), r"rank must be an int in \[0, 1\], got -1"),
        ((4, 2, 2), r"rank must be an int in \[0, 1\]"),
    ],
)
def test_rank_heads_takes_counts_only(args, says):
    with pytest.raises(pdhal.InvalidArgumentError, match=says):
        transfer.rank_heads(*args)


@pytest.mark.parametrize(
    "args, says",
    [
        ((np.int64(4), np.float64(1), 2), "src_ranks must be an int"),
        ((4, True, 2), "src_ranks must be an int"),
        ((4, 1, 2.0), "dst_ranks must be an int"),
        ((4, 1, 0), "dst_ranks must be an int"),
    ],
)
def test_head_shards_takes_counts_only(args, says):
    with pytest.raises(pdhal.InvalidArgumentError, match=says):
        transfer.head_shards(*args)


def test_head_splits_take_numpy_ints():
    assert transfer.rank_heads(np.int64(4), np.int32(2), np.int8(1)) == range(2, 4)
    assert transfer.head_shards(np.int64(4), np.int64(1), np.int64(2)) == (
        transfer.head_shards(4, 1, 2)
    )


@pytest.mark.parametrize(
    "fields, says",
    [
        ((-1, 0, 1), "HeadShard.src_first"),
        ((0, True, 1), "HeadShard.dst_first"),
        ((0, 0, 0), "HeadShard.count"),
        ((0, 0, 1.5), "HeadShard.count"),
        (("0", 0, 1), "HeadShard.src_first"),
    ],
)
def test_a_head_shard_s_fields_are_counts(fields, says):
    with pytest.raises(pdhal.InvalidArgumentError, match=says):
        transfer.HeadShard(*fields)


def test_a_head_shard_takes_numpy_ints_as_ints():
    shard = transfer.HeadShard(np.int64(1), np.int32(0), np.uint8(2))
    assert shard == transfer.HeadShard(1, 0, 2)
    assert all(type(v) is int for v in vars(shard).values())


# ---- feeds -------------------------------------------------------------------------------


class FakeStreamer:
    """What a feed drives: a layout's layer count and layer_ready, recorded."""

    class layout:
        num_layers = LAYERS

    def __init__(self):
        self.sent = []

    def layer_ready(self, layer, ready, signal_ns=None, *, step=None):
        assert type(layer) is int and type(signal_ns) is int and type(step) is int
        assert all(type(r) is str and type(t) is int for r, t in ready)
        self.sent.append((layer, list(ready), step))


@pytest.mark.parametrize(
    "step, requests, says",
    [
        (1.0, [("a", 6)], "step must be an int"),
        (True, [("a", 6)], "step must be an int"),
        (-1, [("a", 6)], "step must be an int"),
        (1, [("a", "6")], r"requests\[0\]'s tokens must be an int"),
        (1, [("a", 6.0)], r"requests\[0\]'s tokens must be an int"),
        (1, [("a", True)], r"requests\[0\]'s tokens must be an int"),
        (1, [("a", 6), ("b", -1)], r"requests\[1\]'s tokens must be an int"),
        (1, [("a", 6), ("b", 0)], r"requests\[1\]'s tokens must be an int in \[1, "),
        (1, [(None, 6)], r"requests\[0\]'s request id must be a non-empty str"),
        (1, [("", 6)], r"requests\[0\]'s request id must be a non-empty str"),
        (1, [("a",)], r"requests\[0\] \(request_id, tokens\) must be a pair"),
        (1, ["ab"], r"requests\[0\] \(request_id, tokens\) must be a pair"),
        (1, "ab", "requests must be a list of"),
        (1, 5, "requests must be a list of"),
    ],
)
def test_a_bad_step_table_is_refused_at_step_and_never_kept(step, requests, says):
    streamer = FakeStreamer()
    feed = transfer.PerQueryFeed(streamer)
    with pytest.raises(pdhal.InvalidArgumentError, match=says):
        feed.step(step, requests)
    feed.progress((1, LAYERS - 1))  # nothing was kept: nothing raises, nothing is sent
    assert streamer.sent == []
    feed.step(2, [("a", 6)])  # the feed goes on
    feed.progress((2, 0))
    assert streamer.sent == [(0, [("a", 6)], 2)]


def test_a_step_table_of_numpy_ints_is_converted_once():
    streamer = FakeStreamer()
    feed = transfer.PerQueryFeed(streamer)
    feed.step(np.int64(1), [("a", np.int32(6)), ["b", np.uint16(4)]])
    feed.progress((np.int64(1), np.int32(1)), np.int64(5))
    assert streamer.sent == [(0, [("a", 6), ("b", 4)], 1), (1, [("a", 6), ("b", 4)], 1)]


@pytest.mark.parametrize(
    "seen, signal_ns, says",
    [
        (("1", 0), None, "seen's step must be an int"),
        ((1, 1.0), None, "seen's layer must be an int"),
        ((1, LAYERS), None, rf"seen's layer must be an int in \[-1, {LAYERS - 1}\]"),
        ((1, 0, 2), None, r"seen \(step, layer\) must be a pair"),
        (1, None, r"seen \(step, layer\) must be a pair"),
        ((1, 0), "now", "signal_ns must be an int"),
        ((1, 0), -5, "signal_ns must be an int"),
    ],
)
def test_bad_progress_is_refused(seen, signal_ns, says):
    streamer = FakeStreamer()
    feed = transfer.PerQueryFeed(streamer)
    feed.step(1, [("a", 6)])
    with pytest.raises(pdhal.InvalidArgumentError, match=says):
        feed.progress(seen, signal_ns)
    assert streamer.sent == []


def chunk_feed() -> tuple[FakeStreamer, transfer.PerChunkFeed]:
    streamer = FakeStreamer()
    feed = transfer.PerChunkFeed(streamer)
    feed.slots(1, {0: "a", 1: "b"})
    return streamer, feed


def record(*words, dtype=np.int32):
    out = np.zeros(pdhal.RECORD_WORDS, dtype)
    out[: len(words)] = words
    return out


@pytest.mark.parametrize(
    "rec, says",
    [
        ([3, 0, 0, 1, 2], r"record\[0\] \(the count: the record has room for 1\)"),
        (record(-1, 0), r"record\[0\] \(the count"),
        (record(pdhal.RECORD_WORDS, 0), r"record\[0\] \(the count"),
        (
            record(1, LAYERS, 0, 0, 4),
            rf"record\[1\] \(the layer\) must be an int in \[0, {LAYERS - 1}\]",
        ),
        (record(1, -1, 0, 0, 4), r"record\[1\] \(the layer\)"),
        (record(2, 0, 0, 0, 4, 1, -3, 4), r"record\[6\] \(cached tokens 1\)"),
        (record(1, 0, 0, 0, -4), r"record\[4\] \(chunk tokens 0\)"),
        ([1, 0, 0, 1.5, 4], r"record\[3\] \(cached tokens 0\)"),
        ([1, 0, "0", 0, 4], r"record\[2\] \(slot 0\)"),
        ([True, 0, 0, 0, 4], r"record\[0\] \(the count"),
        ("abc", "record must be"),
        ([1], "record must be"),
        (5, "record must be"),
        (np.zeros((2, 8), np.int32), "record must be"),
    ],
)
def test_a_bad_record_is_refused_before_anything_is_sent(rec, says):
    streamer, feed = chunk_feed()
    with pytest.raises(pdhal.InvalidArgumentError, match=says):
        feed.record(1, rec)
    assert streamer.sent == []


def test_a_record_as_the_reader_fills_it_is_taken():
    streamer, feed = chunk_feed()
    feed.record(np.int64(1), record(2, 1, 1, 0, 6, 0, 4, 4), np.int64(7))
    feed.record(1, [1, 2, 0, 8, 2])
    assert streamer.sent == [(1, [("b", 6), ("a", 8)], 1), (2, [("a", 10)], 1)]


@pytest.mark.parametrize(
    "step, holders, says",
    [
        (1.5, {0: "a"}, "step must be an int"),
        (1, [(0, "a")], "holders must be a dict"),
        (1, {"0": "a"}, "holders' slot must be an int"),
        (1, {True: "a"}, "holders' slot must be an int"),
        (1, {-1: "a"}, "holders' slot must be an int"),
        (1, {0: ""}, r"holders\[0\] must be a non-empty str"),
        (1, {0: 5}, r"holders\[0\] must be a non-empty str"),
    ],
)
def test_bad_slots_are_refused(step, holders, says):
    streamer = FakeStreamer()
    feed = transfer.PerChunkFeed(streamer)
    with pytest.raises(pdhal.InvalidArgumentError, match=says):
        feed.slots(step, holders)
    with pytest.raises(pdhal.InvalidArgumentError, match="slots were not given"):
        feed.record(1, record(1, 0, 0, 0, 4))


def test_slots_take_numpy_ints():
    streamer = FakeStreamer()
    feed = transfer.PerChunkFeed(streamer)
    feed.slots(np.int64(3), {np.int32(2): "a"})
    feed.record(3, record(1, 0, 2, 4, 4))
    assert streamer.sent == [(0, [("a", 8)], 3)]


# ---- transport names ---------------------------------------------------------------------


@pytest.mark.parametrize("bad", [["shm"], None, 3, b"shm", ""])
def test_a_transport_name_that_is_not_a_str_is_refused(bad):
    with pytest.raises(
        pdhal.InvalidArgumentError, match=r"transport name must be a non-empty str, got "
    ) as refused:
        transfer.transport(bad)
    assert repr(bad) in str(refused.value)
    assert transfer.transport("shm").name == "shm"


@pytest.mark.parametrize(
    "runs, why",
    [
        (None, "block runs must be a list"),
        ([(0, 0, 1, 5)], r"block run 0 must be \(first source block"),  # a 4th field
        ([(0, 0)], r"block run 0 must be \(first source block"),
        ([(0, 0, 1), (1 << 63, 0, 1)], "block run 1's source block"),
        ([(0, -1, 1)], "block run 0's destination block"),
        ([(0, 0, 0)], "block run 0's count"),
        ([(0, 0, 1.0)], "block run 0's count"),
        ([(0, "1", 1)], "block run 0's destination block"),
        ([(True, 0, 1)], "block run 0's source block"),
    ],
)
def test_block_runs_built_by_hand_are_checked_field_by_field(runs, why):
    """BlockRuns goes to C as flat words: a run of the wrong length would shift those after
    it, a huge or negative id overflow; each is refused when made, naming it."""
    with pytest.raises(pdhal.InvalidArgumentError, match=why):
        transfer.BlockRuns(runs)


def test_block_runs_cannot_change_under_their_packed_words():
    runs = transfer.BlockRuns([(0, 1, 2)])
    assert list(runs.words) == [0, 1, 2]
    with pytest.raises(AttributeError):
        runs.runs = [(5, 5, 5), (6, 6, 6)]
    assert runs.runs == ((0, 1, 2),)


@pytest.mark.parametrize(
    "cache, why",
    [
        ((0, 64, 0, 0, 64), r"cache 0 must be \(source address"),
        ((0, 64, -1, 0, 64, 64), "cache 0's region"),
        ((0, 0, 0, 0, 64, 64), "cache 0's source stride"),
        ((0, 64, 0, 0, 64, 0), "cache 0's block bytes"),
        ((0, 64, 0, 0, 32, 64), "longer than its strides"),
        ((1 << 64, 64, 0, 0, 64, 64), "cache 0's source address"),
        ((0, 64, 0, 0.5, 64, 64), "cache 0's offset"),
    ],
)
def test_layer_copies_built_by_hand_are_checked_field_by_field(cache, why):
    with pytest.raises(pdhal.InvalidArgumentError, match=why):
        transfer.LayerCopies([cache])


def test_submit_blocks_refuses_anything_but_its_two_types():
    """The default Link.submit_blocks and shm's (which hands them to C), before anything
    else: a list for the runs, None for the layer."""
    from pdhal._transfer.shm import ShmLink

    layer, runs = transfer.LayerCopies([(0, 64, 0, 0, 64, 64)]), transfer.BlockRuns([(0, 0, 1)])
    for link in (transfer.Link(), object.__new__(ShmLink)):
        with pytest.raises(pdhal.InvalidArgumentError, match="runs must be a BlockRuns"):
            link.submit_blocks(layer, [(0, 0, 1)])
        with pytest.raises(pdhal.InvalidArgumentError, match="layer must be a LayerCopies"):
            link.submit_blocks(None, runs)
