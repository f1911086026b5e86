"""Run in a Python that has vLLM (``tests/vllm_python.py``): prints, as JSON, what vLLM 0.32's own
code builds for the inputs below, for ``tests/test_vllm_shapes.py`` to compare with rlserve's
answers and with its literal copy of them.

- ``logprobs``: completions ``logprobs``, chat ``logprobs`` and ``prompt_logprobs`` as vLLM's
  serving code builds them (``OpenAIServingCompletion._create_completion_logprobs``,
  ``OpenAIServingChat._create_chat_logprobs``, ``vllm/logprobs.py``'s
  ``append_logprobs_for_next_position`` + ``clamp_prompt_logprobs``, dumped as the API router
  dumps a response), with and without ``return_tokens_as_token_ids``, over a 7-token vocabulary.
- ``generation_defaults``: the default sampling parameters vLLM takes from a model's
  ``generation_config.json`` (:data:`GENERATION_CONFIG`) under ``--generation-config`` auto,
  vllm and a directory (``ModelConfig.get_diff_sampling_param``).
- ``metrics`` (with arguments ``metrics MODEL_DIR``): per series of :data:`METRICS`, its type,
  help, label names and histogram buckets as vLLM's ``PrometheusStatLogger`` registers them.
- ``tokenizer_info`` (with arguments ``TOKENIZER_DIR CHAT_TEMPLATE``): vLLM's ``/tokenizer_info``
  answer for that tokenizer and ``--chat-template``.

The module itself imports no vLLM: the tests read its inputs without one.
"""

from __future__ import annotations

import json
import math

#: the fake tokenizer's vocabulary: id -> text
VOCAB = ["a", " b", "\u00e9", "<s>", "cc", "d", "ee"]

#: generated tokens, per step vLLM's sampler order: ([sampled, top-1 .. top-k] ids, their logprobs, sampled's rank)
SAMPLE_STEPS = [([1, 4, 1], [-1.0, -0.5, -1.0], 2),
                ([5, 2, 4], [-2.5, -0.3, -0.9], 4),
                ([2, 2, 6], [-0.1, -0.1, -math.inf], 1)]
TOP_K = 2

#: a prompt and, per position after the first, ([prompt token, top-1 .. top-k], logprobs, prompt token's rank)
PROMPT_IDS = [3, 0, 1, 5]
PROMPT_STEPS = [([0, 4, 2], [-1.5, -0.2, -0.7], 3),
                ([1, 1, 6], [-0.05, -0.05, -3.0], 1),
                ([5, 0, 2], [-math.inf, -0.4, -1.2], 7)]

#: a model's generation_config.json: sampling values vLLM takes as defaults, and ones it leaves
GENERATION_CONFIG = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_new_tokens": 7, "do_sample": True,
                     "repetition_penalty": 1.0, "min_p": 0.05, "bos_token_id": 1, "eos_token_id": 2}

MAX_MODEL_LEN = 128

#: the vLLM series rlserve serves (name as prometheus-client reports it: a counter without ``_total``;
#: ``vllm:cache_config_info`` apart, its labels being the cache configuration)
METRICS = ["vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds",
           "vllm:request_decode_time_seconds", "vllm:request_inference_time_seconds", "vllm:iteration_tokens_total",
           "vllm:prompt_tokens_cached", "vllm:engine_sleep_state",
           "vllm:request_params_n", "vllm:request_params_max_tokens", "vllm:num_requests_running",
           "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc", "vllm:prompt_tokens", "vllm:generation_tokens",
           "vllm:request_success", "vllm:num_preemptions", "vllm:prefix_cache_queries", "vllm:prefix_cache_hits",
           "vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
           "vllm:inter_token_latency_seconds", "vllm:request_time_per_output_token_seconds",
           "vllm:request_prompt_tokens", "vllm:request_generation_tokens"]


class FakeTokenizer:
    """Decodes ids by :data:`VOCAB` (what both sides' logprob builders call)."""

    def decode(self, ids, **_kw) -> str:
        ids = [ids] if isinstance(ids, int) else ids
        return "".join(VOCAB[i] for i in ids)

    def convert_ids_to_tokens(self, ids):
        return [VOCAB[i] for i in ids]


