"""DLPack (v0.8) structs, and exporting memory pdhal mapped as a DLPack capsule, so a
framework wraps it without a copy (paddle.from_dlpack, torch.from_dlpack, numpy.from_dlpack
for host memory). The exporting object is kept alive until the consumer lets go."""

from __future__ import annotations

import ctypes
import threading

from pdhal._errors import UnsupportedError


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class DLManagedTensor(ctypes.Structure):
    pass


_Deleter = ctypes.CFUNCTYPE(None, ctypes.POINTER(DLManagedTensor))
DLManagedTensor._fields_ = [
    ("dl_tensor", DLTensor),
    ("manager_ctx", ctypes.c_void_p),
    ("deleter", _Deleter),
]

#: DLDeviceType of pdhal's device kinds.
DEVICE_TYPES = {"cpu": 1, "gpu": 2}
#: DLDataTypeCode and bits of dtype names.
DTYPES = {
    "bool": (6, 8),
    "int8": (0, 8),
    "uint8": (1, 8),
    "int16": (0, 16),
    "uint16": (1, 16),
    "int32": (0, 32),
    "uint32": (1, 32),
    "int64": (0, 64),
    "uint64": (1, 64),
    "float16": (2, 16),
    "bfloat16": (4, 16),
    "float32": (2, 32),
    "float64": (2, 64),
}

_alive: dict[int, tuple] = {}  # managed tensor address -> what must outlive the consumer
_alive_lock = threading.Lock()


@_Deleter
def _delete(managed) -> None:
    with _alive_lock:
        _alive.pop(ctypes.addressof(managed.contents), None)


_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype = ctypes.c_void_p
_capsule_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
# The destructor gets a capsule whose count already reached zero: it must be passed on as a
# raw pointer, never as a Python object (whose reference counting would free it twice).
_dying_is_valid = ctypes.PyDLL(None).PyCapsule_IsValid
_dying_is_valid.restype = ctypes.c_int
_dying_is_valid.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
_dying_pointer = ctypes.PyDLL(None).PyCapsule_GetPointer
_dying_pointer.restype = ctypes.c_void_p
_dying_pointer.argtypes = [ctypes.c_void_p, ctypes.c_char_p]


def capsule_pointer(capsule) -> int:
    """The DLManagedTensor (whose first member is the DLTensor) of a "dltensor" capsule."""
    return _capsule_pointer(capsule, b"dltensor")


@ctypes.CFUNCTYPE(None, ctypes.c_void_p)
def _capsule_destructor(capsule) -> None:
    # An unconsumed capsule still owns its tensor (a consumer renames it "used_dltensor").
    if _dying_is_valid(capsule, b"dltensor"):
        managed = DLManagedTensor.from_address(_dying_pointer(capsule, b"dltensor"))
        managed.deleter(ctypes.pointer(managed))


def export(owner: object, address: int, shape: tuple[int, ...], dtype: str, device: str):
    """A "dltensor" capsule over `address` (C-contiguous `shape` of `dtype` on `device`,
    "cpu", "gpu" or "gpu:N"); `owner` stays alive until the consumer releases it."""
    kind, _, index = device.partition(":")
    if kind not in DEVICE_TYPES:
        raise UnsupportedError(f"DLPack has no device type for {device} memory")
    if dtype not in DTYPES:
        raise UnsupportedError(f"DLPack export of dtype {dtype} is not supported")
    code, bits = DTYPES[dtype]
    dims = (ctypes.c_int64 * max(len(shape), 1))(*shape)
    managed = DLManagedTensor()
    managed.dl_tensor = DLTensor(
        address,
        DLDevice(DEVICE_TYPES[kind], int(index or 0)),
        len(shape),
        DLDataType(code, bits, 1),
        ctypes.cast(dims, ctypes.POINTER(ctypes.c_int64)),
        None,
        0,
    )
    managed.deleter = _delete
    with _alive_lock:
        _alive[ctypes.addressof(managed)] = (managed, dims, owner)
    return _capsule_new(
        ctypes.addressof(managed), b"dltensor", ctypes.cast(_capsule_destructor, ctypes.c_void_p)
    )
