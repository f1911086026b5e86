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
- ``updated``: the trainer's whole update landed before it died (possible only where one call
  is the whole update: ipc per tensor), served under a new version;
- ``FAIL: ...`` anything else (e.g. 200 with changed weights: a half-updated model in service).
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time
from dataclasses import dataclass

import httpx
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from tests.kill_trainer import PHASES, random_weights, spawn_killed_trainer, trainer_init_info  # noqa: E402
from tests.transfer_harness import InProcessServer  # noqa: E402

PROMPTS = [[5, 17, 42, 9, 77, 3], [100, 101, 7]]
N_TOK = 6
GOOD_SEED, BAD_SEED = 1, 2
_LABELS = itertools.count(1)


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
    backend: str = "gloo"

    def phases(self) -> tuple[str, ...]:
        """The phases that exist on this path. gloo / NCCL: checksums travel after the data only
        when packed. ipc: ``checksums`` is a wrong checksum on the last data call (there is no
        exchange); per tensor, the whole update is one call (no ``between_buckets``, and
        ``/sync_weights`` is its own ``finish``)."""
        if self.backend == "ipc":
            return PHASES if self.packed else ("before_header", "first_bucket", "checksums")
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


def expected(cfg: Config, phase: str, cut: bool = True) -> set[str]:
    """The verdicts the server may give: staged updates never touch the served weights
    (``unchanged``); in place, the model is refused (``503``) from the moment bytes may have
    reached the parameters: a direct receive writes them from the first byte of the first
    bucket, the other paths once the first complete bucket / tensor is loaded. Where the
    trainer's death is not pinned to a byte (``cut`` false: real NCCL; ipc calls in flight),
    the first bucket may have been loaded or not: either verdict is right, a half-updated model
    in service never is."""
    if phase == "before_header":
        return {"unchanged"}
    if cfg.staging != "none":
        if phase == "first_bucket" and cfg.backend == "ipc" and not cfg.packed:
            # the one /sync_weights call may have completed (and been verified and committed)
            # before the kill: a whole new version, never a mix (seen on the H200, 2026-12-01)
            return {"unchanged", "updated"}
        return {"unchanged"}
    if cfg.backend == "ipc" and phase == "checksums":
        # a packed bucket's checksum is compared before its load (the earlier buckets were
        # loaded); per tensor the copy comes first
        return {"503"}
    if phase == "first_bucket":
        if cfg.backend == "ipc" and not cfg.packed:
            return {"503", "unchanged", "updated"}  # the one /sync_weights call may have completed
        if cfg.backend == "ipc" or not cut:
            return {"503", "unchanged"}
        return {"503"} if (cfg.direct and cfg.packed and cfg.protocol == "sdk" and cfg.backend == "gloo") \
            else {"unchanged"}
    return {"503"}


def model_meta(path: str) -> list[tuple[str, str, list[int]]]:
    """``(HF name, dtype name, shape)`` of every tensor a trainer of ``path`` sends, in order."""
    import torch
    from transformers import AutoModelForCausalLM

    from rlserve.transfer import ModuleSource
    from rlserve.transfer.wire.protocol import dtype_to_name

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return [(n, dtype_to_name(d), list(s)) for n, d, s in ModuleSource(hf).metadata()]


def generate(url: str) -> httpx.Response:
    return httpx.post(url + "/generate/", json={"prompt_ids": PROMPTS, "max_tokens": N_TOK, "temperature": 0,
                                                "generation_kwargs": {"ignore_eos": True}}, timeout=60)


def weight_checker(url: str, compare: dict | None = None) -> dict:
    r = httpx.post(url + "/weight_checker", json={} if compare is None else {"compare": compare}, timeout=60)
    r.raise_for_status()
    return r.json()


