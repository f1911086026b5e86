"""Start-up order of ``rlserve serve`` (issue 37: Qwen3-8B start-up to ready): the engine-core process gets its
arguments before the API process imports torch (its ~2 s import on the GPU machine used to delay the core's
whole start), and the phase lines of :mod:`rlserve.startup_log`."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import textwrap
import time

import pytest

from rlserve.startup_log import Phases, process_age

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
T = 120  # bound on every subprocess (seconds): only catches a hang


def _run(code: str, *args: str, **env_vars: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), **env_vars)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], env=env, capture_output=True,
                          text=True, timeout=T, cwd=REPO)


def test_process_age_counts_from_the_process_start():
    """A process that slept 0.5 s before asking is at least 0.5 s old, and no older than the time since its
    parent started it (+ 0.02 s: the kernel's start time is in 10 ms ticks, CLOCK_BOOTTIME's reading too)."""
    t0 = time.monotonic()
    out = _run("import time; time.sleep(0.5); from rlserve.startup_log import process_age; print(process_age())")
    elapsed = time.monotonic() - t0
    assert out.returncode == 0, out.stderr
    age = float(out.stdout)
    assert 0.5 <= age <= elapsed + 0.02, (age, elapsed)
    assert 0 < process_age()  # this process (pytest) as well


def test_phases_log_one_line_per_mark(caplog):
    log = logging.getLogger("rlserve.test_startup_order")
    with caplog.at_level(logging.INFO, logger=log.name):
        phases = Phases(log)
        time.sleep(0.05)
        first = phases.mark("first", "detail")
        second = phases.mark("second")
    assert first >= 0.05 and 0 <= second < first
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2
    assert lines[0].startswith(f"start-up: first took {first:.2f} s (detail; process age ")
    assert lines[1].startswith(f"start-up: second took {second:.2f} s (process age ")
    # the process's CPU seconds last (session 21): at least what this process has used before the mark
    cpu = float(re.fullmatch(r".*, CPU (\d+\.\d\d) s\)", lines[1]).group(1))
    assert 0 < cpu <= time.process_time() + 0.01, (cpu, lines[1])


def test_engine_config_does_not_import_torch():
    """What the API process builds before it hands the engine-core process its arguments: the config (also
    JSON-encoded as sent), without torch (fails on the code before: ``rlserve.config`` imported torch)."""
    out = _run("""
        import sys
        import msgspec
        from rlserve.config import EngineConfig
        c = EngineConfig(model="m", device="cuda", dtype="bfloat16", max_model_len=2056)
        wire = msgspec.json.encode(c)
        print("torch" in sys.modules, msgspec.json.decode(wire, type=EngineConfig) == c)
    """)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "True"], out.stdout


@pytest.mark.parametrize("overlap", ["1", "0"])
def test_serve_sends_the_core_its_arguments_before_importing_torch(tmp_path, overlap):
    """``rlserve serve --device cuda`` (the driver's device count stood in for: this machine may have no GPU)
    with ``RLSERVE_GPU_START_OVERLAP=1``: when the prestarted engine-core process is handed its arguments, the
    API process's main thread has not imported torch (it loads beside the engine's start). Fails on the code
    before (torch was imported by the config, the device check and the app's import first). Off (the
    default until measured on a GPU) the app's modules are imported before, and since session 21 they import no
    torch either (the metrics' buckets came from the engine's step module, which imports torch): the
    tokenizer's load imports it, beside the engine's start in both modes. The check stops the process there."""
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "model_type": "llama"}')
    out = _run("""
        import os, sys
        import rlserve.cli.serve_checks as serve_checks
        from rlserve.engine.front import core_spawn

        serve_checks.driver_device_count = lambda: 1

        def take(index, cmd):
            print("torch imported:", "torch" in sys.modules, "config sent:", "--config" in cmd, flush=True)
            core_spawn.discard_prestarted()
            os._exit(0)

        core_spawn.take_prestarted = take
        from rlserve.cli import main
        main(["serve", sys.argv[1], "--device", "cuda", "--port", "0", "--load-format", "dummy"])
        print("not reached")
    """, str(model), RLSERVE_GPU_START_OVERLAP=overlap)
    assert out.returncode == 0, out.stderr[-3000:]
    want = "torch imported: False config sent: True"
    assert out.stdout.strip().splitlines()[-1] == want, out.stdout + out.stderr[-3000:]


def test_app_import_does_not_import_torch():
    """The API process's app modules (``rlserve serve``'s ``_import_app``: the routes, the metrics) import no torch:
    the metrics' ``vllm:iteration_tokens_total`` buckets live in a torch-free module. Fails on the code before
    (``rlserve.server.vllm_metrics`` imported ``rlserve.engine.core.engine_step``, which imports torch)."""
    out = _run("""
        import sys
        import rlserve.cli.serve as serve
        serve._import_app()
        from rlserve.engine.core import iteration_tokens
        print("torch" in sys.modules, iteration_tokens.ITERATION_TOKENS_BUCKETS[-1])
    """)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "16384"], out.stdout


def test_prestarted_imports_name_their_parts():
    """A prestarted engine core's import phase is split into parts for its start-up line (torch, the engine's
    modules, transformers' config modules; on the CPU no CUDA / Triton part), then its CPU seconds."""
    out = _run("""
        from rlserve.engine.core.core_proc import warm_up_imports
        parts = warm_up_imports("cpu")
        print(" | ".join(name for name, _ in parts))
        print(all(s >= 0 for _, s in parts), parts[0][1] > 0.05, parts[-1][1] > 0.05)
    """)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "torch | engine modules | transformers configs | CPU", out.stdout
    assert lines[1] == "True True True", out.stdout


