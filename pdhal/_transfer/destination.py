"""One decode side a streamer sends to, as an active object: it owns its link, its window of
writes in flight, the writes waiting for that window, the buffers its status words go out
from, and two threads, one submitting its writes in order and one completing them in order
(and, once a step is followed, a third settling its followed sends: see arm).
The streamer only hands it writes (put) and never waits on it, so no caller of the
streamer (a layer signal, fail, abort, a messager's event loop) is held by a slow decode
side, and every copy, the shm transport's memmove included, runs off the caller's thread.

A write that fails, or has not landed stall_timeout after it was submitted, breaks the
destination as a whole: every request sent to it so far fails (its decode side ends it by
its own deadline), the writes still waiting are dropped, and the link is retired, closed
once the writes on it settled. Nothing of the old link is used again (no status buffer a
stalled write may still read), and the next request sent there connects anew: a stall that
passes costs the requests in flight, never the ones after it.

Why the completing thread waits on each write in turn rather than on a wake: a transport's
Batch is a completion to poll or wait for (Mooncake's and NIXL's are polled); each wait is
bounded by what is left of that write's own stall_timeout."""

from __future__ import annotations

import collections
import ctypes
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pdhal._errors import BatchFailedError, TransferError
from pdhal._protocol import core as _core
from pdhal._transfer import mailbox
from pdhal._transfer.contract import Batch, Gate, Link
from pdhal._transfer.layout import BlockRuns, RunPlanner

#: The shortest wait for a write whose stall_timeout passed while it queued: one look.
MIN_WAIT_S = 1e-3


@dataclass(eq=False)
class Write:
    """One submit to a destination, from the moment it is put to when it settled."""

    epoch: int = 0  # the destination's link generation it was put in
    batch: Batch | None = None  # once submitted
    submit_ns: int = 0
    failed: str | None = None  # why it could not be submitted; "" when dropped unsent
    channel: _Channel | None = None
    #: It failed and its link is sound (a followed send whose copies never started, a
    #: batch whose failure was its own: BatchFailedError): nothing breaks, and its
    #: requests' decode side is told why
    link_sound: bool = False


@dataclass(eq=False)
class Send(Write):
    """One layer's newly sendable blocks of some requests."""

    layer: int = 0
    items: list = field(default_factory=list)  # (request, blocks) it carries
    runs: BlockRuns | None = None  # its block runs, the same in each layer of a step
    nbytes: int = 0
    signal_ns: int = 0  # followed: when the link saw the signal
    step: int | None = None  # the engine's, if it said
    gate: Gate | None = None  # followed (KVStreamer.follow): the signal its copies wait for


@dataclass(eq=False)
class StatusWrite(Write):
    """Bytes into one request's status slot: a progress word, a failure's reason, or its
    outcome word (`action`: the outcome it posts, None for progress)."""

    request: object = None
    at: int = 0  # offset in the slot
    data: bytes = b""
    action: object = None
    then: bytes | None = None  # the outcome word, written once this reason landed
    buffer: int = 0  # the status buffer it is copied from, once submitted


