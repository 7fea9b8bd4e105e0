"""Integer buffers handed to the C ABI without copies where the caller's
object allows it: numpy arrays, CPU torch tensors and writable buffers
(``array.array``, memoryviews of writable memory) of the right type are
passed by address; lists, tuples and read-only buffers are copied. GPU
arrays (anything with ``__cuda_array_interface__``: CUDA torch tensors,
CuPy and Numba arrays) are passed by device address to the device checks."""

from __future__ import annotations

import ctypes
from typing import Any, NamedTuple

# (ctypes type, numpy dtype names, torch dtype names, buffer formats)
_TYPES = {
    ctypes.c_int32: (("int32",), ("torch.int32",), ("i", "=i", "<i")),
    ctypes.c_int64: (("int64",), ("torch.int64",), ("q", "=q", "<q", "l", "=l", "<l")),
}
_NAMES = {ctypes.c_int32: "int32", ctypes.c_int64: "int64"}


class CArray(NamedTuple):
    """A C view of an integer buffer: its address, its length, and the
    object that keeps the memory alive while the call runs."""

    pointer: Any
    length: int
    keepalive: Any
    copied: bool


def as_c_array(obj: Any, ctype: type, name: str) -> CArray:
    """``obj`` as a contiguous C array of ``ctype`` (``c_int32`` or
    ``c_int64``), by address when it can be; raises ``TypeError`` naming
    ``name`` for a buffer of another type or layout, ``ValueError`` for a
    tensor that is not in host memory."""
    np_names, torch_names, formats = _TYPES[ctype]
    kind = type(obj).__module__.split(".")[0]
    ptr_type = ctypes.POINTER(ctype)
    if kind == "numpy" and hasattr(obj, "ctypes"):
        if str(obj.dtype) not in np_names:
            raise TypeError(f"{name}: numpy dtype {obj.dtype}, expected {np_names[0]}")
        if not obj.flags["C_CONTIGUOUS"]:
            raise TypeError(f"{name}: the numpy array is not C-contiguous")
        return CArray(obj.ctypes.data_as(ptr_type), int(obj.size), obj, False)
    if kind == "torch" and hasattr(obj, "data_ptr"):
        if obj.device.type != "cpu":
            raise ValueError(
                f"{name}: a tensor on {obj.device}; the host checks read host memory "
                "(copy it with .cpu(), as the kernel's launch arguments are)"
            )
        if str(obj.dtype) not in torch_names:
            raise TypeError(f"{name}: torch dtype {obj.dtype}, expected {torch_names[0]}")
        if not obj.is_contiguous():
            raise TypeError(f"{name}: the tensor is not contiguous")
        return CArray(ctypes.cast(obj.data_ptr(), ptr_type), int(obj.numel()), obj, False)
    try:
        view = memoryview(obj)
    except TypeError:
        view = None
    if view is not None:
        if view.format not in formats or view.itemsize != ctypes.sizeof(ctype):
            raise TypeError(
                f"{name}: buffer of format {view.format!r} (itemsize {view.itemsize}), "
                f"expected {_NAMES[ctype]}"
            )
        if not view.c_contiguous:
            raise TypeError(f"{name}: the buffer is not C-contiguous")
        n = view.nbytes // view.itemsize
        if not view.readonly and n > 0:
            array = (ctype * n).from_buffer(view.cast("B"))
            return CArray(ctypes.cast(array, ptr_type), n, (array, view), False)
        values = view.cast("B").cast(formats[0]).tolist()
        array = (ctype * n)(*values)
        return CArray(ctypes.cast(array, ptr_type), n, array, True)
    values = [int(v) for v in obj]
    array = (ctype * len(values))(*values)
    return CArray(ctypes.cast(array, ptr_type), len(values), array, True)


# (ctypes type) -> the __cuda_array_interface__ type strings it accepts.
_DEVICE_TYPES = {ctypes.c_int32: ("<i4", "|i4", "=i4"), ctypes.c_int64: ("<i8", "|i8", "=i8")}


class DeviceArray(NamedTuple):
    """A GPU buffer by device address: its address, length in values, the
    CUDA device ordinal it lives on, and the object that keeps it alive."""

    address: int
    length: int
    device: int
    keepalive: Any


def on_device(obj: Any) -> bool:
    """Whether ``obj`` is a GPU array (``__cuda_array_interface__``)."""
    return hasattr(type(obj), "__cuda_array_interface__") or hasattr(obj, "__cuda_array_interface__")


def _ordinal(obj: Any) -> int:
    device = getattr(obj, "device", None)
    for attr in ("index", "id"):  # torch.device.index, cupy.cuda.Device.id
        value = getattr(device, attr, None)
        if isinstance(value, int):
            return value
    return 0


def as_device_array(obj: Any, ctype: type, name: str) -> DeviceArray:
    """``obj`` (a GPU array) as a contiguous device buffer of ``ctype``;
    raises ``TypeError`` naming ``name`` for another type or layout."""
    cai = obj.__cuda_array_interface__
    typestr = cai.get("typestr")
    if typestr not in _DEVICE_TYPES[ctype]:
        raise TypeError(f"{name}: device array of type {typestr!r}, expected {_NAMES[ctype]}")
    shape = tuple(cai.get("shape", ()))
    n = 1
    for dim in shape:
        n *= int(dim)
    strides = cai.get("strides")
    if strides is not None:
        expected, size = [], ctypes.sizeof(ctype)
        for dim in reversed(shape):
            expected.append(size)
            size *= int(dim)
        if tuple(reversed(expected)) != tuple(strides) and n > 1:
            raise TypeError(f"{name}: the device array is not C-contiguous")
    address = int(cai["data"][0])
    return DeviceArray(address, n, _ordinal(obj), obj)
