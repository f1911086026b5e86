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


def check_one_version_and_greedy(trainer, router_url: str, model_path: str, hf, prompts, admin_key: str) -> str:
    """After a sync: every server of ``trainer`` reports one version, holds the same tensors
    (``/weight_checker``), and greedy completions through the router equal ``hf``'s. Returns
    the version."""
    from tests.transfer_harness import greedy_continuation

    versions = trainer.weight_versions()
    assert len(set(versions.values())) == 1, versions
    v = next(iter(versions.values()))
    sums = [weight_checksums(u, admin_key) for u in trainer.urls]
    assert all(s == sums[0] for s in sums)
    for p in prompts:
        ans = router_completion(router_url, model_path, p)
        assert ans["weight_version"] == v, ans
        c = ans["choices"][0]
        assert c["token_ids"] == greedy_continuation(hf, c["prompt_token_ids"], len(c["token_ids"])), c
    return v


def weight_checksums(url: str, admin_key: str | None) -> dict:
    """``POST /weight_checker``'s sha256 per tensor of one server."""
    headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}
    r = requests.post(url.rstrip("/") + "/weight_checker", json={}, headers=headers, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["checksums"]


def kill_mid_sync_and_recover(trainer, kill, dead: str, router, model_path: str, hf, prompts,
                              admin_key: str) -> None:
    """Scale ``hf``'s weights, run a sync whose source calls ``kill()`` after its first tensors
    went out (``trainer.engine.source.on_tensor``), and check the outcome: the update failed on
    every server, the survivors kept their version and weights and serve every request through
    the router (which no longer lists ``dead``), and the next sync runs with the survivors."""
    import pytest
    import torch

    from rlserve.transfer.sdk.multi_server import MultiServerUpdateError

    alive = [u for u in trainer.urls if u != dead]
    old_version = trainer.weight_versions()[alive[0]]
    old_sums = weight_checksums(alive[0], admin_key)
    trainer.engine.source.on_tensor[6] = kill
    with torch.no_grad():
        for p in hf.parameters():
            p.mul_(1.1)
    with pytest.raises(MultiServerUpdateError) as ei:
        trainer.send_weights()
    assert ei.value.dropped == [dead] and ei.value.committed == [], ei.value
    assert trainer.urls == alive
    assert trainer.weight_versions() == {u: old_version for u in alive}
    assert all(weight_checksums(u, admin_key) == old_sums for u in alive)
    assert dead not in {w["url"] for w in router.workers()}
    for p in prompts:  # every request is served, by the survivors
        router_completion(router.url, model_path, p, max_tokens=2)
    trainer.send_weights()
    assert trainer.engine.init_info.world_size == 1 + len(alive)
    check_one_version_and_greedy(trainer, router.url, model_path, hf, prompts[:2], admin_key)


def killing_source(module):
    """A ``ModuleSource`` of ``module`` that runs ``source.on_tensor[i]()`` just before it yields
    tensor ``i`` (once)."""
    from rlserve.transfer import ModuleSource

    class KillingSource(ModuleSource):
        def __init__(self, m):
            super().__init__(m)
            self.on_tensor: dict = {}

        def named_tensors(self):
            for i, nt in enumerate(super().named_tensors()):
                fn = self.on_tensor.pop(i, None)
                if fn is not None:
                    fn()
                yield nt

    return KillingSource(module)
