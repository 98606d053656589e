"""What an argument names: addresses, sizes and values of the objects engines pass.

Accepted, in this order: Paddle tensors (recognised by type, so paddle is never imported
here), objects with `data_ptr()` (e.g. torch), `__cuda_array_interface__`, `__dlpack__`,
Python buffers (numpy, bytearray, memoryview, array), and raw int addresses.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

from pdhal._core import ffi
from pdhal._errors import InvalidArgumentError, InvalidTypeError

_ACCEPTED = ("a Paddle tensor, an object with data_ptr(), __cuda_array_interface__ or "
             "__dlpack__, a writable buffer, or an int address")


@dataclass(frozen=True)
class MemoryRef:
    """Where an object's data lives: address, size in bytes (None if unknown), device."""

    address: int
    nbytes: int | None
    device: str  # "cpu", or "<kind>:<id>" for device memory ("gpu:0", "xpu:1", ...)


def is_paddle_tensor(obj: object) -> bool:
    return type(obj).__module__.startswith("paddle") and hasattr(obj, "data_ptr")


def _paddle_device(tensor) -> str:
    place = tensor.place
    if place.is_cpu_place() or place.is_cuda_pinned_place():
        return "cpu"
    if place.is_gpu_place():
        return f"gpu:{place.gpu_device_id()}"
    if hasattr(place, "is_xpu_place") and place.is_xpu_place():
        return f"xpu:{place.xpu_device_id()}"
    return str(place)


# DLPack's C structs (dlpack.h, v0.8): just enough to read a capsule's data pointer.
class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


_DL_DEVICE_NAMES = {1: "cpu", 2: "gpu", 3: "cpu", 13: "cpu"}  # kDLCPU, kDLCUDA, pinned, managed

_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype = ctypes.c_void_p
_capsule_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]


def _dlpack_ref(obj) -> MemoryRef:
    # Reading the capsule without renaming it leaves ownership with the capsule, whose
    # destructor releases the export; `obj` keeps the memory itself alive.
    capsule = obj.__dlpack__()
    tensor = _DLTensor.from_address(_capsule_pointer(capsule, b"dltensor"))
    count = 1
    for i in range(tensor.ndim):
        count *= tensor.shape[i]
    kind = _DL_DEVICE_NAMES.get(tensor.device.device_type, f"dl{tensor.device.device_type}")
    device = "cpu" if kind == "cpu" else f"{kind}:{tensor.device.device_id}"
    nbytes = count * tensor.dtype.bits * tensor.dtype.lanes // 8
    return MemoryRef((tensor.data or 0) + tensor.byte_offset, nbytes, device)


def memory_ref(obj: object, what: str = "memory") -> MemoryRef:
    """Describe the memory `obj` names; InvalidTypeError if it names none."""
    if isinstance(obj, bool):
        raise InvalidTypeError(f"{what} must be {_ACCEPTED}, got bool")
    if isinstance(obj, int):
        if not 0 < obj < 1 << 64:
            raise InvalidArgumentError(f"{what} address must be in (0, 2**64), got {obj:#x}")
        return MemoryRef(obj, None, "unknown")
    if is_paddle_tensor(obj):
        return MemoryRef(obj.data_ptr(), int(obj.numel()) * obj.element_size(),
                         _paddle_device(obj))
    if hasattr(obj, "data_ptr") and hasattr(obj, "element_size") and hasattr(obj, "numel"):
        device = getattr(obj, "device", "cpu")
        device = "cpu" if str(device) == "cpu" else str(device).replace("cuda", "gpu")
        return MemoryRef(obj.data_ptr(), obj.numel() * obj.element_size(), device)
    cai = getattr(obj, "__cuda_array_interface__", None)
    if cai is not None:
        count = 1
        for n in cai["shape"]:
            count *= n
        return MemoryRef(cai["data"][0], count * int(cai["typestr"][2:]), "gpu")
    if hasattr(obj, "__dlpack__"):
        return _dlpack_ref(obj)
    try:
        view = memoryview(obj)
    except TypeError:
        raise InvalidTypeError(f"{what} must be {_ACCEPTED}, got {type(obj).__name__}") from None
    with view:
        if view.nbytes == 0:
            raise InvalidArgumentError(f"{what} is an empty buffer")
        address = int(ffi.cast("uintptr_t", ffi.from_buffer(view)))
        return MemoryRef(address, view.nbytes, "cpu")


def writable_int32(obj: object, what: str, minimum: int):
    """(int32_t * cdata, length in words) of a writable CPU int32 array with >= minimum words.

    The cdata is only valid while `obj` is alive; callers use it immediately.
    """
    if is_paddle_tensor(obj):
        if str(obj.dtype).split(".")[-1] != "int32":
            raise InvalidArgumentError(f"{what} must have dtype int32, got {obj.dtype}")
        if _paddle_device(obj) != "cpu":
            raise InvalidArgumentError(f"{what} must be a CPU tensor, got one on {obj.place}")
        count = int(obj.numel())
        words = ffi.cast("int32_t *", obj.data_ptr())
    else:
        try:
            view = memoryview(obj)
        except TypeError:
            raise InvalidTypeError(
                f"{what} must be a writable int32 CPU array (Paddle tensor, numpy array, "
                f"array('i')), got {type(obj).__name__}") from None
        if view.readonly or view.itemsize != 4 or view.format not in ("i", "<i", "=i") or \
                not view.c_contiguous:
            raise InvalidArgumentError(
                f"{what} must be a writable, contiguous int32 array, got format "
                f"{view.format!r} itemsize {view.itemsize} readonly={view.readonly}")
        count = view.nbytes // 4
        words = ffi.cast("int32_t *", ffi.from_buffer(view, require_writable=True))
    if count < minimum:
        raise InvalidArgumentError(f"{what} must hold at least {minimum} int32 words, got {count}")
    return words, count


def int_list(obj: object, what: str) -> list[int]:
    """The integers of a 1-D (or [n, 1]) tensor, array or sequence."""
    if hasattr(obj, "tolist"):  # Paddle tensors and numpy arrays (device tensors: copied)
        values = obj.tolist()
    elif isinstance(obj, (list, tuple)):
        values = list(obj)
    else:
        raise InvalidTypeError(f"{what} must be a tensor, array or list of ints, got "
                               f"{type(obj).__name__}")
    flat = []
    for v in values:
        if isinstance(v, list) and len(v) == 1:
            v = v[0]
        if isinstance(v, bool) or not isinstance(v, int):
            raise InvalidArgumentError(f"{what} must hold integers of shape [n] or [n, 1], "
                                       f"found {v!r}")
        flat.append(v)
    return flat
