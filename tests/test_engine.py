"""The reference engine end to end: real instance, router and launcher processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import numpy as np
import pytest
import yaml

from kvxfer.config import load_instance_config, load_launch_config, to_yaml
from kvxfer.engine import messages as m
from kvxfer.engine.launcher import (
    _addr,
    _request,
    check_blocks,
    make_workload,
    run_workload,
    started,
    verify_config,
    wait_ready,
)

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"
LAUNCH_FILES = sorted(p.name for p in CONFIGS.glob("*.yaml") if "instances" in yaml.safe_load(p.read_text()))


def kvxfer_children() -> list[str]:
    """Command lines of live ``kvxfer serve`` / ``kvxfer route`` processes on this machine."""
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmd = (Path("/proc") / pid / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if "-m kvxfer serve" in cmd or "-m kvxfer route" in cmd:
            out.append(f"{pid}: {cmd}")
    return out


def small_launch(tmp_path: Path, name: str, **extra: object) -> Path:
    """The shipped launch file with a handful of short requests."""
    data = yaml.safe_load((CONFIGS / name).read_text())
    data["instances"] = [str(CONFIGS / p) for p in data["instances"]]
    data["workload"] = {"num_requests": 4, "prompt_tokens": 72, "output_tokens": 6, "seed": 3}
    data.update(extra)
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return path


def test_every_shipped_launch_file_is_tested() -> None:
    assert {"demo.yaml", "blocks.yaml", "ucx.yaml", "hetero-tp.yaml", "hetero-tp-up.yaml", "pp.yaml", "push.yaml",
            "push-hetero-tp.yaml", "push-blocks.yaml"} <= set(LAUNCH_FILES)


@pytest.mark.parametrize("name", LAUNCH_FILES)
def test_launch_verify_agrees_and_leaves_nothing_behind(tmp_path: Path, name: str) -> None:
    path = small_launch(tmp_path, name)
    r = subprocess.run([sys.executable, "-m", "kvxfer", "launch", str(path), "--verify"], capture_output=True,
                       text=True, timeout=600, cwd=REPO)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "4 ok, 0 failed; 4 loaded over the connector" in r.stdout
    assert "every instance's pool is whole" in r.stdout
    assert "verify: 4 of 4 requests agree token for token" in r.stdout
    assert kvxfer_children() == []


def _kv(addr: str, prompt: list[int]) -> tuple[int, bytes]:
    dump = _request(addr, m.KVQuery(prompt=prompt), 30)
    assert isinstance(dump, m.KVDump), dump
    return dump.num_tokens, dump.data


@pytest.mark.parametrize("name", ["blocks.yaml", "hetero-tp.yaml", "hetero-tp-up.yaml", "pp.yaml", "push-blocks.yaml",
                                  "push-hetero-tp.yaml"])
def test_decode_kv_equals_prefill_kv_after_repack(tmp_path: Path, name: str) -> None:
    """blocks: 16-token HND blocks -> 32-token NHD; hetero-tp: two prefill ranks' heads -> one
    rank; hetero-tp-up: the reverse; pp: two prefill stages' layers -> one rank; push-*: the same
    pushed layer by layer. The dump gathers every rank's part of the instance's KV."""
    path = small_launch(tmp_path, name)
    launch = load_launch_config(path)
    (pcfg, dcfg) = [load_instance_config(p) for p in launch.instances]
    assert (pcfg.world_size, pcfg.cache.block_size, pcfg.cache.layout) != \
        (dcfg.world_size, dcfg.cache.block_size, dcfg.cache.layout)
    with started(tmp_path / "logs") as run:
        targets = [(run.start(c.engine_id, ["serve", p]), _addr(c.server.host, c.server.port))
                   for c, p in zip((pcfg, dcfg), launch.instances, strict=True)]
        targets.append((run.start("router", ["route", str(path)]), _addr(launch.router.host, launch.router.port)))
        wait_ready(run, targets, 120)
        reqs = make_workload(launch, pcfg.model.vocab_size)
        results = run_workload(_addr(launch.router.host, launch.router.port), reqs, 120, "kv check")
        assert all(r.result.loaded and not r.result.error for r in results.values())
        shape = (pcfg.model.num_layers * 2, -1, pcfg.model.num_kv_heads, pcfg.model.head_size)
        dtype = np.dtype(pcfg.cache.dtype)
        for req in reqs:
            pn, pdata = _kv(_addr(pcfg.server.host, pcfg.server.port), req.prompt)
            dn, ddata = _kv(_addr(dcfg.server.host, dcfg.server.port), req.prompt)
            n = min(pn, dn)
            assert n >= 64  # 72-token prompts: 4 full blocks of 16 (2 of 32)
            pk = np.frombuffer(pdata, dtype=dtype).reshape(shape)[:, :n]
            dk = np.frombuffer(ddata, dtype=dtype).reshape(shape)[:, :n]
            assert np.abs(pk).sum() > 0
            assert pk.tobytes() == dk.tobytes(), "the decode KV is the prefill KV, byte for byte"
    assert kvxfer_children() == []


@pytest.mark.parametrize("name", ["demo.yaml", "push.yaml"])
def test_killing_prefill_mid_run_completes_every_request_on_decode(tmp_path: Path, name: str) -> None:
    """Pull: loads in flight fail and queued requests time out at the router; push: reservations
    being pushed fail (transfer_s after the last layer), the rest time out; all are computed on decode."""
    path = small_launch(tmp_path, name, prefill_timeout_s=2.0)
    data = yaml.safe_load(path.read_text())
    data["workload"] = {"num_requests": 40, "prompt_tokens": 300, "output_tokens": 16, "seed": 5}
    path.write_text(yaml.safe_dump(data))
    launch = load_launch_config(path)
    pcfg, dcfg = [load_instance_config(p) for p in launch.instances]
    reqs = make_workload(launch, pcfg.model.vocab_size)
    with started(tmp_path / "logs") as run:
        prefill = run.start(pcfg.engine_id, ["serve", launch.instances[0]])
        decode = run.start(dcfg.engine_id, ["serve", launch.instances[1]])
        router = run.start("router", ["route", str(path)])
        wait_ready(run, [(prefill, _addr(pcfg.server.host, pcfg.server.port)),
                         (decode, _addr(dcfg.server.host, dcfg.server.port)),
                         (router, _addr(launch.router.host, launch.router.port))], 120)
        import threading

        def kill_soon() -> None:  # while most of the 40 requests are still queued or loading
            time.sleep(0.5)
            os.kill(prefill.proc.pid, signal.SIGKILL)

        threading.Thread(target=kill_soon).start()
        results = run_workload(_addr(launch.router.host, launch.router.port), reqs, 120, "kill prefill")
        assert prefill.proc.wait(timeout=10) == -signal.SIGKILL
        assert all(not r.result.error for r in results.values()), [r.result.error for r in results.values()]
        recomputed = [rid for rid, r in results.items() if not r.result.loaded]
        assert recomputed, "the kill must have hit some requests"
        assert check_blocks([dcfg]) == [], "no block leaks on the decode side"
        # and the recomputed requests are still right: compare with a monolithic instance
        vcfg = verify_config(launch, dcfg)
        vpath = tmp_path / "verify.yaml"
        vpath.write_text(to_yaml(vcfg))
        v = run.start("verify", ["serve", str(vpath)])
        wait_ready(run, [(v, _addr(vcfg.server.host, vcfg.server.port))], 120)
        ref = run_workload(_addr(vcfg.server.host, vcfg.server.port), reqs, 120, "reference")
        assert {k: r.result.tokens for k, r in results.items()} == {k: r.result.tokens for k, r in ref.items()}
    assert kvxfer_children() == []


def test_launcher_failure_names_what_did_not_come_up_and_stops_the_rest(tmp_path: Path) -> None:
    bad = yaml.safe_load((CONFIGS / "decode.yaml").read_text())
    bad["cache"]["dtype"] = "float64"  # valid config, but the reference engine refuses it at start
    (tmp_path / "decode.yaml").write_text(yaml.safe_dump(bad))
    launch = {"instances": [str(CONFIGS / "prefill.yaml"), str(tmp_path / "decode.yaml")], "ready_timeout_s": 60}
    path = tmp_path / "launch.yaml"
    path.write_text(yaml.safe_dump(launch))
    r = subprocess.run([sys.executable, "-m", "kvxfer", "launch", str(path)], capture_output=True, text=True,
                       timeout=300, cwd=REPO)
    assert r.returncode == 2
    assert "decode-0 exited with status 1 before it was ready" in r.stderr
    assert "stores its KV in the model dtype" in r.stderr
    assert kvxfer_children() == []


def test_a_rank_that_cannot_start_fails_its_instance_and_leaves_nothing_behind(tmp_path: Path) -> None:
    """Rank 1 of a TP 2 decode instance finds its side-channel port taken: the instance exits,
    the launcher names it, and neither rank (nor anything else) is left running."""
    import socket

    dcfg = yaml.safe_load((CONFIGS / "hetero-tp-up-decode.yaml").read_text())
    blocker = socket.socket()
    blocker.bind(("127.0.0.1", dcfg["connector"]["side_channel"]["port"] + 1))
    blocker.listen()
    try:
        launch = small_launch(tmp_path, "hetero-tp-up.yaml", ready_timeout_s=60)
        r = subprocess.run([sys.executable, "-m", "kvxfer", "launch", str(launch)], capture_output=True, text=True,
                           timeout=300, cwd=REPO)
    finally:
        blocker.close()
    assert r.returncode == 2, r.stderr[-3000:]
    assert "decode-tp2 exited with status 2 before it was ready" in r.stderr
    assert "rank(s) exited (rank: status) {1: 1}" in r.stderr
    assert kvxfer_children() == []


def test_a_rank_killed_while_serving_takes_its_instance_down(tmp_path: Path) -> None:
    """SIGKILL to rank 1 of a running TP 2 instance: rank 0 notices at its next step and exits
    with a message naming the rank, instead of hanging in a collective."""
    cfg_path = CONFIGS / "hetero-tp-prefill.yaml"
    cfg = load_instance_config(cfg_path)
    with started(tmp_path / "logs") as run:
        inst = run.start(cfg.engine_id, ["serve", str(cfg_path)])
        wait_ready(run, [(inst, _addr(cfg.server.host, cfg.server.port))], 120)
        ranks = [c for c in kvxfer_children() if "--rank 1" in c]
        assert len(ranks) == 1, kvxfer_children()
        os.kill(int(ranks[0].split(":")[0]), signal.SIGKILL)
        assert inst.proc.wait(timeout=60) == 2
        assert "rank(s) exited (rank: status) {1: -9}" in inst.log.read_text()
    assert kvxfer_children() == []


def test_interrupted_launch_stops_its_children(tmp_path: Path) -> None:
    path = small_launch(tmp_path, "demo.yaml")
    data = yaml.safe_load(path.read_text())
    data["workload"] = {"num_requests": 200, "prompt_tokens": 300, "output_tokens": 64, "seed": 0}
    path.write_text(yaml.safe_dump(data))
    p = subprocess.Popen([sys.executable, "-m", "kvxfer", "launch", str(path)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, cwd=REPO)
    deadline = time.monotonic() + 120
    while len(kvxfer_children()) < 3 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert len(kvxfer_children()) == 3
    time.sleep(1.0)
    p.send_signal(signal.SIGINT)  # Ctrl-C
    try:
        _, err = p.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        p.kill()
        _, err = p.communicate()
        pytest.fail(f"the launcher did not stop after Ctrl-C; its stderr:\n{err[-3000:]}")
    assert p.returncode == 130, err[-2000:]
    assert "every process this launch started has been stopped" in err
    assert kvxfer_children() == []


def test_engine_messages_refuse_garbage() -> None:
    from kvxfer.protocol import ProtocolError

    with pytest.raises(ProtocolError):
        m.decode(msgspec.msgpack.encode({"type": "generate", "request_id": "r"}))
    assert m.decode(m.encode(m.Ping())) == m.Ping()