class StatusBuffers:
    """Source memory for status words, one buffer per write that may be in flight."""

    def __init__(self, count: int):
        self._memory = (ctypes.c_char * (count * mailbox.SLOT_BYTES))()
        self.address, self.nbytes = ctypes.addressof(self._memory), count * mailbox.SLOT_BYTES
        self._free = collections.deque(range(count))

    def take(self) -> int:
        return self.address + self._free.popleft() * mailbox.SLOT_BYTES

    def give_back(self, address: int) -> None:
        self._free.append((address - self.address) // mailbox.SLOT_BYTES)


class _Channel:
    """One link to the decode side and the status buffers it copies from."""

    def __init__(self, link: Link, status: StatusBuffers):
        self.link, self.status = link, status
        self.outstanding = 0  # writes submitted on it, not settled
        self.retired = False  # no new writes; closed once the last settled


class Destination:
    """A decode side, connected (KVStreamer.connect)."""

    def __init__(
        self,
        connect: Callable[[tuple[int, int]], Link],
        planner: RunPlanner,
        status_region: int,
        status_slots: int,
        receiver: str,
        window: int,
        stall_timeout: float,
        settled: Callable[[Destination, Write, str | None], None],
        broken: Callable[[Destination, int, str], None],
        posts: bool = False,
    ):
        """`connect(status source)`: a new link to the decode side; `settled(dest, write,
        reason)`: a write landed (None), failed (its reason) or was dropped unsent ("");
        `broken(dest, epoch, reason)`: every request put before `epoch` is to fail;
        `posts`: the transport's submit only queues its copies (Transport.posts), so a write
        put while nothing waits is submitted on the caller's thread."""
        self.planner, self.status_region, self.status_slots = planner, status_region, status_slots
        self.receiver = receiver  # the receiver tickets for this decode side must name
        self._connect, self._window, self._stall = connect, window, stall_timeout
        self._settled, self._broken, self._posts = settled, broken, posts
        #: Why its process is gone, once a peer check found it so (a gone decode side is
        #: not connected again: its requests fail, and it is forgotten once it has none).
        self.gone: str | None = None
        self._cond = threading.Condition()
        self._inbox: collections.deque[Write] = collections.deque()  # waiting for the window
        self._submitted: collections.deque[Write] = collections.deque()  # in order
        self._taken = 0  # window places held: being submitted, or submitted and unsettled
        self._submitting = 0  # writes being submitted (0 or 1), on either thread
        self._stopping = False
        self._submitting_done = False
        #: Followed sends submitted (arm), in order, and the thread settling them (made by
        #: the first), woken by _armed_bell
        self._armed: collections.deque[Send] = collections.deque()
        self._arming = 0  # sends counted on a link by arm, not in _armed yet
        self._armed_bell = _core.Bell()
        self._armer: threading.Thread | None = None
        #: Rung when _submitted grows or submitting ended: the completing thread waits on
        #: it in C, so a write submitted on a caller's thread hands no lock to a Python
        #: thread (Condition.notify is ~100 us of the caller's time under the GIL)
        self._bell = _core.Bell()
        #: The link generation: a break starts the next one.
        self.epoch = 0
        #: (generation, why) once a connect after a break failed: its other writes fail
        self._unreachable: tuple[int, str] | None = None
        # a connect failure is the caller's; one that hangs (a cut-off peer) is one too
        self._channel: _Channel | None = _within(self._open, stall_timeout, "connecting")
        self._running = 0  # its threads not ended: the last, once stopping, closes the link
        self._threads = [
            self._thread(self._submit_loop, "pdhal-transfer-submit"),
            self._thread(self._complete_loop, "pdhal-transfer-complete"),
        ]

    def _open(self) -> _Channel:
        status = StatusBuffers(self._window + 1)
        return _Channel(self._connect((status.address, status.nbytes)), status)

    def _reopen(self, epoch: int) -> _Channel:
        """A new channel after a break, the transport's connect bounded by stall_timeout:
        it runs on a thread of its own (a connect to a cut-off peer may block for minutes,
        and the writes behind it, a failed request's word among them, would wait), and one
        that returns late is closed. Once a connect of link generation `epoch` failed, the
        other writes of that generation fail at once, each without another try."""
        if self._unreachable is not None and self._unreachable[0] == epoch:
            raise TransferError(self._unreachable[1])
        try:
            return _within(self._open, self._stall, "connecting again")
        except Exception as e:
            self._unreachable = (epoch, _why(e))
            raise

    # ---- what the streamer asks ---------------------------------------------------

    def put(self, write: Write) -> None:
        """Queue `write` behind those put before it (never blocks on the decode side). With
        a transport that posts, a write that would be the next submitted, with window room
        and a link, is submitted here: a post returns at once."""
        direct = self._posts and not self._unneeded(write)
        with self._cond:
            if self._submitting_done:
                channel = None
            else:
                write.epoch, channel = self.epoch, self._channel
                if not (
                    direct
                    and channel is not None
                    and not self._inbox
                    and not self._submitting
                    and self._taken < self._window
                ):
                    self._inbox.append(write)
                    self._cond.notify_all()
                    return
                self._submitting += 1
                self._taken += 1
                channel.outstanding += 1
        if channel is None:
            write.failed = "the streamer was closed"
            self._settled(self, write, write.failed)
            return
        try:
            self._send(write, channel)
        finally:
            if write.batch is None and write.failed is None:  # a KeyboardInterrupt in it
                write.failed = "the submit was interrupted"
            with self._cond:
                self._submitting -= 1
                self._submitted.append(write)
                if self._inbox:  # put meanwhile: the submitting thread's turn
                    self._cond.notify_all()
            self._bell.ring()

    def arm(self, send: Send) -> None:
        """Submit a followed `send` (its copies gated on the engine's layer signal) now, on
        the caller's thread, beside the other writes rather than among them: its gate may
        wait as long as a layer computes, and no other write, nor the window, waits behind
        it (shm runs gated copies on a copier of their own). A thread of their own settles
        followed sends in order. Without a link to submit on, or where submits may block,
        it is put as any write."""
        with self._cond:
            channel = self._channel
            lane = self._posts and channel is not None and not self._stopping
            if lane:  # it counts on its link until it settled, submitted or not
                send.epoch, send.channel = self.epoch, channel
                channel.outstanding += 1
                self._arming += 1  # (stop's threads wait for it)
                if self._armer is None:
                    self._armer = self._thread(self._armed_loop, "pdhal-transfer-followed")
                    self._threads.append(self._armer)
        if not lane:
            self.put(send)
            return
        try:
            if self._unneeded(send):
                send.failed = ""
            else:
                self._send(send, channel)
        finally:
            if send.batch is None and send.failed is None:  # a KeyboardInterrupt in it
                send.failed = "the submit was interrupted"
            with self._cond:
                self._armed.append(send)
                self._arming -= 1
                self._cond.notify_all()
            self._armed_bell.ring()
        if send.batch is not None and self._unneeded(send):  # failed meanwhile
            send.batch.cancel()

    def give_up_unneeded(self) -> None:
        """Cancel the followed sends that no live request needs and whose signal has not
        come (a request failed): they will not copy, and their requests' outcomes wait for
        no signal that may never come. Those not submitted yet are dropped when their turn
        comes."""
        with self._cond:
            followed = [w for w in (*self._armed, *self._submitted) if isinstance(w, Send)]
        for send in followed:
            if send.gate is not None and send.batch is not None and self._unneeded(send):
                send.batch.cancel()

    def problem(self) -> str | None:
        """Why the decode side looks gone (its link's problem()), or None."""
        with self._cond:
            channel = self._channel
        if channel is None:
            return None
        try:
            return channel.link.problem()
        except Exception as e:  # a transport's bug: the link is not to be trusted
            return f"the transport's problem() raised {type(e).__name__}: {e}"

    def break_(self, reason: str, epoch: int | None = None) -> None:
        """Fail every request put so far (of link generation `epoch`, if given: a late
        failure of an older link's write breaks nothing new), drop the writes waiting, and
        retire the link: the next write connects anew."""
        with self._cond:
            if epoch is not None and epoch != self.epoch:
                return
            ended, self.epoch = self.epoch, self.epoch + 1
            channel, self._channel = self._channel, None
            close = channel is not None and self._retire(channel)
            dropped = list(self._inbox)
            self._inbox.clear()
        if close:
            channel.link.close()
        self._broken(self, ended + 1, reason)
        for write in dropped:
            write.failed = reason
            self._settled(self, write, reason if isinstance(write, StatusWrite) else "")

    def runs_here(self) -> bool:
        """Whether the caller is one of this destination's threads (a settle callback)."""
        return threading.current_thread() in self._threads

    def stop(self, deadline: float) -> bool:
        """Settle what was put, then close the link (its last thread to end does); False
        if that did not end by `deadline` (time.monotonic()): its threads are left to end
        on their own, and the link closes when they have."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
            threads = list(self._threads)
        self._armed_bell.ring()
        for thread in threads:
            thread.join(max(deadline - time.monotonic(), 0))
        return not any(thread.is_alive() for thread in threads)

    @staticmethod
    def _retire(channel: _Channel) -> bool:
        """Retire `channel` (under the lock); True when it is to be closed now."""
        channel.retired = True
        return channel.outstanding == 0

    # ---- its threads ----------------------------------------------------------------

    def _thread(self, loop: Callable[[], None], name: str) -> threading.Thread:
        """Start one of its threads, running `loop` (under the lock, or before any other)."""
        self._running += 1
        thread = threading.Thread(target=self._run, args=(loop,), name=name, daemon=True)
        thread.start()
        return thread

    def _run(self, loop: Callable[[], None]) -> None:
        """Run `loop`, which ends once stopping; the last of its threads to end closes the
        link, whether or not stop() still waits (a lost connect race, a gone peer)."""
        try:
            loop()
        finally:
            with self._cond:
                self._running -= 1
                channel = None
                if not self._running:
                    channel, self._channel = self._channel, None
            if channel is not None:
                channel.link.close()

    def _submit_loop(self) -> None:
        """Submit each write in order as the window has room."""
        while True:
            with self._cond:
                # once stopping, it ends when nothing is queued or in flight (a write
                # settling may queue another: a failure's word after its reason)
                # (a followed send settling may queue its request's word: the armed too)
                while not (
                    self._inbox and self._taken < self._window and not self._submitting
                ) and not (
                    self._stopping
                    and not self._inbox
                    and not self._taken
                    and not self._armed
                    and not self._arming
                ):
                    self._cond.wait()
                write = self._inbox.popleft() if self._inbox else None
                if write is None:
                    self._submitting_done = True
                else:
                    self._taken += 1
                    self._submitting += 1  # no put submits on its own thread meanwhile
            if write is None:
                self._bell.ring()  # the completing thread ends once what it has settled
                return
            self._submit(write)
            with self._cond:
                self._submitting -= 1
                self._submitted.append(write)
            self._bell.ring()

    @staticmethod
    def _unneeded(write: Write) -> bool:
        """Whether `write` carries blocks no live request needs (dropped, not sent)."""
        return isinstance(write, Send) and not any(r.live for r, _ in write.items)

    def _submit(self, write: Write) -> None:
        """Submit `write` on the current link (connecting anew after a break); a write no
        live request needs is dropped, one that cannot be submitted failed."""
        if self._unneeded(write):
            write.failed = ""
            return
        with self._cond:  # the write counts on its link before it is made: a break
            channel = self._channel  # meanwhile closes the link only once it settled
            if channel is not None:
                channel.outstanding += 1
        if channel is None:
            try:
                channel = self._reopen(write.epoch)
            except Exception as e:
                write.failed = f"the decode side cannot be reached again: {_why(e)}"
                return
            with self._cond:
                channel.outstanding += 1
                if self._channel is None and write.epoch == self.epoch:
                    self._channel = channel
                else:  # broken again meanwhile: this link is not the current one
                    channel.retired = True
        self._send(write, channel)

    def _send(self, write: Write, channel: _Channel) -> None:
        """Submit `write` on `channel` (which counts it outstanding already)."""
        write.channel, link = channel, channel.link
        if isinstance(write, StatusWrite):
            write.buffer = channel.status.take()
            ctypes.memmove(write.buffer, write.data, len(write.data))
            offset = write.request.slot * mailbox.SLOT_BYTES + write.at
            runs = [(write.buffer, self.status_region, offset, len(write.data))]
        write.submit_ns = time.monotonic_ns()
        try:
            if isinstance(write, StatusWrite):
                write.batch = link.submit(runs)
            elif write.gate is None:
                write.batch = link.submit_blocks(self.planner.layer(write.layer), write.runs)
            else:
                layer = self.planner.layer(write.layer)
                write.batch = link.submit_blocks(layer, write.runs, write.gate)
        except Exception as e:  # TransferError, or a transport's bug
            write.failed = _why(e)
            write.link_sound = isinstance(e, BatchFailedError)

    def _complete_loop(self) -> None:
        """Settle each submitted write in order: waited for until stall_timeout after it
        was submitted (the writes behind a stalled one do not each wait it again)."""
        while True:
            while True:
                with self._cond:
                    seen = self._bell.seen()  # before looking: a ring after it is not missed
                    if self._submitted or self._submitting_done:
                        break
                self._bell.wait(seen)
            with self._cond:
                if not self._submitted:
                    return
                write = self._submitted[0]
            self._settle(write)
            with self._cond:  # its window place goes only now: what it queued is seen
                self._submitted.popleft()
                self._taken -= 1
                if self._inbox or self._stopping:  # the submitting thread waits for room
                    self._cond.notify_all()

    def _armed_loop(self) -> None:
        """Settle each followed send in order (arm), then end once stopping."""
        while True:
            with self._cond:
                seen = self._armed_bell.seen()  # before looking: a ring after it is not missed
                send = self._armed[0] if self._armed else None
                if send is None and self._stopping and not self._arming:
                    return
            if send is None:
                self._armed_bell.wait(seen)
                continue
            self._settle(send)
            with self._cond:
                self._armed.popleft()
                self._cond.notify_all()  # a stopping submit thread waits for the armed too

    def _settle(self, write: Write) -> None:
        """Wait for `write` (a followed send as _wait_followed does, any other until
        stall_timeout after it was submitted), take it off its link (closed once retired
        and idle), report it, and break the destination if it failed, unless it was a
        followed send whose signal never came (the engine's, not the link's) or its batch
        said the failure is its own (BatchFailedError: its requests' decode side is told
        over the same link)."""
        reason = write.failed
        if write.batch is not None:
            try:
                if isinstance(write, Send) and write.gate is not None:
                    self._wait_followed(write)
                else:
                    left = write.submit_ns / 1e9 + self._stall - time.monotonic()
                    write.batch.wait(max(left, MIN_WAIT_S))
                reason = None
            except Exception as e:  # TransferError, or a transport's bug
                reason = _why(e)
                write.link_sound = write.link_sound or isinstance(e, BatchFailedError)
        channel, close = write.channel, False
        with self._cond:
            if channel is not None:
                channel.outstanding -= 1
                close = channel.retired and channel.outstanding == 0
        if isinstance(write, StatusWrite) and write.buffer and reason is None:
            channel.status.give_back(write.buffer)  # one that failed may still be read
        if close:
            channel.link.close()
        self._settled(self, write, reason)
        if reason and not write.link_sound:
            self.break_(reason, write.epoch)

    def _wait_followed(self, send: Send) -> None:
        """Wait for a followed `send` to land: its gate as long as it takes (the link fails
        it if the signal does not come in time: Link.submit_blocks), its copies up to
        stall_timeout from when they started. Submitted when the link saw the signal; one
        that failed before its copies started leaves its link sound and breaks nothing (the
        engine never computed the layer)."""
        batch = send.batch
        try:
            while True:
                started = batch.started_ns()
                left = self._stall - (time.monotonic_ns() - started) / 1e9 if started else None
                if left is not None and left <= 0:
                    raise TransferError(
                        f"a followed layer did not land within {self._stall:g} s of its signal"
                    )
                try:  # its gate: a slice of stall_timeout at a time; its copies: what is left
                    batch.wait(self._stall if left is None else max(left, MIN_WAIT_S))
                    break
                except TransferError:
                    if batch.done():  # (raises the reason if it failed)
                        break
        except Exception:
            send.link_sound = not batch.started_ns()
            raise
        finally:
            send.submit_ns = send.signal_ns = batch.started_ns() or time.monotonic_ns()


def _within(open_: Callable[[], _Channel], bound: float, what: str) -> _Channel:
    """open_(), a transport's connect, on a thread of its own, given up after `bound` s
    (TransferError): a connect to a cut-off peer may block for minutes (Mooncake's does),
    and no caller, nor the writes behind it, waits that long. One that returns late is
    closed."""
    lock, done, late, result = threading.Lock(), threading.Event(), [], []

    def connect() -> None:
        try:
            got: object = open_()
        except Exception as e:
            got = e
        with lock:
            result.append(got)
            abandoned = bool(late)
        done.set()
        if abandoned and isinstance(got, _Channel):
            got.link.close()

    threading.Thread(target=connect, name="pdhal-transfer-connect", daemon=True).start()
    done.wait(bound)
    with lock:
        if not result:
            late.append(True)
            result.append(TransferError(f"{what} did not finish within {bound:g} s"))
    got = result[0]
    if isinstance(got, Exception):
        raise got
    return got


def _why(error: Exception) -> str:
    """A failure's reason: a TransferError's message, or what a transport's bug raised."""
    if isinstance(error, TransferError):
        return str(error)
    return f"the transport failed: {type(error).__name__}: {error}"
