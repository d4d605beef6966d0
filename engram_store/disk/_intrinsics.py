"""LLVM intrinsics the disk kernels need and Numba does not offer: memcpy, atomics, fences and libc ``pread``.

Each is an ``@intrinsic`` that emits a few LLVM instructions, so kernels that use them still compile with
``cache=True`` (a ``ctypes`` function pointer would bake an address into the code and disable the cache). ``pread``
and ``__errno_location`` are resolved by name from the C library already loaded into the process (glibc and musl
both export them), which is why the disk tier reads files on Linux only.

None of them checks bounds: the kernels that call them check every offset first.
"""
from __future__ import annotations

import sys

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

_I8P = ir.IntType(8).as_pointer()
_I64 = ir.IntType(64)
_I32 = ir.IntType(32)
_LOW_BYTE = 0 if sys.byteorder == "little" else 7   # where an int64's lowest byte lies


def _address(context, builder, array_type, array, index):
    ary = context.make_array(array_type)(context, builder, array)
    return builder.gep(ary.data, [index])


@intrinsic
def memcpy(typingctx, dst, dst_index, src, src_index, nbytes):
    """Copy ``nbytes`` bytes from ``&src[src_index]`` to ``&dst[dst_index]`` (1-D arrays; no bounds check)."""
    if not (isinstance(dst, types.Array) and isinstance(src, types.Array)):
        return None

    def codegen(context, builder, signature, args):
        d = builder.bitcast(_address(context, builder, signature.args[0], args[0], args[1]), _I8P)
        s = builder.bitcast(_address(context, builder, signature.args[2], args[2], args[3]), _I8P)
        n = context.cast(builder, args[4], signature.args[4], types.int64)
        cgutils.raw_memcpy(builder, d, s, n, 1)
        return context.get_dummy_value()

    return types.void(dst, dst_index, src, src_index, nbytes), codegen


def _rmw(op):
    def typer(typingctx, arr, index, value):
        if not (isinstance(arr, types.Array) and arr.dtype == types.int64):
            return None

        def codegen(context, builder, signature, args):
            ptr = _address(context, builder, signature.args[0], args[0], args[1])
            val = context.cast(builder, args[2], signature.args[2], types.int64)
            return builder.atomic_rmw(op, ptr, val, "seq_cst")

        return types.int64(arr, index, value), codegen

    return intrinsic(typer)


#: ``atomic_add(a, i, v)``: ``a[i] += v`` atomically (int64 arrays); returns the old value.
atomic_add = _rmw("add")
#: ``atomic_or(a, i, v)``: ``a[i] |= v`` atomically; returns the old value.
atomic_or = _rmw("or")
#: ``atomic_and(a, i, v)``: ``a[i] &= v`` atomically; returns the old value.
atomic_and = _rmw("and")


@intrinsic
def load_acquire(typingctx, arr, index):
    """``arr[index]`` (int64) read with acquire ordering: later reads are not moved before it."""
    if not (isinstance(arr, types.Array) and arr.dtype == types.int64):
        return None

    def codegen(context, builder, signature, args):
        ptr = _address(context, builder, signature.args[0], args[0], args[1])
        return builder.load_atomic(ptr, "acquire", 8)

    return types.int64(arr, index), codegen


@intrinsic
def or_low_byte_relaxed(typingctx, arr, index, bits):
    """``arr[index] |= bits`` for ``bits`` within the word's lowest byte (int64 arrays), as a relaxed
    byte load and store: no locked instruction, so a reader that marks a cache way as used does not stall on the
    memory it has in flight. Bytes above the lowest one are never written, so a writer's concurrent atomic update
    of them (a set's version) is never lost; a concurrent change of the lowest byte may be."""
    if not (isinstance(arr, types.Array) and arr.dtype == types.int64):
        return None

    def codegen(context, builder, signature, args):
        word = builder.bitcast(_address(context, builder, signature.args[0], args[0], args[1]), _I8P)
        ptr = builder.gep(word, [ir.Constant(_I64, _LOW_BYTE)])
        val = builder.trunc(context.cast(builder, args[2], signature.args[2], types.int64), ir.IntType(8))
        old = builder.load_atomic(ptr, "monotonic", 1)
        builder.store_atomic(builder.or_(old, val), ptr, "monotonic", 1)
        return context.get_dummy_value()

    return types.void(arr, index, bits), codegen


def _fence(ordering):
    def typer(typingctx):
        def codegen(context, builder, signature, args):
            builder.fence(ordering)
            return context.get_dummy_value()

        return types.void(), codegen

    return intrinsic(typer)


