"""The session protocol's messages: what a prefill-side service and a decode-side client say
to each other (docs/session-protocol.md specifies them), as typed values.

Each message is a frozen dataclass; on the wire it is one JSON object, {"type": ..., field:
value, ...}, in one length-prefixed frame. Everything a peer sends is untrusted: decode()
checks the frame's size, the JSON, the type and every field (type and bounds) and raises a
SessionError naming what is wrong, so nothing malformed gets past the message that brought
it. The protocol's version is in the messages that open a session only (a hello, its
welcome, an abandon): a peer of another version is refused there, naming both versions,
before anything else of its is read."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from typing import ClassVar

from pdhal._errors import InvalidArgumentError, SessionError
from pdhal._transfer import checks

#: The protocol this pdhal speaks. A change a peer of the last version would misread
#: raises it; the hello refuses any other. 2: `ended`, which a peer of 1 would refuse.
PROTOCOL = 2
#: The largest frame accepted (a claim of a million blocks fits; a peer's flood does not).
MOST_BYTES = 1 << 24
#: The longest string field (ids, names, reasons).
MOST_CHARS = 4096
#: The shortest keepalive bound a side may have or a peer may say (s): a third of it is how
#: often pings go, so a peer saying less would have this side flood it.
LEAST_KEEPALIVE_S = 0.1


def keepalive(value: object, what: str) -> float:
    """`value` as a keepalive bound: seconds, at least LEAST_KEEPALIVE_S."""
    seconds = checks.seconds(value, what)
    if seconds < LEAST_KEEPALIVE_S:
        raise InvalidArgumentError(
            f"{what} must be at least {LEAST_KEEPALIVE_S:g} s, got {seconds:g}"
        )
    return seconds


@dataclass(frozen=True)
class Facts:
    """What one side is, as its hello says: everything the other side checks once, at the
    hello, before any request (a mismatch is refused naming both sides)."""

    role: str  # "prefill" or "decode"
    instance: str  # this side's session object; a restarted peer has another
    pid: int
    host: str
    transport: str
    transport_version: str
    namespace: str
    block_tokens: int
    kv_heads: int  # of the whole model; a rank holds its tensor-parallel share
    tp_rank: int
    tp_size: int
    #: this side's liveness bound (s): the other side pings within a third of the smaller
    #: of the two, so neither hears silence for its own bound however the two differ
    keepalive: float

    def named(self) -> str:
        """This side, for a message: "the decode side (rank 1 of 2, pid 42 on host-a)"."""
        return (
            f"the {self.role} side (rank {self.tp_rank} of {self.tp_size}, pid {self.pid} "
            f"on {self.host})"
        )


@dataclass(frozen=True)
class Hello:
    """Client -> service, first: its facts and its KV receiver's describe()."""

    TYPE: ClassVar[str] = "hello"
    protocol: int
    facts: Facts
    described: dict


@dataclass(frozen=True)
class Welcome:
    """Service -> client, the hello accepted: the service's facts."""

    TYPE: ClassVar[str] = "welcome"
    protocol: int
    facts: Facts


@dataclass(frozen=True)
class Refused:
    """Either way, then the connection closes: why (naming both sides)."""

    TYPE: ClassVar[str] = "refused"
    reason: str


@dataclass(frozen=True)
class Claim:
    """Client -> service: part `part` of request `request` goes to `blocks` of the
    client's caches (the first `cached_blocks` of the prompt it has already), `tokens`
    of the prompt, its outcome to the status slot of `ticket` (the receiver's expect())."""

    TYPE: ClassVar[str] = "claim"
    request: str
    part: str
    blocks: list[int]
    tokens: int
    cached_blocks: int
    ticket: dict


@dataclass(frozen=True)
class Cached:
    """Client -> service: the decode side has every block of `part` of `request` already
    (its prefix cache): nothing of it is sent, and it counts as landed."""

    TYPE: ClassVar[str] = "cached"
    request: str
    part: str


@dataclass(frozen=True)
class Cancel:
    """Client -> service: the decode side no longer wants `part` (its request was aborted):
    the service writes nothing more of it."""

    TYPE: ClassVar[str] = "cancel"
    part: str


@dataclass(frozen=True)
class Unserved:
    """Service -> client: nothing of `part` was written, nor will be (the request failed or
    ended before the claim, the claim was refused or cancelled), so its blocks are free."""

    TYPE: ClassVar[str] = "unserved"
    part: str
    reason: str


@dataclass(frozen=True)
class Ended:
    """Service -> client: the streamer ended `part` (its outcome is in the part's status
    slot, unless the transport failed first). Only a wake, so that a decode side waiting
    for something to report (DecodeClient.poll(timeout)) looks now: the slot, written
    through the transport, says how it ended."""

    TYPE: ClassVar[str] = "ended"
    part: str


@dataclass(frozen=True)
class Abandon:
    """Whoever holds the deployment's key (a router) -> service, instead of a hello:
    `request`'s decode side will never claim it (its decode request failed), so the
    service fails it if no decode side claimed it (a claimed one is its decode side's to
    end), or, added later, at once. The service answers with a Welcome (its facts: how
    many ranks to tell) and closes."""

    TYPE: ClassVar[str] = "abandon"
    protocol: int
    request: str
    reason: str


