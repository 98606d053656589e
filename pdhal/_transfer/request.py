"""A request's life on the prefill side, as one state machine: every state and every
transition is here, so "the first failure wins" and "a request ends exactly once" hold by
construction rather than by each caller remembering them.

    ADDED ──claim──▶ STREAMING ──every layer landed──▶ POSTING ──word written──▶ ENDED
      │                  │                                 │
      └──────fail────────┴──▶ FAILING ──nothing in flight──┴──▶ (POSTING or) ENDED

A request fails at most once (a later failure is ignored); it is reported only once nothing
of it is in flight, so its decode side never has a write still to come after its outcome.
The streamer holds its lock around every method here; what a transition asks for (a status
write, a report) is returned to it as an Action and carried out outside the lock."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from pdhal._transfer.layout import extend_runs


class State(enum.Enum):
    ADDED = "added"  # its decode side is not known yet (the claim lease runs)
    STREAMING = "streaming"  # layers go to its destination as they become ready
    FAILING = "failing"  # failed: its writes in flight settle before it is reported
    POSTING = "posting"  # its outcome word is on its way to the decode side
    ENDED = "ended"  # its outcome is out; nothing of it will be written again


@dataclass(frozen=True)
class Action:
    """What the streamer does for a request that moved on: write its outcome word to the
    decode side (`post`), or report it (the prefill side's outcome)."""

    post: bool  # write the word `landed` / `reason` first; report once it settled
    landed: bool
    reason: str


@dataclass(eq=False)
class Request:
    id: str
    given: list[int]  # source blocks of the prompt from block `base` on (more may come)
    prompt_tokens: int  # of the prompt, those that go (the decode side may need fewer)
    layers: int
    blocks: int  # the blocks that go: from `cached` to the last of prompt_tokens
    cached: int = 0  # the prompt's first blocks, on the decode side already
    state: State = State.ADDED
    dest: object = None  # its Destination, once claimed
    epoch: int = 0  # the destination's link generation it was claimed in
    dst_blocks: list[int] = field(default_factory=list)
    slot: int = 0  # its ticket's status slot, generation and layerwise flag
    generation: int = 0
    layerwise: bool = False
    ready: list[int] = field(default_factory=list)  # tokens in the cache, per layer
    sent: list[int] = field(default_factory=list)  # blocks submitted, per layer
    landed: list[int] = field(default_factory=list)  # blocks in the destination, per layer
    layers_landed: int = 0  # the first layers, each of whose blocks all landed
    in_flight: int = 0  # writes of it not settled (data or progress, queued or submitted)
    gates: list = field(default_factory=list)  # its followed layers' (follow), till settled
    #: per layer, the gate of its last follow: blocks given later (add_blocks) wait on it too
    follows: list = field(default_factory=list)
    reason: str = ""  # why it failed
    post_failure: bool = True  # whether its decode side is to read why it failed
    nbytes: int = 0
    first_submit_ns: int | None = None
    last_signal_ns: int | None = None
    #: tokens of a source block; once claimed, what its counts (blocks, cached, sent,
    #: landed) are in: units of `unit_tokens`, `units` = (per source block, per
    #: destination block), which are blocks, (1, 1), where both sides' blocks are alike
    block_tokens: int = 1
    unit_tokens: int = 1
    units: tuple[int, int] = (1, 1)
    dst_skip: int = 0  # the destination blocks before dst_blocks' first (its cached prefix)

    def __post_init__(self):
        self.ready, self.sent, self.landed = [0] * self.layers, [0] * self.layers, [0] * self.layers
        self.follows = [None] * self.layers
        self.base = self.cached  # add_request's cached blocks (`given` starts after them)
        self.needed = self.blocks  # source blocks from `base` to the prompt's end
        self.unit_tokens = self.block_tokens

    # ---- what it is ---------------------------------------------------------------

    @property
    def live(self) -> bool:
        """Still to be sent (not failed, not ended)."""
        return self.state in (State.ADDED, State.STREAMING)

    @property
    def ended(self) -> bool:
        return self.state is State.ENDED

    @property
    def sources_missing(self) -> bool:
        """Its prompt is whole in every layer, yet not all its source blocks were given."""
        # the block count first: it is cheap and, once every block was given, decides
        # (layer_ready asks this for every request of every layer)
        short = (self.base + len(self.given)) * self.block_tokens < self.prompt_tokens
        return short and all(tokens >= self.prompt_tokens for tokens in self.ready)

    @property
    def all_sent(self) -> bool:
        """Every block of every layer was handed to its destination, a followed layer once
        the engine signalled it (its copies may not have started): it needs nothing more
        from the prefill side."""
        return (
            self.state is State.STREAMING
            and all(n == self.blocks for n in self.sent)
            and all(gate.came() for gate in self.gates)
        )

    def sendable(self, layer: int) -> int:
        """Units of `layer` that may go: the full ones, the last partial one once whole,
        of those whose source blocks are known."""
        tokens = self.ready[layer]
        known = min(
            self.blocks, max((self.base + len(self.given)) * self.units[0] - self.cached, 0)
        )
        if tokens >= self.prompt_tokens:
            return known
        return min(max(tokens // self.unit_tokens - self.cached, 0), known)

    def runs(self, first: int, end: int) -> list[list[int]]:
        """[first source id, first destination id, count] of each run of units [first, end)
        of those that go, consecutive on both sides: ids are block ids where units are
        blocks, else virtual ids (block * units per block + the unit's place in it). A
        stretch inside one block on both sides at a time, so its cost is in blocks, not
        units (a unit may be one token)."""
        (src_per, dst_per), out = self.units, []
        unit, stop = self.cached + first, self.cached + end
        while unit < stop:
            count = min(stop - unit, src_per - unit % src_per, dst_per - unit % dst_per)
            src = self.given[unit // src_per - self.base] * src_per + unit % src_per
            dst = self.dst_blocks[unit // dst_per - self.dst_skip] * dst_per + unit % dst_per
            extend_runs(out, src, dst, count)
            unit += count
        return out

    def source_blocks(self, first: int, end: int) -> list[int]:
        """The source blocks units [first, end) lie in, each once, in order (where a unit
        is part of a block, what holds it whole)."""
        per, unit = self.units[0], self.cached + first
        return self.given[unit // per - self.base : (unit + end - first - 1) // per - self.base + 1]

    # ---- transitions --------------------------------------------------------------

    def claim(self, dest, epoch: int, dst_blocks: list[int], ticket: tuple, need: tuple) -> None:
        """ADDED -> STREAMING: its decode side, blocks there and ticket (slot, generation,
        layerwise); it needs the prompt's first `tokens` from destination block `cached`
        on (nothing of it went yet), in units of `unit_tokens` (`units` per block on each
        side) from then on."""
        assert self.state is State.ADDED
        tokens, cached, self.unit_tokens, self.units = need
        self.prompt_tokens, self.dst_skip = tokens, cached
        self.cached = cached * self.units[1]
        self.blocks = -(-tokens // self.unit_tokens) - self.cached
        self.dest, self.epoch, self.dst_blocks = dest, epoch, dst_blocks
        self.slot, self.generation, self.layerwise = ticket
        self.state = State.STREAMING

    def mark_sent(self, layer: int, blocks: int) -> None:
        self.sent[layer] = blocks
        self.in_flight += 1

    def write_settled(self, layer: int | None, blocks: int, nbytes: int, reason: str | None):
        """One write of it settled: `blocks` of `layer` landed (reason None; layer None for
        a progress word), or it failed. Returns True when the first layers that all landed
        grew (a layerwise decode side is to hear of it)."""
        self.in_flight -= 1
        if reason is not None:  # its link broke: the decode side ends it by its deadline
            self.fail(reason, post=False)
            return False
        if layer is None:
            return False
        self.nbytes += nbytes
        self.landed[layer] += blocks
        grew = False
        while self.layers_landed < self.layers and self.landed[self.layers_landed] >= self.blocks:
            self.layers_landed += 1
            grew = True
        return grew and self.live and self.layerwise and self.layers_landed < self.layers

    def write_failed_alone(self, reason: str) -> None:
        """A write of it failed with its link sound (never started, or its batch's own
        failure): it fails, and its decode side is to read why."""
        self.in_flight -= 1
        self.fail(reason)

    def fail(self, reason: str, *, post: bool = True) -> bool:
        """ADDED or STREAMING -> FAILING (the first failure wins; later ones, and a failure
        of one whose outcome is already going out, are ignored). `post`: its decode side is
        to read the reason (False when its link broke: it ends the request by its own
        deadline). Returns whether it failed now."""
        if not self.live:
            return False
        self.state, self.reason, self.post_failure = State.FAILING, reason, post
        return True

    def advance(self) -> Action | None:
        """Move on if it can: a request with nothing in flight that failed, or all of whose
        layers landed, is posted (if it has a decode side to tell) or ended."""
        if self.in_flight:
            return None
        if self.state is State.STREAMING and self.layers_landed == self.layers:
            self.state = State.POSTING
            return Action(True, True, "")
        if self.state is State.FAILING:
            if self.dest is not None and self.post_failure:
                self.state = State.POSTING
                return Action(True, False, self.reason)
            self.state = State.ENDED
            return Action(False, False, self.reason)
        return None

    def abandon(self, reason: str) -> Action | None:
        """Any state but ENDED -> ENDED, failed, its decode side not told (close() past its
        bound: its writes did not settle)."""
        if self.state is State.ENDED:
            return None
        self.state = State.ENDED
        return Action(False, False, self.reason or reason)

    def posted(self, action: Action, why: str | None) -> Action:
        """POSTING -> ENDED once its word settled (`why` None) or failed: the outcome to
        report."""
        assert self.state is State.POSTING
        self.state = State.ENDED
        if why is None:
            return Action(False, action.landed, action.reason)
        if action.landed:
            return Action(False, False, f"the data landed but its status did not: {why}")
        return Action(False, False, action.reason)
