"""Many device copies in one host call: the CUDA driver's batched memcpy (cuMemcpyBatchAsync, CUDA >= 12.8).

The EP layer's copy-engine transfers move a pipeline chunk as one run per (local expert, source rank): dozens
of copies a chunk on Qwen3-30B-A3B's shape. One cudaMemcpyAsync each costs the host microseconds apiece; one
batch takes them all, and the copies stay on the copy engines (no SM is taken from the GEMMs beside them).

The function is looked up through cuGetProcAddress for the CUDA version whose argument list this file uses: 12.8's
on a 12.8 or 12.9 driver (with a failure index), 13.0's on a newer one (without). The batch runs in stream order on ``stream`` (the
source is read in stream order too); within a batch the copies have no order, so they must not overlap.
Where the driver has no such function (or no CUDA is there), ``available()`` is False and callers copy one by
one; nothing here runs on CPU tensors.
"""
from __future__ import annotations

import ctypes
import functools

_SRC_ACCESS_ORDER_STREAM = 1  # CU_MEMCPY_SRC_ACCESS_ORDER_STREAM


class _Location(ctypes.Structure):  # CUmemLocation
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _Attributes(ctypes.Structure):  # CUmemcpyAttributes
    _fields_ = [("srcAccessOrder", ctypes.c_int), ("srcLocHint", _Location), ("dstLocHint", _Location),
                ("flags", ctypes.c_uint)]


@functools.lru_cache(maxsize=1)
def _driver():
    """(function, whether it takes a failure index, the attributes and their index), or None."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    version = ctypes.c_int(0)
    if lib.cuDriverGetVersion(ctypes.byref(version)) != 0 or version.value < 12080:
        return None
    get = getattr(lib, "cuGetProcAddress_v2", None)
    if get is None:
        return None
    pfn, status = ctypes.c_void_p(), ctypes.c_int(0)
    get.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, ctypes.c_uint64,
                    ctypes.POINTER(ctypes.c_int)]
    # the argument list of a CUDA version this file knows: 13.0's on a 13.x (or newer) driver, else 12.8's
    with_fail = version.value < 13000
    asked = 12080 if with_fail else 13000
    if get(b"cuMemcpyBatchAsync", ctypes.byref(pfn), asked, 0, ctypes.byref(status)) != 0 or not pfn.value:
        return None
    u64, size = ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t)
    args = [u64, u64, size, ctypes.c_size_t, ctypes.POINTER(_Attributes), size, ctypes.c_size_t]
    args += [size] if with_fail else []
    fn = ctypes.CFUNCTYPE(ctypes.c_int, *args, ctypes.c_void_p)(pfn.value)
    attrs = _Attributes(srcAccessOrder=_SRC_ACCESS_ORDER_STREAM)
    index = (ctypes.c_size_t * 1)(0)
    return fn, with_fail, attrs, index


def available() -> bool:
    return _driver() is not None


def copy_batch(dsts, srcs, sizes, stream: int) -> None:
    """Copy sizes[i] bytes from device address srcs[i] to dsts[i], for every i, on CUDA stream ``stream`` (an
    address, as torch.cuda.Stream.cuda_stream gives). Three sequences of ints of one length; the copies must
    not overlap, and the stream must not be the legacy default stream (0). Raises RuntimeError with the driver's
    code if it refuses the batch."""
    count = len(sizes)
    if len(dsts) != count or len(srcs) != count:
        raise ValueError("uniep: copy_batch takes three sequences of one length")
    if not stream:
        raise ValueError("uniep: copy_batch needs a stream other than the legacy default stream")
    if count == 0:
        return
    fn, with_fail, attrs, index = _driver()
    array = ctypes.c_uint64 * count
    extra = (ctypes.byref(ctypes.c_size_t(0)),) if with_fail else ()
    code = fn(array(*dsts), array(*srcs), (ctypes.c_size_t * count)(*sizes), count, ctypes.byref(attrs),
              index, 1, *extra, stream)
    if code != 0:
        raise RuntimeError(f"uniep: cuMemcpyBatchAsync of {count} copies failed with CUDA driver error {code}")
