"""The repository keeps its promises: README map, CI command, environment, import arrows."""

import ast
import re
import tomllib

import yaml
from conftest import REPO

README = (REPO / "README.md").read_text()


def test_every_path_the_readme_names_exists():
    block = README.split("## Map of the house", 1)[1].split("```")[1]
    stack: list[str] = []
    named = []
    for line in block.splitlines():
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        name = line.split()[0]
        depth = indent // 2
        stack = stack[:depth] + [name]
        named.append("".join(stack))
    inline = re.findall(r"`([\w./-]+\.(?:py|yaml|yml|md|toml))`", README)
    named += [p for p in inline if not p.startswith("RUN_DIR/")]  # RUN_DIR: inside a run
    assert len(named) > 30
    missing = [p for p in named if not (REPO / p).exists()]
    assert not missing, f"README names paths that do not exist: {missing}"


def test_ci_runs_the_readme_test_command():
    commands = re.findall(r"^python3 -m venv .*$", README, flags=re.M)
    assert len(commands) == 2, "the Quickstart has exactly two set-up commands"
    assert commands[0].endswith("laminar run configs/tiny.yaml")
    assert commands[1] in (REPO / ".ci" / "run").read_text().splitlines()


def test_environment_yml_installs_the_package():
    env = yaml.safe_load((REPO / "environment.yml").read_text())
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    python = next(d for d in env["dependencies"] if isinstance(d, str) and d.startswith("python="))
    assert project["requires-python"] == ">=" + python.split("=")[1]
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    # Dependencies come from pyproject.toml alone: the package with extras it defines.
    [line] = pip
    extras = re.fullmatch(r"-e \.\[([a-z,-]+)\]", line).group(1).split(",")
    assert set(extras) <= set(project["optional-dependencies"]), extras
    assert {"cpu", "slurm"} <= set(extras)


def _imports(path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module.split(".")[0]


def test_imports_point_down_only():
    forbidden = {
        "storage": {"laminar", "pipelines", "torch", "distributed"},
        "laminar": {"pipelines"},
    }
    for package, banned in forbidden.items():
        for path in (REPO / package).rglob("*.py"):
            bad = banned & set(_imports(path))
            assert not bad, f"{path.relative_to(REPO)} imports {sorted(bad)}"


def test_code_passes_ruff():
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "."],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def _anchors(text: str) -> set[str]:
    """GitHub's ids of a Markdown file's headings: lower case, punctuation but ``-`` and
    ``_`` dropped, each space a ``-``."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)  # (a `# comment` in a block)
    headings = re.findall(r"^#+ (.+)$", text, flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_docs_images_and_links_resolve():
    """Every relative link of README.md and docs/*.md names a file that exists and, with
    a ``#fragment``, a heading of it."""
    checked = 0
    for doc in [REPO / "README.md", *(REPO / "docs").glob("*.md")]:
        for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
            if "://" in target:
                continue
            path, _, fragment = target.partition("#")
            file = doc.parent / path if path else doc
            assert file.exists(), f"{doc.name} links to missing {target}"
            if fragment:
                checked += 1
                assert fragment in _anchors(file.read_text()), (
                    f"{doc.name} links to {target}: {file.name} has no heading #{fragment}"
                )
    assert checked >= 5  # (the links with a fragment, which the pattern once skipped)


def _user_docs() -> str:
    return "\n".join(p.read_text() for p in [REPO / "README.md", *(REPO / "docs").glob("*.md")])


def test_every_cli_subcommand_and_flag_is_documented():
    """A subcommand or flag no user doc names cannot be found: `laminar <cmd>`, each
    benchmark (`laminar bench <name>`) and every option string of `build_parser()` appear
    in README.md or docs/*.md."""
    import argparse

    from pipelines.cli import build_parser

    docs = _user_docs()
    [sub] = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    assert len(sub.choices) >= 5
    missing = []
    for name, parser in sub.choices.items():
        if not re.search(rf"laminar {name}(?![\w-])", docs):
            missing.append(f"laminar {name}")
        for action in parser._actions:
            if not action.option_strings and action.choices:  # (bench's: engine, relay, ...)
                missing += [
                    f"laminar {name} {c}"
                    for c in action.choices
                    if not re.search(rf"laminar {name} {c}(?![\w-])", docs)
                ]
            for flag in action.option_strings:
                if flag.startswith("--") and flag != "--help":
                    if not re.search(rf"{re.escape(flag)}(?![\w-])", docs):
                        missing.append(f"laminar {name} {flag}")
    assert not missing, f"not in README.md or docs/*.md: {missing}"


def _config_keys(model, prefix=""):
    """(dotted key, is a section that is off unless set) of every key under ``model``."""
    import typing

    from pydantic import BaseModel

    for name, field in model.model_fields.items():
        args = [field.annotation, *typing.get_args(field.annotation)]
        section = next((a for a in args if isinstance(a, type) and issubclass(a, BaseModel)), None)
        if section is None:
            yield prefix + name, False
        else:
            if field.default is None:  # (rollout.pacing, repack, ...: a row may say so)
                yield prefix + name, True
            yield from _config_keys(section, f"{prefix}{name}.")


def test_every_config_key_has_a_row_in_configuration_md():
    """docs/configuration.md's tables give every key of `RunConfig` (a new key is found
    there), and name no key the loader would refuse (a removed or renamed one). A row
    names its keys in its first cell: `section.key`, then `.other` or `other` for
    siblings, or `cluster.slurm.{a,b}.key` for several roles."""
    from laminar.config import RunConfig

    text = (REPO / "docs" / "configuration.md").read_text()
    tables = text.split("## Keys", 1)[1].split("## Cross-field checks", 1)[0]
    documented = set()
    for line in tables.splitlines():
        if not line.startswith("| `"):
            continue
        first = line.split(" | ", 1)[0]
        if roles := re.match(r"\| `([\w.]+)\.\{([\w,]+)\}\.(\w+)`", first):
            head, names, leaf = roles.groups()
            documented |= {f"{head}.{r}.{leaf}" for r in names.split(",")}
            continue
        [lead, *siblings] = re.findall(r"`([\w.]+)`", first)
        parent = lead.rpartition(".")[0]
        documented.add(lead)
        documented |= {f"{parent}.{s.lstrip('.')}".lstrip(".") for s in siblings}
    keys = dict(_config_keys(RunConfig))
    leaves = {k for k, optional_section in keys.items() if not optional_section}
    assert len(leaves) > 100
    assert not leaves - documented, f"keys with no row: {sorted(leaves - documented)}"
    assert not documented - set(keys), f"rows of no key: {sorted(documented - set(keys))}"


def test_every_accessor_member_is_documented():
    """Each public method and property of `ds.laminar` appears as `laminar.<name>` in
    README.md or docs/*.md (docs/analysis.md lists them)."""
    from storage import LaminarAccessor

    docs = _user_docs()
    members = [m for m in vars(LaminarAccessor) if not m.startswith("_")]
    assert len(members) > 10
    missing = [m for m in members if not re.search(rf"laminar\.{m}\b", docs)]
    assert not missing, f"ds.laminar members no user doc names: {missing}"
