"""The ``kvxfer`` command as a user runs it: a real process, exit codes, what it prints."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def kvxfer(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    script = Path(sys.executable).parent / "kvxfer"
    cmd = [str(script)] if script.exists() else [shutil.which("kvxfer") or "kvxfer"]
    return subprocess.run([*cmd, *args], capture_output=True, text=True, cwd=REPO, timeout=120,
                          env={**os.environ, **(env or {})})


def test_check_config_prints_resolved_config() -> None:
    r = kvxfer("check-config", "configs/decode.yaml")
    assert r.returncode == 0, r.stderr
    assert "decode instance 'decode-0', valid" in r.stdout
    assert "hash_algo: xxh3_128" in r.stdout  # defaults filled in
    assert "block 16 tokens = 32,768 B" in r.stdout



def test_check_config_notes_a_connector_that_is_not_installed(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("role: decode\nengine_id: d\nconnector: {name: nope}\n")
    r = kvxfer("check-config", str(cfg))
    assert r.returncode == 0, r.stderr
    assert "connector.name 'nope' is not installed here (installed: cma, local, tcp" in r.stdout


def test_check_config_refuses_with_field_path(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("role: decode\nengine_id: d\nparallel: {pp: 2, layer_partition: [1, 1]}\n")
    r = kvxfer("check-config", "configs/prefill.yaml", str(bad))
    assert r.returncode == 1
    assert f"{bad}: parallel.layer_partition: expected entries summing to model.num_layers=4" in r.stderr
    r = kvxfer("check-config", "configs/prefill.yaml", env={"KVXFER_CACHE__NUM_BLOCKS": "0"})
    assert r.returncode == 1 and "configs/prefill.yaml: cache.num_blocks: Expected `int` >= 1" in r.stderr


def test_the_readme_main_job_runs_to_the_end() -> None:
    """``kvxfer launch configs/demo.yaml``, exactly as the README's first command runs it."""
    r = kvxfer("launch", "configs/demo.yaml")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "prefill instance 'prefill-0'" in r.stdout and "decode instance 'decode-0'" in r.stdout
    assert "16 ok, 0 failed; 16 loaded over the connector" in r.stdout
    assert "every instance's pool is whole" in r.stdout


def test_version_and_usage() -> None:
    r = kvxfer("--version")
    assert r.returncode == 0 and r.stdout.startswith("kvxfer ")
    r = kvxfer("no-such-command")
    assert r.returncode == 2 and "invalid choice" in r.stderr


def test_check_config_reports_every_mistake_of_a_file_with_its_path(tmp_path: Path) -> None:
    """An unknown key, a wrong type, an out-of-range value and a cross-field error, in four sections."""
    bad = tmp_path / "four.yaml"
    bad.write_text("role: decode\nengine_id: d\n"
                   "cache: {bloc_size: 16}\n"                             # unknown key
                   "parallel: {tp: two}\n"                                # wrong type
                   "server: {port: 70000}\n"                              # out of range
                   "connector: {timeouts: {transfer_s: 10, abort_s: 5}}\n")  # cross-field
    r = kvxfer("check-config", str(bad), "configs/prefill.yaml")
    assert r.returncode == 1, r.stdout + r.stderr
    expected = [f"error: {bad}: cache.bloc_size: unknown key",
                f"error: {bad}: parallel.tp: Expected `int`, got `str`",
                f"error: {bad}: server.port: Expected `int` <= 65535",
                f"error: {bad}: connector.timeouts.abort_s: expected >= timeouts.transfer_s (10.0), got 5.0"]
    lines = r.stderr.splitlines()
    for e in expected:
        assert sum(line.startswith(e) for line in lines) == 1, (e, r.stderr)
    assert len(lines) == 4, r.stderr
    assert "prefill instance 'prefill-0', valid" in r.stdout, "the next file is still checked"


def test_check_config_of_a_launch_file_checks_every_instance(tmp_path: Path) -> None:
    (tmp_path / "p.yaml").write_text("role: prefill\nengine_id: p\ncache: {block_size: 12}\n")
    (tmp_path / "d.yaml").write_text("role: decode\nengine_id: d\nmodel: {num_layers: 0}\n")
    (tmp_path / "ok.yaml").write_text("role: decode\nengine_id: ok\n")
    launch = tmp_path / "launch.yaml"
    launch.write_text("instances: [p.yaml, d.yaml, ok.yaml]\n")
    r = kvxfer("check-config", str(launch))
    assert r.returncode == 1
    assert f"{tmp_path / 'p.yaml'}: cache.block_size: expected a power of two" in r.stderr
    assert f"{tmp_path / 'd.yaml'}: model.num_layers: Expected `int` >= 1" in r.stderr
    assert "decode instance 'ok', valid" in r.stdout
