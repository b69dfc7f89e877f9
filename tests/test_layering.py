"""The one-way layering of the five packages, read from the imports of every module.

types <- rollout, types <- adapter, algos (torch only) <- trainer; inside agl_trainer, settings
below serving, step and the embedded default (agl_trainer.local), which no production module
imports (the console script only on demand). Any import outside a function body runs at import
time (a top-level try/if/with or a class body too), except under ``if TYPE_CHECKING``. A violation names the file and line of the offending import.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SIBLINGS = frozenset({"agl_types", "agl_rollout", "agl_adapter", "agl_algos", "agl_trainer"})


@dataclass(frozen=True)
class Import:
    """One imported module; ``import_time`` when it runs on import (not inside a function or
    under ``if TYPE_CHECKING``). ``shown`` is the file as messages name it."""

    shown: str
    line: int
    module: str
    import_time: bool

    @property
    def root(self) -> str:
        return self.module.split(".")[0]

    def __str__(self) -> str:
        return f"{self.shown}:{self.line} imports {self.module}"


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


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(
    nodes: Iterable[ast.AST], import_time: bool
) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Every import statement under ``nodes``; a function body (a method's too) runs later, a
    class body or a top-level try/if/with runs on import."""
    for node in nodes:
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node, import_time
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield from _import_nodes(node.body, False)
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            yield from _import_nodes(node.body, False)
            yield from _import_nodes(node.orelse, import_time)
        else:
            yield from _import_nodes(ast.iter_child_nodes(node), import_time)


def _imports_of(path: Path, src: Path, shown: str) -> list[Import]:
    tree = ast.parse(path.read_text(), filename=str(path))
    module = _module_name(path, src)
    found: list[Import] = []
    for node, import_time in _import_nodes(tree.body, True):
        if isinstance(node, ast.Import):
            found.extend(Import(shown, node.lineno, a.name, import_time) for a in node.names)
        else:
            target = _resolve(node, module, path.name == "__init__.py")
            found.append(Import(shown, node.lineno, target, import_time))
            found.extend(Import(shown, node.lineno, f"{target}.{a.name}", import_time) for a in node.names)
    return found


def _violations(rule: Rule, root: Path = ROOT) -> list[str]:
    """Every import of ``rule.package`` (under ``root/packages``) that breaks the rule."""
    src = root / "packages" / rule.package.replace("_", "-") / "src"
    problems: list[str] = []
    for path in sorted((src / rule.package).rglob("*.py")):
        in_lazy = rule.lazy_subpackage is not None and _module_name(path, src).startswith(
            rule.lazy_subpackage
        )
        for imp in _imports_of(path, src, str(path.relative_to(root))):
            eager = imp.import_time and not in_lazy
            if imp.root in SIBLINGS and imp.root != rule.package and imp.root not in rule.allowed_siblings:
                problems.append(f"{imp}: {rule.package} may not import sibling {imp.root}")
            elif imp.root in rule.banned_anywhere:
                problems.append(f"{imp}: {rule.package} may not import {imp.root}")
            elif eager and imp.root in rule.banned_at_import:
                problems.append(f"{imp}: {rule.package} may import {imp.root} only inside a function")
            elif eager and rule.lazy_subpackage and imp.module == rule.lazy_subpackage:
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
        ("agl_adapter", ("httpx", "verl", "ray", "vllm", "wandb", "tensordict")),
        ("agl_algos", ("httpx", "verl", "ray", "vllm")),
    ],
)
def test_importing_package_loads_no_heavy_dependency(package: str, heavy: tuple[str, ...]) -> None:
    probe = f"import sys, {package}; print(','.join(m for m in {heavy!r} if m in sys.modules))"
    loaded = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert loaded == "", f"importing {package} loaded {loaded}"


def _algos_module(root: Path, text: str) -> None:
    module = root / "packages" / "agl-algos" / "src" / "agl_algos" / "mod.py"
    module.parent.mkdir(parents=True)
    module.write_text(text)


ALGOS = next(rule for rule in RULES if rule.package == "agl_algos")


