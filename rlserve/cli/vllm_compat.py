"""``vllm serve`` flags that rlserve accepts so that launch lines written for vLLM (``trl
vllm-serve``'s among them) start rlserve unchanged.

Each flag is implemented where it means something for rlserve (``--logprobs-mode``,
``--max-logprobs -1``, ``--uvicorn-log-level``, ``--kv-cache-dtype auto``); where it does not
apply, the server logs one warning line saying so and goes on; a value rlserve cannot honour
(an fp8 KV cache, a speculative config, Ray) stops the server with a message naming the flag.
"""

from __future__ import annotations

import argparse
import json
import logging

logger = logging.getLogger("rlserve.serve")

LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")
UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def add_vllm_compat_args(p: argparse.ArgumentParser) -> None:
    """The vLLM-compatibility flags (vLLM's names and value sets)."""
    g = p.add_argument_group("vLLM compatibility", "flags of `vllm serve` (what `trl vllm-serve` passes)")
    g.add_argument("--logprobs-mode", default="raw_logprobs", choices=LOGPROBS_MODES,
                   help="what logprobs hold: raw_* = the model's distribution; processed_* = after penalties, "
                        "temperature, top-k/top-p/min-p (what an importance ratio needs)")
    g.add_argument("--kv-cache-dtype", default="auto",
                   help="only 'auto' (the KV cache is kept in the model's dtype)")
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


def check_vllm_compat_args(args) -> str | None:
    """Log a warning per flag that does not apply; return an error message for a value rlserve
    cannot honour (the caller exits with it), else None."""
    if args.kv_cache_dtype != "auto":
        return (f"--kv-cache-dtype {args.kv_cache_dtype}: rlserve keeps the KV cache in the model's dtype; "
                "only 'auto' is supported")
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
    if args.enable_scale_out:
        logger.warning("--enable-scale-out does not apply: rlserve serves no /v1/chat/completions/render or "
                       "/inference/v1/generate (multimodal prompts)")
    if args.revision is not None:
        logger.warning("--revision %s does not apply: rlserve serves the local model directory as it is",
                       args.revision)
    if args.trust_remote_code:
        logger.warning("--trust-remote-code does not apply: rlserve runs no code from the checkpoint")
    return None
