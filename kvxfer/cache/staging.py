"""Host staging: copy chosen blocks between a cache and packed host buffers.

A data plane that cannot reach device memory moves blocks through host buffers.
Each copy is one batched gather or scatter per tensor (per layer, or one for a
cross-layer cache; ``index_select`` / numpy row assignment / ``index_copy_``, see
``blockcopy``), never a Python loop per block.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import logging
from collections.abc import Sequence

import numpy as np
import torch

from kvxfer.cache.blockcopy import _wide, gather_rows, scatter_rows
from kvxfer.cache.tensors import KVCache

logger = logging.getLogger(__name__)

CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712  # cudaErrorHostMemoryAlreadyRegistered
MAX_SLICE_RUNS = 8  # a device<->host copy of at most this many runs of block ids copies slices, no gather


def _index(cache: KVCache, block_ids: Sequence[int] | np.ndarray | torch.Tensor) -> torch.Tensor:
    idx = torch.as_tensor(block_ids, dtype=torch.int64)
    if idx.ndim != 1:
        raise ValueError(f"block_ids: expected a 1-d sequence, got shape {tuple(idx.shape)}")
    if len(idx) and (int(idx.min()) < 0 or int(idx.max()) >= cache.num_blocks):
        raise ValueError(f"block_ids: expected ids in [0, {cache.num_blocks}), got {idx.tolist()}")
    return idx


def _check_buffers(cache: KVCache, bufs: list[torch.Tensor], n: int, what: str) -> None:
    """Refuse (before any copy) buffers that cannot hold ``n`` blocks of every tensor."""
    if len(bufs) != len(cache.tensors):
        raise ValueError(f"{what}: expected {len(cache.tensors)} buffers, got {len(bufs)}")
    for t, buf in zip(cache.tensors, bufs, strict=True):
        if buf.shape[0] < n or buf.shape[1:] != t.shape[1:] or buf.dtype != t.dtype:
            raise ValueError(f"{what} buffer {tuple(buf.shape)} {buf.dtype} does not fit {n} "
                             f"blocks of {tuple(t.shape[1:])} {t.dtype}")


def host_buffers(cache: KVCache, num_blocks: int) -> list[torch.Tensor]:
    """Packed host buffers for ``num_blocks`` blocks of every tensor (pinned for CUDA)."""
    pin = cache.device.type == "cuda"
    return [torch.empty((num_blocks, *t.shape[1:]), dtype=t.dtype, pin_memory=pin) for t in cache.tensors]


def gather_to_host(cache: KVCache, block_ids: Sequence[int] | torch.Tensor,
                   out: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """Blocks ``block_ids`` of every tensor, packed in that order into host buffers."""
    idx = _index(cache, block_ids)
    if out is None:
        out = host_buffers(cache, len(idx))
    _check_buffers(cache, out, len(idx), "out")
    for t, buf in zip(cache.tensors, out, strict=True):
        gather_rows(t, idx, out=buf)
    if cache.device.type == "cuda":
        torch.cuda.synchronize(cache.device)
    return out


def scatter_from_host(cache: KVCache, block_ids: Sequence[int] | torch.Tensor,
                      src: list[torch.Tensor]) -> None:
    """Write packed host buffers into blocks ``block_ids`` of every tensor."""
    idx = _index(cache, block_ids)
    _check_buffers(cache, src, len(idx), "src")
    for t, buf in zip(cache.tensors, src, strict=True):
        scatter_rows(t, idx, buf)
    if cache.device.type == "cuda":
        torch.cuda.synchronize(cache.device)


def mirror_of(cache: KVCache, huge_pages: bool = True, pin: bool = True) -> KVCache:
    """A host cache of the same spec and size: the registered stand-in for a device cache.
    ``pin=False``: the caller pins it (``pin_for``) once its memory stays where it is."""
    from kvxfer.cache.tensors import allocate_kv_cache

    mirror = allocate_kv_cache(cache.spec, cache.num_blocks, device="cpu", huge_pages=huge_pages)
    if pin:
        pin_for(cache, mirror)
    return mirror


def pin_for(cache: KVCache, mirror: KVCache) -> None:
    """Pin ``mirror``'s host memory when ``cache`` is on a GPU, so device copies run at full speed.

    Each storage is registered once (``cudaHostRegister``) and stays registered until ``unpin``:
    memory freed while registered would stay pinned, and a later allocation at the same address
    could not be registered. A failure raises and leaves nothing registered."""
    if cache.device.type != "cuda":
        return
    rt = _cudart()
    done: list[tuple[int, int]] = []
    for ptr, nbytes in _storages(mirror):
        if any(ptr == p for p, _ in mirror._pinned):
            continue
        err = rt.cudaHostRegister(ctypes.c_void_p(ptr), ctypes.c_size_t(nbytes), 0)
        if err == 0:
            done.append((ptr, nbytes))
            continue
        rt.cudaGetLastError()  # clear it: torch would otherwise raise it at its next kernel launch
        if err == CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED:  # someone else pinned it: theirs to unpin
            logger.debug("host mirror at %#x is already pinned", ptr)
            continue
        for p, _ in done:
            rt.cudaHostUnregister(ctypes.c_void_p(p))
        rt.cudaGetLastError()
        raise RuntimeError(f"pinning the host mirror of a {cache.device} cache ({nbytes / 2**20:.1f} MiB at "
                           f"{ptr:#x}) failed: cudaHostRegister: {_error_string(rt, err)} ({err})")
    mirror._pinned.extend(done)


def unpin(mirror: KVCache) -> None:
    """Undo ``pin_for`` (the connector's close): the memory may then be freed."""
    if not mirror._pinned:
        return
    rt = _cudart()
    while mirror._pinned:
        ptr, nbytes = mirror._pinned.pop()
        err = rt.cudaHostUnregister(ctypes.c_void_p(ptr))
        if err != 0:
            rt.cudaGetLastError()
            logger.warning("unpinning the host mirror (%.1f MiB at %#x) failed: %s (%d)", nbytes / 2**20, ptr,
                           _error_string(rt, err), err)


def _storages(cache: KVCache) -> list[tuple[int, int]]:
    """(address, bytes) of each distinct storage behind ``cache``'s tensors."""
    seen: dict[int, int] = {}
    for t in cache.tensors:
        st = t.untyped_storage()
        seen.setdefault(st.data_ptr(), st.nbytes())
    return list(seen.items())


@functools.cache
def _cudart() -> ctypes.CDLL:
    """The CUDA runtime torch loaded (its host registration calls, checked here, with the error
    state cleared after a failure, which torch's own binding leaves set)."""
    torch.cuda.init()
    names = []
    with open("/proc/self/maps") as f:  # the very library torch uses, by path
        for line in f:
            path = line.split()[-1] if line.count("/") else ""
            if "/libcudart.so" in path and path not in names:
                names.append(path)
    major = (torch.version.cuda or "").split(".")[0]
    names += [f"libcudart.so.{major}", "libcudart.so"] if major else ["libcudart.so"]
    for name in names:
        try:
            rt = ctypes.CDLL(name)
        except OSError:
            continue
        rt.cudaHostRegister.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
        rt.cudaHostUnregister.argtypes = [ctypes.c_void_p]
        rt.cudaGetErrorString.restype = ctypes.c_char_p
        rt.cudaGetErrorString.argtypes = [ctypes.c_int]
        return rt
    raise RuntimeError(f"host staging: no CUDA runtime library found (tried {', '.join(names)})")


def _error_string(rt: ctypes.CDLL, err: int) -> str:
    msg = rt.cudaGetErrorString(err)
    return msg.decode(errors="replace") if msg else "unknown error"


def copy_blocks(src: KVCache, dst: KVCache, block_ids: Sequence[int] | np.ndarray | torch.Tensor,
                layer: int | None = None) -> None:
    """Blocks ``block_ids`` of every tensor from ``src`` to the same ids of ``dst`` (any devices):
    one batched gather and one batched scatter per tensor. ``layer`` (a global layer id): only
    that layer's tensors, as a push stages each layer once it is written (a cross-layer cache
    keeps every layer in one tensor, so it copies them all)."""
    if src.spec != dst.spec or src.num_blocks != dst.num_blocks:
        raise ValueError("copy_blocks: the two caches differ in spec or size")
    idx = _index(src, block_ids)
    if len(idx) == 0:
        return
    pairs = list(zip(src.tensors, dst.tensors, strict=True))
    if layer is not None and not src.spec.cross_layer:
        layers = src.spec.layers
        if layer not in layers:
            raise ValueError(f"copy_blocks: layer {layer} is not in this cache (layers {layers.start}.."
                             f"{layers.stop - 1})")
        per = len(pairs) // len(layers)
        i = layer - layers.start
        pairs = pairs[i * per : (i + 1) * per]
    cuda = src.device if src.device.type == "cuda" else dst.device
    crossing = {src.device.type, dst.device.type} == {"cpu", "cuda"}
    runs = _runs(idx) if crossing else []
    if crossing and len(runs) <= MAX_SLICE_RUNS:
        _copy_slices(pairs, runs, cuda)
    elif crossing and src.device.type == "cuda":
        _device_to_host(pairs, idx, cuda)
    elif crossing:
        _host_to_device(pairs, idx, cuda)
    else:
        for s, d in pairs:
            scatter_rows(d, idx, gather_rows(s, idx))
        for c in (src, dst):
            if c.device.type == "cuda":
                torch.cuda.synchronize(c.device)


def _runs(idx: torch.Tensor) -> list[tuple[int, int]]:
    """Block ids as sorted runs of consecutive ids, ``[(first, end), ...]``."""
    ids = np.unique(idx.numpy())
    breaks = np.flatnonzero(np.diff(ids) != 1) + 1
    firsts, lasts = ids[np.r_[0, breaks]], ids[np.r_[breaks - 1, len(ids) - 1]]
    return [(int(a), int(b) + 1) for a, b in zip(firsts, lasts, strict=True)]


def _copy_slices(pairs: list[tuple[torch.Tensor, torch.Tensor]], runs: list[tuple[int, int]],
                 device: torch.device) -> None:
    """Few runs of ids (a request of a few blocks, or contiguous ones): each run of each tensor
    straight from one cache into the other, all queued by one call, then one synchronize. A
    gather and a scatter per tensor cost tens of microseconds each in launches and views
    (measured on an H100 host, 1 block of the bench's 64-tensor cache: 3.7 ms that way)."""
    dsts = [d[a:b] for _, d in pairs for a, b in runs]
    srcs = [s[a:b] for s, _ in pairs for a, b in runs]
    torch._foreach_copy_(dsts, srcs, non_blocking=True)
    torch.cuda.synchronize(device)


def _staging(pairs: list[tuple[torch.Tensor, torch.Tensor]], n: int) -> list[torch.Tensor]:
    """One pinned host buffer for ``n`` blocks of every tensor, cut per tensor (torch's pinned
    allocator caches it: no pinning per call; its non-blocking copies are stream-ordered)."""
    sizes = [n * s[0].numel() * s.element_size() for s, _ in pairs]
    flat = torch.empty(sum(sizes), dtype=torch.uint8, pin_memory=True)
    return [flat.narrow(0, at, size) for at, size in zip(itertools.accumulate([0, *sizes[:-1]]), sizes, strict=True)]


def _device_to_host(pairs: list[tuple[torch.Tensor, torch.Tensor]], idx: torch.Tensor,
                    device: torch.device) -> None:
    """Gather on the GPU, one non-blocking copy per tensor into pinned staging, one synchronize,
    then a CPU scatter into the host cache. The block ids go to the GPU once, not per tensor."""
    ids = idx.to(device, non_blocking=True)
    bufs = _staging(pairs, len(idx))
    for (s, _), buf in zip(pairs, bufs, strict=True):
        packed = gather_rows(s, ids)
        buf.view(packed.dtype).view(packed.shape).copy_(packed, non_blocking=True)
    torch.cuda.synchronize(device)
    for (_, d), buf in zip(pairs, bufs, strict=True):  # torch's index_copy_: on every core of a GPU host
        rows = _wide(d.view(d.shape[0], -1).view(torch.uint8))
        rows.index_copy_(0, idx, buf.view(rows.dtype).view(len(idx), -1))


def _host_to_device(pairs: list[tuple[torch.Tensor, torch.Tensor]], idx: torch.Tensor,
                    device: torch.device) -> None:
    """A CPU gather into pinned staging, then per tensor a non-blocking copy and a scatter on the
    GPU; one synchronize at the end (the staging stays alive until then)."""
    ids = idx.to(device, non_blocking=True)
    bufs = _staging(pairs, len(idx))
    for (s, d), buf in zip(pairs, bufs, strict=True):
        packed = gather_rows(s, idx, out=buf.view(s.dtype).view((len(idx), *s.shape[1:])))
        scatter_rows(d, ids, packed.to(device, non_blocking=True))
    torch.cuda.synchronize(device)
