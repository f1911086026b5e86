"""``rlserve serve``'s HTTP-side settings (:class:`ServerSettings`), as :mod:`rlserve.server.state`'s
:class:`~rlserve.server.state.ServerState` and the app factory take them."""

from __future__ import annotations

import dataclasses

from rlserve.server.limits import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_REQUEST_SEQUENCES


@dataclasses.dataclass
class ServerSettings:
    """HTTP-side settings.

    Attributes:
        model: the model path (or name) the engine was started with.
        served_model_names: names accepted in the ``model`` field (first one is reported).
        host / port: bind address.
        api_key: Bearer key required on the generation routes (/v1, /generate/), or None.
        admin_key: Bearer key required on control routes (pause, resume, weights, ...), or
            None; without it control routes are only served on a loopback bind.
        weight_transfer_config: the parsed ``--weight-transfer-config`` (None: weight-sync
            routes are not mounted).
        weight_staging: "none", "device" or "host".
        weight_check_finite: refuse synced tensors holding NaN / inf (``--weight-check-finite``).
        max_request_body_bytes: largest request body (413 above; ``rlserve.server.limits``).
        max_request_sequences: largest prompts x ``n`` of one request (400 above).
        insecure_control_routes: serve control routes without a key on a non-loopback bind
            (``--insecure-control-routes``, default on with env ``VLLM_SERVER_DEV_MODE=1``: vLLM's
            dev mode, which `trl vllm-serve` sets); ``admin_key``, when set, still applies.
        lora_modules: ``[(name, path)]`` LoRA adapters loaded at startup (``--lora-modules``).
        allow_unknown_fields: ``--allow-unknown-fields``: completions / chat / responses requests
            with fields rlserve does not know are served, the fields ignored and named in one log
            line (vLLM's behaviour), instead of a 400 (:mod:`rlserve.server.request_fields`).
        tool_call_parser / reasoning_parser / enable_auto_tool_choice: vLLM's flags of those
            names (:mod:`rlserve.server.chat_output`).
        structured_in_reasoning: ``--structured-outputs-config '{"enable_in_reasoning": true}'``:
            constraints apply from the first token, in the reasoning too (vLLM's option; by
            default they wait for the reasoning's end under ``--reasoning-parser``).
        chat_template: ``--chat-template``'s template text (None: the tokenizer's).
        sampling_defaults: a request's sampling defaults from ``--generation-config``
            (``{field: value}``, ``max_tokens`` among them; {}: vLLM's neutral ones).
        enable_log_requests / max_log_len: log each request (``--enable-log-requests``), its
            prompt ids at most ``max_log_len`` (None: all) at debug level.
        enable_tokenizer_info_endpoint: serve ``GET /tokenizer_info``.
        model_impl / generation_config: ``--model-impl`` / ``--generation-config`` as given
            (``/server_info`` reports them).
        metrics_multiproc_dir: ``--api-server-count`` N > 1: the directory the N processes' metric
            values share (:mod:`rlserve.server.metrics_mp`); None: in memory, this process's.
    """

    model: str
    served_model_names: list[str]
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    admin_key: str | None = None
    weight_transfer_config: dict | None = None
    weight_staging: str = "none"
    weight_check_finite: bool = True
    max_request_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_request_sequences: int = DEFAULT_MAX_REQUEST_SEQUENCES
    insecure_control_routes: bool = False
    lora_modules: list = dataclasses.field(default_factory=list)
    allow_unknown_fields: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    enable_auto_tool_choice: bool = False
    structured_in_reasoning: bool = False
    chat_template: str | None = None
    sampling_defaults: dict = dataclasses.field(default_factory=dict)
    enable_log_requests: bool = False
    max_log_len: int | None = None
    enable_tokenizer_info_endpoint: bool = False
    model_impl: str = "auto"
    generation_config: str = "auto"
    metrics_multiproc_dir: str | None = None
