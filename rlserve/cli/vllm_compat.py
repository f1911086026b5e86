"""``vllm serve`` flags that rlserve accepts so that launch lines written for vLLM (``trl
vllm-serve``'s among them) start rlserve unchanged.

Each flag is implemented where it means something for rlserve (``--logprobs-mode``,
``--max-logprobs -1``, ``--uvicorn-log-level``, ``--kv-cache-dtype``); where it does not
apply, the server logs one warning line saying so and goes on; a value rlserve cannot honour
(a speculative config, Ray) stops the server with a message naming the flag.
"""

from __future__ import annotations

import argparse
import json
import logging
import os

from rlserve.config import LOGPROBS_MODES

logger = logging.getLogger("rlserve.serve")

UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def add_vllm_compat_args(p: argparse.ArgumentParser) -> None:
    """The vLLM-compatibility flags (vLLM's names and value sets)."""
    g = p.add_argument_group("vLLM compatibility", "flags of `vllm serve` (what `trl vllm-serve` passes)")
    g.add_argument("--logprobs-mode", default="raw_logprobs", choices=LOGPROBS_MODES,
                   help="what logprobs hold: raw_* = the model's distribution; processed_* = after penalties, "
                        "temperature, top-k/top-p/min-p (what an importance ratio needs)")
    g.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3", "fp8_e5m2"],
                   help="the KV cache's dtype: auto = the model's; fp8 (= fp8_e4m3) / fp8_e5m2: one byte per "
                        "element, twice the blocks in the same memory, per-layer k/v scales (1.0 unless "
                        "--calculate-kv-scales)")
    g.add_argument("--calculate-kv-scales", action="store_true",
                   help="with an fp8 KV cache: each layer's k_scale / v_scale from the first batch (max|k| / 200, "
                        "max|v| / 100, vLLM's constants) instead of 1.0")
    g.add_argument("--model-impl", default="auto", choices=["auto", "vllm", "transformers", "terratorch"],
                   help="rlserve always runs its own model implementations (auto / vllm)")
    g.add_argument("--uvicorn-log-level", default=None, choices=UVICORN_LOG_LEVELS,
                   help="uvicorn's log level (default: --log-level)")
    g.add_argument("--enable-scale-out", action="store_true",
                   help="accepted; rlserve serves no multimodal render/generate routes")
    g.add_argument("--revision", default=None, help="accepted; rlserve serves a local model directory")
    g.add_argument("--trust-remote-code", action="store_true",
                   help="accepted; rlserve runs no code from the checkpoint")
    g.add_argument("--distributed-executor-backend", default=None,
                   choices=["mp", "uni", "ray", "external_launcher"],
                   help="mp / uni accepted (rlserve's TP/DP workers are local processes); ray is refused")
    g.add_argument("--enable-return-routed-experts", action="store_true",
                   help="every choice carries routed_experts: per token, per layer, the expert ids its router "
                        "picked (base64 .npy, uint8/uint16 [tokens - 1, layers, top_k]); MoE models only; turns "
                        "CUDA graphs off")
    g.add_argument("--speculative-config", default=None,
                   help="refused when given: rlserve has no speculative decoding")
    g.add_argument("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
                   help="the chat template for /v1/chat/completions, /tokenize and /v1/responses in place of the "
                        "tokenizer's: a file's path, else the Jinja template itself (as vLLM reads it)")
    g.add_argument("--generation-config", default="auto", metavar="auto|vllm|DIR",
                   help="default sampling parameters of a request that does not set them, as vLLM applies them: "
                        "auto: the model's generation_config.json (temperature, top_p, top_k, min_p, "
                        "repetition/presence/frequency penalties, max_new_tokens as max_tokens); vllm: neutral "
                        "defaults; DIR: that directory's generation_config.json")
    g.add_argument("--enable-log-requests", action=argparse.BooleanOptionalAction, default=False,
                   help="log each request (id, sampling parameters, prompt length; prompt ids at --log-level "
                        "debug) and its end (finish reasons, tokens)")
    g.add_argument("--enable-tokenizer-info-endpoint", action=argparse.BooleanOptionalAction, default=False,
                   help="serve GET /tokenizer_info (the tokenizer's configuration and chat template, as vLLM's)")
    g.add_argument("--disable-log-requests", action="store_true",
                   help="accepted (removed in vLLM 0.32): requests are not logged unless --enable-log-requests")
    g.add_argument("--max-log-len", type=int, default=None, metavar="N",
                   help="with --enable-log-requests: prompt ids logged at most (default: all)")
    g.add_argument("--disable-log-stats", action="store_true",
                   help="accepted: rlserve logs no periodic stats (GET /metrics has them)")
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=None,
                   help="split a prompt's prefill over steps in chunks of at most the step's token budget "
                        "(default: off since session 17, on in vLLM: chunk steps measured slower on an H100; off: a prompt "
                        "longer than --max-num-batched-tokens runs alone in one step); chunks run in prefill steps of "
                        "their own, between decode steps")
    g.add_argument("--swap-space", type=float, default=None, metavar="GiB",
                   help="accepted (removed in vLLM 0.32): a preempted request is recomputed, never swapped out")
    g.add_argument("--max-seq-len-to-capture", type=int, default=None, metavar="N",
                   help="accepted (removed in vLLM 0.32): CUDA graphs capture decode steps, whatever the length")
    g.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1, metavar="N",
                   help="only 1: rlserve splits a model across GPUs by tensor parallelism (--tensor-parallel-size)")
    g.add_argument("--tokenizer-mode", default="auto", metavar="MODE",
                   help="auto / hf: the Hugging Face tokenizer (fast when the checkpoint has tokenizer.json); "
                        "slow, mistral and custom modes are refused")
    g.add_argument("--structured-outputs-config", type=json_object, default=None, metavar="JSON",
                   help='backend auto or xgrammar (rlserve\'s), e.g. \'{"backend": "xgrammar"}\'; enable_in_reasoning '
                        "true: constraints apply in the reasoning too; other backends and options are refused")
    g.add_argument("--compilation-config", "-cc", type=json_object, default=None, metavar="JSON",
                   help="accepted: rlserve compiles nothing with torch.compile; its cudagraph_capture_sizes is used "
                        "as --cudagraph-capture-sizes, cudagraph_mode NONE as --enforce-eager")
    g.add_argument("--optimization-level", "-O", default=None, metavar="LEVEL",
                   help="accepted (-O0 .. -O3): rlserve compiles nothing; CUDA graphs follow --enforce-eager")


