"""``benchmarks/csrc_revision.py`` (the A/B scripts' builds of an old revision's C kernels): a
revision's top file comes with the files it includes OF THAT REVISION (transitively), and compiles
from them alone. ``cpu_gemm_ab.py`` used to compile an old ``cpu_team.c`` with ``-I`` this tree's
``csrc``: the "old" build mixed two revisions (and failed to compile where an included file's
function changed its arguments). A throwaway git repository with two revisions of three files."""

from __future__ import annotations

import ctypes
import shutil
import subprocess

import pytest

from benchmarks.csrc_revision import compile_lib, sources

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")

CSRC = "rlserve/layers/csrc"


def _commit(repo, files: dict[str, str], message: str) -> None:
    for name, text in files.items():
        (repo / CSRC / name).write_text(text)
    subprocess.run(["git", "add", "-A"], cwd=repo, check=True, capture_output=True)
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", message], cwd=repo,
                   check=True, capture_output=True)


def test_a_revision_is_built_from_its_own_included_files(tmp_path):
    repo = tmp_path / "repo"
    (repo / CSRC).mkdir(parents=True)
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True, capture_output=True)
    # top.c includes a.c, which includes b.c; the second revision changes b.c's function's arguments
    v1 = {"top.c": '#include "a.c"\nint top(void) { return a() * 10; }\n',
          "a.c": '#include "b.c"\nstatic int a(void) { return b(); }\n',
          "b.c": "static int b(void) { return 3; }\n"}
    _commit(repo, v1, "v1")
    _commit(repo, {"a.c": '#include "b.c"\nstatic int a(void) { return b(4); }\n',
                   "b.c": "static int b(int x) { return x + 1; }\n", "top.c": v1["top.c"] + "/* v2 */\n"}, "v2")

    old = sources("HEAD~1", repo, "top.c")
    assert old == v1  # every included file of that revision, none of the newer tree's
    new = sources("HEAD", repo, "top.c")
    assert new["b.c"] == "static int b(int x) { return x + 1; }\n" and set(new) == set(v1)

    for rev, files, want in (("v1", old, 30), ("v2", new, 50)):
        lib = compile_lib(files, "top.c", tmp_path / rev)
        lib.top.restype = ctypes.c_int
        assert lib.top() == want

    with pytest.raises(subprocess.CalledProcessError):  # a revision without the file
        sources("HEAD~1", repo, "missing.c")
