"""PEFT LoRA adapters for tests, offline: ``make_adapter(base, path, seed, ...)`` wraps the tiny
base model in ``peft.get_peft_model`` with random (non-zero) ``lora_A`` and ``lora_B``
(``init_lora_weights=False``: PEFT's default B = 0 would make the adapter a no-op) and
``save_pretrained``s it (``adapter_config.json`` + ``adapter_model.safetensors``).
``merged_model(base, path)`` is the reference: PEFT's ``merge_and_unload`` of that adapter, float32."""

from __future__ import annotations

import torch

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(base: str, path, seed: int, r: int = 8, alpha: int = 16, targets=None, scale: float = 0.3,
                 **lora_kw) -> str:
    """Write a PEFT adapter of rank ``r`` for the model at ``base`` into ``path``; its factors are
    PEFT's random init times ``scale`` (so the adapter moves the logits by O(1)). Returns ``str(path)``."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    cfg = LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets or ALL_TARGETS), lora_dropout=0.0,
                     init_lora_weights=False, **lora_kw)
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        peft_model = get_peft_model(model, cfg)
        with torch.no_grad():
            for name, p in peft_model.named_parameters():
                if "lora_" in name:
                    p.copy_(torch.randn_like(p) * scale)
    finally:
        torch.random.set_rng_state(state)
    peft_model.save_pretrained(str(path))
    return str(path)


def merged_model(base: str, adapter: str | None):
    """The base model with ``adapter`` merged in by PEFT (``merge_and_unload``), float32, eval;
    the base model itself for ``None``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, attn_implementation="eager")
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    return model.eval()


def hf_greedy_logprobs(model, prompt_ids: list[int], new_tokens: int) -> tuple[list[int], list[float]]:
    """Greedy continuation of ``prompt_ids`` by ``model`` (full recompute each token) and each chosen
    token's log-probability (float32 log_softmax of the last row)."""
    ids = list(prompt_ids)
    out, lps = [], []
    with torch.no_grad():
        for _ in range(new_tokens):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            lp = torch.log_softmax(logits, -1)
            tok = int(lp.argmax())
            out.append(tok)
            lps.append(float(lp[tok]))
            ids.append(tok)
    return out, lps
