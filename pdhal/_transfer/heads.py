"""Tensor parallelism: which KV heads go from which prefill rank to which decode rank.

The ranks of a tensor-parallel instance split the model's KV heads evenly and in order:
with H heads over N ranks, rank r holds heads [r*H/N, (r+1)*H/N); with fewer heads than
ranks (each head replicated), rank r holds head r*H//N alone. A prefill instance and a
decode instance may split them differently (2 ranks -> 1, 1 -> 2, ...): each decode rank
gets each head it holds from one prefill rank that holds it, and nothing else.

A cache splits by head when its blocks are head-major (each head's part of a block is
contiguous) and its CacheSpec counts the heads; KVStreamer.connect(described, heads=shard)
then sends the shard's heads only, after checking that both sides hold them and that a head
is the same bytes on both."""

from __future__ import annotations

from dataclasses import dataclass

from pdhal._errors import InvalidArgumentError
from pdhal._transfer.checks import integer

#: The most KV heads, and tensor-parallel ranks, a split takes (head_shards pairs every
#: source rank with every destination rank: beyond this the numbers are not a model's).
MOST = 1 << 16


@dataclass(frozen=True)
class HeadShard:
    """`count` heads from head `src_first` of a source rank's caches to head `dst_first`
    of a destination rank's (first heads counted within each rank). Checked when made:
    ints (numpy ints converted), firsts >= 0, count >= 1; InvalidArgumentError otherwise."""

    src_first: int
    dst_first: int
    count: int

    def __post_init__(self) -> None:
        for field, least in (("src_first", 0), ("dst_first", 0), ("count", 1)):
            value = integer(getattr(self, field), f"HeadShard.{field}", least, MOST)
            object.__setattr__(self, field, value)  # frozen: set once, converted


def rank_heads(heads: int, ranks: int, rank: int) -> range:
    """The KV heads (of all `heads`) tensor-parallel rank `rank` of `ranks` holds."""
    heads, ranks = integer(heads, "heads", 1, MOST), integer(ranks, "ranks", 1, MOST)
    if heads % ranks and ranks % heads:
        raise InvalidArgumentError(
            f"{heads} KV heads do not split over {ranks} tensor-parallel ranks: the heads "
            f"must be a multiple of the ranks, or the ranks of the heads"
        )
    rank = integer(rank, "rank", 0, ranks - 1)
    if heads >= ranks:
        share = heads // ranks
        return range(rank * share, (rank + 1) * share)
    return range(rank * heads // ranks, rank * heads // ranks + 1)


def head_shards(heads: int, src_ranks: int, dst_ranks: int) -> dict[tuple[int, int], HeadShard]:
    """{(source rank, destination rank): the heads it sends}, for `heads` KV heads split
    over `src_ranks` on the source side and `dst_ranks` on the destination side. Each head
    a destination rank holds comes from the first source rank that holds it."""
    heads = integer(heads, "heads", 1, MOST)
    src_ranks = integer(src_ranks, "src_ranks", 1, MOST)
    dst_ranks = integer(dst_ranks, "dst_ranks", 1, MOST)
    src = [rank_heads(heads, src_ranks, r) for r in range(src_ranks)]
    holder: dict[int, int] = {}  # head -> the first source rank holding it
    for r, theirs in enumerate(src):
        for k in theirs:
            holder.setdefault(k, r)
    out: dict[tuple[int, int], HeadShard] = {}
    for d in range(dst_ranks):
        mine = rank_heads(heads, dst_ranks, d)
        for r, theirs in enumerate(src):
            first, end = max(mine.start, theirs.start), min(mine.stop, theirs.stop)
            if first >= end or any(holder[k] < r for k in range(first, end)):
                continue  # held by an earlier source rank (heads replicated there)
            out[(r, d)] = HeadShard(first - theirs.start, first - mine.start, end - first)
    return out
