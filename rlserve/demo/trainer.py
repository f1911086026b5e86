"""The trainer's side of the demo: its Hugging Face model, its own greedy ``generate`` (the
reference), and the weight sync through the trainer SDK (:func:`sync_weights`)."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from rlserve.demo.common import DemoError
from rlserve.demo.layout import Layout
from rlserve.progress import progress as progress_line


def torch_dtype(name: str):
    import torch

    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise DemoError(f"unknown dtype {name!r}")
    return dt


def load_trainer_model(model_path: str, device: str = "cpu", dtype: str = "float32"):
    """The trainer's model: ``AutoModelForCausalLM.from_pretrained`` on ``device`` in ``dtype``, eval mode."""
    import transformers
    from transformers import AutoModelForCausalLM

    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    key = "dtype" if (major, minor) >= (4, 56) else "torch_dtype"
    if str(device).startswith("cpu"):
        # the trainer's generate shares the machine with the server as an engine would: the
        # same thread rule (one core left to the others; torch's default of one thread per
        # core measured 508 s for the 4 x 32-token reference generate on the loaded 2-core
        # CI machine, where the server itself took 35-45 s per 4 x 32 tokens)
        from rlserve.engine.cpu.cpu_threads import configure_engine_threads

        configure_engine_threads()
    model = AutoModelForCausalLM.from_pretrained(model_path, **{key: torch_dtype(dtype)})
    return model.to(device).eval()


def eos_token_ids(model) -> set[int]:
    """EOS ids as ``generate`` uses them (generation config, else the model config)."""
    ids: set[int] = set()
    for cfg in (getattr(model, "generation_config", None), model.config):
        e = getattr(cfg, "eos_token_id", None) if cfg is not None else None
        if e is not None:
            ids.update([e] if isinstance(e, int) else list(e))
            break
    return ids


def trainer_greedy(model, prompt_token_ids: Sequence[Sequence[int]], max_new_tokens: int,
                   progress: str | None = None) -> list[list[int]]:
    """The trainer model's own greedy ``generate`` (``do_sample=False``), one prompt at a time,
    from the given token ids; each result ends after its first EOS token (kept, as the server
    keeps it) or after ``max_new_tokens``. ``progress``: the label of a tqdm line of tokens."""
    import torch
    from transformers import GenerationConfig

    eos = sorted(eos_token_ids(model))
    pad = eos[0] if eos else 0
    gc = GenerationConfig(do_sample=False, num_beams=1, max_new_tokens=int(max_new_tokens),
                          eos_token_id=eos or None, pad_token_id=pad)
    from transformers.generation.streamers import BaseStreamer

    class _Count(BaseStreamer):  # generate() puts the prompt first, then one token per step
        def __init__(self, bar):
            self.bar, self.prompt_seen = bar, False

        def put(self, value):
            if self.prompt_seen:
                self.bar.update(1)
            self.prompt_seen = True

        def end(self):
            pass

    device = next(model.parameters()).device
    out: list[list[int]] = []
    with torch.inference_mode(), progress_line(progress, total=len(prompt_token_ids) * int(max_new_tokens),
                                               unit="tok", enabled=progress is not None) as bar:
        for ids in prompt_token_ids:
            x = torch.tensor([list(ids)], dtype=torch.long, device=device)
            y = model.generate(x, attention_mask=torch.ones_like(x), generation_config=gc,
                               streamer=_Count(bar) if progress is not None else None)
            gen = y[0, x.shape[1]:].tolist()
            if progress is not None and len(gen) < int(max_new_tokens):  # ended at EOS: the line ends at 100%
                bar.total -= int(max_new_tokens) - len(gen)
                bar.refresh()
            for i, t in enumerate(gen):
                if t in eos:
                    gen = gen[: i + 1]
                    break
            out.append(gen)
    return out


