"""``rlserve serve``'s flags (vLLM's names) and the engine config they make: :func:`add_serve_parser`,
:func:`add_engine_args`, :func:`engine_config_from_args`. Parsing only: starting the server is
:mod:`rlserve.cli.serve`'s."""

from __future__ import annotations

import argparse
import json
import re

from rlserve import envs
from rlserve.cli._arg_types import non_negative_int as _non_negative_int, port as _port
from rlserve.cli._arg_types import max_model_len as _max_model_len
from rlserve.cli._arg_types import positive_int as _positive_int, positive_seconds as _positive_float
from rlserve.cli._help import HelpFormatter
from rlserve.cli.tool_flags import add_tool_args
from rlserve.cli.vllm_compat import add_vllm_compat_args, json_object
from rlserve.config import DTYPE_NAMES


def _device_ids(value: str) -> list[int]:
    try:
        return [int(x) for x in value.replace(" ", "").split(",") if x != ""]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--device-ids takes comma-separated integers, got {value!r}") from None


def _device(value: str) -> str:
    """``--device``: ``auto``, ``cpu``, ``cuda`` or ``cuda:N`` (what the engine takes)."""
    if value == "auto" or value == "cpu" or re.fullmatch(r"cuda(:\d+)?", value):
        return value
    raise argparse.ArgumentTypeError(f"expected auto, cpu, cuda or cuda:N, got {value!r}")


def _lora_module(value: str) -> tuple[str, str]:
    """vLLM's ``--lora-modules`` item: ``NAME=PATH`` or ``{"name": ..., "path": ...}``."""
    if value.lstrip().startswith("{"):
        try:
            obj = json.loads(value)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"not valid JSON ({e}): {value!r}") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not isinstance(obj.get("path"), str):
            raise argparse.ArgumentTypeError(f'expected {{"name": ..., "path": ...}}, got {value!r}')
        return obj["name"], obj["path"]
    name, sep, path = value.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {value!r}")
    return name, path


def _json_object(value: str) -> dict:
    return json_object(value, '{"backend": "nccl"}')


