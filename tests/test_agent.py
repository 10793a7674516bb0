"""The transfer agent: a rank's data path in a process of its own, driven through the public
``Connector`` API. Real agent processes, real sockets; faults injected by signalling the agent."""

from __future__ import annotations

import math
import os
import resource
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch
from test_gil_kept import gil_turns

from kvxfer.agent import client as agent_client
from kvxfer.agent.client import AgentConnector
from kvxfer.agent.messages import StartLoad
from kvxfer.agent.priority import nice_refusal
from kvxfer.cache import KVCache, allocate_kv_cache, spec_from_config
from kvxfer.config import (
    CacheConfig,
    ConnectorConfig,
    InstanceConfig,
    ModelConfig,
    SideChannelConfig,
    TimeoutsConfig,
    convert,
)
from kvxfer.connector import Connector, EngineConnector
from kvxfer.protocol import ErrorCode
from kvxfer.transfer.aggregator import Finished

NB = 64


def cfg(role: str, plane: str = "tcp", transfer_s: float = 10.0, hold_wait_s: float = 1.0,
        data_path: str = "auto", host_staging: str = "auto", gil_switch_interval_s: float = 0.0005) -> InstanceConfig:
    return InstanceConfig(
        role=role, engine_id=f"agent-{role}",
        model=ModelConfig(num_layers=3, num_kv_heads=2, num_heads=4, head_size=16),
        cache=CacheConfig(block_size=16, num_blocks=NB),
        connector=ConnectorConfig(
            name=plane, side_channel=SideChannelConfig(host="127.0.0.1", port=0), data_path=data_path,
            host_staging=host_staging, gil_switch_interval_s=gil_switch_interval_s,
            # the ucx plane on UCX's own wire (its default reads this host's producers with CMA)
            data_plane={"same_host": "ucx"} if plane == "ucx" else {},
            timeouts=TimeoutsConfig(handshake_s=5.0, handshake_retries=1, transfer_s=transfer_s,
                                    hold_wait_s=hold_wait_s)),
    )


def make(c: InstanceConfig, fill: int | None = None) -> tuple[EngineConnector, list[torch.Tensor]]:
    conn = Connector.from_config(c)
    cache = allocate_kv_cache(spec_from_config(c), NB)
    if fill is not None:
        for i, t in enumerate(cache.tensors):
            t.view(-1).view(torch.uint8).copy_(torch.randint(0, 256, (t.numel() * t.element_size(),),
                                                             generator=torch.Generator().manual_seed(fill + i),
                                                             dtype=torch.uint8))
    conn.register_kv_caches(cache)
    return conn, cache.tensors


def wait_for(conn: EngineConnector, rid: str, timeout_s: float = 30.0) -> Finished:
    deadline = time.monotonic() + timeout_s
    out = Finished()
    while time.monotonic() < deadline:
        out.extend(conn.poll(0.05))
        if rid in out.receiving or rid in out.failed:
            return out
    raise AssertionError(f"{rid} neither finished nor failed in {timeout_s} s")


def released(p: EngineConnector, rids: list[str], timeout_s: float = 10.0) -> list[str]:
    """The holds ``p``'s polls report released, until all of ``rids`` are (or ``timeout_s`` passed), sorted."""
    deadline = time.monotonic() + timeout_s
    sent: list[str] = []
    while sorted(sent) != sorted(rids) and time.monotonic() < deadline:
        sent += p.poll(0.05).sending
    return sorted(sent)


@contextmanager
def pair_of(pc: InstanceConfig, dc: InstanceConfig) -> Iterator[tuple[EngineConnector, list[torch.Tensor],
                                                                      EngineConnector, list[torch.Tensor]]]:
    """A producer (its cache filled) and a consumer with these configs, closed after."""
    p, pt = make(pc, fill=1)
    try:
        c, ct = make(dc)
        try:
            yield p, pt, c, ct
        finally:
            c.close()
    finally:
        p.close()


