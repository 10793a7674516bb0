"""One-sided UCX reads (``ucp_get_nbx``) on ucxx's own context and workers, through ctypes.

ucxx 0.52's Python API has tag, stream and active messages but no RMA, while the ucx plane's
two-sided reads need the producer's Python to send every reply: a producer whose Python is busy
(a vLLM prefill worker between steps) stalls them, and UCX's bounded shared-memory FIFO stalls
them further (docs/benchmarks.md, vLLM section). A get needs nothing of the producer's Python:
UCX serves it on the fabric (RDMA), through CMA, or, with neither, by software emulation on the
producer's worker, which a native ucxx progress thread answers without the GIL. The calls here
are the few this needs from libucp (the library ucxx loaded): map a region and pack its remote
key (producer), unpack it on an endpoint and get pieces, then flush the endpoint (consumer).

Layouts come from UCX 1.21's ``ucp.h``: ``ucp_mem_map_params_t`` begins with ``field_mask``,
``address``, ``length``; a ``ucp_request_param_t`` of zeros (no fields) is 72 bytes, given 128.
Nothing here reads message text: failures raise :class:`UcxRmaError` with the UCX status. UCX
does not check a packed key it unpacks (16 zero bytes unpack as a key of no memory domains), so
keys must come from a peer the side channel authenticated, like every other handshake field.

Threads: the functions are thread-safe as far as UCX's worker is (ucxx makes its workers
``UCS_THREAD_MODE_MULTI``); a :class:`RemoteKey` belongs to the endpoint it was unpacked on.
"""

from __future__ import annotations

import ctypes
import logging
import os
from dataclasses import dataclass

import numpy as np

from kvxfer.dataplane import join_adjacent

logger = logging.getLogger(__name__)

UCS_OK, UCS_INPROGRESS = 0, 1
_FIELD_ADDRESS, _FIELD_LENGTH = 1 << 0, 1 << 1  # UCP_MEM_MAP_PARAM_FIELD_*
_PARAM_BYTES = 128  # a ucp_request_param_t (72 bytes in UCX 1.21) with no fields set
_ERR_PTR_MIN = (1 << 64) - 4096  # UCS_PTR_IS_ERR: a returned "pointer" that is a negative status
_vp = ctypes.c_void_p
_status = ctypes.c_int8  # ucs_status_t is a packed enum: one signed byte


class UcxRmaError(ConnectionError):
    """A libucp call failed; ``status`` is UCX's ``ucs_status_t`` (negative). A ConnectionError:
    a get or flush fails when the peer is gone (its process died, the link broke)."""

    def __init__(self, call: str, status: int) -> None:
        super().__init__(f"{call} failed: UCX status {status}")
        self.call = call
        self.status = status


class _Ucp:
    """libucp's functions used here, typed once per process."""

    def __init__(self) -> None:
        import libucx  # the wheel ucxx depends on; its libucp is the one ucxx loaded

        lib = ctypes.CDLL(os.path.join(os.path.dirname(libucx.__file__), "lib", "libucp.so"))
        self.mem_map = lib.ucp_mem_map
        self.mem_map.argtypes = [_vp, _vp, ctypes.POINTER(_vp)]
        self.mem_map.restype = _status
        self.mem_unmap = lib.ucp_mem_unmap
        self.mem_unmap.argtypes = [_vp, _vp]
        self.mem_unmap.restype = _status
        self.rkey_pack = lib.ucp_rkey_pack
        self.rkey_pack.argtypes = [_vp, _vp, ctypes.POINTER(_vp), ctypes.POINTER(ctypes.c_size_t)]
        self.rkey_pack.restype = _status
        self.rkey_buffer_release = lib.ucp_rkey_buffer_release
        self.rkey_buffer_release.argtypes = [_vp]
        self.rkey_buffer_release.restype = None
        self.ep_rkey_unpack = lib.ucp_ep_rkey_unpack
        self.ep_rkey_unpack.argtypes = [_vp, ctypes.c_char_p, ctypes.POINTER(_vp)]
        self.ep_rkey_unpack.restype = _status
        self.rkey_destroy = lib.ucp_rkey_destroy
        self.rkey_destroy.argtypes = [_vp]
        self.rkey_destroy.restype = None
        self.get_nbx = lib.ucp_get_nbx
        self.get_nbx.argtypes = [_vp, _vp, ctypes.c_size_t, ctypes.c_uint64, _vp, _vp]
        self.get_nbx.restype = _vp
        self.ep_flush_nbx = lib.ucp_ep_flush_nbx
        self.ep_flush_nbx.argtypes = [_vp, _vp]
        self.ep_flush_nbx.restype = _vp
        self.request_check_status = lib.ucp_request_check_status
        self.request_check_status.argtypes = [_vp]
        self.request_check_status.restype = _status
        self.request_free = lib.ucp_request_free
        self.request_free.argtypes = [_vp]
        self.request_free.restype = None


_ucp: _Ucp | None = None


def _lib() -> _Ucp:
    global _ucp
    if _ucp is None:
        _ucp = _Ucp()
    return _ucp


def _status_of(ptr: int | None) -> int | None:
    """None: completed at once (a NULL request); a negative status: failed; else 1 (a request)."""
    if ptr is None:
        return None
    return ptr - (1 << 64) if ptr >= _ERR_PTR_MIN else UCS_INPROGRESS


@dataclass
class MemoryKey:
    """A region mapped for remote reads on the producer's context; ``rkey`` goes to consumers."""

    context: int
    memh: int
    address: int
    length: int
    rkey: bytes

    def close(self) -> None:
        if self.memh:
            status = _lib().mem_unmap(self.context, self.memh)
            self.memh = 0
            if status != UCS_OK:
                logger.warning("ucp_mem_unmap of %d bytes at %#x: UCX status %d", self.length, self.address, status)


