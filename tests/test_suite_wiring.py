"""The suite's structure holds.

- Scheduling (tests/conftest.py): under ``--dist loadgroup`` a multi-process test carries its
  group, so xdist runs all of them on one worker, one after another.
- Sharing: test modules share code through ``tests/helpers/`` alone. No test module (nor helper)
  imports a test module, so a test module's tests are collected once and no test reads state
  another test module left behind; and none edits ``sys.path`` (pyproject.toml's ``pythonpath``
  puts the repository root there, for ``tests.helpers`` and ``examples``).
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
# an import written out in a string (a generated factory file, a script run by a subprocess)
IMPORT_IN_STRING = re.compile(r"^\s*(?:from|import)\s+((?:tests\.)?test_\w+)", re.M)


def imports_of_test_modules(source: str, test_modules: set) -> list:
    """(line, what) for every import of a test module in ``source``, and every ``sys.path`` edit.

    >>> imports_of_test_modules("import os\\nfrom tests.helpers.exactness import close", {"test_a"})
    []
    """
    found = []

    def is_test_module(name: str) -> bool:
        parts = name.split(".")
        parts = parts[1:] if parts[0] == "tests" and len(parts) > 1 else parts
        return parts[0] in test_modules

    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, f"import {a.name}") for a in node.names if is_test_module(a.name)]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if is_test_module(node.module):
                found.append((node.lineno, f"from {node.module} import ..."))
            elif node.module == "tests":
                found += [(node.lineno, f"from tests import {a.name}") for a in node.names if a.name in test_modules]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                ast.unparse(node.func.value) == "sys.path":
            found.append((node.lineno, f"sys.path.{node.func.attr}(...)"))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            found += [(node.lineno, f"a string that imports {m}") for m in IMPORT_IN_STRING.findall(node.value)
                      if is_test_module(m)]
    return found


def test_no_test_module_imports_another_or_edits_sys_path():
    modules = {p.stem for p in TESTS.glob("test_*.py")}
    files = sorted(TESTS.glob("*.py")) + sorted((TESTS / "helpers").rglob("*.py"))
    bad = [f"{path.relative_to(TESTS.parent)}:{line}: {what}" for path in files
           for line, what in imports_of_test_modules(path.read_text(), modules)]
    assert not bad, "shared code belongs in tests/helpers/:\n" + "\n".join(bad)


@pytest.mark.parametrize("source", [
    "import test_a", "import tests.test_a as t", "from test_a import x", "from tests.test_a import x",
    "from tests import test_a", "def f():\n    from test_a import x", "sys.path.insert(0, 'tests')",
    "sys.path.append('x')", "FACTORY = '''import torch\nfrom test_a import Model\n'''",
])
def test_the_sharing_check_sees_every_form(source):
    assert imports_of_test_modules(source, {"test_a"}), source


@pytest.mark.slow
def test_multiprocess_tests_share_one_xdist_group(request):
    if not getattr(request.config.option, "loadgroup", False):
        pytest.skip("only meaningful on an xdist worker under --dist loadgroup (scripts/test.sh)")
    # xdist groups by a "@<group>" suffix on the node id; a pytest that ignores the suffix
    # (9.2 with pytest-xdist 3.8) spreads the group over every worker without a word
    assert request.node.nodeid.endswith("@multiprocess"), request.node.nodeid
