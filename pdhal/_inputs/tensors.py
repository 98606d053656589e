"""What an argument names: address, size, dtype and device of the objects engines pass.

Accepted, in this order: Paddle tensors (recognised by type, so paddle is never imported
here), Python buffers (numpy, bytearray, memoryview, array), objects with `data_ptr()` (e.g.
torch), `__cuda_array_interface__`, `__dlpack__`, and raw int addresses.

Memory is checked before pdhal reads or writes it by address: it must be contiguous (a
strided or stride-0 view names fewer bytes, or other bytes, than its element count says),
non-empty, of a dtype a buffer can hold, and writable where pdhal writes. A failed check is
an InvalidArgumentError that names the argument, what it got and what it needs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pdhal._compiled import ffi  # its types only: no C function is called from here
from pdhal._errors import InvalidArgumentError, InvalidTypeError
from pdhal._inputs.dlpack import DLTensor, capsule_pointer

_ACCEPTED = (
    "a Paddle tensor, a buffer (numpy array, bytearray, ...), an object with "
    "data_ptr(), __cuda_array_interface__ or __dlpack__, or an int address"
)


@dataclass(frozen=True)
class MemoryRef:
    """Where an object's data lives: one contiguous range of memory."""

    address: int
    #: Size in bytes; None for a raw int address (its extent is unknown).
    nbytes: int | None
    #: "cpu", or "<kind>:<id>" for device memory ("gpu:0", "xpu:1", ...); "unknown" for ints.
    device: str
    #: Element type ("int32", "float16", "bfloat16", ...); None when the object has none.
    dtype: str | None = None
    readonly: bool = False
    #: The pdhal memory this lies in (a host buffer, a mapping, a registered range), which an
    #: op holds while it uses the memory; None for memory pdhal does not own (tensors).
    extent: object = field(default=None, compare=False, repr=False)


def is_paddle_tensor(obj: object) -> bool:
    return type(obj).__module__.startswith("paddle") and hasattr(obj, "data_ptr")


def dtype_name(dtype: object) -> str:
    """ "float16" for paddle.float16, numpy.float16, torch.float16 or "float16"."""
    return str(dtype).rsplit(".", 1)[-1]


def _paddle_device(tensor) -> str:
    place = tensor.place
    if place.is_cpu_place() or place.is_cuda_pinned_place():
        return "cpu"
    if place.is_gpu_place():
        return f"gpu:{place.gpu_device_id()}"
    if hasattr(place, "is_xpu_place") and place.is_xpu_place():
        return f"xpu:{place.xpu_device_id()}"
    return str(place)


def _require_contiguous(contiguous: bool, what: str, detail) -> None:
    """`detail()` says what was given; called only for the error (ops sit on hot paths)."""
    if not contiguous:
        raise InvalidArgumentError(
            f"{what} must be contiguous (its elements back to back in memory), got "
            f"{detail()}: pass a contiguous copy (tensor.contiguous(), numpy.ascontiguousarray)"
        )


def _require_elements(count: int, what: str) -> None:
    if count == 0:
        raise InvalidArgumentError(f"{what} is empty: it names no memory")


def _compact(shape, strides, itemsize: int) -> bool:
    """Are `strides` (in bytes) those of a C-contiguous array of `shape`?"""
    expected = itemsize
    for n, stride in zip(reversed(list(shape)), reversed(list(strides))):
        if n != 1 and stride != expected:
            return False
        expected *= n
    return True


def _paddle_ref(tensor, what: str) -> MemoryRef:
    contiguous = tensor.is_contiguous() if hasattr(tensor, "is_contiguous") else True
    _require_contiguous(
        contiguous,
        what,
        lambda: f"a Paddle view of shape {list(tensor.shape)} with strides {list(tensor.strides)}",
    )
    count = int(tensor.numel())
    _require_elements(count, what)
    return MemoryRef(
        tensor.data_ptr(),
        count * tensor.element_size(),
        _paddle_device(tensor),
        dtype_name(tensor.dtype),
    )


# Python buffer format characters (native byte order) and their dtype names.
_FORMATS = {
    "b": "int8",
    "B": "uint8",
    "h": "int16",
    "H": "uint16",
    "i": "int32",
    "I": "uint32",
    "l": "int64",
    "L": "uint64",
    "q": "int64",
    "Q": "uint64",
    "e": "float16",
    "f": "float32",
    "d": "float64",
    "?": "bool",
    "c": "uint8",
}