def _one_line_error(parser: argparse.ArgumentParser):
    """``parser.error`` that prints one ``PROG: error: MESSAGE`` line and exits 2, without
    argparse's usage (``rlserve serve``'s is ~50 lines; the message already names the flag)."""
    def error(message: str):
        parser.exit(2, f"{parser.prog}: error: {message} (see `{parser.prog} --help`)\n")
    return error


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Engine flags (vLLM's names), shared with other subcommands that start an engine."""
    g = p.add_argument_group("engine")
    g.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the model's)")
    g.add_argument("--dtype", default="auto", choices=["auto", *DTYPE_NAMES], metavar="DTYPE",
                   help="auto | float32 | bfloat16 | float16 (also vLLM's half / float and fp32 / bf16 / fp16; "
                        "auto: float32 on CPU, the checkpoint's 16-bit dtype on GPU)")
    g.add_argument("--device", type=_device, default="auto", help="auto | cpu | cuda | cuda:N")
    g.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "pt", "dummy"],
                   help="dummy = random weights of the right shapes")
    g.add_argument("--max-model-len", type=_max_model_len, default=None,
                   help="context length in tokens (prompt + output; default: the model's max_position_embeddings "
                        "(times a linear RoPE scaling factor), at most 8192; above that length an error unless "
                        "env VLLM_ALLOW_LONG_MAX_MODEL_LEN=1, as in vLLM; -1 or auto: the model's length, cut to what the KV "
                        "cache holds; 1k, 1K, 25.6k as vLLM)")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.92,
                   help="fraction of GPU memory for weights + KV cache (vLLM's default, 0.92)")
    g.add_argument("--max-num-seqs", type=int, default=256, help="sequences per batch at most")
    g.add_argument("--max-num-batched-tokens", type=int, default=None, help="tokens per forward step at most (default on CUDA: max(8192, max-model-len), 8192 "
                        "with --enable-chunked-prefill; 1024 on CPU; a longer prompt runs alone in one step, or in "
                        "chunks with --enable-chunked-prefill)")
    g.add_argument("--long-prefill-token-threshold", type=int, default=0, metavar="N",
                   help="with chunked prefill: tokens of one prompt's chunk at most (0, the default: the step's "
                        "budget); vLLM's flag")
    g.add_argument("--max-consecutive-prefill-steps", type=int, default=None, metavar="N",
                   help="prefill steps in a row at most while requests are decoding, then a decode step (0: no "
                        "bound: new requests always first; default: 1 on CUDA, 0 on CPU). rlserve's own flag: "
                        "vLLM mixes decodes into its prefill steps instead")
    g.add_argument("--max-prefill-tokens-while-decoding", type=_positive_int, default=None, metavar="N",
                   help="tokens of a prefill step at most while streamed requests are decoding (a prefill step "
                        "stalls every running stream; a longer prompt is prefilled in chunks of this size, or runs alone "
                        "with --no-enable-chunked-prefill; at most --max-num-batched-tokens). Default: "
                        "2048. rlserve's own flag: vLLM's decodes share --max-num-batched-tokens with its prefill chunks")
    g.add_argument("--mixed-prefill-decode", action=argparse.BooleanOptionalAction, default=False,
                   help="a prefill step while requests decode also decodes every running request (vLLM's mixed "
                        "steps; its decode tokens count against the step's prefill budget): a stream waits one "
                        "eager step instead of a prefill step plus a decode step. rlserve's own flag (vLLM always "
                        "mixes); default off")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block")
    g.add_argument("--num-kv-blocks", type=int, default=None, help="force the KV-cache size in blocks (default: from --kv-cache-bytes or "
                        "--gpu-memory-utilization)")
    g.add_argument("--kv-cache-bytes", type=int, default=None, help="KV-cache size in bytes on CPU (default: 512 MiB)")
    g.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    g.add_argument("--cudagraph-capture-sizes", nargs="+", type=_positive_int, default=None, metavar="N",
                   help="decode batch sizes captured as CUDA graphs, capped at --max-num-seqs; a larger batch runs "
                        "eagerly (vLLM's flag; default: env RLSERVE_CUDA_GRAPH_SIZES, else 1, 2, 4, 8, then "
                        "multiples of 16 up to --max-num-seqs)")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse KV blocks of identical prompt prefixes")
    g.add_argument("--seed", type=int, default=0, help="global seed (dummy weights, unseeded sampling)")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="GPUs per replica: one process per rank, weights sharded across them")
    g.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                   help="engine replicas behind one server (requests balanced by load)")
    g.add_argument("--device-ids", type=_device_ids, default=None,
                   help="GPUs to use, comma-separated (TP x DP of them), e.g. 0,1 (default: 0, 1, ...)")
    g.add_argument("--quantization", "-q", default=None, choices=["fp8"], help="online fp8 (W8A8; default: none)")
    g.add_argument("--max-logprobs", type=int, default=20,
                   help="largest logprobs/top_logprobs a request may ask; -1: no limit")
    g.add_argument("--enable-sleep-mode", action="store_true",
                   help="POST /sleep?level=1|2 frees the GPU memory of the weights and KV cache, POST /wake_up "
                        "takes it back (colocated training; vLLM's flag)")
    g.add_argument("--enable-lora", action="store_true",
                   help="serve LoRA adapters: POST /v1/load_lora_adapter, a request picks one by its 'model' name")
    g.add_argument("--max-loras", type=_positive_int, default=1, metavar="N",
                   help="LoRA adapters loaded at once at most (each one may be in every batch)")
    g.add_argument("--max-lora-rank", type=int, default=16, metavar="R",
                   help="largest LoRA rank served: 1, 8, 16, 32, 64, 128, 256, 320 or 512 (vLLM's values)")
    g.add_argument("--lora-modules", nargs="+", type=_lora_module, default=None, metavar="NAME=PATH",
                   help="adapters to load at startup (with --enable-lora), as NAME=PATH")
    g.add_argument("--batch-invariant", action="store_true",
                   help="batch-invariant kernels: a request's tokens and logprobs are bitwise the same whatever "
                        "else is in its batch (also on with env VLLM_BATCH_INVARIANT=1; CPU: float32 only)")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="overlapped decode: launch step N+1 before reading step N's tokens (default: on for "
                        "CUDA with TP=1; env RLSERVE_ASYNC_SCHEDULING=0/1 when not given)")


