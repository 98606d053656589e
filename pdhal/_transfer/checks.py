"""Every value that crosses pdhal.transfer's API, checked once at the call that brings it.

A caller's ids, counts, block lists, tickets and timeouts, and a peer's descriptions, are
turned here into plain Python values (an int is anything with __index__ but a bool: numpy
integers included) or refused with an InvalidArgumentError naming the argument, the value
and what was expected. Nothing unchecked is carried into a later layer or another request's
send, so a bad value fails only the call that gave it."""

from __future__ import annotations

import hashlib
import operator

from pdhal._errors import InvalidArgumentError

#: The longest timeout pdhal.transfer takes (a day): beyond it, a bound means nothing.
LONGEST_S = 86400.0
#: The largest block id, offset or byte count accepted (2^48: beyond any real memory).
LARGEST = 1 << 48
#: The largest address (64 bits: device memory's too).
ADDRESS_MAX = (1 << 64) - 1
#: The largest time.monotonic_ns() value accepted (int64: its range).
LATEST_NS = (1 << 63) - 1


def integer(value: object, what: str, low: int = 0, high: int = LARGEST) -> int:
    """`value` as an int in [low, high]; anything with __index__ but a bool."""
    number = _index(value)
    if number is None:
        expected = f"an int >= {low}" if high == LARGEST else f"an int in [{low}, {high}]"
        raise InvalidArgumentError(f"{what} must be {expected}, got {value!r}")
    if not low <= number <= high:
        raise InvalidArgumentError(f"{what} must be an int in [{low}, {high}], got {number}")
    return number


def _index(value: object) -> int | None:
    """`value` as an int if it is one (anything with __index__ but a bool), else None (a
    numpy array of one element has __index__ too, and raises in it)."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def seconds(value: object, what: str) -> float:
    """`value` as a timeout in seconds: a real number > 0 and at most a day."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidArgumentError(f"{what} must be a number of seconds, got {value!r}")
    # compared as it is: an int too large for a float (a peer's JSON) is out of range, not
    # an OverflowError; NaN compares false
    if not 0 < value <= LONGEST_S:
        shown = value if isinstance(value, float) or abs(value) < 10**20 else "a huge int"
        raise InvalidArgumentError(f"{what} must be in (0, {LONGEST_S:g}] seconds, got {shown}")
    return float(value)


def timeout_or_zero(value: object, what: str) -> float:
    """`value` as how long to wait: 0 (not at all), or seconds as seconds() takes them."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value == 0:
        return 0.0
    return seconds(value, what)


def blocks_digest(ids: list[int]) -> str:
    """What a ticket says of its request's destination blocks (KVReceiver.expect's
    `blocks`): the prefill side refuses other blocks (32 hex digits)."""
    return hashlib.blake2b(",".join(map(str, ids)).encode(), digest_size=16).hexdigest()


def flag(value: object, what: str) -> bool:
    if not isinstance(value, bool):
        raise InvalidArgumentError(f"{what} must be a bool, got {value!r}")
    return value


def name(value: object, what: str) -> str:
    """A non-empty str (a request id, a reason)."""
    if not isinstance(value, str) or not value:
        raise InvalidArgumentError(f"{what} must be a non-empty str, got {value!r}")
    return value


def block_ids(
    values: object, what: str, limit: int, where: str = "caches", *, unique: bool = False
) -> list[int]:
    """`values` (an ordered iterable of ints: a list, a numpy array, a range) as a list of ints in
    [0, limit) (`where`: whose blocks, for the message); `unique`: no id twice (two blocks
    of one request written to one place would lose one of them)."""
    if isinstance(values, (str, bytes, dict, set, frozenset)) or not hasattr(values, "__iter__"):
        raise InvalidArgumentError(f"{what} must be a list of block ids, got {values!r}")
    try:
        items = iter(values)
    except TypeError:  # (a 0-d numpy array has __iter__ and refuses it)
        raise InvalidArgumentError(f"{what} must be a list of block ids, got {values!r}") from None
    ids = []
    for index, value in enumerate(items):
        number = _index(value)
        if number is None:
            raise InvalidArgumentError(
                f"{what}[{index}] must be a block id (an int), got {value!r}"
            )
        if not 0 <= number < limit:
            raise InvalidArgumentError(
                f"{what}[{index}] is block {number}, outside the {where}' {limit} blocks"
            )
        ids.append(number)
    if unique and len(set(ids)) != len(ids):
        twice = sorted({i for i in ids if ids.count(i) > 1})
        raise InvalidArgumentError(f"{what} names block(s) {twice} more than once")
    return ids