def wait_given_up(url: str, timeout_s: float, idle_ok: bool = False) -> dict:
    """``/weight_info`` once the server has no transfer group and no call running (the failed
    update's teardown ran) -- or, ``idle_ok``, no update session either (a trainer that died
    before its first call); raises AssertionError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    info: dict = {}
    while time.monotonic() < deadline:
        info = httpx.get(url + "/weight_info", timeout=10).json()
        if info["state"] == "uninitialized" or (idle_ok and info["state"] == "ready" and info["session"] is None):
            return info
        time.sleep(0.05)
    raise AssertionError(f"the server never gave the update up within {timeout_s:.0f} s: {info}")


def good_label() -> str:
    """A fresh label for the good weights: unique in this process (labels are unique for a
    server's lifetime, and a server may serve several runs) and never one the server makes up.
    A killed trainer sends no label, and where its whole update landed (ipc per tensor) the
    server labelled it automatically: ``next_version`` of the good label. Automatic labels always
    end in a digit ("good-15" after "good-14", "x.1" after "x"), so the good ones end in "-ok"
    (with "good-N", the next cell's "good-15" was the killed update's automatic label: 409
    ``weight_version_in_use``, the H200's failure of 2026-12-06)."""
    return f"good-{next(_LABELS)}-ok"


class Good:
    """The good weights and what the server serves with them (filled by the first sync)."""

    def __init__(self, meta, device: str = "cpu"):
        from rlserve.transfer import TensorListSource

        self.device = device
        self.source = TensorListSource(random_weights(meta, GOOD_SEED, device))
        self.sums: dict | None = None
        from rlserve.transfer import hf_state_checksums

        # the killed trainers' weights: a server that took their whole update (one ipc call that
        # completed before the trainer died) serves exactly these, under a new version
        self.bad_sums = hf_state_checksums(iter(random_weights(meta, BAD_SEED)), torch.float32)
        self.tokens: list | None = None
        self.version: str | None = None
        self.n = 0

    def sync(self, srv, cfg: Config, bucket_bytes: int) -> None:
        """Land the good weights with an SDK trainer of this process (twice for direct receive)."""
        from rlserve.transfer import HTTPWeightSyncClient, WeightTransferTrainerFactory

        direct = cfg.direct and cfg.packed and cfg.staging == "none" and cfg.backend == "gloo"
        eng = WeightTransferTrainerFactory.trainer_init(
            init_info=trainer_init_info(cfg.backend, cfg.packed or cfg.protocol == "trl", bucket_bytes, 30,
                                        self.device),
            client=HTTPWeightSyncClient(srv.url, timeout_s=60), source=self.source)
        try:
            for i in range(2 if direct else 1):
                self.n += 1
                self.version = good_label()
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
    if problems and body.get("weight_version") != good.version and health.status_code == 200 and \
            weight_checker(url, good.bad_sums)["compare"]["match"]:
        return "updated"  # the trainer's whole update landed before it died: a complete, new version
    if problems:
        return "FAIL: served 200 with " + ", ".join(problems)
    return "unchanged"


#: the server's ``timeout_s`` for TRL configurations (seconds). TRL's ``init_communicator``
#: carries no timeout, so the server's config bounds the whole TRL session: the good sync's and
#: the killed trainer's waits between calls. The killed trainer's own 2 s abandoned its session
#: before its first tensor on a loaded machine (load 14, 2026-12-06: "no /update_named_param/
#: call for 2 s after the update started"; the cell then never reached ``between_buckets``).
#: The TRL cells' deaths (between tensors, before ``reset_prefix_cache``) are noticed by the
#: liveness watch (~1 s), not by this bound.
TRL_SERVER_TIMEOUT_S = 30.0


def cpu_server(path: str, cfg: Config, timeout_s: float, liveness: bool = True):
    """The default server of :func:`run_config`: in this process, CPU, float32 (``liveness``:
    ``trainer_liveness`` in its config). ``timeout_s`` goes into the server's config too (the SDK
    trainers send their own); TRL configurations get :data:`TRL_SERVER_TIMEOUT_S` there."""
    server_timeout_s = max(timeout_s, TRL_SERVER_TIMEOUT_S) if cfg.protocol == "trl" and liveness else timeout_s
    return InProcessServer(path, transfer_config={"backend": cfg.backend, "direct_receive": cfg.direct,
                                                  "timeout_s": server_timeout_s, "trainer_liveness": liveness},
                           staging=cfg.staging)


def run_config(path: str, meta: list, cfg: Config, timeout_s: float = 2.0, phases=None,
               bucket_bytes: int = 64 << 10, log=print, server=cpu_server, device: str = "cpu",
               setup: str = "", timings: dict | None = None) -> dict[str, str]:
    """Every phase of ``cfg`` (or ``phases``): ``{phase: verdict}``.

    Args:
        server: ``server(path, cfg, timeout_s)`` -> a context manager giving an object with
            ``url`` (e.g. a GPU ``ServerProcess`` whose ``--weight-transfer-config`` has
            ``timeout_s``).
        device: where the trainers' tensors live (NCCL / ipc: a CUDA device).
        setup: Python the killed trainer runs first (:func:`~tests.kill_trainer.spawn_killed_trainer`).
        timings: when given, filled with ``{phase: seconds}`` from the trainer's death to the
            failure the server recorded (``/weight_info`` ``last_update.time``; ``None`` where it
            recorded none, e.g. an ipc trainer that died before its only call).
    """
    out: dict[str, str] = {}
    with server(path, cfg, timeout_s) as srv:
        good = Good(meta, device)
        for phase in phases or cfg.phases():
            t0 = time.monotonic()
            good.sync(srv, cfg, bucket_bytes)
            try:
                times: dict = {}
                spawn_killed_trainer(srv.url, 0, timeout_s, cfg.protocol, phase, meta, BAD_SEED,
                                     packed=cfg.packed, bucket_bytes=bucket_bytes, backend=cfg.backend,
                                     device=device, setup=setup, times=times)
                info = wait_given_up(srv.url, 30 + 10 * timeout_s,
                                     idle_ok=cfg.backend == "ipc" and not cfg.packed and phase == "before_header")
                if timings is not None:
                    last = info.get("last_update") or {}
                    failed = last.get("ok") is False and last.get("time", 0) >= times["killed"] - 1
                    timings[phase] = round(last["time"] - times["killed"], 3) if failed else None
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
            if p in row and v not in expected(cfg, p):
                v += f" (expected {' or '.join(sorted(expected(cfg, p)))})"
                bad += 1
            cells.append(v)
        print(f"| {cfg.name} | " + " | ".join(cells) + " |")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
