"""pdhal-mooncake's tests: each in a PDHAL_NAMESPACE of its own, nothing left behind."""

from pdhal.testing.fixtures import namespace  # noqa: F401  (autouse: every test)
