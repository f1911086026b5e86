"""Test helpers for the scale-out tests (several servers, the SGLang router): not a test module."""

from __future__ import annotations

import re
import time

import requests


def router_completion(router_url: str, model: str, prompt: str, max_tokens: int = 6, **kw) -> dict:
    """A greedy ``/v1/completions`` through the router (text prompt, token ids returned,
    ``ignore_eos`` so every answer has ``max_tokens`` tokens); the JSON answer. Raises
    AssertionError on a non-200."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "return_token_ids": True,
            "ignore_eos": True, **kw}
    r = requests.post(router_url.rstrip("/") + "/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, (r.status_code, r.text[:1000])
    return r.json()


def metric(url: str, name: str) -> float:
    """The sum of a Prometheus metric's samples on one server's ``/metrics``."""
    text = requests.get(url.rstrip("/") + "/metrics", timeout=30).text
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", line)
        if m:
            total += float(m.group(2))
    return total


def wait_for(cond, what: str, timeout_s: float = 120.0) -> None:
    """Poll ``cond()`` (a state, never a duration) until true; fail naming ``what`` after a bound
    far above any healthy run."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s:.0f} s"
        time.sleep(0.05)