@dataclass(frozen=True)
class Ping:
    """Either way, when a side has sent nothing for a third of the keepalive bound."""

    TYPE: ClassVar[str] = "ping"


Message = Hello | Welcome | Refused | Claim | Cached | Cancel | Unserved | Ended | Abandon | Ping
_TYPES = {
    cls.TYPE: cls
    for cls in (Hello, Welcome, Refused, Claim, Cached, Cancel, Unserved, Ended, Abandon, Ping)
}
#: The messages that open a session (their protocol version is checked first).
_OPENING = (Hello, Welcome, Abandon)


def encode(message: Message) -> bytes:
    """`message` as one frame's bytes."""
    return json.dumps({"type": message.TYPE, **asdict(message)}).encode()


def decode(frame: bytes) -> Message:
    """A frame from a peer as a message, every field checked; SessionError naming what is
    wrong otherwise (a hello or welcome of another protocol version names both)."""
    if len(frame) > MOST_BYTES:
        raise SessionError(f"a message of {len(frame)} bytes (at most {MOST_BYTES})")
    try:
        data = json.loads(frame)
    except (ValueError, RecursionError) as e:
        raise SessionError(f"a message that is not JSON ({e})") from None
    if not isinstance(data, dict):
        raise SessionError(f"a message that is not a JSON object: {_short(data)}")
    kind = data.pop("type", None)
    cls = _TYPES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise SessionError(f"a message of unknown type {_short(kind)} (known: {', '.join(_TYPES)})")
    if cls in _OPENING and data.get("protocol") != PROTOCOL:
        raise SessionError(
            f"a {kind!r} message of protocol version {_short(data.get('protocol'))}; this "
            f"side speaks version {PROTOCOL}"
        )
    try:
        return _build(cls, data, kind)
    except InvalidArgumentError as e:
        raise SessionError(f"a malformed {kind}: {e}") from None


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _text(value: object, what: str) -> str:
    text = checks.name(value, what)
    if len(text) > MOST_CHARS:
        raise InvalidArgumentError(f"{what} is {len(text)} characters, at most {MOST_CHARS}")
    return text


def _json_object(value: object, what: str) -> dict:
    if not isinstance(value, dict):
        raise InvalidArgumentError(f"{what} must be an object, got {_short(value)}")
    return value


def _facts(value: object, what: str) -> Facts:
    facts = _build(Facts, _json_object(value, what), what)
    if facts.tp_rank >= facts.tp_size:
        raise InvalidArgumentError(
            f"{what}: tp_rank {facts.tp_rank} is not a rank of tp_size {facts.tp_size}"
        )
    return facts


def _role(value: object, what: str) -> str:
    if value not in ("prefill", "decode"):
        raise InvalidArgumentError(f"{what} must be 'prefill' or 'decode', got {_short(value)}")
    return value


def _blocks(value: object, what: str) -> list[int]:
    if not isinstance(value, list):
        raise InvalidArgumentError(f"{what} must be a list of block ids, got {_short(value)}")
    return checks.block_ids(value, what, checks.LARGEST)


def _version(value: object, what: str) -> str:
    """A version string, maybe empty (a transport that does not say)."""
    if not isinstance(value, str) or len(value) > MOST_CHARS:
        raise InvalidArgumentError(f"{what} must be a version string, got {_short(value)}")
    return value


#: How each field of a message is checked, by its name.
_CHECKS: dict[str, Callable[[object, str], object]] = {
    "protocol": lambda v, w: checks.integer(v, w),
    "facts": _facts,
    "described": _json_object,
    "ticket": _json_object,
    "reason": _text,
    "request": _text,
    "part": _text,
    "blocks": _blocks,
    "tokens": lambda v, w: checks.integer(v, w, 1),
    "cached_blocks": lambda v, w: checks.integer(v, w),
    "role": _role,
    "instance": _text,
    "pid": lambda v, w: checks.integer(v, w, 1, (1 << 31) - 1),
    "host": _text,
    "transport": _text,
    "transport_version": _version,
    "namespace": _text,
    "block_tokens": lambda v, w: checks.integer(v, w, 1, 1 << 20),
    "kv_heads": lambda v, w: checks.integer(v, w, 1, 1 << 16),
    "tp_rank": lambda v, w: checks.integer(v, w, 0, (1 << 16) - 1),
    "tp_size": lambda v, w: checks.integer(v, w, 1, 1 << 16),
    "keepalive": keepalive,
}


def _build(cls, data: dict, what: str):
    """`cls` from `data`: exactly its fields, each checked (InvalidArgumentError)."""
    names = [f.name for f in fields(cls)]
    unknown = sorted(set(data) - set(names))
    missing = [n for n in names if n not in data]
    if unknown or missing:
        raise InvalidArgumentError(f"{what} has fields {sorted(data)}, expected {names}")
    return cls(**{n: _CHECKS[n](data[n], f"{what}'s {n}") for n in names})