@pytest.fixture
def pair(request: pytest.FixtureRequest) -> Iterator[tuple[EngineConnector, list[torch.Tensor],
                                                           EngineConnector, list[torch.Tensor]]]:
    plane = getattr(request, "param", "tcp")
    p, pt = make(cfg("prefill", plane), fill=1)
    c, ct = make(cfg("decode", plane))
    yield p, pt, c, ct
    c.close()
    p.close()


@pytest.mark.parametrize("pair", ["tcp", "cma", "ucx"], indirect=True)
def test_an_agent_moves_the_bytes_bit_exact_in_another_process(pair: tuple) -> None:
    p, pt, c, ct = pair
    assert isinstance(c, AgentConnector) and isinstance(p, AgentConnector)
    assert c.process is not None and c.process.pid != os.getpid()
    src, dst = [5, 9, 10, 11, 40], [60, 2, 3, 4, 17]
    params = p.hold("r1", src, 5 * 16)
    c.start_load("r1", params, dst)
    out = wait_for(c, "r1")
    assert out.receiving == ["r1"], out.errors
    for a, b in zip(pt, ct, strict=True):
        assert torch.equal(a[src].view(torch.uint8), b[dst].view(torch.uint8))
    s = c.stats()
    assert s["loads_ok"] == 1 and s["bytes_received"] > 0 and s["broken"] == 0
    assert released(p, ["r1"]) == ["r1"]  # the producer's hold came back through its agent's events


def test_bad_input_is_refused_by_name_and_changes_nothing(pair: tuple) -> None:
    p, pt, c, ct = pair
    with pytest.raises(ValueError, match="need 2 blocks"):
        p.hold("r1", [1], 20)
    with pytest.raises(ValueError, match=r"block ids must be in \[0, 64\)"):
        p.hold("r1", [1, 999], 20)
    params = p.hold("r1", [1, 2], 32)
    with pytest.raises(ValueError, match="already held"):
        p.hold("r1", [3, 4], 32)
    with pytest.raises(ValueError, match=r"local block ids must be in \[0, 64\)"):
        c.start_load("r1", params, [0, 100])
    c.start_load("r1", params, [7, 8])  # the refused call changed nothing
    assert wait_for(c, "r1").receiving == ["r1"]
    for a, b in zip(pt, ct, strict=True):
        assert torch.equal(a[[1, 2]].view(torch.uint8), b[[7, 8]].view(torch.uint8))


@pytest.mark.parametrize("staging", ["never", "always"])
def test_save_layer_is_one_way_but_checks_its_arguments_and_pushes_bit_exact(staging: str) -> None:
    """save_layer is not answered by the agent (a send per layer, no round trip); bad arguments
    are still refused by name here, and the layers sent after them land bit-exact. Staged (the
    engine's cache stands in for a device cache): each save copies its own layer to the host
    mirror, and the engine's own tensors arrive whole."""
    with pair_of(cfg("prefill", host_staging=staging), cfg("decode", host_staging=staging)) as pair:
        _save_layer_case(*pair)


def _save_layer_case(p: EngineConnector, pt: list[torch.Tensor], c: EngineConnector, ct: list[torch.Tensor]) -> None:
    with pytest.raises(ValueError, match="not a streaming hold"):
        p.save_layer("nobody", 0)
    p.hold("pull-only", [5], 16)
    with pytest.raises(ValueError, match="not a streaming hold"):
        p.save_layer("pull-only", 0)  # a pull hold has no layers to save
    p.hold("r1", [1, 2], 32, streaming=True)
    with pytest.raises(ValueError, match=r"layer 3 is not on this rank \(layers 0..2\)"):
        p.save_layer("r1", 3)
    target = c.reserve("d1", [7, 8], 32)
    p.push("r1", target)
    for layer in range(3):
        p.save_layer("r1", layer)
    deadline = time.monotonic() + 30
    out = Finished()
    while "d1" not in out.receiving and not out.failed and time.monotonic() < deadline:
        out.extend(c.poll(0.05))
    landed = sorted(out.layers.get("d1", []))
    assert out.receiving == ["d1"] and landed == [0, 1, 2], (out.failed, out.errors)
    for a, b in zip(pt, ct, strict=True):
        assert torch.equal(a[[1, 2]].view(torch.uint8), b[[7, 8]].view(torch.uint8))


