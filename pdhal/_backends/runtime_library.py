"""RuntimeLibrary: a vendor runtime bound with cffi in ABI mode, for backend plugins.

Nothing vendor-specific is needed at build time: the library is dlopen'ed when a backend is
asked whether it is available, from the path its backend found.
"""

from __future__ import annotations

import ctypes
from typing import ClassVar

from cffi import FFI

from pdhal._errors import DeviceError, UnsupportedError


class RuntimeLibrary:
    """A loaded runtime: `ffi`, `lib`, where it came from, and error checking."""

    #: C declarations of what the backend calls (optional symbols included).
    cdef: ClassVar[str] = ""
    #: Words for messages, e.g. "XPU runtime".
    title: ClassVar[str] = "runtime"
    #: The variable that points pdhal at the library (e.g. PDHAL_XPURT).
    path_variable: ClassVar[str] = ""
    #: What else provides the library, for the message when it cannot be loaded.
    provided_by: ClassVar[str] = ""

    @classmethod
    def not_loadable(cls, error: OSError) -> str:
        """Why the library could not be loaded, and how to point pdhal at one."""
        reason = str(error).split("  Additionally,")[0].strip()  # (cffi's second guess)
        fix = f"set {cls.path_variable} to its path" if cls.path_variable else "install it"
        if cls.provided_by:
            fix += f", or install {cls.provided_by}"
        return f"{cls.title} not loadable: {reason} ({fix})"

    @classmethod
    def find_library(cls) -> tuple[str, str]:
        """(path or soname to dlopen, how it was found): override per runtime."""
        raise NotImplementedError

    def __init__(self, path: str | None = None, found_by: str = ""):
        """dlopen `path` (default: where find_library() points); OSError, with the loader's
        reason, when it cannot be loaded."""
        if path is None:
            path, found_by = self.find_library()
        self.path = path
        self.found_by = found_by
        if "/" not in path and "." in path:
            # a soname: the system loader first, directly; where it fails, cffi's dlopen would
            # guess with ctypes.util.find_library, which runs ldconfig, gcc and ld (~0.1 s in
            # every process that asks whether an absent runtime is there). (cffi resolves a
            # bare name such as "xpurt" through find_library only: left to it.)
            ctypes.CDLL(path)
        self.ffi = FFI()
        self.ffi.cdef(self.cdef)
        self.lib = self.ffi.dlopen(path)

    def error_text(self, rc: int) -> str:
        """Human words for a runtime error code (override where the runtime has them)."""
        return f"error {rc}"

    def version(self) -> str:
        return "unknown"

    def describe(self) -> dict[str, object]:
        """What `pdhal info` shows: library, how it was found, runtime version."""
        try:
            version = self.version()
        except Exception as e:  # a report must not fail on a half-working runtime
            version = f"unknown ({e})"
        return {"library": self.path, "found_by": self.found_by, "runtime_version": version}

    def check(self, rc: int, call: str) -> None:
        """Raise DeviceError naming `call` when the runtime returned non-zero."""
        if rc != 0:
            raise DeviceError(f"{call} failed: {self.title} {self.error_text(rc)} ({self.path})")

    def has(self, name: str) -> bool:
        try:
            getattr(self.lib, name)
        except AttributeError:
            return False
        return True

    def optional(self, name: str):
        """A function not every version exports; UnsupportedError naming it when absent."""
        try:
            return getattr(self.lib, name)
        except AttributeError:
            raise UnsupportedError(
                f"{name} is unsupported by this {self.title} version ({self.version()} at "
                f"{self.path})"
            ) from None

    def address(self, cdata) -> int:
        return int(self.ffi.cast("uintptr_t", cdata))

    def pointer(self, address: int):
        return self.ffi.cast("void *", address)
