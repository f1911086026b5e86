"""The package's shape, checked statically (``ast``, nothing imported):

- no import circle between modules of ``rlserve/``. Every import counts: module level,
  inside functions, and under ``if TYPE_CHECKING:``. A function-local or type-only import
  does not make a circle harmless, it only hides it: the seven circles issue 34 listed were
  all of that kind (a module-level circle fails at import and no test would pass), so a
  module-level-only check would have passed on that tree. An import names the module it
  reaches (``from a.b import c``: ``a.b.c`` when that is a module, else ``a.b``); the
  packages above it are not counted as imported, since a package ``__init__`` that exports
  lazily (``rlserve``, ``rlserve.transfer``) would otherwise close a circle with every module
  below it.
- no module but ``rlserve/envs.py`` reads an ``RLSERVE_*`` environment variable: no
  ``os.environ.get / [] / in / pop / setdefault`` or ``os.getenv`` with such a name, written
  out or held in a module-level constant. Setting one (``env["RLSERVE_X"] = ...``,
  ``os.environ[...] = ...`` for a child process) is a write and allowed.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PREFIX = "RLSERVE_"


def _modules(root: Path, package: str = "rlserve") -> dict[str, Path]:
    out = {}
    for p in sorted((root / package).rglob("*.py")):
        parts = list(p.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


def _resolve(name: str, mods: dict[str, Path]) -> str | None:
    while name:
        if name in mods:
            return name
        name = name.rpartition(".")[0]
    return None


def import_graph(root: Path, package: str = "rlserve") -> dict[str, dict[str, int]]:
    """``{module: {imported module: line}}`` over every import statement of every module
    below ``root / package`` (relative imports resolved)."""
    mods = _modules(root, package)
    graph: dict[str, dict[str, int]] = {}
    for mod, path in mods.items():
        pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        edges: dict[str, int] = {}
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = pkg.split(".")[: len(pkg.split(".")) - (node.level - 1)]
                    base = ".".join(up + ([node.module] if node.module else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            for t in targets:
                r = _resolve(t, mods)
                if r is not None and r != mod:
                    edges.setdefault(r, node.lineno)
        graph[mod] = edges
    return graph


def circles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _describe(comp: list[str], graph: dict[str, dict[str, int]]) -> str:
    return "; ".join(f"{a} -> {b} (line {graph[a][b]})" for a in comp for b in sorted(graph[a]) if b in comp)


def test_no_import_circle_in_rlserve():
    graph = import_graph(ROOT)
    assert len(graph) > 100  # the walk saw the package (158 modules when this was written)
    found = circles(graph)
    assert not found, "import circles: " + " | ".join(_describe(c, graph) for c in found)


def test_circle_check_sees_function_level_and_type_checking_imports(tmp_path):
    pkg = tmp_path / "rlserve"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from rlserve.sub import b\n")
    (pkg / "sub" / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .. import a\n")
    (pkg / "c.py").write_text("import rlserve.a\n")
    graph = import_graph(tmp_path)
    assert graph["rlserve.a"] == {"rlserve.sub.b": 2} and graph["rlserve.sub.b"] == {"rlserve.a": 3}
    assert circles(graph) == [["rlserve.a", "rlserve.sub.b"]]


def _str_constants(tree: ast.Module) -> dict[str, str]:
    """Module-level ``NAME = "RLSERVE_..."`` assignments."""
    out = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            for t in node.targets:
                if isinstance(t, ast.Name) and node.value.value.startswith(PREFIX):
                    out[t.id] = node.value.value
    return out


def _names_variable(node: ast.AST | None, constants: dict[str, str]) -> bool:
    """Whether the expression is (or starts) an ``RLSERVE_*`` name: a literal, an f-string or
    ``+`` starting with one, or a name / attribute bound to one at some module's top level."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str) and node.value.startswith(PREFIX)
    if isinstance(node, ast.JoinedStr):
        return bool(node.values) and _names_variable(node.values[0], constants)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _names_variable(node.left, constants)
    if isinstance(node, ast.Name):
        return node.id in constants
    if isinstance(node, ast.Attribute):
        return node.attr in constants
    return False


def _is_environ(node: ast.AST) -> bool:
    """``os.environ`` or a bare ``environ`` (``from os import environ``)."""
    return (isinstance(node, ast.Attribute) and node.attr == "environ") or (
        isinstance(node, ast.Name) and node.id == "environ")