@dataclass
class SyncReport:
    """Timings of one weight sync (seconds) and what moved. ``kind``: "cold" (the first sync of a
    transfer group: includes ``trainer_init`` and the server laying out its receive buffers) or
    "warm" (a later sync on the same group: what every training step pays)."""

    backend: str
    init_s: float
    pause_s: float
    send_s: float
    resume_s: float
    bytes: int
    buckets: int
    transfer_s: float | None
    weight_version: str | None
    stats: dict = field(default_factory=dict)
    kind: str = "cold"
    init_stats: dict = field(default_factory=dict)  # the engine's init_stats (the cold sync's handshake)

    @property
    def sync_s(self) -> float:
        """pause + send + resume: how long generation was stopped."""
        return self.pause_s + self.send_s + self.resume_s

    @property
    def gbps(self) -> float:
        return self.bytes / self.send_s / 1e9 if self.send_s > 0 else 0.0

    def lines(self) -> list[str]:
        xfer = ""
        if self.transfer_s:
            xfer = f" (data plane {self.transfer_s:.2f}s, {self.bytes / self.transfer_s / 1e9:.2f} GB/s)"
        what = ("cold: the group's first sync, with trainer_init" if self.kind == "cold"
                else "warm: a later sync on the same group, as every training step")
        init = f"init {self.init_s:.2f}s | " if self.kind == "cold" else ""
        return [
            f"[sync] {self.kind} sync ({what}): {self.backend}, {self.bytes / 1e6:.1f} MB in {self.buckets} "
            f"bucket(s), weight version -> {self.weight_version}",
            f"[sync]   {init}pause {self.pause_s:.2f}s | send_weights {self.send_s:.2f}s{xfer} | "
            f"resume {self.resume_s:.2f}s",
            *phase_lines(self.stats, self.init_stats if self.kind == "cold" else None),
            f"[sync]   {self.kind} sync time {self.sync_s:.2f}s (generation paused), {self.gbps:.2f} GB/s end to end",
        ]


#: the server's update phases (``update_weights``' ``worker_phases_s``) the demo prints, in order
_SERVER_PHASES = (("receive_buffers", "buffers"), ("receive_header", "header"), ("receive_wait", "wait"),
                  ("receive_load", "load"), ("receive_checksum", "checksum"),
                  ("op_direct_layout", "lay out for direct receive"), ("op_post_load", "post-load repack"))


def phase_lines(stats: dict, init_stats: dict | None = None) -> list[str]:
    """Where one ``send_weights`` went (seconds), from the SDK's :attr:`last_stats`: its own phases
    (``phases_s``) and the server's (``server.worker_phases_s``, the worker's receive in
    ``worker_seconds``); with ``init_stats`` (:attr:`init_stats` of the engine: a cold sync) the
    handshake's too. Empty when the stats have none of them (e.g. ipc's one-call sync)."""
    out = []
    if init_stats and init_stats.get("phases_s"):
        ph, srv = init_stats["phases_s"], init_stats.get("server") or {}
        parts = [f"{k} {ph[k]:.2f}s" for k in ("group", "init_call") if ph.get(k) is not None]
        if srv.get("seconds") is not None:
            parts.append(f"server {srv['seconds']:.2f}s")
        out.append("[sync]   trainer_init: " + " | ".join(parts))
    ph = stats.get("phases_s") or {}
    if ph:
        out.append("[sync]   send_weights: " + " | ".join(f"{k} {v:.2f}s" for k, v in ph.items()))
    srv = stats.get("server") or {}
    wph = srv.get("worker_phases_s") or {}
    if srv.get("worker_seconds") is not None and wph:
        parts = [f"{label} {wph[k]:.2f}s" for k, label in _SERVER_PHASES if k in wph]
        what = "direct receive" if srv.get("direct_receive") else "receive"
        out.append(f"[sync]   server: {what} {srv['worker_seconds']:.2f}s, update_weights {srv.get('seconds', 0):.2f}s"
                   + (" (" + " | ".join(parts) + ")" if parts else ""))
    return out


