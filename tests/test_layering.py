"""The one-way layering of the five packages, read from the imports of every module.

types <- rollout, types <- adapter, algos (torch only) <- trainer. A violation names the
file and line of the offending import.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SIBLINGS = frozenset({"agl_types", "agl_rollout", "agl_adapter", "agl_algos", "agl_trainer"})


@dataclass(frozen=True)
class Import:
    path: Path
    line: int
    module: str
    top_level: bool

    @property
    def root(self) -> str:
        return self.module.split(".")[0]

    def __str__(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line} imports {self.module}"


@dataclass(frozen=True)
class Rule:
    """What one package may import: siblings anywhere, and modules banned everywhere or at import time."""

    package: str
    allowed_siblings: frozenset[str]
    banned_anywhere: frozenset[str] = frozenset()
    banned_at_import: frozenset[str] = frozenset()
    lazy_subpackage: str | None = None  # may import banned_at_import modules at top level


RULES = (
    Rule("agl_types", frozenset()),
    Rule(
        "agl_rollout", frozenset({"agl_types"}), banned_anywhere=frozenset({"torch", "verl", "ray", "vllm"})
    ),
    Rule(
        "agl_adapter",
        frozenset({"agl_types"}),
        banned_anywhere=frozenset({"httpx", "ray", "vllm"}),
        banned_at_import=frozenset({"verl"}),
    ),
    Rule(
        "agl_algos",
        frozenset(),
        banned_anywhere=frozenset({"httpx", "ray", "vllm"}),
        banned_at_import=frozenset({"verl"}),
        lazy_subpackage="agl_algos.verl",
    ),
)


def _module_name(path: Path, src: Path) -> str:
    parts = list(path.relative_to(src).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolve(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    if node.level == 0:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def _imports_of(path: Path, src: Path) -> list[Import]:
    tree = ast.parse(path.read_text(), filename=str(path))
    module = _module_name(path, src)
    top = {id(n) for n in tree.body}
    found: list[Import] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend(Import(path, node.lineno, a.name, id(node) in top) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(node, module, path.name == "__init__.py")
            found.append(Import(path, node.lineno, target, id(node) in top))
            found.extend(Import(path, node.lineno, f"{target}.{a.name}", id(node) in top) for a in node.names)
    return found


def _violations(rule: Rule) -> list[str]:
    src = ROOT / "packages" / rule.package.replace("_", "-") / "src"
    problems: list[str] = []
    for path in sorted((src / rule.package).rglob("*.py")):
        in_lazy = rule.lazy_subpackage is not None and _module_name(path, src).startswith(
            rule.lazy_subpackage
        )
        for imp in _imports_of(path, src):
            if imp.root in SIBLINGS and imp.root != rule.package and imp.root not in rule.allowed_siblings:
                problems.append(f"{imp}: {rule.package} may not import sibling {imp.root}")
            elif imp.root in rule.banned_anywhere:
                problems.append(f"{imp}: {rule.package} may not import {imp.root}")
            elif imp.top_level and not in_lazy and imp.root in rule.banned_at_import:
                problems.append(f"{imp}: {rule.package} may import {imp.root} only inside a function")
            elif (
                imp.top_level and not in_lazy and rule.lazy_subpackage and imp.module == rule.lazy_subpackage
            ):
                problems.append(f"{imp}: {rule.lazy_subpackage} must be imported on demand only")
    return problems


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.package)
def test_package_imports_respect_layering(rule: Rule) -> None:
    assert _violations(rule) == []


@pytest.mark.parametrize(
    ("package", "heavy"),
    [
        ("agl_types", ("torch", "httpx", "verl", "ray", "agl_rollout")),
        ("agl_rollout", ("torch", "numpy", "verl", "ray", "vllm")),
        ("agl_adapter", ("httpx", "verl", "ray", "vllm")),
        ("agl_algos", ("httpx", "verl", "ray", "vllm")),
    ],
)
def test_importing_package_loads_no_heavy_dependency(package: str, heavy: tuple[str, ...]) -> None:
    probe = f"import sys, {package}; print(','.join(m for m in {heavy!r} if m in sys.modules))"
    loaded = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert loaded == "", f"importing {package} loaded {loaded}"


def test_rule_checker_reports_file_and_line(tmp_path: Path) -> None:
    src = tmp_path / "src" / "pkg"
    src.mkdir(parents=True)
    (src / "mod.py").write_text("import os\nfrom agl_rollout import client\n")
    (imp,) = [i for i in _imports_of(src / "mod.py", tmp_path / "src") if i.module == "agl_rollout"]
    assert (imp.line, imp.top_level) == (2, True)
