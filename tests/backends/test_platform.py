"""Visibility lists and launching a cache process on a physical device."""

from __future__ import annotations

import pytest

import pdhal
from pdhal._backends.platform import parse_visible_devices
from pdhal.testing.fixtures import run_child


def test_parse_visible_devices():
    assert parse_visible_devices(None, "V") is None
    assert parse_visible_devices("", "V") == []
    assert parse_visible_devices("4, 5,6", "V") == [4, 5, 6]
    named = lambda entry: entry.startswith("GPU-")  # a platform's own device names  # noqa: E731
    assert parse_visible_devices("GPU-8f2a,3", "V", named) == ["GPU-8f2a", 3]
    for bad in ("1,x", "1,,2", "-1", "GPU-8f2a", "2,2"):
        with pytest.raises(pdhal.InvalidArgumentError, match="V="):
            parse_visible_devices(bad, "V")


def test_cuda_device_names_are_the_cuda_platform_s_own():
    """GPU-/MIG- UUIDs are CUDA syntax: the cuda platform accepts them, the core does not."""
    from pdhal_cuda._backend import CudaPlatform

    platform = CudaPlatform(runtime=None)
    env = {"CUDA_VISIBLE_DEVICES": "GPU-aa,MIG-bb,2"}
    assert platform.visible_devices(env) == ["GPU-aa", "MIG-bb", 2]
    assert platform.child_env(["MIG-bb"], base=env)["CUDA_VISIBLE_DEVICES"] == "MIG-bb"
    with pytest.raises(pdhal.InvalidArgumentError, match="neither a device index"):
        platform.visible_devices({"CUDA_VISIBLE_DEVICES": "GPU-"})


def test_physical_device_id_follows_the_visibility_list(monkeypatch):
    monkeypatch.setenv("PDHAL_CPU_VISIBLE_DEVICES", "4,5,6,7")
    platform = pdhal.current_platform()
    assert [platform.physical_device_id(i) for i in range(4)] == [4, 5, 6, 7]
    with pytest.raises(pdhal.InvalidArgumentError, match="makes 4 visible"):
        platform.physical_device_id(5)  # the bug: a physical id used as a local index
    assert platform.device_count() == 4


def test_child_on_device_5_of_4567_gets_a_valid_device(monkeypatch):
    """The FastDeploy bug: a cache process launched with --device_id 5 inheriting
    VISIBLE_DEVICES=4,5,6,7 found id 5 invalid. child_env gives it exactly device 5,
    as its local device 0."""
    monkeypatch.setenv("PDHAL_CPU_VISIBLE_DEVICES", "4,5,6,7")
    monkeypatch.setenv("PDHAL_CPU_DEVICE_COUNT", "8")
    env = pdhal.current_platform().child_env([5])
    assert env["PDHAL_CPU_VISIBLE_DEVICES"] == "5"
    proc = run_child(
        """
        import pdhal
        p = pdhal.current_platform()
        assert p.device_count() == 1, p.device_count()
        print(p.physical_device_id(0))
    """,
        env=env,
    )
    assert proc.stdout.strip() == "5"


def test_child_env_and_invisible_devices(monkeypatch):
    monkeypatch.setenv("PDHAL_CPU_VISIBLE_DEVICES", "4,6")
    platform = pdhal.current_platform()
    assert platform.child_env([6])["PDHAL_CPU_VISIBLE_DEVICES"] == "6"
    with pytest.raises(pdhal.InvalidArgumentError, match="not visible to this process"):
        platform.child_env([3])
    with pytest.raises(pdhal.InvalidArgumentError, match="at least one"):
        platform.child_env([])
    base = {"OTHER": "1"}
    assert platform.child_env([0], base=base) == {"OTHER": "1", "PDHAL_CPU_VISIBLE_DEVICES": "0"}


def test_child_env_that_keeps_physical_ids_valid(monkeypatch):
    """FastDeploy launches its cache process on a physical id and calls set_device(id)
    there: the child must see every device, not a list in which id 5 is invalid."""
    monkeypatch.setenv("PDHAL_CPU_VISIBLE_DEVICES", "4,5,6,7")
    monkeypatch.setenv("PDHAL_CPU_DEVICE_COUNT", "8")
    platform = pdhal.current_platform()
    assert platform.device_index(1) == 5
    env = platform.child_env([5], isolate=False)
    assert "PDHAL_CPU_VISIBLE_DEVICES" not in env
    proc = run_child(
        """
        import pdhal
        p = pdhal.current_platform()
        assert p.visible_devices() is None and p.device_count() == 8
        print(p.physical_device_id(5))
    """,
        env=env,
    )
    assert proc.stdout.strip() == "5"
    with pytest.raises(pdhal.InvalidArgumentError, match="not visible"):
        platform.child_env([2], isolate=False)
    assert platform.child_env([5])["PDHAL_CPU_VISIBLE_DEVICES"] == "5"  # isolate: the default


def test_device_index_refuses_names(monkeypatch):
    from pdhal_cuda._backend import CudaPlatform

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-aa,3")
    platform = CudaPlatform(runtime=None)
    assert platform.device_index(1) == 3
    with pytest.raises(pdhal.InvalidArgumentError, match="not an index"):
        platform.device_index(0)