#: ``fence_acquire()``: reads before it complete before any read or write after it (free on x86-64).
fence_acquire = _fence("acquire")
#: ``fence_release()``: reads and writes before it complete before any write after it (free on x86-64).
fence_release = _fence("release")


@intrinsic
def pread(typingctx, fd, arr, index, nbytes, offset):
    """libc ``pread(fd, &arr[index], nbytes, offset)``: bytes read, 0 at end of file, -1 on error (see errno)."""
    if not isinstance(arr, types.Array):
        return None

    def codegen(context, builder, signature, args):
        fnty = ir.FunctionType(_I64, [_I32, _I8P, _I64, _I64])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "pread")
        buf = builder.bitcast(_address(context, builder, signature.args[1], args[1], args[2]), _I8P)
        fdv = context.cast(builder, args[0], signature.args[0], types.int32)
        n = context.cast(builder, args[3], signature.args[3], types.int64)
        off = context.cast(builder, args[4], signature.args[4], types.int64)
        return builder.call(fn, [fdv, buf, n, off])

    return types.int64(fd, arr, index, nbytes, offset), codegen


@intrinsic
def errno(typingctx):
    """The calling thread's ``errno`` (glibc and musl: ``*__errno_location()``)."""

    def codegen(context, builder, signature, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_I32.as_pointer(), []),
                                            "__errno_location")
        value = builder.load(builder.call(fn, []))
        return builder.sext(value, _I64)

    return types.int64(), codegen


@intrinsic
def address(typingctx, arr, index):
    """The address of ``arr[index]`` as an int64 (for structures handed to the kernel)."""
    if not isinstance(arr, types.Array):
        return None

    def codegen(context, builder, signature, args):
        return builder.ptrtoint(_address(context, builder, signature.args[0], args[0], args[1]), _I64)

    return types.int64(arr, index), codegen


@intrinsic
def memcpy_to(typingctx, dst_address, src, src_index, nbytes):
    """Copy ``nbytes`` bytes from ``&src[src_index]`` to the address ``dst_address`` (an int64)."""
    if not isinstance(src, types.Array):
        return None

    def codegen(context, builder, signature, args):
        d = builder.inttoptr(context.cast(builder, args[0], signature.args[0], types.int64), _I8P)
        s = builder.bitcast(_address(context, builder, signature.args[1], args[1], args[2]), _I8P)
        n = context.cast(builder, args[3], signature.args[3], types.int64)
        cgutils.raw_memcpy(builder, d, s, n, 1)
        return context.get_dummy_value()

    return types.void(dst_address, src, src_index, nbytes), codegen


def _syscall(arity):
    def typer(typingctx, number, *args):
        if len(args) != arity:
            return None

        def codegen(context, builder, signature, llargs):
            fnty = ir.FunctionType(_I64, [_I64], var_arg=True)
            fn = cgutils.get_or_insert_function(builder.module, fnty, "syscall")
            values = [context.cast(builder, v, t, types.int64) for v, t in zip(llargs, signature.args)]
            return builder.call(fn, values)

        return types.int64(number, *args), codegen

    return typer


@intrinsic
def syscall3(typingctx, number, a, b, c):
    """libc ``syscall(number, a, b, c)`` with int64 arguments: the result, or -1 with errno set."""
    return _syscall(3)(typingctx, number, a, b, c)


@intrinsic
def syscall5(typingctx, number, a, b, c, d, e):
    """libc ``syscall(number, a, b, c, d, e)`` with int64 arguments: the result, or -1 with errno set."""
    return _syscall(5)(typingctx, number, a, b, c, d, e)


def _load(width: int):
    def typer(typingctx, arr, index):
        if not (isinstance(arr, types.Array) and arr.dtype == types.uint8):
            return None
        out = types.uint64 if width == 64 else types.uint32

        def codegen(context, builder, signature, args):
            ptr = _address(context, builder, signature.args[0], args[0], args[1])
            value = builder.load(builder.bitcast(ptr, ir.IntType(width).as_pointer()), align=1)
            return value

        return out(arr, index), codegen

    return intrinsic(typer)


#: ``load_u64(a, i)``: the 8 bytes ``a[i:i + 8]`` of a uint8 array as a uint64, in the host's byte order (an
#: unaligned load; no bounds check).
load_u64 = _load(64)
#: ``load_u32(a, i)``: the 4 bytes ``a[i:i + 4]`` as a uint32, the same way.
load_u32 = _load(32)