def test_a_killed_agent_fails_its_loads_with_their_blocks_and_reports_broken(pair: tuple) -> None:
    p, _, c, _ = pair
    assert isinstance(c, AgentConnector) and c.process is not None
    params = p.hold("r1", [1, 2], 20)
    p.release("r1")  # not held: the consumer retries for hold_wait_s, so the load is in flight
    c.start_load("r1", params, [7, 8])
    c.process.send_signal(signal.SIGKILL)
    t0 = time.monotonic()
    out = wait_for(c, "r1", timeout_s=15)
    assert out.failed == {"r1": [7, 8]}
    assert out.codes["r1"] == ErrorCode.PLANE_BROKEN and "transfer agent" in out.errors["r1"]
    assert time.monotonic() - t0 < 10
    assert c.broken is not None and c.stats()["broken"] == 1
    c.start_load("r2", params, [9, 10])  # a broken rank fails every later load at once
    assert wait_for(c, "r2", timeout_s=2).failed == {"r2": [9, 10]}
    c.wait("r3", params)  # the request path goes on: nothing to renew or abandon through a dead agent
    c.abandon("r3", params)


def test_a_hung_agent_is_killed_and_its_loads_fail(monkeypatch: pytest.MonkeyPatch) -> None:
    """start_load is one-way: a stopped agent does not stop the engine's thread; the load it
    never finishes fails with its block ids AGENT_GRACE_S past its deadline, the agent killed."""
    monkeypatch.setattr(agent_client, "AGENT_GRACE_S", 1.0)
    p, _ = make(cfg("prefill"), fill=1)
    c, _ = make(cfg("decode", transfer_s=1.0, hold_wait_s=0.5))
    try:
        assert isinstance(c, AgentConnector) and c.process is not None
        params = p.hold("r1", [1], 10)
        c.process.send_signal(signal.SIGSTOP)  # a stopped agent reads no command ...
        t0 = time.monotonic()
        c.start_load("r1", params, [3])
        assert time.monotonic() - t0 < 1.0, "start_load waited for the agent"
        out = wait_for(c, "r1", timeout_s=10)  # ... so it is killed, and the load fails with its block
        assert out.failed == {"r1": [3]} and "past its deadline" in out.errors["r1"]
        assert time.monotonic() - t0 >= 2.0  # transfer_s + AGENT_GRACE_S: not before
        assert c.process.poll() is not None and c.broken is not None
    finally:
        c.close()
        p.close()


def test_a_one_way_load_the_agent_refuses_fails_at_poll_with_its_blocks(pair: tuple) -> None:
    """The engine checks a load before it sends it one-way; a load the agent refuses all the same
    (sent here past the engine's checks, as a bug there would) is reported failed, not lost."""
    p, _, c, _ = pair
    assert isinstance(c, AgentConnector)
    params = p.hold("r1", [1, 2], 32)
    with c._lock:
        c._loads["bad"] = agent_client._Load(np.array([5, 999]), time.monotonic() + 10)
    c._send_only(StartLoad("bad", params, [5, 999], 0))  # 999 is past the cache's 64 blocks
    out = wait_for(c, "bad", timeout_s=10)
    assert out.failed == {"bad": [5, 999]} and out.codes["bad"] is ErrorCode.BAD_PARAMS
    assert "must be in [0, 64)" in out.errors["bad"]
    c.start_load("r1", params, [7, 8])  # the agent goes on
    assert wait_for(c, "r1").receiving == ["r1"]


def test_an_agent_exits_when_its_engine_dies() -> None:
    script = textwrap.dedent("""
        import os, sys
        sys.path.insert(0, sys.argv[1])
        from test_agent import cfg, make
        conn, _ = make(cfg("decode"))
        print(conn.process.pid, flush=True)
        os._exit(0)  # no close: the engine dies
    """)
    out = subprocess.run([sys.executable, "-c", script, os.path.dirname(__file__)], capture_output=True,
                         text=True, timeout=120)
    pid = int(out.stdout.split()[0])
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    os.kill(pid, signal.SIGKILL)
    raise AssertionError("the agent outlived its engine")


