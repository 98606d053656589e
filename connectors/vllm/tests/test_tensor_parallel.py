"""Tensor parallelism on both sides and between them: a prefill instance of TP P (a messager
per rank, on consecutive ports) streams into decode instances of TP D, each side's ranks
worker processes of their own; a prefill of TP 2 serves a decode instance of TP 2 and one of
TP 1 at once (each part made when its decode rank says its split at its hello). Each decode
rank holds KV heads [d * H / D, (d + 1) * H / D) and must receive exactly those, from
whichever prefill ranks hold them; the bytes of every head of every block are compared
where the prefill wrote them, where its messager read them and where the decode side holds
them, and the tokens are a plain run's. The model runs in
float32 here: in bfloat16 the ranks' partial sums round differently than one rank's whole
sums, and the tiny model's greedy tokens already differ between plain TP 1 and TP 2 runs."""

from __future__ import annotations

import pytest
from conftest import (
    KV_HEADS,
    LAYERS,
    after_prefill,
    free_ports,
    head_crcs,
    plain_run,
    prefill_first,
    prompts,
    write_prompts,
)

from pdhal.transfer import rank_heads

# vLLM binds each CPU worker to a NUMA node of its own by default and refuses to start TP 2
# on a machine with one node (as here): each rank's threads are left unbound instead.
UNBOUND = {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}
ITEMS = prompts()[:2]  # 40 and 100 tokens: 2 and 4 blocks
FLOAT32 = ("--dtype", "float32")


@pytest.fixture(scope="module")
def plain_float32(tmp_path_factory, model_dir) -> dict[tuple, list[int]]:
    return plain_run(tmp_path_factory.mktemp("plain32"), model_dir, ITEMS, *FLOAT32)


def start_messagers(cluster, prefill_tp: int, base: int) -> None:
    """One per prefill rank; none is told the decode side's split (each decode rank says
    its own at its hello)."""
    for rank in range(prefill_tp):
        cluster.start_messager(
            "--prefill-tp", str(prefill_tp), rank=rank, listen=f"127.0.0.1:{base + rank}"
        )


@pytest.mark.parametrize("prefill_tp, decode_tps", [(2, (2, 1)), (1, (2,))])
def test_each_decode_rank_receives_exactly_its_heads(
    cluster, plain_float32, prefill_tp, decode_tps
):
    cluster.env |= UNBOUND
    # decode instance n (named "tpD.n") asks for its own transfers of the prompts
    decodes = {f"tp{tp}.{n}": tp for n, tp in enumerate(decode_tps)}
    asked = {name: [dict(item, tid=f"{name}-{item['tid']}") for item in ITEMS] for name in decodes}
    start_messagers(cluster, prefill_tp, free_ports(prefill_tp))
    for name, tp in decodes.items():
        cluster.start(
            "decode",
            write_prompts(cluster, asked[name], f"{name}.prompts.json"),
            "--tp",
            str(tp),
            *FLOAT32,
            "--submitted-file",
            cluster.path(f"{name}.submitted"),
            *after_prefill(cluster),
            name=name,
        )
    every_item = [item for items in asked.values() for item in items]
    cluster.start(
        "prefill",
        write_prompts(cluster, every_item),
        "--tp",
        str(prefill_tp),
        *FLOAT32,
        *prefill_first(cluster),
        *(arg for name in decodes for arg in ("--wait-file", cluster.path(f"{name}.submitted"))),
    )
    for name in decodes:
        decoded = cluster.wait(name, timeout=400)
        for item, result in zip(asked[name], decoded["results"]):
            assert result["tokens"] == plain_float32[tuple(item["tokens"])], item["tid"]
    cluster.wait("prefill", timeout=400)

    blocks = {
        (item["tid"], layer, i)
        for item in every_item
        for layer in range(LAYERS)
        for i in range(-(-len(item["tokens"]) // 32))
    }
    every = {(*block, head) for block in blocks for head in range(KV_HEADS)}
    written = {}
    for rank in range(prefill_tp):
        mine = head_crcs(cluster.trace(f"prefill{rank}"))
        assert {k[3] for k in mine} == set(rank_heads(KV_HEADS, prefill_tp, rank))
        written |= mine
    read = {}
    for rank in range(prefill_tp):
        read |= head_crcs(cluster.trace(f"messager{rank or ''}"))
    assert set(read) >= every  # (each messager reads every prompt block of its heads)
    assert {k: read[k] for k in every} == {k: written[k] for k in every}
    for name, tp in decodes.items():
        tids = {item["tid"] for item in asked[name]}
        for rank in range(tp):
            events = cluster.trace(f"{name}.decode{rank}")
            held = head_crcs(events)
            heads = set(rank_heads(KV_HEADS, tp, rank))
            assert {k[3] for k in held} == heads, (name, rank)  # its rank's heads, no other
            assert held == {k: read[k] for k in every if k[3] in heads and k[0] in tids}
            landed = {}
            for e in events:
                if e["kind"] == "landed":
                    landed.setdefault(e["tid"], []).append(e["layer"])
            assert landed == {tid: list(range(LAYERS)) for tid in tids}, (name, rank)
