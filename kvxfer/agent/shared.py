"""Cache memory an engine and its transfer agent both map: no copy per transfer.

The engine's cache tensors move into shared memory once, at registration, in place: torch
swaps each storage's memory for a shared-memory file of the same bytes, so every view the
engine (or vLLM) already holds sees the shared pages. The agent maps the same files by
descriptor and builds its own tensors over them. Shared memory comes from /dev/shm (checked
for room first); on this kernel it has no transparent huge pages unless ``shmem_enabled``
allows them.

The agent's mapping starts with empty page tables: the first read or write of each 4 KiB page
through it would take a page fault inside the transfer (a data plane writing a block the agent
never touched, or a cma reader pinning the producer agent's pages). Measured here, a 2 MiB
block of 64 pieces copied with ``process_vm_readv`` into and out of such mappings: 1.1-1.2 ms,
against 0.47-0.49 ms once the page tables are filled. So the agent fills them at once, writable,
without touching a byte (``MADV_POPULATE_WRITE``, Linux 5.14), on a thread of its own so that
registration does not wait: the page tables cost 2 MiB per GiB of cache.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import mmap
import os
import time

import torch

from kvxfer.agent.messages import SharedTensor
from kvxfer.cache.spec import KVCacheSpec
from kvxfer.cache.tensors import KVCache
from kvxfer.threads import NamedThread

logger = logging.getLogger(__name__)


SHM = "/dev/shm"
MADV_POPULATE_WRITE = 23  # <linux/mman.h>, Linux 5.14
POPULATE_CHUNK = 64 << 20  # bytes per madvise call: the populating thread yields between them

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)  # CDLL: the GIL is released
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.madvise.restype = ctypes.c_int


def share_tensors(cache: KVCache) -> list[SharedTensor]:
    """Each tensor of ``cache`` as (memory file, offset, size); moves storages to shared memory
    (``cache.regions`` are described again at the new addresses)."""
    out = []
    moved = 0
    all_moved = True
    for name, t in zip(cache.names, cache.tensors, strict=True):
        if t.device.type != "cpu":
            raise ValueError(f"tensor {name}: a transfer agent maps host memory; this one is on {t.device} "
                             "(connector.host_staging stages it through a host mirror)")
    need = sum(t.untyped_storage().nbytes() for t in cache.tensors if not t.untyped_storage().is_shared())
    st = os.statvfs(SHM)
    if need > st.f_bavail * st.f_frsize:
        raise ValueError(f"the transfer agent needs the KV cache in shared memory: {need / 2**20:.0f} MiB, but "
                         f"{SHM} has {st.f_bavail * st.f_frsize / 2**20:.0f} MiB free; enlarge it (docker: "
                         "--shm-size) or set connector.data_path: engine")
    for name, t in zip(cache.names, cache.tensors, strict=True):
        storage = t.untyped_storage()
        if storage.is_shared():
            all_moved = False
        else:
            moved += storage.nbytes()
            storage.share_memory_()
        fd, size = storage._share_fd_cpu_()  # torch keeps the descriptor open while the storage lives
        offset = t.data_ptr() - storage.data_ptr()
        nbytes = t.numel() * t.element_size()
        if offset < 0 or offset + nbytes > size:
            raise ValueError(f"tensor {name}: {nbytes} bytes at offset {offset} lie outside its storage of {size}")
        out.append(SharedTensor(fd=fd, offset=offset, nbytes=nbytes, shape=list(t.shape)))
    if moved and all_moved:  # the anonymous mappings the tensors lived in are no longer used: free them
        cache._buffers = []
    cache.regions = [cache._region(i, t) for i, t in enumerate(cache.tensors)]
    if moved:
        logger.info("moved %.1f MiB of KV cache into shared memory for the transfer agent", moved / 2**20)
    return out


def map_cache(spec: KVCacheSpec, num_blocks: int, tensors: list[SharedTensor]) -> KVCache:
    """The agent's view of the engine's cache: tensors over the same shared memory."""
    views: list[torch.Tensor] = []
    buffers: list[object] = []
    by_file: dict[tuple[int, int], mmap.mmap] = {}  # tensors of one storage (vLLM's layers) share one mapping
    for st in tensors:
        info = os.fstat(st.fd)
        size = info.st_size
        if st.offset + st.nbytes > size:
            raise ValueError(f"shared tensor: {st.nbytes} bytes at {st.offset} exceed its memory file of {size}")
        buf = by_file.get((info.st_dev, info.st_ino))
        if buf is None:
            buf = by_file[(info.st_dev, info.st_ino)] = mmap.mmap(st.fd, size, flags=mmap.MAP_SHARED,
                                                                  prot=mmap.PROT_READ | mmap.PROT_WRITE)
            buffers.append(buf)
        raw = torch.frombuffer(buf, dtype=torch.uint8)[st.offset:st.offset + st.nbytes]
        views.append(raw.view(spec.torch_dtype).view(st.shape))
    cache = KVCache(spec=spec, num_blocks=num_blocks, tensors=views, names=[])
    cache._buffers = buffers
    if buffers:
        NamedThread(target=_populate_or_report, args=(buffers,), name="kvxfer-populate", daemon=True).start()
    return cache


def _populate_or_report(buffers: list[mmap.mmap]) -> None:
    """The populating thread: any failure is logged once; pages then fault in on first use, as before."""
    try:
        populate(buffers)
    except Exception as e:
        logger.warning("the transfer agent's cache mapping is not prefaulted (%s: %s); its pages fault in on "
                       "first use", type(e).__name__, e)


def populate(buffers: list[mmap.mmap]) -> int:
    """Fill the page tables of ``buffers`` (writable, no byte touched; see the module doc);
    returns the bytes populated. A kernel without ``MADV_POPULATE_WRITE`` leaves the pages to
    fault in on first use, as before (logged once). The mappings live as long as the agent."""
    t0 = time.monotonic()
    done = 0
    for buf in buffers:
        base = ctypes.addressof(ctypes.c_char.from_buffer(buf))
        for at in range(0, len(buf), POPULATE_CHUNK):
            n = min(POPULATE_CHUNK, len(buf) - at)
            if _libc.madvise(base + at, n, MADV_POPULATE_WRITE) != 0:
                err = ctypes.get_errno()
                logger.info("the transfer agent's cache mapping is not prefaulted (madvise: %s); its pages fault "
                            "in on first use", os.strerror(err))
                return done
            done += n
    logger.debug("prefaulted %.1f MiB of the cache mapping in %.2f s", done / 2**20, time.monotonic() - t0)
    return done