def test_uncached_bytecode_names_packages_that_compile_at_every_start(tmp_path):
    """A package imported from sources with no ``.pyc`` beside them, in a process that may not write one
    (``PYTHONDONTWRITEBYTECODE``), is named; once compiled (``compileall``) it is not; a package not imported
    is not looked at."""
    pkg = tmp_path / "s21pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("X = 1\n")
    code = """
        import sys
        sys.path.insert(0, sys.argv[1])
        import s21pkg
        from rlserve.startup_log import uncached_bytecode
        print(uncached_bytecode(("s21pkg", "not_imported_pkg")))
    """
    out = _run(code, str(tmp_path), PYTHONDONTWRITEBYTECODE="1")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "['s21pkg']", out.stdout
    import compileall

    assert compileall.compile_dir(str(pkg), quiet=1)
    out = _run(code, str(tmp_path), PYTHONDONTWRITEBYTECODE="1")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


def test_cpu_engine_build_imports_no_model_download_modules(tiny_model):
    """The engine-core's build on the CPU (the model, the C kernels' cache: rlserve.layers.cpu_build) imports none
    of the default model's download modules: cpu_build takes the cache root from rlserve.cache_root (session 23;
    before, rlserve.download and with it rlserve.default_model and rlserve.gguf_source: ~7-14 ms of CPU per start
    on the 2-core Xeon at load ~10). rlserve.download still names the same root."""
    out = _run("""
        import sys
        from rlserve.config import EngineConfig
        from rlserve.engine.core.llm_engine import LLMEngine
        from rlserve.layers import cpu_argmax

        e = LLMEngine(EngineConfig(model=sys.argv[1], device="cpu", dtype="float32"))
        assert cpu_argmax.warm_up()  # a C kernel loaded through cpu_build's cache
        print(sorted(m for m in ("rlserve.download", "rlserve.default_model", "rlserve.gguf_source") if m in sys.modules))
        from rlserve import cache_root, download
        print(download.default_cache_root() == cache_root.default_cache_root())
    """, tiny_model("llama"))
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split("\n")[-3:] == ["[]", "True", ""], out.stdout