def map_region(context_handle: int, address: int, length: int) -> MemoryKey:
    """Map ``length`` bytes at ``address`` for remote reads (``ucp_mem_map``) and pack its key."""
    if length <= 0:
        raise ValueError(f"a region to map needs a positive length, got {length}")
    u = _lib()
    params = (ctypes.c_uint64 * 6)(_FIELD_ADDRESS | _FIELD_LENGTH, address, length, 0, 0, 0)
    memh = _vp()
    status = u.mem_map(context_handle, ctypes.addressof(params), ctypes.byref(memh))
    if status != UCS_OK:
        raise UcxRmaError("ucp_mem_map", status)
    buf, size = _vp(), ctypes.c_size_t()
    status = u.rkey_pack(context_handle, memh, ctypes.byref(buf), ctypes.byref(size))
    if status != UCS_OK:
        u.mem_unmap(context_handle, memh)
        raise UcxRmaError("ucp_rkey_pack", status)
    try:
        rkey = ctypes.string_at(buf.value or 0, size.value)
    finally:
        u.rkey_buffer_release(buf)
    return MemoryKey(context=context_handle, memh=memh.value or 0, address=address, length=length, rkey=rkey)


class RemoteKey:
    """A producer's packed key unpacked on one endpoint (``ucp_ep_rkey_unpack``)."""

    def __init__(self, ep_handle: int, rkey: bytes) -> None:
        handle = _vp()
        status = _lib().ep_rkey_unpack(ep_handle, rkey, ctypes.byref(handle))
        if status != UCS_OK:
            raise UcxRmaError("ucp_ep_rkey_unpack", status)
        self.ep = ep_handle
        self.handle: int = handle.value or 0

    def close(self) -> None:
        if self.handle:
            _lib().rkey_destroy(self.handle)
            self.handle = 0


class Getter:
    """Issues gets on one endpoint and tells when all of them have landed (one ep flush).

    ``get_pieces`` posts one ``ucp_get_nbx`` per piece and frees each request at once (UCX
    completes it anyway); ``flush`` then posts an endpoint flush, which completes once every get
    before it has: the caller progresses the worker until ``done`` says so. Owned by one thread.
    """

    def __init__(self, ep_handle: int) -> None:
        self.ep = ep_handle
        self._param = ctypes.create_string_buffer(_PARAM_BYTES)
        self._param_at = ctypes.addressof(self._param)

    def get_pieces(self, rkeys: np.ndarray, local: np.ndarray, remote: np.ndarray, lengths: np.ndarray) -> None:
        """Get ``lengths[i]`` bytes at remote address ``remote[i]`` (of the region whose unpacked
        key handle is ``rkeys[i]``) into local address ``local[i]``; pieces adjacent on both sides
        under one key go as one get."""
        local, remote, lengths, keys = join_adjacent(local, remote, lengths, rkeys)
        assert keys is not None
        u = _lib()
        get, free, ep, param = u.get_nbx, u.request_free, self.ep, self._param_at
        for dst, src, n, rk in zip(local.tolist(), remote.tolist(), lengths.tolist(), keys.tolist(), strict=True):
            req = get(ep, dst, n, src, rk, param)
            if req is not None:
                if req >= _ERR_PTR_MIN:
                    raise UcxRmaError("ucp_get_nbx", req - (1 << 64))
                free(req)

    def flush(self) -> int | None:
        """Post an endpoint flush: None if everything landed already, else the request to check."""
        req = _lib().ep_flush_nbx(self.ep, self._param_at)
        status = _status_of(req)
        if status is not None and status < 0:
            raise UcxRmaError("ucp_ep_flush_nbx", status)
        return req

    @staticmethod
    def done(req: int | None) -> bool:
        """Whether the flush ``req`` completed; it is freed then. A failed flush raises."""
        if req is None:
            return True
        u = _lib()
        status = u.request_check_status(req)
        if status == UCS_INPROGRESS:
            return False
        u.request_free(req)
        if status != UCS_OK:
            raise UcxRmaError("ucp_ep_flush_nbx", status)
        return True


class RemoteRegions:
    """A producer's mapped regions as seen by one consumer endpoint: where each lies and its key,
    so that a read's pieces turn into remote addresses and key handles in one vectorised step."""

    def __init__(self, ep_handle: int, regions: dict[int, tuple[int, int, bytes]]) -> None:
        ids = sorted(regions)
        self.keys = [RemoteKey(ep_handle, regions[i][2]) for i in ids]
        self.known = np.array(ids, dtype=np.int64)
        self.bases = np.array([regions[i][0] for i in ids], dtype=np.uint64)
        self.sizes = np.array([regions[i][1] for i in ids], dtype=np.int64)
        self.handles = np.array([k.handle for k in self.keys], dtype=np.uint64)

    def at(self, regions: np.ndarray, offsets: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(remote addresses, key handles) of pieces; IndexError for a piece outside its region."""
        pos = np.minimum(np.searchsorted(self.known, regions), max(len(self.known) - 1, 0))
        if not len(self.known) or (self.known[pos] != regions).any() or (offsets < 0).any() \
                or (offsets + lengths > self.sizes[pos]).any():
            raise IndexError("a piece is outside the producer's mapped regions")
        return self.bases[pos] + offsets.astype(np.uint64), self.handles[pos]

    def close(self) -> None:
        for k in self.keys:
            k.close()


__all__ = ["Getter", "MemoryKey", "RemoteKey", "RemoteRegions", "UcxRmaError", "map_region"]