def test_an_agents_threads_carry_their_names_into_the_kernel() -> None:
    """For traces (`top -H`, `perf sched`): the agent's threads carry kvxfer's names."""
    c, _ = make(cfg("decode", "ucx"))
    try:
        assert c.process is not None
        names = set()
        for tid in os.listdir(f"/proc/{c.process.pid}/task"):
            with open(f"/proc/{c.process.pid}/task/{tid}/comm") as f:
                names.add(f.read().strip())
        assert {"kvxfer-ucx", "kvxfer-ucx-cont"} <= names, names  # the plane's loop and control threads
    finally:
        c.close()


def _cpus_of(pid: int) -> dict[int, set[int]]:
    """Every thread of ``pid``: the CPUs it may run on."""
    return {int(t): os.sched_getaffinity(int(t)) for t in os.listdir(f"/proc/{pid}/task")}


@pytest.mark.parametrize("agent_cpus", ["engine", "any"])
def test_an_agent_runs_on_its_engine_threads_cpus_without_its_openmp_binding(
        agent_cpus: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's CPU worker pins its thread and sets OpenMP's binding; its agent keeps that thread's CPUs
    (``engine``: the share the kernel gives its engine's session is there) or takes any (``any``),
    and never the binding, which would pin the agent's main thread to the first place."""
    allowed = os.sched_getaffinity(0)
    if len(allowed) < 2:
        pytest.skip("needs two CPUs")
    one = {max(allowed)}
    monkeypatch.setenv("OMP_PLACES", f"{{{min(allowed)}}}")
    monkeypatch.setenv("OMP_PROC_BIND", "true")
    c = cfg("decode", "ucx")
    c = msgspec.structs.replace(c, connector=msgspec.structs.replace(c.connector, agent_cpus=agent_cpus))
    started: list[EngineConnector] = []

    def worker() -> None:  # as vLLM's worker thread: pinned, then registers its cache
        os.sched_setaffinity(0, one)
        started.append(make(c)[0])

    t = threading.Thread(target=worker)
    t.start()
    t.join(60)
    assert started, "the agent did not start"
    conn = started[0]
    try:
        assert isinstance(conn, AgentConnector) and conn.process is not None
        want = one if agent_cpus == "engine" else allowed
        cpus = _cpus_of(conn.process.pid)
        assert len(cpus) > 2 and all(m == want for m in cpus.values()), (want, cpus)
        with open(f"/proc/{conn.process.pid}/environ", "rb") as f:
            env = f.read().split(b"\0")
        assert not any(v.startswith((b"OMP_PLACES=", b"OMP_PROC_BIND=")) for v in env)
        assert os.sched_getaffinity(0) == allowed, "the engine's other threads keep their CPUs"
    finally:
        conn.close()


def _nice_of(pid: int) -> dict[int, int]:
    """Every thread of ``pid``: its nice value (field 19 of its stat)."""
    out = {}
    for t in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{t}/stat") as f:
            out[int(t)] = int(f.read().rsplit(")", 1)[1].split()[16])
    return out


def test_every_thread_of_an_agent_runs_at_its_agent_nice_and_the_engine_keeps_its_own() -> None:
    """connector.agent_nice: the agent's threads, those started before the setting and after it,
    all run at that nice value; the engine's process is left as it was. A positive value needs no
    privilege, so this holds for any user."""
    before = _nice_of(os.getpid())
    c = cfg("decode", "tcp")
    c = msgspec.structs.replace(c, connector=msgspec.structs.replace(c.connector, agent_nice=7))
    conn, _ = make(c)
    try:
        assert isinstance(conn, AgentConnector) and conn.process is not None
        nice = _nice_of(conn.process.pid)
        assert len(nice) > 2 and set(nice.values()) == {7}, nice
        assert set(_nice_of(os.getpid()).values()) == set(before.values())
    finally:
        conn.close()


@pytest.mark.skipif(not Path("/usr/bin/setpriv").exists(), reason="needs setpriv (util-linux) to drop CAP_SYS_NICE")
def test_an_agent_nice_the_kernel_refuses_fails_the_registration_by_name(tmp_path: Path) -> None:
    """A negative agent_nice without CAP_SYS_NICE (dropped here from the bounding set, so root
    loses it too) and with RLIMIT_NICE at 0: register_kv_caches raises a ValueError that names
    the option, no agent process is left, and the bench skips its nice rows saying why."""
    script = tmp_path / "engine.py"
    script.write_text(textwrap.dedent(f"""
        import os, resource, sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        import msgspec
        from test_agent import cfg, make
        from kvxfer.bench.transfer import _unusable
        resource.setrlimit(resource.RLIMIT_NICE, (0, 0))
        c = cfg("decode", "tcp")
        c = msgspec.structs.replace(c, connector=msgspec.structs.replace(c.connector, agent_nice=-5))
        try:
            make(c)
        except ValueError as e:
            print("REFUSED", e)
        else:
            print("STARTED")
            sys.exit(1)
        children = [p for t in os.listdir("/proc/self/task")
                    for p in open(f"/proc/self/task/{{t}}/children").read().split()]
        print("CHILDREN", children)
        print("BENCH", _unusable("tcp-nice", None))
    """))
    drop = ["/usr/bin/setpriv", "--bounding-set", "-sys_nice", "--inh-caps", "-sys_nice", "true"]
    prefix = drop[:-1]
    if subprocess.run(drop, capture_output=True).returncode != 0:  # not root: no CAP_SYS_NICE to drop, as a rule
        if nice_refusal(-5) is None and resource.getrlimit(resource.RLIMIT_NICE)[0] < 25:  # CAP_SYS_NICE: kept
            pytest.skip("this user has CAP_SYS_NICE and setpriv cannot drop it")
        prefix = []
    out = subprocess.run([*prefix, sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "REFUSED rank 0: transfer agent: connector.agent_nice: -5" in out.stdout, out.stdout
    assert "RLIMIT_NICE >= 25" in out.stdout, out.stdout
    assert "CHILDREN []" in out.stdout, out.stdout
    assert "BENCH connector.agent_nice: -10 is refused" in out.stdout, out.stdout


def test_agent_nice_out_of_range_or_without_an_agent_is_refused_by_name() -> None:
    with pytest.raises(Exception, match=r"connector\.agent_nice"):
        convert({"role": "decode", "engine_id": "x", "connector": {"agent_nice": -21}}, InstanceConfig)
    c = cfg("decode", "tcp", data_path="engine")
    c = msgspec.structs.replace(c, connector=msgspec.structs.replace(c.connector, agent_nice=-5))
    with pytest.raises(ValueError, match=r"connector\.agent_nice: -5 .*data_path: engine"):
        Connector.from_config(c)
    c = cfg("decode", "local")  # auto: local runs in the engine's process, so no agent to set
    c = msgspec.structs.replace(c, connector=msgspec.structs.replace(c.connector, agent_nice=3))
    with pytest.raises(ValueError, match=r"connector\.agent_nice: 3 .*data_path: auto, plane 'local'"):
        Connector.from_config(c)


def test_where_the_data_path_runs_is_chosen_by_config() -> None:
    c = Connector.from_config(cfg("decode", plane="local"))  # auto: local reaches only its own process
    assert isinstance(c, Connector)
    c.close()
    assert isinstance(Connector.from_config(cfg("decode", data_path="engine")), Connector)
    with pytest.raises(ValueError, match="data_path: agent, but the 'local' data plane"):
        Connector.from_config(cfg("decode", plane="local", data_path="agent"))


def test_a_staged_cache_goes_through_the_agent_bit_exact() -> None:
    p, pt = make(cfg("prefill", host_staging="always"), fill=3)
    c, ct = make(cfg("decode", host_staging="always"))
    try:
        params = p.hold("r1", [4, 5], 32)
        c.start_load("r1", params, [50, 51])
        assert wait_for(c, "r1").receiving == ["r1"]
        for a, b in zip(pt, ct, strict=True):  # the engine's own tensors, not the agent's mirror
            assert torch.equal(a[[4, 5]].view(torch.uint8), b[[50, 51]].view(torch.uint8))
    finally:
        c.close()
        p.close()


def test_config_round_trips_to_the_agent() -> None:
    c = cfg("decode")
    assert msgspec.convert(msgspec.to_builtins(c), InstanceConfig) == c


def test_a_dead_producer_agent_frees_its_holds_through_poll(pair: tuple) -> None:
    p, _, _, _ = pair
    assert isinstance(p, AgentConnector) and p.process is not None
    p.hold("h1", [1, 2], 32)
    p.hold("h2", [3], 16)
    p.process.send_signal(signal.SIGKILL)
    assert released(p, ["h1", "h2"], 15) == ["h1", "h2"]  # nobody can read them any more: the engine frees the blocks
    assert p.broken is not None and "transfer agent" in p.broken


def test_too_little_shared_memory_is_refused_by_name_before_anything_moves(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvxfer.agent import shared

    real = os.statvfs

    class Tiny:
        f_bavail, f_frsize = 16, 4096

    monkeypatch.setattr(shared.os, "statvfs", lambda path: Tiny() if path == shared.SHM else real(path))
    c = Connector.from_config(cfg("decode"))
    cache = allocate_kv_cache(spec_from_config(cfg("decode")), NB)
    with pytest.raises(ValueError, match=r"/dev/shm has 0 MiB free.*connector.data_path: engine"):
        c.register_kv_caches(cache)
    assert not any(t.untyped_storage().is_shared() for t in cache.tensors)  # nothing moved
    assert isinstance(c, AgentConnector) and c.process is None
    c.close()


@pytest.mark.parametrize("pair", ["cma", "tcp"], indirect=True)
def test_many_loads_in_flight_at_once_arrive_bit_exact(pair: tuple) -> None:
    """cma sends every queued read's grant request at once (pipelined); tcp splits over streams."""
    p, pt, c, ct = pair
    n = 16
    params = [p.hold(f"m{i}", [2 * i, 2 * i + 1], 32) for i in range(n)]
    for i in range(n):
        c.start_load(f"m{i}", params[i], [63 - 2 * i, 62 - 2 * i])
    done: set[str] = set()
    deadline = time.monotonic() + 30
    while len(done) < n and time.monotonic() < deadline:
        f = c.poll(0.05)
        assert not f.failed, f.errors
        done.update(f.receiving)
    assert done == {f"m{i}" for i in range(n)}
    for i in range(n):
        for a, b in zip(pt, ct, strict=True):
            assert torch.equal(a[[2 * i, 2 * i + 1]].view(torch.uint8), b[[63 - 2 * i, 62 - 2 * i]].view(torch.uint8))


def test_channel_has_next_says_whether_a_whole_message_waits_without_taking_it() -> None:
    """The agent sends a burst's events once, after its last StartLoad: ``has_next`` must not
    count half a frame as a message, nor lose one it read ahead."""
    import socket

    from kvxfer.agent.channel import Channel, ChannelClosed
    from kvxfer.agent.messages import Command, Release

    a, b = socket.socketpair()
    reader, writer = Channel(a, Command), Channel(b, Command)
    assert not reader.has_next()
    load = Release(request_id="r")
    whole = msgspec.msgpack.encode(load)
    b.sendall(len(whole).to_bytes(4, "little") + whole[:3])  # half a frame
    assert not reader.has_next()
    b.sendall(whole[3:])
    writer.send(load)
    assert reader.has_next()
    assert reader.recv(1.0) == load
    assert reader.has_next()  # the second one was read ahead into the buffer
    assert reader.recv(1.0) == load
    assert not reader.has_next()
    writer.close()
    assert reader.has_next()  # the close is news too: the next recv raises it
    with pytest.raises(ChannelClosed):
        reader.recv(1.0)
    reader.close()


def _mapped_rss(address: int) -> int:
    """Bytes of the mapping holding ``address`` that this process's page tables map (smaps' Rss)."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    for i, line in enumerate(lines):
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            if lo <= address < hi:
                rss = next(ln for ln in lines[i + 1:] if ln.startswith("Rss:"))
                return int(rss.split()[1]) * 1024
    raise AssertionError(f"no mapping holds {address:#x}")


def test_the_agents_view_of_the_cache_is_prefaulted_without_changing_a_byte() -> None:
    """A data plane in the agent writes and reads the cache through the agent's own mapping of it; map_cache's
    thread fills its page tables at once, so a transfer takes no page fault per 4 KiB page (the engine's bytes
    kept)."""
    import ctypes
    import mmap

    from kvxfer.agent import shared

    probe = mmap.mmap(-1, 4096)
    if shared._libc.madvise(ctypes.addressof(ctypes.c_char.from_buffer(probe)), 4096, shared.MADV_POPULATE_WRITE):
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux 5.14): the agent's pages fault in on first use")
    c = cfg("decode")
    cache = allocate_kv_cache(spec_from_config(c), NB)
    for i, t in enumerate(cache.tensors):
        t.view(-1).view(torch.uint8).copy_(torch.randint(0, 256, (t.numel() * t.element_size(),),
                                                         generator=torch.Generator().manual_seed(i),
                                                         dtype=torch.uint8))
    before = [t.view(-1).view(torch.uint8).clone() for t in cache.tensors]  # random bytes: NaNs as floats
    tensors = shared.share_tensors(cache)
    view = shared.map_cache(spec_from_config(c), NB, tensors)  # starts the populating thread
    buffers = view._buffers
    assert buffers and all(isinstance(b, mmap.mmap) for b in buffers)
    addr = [ctypes.addressof(ctypes.c_char.from_buffer(b)) for b in buffers]
    assert all(any(a <= t.data_ptr() < a + len(b) for a, b in zip(addr, buffers, strict=True))
               for t in view.tensors), "every tensor lies in a mapping populated"
    deadline = time.monotonic() + 30
    while any(_mapped_rss(a) < len(b) // 4096 * 4096 for a, b in zip(addr, buffers, strict=True)):
        assert time.monotonic() < deadline, "the agent's mapping was not prefaulted within 30 s"
        time.sleep(0.02)
    for v, t, b in zip(view.tensors, cache.tensors, before, strict=True):
        # nothing written: the engine's bytes, seen through both
        assert torch.equal(v.reshape(-1).view(torch.uint8), b) and torch.equal(t.reshape(-1).view(torch.uint8), b)


def test_tensors_of_one_storage_are_mapped_once_by_the_agent() -> None:
    """vLLM's layers are views of one storage: the agent maps that memory file once (not once per
    layer, each mapping the whole file and populated in full), and each view sees its own bytes."""
    from kvxfer.agent import shared

    c = cfg("decode")
    spec = spec_from_config(c)
    shapes = [shape for _, shape in spec.tensor_shapes(NB)]
    sizes = [math.prod(shape) for shape in shapes]
    whole = torch.randint(0, 100, (sum(sizes),), generator=torch.Generator().manual_seed(5)).to(spec.torch_dtype)
    parts = [p.view(shape) for p, shape in zip(whole.split(sizes), shapes, strict=True)]
    cache = KVCache(spec=spec, num_blocks=NB, tensors=parts, names=[f"t{i}" for i in range(len(parts))])
    tensors = shared.share_tensors(cache)
    view = shared.map_cache(spec, NB, tensors)
    assert len(view._buffers) == 1 < len(parts)
    for v, t in zip(view.tensors, cache.tensors, strict=True):
        assert torch.equal(v, t) and v.data_ptr() != t.data_ptr()


def test_a_busy_polling_engine_offers_its_core_while_its_loads_are_in_flight(
        pair: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    """poll() in a tight loop (as NIXL's callers wait) would keep the engine's core from the agent
    that does its loads: an empty non-blocking poll with loads in flight yields the CPU; one with
    nothing in flight, or one that waits, does not."""
    p, _, c, _ = pair
    yields: list[int] = []
    monkeypatch.setattr(agent_client, "_sched_yield", lambda: yields.append(1))
    for _ in range(5):
        c.poll()
    assert yields == [], "nothing in flight: no reason to yield"
    params = p.hold("r1", [1, 2], 20)
    p.release("r1")  # not held: the consumer retries for hold_wait_s, so the load stays in flight
    c.start_load("r1", params, [7, 8])
    c.poll(0.01)
    assert yields == [], "a poll that waits gives the core up already"
    for _ in range(5):
        c.poll()
    assert len(yields) >= 4  # one poll may have found the load failed


@pytest.mark.parametrize("plane", ["tcp", "cma"])
def test_start_load_and_the_polls_that_see_it_finish_keep_the_gil(plane: str) -> None:
    """With a transfer agent the engine's thread spends no GIL hand-off on a load: every byte moves
    in the agent, and ``start_load`` and a tight ``poll()`` loop never release the GIL (a busy thread
    of the engine would keep it for a switch interval once given it). A thread that runs only when
    the GIL is free (forced switches 60 s apart) gets no turn during 20 loads. The connector's short
    switch interval while loads are in flight (gil_switch_interval_s) forces switches on purpose, so
    it is off here: this counts the releases the engine's thread would make itself."""
    with pair_of(cfg("prefill", plane), cfg("decode", plane, gil_switch_interval_s=0.0)) as pair:
        _keeps_the_gil(*pair)


def _keeps_the_gil(p: EngineConnector, pt: list[torch.Tensor], c: EngineConnector, ct: list[torch.Tensor]) -> None:
    assert isinstance(c, AgentConnector)
    first = p.hold("r0", [1], 16)
    c.start_load("r0", first, [2])  # the first load handshakes
    assert wait_for(c, "r0").receiving == ["r0"]
    params = [p.hold(f"r{i}", [i + 1], 16) for i in range(1, 21)]  # round trips: made before the count
    with gil_turns() as ticks:
        before, outs = ticks[0], []
        for i, pr in enumerate(params, start=1):
            c.start_load(f"r{i}", pr, [i + 30])
            deadline = time.monotonic() + 30
            while not (out := c.poll()) and time.monotonic() < deadline:
                pass
            outs.append(out)
        during = ticks[0] - before
    assert [o.receiving for o in outs] == [[f"r{i}"] for i in range(1, 21)], [o.errors for o in outs]
    assert during == 0, f"the engine's thread released the GIL {during} times in 20 loads"
    for i in range(1, 21):
        assert torch.equal(pt[0][i + 1].view(torch.uint8), ct[0][i + 30].view(torch.uint8))


@pytest.mark.parametrize("takes", ["sends", "declines", "raises"])
def test_what_the_consumer_worker_finishes_goes_to_its_taker_or_wakes_the_waiters(takes: str) -> None:
    """The agent sends what the consumer's worker thread finished from that thread
    (``worker_takes_done``: no hand-off to its event thread). A taker that declines or raises
    leaves it to the waiters, who are woken: a poll that waits returns with it at once."""
    p, pt = make(cfg("prefill", data_path="engine"), fill=3)
    c, ct = make(cfg("decode", data_path="engine"))
    assert isinstance(c, Connector) and c.consumer is not None
    consumer = c.consumer
    calls: list[tuple[str, list[str]]] = []
    called = threading.Event()

    def taker() -> bool:
        if takes == "raises":
            raise RuntimeError("the taker failed")
        if takes == "declines":
            calls.append((threading.current_thread().name, []))
            called.set()
            return False
        calls.append((threading.current_thread().name, consumer.poll(0.0).receiving))  # as the agent's _flush
        called.set()
        return True

    consumer.worker_takes_done = taker
    try:
        params = p.hold("r1", [4, 5], 32)
        c.start_load("r1", params, [9, 10])  # the first load handshakes: the worker begins and finishes it
        t0 = time.monotonic()
        if takes == "sends":
            called.wait(30)
            assert calls == [(consumer._worker.name, ["r1"])]
            assert c.poll(0.0).receiving == []  # taken: the engine's poll does not see it again
        else:
            out = c.poll(30.0)  # woken when the taker declines: not the whole 30 s
            assert out.receiving == ["r1"], out.errors
            assert time.monotonic() - t0 < 20, "the waiter was not woken"
            if takes == "declines":
                assert [name for name, _ in calls] == [consumer._worker.name]
        for a, b in zip(pt, ct, strict=True):
            assert torch.equal(a[[4, 5]].view(torch.uint8), b[[9, 10]].view(torch.uint8))
    finally:
        c.close()
        p.close()
