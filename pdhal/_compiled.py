"""The compiled C core (cffi's pdhal._pdhal_c), with the fix when it is missing. Only
_protocol.core calls its functions; _inputs uses its types."""

try:
    from pdhal._pdhal_c import ffi, lib
except ImportError as e:  # pragma: no cover - only on a broken install
    raise ImportError(
        "pdhal's compiled core (pdhal._pdhal_c) is missing: reinstall pdhal "
        "(`pip install -e .` in a checkout, or `make test`) so cffi builds csrc/"
    ) from e

__all__ = ["ffi", "lib"]
