"""What this process has mapped, from /proc/self/maps: whether memory a caller names by
its address can be read here at all (an address pdhal did not allocate, that a copy would
otherwise fault on)."""

from __future__ import annotations

import bisect


def _readable_ranges() -> list[tuple[int, int]]:
    """This process's readable mappings as [start, end), in address order, mappings that
    follow each other merged."""
    ranges: list[tuple[int, int]] = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            span, perms = line.split(" ", 2)[:2]
            if perms[0] != "r":  # a guard page, a reserved range (PROT_NONE)
                continue
            start, end = (int(x, 16) for x in span.split("-"))
            if ranges and ranges[-1][1] == start:
                ranges[-1] = (ranges[-1][0], end)
            else:
                ranges.append((start, end))
    return ranges


def unreadable(spans: list[tuple[int, int]]) -> int | None:
    """The index of the first (address, bytes) span not wholly inside readable memory of
    this process, or None when every one is."""
    ranges = _readable_ranges()
    starts = [start for start, _ in ranges]
    for index, (address, nbytes) in enumerate(spans):
        at = bisect.bisect_right(starts, address) - 1  # the last range starting at or before
        if at < 0 or address + max(nbytes, 1) > ranges[at][1]:
            return index
    return None