def json_object(value: str, example: str = '{"key": "value"}') -> dict:
    """An argparse type: a flag's JSON object value (vLLM's config flags), else argparse's error
    naming ``example``."""
    try:
        obj = json.loads(value)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e}): {value!r}") from None
    if not isinstance(obj, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object such as '{example}', got {value!r}")
    return obj


#: flags accepted with one warning line where they change nothing here: ``{flag: why}`` (the line
#: is "FLAG does not apply: WHY"; docs/vllm-flags.md's table is made from this)
NOOP_FLAGS: dict[str, str] = {
    "--enable-scale-out": "rlserve serves no /v1/chat/completions/render or /inference/v1/generate (multimodal "
                          "prompts)",
    "--revision": "rlserve serves the local model directory as it is",
    "--trust-remote-code": "rlserve runs no code from the checkpoint",
    "--disable-log-requests": "requests are not logged unless --enable-log-requests (vLLM 0.32 removed this flag)",
    "--disable-log-stats": "rlserve logs no periodic stats (GET /metrics has them)",
    "--swap-space": "a preempted request is recomputed, never swapped to CPU (vLLM 0.32 removed this flag)",
    "--max-seq-len-to-capture": "CUDA graphs capture decode steps of any length (vLLM 0.32 removed this flag)",
    "--optimization-level": "rlserve compiles nothing with torch.compile; CUDA graphs follow --enforce-eager",
    "--compilation-config": "rlserve compiles nothing with torch.compile (its cudagraph_capture_sizes and "
                            "cudagraph_mode NONE are used)",
}
#: flags of which only some values are served, the others refused with a message: ``{flag: which}``
LIMITED_FLAGS: dict[str, str] = {
    "--kv-cache-dtype": "`auto`, `fp8` (= `fp8_e4m3`), `fp8_e4m3`, `fp8_e5m2`; fp8 with "
                        "`--batch-invariant` refused",
    "--model-impl": "`auto`, `vllm`; `transformers` with one warning line (rlserve's own implementation runs); "
                    "`terratorch` refused",
    "--distributed-executor-backend": "`mp`, `uni` (local worker processes); `ray`, `external_launcher` refused",
    "--speculative-config": "refused when given (no speculative decoding)",
    "--pipeline-parallel-size": "1 only (split a model by `--tensor-parallel-size`)",
    "--tokenizer-mode": "`auto`, `hf`; `slow`, `mistral`, `custom`, ... refused",
    "--structured-outputs-config": "backend `auto` / `xgrammar` with vLLM's default options, and `enable_in_reasoning`; "
                                   "others refused",
    "--quantization": "`fp8` (online W8A8) only",
    "--max-lora-rank": "vLLM's values 1, 8, 16, 32, 64, 128, 256, 320, 512",
}


def _noop(flag: str, shown: str | None = None) -> None:
    """The one warning line of a no-op flag (:data:`NOOP_FLAGS`); ``shown``: the flag as given."""
    logger.warning("%s does not apply: %s", shown or flag, NOOP_FLAGS[flag])


#: --structured-outputs-config keys and the values that change nothing here
_STRUCTURED_OK = {"backend": ("auto", "xgrammar"), "disable_any_whitespace": (False,),
                  "disable_additional_properties": (False,), "reasoning_parser": ("",),
                  "reasoning_parser_plugin": ("",), "enable_in_reasoning": (False, True)}
#: vLLM's --tokenizer-mode values rlserve serves as they are
_TOKENIZER_MODES = ("auto", "hf")


def check_vllm_compat_args(args) -> str | None:
    """Log a warning per flag that does not apply; return an error message for a value rlserve
    cannot honour (the caller exits with it), else None."""
    if args.calculate_kv_scales and args.kv_cache_dtype == "auto":
        logger.warning("--calculate-kv-scales does not apply: --kv-cache-dtype auto keeps no scales")
    if args.speculative_config not in (None, "", "null", "{}"):
        try:
            json.loads(args.speculative_config)
        except json.JSONDecodeError as e:
            return f"--speculative-config is not valid JSON ({e})"
        return "--speculative-config: rlserve has no speculative decoding; start it without this flag"
    if args.distributed_executor_backend in ("ray", "external_launcher"):
        return (f"--distributed-executor-backend {args.distributed_executor_backend}: not supported; rlserve runs "
                "its tensor/data-parallel workers as local processes (mp)")
    if args.model_impl == "terratorch":
        return "--model-impl terratorch: not supported (rlserve serves causal language models only)"
    if args.model_impl == "transformers":
        logger.warning("--model-impl transformers does not apply: rlserve runs its own model implementation "
                       "(same weights and outputs)")
    return _check_serve_flags(args)


def _check_serve_flags(args) -> str | None:
    """The ``vllm serve`` flags of issue 38 item 5: refusals (returned) and no-op warnings."""
    if args.pipeline_parallel_size != 1:
        return (f"--pipeline-parallel-size {args.pipeline_parallel_size}: rlserve has no pipeline parallelism; "
                "split the model across GPUs with --tensor-parallel-size instead")
    if args.tokenizer_mode not in _TOKENIZER_MODES:
        return (f"--tokenizer-mode {args.tokenizer_mode}: not supported; rlserve uses the checkpoint's Hugging Face "
                "tokenizer (--tokenizer-mode auto or hf)")
    for key, value in (args.structured_outputs_config or {}).items():
        if key not in _STRUCTURED_OK:
            return f"--structured-outputs-config: unknown key {key!r} (vLLM's: {', '.join(_STRUCTURED_OK)})"
        if value not in _STRUCTURED_OK[key]:
            return (f"--structured-outputs-config {key}={value!r}: not supported; rlserve's structured outputs use "
                    f"xgrammar with vLLM's defaults ({key}: {_STRUCTURED_OK[key][0]!r})")
    if args.max_log_len is not None and args.max_log_len < 0:
        return f"--max-log-len must be >= 0, got {args.max_log_len}"
    level = args.optimization_level
    if level is not None and level not in ("0", "1", "2", "3"):
        return f"-O / --optimization-level {level}: expected 0, 1, 2 or 3"
    cc = args.compilation_config or {}
    sizes = cc.get("cudagraph_capture_sizes")
    if sizes is not None:
        if not isinstance(sizes, list) or not all(isinstance(n, int) and n >= 1 for n in sizes):
            return f"--compilation-config cudagraph_capture_sizes: expected positive integers, got {sizes!r}"
        if args.cudagraph_capture_sizes is None:
            args.cudagraph_capture_sizes = list(sizes)
    if str(cc.get("cudagraph_mode", "")).upper() == "NONE":
        args.enforce_eager = True
    given = {
        "--enable-scale-out": args.enable_scale_out, "--revision": args.revision is not None,
        "--trust-remote-code": args.trust_remote_code, "--disable-log-requests": args.disable_log_requests,
        "--disable-log-stats": args.disable_log_stats,
        "--swap-space": args.swap_space is not None, "--max-seq-len-to-capture": args.max_seq_len_to_capture is not None,
        "--optimization-level": level is not None,
        "--compilation-config": bool(set(cc) - {"cudagraph_capture_sizes", "cudagraph_mode"}),
    }
    for flag, on in given.items():
        if on:
            _noop(flag, {"--optimization-level": "-O / --optimization-level"}.get(flag))
    return None


def load_chat_template(value: str | None) -> str | None:
    """``--chat-template``'s template as vLLM 0.32 reads it (``vllm/renderers/chat_utils.py``'s
    ``_load_chat_template``): the file's text when ``value`` opens as a file; else, when it
    holds one of ``{``, ``}`` or a newline, ``value`` itself is the template.

    Raises:
        ValueError: ``value`` looks like a path (none of those characters) but cannot be read.
    """
    if value is None:
        return None
    try:
        with open(value, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        if not any(c in value for c in "{}\n"):
            raise ValueError(f"--chat-template {value!r} looks like a file path, but it could not be read "
                             f"({e.strerror or e}); pass a file or the Jinja template itself") from None
        return value


#: the sampling fields vLLM 0.32 takes from a generation config (``ModelConfig.get_diff_sampling_param``)
GENERATION_FIELDS = ("repetition_penalty", "presence_penalty", "frequency_penalty", "temperature", "top_k", "top_p",
                     "min_p", "max_new_tokens")


def generation_config_dir(source: str, model_path: str) -> str | None:
    """Where ``--generation-config source`` reads ``generation_config.json``: None for ``vllm``, the model
    directory for ``auto``, else ``source`` (checked here, without transformers: ``rlserve serve`` reads
    the file itself beside the engine's start).

    Raises:
        ValueError: ``source`` is a directory path that does not exist.
    """
    if source == "vllm":
        return None
    if source != "auto" and not os.path.isdir(source):
        raise ValueError(f"--generation-config {source!r}: expected auto, vllm or a directory holding "
                         "generation_config.json")
    return model_path if source == "auto" else source


def generation_defaults(source: str, model_path: str) -> dict:
    """The default sampling parameters of ``--generation-config source`` as vLLM 0.32 computes
    them (``ModelConfig.get_diff_sampling_param``): ``vllm``: none; ``auto``: the model
    directory's ``generation_config.json``; else the directory ``source``'s. Only the values that
    differ from transformers' ``GenerationConfig`` defaults (``to_diff_dict``) among
    :data:`GENERATION_FIELDS`, ``max_new_tokens`` renamed ``max_tokens``; ``{}`` when there is no
    file. Logs vLLM's warning line when the defaults change.

    Raises:
        ValueError: ``source`` is a directory path that does not exist.
    """
    where = generation_config_dir(source, model_path)
    if where is None:
        return {}
    from rlserve.hf_import import from_transformers

    generation_config = from_transformers("GenerationConfig")  # beside the tokenizer's load (rlserve serve)
    try:
        config = generation_config.from_pretrained(where).to_diff_dict()
    except OSError:  # no generation_config.json (vLLM then derives one from config.json: no sampling values)
        return {}
    out = {k: config[k] for k in GENERATION_FIELDS if config.get(k) is not None}
    if "max_new_tokens" in out:
        out["max_tokens"] = out.pop("max_new_tokens")
    if out:
        logger.warning("Default sampling parameters have been overridden by %s: `%s`. If this is not intended, "
                       "relaunch with `--generation-config vllm`.",
                       "the model's `generation_config.json`" if source == "auto" else source, out)
    return out
