"""Other KV transfer engines measured beside kvxfer in the same run, when installed
(``pip install 'kvxfer[peers]'``): NIXL (UCX backend, DRAM to DRAM, one agent per process)
and Mooncake's transfer engine (TCP, P2P handshake).

Each peer has a producer half, which registers the producer's cache tensors and returns
what the consumer needs to reach them (msgspec-encodable), and a consumer half, which
registers the consumer's cache and reads a descriptor list (remote region, remote offset,
local region, local offset, length) into it.
"""

from __future__ import annotations

import importlib
import logging
import time
from typing import Any

import numpy as np
import torch

logger = logging.getLogger(__name__)

PEERS = ("nixl", "mooncake")
_MODULES = {"nixl": "nixl_cu12._api", "mooncake": "mooncake.engine"}


def missing_reason(name: str) -> str | None:
    """None when peer ``name`` can run here; else why not (for the table)."""
    try:
        importlib.import_module(_MODULES[name])
    except Exception as e:  # ImportError, or a missing system library (OSError inside the import)
        return f"not installed ({type(e).__name__}: {str(e)[:80]}); pip install 'kvxfer[peers]'"
    return None


def _bases(tensors: list[torch.Tensor]) -> list[int]:
    return [t.data_ptr() for t in tensors]


class NixlProducer:
    def __init__(self, tensors: list[torch.Tensor]) -> None:
        from nixl_cu12._api import nixl_agent, nixl_agent_config

        self.agent = nixl_agent("kvxfer-bench-producer", nixl_agent_config(backends=["UCX"]))
        self.agent.register_memory([(t.data_ptr(), t.numel() * t.element_size(), 0, "") for t in tensors], "DRAM")
        self.info = {"metadata": self.agent.get_agent_metadata(), "bases": _bases(tensors)}


class NixlConsumer:
    def __init__(self, tensors: list[torch.Tensor], info: dict[str, Any]) -> None:
        from nixl_cu12._api import nixl_agent, nixl_agent_config

        self.agent = nixl_agent("kvxfer-bench-consumer", nixl_agent_config(backends=["UCX"]))
        self.agent.register_memory([(t.data_ptr(), t.numel() * t.element_size(), 0, "") for t in tensors], "DRAM")
        self.remote = self.agent.add_remote_agent(info["metadata"])
        self.remote_bases = np.asarray(info["bases"], dtype=np.int64)
        self.local_bases = np.asarray(_bases(tensors), dtype=np.int64)

    def read(self, rr: np.ndarray, ro: np.ndarray, lr: np.ndarray, lo: np.ndarray, ln: np.ndarray,
             timeout_s: float = 120.0) -> None:
        zeros = np.zeros_like(ln)
        local = np.stack([self.local_bases[lr] + lo, ln, zeros], axis=1)
        remote = np.stack([self.remote_bases[rr] + ro, ln, zeros], axis=1)
        handle = self.agent.initialize_xfer("READ", self.agent.get_xfer_descs(local, "DRAM"),
                                            self.agent.get_xfer_descs(remote, "DRAM"), self.remote)
        try:
            state = self.agent.transfer(handle)
            deadline = time.monotonic() + timeout_s
            while state == "PROC":
                if time.monotonic() > deadline:
                    raise TimeoutError(f"nixl: read not done in {timeout_s:g}s")
                state = self.agent.check_xfer_state(handle)
            if state != "DONE":
                raise RuntimeError(f"nixl: transfer state {state}")
        finally:
            self.agent.release_xfer_handle(handle)


class MooncakeProducer:
    def __init__(self, tensors: list[torch.Tensor]) -> None:
        from mooncake.engine import TransferEngine

        self.engine = TransferEngine()
        if self.engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", ""):
            raise RuntimeError("mooncake: initialize failed")
        for t in tensors:
            if self.engine.register_memory(t.data_ptr(), t.numel() * t.element_size()):
                raise RuntimeError("mooncake: register_memory failed")
        self.info = {"target": f"127.0.0.1:{self.engine.get_rpc_port()}", "bases": _bases(tensors)}


class MooncakeConsumer:
    def __init__(self, tensors: list[torch.Tensor], info: dict[str, Any]) -> None:
        from mooncake.engine import TransferEngine

        self.engine = TransferEngine()
        if self.engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", ""):
            raise RuntimeError("mooncake: initialize failed")
        for t in tensors:
            if self.engine.register_memory(t.data_ptr(), t.numel() * t.element_size()):
                raise RuntimeError("mooncake: register_memory failed")
        self.target = info["target"]
        self.remote_bases = np.asarray(info["bases"], dtype=np.int64)
        self.local_bases = np.asarray(_bases(tensors), dtype=np.int64)

    def read(self, rr: np.ndarray, ro: np.ndarray, lr: np.ndarray, lo: np.ndarray, ln: np.ndarray,
             timeout_s: float = 120.0) -> None:
        rc = self.engine.batch_transfer_sync_read(self.target, (self.local_bases[lr] + lo).tolist(),
                                                  (self.remote_bases[rr] + ro).tolist(), ln.tolist())
        if rc:
            raise RuntimeError(f"mooncake: batch read failed ({rc})")


PRODUCERS = {"nixl": NixlProducer, "mooncake": MooncakeProducer}
CONSUMERS = {"nixl": NixlConsumer, "mooncake": MooncakeConsumer}
