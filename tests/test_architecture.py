"""The layout the design asks for: imports point one way, the analytic side needs no JAX, folders name a truth."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("lab", "kernels")
# Which packages each part of the lab may import (DESIGN.md: cli -> run -> report, measure, compile -> kernels,
# predict -> core; kernels read only lab.core). A package may always import itself.
ALLOWED = {
    "lab.core": set(),
    "lab.predict": {"lab.core"},
    "lab.studies": {"lab.core", "lab.predict"},
    "lab.compile": {"lab.core", "lab.predict", "kernels"},
    "lab.measure": {"lab.core", "lab.predict", "lab.compile", "kernels"},
    "lab.report": {"lab.core", "lab.predict", "lab.compile"},
    "lab.run": {"lab.core", "lab.predict", "lab.compile", "lab.measure", "lab.report", "kernels"},
    "lab.cli": {"lab", "lab.core", "lab.predict", "lab.studies", "lab.compile", "lab.measure", "lab.report", "lab.run"},
    "kernels": {"lab.core"},
}


def _modules() -> dict[str, Path]:
    mods = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            mods[name.removesuffix(".__init__")] = path
    return mods


def _imports(name: str, path: Path, mods: dict[str, Path]) -> set[str]:
    """The project modules ``name`` imports, anywhere in its body (imports inside functions count too)."""
    is_pkg = path.name == "__init__.py"
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = name.split(".") if is_pkg else name.split(".")[:-1]
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join([*parts, base] if base else parts)
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in mods:
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {m: _imports(m, p, mods) for m, p in mods.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle, as the modules along it, or None (depth-first search with colours)."""
    colour: dict[str, int] = {}
    stack: list[str] = []

    def visit(v: str) -> list[str] | None:
        colour[v] = 1
        stack.append(v)
        for w in sorted(graph[v]):
            if colour.get(w) == 1:
                return [*stack[stack.index(w) :], w]
            if w not in colour and (found := visit(w)):
                return found
        colour[v] = 2
        stack.pop()
        return None

    for v in sorted(graph):
        if v not in colour and (found := visit(v)):
            return found
    return None


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[0] if parts[0] == "kernels" else ".".join(parts[:2]) if len(parts) > 1 else "lab"


def test_the_graph_builder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle_between_modules_of_lab_and_kernels():
    graph = _graph()
    assert len(graph) > 60  # the walk found the packages
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])


def test_imports_point_down_the_three_truths():
    wrong = []
    for module, targets in _graph().items():
        if module in ("lab", "lab.__main__"):  # the version, and `python -m lab`
            continue
        pkg = _package(module)
        for t in targets:
            tp = _package(t)
            if tp != pkg and tp not in ALLOWED[pkg]:
                wrong.append(f"{module} -> {t}")
    assert not wrong, wrong


def test_every_module_sits_in_a_package_that_names_its_truth():
    loose = [p.name for p in (ROOT / "lab").glob("*.py") if p.name not in ("__init__.py", "__main__.py")]
    assert not loose, f"modules directly under lab/: {loose}"
    assert {p.name for p in (ROOT / "lab").iterdir() if p.is_dir() and not p.name.startswith("__")} == {
        "core",
        "predict",
        "studies",
        "compile",
        "measure",
        "report",
        "run",
        "cli",
    }


@pytest.mark.parametrize("package", ["lab.core", "lab.predict", "lab.studies"])
def test_the_analytic_side_imports_no_jax(package):
    """Every module of the package, imported in a fresh interpreter, leaves JAX (and numpy's GPU cousins) out."""
    names = sorted(m for m in _modules() if m == package or m.startswith(package + "."))
    code = "import importlib, sys\n"
    code += "".join(f"importlib.import_module({n!r})\n" for n in names)
    code += "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'flax', 'optax'))\n"
    code += "print(len(bad), bad[:5])\n"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("0 "), f"{package} imported {out.stdout.strip()}"


def test_analytic_commands_and_the_experiment_loader_start_no_jax():
    code = (
        "import sys\n"
        "from lab.cli.main import main\n"
        "from lab.run.experiment import load_experiment\n"
        "main(['train', 'estimate', '--plan', 'experiments/train_fsdp_tp.toml', '--hardware', 'h100', '--json'])\n"
        "load_experiment('experiments/decode_tp.toml')\n"
        "assert 'jax' not in sys.modules, 'jax was imported'\n"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr


def _start_up_tricks(tree: ast.AST) -> list[str]:
    """Assignments into ``sys.modules``, ``marshal`` imports and collector switches (``gc.freeze``/``disable``) in a
    module's syntax tree: what a start-up benchmark once bent product code into."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
            found += [f"line {node.lineno}: imports marshal" for n in names if n == "marshal"]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = node.func.value
            if isinstance(owner, ast.Name) and owner.id == "gc" and node.func.attr in ("freeze", "disable"):
                found.append(f"line {node.lineno}: gc.{node.func.attr}()")
        elif isinstance(node, ast.Assign | ast.Delete):
            for t in node.targets:
                if isinstance(t, ast.Subscript) and ast.unparse(t.value) == "sys.modules":
                    found.append(f"line {node.lineno}: {ast.unparse(t)}")
    return found


def test_the_start_up_check_finds_each_trick():
    code = "import marshal\nimport gc, sys\ngc.freeze()\nsys.modules['inspect'] = None\ndel sys.modules['x']\n"
    assert len(_start_up_tricks(ast.parse(code))) == 4


def test_product_code_patches_no_module_table_and_no_collector():
    """Issue 36: no start-up patching in lab/ or kernels/. The one registration allowed is a user's model file
    under its own fresh name (kernels/user_model.py), which importlib needs for dataclasses and pickling."""
    allowed = {("kernels.user_model", "sys.modules[name]")}
    bad = []
    for name, path in _modules().items():
        for hit in _start_up_tricks(ast.parse(path.read_text(encoding="utf-8"))):
            if not any(name == m and hit.endswith(t) for m, t in allowed):
                bad.append(f"{name} {hit}")
    assert bad == []


def _over(limit: int) -> list[tuple[Path, int]]:
    return [
        (p, n)
        for pkg in PACKAGES
        for p in sorted((ROOT / pkg).rglob("*.py"))
        if (n := len(p.read_text(encoding="utf-8").splitlines())) > limit
    ]


def test_no_module_is_over_600_lines_and_one_over_500_says_why():
    """The design's size rule: past 500 lines a module states its reason in a ``# Over 500 lines on purpose:``
    comment under its docstring; past 600 it is split."""
    too_long = [f"{p.relative_to(ROOT)} ({n})" for p, n in _over(600)]
    assert not too_long, f"split these: {too_long}"
    silent = [
        f"{p.relative_to(ROOT)} ({n})"
        for p, n in _over(500)
        if "# Over 500 lines on purpose: " not in p.read_text(encoding="utf-8")
    ]
    assert not silent, f"say why these are over 500 lines, or split them: {silent}"


def test_a_function_over_80_lines_says_why_in_its_docstring():
    long = []
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                long_function = isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and (
                    node.end_lineno - node.lineno >= 80
                )
                if long_function and "on purpose" not in (ast.get_docstring(node) or ""):
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}")
    assert not long, f"split these, or say in the docstring why they are long on purpose: {long}"
