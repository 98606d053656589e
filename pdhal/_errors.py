"""pdhal's exceptions: one base class, each subclass also inheriting the matching builtin."""


class PdhalError(Exception):
    """Base class of every error pdhal raises."""


class _WithErrno(OSError):
    """An OSError that reads as its message alone: the errno stays in .errno, out of the
    text a person reads ("[Errno 2] ..." prefixes say nothing a message does not)."""

    def __str__(self) -> str:
        return self.strerror if self.strerror is not None else super().__str__()


class BackendNotFoundError(PdhalError, LookupError):
    """No installed backend has the requested name."""


class BackendUnavailableError(PdhalError, RuntimeError):
    """A backend is installed but cannot run here (no runtime, no driver, no device)."""


class BackendLoadError(PdhalError, ImportError):
    """A backend plugin failed to import or to describe itself."""


class InvalidArgumentError(PdhalError, ValueError):
    """A value is out of range, of the wrong shape or dtype, or otherwise unusable."""


class InvalidTypeError(PdhalError, TypeError):
    """An argument has a type pdhal cannot use."""


class ClosedHandleError(PdhalError, ValueError):
    """A handle was used after close() (or after destroy)."""


class MemoryPinnedError(InvalidArgumentError):
    """A free, close or unmap of memory that an object naming it for its whole life (a
    KVStreamer's or KVReceiver's cache layout) still pins: close that object first."""


class UnsupportedError(PdhalError, NotImplementedError):
    """The active backend or its runtime version does not offer this operation."""


class SegmentError(PdhalError, _WithErrno):
    """A shared-memory segment could not be created, opened or validated."""


class ChannelBusyError(SegmentError):
    """The channel already has a live producer, or (per-chunk) a reader."""


class ProducerDiedError(PdhalError, _WithErrno, ConnectionError):
    """The process that produced a channel's signals is gone."""


class ReaderDiedError(PdhalError, _WithErrno, ConnectionError):
    """The per-chunk reader (the cache messager) died while the producer waited for it."""


class SignalTimeoutError(PdhalError, _WithErrno, TimeoutError):
    """A wait ran past its timeout."""


class BackPressureTimeoutError(SignalTimeoutError):
    """The per-chunk reader did not free a ring slot before the timeout."""


class DeviceError(PdhalError, RuntimeError):
    """A vendor runtime call failed."""


class SystemResourceError(PdhalError, _WithErrno):
    """The system refused what pdhal asked for: a thread, memory, a lock."""


class TransferError(PdhalError, ConnectionError):
    """A transfer of KV blocks failed: the peer or the link is gone, or it stalled."""


class BatchFailedError(TransferError):
    """A batch's copies failed while its link stays sound (a runtime's copy error, not a
    gone peer or a stall): a transport's submit or Batch raises it so that the streamer
    fails the requests in that batch and tells their decode side why over the same link,
    where any other failure breaks the link and leaves the decode side to its deadline."""


class TransportLoadError(PdhalError, ImportError):
    """A transport plugin failed to import or to describe itself."""


class SessionError(PdhalError, ConnectionError):
    """The control session between a prefill and a decode side failed: the peer sent what
    the protocol does not allow, went silent past the keepalive bound, or is gone."""


class RefusedError(SessionError):
    """A peer refused the session at its hello: the reason names both sides and what differs
    (protocol version, transport, layout, tensor-parallel split, namespace) or the key."""
