"""Kill-the-trainer matrix: for each receive path and each phase of an update, a real trainer
process dies (:mod:`tests.kill_trainer`) and the server must either still serve exactly the last
good weights or refuse to serve (503) until a complete update lands. Not a test module: the
tests are in ``tests/test_transfer_kill_matrix.py``; run this file to print the whole table::

    PYTHONPATH=. python tests/kill_matrix.py [--timeout-s 2]

Each configuration gets one in-process server (tiny llama, vocabulary 384 so that packed
updates are received straight into the parameters, CPU, float32). Before each cell an SDK
trainer of this process syncs the "good" weights (twice for direct receive: the first sync lays
the parameters out, the second is received into them) and the killed trainer's update uses the
same names, shapes and bucket size, with other values. After the trainer died, the cell waits
for the server to give the update up (``/weight_info`` state ``uninitialized``: a failed update
tears the group down; a trainer that died between calls is noticed by the idle watchdog after
``timeout_s``) and records:

- ``unchanged``: generation answers 200 with the good version and the good tokens, and
  ``/weight_checker`` matches the good checksums;
- ``503``: generation answers 503, ``/health`` 503 and ``/weight_info`` names the reason;
- ``FAIL: ...`` anything else (e.g. 200 with changed weights: a half-updated model in service).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from tests.kill_trainer import PHASES, random_weights, spawn_killed_trainer  # noqa: E402
from tests.transfer_harness import InProcessServer, free_port  # noqa: E402

PROMPTS = [[5, 17, 42, 9, 77, 3], [100, 101, 7]]
N_TOK = 6
GOOD_SEED, BAD_SEED = 1, 2


@dataclass(frozen=True)
class Config:
    """One receive path: ``protocol`` "sdk" (start / update / finish) or "trl" (per tensor),
    ``packed``, ``staging`` ("none" = in place), ``direct`` (``direct_receive`` in the server's
    config; only packed in-place updates use it)."""

    name: str
    protocol: str
    packed: bool
    staging: str
    direct: bool

    def phases(self) -> tuple[str, ...]:
        """The phases that exist on this path (checksums travel after the data only when packed)."""
        return tuple(p for p in PHASES if p != "checksums" or (self.protocol == "sdk" and self.packed))


CONFIGS = [
    Config("gloo packed, in place, direct", "sdk", True, "none", True),
    Config("gloo packed, in place, buffered", "sdk", True, "none", False),
    Config("gloo packed, staged", "sdk", True, "device", True),
    Config("gloo unpacked, in place", "sdk", False, "none", True),
    Config("gloo unpacked, staged", "sdk", False, "device", True),
    Config("TRL per-tensor, in place", "trl", False, "none", True),
    Config("TRL per-tensor, staged", "trl", False, "device", True),
]


def expected(cfg: Config, phase: str) -> str:
    """What the server must do: staged updates never touch the served weights (``unchanged``);
    in place, the model is refused (``503``) from the moment bytes may have reached the
    parameters: a direct receive writes them from the first byte of the first bucket, the other
    paths once the first complete bucket / tensor is loaded."""
    if cfg.staging != "none" or phase == "before_header":
        return "unchanged"
    if phase == "first_bucket":
        return "503" if (cfg.direct and cfg.packed and cfg.protocol == "sdk") else "unchanged"
    return "503"


def model_meta(path: str) -> list[tuple[str, str, list[int]]]:
    """``(HF name, dtype name, shape)`` of every tensor a trainer of ``path`` sends, in order."""
    import torch
    from transformers import AutoModelForCausalLM

    from rlserve.transfer import ModuleSource
    from rlserve.transfer.protocol import dtype_to_name

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return [(n, dtype_to_name(d), list(s)) for n, d, s in ModuleSource(hf).metadata()]


def generate(url: str) -> httpx.Response:
    return httpx.post(url + "/generate/", json={"prompt_ids": PROMPTS, "max_tokens": N_TOK, "temperature": 0,
                                                "generation_kwargs": {"ignore_eos": True}}, timeout=60)


def weight_checker(url: str, compare: dict | None = None) -> dict:
    r = httpx.post(url + "/weight_checker", json={} if compare is None else {"compare": compare}, timeout=60)
    r.raise_for_status()
    return r.json()


def wait_given_up(url: str, timeout_s: float) -> dict:
    """``/weight_info`` once the server has no transfer group and no call running (the failed
    update's teardown ran); raises AssertionError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    info: dict = {}
    while time.monotonic() < deadline:
        info = httpx.get(url + "/weight_info", timeout=10).json()
        if info["state"] == "uninitialized":
            return info
        time.sleep(0.05)
    raise AssertionError(f"the server never gave the update up within {timeout_s:.0f} s: {info}")


class Good:
    """The good weights and what the server serves with them (filled by the first sync)."""

    def __init__(self, meta):
        from rlserve.transfer import TensorListSource

        self.source = TensorListSource(random_weights(meta, GOOD_SEED))
        self.sums: dict | None = None
        self.tokens: list | None = None
        self.version: str | None = None
        self.n = 0

    def sync(self, srv, cfg: Config, bucket_bytes: int) -> None:
        """Land the good weights with an SDK trainer of this process (twice for direct receive)."""
        from rlserve.transfer import GlooTrainerInitInfo, HTTPWeightSyncClient, WeightTransferTrainerFactory

        eng = WeightTransferTrainerFactory.trainer_init(
            init_info=GlooTrainerInitInfo(master_port=free_port(), world_size=2, timeout_s=30,
                                          packed=cfg.packed or cfg.protocol == "trl",
                                          packed_buffer_size_bytes=bucket_bytes),
            client=HTTPWeightSyncClient(srv.url, timeout_s=60), source=self.source)
        try:
            for i in range(2 if cfg.direct and cfg.packed and cfg.staging == "none" else 1):
                self.n += 1
                self.version = f"good-{self.n}"
                eng.send_weights(weight_version=self.version)
                if i == 1:
                    assert eng.last_stats["server"]["direct_receive"] is True, eng.last_stats["server"]
        finally:
            eng.shutdown()
        if self.sums is None:
            self.sums = weight_checker(srv.url)["checksums"]
            r = generate(srv.url)
            assert r.status_code == 200, r.text
            self.tokens = r.json()["completion_ids"]


def verdict(url: str, good: Good) -> str:
    """``unchanged``, ``503`` or ``FAIL: why`` (module docstring)."""
    r = generate(url)
    health = httpx.get(url + "/health", timeout=10)
    info = httpx.get(url + "/weight_info", timeout=10).json()
    cmp = weight_checker(url, good.sums)["compare"]
    if r.status_code == 503:
        if health.status_code != 503 or not info.get("unavailable"):
            return f"FAIL: 503 on generation, /health {health.status_code}, unavailable {info.get('unavailable')!r}"
        return "503"
    if r.status_code != 200:
        return f"FAIL: generation answered {r.status_code}: {r.text[:200]}"
    body = r.json()
    problems = []
    if not cmp["match"]:
        problems.append(f"{len(cmp['mismatched'])} tensors differ from the good version")
    if body["completion_ids"] != good.tokens:
        problems.append("tokens differ from the good version's")
    if body.get("weight_version") != good.version:
        problems.append(f"version {body.get('weight_version')!r} != {good.version!r}")
    if health.status_code != 200:
        problems.append(f"/health {health.status_code}")
    if problems:
        return "FAIL: served 200 with " + ", ".join(problems)
    return "unchanged"


def run_config(path: str, meta: list, cfg: Config, timeout_s: float = 2.0, phases=None,
               bucket_bytes: int = 64 << 10, log=print) -> dict[str, str]:
    """Every phase of ``cfg`` (or ``phases``): ``{phase: verdict}``."""
    out: dict[str, str] = {}
    # timeout_s in the server's config too: TRL's init_communicator carries none
    with InProcessServer(path, transfer_config={"backend": "gloo", "direct_receive": cfg.direct,
                                                "timeout_s": timeout_s}, staging=cfg.staging) as srv:
        good = Good(meta)
        for phase in phases or cfg.phases():
            t0 = time.monotonic()
            good.sync(srv, cfg, bucket_bytes)
            try:
                spawn_killed_trainer(srv.url, free_port(), timeout_s, cfg.protocol, phase, meta, BAD_SEED,
                                     packed=cfg.packed, bucket_bytes=bucket_bytes)
                wait_given_up(srv.url, 30 + 10 * timeout_s)
                out[phase] = verdict(srv.url, good)
            except AssertionError as e:
                out[phase] = f"FAIL: {e}" + (f" [{verdict(srv.url, good)}]" if "gave the update up" in str(e) else "")
            log(f"{cfg.name:34s} {phase:16s} {out[phase]}  ({time.monotonic() - t0:.1f} s)")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--timeout-s", type=float, default=2.0, help="init_info.timeout_s of the killed trainers")
    ap.add_argument("--config", action="append", help="run only configurations whose name contains this")
    args = ap.parse_args()
    import tempfile

    from tests.tiny_models import make_tiny_model

    path = make_tiny_model("llama", tempfile.mkdtemp(prefix="kill-matrix-"), vocab_size=384)
    meta = model_meta(path)
    table = {}
    for cfg in CONFIGS:
        if args.config and not any(c in cfg.name for c in args.config):
            continue
        table[cfg.name] = run_config(path, meta, cfg, args.timeout_s)
    print()
    print("| path | " + " | ".join(PHASES) + " |")
    print("|---|" + "---|" * len(PHASES))
    bad = 0
    for cfg in CONFIGS:
        row = table.get(cfg.name)
        if row is None:
            continue
        cells = []
        for p in PHASES:
            v = row.get(p, "n/a")
            if p in row and v != expected(cfg, p):
                v += f" (expected {expected(cfg, p)})"
                bad += 1
            cells.append(v)
        print(f"| {cfg.name} | " + " | ".join(cells) + " |")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