def test_checker_counts_top_level_try_if_with_and_class_bodies_as_import_time(tmp_path: Path) -> None:
    _algos_module(
        tmp_path,
        "import contextlib\n"
        "try:\n    import verl\nexcept ImportError:\n    pass\n"
        "if contextlib:\n    import verl.protocol\n"
        "with contextlib.suppress(ImportError):\n    import verl.utils\n"
        "class Loss:\n    import verl.trainer\n"
        "import httpx\n"
        "if TYPE_CHECKING:\n    pass\nelse:\n    import verl.workers\n",
    )
    where = "packages/agl-algos/src/agl_algos/mod.py"
    assert _violations(ALGOS, tmp_path) == [
        f"{where}:3 imports verl: agl_algos may import verl only inside a function",
        f"{where}:7 imports verl.protocol: agl_algos may import verl only inside a function",
        f"{where}:9 imports verl.utils: agl_algos may import verl only inside a function",
        f"{where}:11 imports verl.trainer: agl_algos may import verl only inside a function",
        f"{where}:12 imports httpx: agl_algos may not import httpx",
        f"{where}:16 imports verl.workers: agl_algos may import verl only inside a function",
    ]


def test_checker_allows_function_bodies_and_type_checking_blocks(tmp_path: Path) -> None:
    _algos_module(
        tmp_path,
        "import typing\n"
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    import verl\n"
        "if typing.TYPE_CHECKING:\n    import verl.protocol\n"
        "def register():\n    import verl.utils\n"
        "class Loss:\n    async def run(self):\n        import verl.trainer\n",
    )
    assert _violations(ALGOS, tmp_path) == []


TRAINER_WORKER_MODULES = (
    "agl_trainer.verl_glue.workers",
    "agl_trainer.verl_glue.cpu_platform",
    "agl_trainer.verl_glue.actor_worker",
)
"""Within agl_trainer, each of these may import the ones after it, never one before it (no cycle)."""


def test_trainer_worker_modules_import_one_way() -> None:
    src = ROOT / "packages" / "agl-trainer" / "src"
    backwards: list[str] = []
    for position, module in enumerate(TRAINER_WORKER_MODULES):
        path = src / f"{module.replace('.', '/')}.py"
        for imp in _imports_of(path, src, str(path.relative_to(ROOT))):
            if imp.module in TRAINER_WORKER_MODULES[:position]:
                backwards.append(str(imp))
    assert backwards == []


