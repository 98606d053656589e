"""A test-only backend: the cpu implementations under another name and a higher priority,
proving that a separately installed distribution is discovered and selected."""

import pdhal
from pdhal._cpu import CpuBackend, CpuPlatform


class DummyPlatform(CpuPlatform):
    name = "dummy"
    device_control_env_var = "DUMMY_VISIBLE_DEVICES"


class DummyBackend(CpuBackend):
    name = "dummy"
    priority = 50

    def availability(self):
        return pdhal.Availability(True, "always (test plugin)")

    def platform(self):
        return DummyPlatform()


@pdhal.hookimpl
def pdhal_backend():
    return DummyBackend()
