"""What every kernel module shares: the prefetch intrinsic, read-only views, word sizes and argument checks."""
from __future__ import annotations

import numpy as np
from llvmlite import binding as _llvm
from llvmlite import ir as _ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic
from ..errors import InvalidArgument, InvalidType

_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_SHIFT = {1: 0, 2: 1, 4: 2, 8: 3}


# ---- prefetching -------------------------------------------------------------------------------------------------
#
# A gather of random rows from a large table waits on one cache and TLB miss per row; the CPU overlaps only the
# few misses its reorder window reaches. The gathers ask for the row PREFETCH_ROWS ahead to be fetched while they
# copy the current one (a hint: it never faults, whatever the address).

#: How many rows ahead the gathers prefetch (measured: 8-16 rows take a 64k-row gather from 2.6 GB of 4 KiB
#: pages from 7.6-10 ms to 6.2 ms; 32 is no better).
PREFETCH_ROWS = 16
_PREFETCH_NAME = "llvm.prefetch.p0" if _llvm.llvm_version_info[0] >= 15 else "llvm.prefetch.p0i8"


@intrinsic
def _prefetch(typingctx, arr, index):
    """Prefetch ``arr[index]`` for reading into every cache level (``llvm.prefetch``; no bounds check)."""
    if not isinstance(arr, types.Array) or not isinstance(index, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        ary = context.make_array(signature.args[0])(context, builder, args[0])
        i8p = _ir.IntType(8).as_pointer()
        i32 = _ir.IntType(32)
        fn = cgutils.get_or_insert_function(builder.module, _ir.FunctionType(_ir.VoidType(), [i8p, i32, i32, i32]),
                                            _PREFETCH_NAME)
        address = builder.bitcast(builder.gep(ary.data, [args[1]]), i8p)
        builder.call(fn, [address, i32(0), i32(3), i32(1)])  # read, keep in all levels, data cache
        return context.get_dummy_value()

    return types.void(arr, index), codegen


# ---- views and argument checks ----------------------------------------------------------------------------------

def readonly(a: np.ndarray) -> np.ndarray:
    """``a`` itself if read-only, else a read-only view: kernels see every source with one type."""
    if a.flags.writeable:
        a = a.view()
        a.flags.writeable = False
    return a


def word_shift(bits: int) -> int:
    """log2 of the widest word (8, 4, 2 or 1 bytes) that ``bits`` (an OR of offsets and sizes) is a multiple of."""
    return 3 if bits % 8 == 0 else 2 if bits % 4 == 0 else 1 if bits % 2 == 0 else 0


def _words(a: np.ndarray, shift: int) -> np.ndarray:
    """A flat uint8 array seen as words of ``1 << shift`` bytes; a ragged tail no aligned range reaches is left out."""
    if shift == 0:
        return a
    word = 1 << shift
    return a[:a.size - a.size % word].view(_UINT[word])


def _int64_1d(a: np.ndarray, name: str) -> np.ndarray:
    a = np.asarray(a)
    if a.dtype != np.int64 or a.ndim != 1:
        raise InvalidType(f"{name}: expected a 1-D int64 array, got {a.dtype} with shape {a.shape}")
    return np.ascontiguousarray(a)


def _bytes_1d(a: np.ndarray, name: str) -> np.ndarray:
    if not isinstance(a, np.ndarray) or a.dtype != np.uint8 or a.ndim != 1:
        raise InvalidType(f"{name}: expected a 1-D uint8 array, got {getattr(a, 'dtype', type(a).__name__)} "
                        f"with shape {getattr(a, 'shape', None)}")
    if not a.flags.c_contiguous:
        raise InvalidArgument(f"{name}: expected a contiguous array")
    return a


def _ids_2d(ids: np.ndarray) -> np.ndarray:
    if not isinstance(ids, np.ndarray) or ids.dtype != np.int64 or ids.ndim != 2:
        raise InvalidType(f"ids: expected a 2-D int64 array [M, H], got {getattr(ids, 'dtype', type(ids).__name__)} "
                        f"with shape {getattr(ids, 'shape', None)}")
    return readonly(np.ascontiguousarray(ids))


@njit(cache=True, nogil=True)
def _heads_valid(heads, num_heads):
    seen = np.zeros(num_heads, dtype=np.bool_)
    for j in range(heads.size):
        h = heads[j]
        if h < 0 or h >= num_heads or seen[h]:
            return False
        seen[h] = True
    return True


def _heads(heads: np.ndarray, num_heads: int, name: str = "heads") -> np.ndarray:
    heads = readonly(_int64_1d(heads, name))
    if not _heads_valid(heads, num_heads):
        raise InvalidArgument(f"{name}: expected distinct head indices in [0, {num_heads}), got {heads.tolist()[:16]}")
    return heads


def _out_3d(out: np.ndarray, M: int, H: int, dtype: np.dtype) -> np.ndarray:
    if not isinstance(out, np.ndarray) or out.dtype != dtype or out.ndim != 3:
        raise InvalidType(f"out: expected a 3-D {dtype} array [M, H, D], got "
                        f"{getattr(out, 'dtype', type(out).__name__)} with shape {getattr(out, 'shape', None)}")
    if out.shape[:2] != (M, H):
        raise InvalidArgument(f"out: expected shape ({M}, {H}, D), got {out.shape}")
    if not out.flags.c_contiguous or not out.flags.writeable:
        raise InvalidArgument("out: must be a writable C-contiguous array")
    return out


def _check_row_dtype(a: np.ndarray, name: str) -> None:
    if a.dtype.itemsize not in _UINT or a.dtype.kind not in "uif":
        raise InvalidType(f"{name}: expected rows of 1-, 2-, 4- or 8-byte numbers, got {a.dtype}")


def _flat_bytes(a: np.ndarray) -> np.ndarray:
    """A C-contiguous array's bytes as a flat uint8 array (no copy)."""
    return a.reshape(-1).view(np.uint8)