def _buffer_ref(view: memoryview, what: str) -> MemoryRef:
    fmt = view.format.lstrip("@=<")
    if "O" in fmt:
        raise InvalidArgumentError(
            f"{what} holds Python objects (format {view.format!r}), not numbers in memory"
        )
    _require_contiguous(
        view.c_contiguous,
        what,
        lambda: (
            f"a strided view of shape {list(view.shape)} with strides {list(view.strides)} bytes"
        ),
    )
    _require_elements(view.nbytes, what)
    address = int(ffi.cast("uintptr_t", ffi.from_buffer(view)))
    dtype = _FORMATS.get(fmt) if view.itemsize in (1, 2, 4, 8) else None
    if dtype in ("int64", "uint64") and view.itemsize != 8:
        dtype = None
    return MemoryRef(address, view.nbytes, "cpu", dtype, view.readonly)


def _data_ptr_ref(obj, what: str) -> MemoryRef:
    if hasattr(obj, "is_contiguous"):
        _require_contiguous(
            obj.is_contiguous(),
            what,
            lambda: (
                f"a view with strides {obj.stride()}"
                if hasattr(obj, "stride")
                else "a non-contiguous view"
            ),
        )
    count = int(obj.numel())
    _require_elements(count, what)
    device = str(getattr(obj, "device", "cpu"))
    device = "cpu" if device == "cpu" else device.replace("cuda", "gpu")
    return MemoryRef(
        obj.data_ptr(),
        count * obj.element_size(),
        device,
        dtype_name(getattr(obj, "dtype", "")) or None,
    )


# __cuda_array_interface__ / DLPack type kinds and their dtype-name stems.
_TYPE_KINDS = {"i": "int", "u": "uint", "f": "float", "b": "bool"}


def _cai_ref(cai: dict, what: str) -> MemoryRef:
    typestr = cai["typestr"]
    itemsize = int(typestr[2:])
    shape = tuple(cai["shape"])
    strides = cai.get("strides")
    _require_contiguous(
        strides is None or _compact(shape, strides, itemsize),
        what,
        lambda: f"strides {strides} bytes over shape {list(shape)}",
    )
    count = math.prod(shape)
    _require_elements(count, what)
    stem = _TYPE_KINDS.get(typestr[1])
    dtype = None if stem is None else ("bool" if stem == "bool" else f"{stem}{itemsize * 8}")
    address, readonly = cai["data"]
    return MemoryRef(address, count * itemsize, "gpu", dtype, bool(readonly))


_DL_DEVICE_NAMES = {1: "cpu", 2: "gpu", 3: "cpu", 13: "cpu"}  # kDLCPU, kDLCUDA, pinned, managed
_DL_CODES = {0: "int", 1: "uint", 2: "float", 4: "bfloat", 6: "bool"}


def _dlpack_ref(obj, what: str) -> MemoryRef:
    # Reading the capsule without renaming it leaves ownership with the capsule, whose
    # destructor releases the export; `obj` keeps the memory itself alive.
    try:
        capsule = obj.__dlpack__()
    except (BufferError, TypeError, ValueError) as e:
        raise InvalidArgumentError(f"{what} cannot be exported through DLPack: {e}") from None
    tensor = DLTensor.from_address(capsule_pointer(capsule))
    shape = [tensor.shape[i] for i in range(tensor.ndim)]
    itemsize = tensor.dtype.bits * tensor.dtype.lanes // 8
    if tensor.strides:  # in elements; NULL means compact row-major
        strides = [tensor.strides[i] * itemsize for i in range(tensor.ndim)]
        _require_contiguous(
            _compact(shape, strides, itemsize),
            what,
            lambda: (
                f"DLPack strides {[s // itemsize for s in strides]} (elements) over shape {shape}"
            ),
        )
    count = math.prod(shape)
    _require_elements(count, what)
    kind = _DL_DEVICE_NAMES.get(tensor.device.device_type, f"dl{tensor.device.device_type}")
    device = "cpu" if kind == "cpu" else f"{kind}:{tensor.device.device_id}"
    stem = _DL_CODES.get(tensor.dtype.code)
    dtype = (
        None
        if stem is None or tensor.dtype.lanes != 1
        else ("bool" if stem == "bool" else f"{stem}{tensor.dtype.bits}")
    )
    return MemoryRef((tensor.data or 0) + tensor.byte_offset, count * itemsize, device, dtype)


