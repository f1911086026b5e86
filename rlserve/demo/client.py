"""Greedy completions over ``/v1/completions`` (token ids included), plain or streamed with a
progress line."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Sequence

from rlserve.demo.common import DEFAULT_MAX_TOKENS, DemoError
from rlserve.progress import progress as progress_line


@dataclass
class Completion:
    prompt: str
    text: str
    token_ids: list[int]
    prompt_token_ids: list[int]
    finish_reason: str | None = None
    weight_version: str | None = None


def complete(base_url: str, prompts: Sequence[str], max_tokens: int = DEFAULT_MAX_TOKENS,
             model: str | None = None, api_key: str | None = None, timeout_s: float = 600.0,
             progress: str | None = None) -> list[Completion]:
    """Greedy completions (``temperature=0``) of every prompt, in one ``/v1/completions`` request;
    with ``progress`` (the line's label) streamed, with a tqdm line of the tokens done."""
    import requests

    body: dict[str, Any] = {"prompt": list(prompts), "max_tokens": int(max_tokens), "temperature": 0.0,
                            "return_token_ids": True}
    if model:
        body["model"] = model
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    url = f"{base_url.rstrip('/')}/v1/completions"
    if progress is None:
        r = requests.post(url, json=body, headers=headers, timeout=(10, timeout_s))
        if r.status_code != 200:
            raise DemoError(f"/v1/completions -> HTTP {r.status_code}: {r.text[:1000]}")
        choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    else:
        choices = _complete_streamed(url, dict(body, stream=True), headers, timeout_s, len(prompts), int(max_tokens),
                                     progress)
    if len(choices) != len(prompts):
        raise DemoError(f"/v1/completions returned {len(choices)} choices for {len(prompts)} prompts")
    return [Completion(p, c["text"], list(c["token_ids"]), list(c["prompt_token_ids"]), c.get("finish_reason"),
                       c.get("weight_version")) for p, c in zip(prompts, choices)]


def _complete_streamed(url: str, body: dict, headers: dict, timeout_s: float, n_prompts: int, max_tokens: int,
                       label: str) -> list[dict]:
    """A streamed ``/v1/completions``: the choices assembled from their chunks, in index order. The
    progress line counts ``n_prompts * max_tokens`` tokens, less what a completion that ended early left."""
    import requests

    merged: dict[int, dict] = {}
    with progress_line(label, total=n_prompts * max_tokens, unit="tok") as bar, \
            requests.post(url, json=body, headers=headers, timeout=(10, timeout_s), stream=True) as r:
        if r.status_code != 200:
            raise DemoError(f"/v1/completions -> HTTP {r.status_code}: {r.text[:1000]}")
        for line in r.iter_lines(decode_unicode=True):
            if not line or not line.startswith("data: {"):
                continue
            obj = json.loads(line[6:])
            if "error" in obj:
                raise DemoError(f"/v1/completions stream failed: {obj['error']}")
            for c in obj["choices"]:
                m = merged.setdefault(c["index"], {"index": c["index"], "text": "", "token_ids": [],
                                                   "prompt_token_ids": [], "finish_reason": None})
                m["text"] += c["text"]
                m["token_ids"] += c.get("token_ids") or []
                m["prompt_token_ids"] = c.get("prompt_token_ids") or m["prompt_token_ids"]
                m["finish_reason"] = c["finish_reason"] or m["finish_reason"]
                m["weight_version"] = c.get("weight_version")
                bar.update(len(c.get("token_ids") or []))
                if c["finish_reason"] and len(m["token_ids"]) < max_tokens:  # ended early (EOS, stop)
                    bar.total -= max_tokens - len(m["token_ids"])  # so the line ends at 100%
                    bar.refresh()
    return [merged[i] for i in sorted(merged)]


