"""Imports go one way: core <- passes <- cost <- façade (docs/architecture.md, "Layers").

Reads every module of the package with ``ast`` (module-level, function-local and TYPE_CHECKING
imports alike) and fails on any import of a project module in a higher layer, naming the file,
line and both layers. This table is the one place the layers are defined.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Layers, lowest first. A module belongs to the layer of the longest prefix that matches it.
LAYERS = [
    ("core", ["autoshard.mesh", "autoshard.ownership", "autoshard.runtime"]),
    ("passes", ["autoshard.passes"]),
    ("cost", ["autoshard.cost"]),
    ("facade", ["autoshard", "autoshard.api", "autoshard.plan", "autoshard.cli", "autoshard.__main__"]),
]
# Source folders and the package each one is imported as (pyproject.toml's package-dir).
FOLDERS = {"autoshard": "autoshard", "passes": "autoshard.passes", "cost": "autoshard.cost"}


def layer_of(module: str) -> int | None:
    best, rank = -1, None
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best:
                best, rank = len(p), i
    return rank


def project_modules() -> dict:
    """{dotted module name: file path} for every module of the package."""
    out = {}
    for folder, package in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([package, *parts])] = path
    return out


MODULES = project_modules()


def imported_modules(module: str, path: Path):
    """(line, imported project module, enclosing function or None) for every import in ``path``."""
    tree = ast.parse(path.read_text(), str(path))
    is_package = path.name == "__init__.py"
    parents = {}
    for node in ast.walk(tree):
        for child in ast.iter_child_nodes(node):
            parents[child] = node

    def function_of(node):
        while node in parents:
            node = parents[node]
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                return node
        return None

    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[:len(base) - (node.level - 1)]
                stem = ".".join(base + ([node.module] if node.module else []))
            else:
                stem = node.module
            for a in node.names:
                # "from pkg import sub" imports the submodule when there is one, else pkg itself
                sub = f"{stem}.{a.name}"
                targets.append(sub if sub in MODULES else stem)
        for t in targets:
            if t == "autoshard" or t.startswith("autoshard."):
                yield node.lineno, t, function_of(node)


def test_every_module_has_a_layer():
    missing = [m for m in MODULES if layer_of(m) is None]
    assert not missing, f"modules in no layer (add them to LAYERS in {Path(__file__).name}): {missing}"


def upward_imports(module: str, path: Path) -> list:
    """One line per import in ``path`` that reaches above ``module``'s layer."""
    own = layer_of(module)
    bad = []
    for line, target, _ in imported_modules(module, path):
        theirs = layer_of(target)
        if theirs is None or theirs > own:
            name = "unknown" if theirs is None else LAYERS[theirs][0]
            where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
            bad.append(f"{where}:{line}: {module} ({LAYERS[own][0]}) imports {target} ({name})")
    return bad


def test_the_export_runner_is_core():
    """An export runs where only the core is installed: its runner is in the core layer (so the
    test below holds it to core imports), and the run.py an export gets imports nothing else."""
    runner = [m for m in MODULES if m == "autoshard.runtime.export" or m.startswith("autoshard.runtime.export.")]
    assert "autoshard.runtime.export.cli" in runner and {layer_of(m) for m in runner} == {0}
    from autoshard.runtime.export.launcher import run_py_source
    tree = ast.parse(run_py_source(), "run.py")
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert {m for m in imported if m.startswith("autoshard")} == {"autoshard.runtime.export"}


def test_imports_go_down_the_layers():
    bad = [b for module, path in MODULES.items() for b in upward_imports(module, path)]
    assert not bad, "imports that go up a layer:\n" + "\n".join(bad)


def test_function_local_project_imports_say_why():
    """An import inside a function is for a heavy dependency deferred on purpose, with a
    ``# deferred:`` comment above its block; never to dodge an import cycle."""
    bad = []
    for module, path in MODULES.items():
        lines = path.read_text().splitlines()
        for line, target, fn in imported_modules(module, path):
            if fn is None:
                continue
            k = line - 2
            while k >= 0 and (not lines[k].strip() or lines[k].lstrip().startswith(("import ", "from ", "#"))):
                if lines[k].lstrip().startswith("# deferred:"):
                    break
                k -= 1
            if k < 0 or not lines[k].lstrip().startswith("# deferred:"):
                bad.append(f"{path.relative_to(ROOT)}:{line}: {target} imported inside {fn.name}()")
    assert not bad, "function-local imports without a '# deferred:' reason:\n" + "\n".join(bad)


@pytest.mark.parametrize("source, expected", [
    ("from autoshard.cost.model import CostModel\n", ["autoshard.cost.model"]),
    ("def f():\n    from autoshard import ownership, api\n", ["autoshard.ownership", "autoshard.api"]),
    ("from .. import plan\nimport autoshard\n", ["autoshard.plan", "autoshard"]),
])
def test_the_checker_sees_every_kind_of_import(tmp_path, source, expected):
    """The checker itself: module-level, function-local and relative imports are all read, and
    each upward one is reported."""
    f = tmp_path / "m.py"
    f.write_text(source)
    module = "autoshard.runtime.m"
    assert [t for _, t, _ in imported_modules(module, f)] == expected
    assert len(upward_imports(module, f)) == sum(t != "autoshard.ownership" for t in expected)
