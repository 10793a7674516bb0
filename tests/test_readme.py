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
    assert ".venv/bin/mypy &&" in tests  # types are checked (the [tool.mypy] files: kvxfer and connectors)


def test_ci_runs_the_readme_test_command_verbatim() -> None:
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    body = [line for line in ci if line.strip() and not line.startswith("#")]
    assert body[-1] == readme_commands()[1]
    assert all(line.startswith(("set ", "cd ")) for line in body[:-1])


def test_constraints_pin_torch_but_the_package_does_not() -> None:
    assert "torch==2.13.0" in (REPO / "constraints.txt").read_text().split()
    deps = (REPO / "pyproject.toml").read_text().split("dependencies = [", 1)[1].split("]", 1)[0]
    assert '"torch>=2.1"' in deps and "==" not in deps


# --------------------------------------------------------------------------- the README and docs/ agree with the code

DOCS = sorted((REPO / "docs").glob("*.md"))
PAGES = [REPO / "README.md", *DOCS]


def _section(text: str, heading: str) -> str:
    """The body of the ``## heading`` section (up to the next ``## ``)."""
    assert f"\n## {heading}\n" in text, f"README has no '## {heading}' section"
    return text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]


def _table_first_cells(text: str) -> list[str]:
    """The first cell of every body row of every Markdown table in ``text``."""
    cells: list[str] = []
    rows = [line for line in text.splitlines() if line.startswith("|")]
    for line in rows:
        first = line.strip("|").split("|", 1)[0].strip()
        if set(first) <= set("-: ") or first in ("key", "command", "name", "call"):
            continue  # separator or header row
        cells.append(first)
    return cells


def _struct_has_path(root: type, dotted: str) -> bool:
    """Whether ``dotted`` (``connector.timeouts.lease_s``) names a field of msgspec Struct ``root``.

    A free-form dict field (``connector.data_plane``) accepts any key below it."""
    import msgspec

    info = msgspec.inspect.type_info(root)
    for part in dotted.split("."):
        while isinstance(info, msgspec.inspect.Metadata | msgspec.inspect.UnionType):  # Annotated, X | None
            if isinstance(info, msgspec.inspect.Metadata):
                info = info.type
            else:
                info = next((t for t in info.types if not isinstance(t, msgspec.inspect.NoneType)), info.types[0])
        if isinstance(info, msgspec.inspect.DictType):
            return True
        if not isinstance(info, msgspec.inspect.StructType):
            return False
        field = next((f for f in info.fields if f.encode_name == part), None)
        if field is None:
            return False
        info = field.type
    return True


def test_every_config_key_in_the_readme_tables_exists() -> None:
    from kvxfer.config import InstanceConfig, LaunchConfig

    keys = [c.strip("`") for c in _table_first_cells(_section((REPO / "README.md").read_text(), "Configuration"))]
    assert len(keys) >= 20 and "connector.timeouts.hold_wait_s" in keys, keys
    missing = [k for k in keys if not (_struct_has_path(InstanceConfig, k) or _struct_has_path(LaunchConfig, k))]
    assert not missing, f"README configuration keys with no field in kvxfer/config.py: {missing}"


def test_the_key_walker_refuses_names_that_do_not_exist() -> None:
    from kvxfer.config import InstanceConfig

    assert _struct_has_path(InstanceConfig, "connector.side_channel.host")
    assert _struct_has_path(InstanceConfig, "connector.data_plane.streams")  # free-form dict
    assert not _struct_has_path(InstanceConfig, "connector.side_channel.hostname")
    assert not _struct_has_path(InstanceConfig, "cache.block_size.x")
    assert not _struct_has_path(InstanceConfig, "metrics_host")


def _code(text: str) -> list[str]:
    """Fenced code blocks and inline code spans: where commands are shown."""
    blocks = re.findall(r"```[a-z]*\n(.*?)```", text, re.S)
    rest = re.sub(r"```[a-z]*\n.*?```", "", text, flags=re.S)
    return blocks + re.findall(r"`([^`\n]+)`", rest)


def test_every_kvxfer_subcommand_the_docs_show_exists() -> None:
    from kvxfer.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    known = set(sub.choices)  # type: ignore[union-attr]
    shown: set[str] = set()
    for page in PAGES:
        for code in _code(page.read_text()):
            shown |= set(re.findall(r"(?:^|[\s/`'\"])kvxfer ([a-z][a-z-]*)", code))
    assert {"launch", "check-config", "serve", "route"} <= shown
    assert not shown - known, f"subcommands in the docs that kvxfer/cli.py does not have: {shown - known}"
    bench = next(a for a in sub.choices["bench"]._actions if a.dest == "what")  # type: ignore[union-attr]
    benches: set[str] = set()
    for page in PAGES:
        for code in _code(page.read_text()):
            benches |= set(re.findall(r"kvxfer bench ([a-z0-9]+)", code))
    assert benches and not benches - set(bench.choices), benches - set(bench.choices)


def test_every_config_file_the_docs_name_exists() -> None:
    named: set[str] = set()
    for page in PAGES:
        named |= set(re.findall(r"\bconfigs/[A-Za-z0-9_.-]+\.yaml", page.read_text()))
    assert "configs/demo.yaml" in named
    missing = sorted(n for n in named if not (REPO / n).is_file())
    assert not missing, missing


def _links(text: str) -> list[str]:
    return re.findall(r"\]\(([^)\s]+)\)", text)


def test_every_relative_link_points_at_an_existing_file() -> None:
    broken = []
    for page in PAGES:
        for target in _links(page.read_text()):
            if re.match(r"^[a-z]+:", target) or target.startswith("#"):
                continue
            path = (page.parent / target.split("#", 1)[0]).resolve()
            if not path.exists():
                broken.append(f"{page.relative_to(REPO)}: {target}")
            elif REPO not in path.parents and path != REPO:
                broken.append(f"{page.relative_to(REPO)}: {target} (outside the repository)")
    assert not broken, broken


def test_no_link_leaves_the_repository_and_nothing_points_at_shared() -> None:
    for page in PAGES:
        text = page.read_text()
        assert "../shared" not in text and "shared/DESIGN" not in text, page
        assert not any(t.startswith("/") for t in _links(text)), page


def test_no_table_row_is_longer_than_120_characters() -> None:
    long = [f"{p.relative_to(REPO)}:{i}: {len(line)} chars" for p in PAGES
            for i, line in enumerate(p.read_text().splitlines(), 1) if line.startswith("|") and len(line) > 120]
    assert not long, long


def test_the_readme_reads_in_ten_minutes() -> None:
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 300
    headings = re.findall(r"^## (.+)$", text, re.M)
    assert headings.index("Set up") < headings.index("A five-minute tour") < headings.index("Configuration")
    tour = _section(text, "A five-minute tour")
    assert "kvxfer launch configs/demo.yaml" in tour and "Connector" in tour and "KvxferConnector" in tour
    for doc in ("architecture", "reliability", "security", "benchmarks"):
        assert f"docs/{doc}.md" in text, doc
    assert not (REPO / "RELIABILITY.md").exists() and not (REPO / "SECURITY.md").exists()
    assert not (REPO / "BENCHMARKS.md").exists()