def engine_config_from_args(args, model_path: str):
    """EngineConfig from parsed flags. Raises InvalidRequestError for a bad combination."""
    from rlserve.config import EngineConfig

    return EngineConfig(
        model=model_path, tokenizer=args.tokenizer, dtype=args.dtype, device=args.device,
        load_format=args.load_format, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_consecutive_prefill_steps=getattr(args, "max_consecutive_prefill_steps", None),
        max_prefill_tokens_while_decoding=getattr(args, "max_prefill_tokens_while_decoding", None),
        enable_chunked_prefill=getattr(args, "enable_chunked_prefill", None) is True,
        long_prefill_token_threshold=getattr(args, "long_prefill_token_threshold", 0) or 0,
        mixed_prefill_decode=bool(getattr(args, "mixed_prefill_decode", False)),
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks, kv_cache_bytes=args.kv_cache_bytes,
        gpu_memory_utilization=args.gpu_memory_utilization, enable_prefix_caching=args.enable_prefix_caching,
        enforce_eager=args.enforce_eager, seed=args.seed, tensor_parallel_size=args.tensor_parallel_size,
        data_parallel_size=args.data_parallel_size, device_ids=args.device_ids, quantization=args.quantization,
        max_logprobs=args.max_logprobs, logprobs_mode=getattr(args, "logprobs_mode", "raw_logprobs"),
        enable_sleep_mode=getattr(args, "enable_sleep_mode", False),
        async_scheduling=getattr(args, "async_scheduling", None),
        enable_lora=getattr(args, "enable_lora", False), max_loras=getattr(args, "max_loras", 1),
        max_lora_rank=getattr(args, "max_lora_rank", 16),
        enable_return_routed_experts=getattr(args, "enable_return_routed_experts", False),
        batch_invariant=getattr(args, "batch_invariant", False),
        kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"),
        calculate_kv_scales=getattr(args, "calculate_kv_scales", False),
        extra={"cuda_graph_sizes": list(args.cudagraph_capture_sizes)} if getattr(
            args, "cudagraph_capture_sizes", None) else {},
    )


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    """The ``serve`` subcommand's parser with every flag (its ``func``: :func:`rlserve.cli.serve.register`)."""
    p = subparsers.add_parser(
        "serve", help="serve a model over HTTP (OpenAI API, TRL protocol, weight sync)",
        description="Serve MODEL (a local Hugging Face directory, or 'default' for SmolLM2-135M-Instruct) over "
                    "HTTP: /v1/completions, /v1/chat/completions, TRL's /generate/, pause/resume and weight-sync "
                    "control routes, /metrics.",
        formatter_class=HelpFormatter,
    )
    p.error = _one_line_error(p)
    p.add_argument("model", nargs="?", default=None, help="model directory or 'default'")
    p.add_argument("--model", dest="model_flag", default=None, help="same as the positional MODEL")
    s = p.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1", help="bind address (0.0.0.0 for all interfaces)")
    s.add_argument("--port", type=_port, default=8000, help="port (0 = pick a free one; the ready line says which)")
    s.add_argument("--served-model-name", nargs="+", default=None,
                   help="name(s) accepted in the 'model' field (default: the MODEL argument)")
    s.add_argument("--api-key", default=envs.RLSERVE_API_KEY,
                   help="Bearer key for /v1 and /generate/ (default: env RLSERVE_API_KEY, else none)")
    s.add_argument("--admin-key", default=envs.RLSERVE_ADMIN_KEY,
                   help="Bearer key for control routes (pause/resume/abort/weights; default: env RLSERVE_ADMIN_KEY, "
                        "else none). Without it, control routes only work on a loopback --host (see "
                        "--insecure-control-routes)")
    s.add_argument("--insecure-control-routes", action="store_true",
                   default=envs.VLLM_SERVER_DEV_MODE,
                   help="serve control routes (pause/resume/abort/weight sync/TRL) WITHOUT a key on a non-loopback "
                        "--host, as vLLM does in dev mode: anyone who can reach the port can pause the server or "
                        "replace its weights (default: on when env VLLM_SERVER_DEV_MODE=1 (what `trl vllm-serve` "
                        "sets), else off). --admin-key, when given, still applies")
    s.add_argument("--allow-unknown-fields", action="store_true",
                   help="serve completions / chat / responses requests with fields rlserve does not know, ignoring "
                        "them with one log line per request naming them (vLLM's behaviour); default: a 400 "
                        "naming the field (fields that change nothing, e.g. user, metadata, store, are always "
                        "accepted)")
    s.add_argument("--weight-transfer-config", type=_json_object, default=None,
                   help='enable weight sync, e.g. \'{"backend": "nccl"}\' (nccl | gloo | ipc)')
    s.add_argument("--weight-staging", default="none", choices=["none", "device", "host"],
                   help="none: update in place while paused; device/host: receive into a staging copy while "
                        "generating, then commit with one copy")
    s.add_argument("--weight-check-finite", action=argparse.BooleanOptionalAction, default=True,
                   help="refuse a weight update whose tensor holds NaN or +-inf (400 non_finite_weights naming it, "
                        "tested in the checksum pass: staged, the old weights keep serving; in place, 503 until a "
                        "complete good update). --no-weight-check-finite commits whatever arrives")
    s.add_argument("--weight-version", default="0", help="initial weight version reported on every completion")
    s.add_argument("--max-engine-restarts", type=_non_negative_int, default=3, metavar="N",
                   help="an engine-core process that dies is restarted, at most N times within "
                        "--engine-restart-window seconds (a crash loop then leaves it dead, /health says why); "
                        "0: never. The trained weights die with it: 503 weights_lost until a complete sync")
    s.add_argument("--engine-restart-window", type=_positive_float, default=60.0, metavar="SECONDS",
                   help="the window of --max-engine-restarts")
    s.add_argument("--serve-checkpoint-after-restart", action="store_true",
                   help="after an engine-core restart, serve the reloaded checkpoint (under --weight-version, the "
                        "checkpoint's label) instead of answering 503 weights_lost until a complete sync "
                        "(one replica only)")
    s.add_argument("--pause-hold-timeout", type=float, default=600.0, metavar="SECONDS",
                   help="a request that arrives while generation is paused waits at most this long for /resume, "
                        "then gets a 503 (0: wait without bound)")
    s.add_argument("--max-request-body-bytes", type=int, default=64 << 20, metavar="BYTES",
                   help="largest request body; a larger one gets 413 before it is parsed")
    s.add_argument("--max-request-sequences", type=int, default=16384, metavar="N",
                   help="largest number of sequences (prompts x n) one request may ask for")
    s.add_argument("--stream-interval", type=_positive_int, default=1, metavar="N",
                   help="new tokens per streamed chunk at least; the first and last chunks go out at once "
                        "(vLLM's flag; a request's stream_interval can raise it). A client slower than the "
                        "engine still gets larger chunks: it is sent the newest output when it can take one")
    s.add_argument("--http-header-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="close a connection whose request line and headers are not complete this many seconds "
                        "after it opened or after its previous response, or whose request body stops arriving for "
                        "this many seconds (slow-loris clients); 0: no bound")
    s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="server log verbosity (stderr)")
    s.add_argument("--disable-access-log", "--disable-uvicorn-access-log", dest="disable_access_log", action="store_true",
                   help="no per-request access log lines (vLLM's name: --disable-uvicorn-access-log)")
    s.add_argument("--engine-mode", choices=["process", "thread"],
                   default=envs.RLSERVE_ENGINE_MODE,
                   help="process: each engine replica in its own engine-core process (off the HTTP server's GIL); "
                        "thread: on a thread of the server process (debugging; env RLSERVE_ENGINE_MODE)")
    s.add_argument("--api-server-count", "-asc", type=_positive_int, default=1, metavar="N",
                   help="API server processes sharing the listening socket and the engine cores (vLLM's flag; "
                        "process 0 owns weight sync, pause and sleep, the others forward those routes to it; "
                        "/metrics of each is the N processes' aggregate; not with --enable-lora; "
                        "rlserve/server/multi_api.py)")
    add_engine_args(p)
    add_vllm_compat_args(p)
    add_tool_args(p)
    return p