def _module_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Every module of the five packages and the modules of ours it names in an import statement
    (under ``if TYPE_CHECKING`` or in a function body too: a circle there is a circle in the design)."""
    paths = {
        _module_name(path, src): (path, src)
        for src in sorted((root / "packages").glob("*/src"))
        for path in sorted(src.rglob("*.py"))
    }
    graph: dict[str, set[str]] = {}
    for module, (path, src) in paths.items():
        named = {imp.module for imp in _imports_of(path, src, str(path.relative_to(root)))}
        graph[module] = {other for other in named if other in paths and other != module}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles of ``graph``: its strongly connected components of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for other in sorted(graph[module]):
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in on_stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            component: list[str] = []
            while not component or component[-1] != module:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                found.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return found


def test_no_module_imports_itself_through_others() -> None:
    assert _circles(_module_graph()) == []


def test_circle_finder_names_the_modules_of_a_circle(tmp_path: Path) -> None:
    package = tmp_path / "packages" / "agl-types" / "src" / "agl_types"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from agl_types.b import B\nA = 1\n")
    (package / "b.py").write_text("def f():\n    from agl_types import a\nB = 2\n")
    (package / "c.py").write_text("from agl_types.a import A\n")
    assert _circles(_module_graph(tmp_path)) == [["agl_types.a", "agl_types.b"]]


@dataclass(frozen=True)
class TrainerRule:
    """Inside agl_trainer: no module in ``scope`` (each a module and those under it), save those in
    ``exempt``, imports a module under ``banned``; anywhere, or only at import time when ``lazy_ok``."""

    scope: tuple[str, ...]
    banned: tuple[str, ...]
    exempt: tuple[str, ...] = ()
    lazy_ok: bool = False


def _under(module: str, prefixes: tuple[str, ...]) -> str | None:
    """The first of ``prefixes`` that is ``module`` or a package holding it."""
    return next((p for p in prefixes if module == p or module.startswith(f"{p}.")), None)


TRAINER_RULES = {
    # Settings are plain values read from the config; whoever builds behaviour from them sits above.
    "settings": TrainerRule(
        ("agl_trainer.settings",), ("agl_trainer.serving", "agl_trainer.step", "agl_trainer.local")
    ),
    # The production run starts nothing local; only the embedded default (agl_trainer.local) does.
    "production": TrainerRule(
        ("agl_trainer",), ("agl_trainer.local",), exempt=("agl_trainer.local", "agl_trainer.cli")
    ),
    # The console script starts the embedded default, so it imports it, but on demand only.
    "cli": TrainerRule(("agl_trainer.cli",), ("agl_trainer.local",), lazy_ok=True),
}


def _trainer_violations(rule: TrainerRule, root: Path = ROOT) -> list[str]:
    """Every import statement of agl_trainer (under ``root/packages``) that breaks ``rule``, once per line."""
    src = root / "packages" / "agl-trainer" / "src"
    problems: dict[tuple[str, int], str] = {}
    for path in sorted((src / "agl_trainer").rglob("*.py")):
        module = _module_name(path, src)
        if not _under(module, rule.scope) or _under(module, rule.exempt):
            continue
        for imp in _imports_of(path, src, str(path.relative_to(root))):
            banned = _under(imp.module, rule.banned)
            if banned and (imp.import_time or not rule.lazy_ok):
                when = " at import time" if rule.lazy_ok else ""
                problems.setdefault((imp.shown, imp.line), f"{imp}: {module} may not import {banned}{when}")
    return list(problems.values())


@pytest.mark.parametrize("name", TRAINER_RULES)
def test_trainer_modules_respect_inner_layering(name: str) -> None:
    assert _trainer_violations(TRAINER_RULES[name]) == []


def test_inner_checker_bans_lazy_imports_unless_the_rule_allows_them(tmp_path: Path) -> None:
    package = tmp_path / "packages" / "agl-trainer" / "src" / "agl_trainer"
    (package / "settings").mkdir(parents=True)
    (package / "settings" / "server.py").write_text(
        "def build():\n    from agl_trainer.serving import drain\n"
    )
    (package / "cli.py").write_text(
        "from agl_trainer.local.toy_task import ToolLatency\ndef run():\n    from agl_trainer.local import demo\n"
    )
    (package / "trainer.py").write_text("def run():\n    from agl_trainer import local\n")
    found = {name: _trainer_violations(rule, tmp_path) for name, rule in TRAINER_RULES.items()}
    src = "packages/agl-trainer/src/agl_trainer"
    assert found == {
        "settings": [
            f"{src}/settings/server.py:2 imports agl_trainer.serving: agl_trainer.settings.server may not import agl_trainer.serving"
        ],
        "production": [
            f"{src}/trainer.py:2 imports agl_trainer.local: agl_trainer.trainer may not import agl_trainer.local"
        ],
        "cli": [
            f"{src}/cli.py:1 imports agl_trainer.local.toy_task: agl_trainer.cli may not import agl_trainer.local at import time"
        ],
    }


def test_importing_the_cli_loads_nothing_of_the_embedded_default() -> None:
    probe = "import agl_trainer.cli, sys; print(sorted(m for m in sys.modules if m.startswith('agl_trainer.local')))"
    loaded = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert loaded == "[]", f"importing agl_trainer.cli loaded {loaded}"


CONFIG_READERS = ("agl_trainer.settings", "agl_trainer.assembly", "agl_trainer.local.demo")
"""The modules of agl-trainer that may read the Hydra config (omegaconf): the settings it is mapped
onto once, the assembly, and the embedded default's assembly. verl's glue hands verl its own
config and names its type only under ``if TYPE_CHECKING``."""


def test_only_the_settings_and_the_assembly_import_omegaconf() -> None:
    src = ROOT / "packages" / "agl-trainer" / "src"
    readers: list[str] = []
    for path in sorted((src / "agl_trainer").rglob("*.py")):
        module = _module_name(path, src)
        if any(module == allowed or module.startswith(f"{allowed}.") for allowed in CONFIG_READERS):
            continue
        imports = _imports_of(path, src, str(path.relative_to(ROOT)))
        readers += [str(imp) for imp in imports if imp.root == "omegaconf" and imp.import_time]
    assert readers == []
