"""pdhal's backend conformance kit: `pytest --pdhal-backend NAME` runs the behavioural
contract of docs/design.md against one backend (registered as the `pytest11` plugin `pdhal`).

A backend takes part by returning a TestSupport from `Backend.test_support()`: a few
device primitives (allocate, a stream, "work that writes memory after a delay", read back)
that let the kit check ordering and sharing without knowing the device.

`ManualClock` is a clock a test moves by hand, for pdhal.transfer's leases and deadlines.
"""

from pdhal._backends.test_support import DeviceTensor, TestSupport
from pdhal.testing.clock import ManualClock

__all__ = ["DeviceTensor", "ManualClock", "TestSupport"]
