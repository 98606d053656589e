"""Device facts and visibility: what a backend's Platform says about this machine."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import ClassVar

from pdhal._errors import InvalidArgumentError

DeviceId = int | str  # an index, or a platform-specific name (e.g. a CUDA "GPU-<uuid>")


def parse_visible_devices(
    value: str | None, var: str, named: Callable[[str], bool] = lambda entry: False
) -> list[DeviceId] | None:
    """Parse a *_VISIBLE_DEVICES list: None when unset (all devices visible).

    Entries are non-negative integers, or names that `named` accepts (the platform's own
    syntax); anything else is an error, where vendor runtimes would silently drop the rest
    of the list.
    """
    if value is None:
        return None
    entries: list[DeviceId] = []
    for raw in value.split(","):
        entry = raw.strip()
        if not entry and value.strip() == "":
            return []
        if entry.isdigit():
            entries.append(int(entry))
        elif named(entry):
            entries.append(entry)
        else:
            raise InvalidArgumentError(
                f"{var}={value!r}: entry {entry!r} is neither a device "
                f"index nor a device name of this platform"
            )
    if len(set(entries)) != len(entries):
        raise InvalidArgumentError(f"{var}={value!r} lists a device twice")
    return entries


class Platform:
    """Facts about one accelerator platform; backends subclass it."""

    #: Short name, also the backend's name and PDHAL_PLATFORM value.
    name: ClassVar[str] = "abstract"
    #: The variable that restricts which devices a process sees.
    device_control_env_var: ClassVar[str] = ""
    #: The kind that names this platform's device memory in pdhal ("gpu" in "gpu:0", a
    #: MemoryRef's device); "" for a platform without devices (cpu).
    device_kind: ClassVar[str] = ""

    def device_count(self) -> int:
        """Devices this process can use."""
        raise NotImplementedError

    @property
    def capabilities(self) -> dict[str, object]:
        """What this platform offers (e.g. host functions, IPC, pinned memory)."""
        return {}

    def is_device_name(self, entry: str) -> bool:
        """Whether a visibility-list entry that is not an index names a device (override for
        a platform with device names, as CUDA's GPU-/MIG- UUIDs)."""
        return False

    def visible_devices(self, env: dict[str, str] | None = None) -> list[DeviceId] | None:
        """The parsed visibility list of `env` (default os.environ); None if unrestricted."""
        env = os.environ if env is None else env
        var = self.device_control_env_var
        return parse_visible_devices(env.get(var), var, self.is_device_name)

    def physical_device_id(self, local_rank: int) -> DeviceId:
        """The physical device (index or UUID) that local device `local_rank` is."""
        if isinstance(local_rank, bool) or not isinstance(local_rank, int) or local_rank < 0:
            raise InvalidArgumentError(f"local_rank must be an int >= 0, got {local_rank!r}")
        visible = self.visible_devices()
        if visible is None:
            return local_rank
        if local_rank >= len(visible):
            raise InvalidArgumentError(
                f"local_rank {local_rank} is out of range: {self.device_control_env_var}="
                f"{os.environ.get(self.device_control_env_var)!r} makes {len(visible)} visible"
            )
        return visible[local_rank]

    def device_index(self, local_rank: int) -> int:
        """The physical device index of local device `local_rank`: the id to name its
        channels and shared caches with (FastDeploy's convention), the same in every
        process whatever visibility list each inherited."""
        device = self.physical_device_id(local_rank)
        if not isinstance(device, int):
            raise InvalidArgumentError(
                f"{self.device_control_env_var} names local device {local_rank} {device!r}, not "
                f"an index: list devices by index to name channels after them"
            )
        return device

    def child_env(
        self,
        device_ids: list[DeviceId],
        base: dict[str, str] | None = None,
        *,
        isolate: bool = True,
    ) -> dict[str, str]:
        """Environment for a child process on the given PHYSICAL devices.

        isolate=True: the child sees exactly these devices, as its local devices 0..n-1 in
        this order. isolate=False: the child sees every device (the visibility variable is
        unset), so the physical ids stay valid there, as FastDeploy's cache processes expect
        (`set_device(physical_id)`). Either way it never interprets a physical id against
        an inherited visibility list. A device the parent cannot see is an error.
        """
        env = dict(os.environ if base is None else base)
        if isinstance(device_ids, (int, str)):
            device_ids = [device_ids]
        if not device_ids:
            raise InvalidArgumentError("device_ids must name at least one device")
        parent = self.visible_devices(env)
        for dev in device_ids:
            if (
                isinstance(dev, bool)
                or not isinstance(dev, (int, str))
                or (isinstance(dev, int) and dev < 0)
            ):
                raise InvalidArgumentError(
                    f"device ids must be ints >= 0 or device names, got {dev!r}"
                )
            if parent is not None and dev not in parent:
                raise InvalidArgumentError(
                    f"device {dev!r} is not visible to this process "
                    f"({self.device_control_env_var}={env.get(self.device_control_env_var)!r})"
                )
        if isolate:
            env[self.device_control_env_var] = ",".join(str(d) for d in device_ids)
        else:
            env.pop(self.device_control_env_var, None)
        return env