def env_reads(source: str, constants: dict[str, str]) -> list[int]:
    """Lines of ``source`` that read an ``RLSERVE_*`` environment variable."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        key = None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
            f = node.func
            if _is_environ(f.value) and f.attr in ("get", "pop", "setdefault"):
                key = node.args[0]
            elif f.attr == "getenv" and isinstance(f.value, ast.Name) and f.value.id == "os":
                key = node.args[0]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getenv" and node.args:
            key = node.args[0]
        elif isinstance(node, ast.Subscript) and _is_environ(node.value) and isinstance(node.ctx, ast.Load):
            key = node.slice
        elif isinstance(node, ast.Compare) and any(_is_environ(c) for c in node.comparators):
            key = node.left
        if key is not None and _names_variable(key, constants):
            lines.append(node.lineno)
    return lines


def test_only_the_registry_reads_rlserve_variables():
    mods = _modules(ROOT)
    trees = {m: ast.parse(p.read_text(), str(p)) for m, p in mods.items()}
    constants: dict[str, str] = {}
    for tree in trees.values():
        constants.update(_str_constants(tree))
    offenders = {m: env_reads(mods[m].read_text(), constants) for m in mods if m != "rlserve.envs"}
    offenders = {m: lines for m, lines in offenders.items() if lines}
    assert not offenders, f"RLSERVE_* read outside rlserve/envs.py (module: lines): {offenders}"


def test_env_read_check_tells_reads_from_writes():
    constants = {"ENV": "RLSERVE_X"}
    reads = """import os
from os import environ, getenv
a = os.environ.get("RLSERVE_A")
b = os.environ["RLSERVE_B"]
c = "RLSERVE_C" in os.environ
d = os.getenv("RLSERVE_D", "1")
e = environ.get(ENV)
f = mod.ENV in os.environ
g = getenv(f"RLSERVE_{name}")
"""
    assert env_reads(reads, constants) == [3, 4, 5, 6, 7, 8, 9]
    writes = """import os
env = dict(os.environ)
env["RLSERVE_A"] = "1"
os.environ["RLSERVE_B"] = "0"
subprocess.run(cmd, env={**os.environ, "RLSERVE_C": "1"})
x = os.environ.get("OMP_NUM_THREADS")
"""
    assert env_reads(writes, constants) == []


def test_every_variable_used_is_declared_and_every_declared_one_is_used():
    from rlserve import envs

    used = set()
    for p in _modules(ROOT).values():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "envs":
                if node.attr.startswith(PREFIX):
                    used.add(node.attr)
    assert used == set(envs.VARIABLES)


def test_registry_reads_at_access_and_names_the_variable_in_errors(monkeypatch):
    from rlserve import envs

    monkeypatch.delenv("RLSERVE_CPU_MICROBATCHES", raising=False)
    assert envs.RLSERVE_CPU_MICROBATCHES is None
    monkeypatch.setenv("RLSERVE_CPU_MICROBATCHES", "")
    assert envs.RLSERVE_CPU_MICROBATCHES is None  # empty reads as unset
    monkeypatch.setenv("RLSERVE_CPU_MICROBATCHES", "3")
    assert envs.RLSERVE_CPU_MICROBATCHES == 3
    monkeypatch.setenv("RLSERVE_CPU_MICROBATCHES", "0")
    try:
        envs.RLSERVE_CPU_MICROBATCHES
    except ValueError as e:
        assert str(e) == "RLSERVE_CPU_MICROBATCHES must be an integer >= 1, got '0'"
    else:
        raise AssertionError("0 micro-batches accepted")
    monkeypatch.setenv("RLSERVE_FUSED_KERNELS", "0")
    assert envs.RLSERVE_FUSED_KERNELS is False
    monkeypatch.setenv("RLSERVE_ASYNC_SCHEDULING", "yes")
    assert envs.RLSERVE_ASYNC_SCHEDULING is None  # only 0 / 1 decide
    monkeypatch.delenv("RLSERVE_ENGINE_MODE", raising=False)
    assert envs.RLSERVE_ENGINE_MODE == "process"
    assert not hasattr(envs, "RLSERVE_SKINNY_GEMM_MAX_M")


def test_environment_page_lists_exactly_the_declared_variables():
    """``docs/environment.md``'s tables above "Tests and benchmarks" (the variables of the package)
    have one row per variable of ``rlserve/envs.py``."""
    import re

    from rlserve import envs

    page = (ROOT / "docs" / "environment.md").read_text().split("## Tests and benchmarks")[0]
    rows = re.findall(r"^\| `(RLSERVE_[A-Z0-9_]+)` \|", page, re.M)
    assert len(rows) == len(set(rows))
    assert set(rows) == set(envs.VARIABLES)


def test_readme_test_command_runs_every_triton_interpreter_module():
    """The Triton interpreter tests skip in a whole-suite run (Triton is imported before
    ``TRITON_INTERPRET=1`` can be set), so the README's test command (what ``.ci/run`` runs) names
    them in a second ``pytest`` run: every test module importing ``tests.triton_interp`` must be
    named there, or CI would never run it."""
    readme = (ROOT / "README.md").read_text()
    after = readme.split("<!-- test-command -->", 1)[1]
    command = next(line for line in after.splitlines() if line.strip() and not line.startswith("```"))
    named = set(re.findall(r"tests/test_\w+\.py", command))
    users = {f"tests/{p.name}" for p in (ROOT / "tests").glob("test_*.py")
             if re.search(r"^import tests\.triton_interp\b", p.read_text(), re.M)}
    assert len(users) >= 6, users  # the six modules of 2026-12-06: the search itself must find them
    assert users <= named, f"not named in the README's test command: {sorted(users - named)}"
    for name in named:
        assert (ROOT / name).is_file(), name
