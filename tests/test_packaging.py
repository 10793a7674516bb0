"""Connectors install as ``kvxfer.connectors.<name>`` and are found through the entry-point
group, both from this (editable) install and from a built wheel."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from importlib.metadata import distribution
from pathlib import Path

import pytest

from kvxfer.connector import DataPlane, available_data_planes, load_data_plane

REPO = Path(__file__).resolve().parents[1]


def test_installed_distribution_registers_connectors() -> None:
    eps = available_data_planes()
    assert eps["local"].value == "kvxfer.connectors.local:LocalDataPlane"
    cls = load_data_plane("local")
    assert issubclass(cls, DataPlane) and cls.__module__ == "kvxfer.connectors.local"
    direct = distribution("kvxfer").read_text("direct_url.json")
    if direct and json.loads(direct).get("dir_info", {}).get("editable"):
        # editable: the module is the file in the checkout's connectors/ folder
        import kvxfer.connectors.local as mod

        assert Path(mod.__file__).resolve() == REPO / "connectors" / "local" / "__init__.py"


def test_unknown_connector_lists_installed() -> None:
    with pytest.raises(ValueError, match=r"no data plane 'nope' .* installed: .*local"):
        load_data_plane("nope")


def test_wheel_maps_connectors_into_kvxfer(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path / "dist"), str(REPO)],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("kvxfer-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        eps = next(zf.read(n).decode() for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "kvxfer/connectors/local/__init__.py" in names
    assert "kvxfer/cache/block_pool.py" in names
    assert not any(n.startswith(("connectors/", "tests/")) for n in names)
    import configparser

    groups = configparser.ConfigParser()
    groups.read_string(eps)
    assert dict(groups["kvxfer.connectors"]) == {
        "local": "kvxfer.connectors.local:LocalDataPlane", "tcp": "kvxfer.connectors.tcp:TcpDataPlane",
        "ucx": "kvxfer.connectors.ucx:UcxDataPlane", "cma": "kvxfer.connectors.cma:CmaDataPlane"}
    assert dict(groups["vllm.general_plugins"]) == {"kvxfer": "kvxfer.integrations:register_vllm"}
    assert groups["console_scripts"]["kvxfer"] == "kvxfer.cli:main"
    assert "kvxfer/integrations/vllm.py" in names and "kvxfer/connectors/cma/__init__.py" in names

    target = tmp_path / "site"
    out = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    probe = (
        "import kvxfer, kvxfer.connector as c; cls = c.load_data_plane('local'); "
        "import sys, inspect; print(kvxfer.__file__); print(inspect.getfile(cls))"
    )
    env = {**os.environ, "PYTHONPATH": str(target)}
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=tmp_path,
                         env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    pkg_file, cls_file = out.stdout.split()
    assert Path(pkg_file).is_relative_to(target)
    assert Path(cls_file) == target / "kvxfer" / "connectors" / "local" / "__init__.py"
