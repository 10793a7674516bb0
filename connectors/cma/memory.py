"""Another process's memory, read with ``process_vm_readv`` through ctypes (the cma plane's copies).

Two entry points: ``copy_from`` copies a read's pieces (releasing the GIL for a long copy), and
``Peeker`` makes the small reads of the producer's hold board, the GIL kept. Neither allocates
per piece: the pieces travel as int64 arrays handed to the kernel as ``struct iovec``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

import numpy as np

from kvxfer.dataplane import Descriptors

IOV_MAX = 1024  # Linux's UIO_MAXIOV: iovecs per process_vm_readv call
_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_readv = _libc.process_vm_readv
_readv.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]
_readv.restype = ctypes.c_ssize_t
# the same call with the GIL kept: a read of a few bytes takes a microsecond, and releasing the GIL
# for it would let every thread waiting for the GIL run first
_peekv = ctypes.PyDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).process_vm_readv
_peekv.argtypes = _readv.argtypes
_peekv.restype = ctypes.c_ssize_t
PEEK_MAX = 1 << 20  # reads up to this size (board rows, a hold's block ids) keep the GIL


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


class Peeker:
    """Small reads of one process's memory (the hold board), the GIL kept; one thread at a time."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._local = _Iovec()
        self._remote = _Iovec()

    def __call__(self, address: int, nbytes: int) -> np.ndarray:
        if not 0 < nbytes <= PEEK_MAX:
            raise OSError(f"a read of {nbytes} bytes from pid {self.pid} is not a small read")
        out = np.empty(nbytes, dtype=np.uint8)
        self._local.base, self._local.len = out.ctypes.data, nbytes
        self._remote.base, self._remote.len = address, nbytes
        got = _peekv(self.pid, ctypes.byref(self._local), 1, ctypes.byref(self._remote), 1, 0)
        if got != nbytes:
            err = ctypes.get_errno()
            raise OSError(err, f"process_vm_readv from pid {self.pid}: {os.strerror(err) if got < 0 else 'short'}")
        return out


def copy_from(pid: int, local: np.ndarray, remote: np.ndarray, keep_gil: bool = False,
              nbytes: int | None = None) -> None:
    """Copy the pieces ``remote`` [n, 2] (address, length) of process ``pid`` into ``local`` [n, 2];
    IOV_MAX at a time, the GIL released during each call unless ``keep_gil`` (a short copy: a
    busy thread of this process then cannot make the caller wait for the GIL afterwards).
    ``nbytes``: the pieces' total, when the caller knows it. Raises OSError on any failure or
    short copy."""
    call = _peekv if keep_gil else _readv
    if len(local) <= IOV_MAX and local.flags.c_contiguous and remote.flags.c_contiguous:  # the usual case
        want = int(local[:, 1].sum()) if nbytes is None else nbytes
        got = call(pid, local.ctypes.data, len(local), remote.ctypes.data, len(remote), 0)
        if got != want:
            err = ctypes.get_errno()
            raise OSError(err, f"process_vm_readv from pid {pid}: "
                          f"{os.strerror(err) if got < 0 else f'short copy, {got} of {want} bytes'}")
        return
    for a in range(0, len(local), IOV_MAX):
        lo, re = np.ascontiguousarray(local[a : a + IOV_MAX]), np.ascontiguousarray(remote[a : a + IOV_MAX])
        want = int(lo[:, 1].sum())
        got = call(pid, lo.ctypes.data, len(lo), re.ctypes.data, len(re), 0)
        if got < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"process_vm_readv from pid {pid}: {os.strerror(err)}")
        if got != want:
            raise OSError(f"process_vm_readv from pid {pid}: short copy, {got} of {want} bytes")


def iovecs(d: Descriptors, local: np.ndarray, remote: np.ndarray) -> np.ndarray:
    """[local, remote] x piece x (address, length) of ``d``'s pieces; ``local``/``remote``: each
    piece's region's address on either side."""
    iov = np.empty((2, len(d), 2), dtype=np.int64)
    np.add(local, d.local_offset, out=iov[0, :, 0])
    np.add(remote, d.remote_offset, out=iov[1, :, 0])
    iov[:, :, 1] = d.length
    return iov
