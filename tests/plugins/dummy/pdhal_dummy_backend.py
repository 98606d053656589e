"""A test-only backend: pdhal's reference ops under another name and a higher priority,
proving that a separately installed distribution is discovered and selected, and that a
backend needs nothing from pdhal but pdhal.plugin."""

from pdhal.plugin import Availability, Backend, Platform, hookimpl, reference_ops


class DummyPlatform(Platform):
    name = "dummy"
    device_control_env_var = "DUMMY_VISIBLE_DEVICES"

    def device_count(self) -> int:
        visible = self.visible_devices()
        return 1 if visible is None else len(visible)


class DummyBackend(Backend):
    name = "dummy"
    priority = 50

    def availability(self):
        return Availability(True, "always (test plugin)")

    def platform(self):
        return DummyPlatform()

    def ops(self):
        return reference_ops()


@hookimpl
def pdhal_backend():
    return DummyBackend()
