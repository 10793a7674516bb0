"""The README's set-up commands are what CI and users actually run."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def readme_commands() -> list[str]:
    text = (REPO / "README.md").read_text()
    setup = text.split("## Set up", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```sh\n(.+?)\n```", setup, re.S)


def test_readme_has_exactly_two_setup_commands() -> None:
    cmds = readme_commands()
    assert len(cmds) == 2 and all("\n" not in c for c in cmds)
    main_job, tests = cmds
    assert main_job.endswith("kvxfer launch configs/demo.yaml")
    assert "-c constraints.txt" in main_job and "-c constraints.txt" in tests
    assert "pytest" in tests and "ruff check" in tests


def test_ci_runs_the_readme_test_command_verbatim() -> None:
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    body = [line for line in ci if line.strip() and not line.startswith("#")]
    assert body[-1] == readme_commands()[1]
    assert all(line.startswith(("set ", "cd ")) for line in body[:-1])


def test_constraints_pin_torch_but_the_package_does_not() -> None:
    assert "torch==2.13.0" in (REPO / "constraints.txt").read_text().split()
    deps = (REPO / "pyproject.toml").read_text().split("dependencies = [", 1)[1].split("]", 1)[0]
    assert '"torch>=2.1"' in deps and "==" not in deps