def _vllm_logprobs() -> dict:
    from vllm.entrypoints.generate.base.serving import clamp_prompt_logprobs
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
    from vllm.entrypoints.openai.completion.protocol import CompletionResponseChoice
    from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion
    from vllm.logprobs import append_logprobs_for_next_position

    tok = FakeTokenizer()

    def steps(rows):
        out: list = []
        for ids, lps, rank in rows:
            append_logprobs_for_next_position(out, ids, lps, [VOCAB[i] for i in ids], rank, TOP_K)
        return out

    class Serving:  # the two builders' ``self``: only these attributes are read
        _get_decoded_token = staticmethod(OpenAIServingCompletion._get_decoded_token)
        _get_top_logprobs = OpenAIServingChat._get_top_logprobs
        return_tokens_as_token_ids = False

    sampled = [ids[0] for ids, _, _ in SAMPLE_STEPS]
    result = {}
    for as_ids in (False, True):
        comp = OpenAIServingCompletion._create_completion_logprobs(
            Serving(), sampled, steps(SAMPLE_STEPS), TOP_K, tok, initial_text_offset=3, return_as_token_id=as_ids)
        chat = OpenAIServingChat._create_chat_logprobs(Serving(), sampled, steps(SAMPLE_STEPS), tok, TOP_K,
                                                       return_as_token_id=as_ids)
        plps = clamp_prompt_logprobs([None] + steps(PROMPT_STEPS))
        choice = CompletionResponseChoice(index=0, text="", prompt_logprobs=plps)
        result[f"as_ids={as_ids}"] = {
            "completion": comp.model_dump(),
            "chat": chat.model_dump(),
            "prompt_logprobs": json.loads(json.dumps(choice.model_dump()["prompt_logprobs"])),
        }
    return result


def write_generation_config(directory: str) -> str:
    """Write :data:`GENERATION_CONFIG` as ``directory/generation_config.json``; returns ``directory``."""
    import os

    with open(os.path.join(directory, "generation_config.json"), "w") as f:
        json.dump(GENERATION_CONFIG, f)
    return directory


def _vllm_generation_defaults() -> dict:
    """``ModelConfig.get_diff_sampling_param`` for ``--generation-config auto`` / ``vllm`` /
    a directory, on :data:`GENERATION_CONFIG` (read by vLLM's ``try_get_generation_config``)."""
    import tempfile

    from vllm.config.model import ModelConfig
    from vllm.transformers_utils.config import try_get_generation_config

    out = {}
    with tempfile.TemporaryDirectory() as d:
        write_generation_config(d)
        for source in ("auto", "vllm", "dir"):
            class Stub:  # the ModelConfig attributes get_diff_sampling_param reads
                generation_config = source
                override_generation_config: dict = {}

                def try_get_generation_config(self):
                    return try_get_generation_config(d, trust_remote_code=False).to_diff_dict()

            out[source] = ModelConfig.get_diff_sampling_param(Stub())
    return out


def _vllm_tokenizer_info(tokenizer_dir: str, chat_template: str) -> dict:
    """vLLM's ``TokenizerInfo(tokenizer, chat_template).to_dict()`` (``GET /tokenizer_info``) for
    the Hugging Face tokenizer of ``tokenizer_dir`` as vLLM loads it (``get_tokenizer``), less
    ``local_files_only`` (set from the loading process's ``HF_HUB_OFFLINE``)."""
    from vllm.entrypoints.serve.tokenize.serving import TokenizerInfo
    from vllm.tokenizers.registry import get_tokenizer

    info = TokenizerInfo(get_tokenizer(tokenizer_dir), chat_template).to_dict()
    info.pop("local_files_only", None)  # the loading process's HF_HUB_OFFLINE, not the tokenizer's
    return info


def _vllm_metrics(model_dir: str) -> dict:
    """``{name: {"type", "help", "labels", "buckets"}}`` of the series in :data:`METRICS` as vLLM's
    ``PrometheusStatLogger`` registers them for ``model_dir`` (one engine, ``max_model_len``
    :data:`MAX_MODEL_LEN`); ``labels`` sorted, without ``le``; ``buckets`` the finite bounds."""
    import prometheus_client

    from vllm.config import ModelConfig, VllmConfig
    from vllm.v1.metrics.loggers import PrometheusStatLogger

    config = VllmConfig(model_config=ModelConfig(model=model_dir, tokenizer=model_dir, max_model_len=MAX_MODEL_LEN))
    PrometheusStatLogger(config, engine_indexes=[0]).log_engine_initialized()
    return series_of(prometheus_client.REGISTRY.collect(), METRICS + ["vllm:cache_config_info"])


def series_of(families, names) -> dict:
    """``{name: {"type", "help", "labels", "buckets"}}`` of the metric families named in ``names``
    (a counter by its name without ``_total``, as prometheus-client reports it)."""
    out = {}
    for fam in families:
        if fam.name not in names:
            continue
        labels = sorted({k for smp in fam.samples for k in smp.labels} - {"le"})
        buckets = sorted({float(smp.labels["le"]) for smp in fam.samples if "le" in smp.labels} - {float("inf")})
        out[fam.name] = {"type": fam.type, "help": fam.documentation, "labels": labels, "buckets": buckets}
    return out


if __name__ == "__main__":
    import sys

    if sys.argv[1:2] == ["metrics"]:  # metrics MODEL_DIR
        print(json.dumps({"metrics": _vllm_metrics(sys.argv[2])}))
        sys.exit(0)
    out = {"logprobs": _vllm_logprobs(), "generation_defaults": _vllm_generation_defaults()}
    if len(sys.argv) == 3:  # TOKENIZER_DIR CHAT_TEMPLATE
        out["tokenizer_info"] = _vllm_tokenizer_info(sys.argv[1], sys.argv[2])
    print(json.dumps(out))
