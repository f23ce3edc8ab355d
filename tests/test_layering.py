"""The layering of the compiler, checked on the source: which package may import which.

Data flows one way, capture -> analyze -> plan -> transform -> codegen -> run, and the code's
imports must say so (docs/architecture.md):

- the leaf vocabulary (errors, IR, placements, plan, schedules, units) imports nothing of autopar
  above it, so ``passes/`` and ``runtime/`` can use it without pulling in the front end;
- ``passes/`` never imports the planner, the API or the CLI;
- ``runtime/`` never imports the planner, the passes, the API or the CLI;
- no module imports a private name (``_x``) of another module;
- the import graph of autopar's modules has no cycle.

Every ``import`` statement counts, inside functions too (a lazy import is still a dependency);
imports under ``if TYPE_CHECKING:`` are annotations only and do not. The checker is tested on
a violating package it writes itself, so it cannot pass by finding nothing.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parent.parent
#: Source folder -> the package it installs as (setup.py's package-dir).
PACKAGES = {"autopar": "autopar", "passes": "autopar.passes", "runtime": "autopar.runtime"}

LEAF = ("autopar.errors", "autopar.ir", "autopar.solver", "autopar.sharding", "autopar.plan_types", "autopar.units",
        "autopar.cluster", "autopar.captured",
        "autopar._version", "autopar.runtime.schedules", "autopar.runtime.pipeline_actions",
        "autopar.runtime.schedule_builders")
PLANNER_API_CLI = ("autopar.planner", "autopar.api", "autopar.cli", "autopar.commands",
                   "autopar.demo", "autopar.compiler", "autopar.parallel_model")
#: (importer prefix, forbidden prefixes, why)
CONTRACTS = (
    ("autopar.passes", PLANNER_API_CLI, "passes never import the planner, API or CLI"),
    ("autopar.runtime", PLANNER_API_CLI + ("autopar.passes", "autopar.frontend",
                                           "autopar.tensor_parallel", "autopar.verify"),
     "the runtime never imports the planner, the passes or the front end"),
)


@dataclass(frozen=True)
class Import:
    importer: str
    imported: str
    names: tuple[str, ...]
    line: int


def _module_name(path: Path, root: Path) -> str:
    rel = path.relative_to(root)
    top = PACKAGES[rel.parts[0]]
    parts = list(rel.with_suffix("").parts[1:])
    if parts and parts[-1] == "__init__":
        parts.pop()
    return ".".join([top, *parts])


def _type_checking_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                for sub in ast.walk(child):
                    if hasattr(sub, "lineno"):
                        lines.add(sub.lineno)
    return lines


def collect_imports(root: Path) -> tuple[list[Import], set[str]]:
    """Every autopar import of every module under ``root``'s package folders."""
    imports: list[Import] = []
    modules: set[str] = set()
    for folder in PACKAGES:
        for path in sorted((root / folder).rglob("*.py")):
            name = _module_name(path, root)
            modules.add(name)
            tree = ast.parse(path.read_text(), str(path))
            skip = _type_checking_lines(tree)
            package = name if path.name == "__init__.py" else name.rpartition(".")[0]
            for node in ast.walk(tree):
                if getattr(node, "lineno", None) in skip:
                    continue
                if isinstance(node, ast.Import):
                    for alias in node.names:
                        if alias.name.startswith("autopar"):
                            imports.append(Import(name, alias.name, (), node.lineno))
                elif isinstance(node, ast.ImportFrom):
                    base = node.module or ""
                    if node.level:
                        anchor = package.split(".")
                        anchor = anchor[:len(anchor) - (node.level - 1)]
                        base = ".".join(anchor + ([base] if base else []))
                    if base.startswith("autopar"):
                        names = tuple(a.name for a in node.names)
                        imports.append(Import(name, base, names, node.lineno))
    return imports, modules


def _within(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def _target(imp: Import, modules: set[str]) -> list[str]:
    """The modules an import loads: ``from pkg import mod`` names a submodule."""
    out = [imp.imported] if imp.imported in modules else []
    out += [f"{imp.imported}.{n}" for n in imp.names if f"{imp.imported}.{n}" in modules]
    return out or [imp.imported]


def violations(root: Path) -> list[str]:
    imports, modules = collect_imports(root)
    found = []
    for imp in imports:
        targets = _target(imp, modules)
        where = f"{imp.importer} (line {imp.line}) imports"
        if _within(imp.importer, LEAF):
            for t in targets:
                if not _within(t, LEAF):
                    found.append(f"{where} {t}: the leaf vocabulary imports nothing above it")
        for importer, forbidden, why in CONTRACTS:
            if _within(imp.importer, (importer,)):
                for t in targets:
                    if _within(t, forbidden):
                        found.append(f"{where} {t}: {why}")
        for n in imp.names:
            if n.startswith("_") and not n.startswith("__") and imp.imported != imp.importer:
                found.append(f"{where} the private name {n} of {imp.imported}")
    graph = nx.DiGraph()
    for imp in imports:
        for t in _target(imp, modules):
            if t in modules and t != imp.importer and not imp.importer.startswith(t + "."):
                graph.add_edge(imp.importer, t)
    for cycle in nx.simple_cycles(graph):
        found.append("import cycle: " + " -> ".join(cycle + [cycle[0]]))
    return found


def test_autopar_keeps_its_layering():
    found = violations(ROOT)
    assert not found, "\n".join(found)


def test_the_checker_finds_each_kind_of_violation(tmp_path):
    for folder in PACKAGES:
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "__init__.py").write_text("")
    (tmp_path / "autopar" / "planner").mkdir()
    (tmp_path / "autopar" / "planner" / "__init__.py").write_text("")
    (tmp_path / "autopar" / "ir.py").write_text("from autopar.planner import search\n")
    (tmp_path / "passes" / "shard.py").write_text(
        "def f():\n    from autopar.api import parallelize\n")
    (tmp_path / "runtime" / "pipeline.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from autopar.api import x\n"
        "from autopar.passes.shard import f\n")
    (tmp_path / "autopar" / "a.py").write_text("from autopar.b import _hidden\n")
    (tmp_path / "autopar" / "b.py").write_text("import autopar.a\n_hidden = 1\n")
    found = "\n".join(violations(tmp_path))
    assert "autopar.ir (line 1) imports autopar.planner" in found
    assert "autopar.passes.shard (line 2) imports autopar.api" in found
    assert "autopar.runtime.pipeline (line 4) imports autopar.passes.shard" in found
    assert "(line 3)" not in found  # the TYPE_CHECKING import does not count
    assert "private name _hidden" in found
    assert "import cycle" in found and "autopar.a" in found


def test_ruff_finds_nothing():
    """Lint (pyflakes' rules, pyproject.toml's [tool.ruff]) over the whole repository."""
    import shutil
    import subprocess
    import sys

    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    assert ruff, "ruff is a test dependency (pip install -e '.[test]')"
    done = subprocess.run([ruff, "check", "--output-format", "concise", str(ROOT)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


def test_mypy_passes_on_the_vocabulary_and_the_artifacts():
    """mypy over the leaf vocabulary and the compiler's artifacts (pyproject.toml's
    [tool.mypy] files): the types at the phase boundaries are checked, not only written."""
    import shutil
    import subprocess
    import sys

    mypy = shutil.which("mypy", path=str(Path(sys.executable).parent)) or shutil.which("mypy")
    assert mypy, "mypy is a test dependency (pip install -e '.[test]')"
    done = subprocess.run([mypy, "--no-error-summary"], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
