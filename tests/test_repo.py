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


def test_docs_images_and_links_resolve():
    for doc in [REPO / "README.md", *(REPO / "docs").glob("*.md")]:
        for target in re.findall(r"\]\(([^)#]+)\)", doc.read_text()):
            if "://" in target:
                continue
            assert (doc.parent / target).exists(), f"{doc.name} links to missing {target}"
