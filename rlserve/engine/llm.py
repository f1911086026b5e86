"""Offline API: ``LLM(model).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import os

from rlserve.config import EngineConfig
from rlserve.engine.core.llm_engine import LLMEngine
from rlserve.engine.outputs import RequestOutput
from rlserve.engine.sampling_params import SamplingParams
from rlserve.errors import InvalidRequestError

#: vLLM's prompt dicts: ``TextPrompt`` {"prompt": str} and ``TokensPrompt`` {"prompt_token_ids": list[int]}
_PROMPT_KEYS = ("prompt", "prompt_token_ids")


def _from_prompt_dict(p, i: int):
    """A vLLM ``TextPrompt`` / ``TokensPrompt`` dict -> its text or token ids; anything else as it is.

    Raises:
        InvalidRequestError: a dict with neither key, both, or another key (multi-modal data, cache salt...:
            not served), naming the prompt's index.
    """
    if not isinstance(p, dict):
        return p
    keys = set(p)
    if len(keys & set(_PROMPT_KEYS)) != 1 or keys - set(_PROMPT_KEYS):
        raise InvalidRequestError(f"prompts[{i}]: a prompt dict takes exactly one of 'prompt' (text) or "
                                  f"'prompt_token_ids' (vLLM's TextPrompt / TokensPrompt), got keys {sorted(keys)}")
    return p["prompt"] if "prompt" in p else p["prompt_token_ids"]


class LLM:
    """Offline batched generation.

    Args:
        model: path of a Hugging Face model directory, or ``"default"`` (also
            ``"SmolLM2-135M-Instruct"``, ``"HuggingFaceTB/SmolLM2-135M-Instruct"``) for the built-in
            default model, resolved as ``rlserve serve`` does (:func:`rlserve.download.resolve_model`:
            rlserve's cache, built on first use; never the Hugging Face Hub).
        **kwargs: any :class:`rlserve.config.EngineConfig` field (dtype, device,
            load_format, max_model_len, tensor_parallel_size, quantization, ...).

    Example:
        >>> llm = LLM("/path/to/model", dtype="float32", device="cpu")
        >>> out = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=8))
        >>> out[0].outputs[0].text
    """

    def __init__(self, model: str, **kwargs):
        """Raises:
            UnknownModelError: ``model`` is neither an existing path nor the default model's name
                (:func:`rlserve.download.resolve_model`'s message says what to pass).
            ModelDownloadError: the default model could not be fetched or built.
            MissingExtraError: (an ImportError) ``enable_lora=True`` without PEFT installed
                (:func:`rlserve.lora.require_peft`: the message names ``pip install 'rlserve[lora]'``).
        """
        if kwargs.get("enable_lora"):
            from rlserve.lora import require_peft

            require_peft("enable_lora=True")
        if not os.path.exists(os.path.expanduser(os.fspath(model))):  # "default", or a name serve refuses too
            from rlserve.download import resolve_model

            model = resolve_model(model)
        self.engine = LLMEngine(EngineConfig(model=model, **kwargs))

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | dict | list[str] | list[int] | list[list[int]] | list[dict],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = False,
        lora_request=None,
    ) -> list[RequestOutput]:
        """Generate completions for every prompt, batched by the engine.

        Args:
            prompts: one prompt or a list; each is text, a list of token ids, or vLLM's prompt dict
                (``{"prompt": text}`` or ``{"prompt_token_ids": ids}``).
            sampling_params: one for all prompts, or one per prompt.
            lora_request: vLLM's: a :class:`rlserve.lora.request.LoRARequest` for all prompts, a
                list (one per prompt, None = the base model), or None (engine built with
                ``enable_lora=True``; an adapter is read the first time its id is seen).

        Returns:
            one :class:`RequestOutput` per prompt, in order.

        Raises:
            InvalidRequestError: on bad prompts or parameters (nothing is queued then);
                LoRAAdapterError (a subclass) for an adapter that cannot be served.
        """
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = [_from_prompt_dict(p, i) for i, p in enumerate(prompts)]
        sampling_params = sampling_params or SamplingParams()
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        if lora_request is not None:
            from rlserve.lora.request import with_adapters

            params = with_adapters(self.engine, params, lora_request)
        return self.engine.generate_blocking(list(prompts), params, progress=use_tqdm)

    def sleep(self, level: int = 1) -> None:
        """vLLM's ``LLM.sleep``: free the GPU memory of the weights and the KV cache (needs
        ``enable_sleep_mode=True``). Level 1 keeps the weights in host memory; level 2 drops
        them (refill with ``load_weights`` after ``wake_up(tags=["weights"])``, or a full
        ``wake_up`` reloads the checkpoint). The prefix cache is reset.

        Raises:
            SleepStateError: already asleep; sleep mode off. InvalidRequestError: bad level.
        """
        self.engine.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """vLLM's ``LLM.wake_up``: take the memory of ``tags`` (``"weights"``, ``"kv_cache"``;
        default both) back; generation works again once both are awake.

        Raises:
            SleepStateError: none of ``tags`` sleeps. SleepMemoryError: the GPU memory is taken.
        """
        self.engine.wake_up(tags)

    def is_sleeping(self) -> bool:
        """True while any memory region sleeps (``generate`` raises ModelSleepingError)."""
        return self.engine.is_sleeping()
