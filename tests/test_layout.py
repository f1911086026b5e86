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
- no module but ``rlserve/envs.py`` reads an ``RLSERVE_*`` or ``VLLM_*`` environment variable: no
  ``os.environ.get / [] / in / pop / setdefault`` or ``os.getenv`` with such a name, written
  out or held in a module-level constant. Setting one (``env["RLSERVE_X"] = ...``,
  ``os.environ[...] = ...`` for a child process) is a write and allowed. Every other variable a
  module reads by name is listed in ``docs/environment.md``'s "Other variables rlserve reads".
- ``docs/environment.md`` has one row per variable of ``rlserve/envs.py``, with the registry's
  default and its "read at import".
- no module of ``rlserve/`` is longer than :data:`MAX_LINES` lines (the project's "small files,
  one job each").
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PREFIX = "RLSERVE_"
#: the variables only rlserve/envs.py reads: rlserve's own and the vLLM ones it honours (envs.VLLM_VARIABLES)
PREFIXES = (PREFIX, "VLLM_")
#: the longest a module of rlserve/ may be (lines): the brief's "<= ~500"
MAX_LINES = 500


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
                if isinstance(t, ast.Name) and node.value.value.startswith(PREFIXES):
                    out[t.id] = node.value.value
    return out


def _names_variable(node: ast.AST | None, constants: dict[str, str]) -> bool:
    """Whether the expression is (or starts) an ``RLSERVE_*`` / ``VLLM_*`` name: a literal, an f-string or
    ``+`` starting with one, or a name / attribute bound to one at some module's top level."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str) and node.value.startswith(PREFIXES)
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


def env_keys(source: str) -> list[tuple[int, ast.AST]]:
    """``(line, key expression)`` of every environment read in ``source``: ``os.environ.get / pop /
    setdefault``, ``os.getenv`` / ``getenv``, ``os.environ[key]`` as a value, ``key in os.environ``."""
    out = []
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
        if key is not None:
            out.append((node.lineno, key))
    return out


def env_reads(source: str, constants: dict[str, str]) -> list[int]:
    """Lines of ``source`` that read an ``RLSERVE_*`` / ``VLLM_*`` environment variable."""
    return [line for line, key in env_keys(source) if _names_variable(key, constants)]


def test_only_the_registry_reads_rlserve_variables():
    mods = _modules(ROOT)
    trees = {m: ast.parse(p.read_text(), str(p)) for m, p in mods.items()}
    constants: dict[str, str] = {}
    for tree in trees.values():
        constants.update(_str_constants(tree))
    offenders = {m: env_reads(mods[m].read_text(), constants) for m in mods if m != "rlserve.envs"}
    offenders = {m: lines for m, lines in offenders.items() if lines}
    assert not offenders, f"RLSERVE_* / VLLM_* read outside rlserve/envs.py (module: lines): {offenders}"


def test_every_other_variable_read_is_on_the_environment_page():
    """A module of rlserve/ that reads another program's variable by name (``OMP_NUM_THREADS``, ``CC``...)
    is listed in docs/environment.md's "Other variables rlserve reads", so that page names every variable
    that changes what rlserve does."""
    page = (ROOT / "docs" / "environment.md").read_text()
    other = page.split("## Other variables rlserve reads", 1)[1]
    listed = set(re.findall(r"`([A-Z][A-Z0-9_]+)(?:=[^`]*)?`", other))
    read = {}
    for mod, path in _modules(ROOT).items():
        if mod == "rlserve.envs":
            continue
        for line, key in env_keys(path.read_text()):
            if isinstance(key, ast.Constant) and isinstance(key.value, str):
                read.setdefault(key.value, f"{mod}:{line}")
    assert {"OMP_NUM_THREADS", "CC", "XDG_CACHE_HOME"} <= set(read)  # the walk found them (2026-12-07)
    missing = {name: where for name, where in read.items() if name not in listed}
    assert not missing, f"read in rlserve/ but not on docs/environment.md's 'Other variables' list: {missing}"


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
h = os.environ.get("VLLM_SERVER_DEV_MODE", "")
"""
    assert env_reads(reads, constants) == [3, 4, 5, 6, 7, 8, 9, 10]
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
                if node.attr.startswith(PREFIXES):
                    used.add(node.attr)
    assert used == set(envs.VARIABLES) | set(envs.VLLM_VARIABLES)


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


def _page_rows() -> dict[str, tuple[str, str]]:
    """``{variable: (type cell, default cell)}`` of docs/environment.md's tables above "Tests and
    benchmarks" (the package's variables: rlserve's own and vLLM's it honours)."""
    page = (ROOT / "docs" / "environment.md").read_text().split("## Tests and benchmarks")[0]
    cell = r"((?:[^|\\]|\\.)*)"  # a cell: no bare '|' (an escaped one, \|, is part of it)
    rows = re.findall(rf"^\| `((?:RLSERVE|VLLM)_[A-Z0-9_]+)` \|{cell}\|{cell}\|", page, re.M)
    out = {name: (typ.strip(), default.strip()) for name, typ, default in rows}
    assert len(out) == len(rows), "a variable has two rows"
    return out


def test_environment_page_lists_exactly_the_declared_variables():
    """``docs/environment.md``'s tables above "Tests and benchmarks" (the variables of the package)
    have one row per variable of ``rlserve/envs.py``."""
    from rlserve import envs

    assert set(_page_rows()) == set(envs.VARIABLES) | set(envs.VLLM_VARIABLES)


def page_default_matches(default, cell: str) -> bool:
    """Whether a docs default ``cell`` states the registry's ``default``: ``True`` "on...", ``False``
    "off..." or `` `0` ``, a string or an integer written first in backquotes (or a bare integer). A
    ``None`` or empty default (the value is decided where it is used: a flag, the machine) must not read
    as a fixed switch state or be blank."""
    if default is True:
        return cell.startswith("on")
    if default is False:
        return cell.startswith("off") or cell == "`0`"
    if default is None or default == "":
        return bool(cell) and not re.fullmatch(r"on|`1`", cell)
    if isinstance(default, int):
        return re.match(rf"`?{default}\b`?", cell) is not None
    return cell.startswith(f"`{default}`")


def test_environment_page_states_each_default_and_read_at_import():
    """Every row's default column states the default ``rlserve/envs.py`` declares (:func:`page_default_matches`),
    and a variable's type column says "read at import" exactly when its declaration's meaning does."""
    from rlserve import envs

    rows = _page_rows()
    declared = {**envs.VARIABLES, **envs.VLLM_VARIABLES}
    wrong = {n: (v.default, rows[n][1]) for n, v in declared.items() if not page_default_matches(v.default, rows[n][1])}
    assert not wrong, f"docs/environment.md's default differs from rlserve/envs.py's (variable: (envs, page)): {wrong}"
    at_import = {n for n, v in declared.items() if "read at import" in v.meaning}
    assert len(at_import) >= 6  # the six of 2026-12-07 (fused kernels, sampler, GEMV, GEMM rows and fold, CPU layer)
    assert {n for n, (typ, _) in rows.items() if "read at import" in typ} == at_import


def test_default_check_tells_a_stated_default_from_another():
    assert page_default_matches(True, "on (since session 19)") and not page_default_matches(True, "off")
    assert page_default_matches(False, "off") and page_default_matches(False, "`0`")
    assert not page_default_matches(False, "on")
    assert page_default_matches("auto", "`auto`") and not page_default_matches("auto", "`nobind`")
    assert page_default_matches(0, "`0`") and not page_default_matches(0, "`16`")
    assert page_default_matches(None, "unset (no key)") and not page_default_matches(None, "on")
    assert not page_default_matches(None, "")


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


#: modules over MAX_LINES still waiting for their split, with their length when this was written: they may
#: shrink, not grow; a module leaves this list once it is split
LONG_MODULES: dict[str, int] = {}


def test_no_module_is_over_the_line_limit():
    lengths = {m: len(p.read_text().splitlines()) for m, p in _modules(ROOT).items()}
    assert len(lengths) > 100
    over = {m: n for m, n in lengths.items() if n > max(MAX_LINES, LONG_MODULES.get(m, 0))}
    assert not over, f"modules over {MAX_LINES} lines (split them along one job each): {over}"
    assert all(lengths.get(m, 0) > MAX_LINES for m in LONG_MODULES), "a listed module is short now: drop it"