def make_init_info(layout: Layout, world_size: int, **kw):
    """The trainer init info of ``layout.backend`` (trainer = rank 0, rendezvous on 127.0.0.1)."""
    from rlserve.transfer import GlooTrainerInitInfo, IPCTrainerInitInfo, NCCLTrainerInitInfo

    if layout.backend == "gloo":
        return GlooTrainerInitInfo(master_address="127.0.0.1", world_size=world_size, **kw)
    if layout.backend == "nccl":
        return NCCLTrainerInitInfo(master_address="127.0.0.1", world_size=world_size,
                                   device=layout.trainer_device, **kw)
    if layout.backend == "ipc":
        return IPCTrainerInitInfo(world_size=world_size, device=layout.trainer_device, **kw)
    raise DemoError(f"unknown backend {layout.backend!r}")


def default_trainer_init(client, model, layout: Layout):
    """``WeightTransferTrainerFactory.trainer_init`` with :func:`make_init_info`'s init info."""
    from rlserve.transfer import ModuleSource, WeightTransferTrainerFactory

    return WeightTransferTrainerFactory.trainer_init(
        init_info=make_init_info(layout, client.get_world_size() + 1),
        client=client,
        source=ModuleSource(model),
    )


#: ``trainer_init(client, model, layout) -> trainer engine``: how a script opens its end.
TrainerInit = Callable[[Any, Any, Layout], Any]


def sync_weights(base_url: str, model, layout: Layout, admin_key: str | None = None,
                 pause_mode: str = "abort", trainer_init: TrainerInit | None = None, warm_syncs: int = 1,
                 progress: bool = False) -> list[SyncReport]:
    """Push ``model``'s weights through the trainer SDK: ``trainer_init`` (the handshake; default
    :func:`default_trainer_init`), then ``1 + warm_syncs`` times pause generation, ``send_weights``,
    resume; then leave the transfer group. Returns the reports, the cold one first.
    ``progress``: a tqdm line with the elapsed time while each sync runs."""
    import torch

    from rlserve.transfer import HTTPWeightSyncClient

    client = HTTPWeightSyncClient(base_url, admin_key=admin_key)
    if layout.trainer_device.startswith("cuda"):
        torch.cuda.set_device(torch.device(layout.trainer_device))
    reports: list[SyncReport] = []
    cold_bar = contextlib.ExitStack()  # one line for trainer_init + the first send_weights
    cold_bar.enter_context(progress_line("[sync] cold: trainer_init + send_weights", enabled=progress))
    t0 = time.perf_counter()
    try:
        engine = (trainer_init or default_trainer_init)(client, model, layout)
    except BaseException:
        cold_bar.close()
        raise
    init_s = time.perf_counter() - t0
    try:
        for i in range(1 + max(0, int(warm_syncs))):
            kind = "cold" if i == 0 else "warm"
            with (progress_line("[sync] warm: send_weights", enabled=progress) if i > 0
                  else contextlib.nullcontext()):
                t1 = time.perf_counter()
                client.pause(mode=pause_mode)
                t2 = time.perf_counter()
                try:
                    fin = engine.send_weights()
                except BaseException:
                    with contextlib.suppress(Exception):  # never leave the server paused; keep the first error
                        client.resume()
                    raise
                t3 = time.perf_counter()
                client.resume()
                t4 = time.perf_counter()
            cold_bar.close()  # idempotent
            st = dict(engine.last_stats)
            reports.append(SyncReport(layout.backend, init_s if i == 0 else 0.0, t2 - t1, t3 - t2, t4 - t3,
                                      int(st.get("bytes") or 0), int(st.get("buckets") or 0), st.get("seconds"),
                                      fin.get("weight_version"), st, kind=kind,
                                      init_stats=dict(getattr(engine, "init_stats", None) or {}) if i == 0 else {}))
    except BaseException:
        cold_bar.close()
        with contextlib.suppress(Exception):
            engine._teardown()  # the server is about to go too: do not wait on its shutdown route
        raise
    engine.shutdown()
    return reports