def memory_ref(obj: object, what: str = "memory", *, writable: bool = False) -> MemoryRef:
    """Describe the contiguous memory `obj` names; a pdhal error if it names none.

    With `writable`, read-only memory is refused too (pdhal is about to write there)."""
    if isinstance(obj, bool):
        raise InvalidTypeError(f"{what} must be {_ACCEPTED}, got bool")
    if isinstance(obj, int):
        if not 0 < obj < 1 << 64:
            raise InvalidArgumentError(f"{what} address must be in (0, 2**64), got {obj:#x}")
        return MemoryRef(obj, None, "unknown")
    own = getattr(obj, "_pdhal_memory_ref", None)  # pdhal's own buffers describe themselves
    if own is not None:
        ref = own()
    elif is_paddle_tensor(obj):
        ref = _paddle_ref(obj, what)
    else:
        try:
            view = memoryview(obj)
        except TypeError:
            view = None
        if view is not None:
            with view:
                ref = _buffer_ref(view, what)
        elif hasattr(obj, "data_ptr") and hasattr(obj, "element_size") and hasattr(obj, "numel"):
            ref = _data_ptr_ref(obj, what)
        elif getattr(obj, "__cuda_array_interface__", None) is not None:
            ref = _cai_ref(obj.__cuda_array_interface__, what)
        elif hasattr(obj, "__dlpack__"):
            ref = _dlpack_ref(obj, what)
        else:
            raise InvalidTypeError(f"{what} must be {_ACCEPTED}, got {type(obj).__name__}")
    if writable and ref.readonly:
        raise InvalidArgumentError(
            f"{what} is read-only, and pdhal writes into it: pass a writable array"
        )
    return ref


def writable_int32(obj: object, what: str, minimum: int):
    """(int32_t * cdata, length in words) of a writable, contiguous CPU int32 array with at
    least `minimum` words. The cdata is only valid while `obj` is alive; use it at once."""
    if isinstance(obj, (bool, int)) or obj is None:
        raise InvalidTypeError(
            f"{what} must be a writable int32 CPU array (Paddle tensor, numpy "
            f"array, array('i')), got {type(obj).__name__}"
        )
    ref = memory_ref(obj, what, writable=True)
    if ref.dtype != "int32":
        raise InvalidArgumentError(f"{what} must have dtype int32, got {ref.dtype or 'no dtype'}")
    if ref.device != "cpu":
        raise InvalidArgumentError(f"{what} must be in CPU memory, got one on {ref.device}")
    count = ref.nbytes // 4
    if count < minimum:
        raise InvalidArgumentError(f"{what} must hold at least {minimum} int32 words, got {count}")
    return ffi.cast("int32_t *", ref.address), count


_INT32_MAX = 2**31 - 1


def int_list(obj: object, what: str) -> list[int]:
    """The integers of a 1-D (or [n, 1]) tensor, array or sequence; each must fit int32."""
    if hasattr(obj, "tolist"):  # Paddle tensors and numpy arrays (device tensors: copied)
        values = obj.tolist()
    elif isinstance(obj, (list, tuple)):
        values = list(obj)
    else:
        raise InvalidTypeError(
            f"{what} must be a tensor, array or list of ints, got {type(obj).__name__}"
        )
    if not isinstance(values, list):
        raise InvalidArgumentError(f"{what} must be 1-D ([n] or [n, 1]), got a scalar {values!r}")
    flat = []
    for v in values:
        if isinstance(v, list) and len(v) == 1:
            v = v[0]
        if isinstance(v, bool) or not isinstance(v, int):
            raise InvalidArgumentError(
                f"{what} must hold integers of shape [n] or [n, 1], found {v!r}"
            )
        if not -_INT32_MAX - 1 <= v <= _INT32_MAX:
            raise InvalidArgumentError(
                f"{what} holds {v}, which does not fit the int32 record the messager reads"
            )
        flat.append(v)
    return flat
