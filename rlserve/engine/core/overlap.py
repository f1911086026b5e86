"""Overlapped decode: schedule and launch step N+1 before reading step N's tokens.

In the plain loop the GPU waits while the host reads a step's tokens, appends them, checks
stop conditions, schedules and builds the next step: 0.6-1.0 ms of host CPU per step with 256
sequences in every decode step (``benchmarks/host_step.py --min-len 200 --max-len 200``: forward
and sampler stubbed, best of 3; 636-984 us a step in four runs, plain and overlapped loops, on a
2-core AMD EPYC at load ~6, 2026-12-07; session 18 measured 0.6-0.9 ms on it; BENCHMARKS.md,
"Engine host overhead", E3). Here, in steady decode, :meth:`OverlapScheduler.step`
launches step N+1 first and processes step N while N+1 runs:

1. every sequence of step N gets a placeholder token, so lengths, block slots, positions and
   seeded-draw indices of step N+1 are right; sequences that reach ``max_tokens`` or
   ``max_model_len`` with step N's token leave the running list (their next step is known to
   be unneeded);
2. the scheduler picks step N+1; its input ids are gathered on the device from step N's
   sampled tokens (``StepInput.input_ids_from``), its forward and sampler are launched;
3. step N's tokens are read (the only host sync: they were copied to pinned host memory right
   after step N's sampler, and only that copy is waited for), replace the placeholders and go through
   the usual bookkeeping; a sequence that stops here (EOS, stop token or string) has one
   wasted row in step N+1, whose result is dropped.

Prefill steps overlap the same way: while prompts wait, the next step is a prefill of other
sequences, whose inputs are all on the host, so it is launched before the step in flight is
read (the prefill phase of a large batch is otherwise one host sync per step). A mixed step
(``--mixed-prefill-decode``) too: its decode rows of the step in flight take their input ids on
the device (``StepInput.input_ids_from`` with the flat rows to fill), under the decode rule below.

With ``RLSERVE_OVERLAP_AFTER_PREFILL=1`` (the default since session 19: GPU tests pass, H100 offline 0.1-0.4% faster),
a decode step after a prefill step of new prompts holds the running sequences (their last token
on the host: they were not in the prefill step) and the new ones (their first token on the
device, in the prefill's sampler output): it is launched early too, its rows of the step in flight
filled on the device (``(tokens, rows, where)``), the others from the host. Only one step is ever
in flight, so a sequence not in it has no placeholder. Before session 18 (issue 37) a decode step
was launched early only when *every* sequence in it was in the step in flight, so every prefill
step while sequences ran was followed by an unoverlapped decode step (the default still keeps that
rule: the gain and the GPU tests are not yet run on a GPU, ``benchmarks/device/s18_overlap.sh``).
Which batch runs next does not change, only when it is launched: tokens are the plain loop's.

Block frees while a step is in flight are safe: every later write to a freed block comes from
a step launched later on the same stream. A decode step (or a mixed step's decode rows) is
launched early only when every sequence in it that was in the step in flight samples
independently of its output's *values* (no repetition / frequency / presence penalty, no bad
words, no structured output: those read the placeholder; a sequence that was not in the step in
flight has its real tokens and may use them), and the executor takes device-side input ids
(in-process workers); a prefill step whenever it is the next step. Otherwise the step is
launched after the step in flight was read, and stays in flight until the next ``step()``: prompts
waiting then go out before it is read (a step whose sampling reads output values, with no prompt
waiting, is read at once: there is nothing to overlap it with). On by default
for a CUDA engine with in-process workers (``EngineConfig.async_scheduling``, vLLM's name;
:func:`rlserve.engine.core.engine_setup.want_async_scheduling` says how it is decided; off with
``--no-async-scheduling`` or ``RLSERVE_ASYNC_SCHEDULING=0``); anything that changes the engine
from outside a step (abort, weight loads, RPCs, prefix-cache reset) first calls
:meth:`OverlapScheduler.drain`, whose outputs the next ``step()`` returns (until then
``has_unfinished_requests()`` stays true, so a driver keeps stepping).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlserve import envs
from rlserve.engine.core.scheduler import ScheduledBatch

PLACEHOLDER = -1  # a sampled token not yet read back; never reaches an output


@dataclass
class _InFlight:
    seqs: list
    out: object  # SamplerOutput (device tensors: the next step gathers its input ids here)
    host: object  # the same in pinned host memory, valid once ``done`` has completed
    done: object  # CUDA event after the device-to-host copies (None on CPU)
    token_index: list[int]  # per sequence: where this step's token goes in its output list
    row: dict  # sequence -> row (sequences hash by identity)
    is_prefill: bool = False

    def wait(self):
        """The step's results on the host (waits for this step's copies only: a ``tolist()``
        of the device tensors would wait for every later launch on the stream too)."""
        if self.done is not None:
            self.done.synchronize()
        return self.host


def _copy_to_host(out):
    """Queue pinned device-to-host copies of a SamplerOutput; ``(host copy, event)``."""
    if out.token_ids.device.type != "cuda":
        return out, None
    host = type(out)(*(torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
                       if t.numel() else torch.empty(t.shape, dtype=t.dtype)
                       for t in (out.token_ids, out.logprobs, out.topk_token_ids, out.topk_logprobs)))
    done = torch.cuda.Event()
    done.record()
    return host, done


def _ids_from(batch, prev: _InFlight | None) -> tuple | None:
    """``StepInput.input_ids_from`` of ``batch`` launched while ``prev`` is in flight: its decode
    rows (every row of a decode step, the first ``num_decodes`` of a mixed one) whose sequence
    was in ``prev`` take their id from ``prev``'s sampled tokens, ``(tokens, rows)`` when that is
    every row of a decode step, else ``(tokens, rows, where)`` with the flat rows ``where``; None
    when no row is such (the others' last tokens are on the host)."""
    if prev is None:
        return None
    dec = batch.seqs[:batch.num_decodes] if batch.is_prefill else batch.seqs
    row = prev.row
    where, rows = [], []
    for i, s in enumerate(dec):
        r = row.get(s)
        if r is not None:
            where.append(i)
            rows.append(r)
    if not where:
        return None
    if not batch.is_prefill and len(where) == len(dec):
        return prev.out.token_ids, rows
    return prev.out.token_ids, rows, where


def overlappable(seqs) -> bool:
    """Whether a decode batch's sampling is independent of its output token values."""
    for s in seqs:
        p = s.params
        if s.grammar is not None or p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 \
                or p.presence_penalty != 0.0 or p.bad_words_token_ids:
            return False
    return True


class OverlapScheduler:
    """The overlapped ``step`` of an :class:`~rlserve.engine.core.llm_engine.LLMEngine` (see the
    module docstring)."""

    def __init__(self, engine):
        self.engine = engine
        self.inflight: _InFlight | None = None
        self.pending: list = []
        self.after_prefill = envs.RLSERVE_OVERLAP_AFTER_PREFILL
        #: steps scheduled while a step was in flight: launched before it was read ("early"; of
        #: them "early_host_rows": decode steps with rows whose ids came from the host) or after
        #: ("after_read": not launchable early)
        self.counts = {"early": 0, "early_host_rows": 0, "after_read": 0}

    def _launch(self, batch, prev: _InFlight | None) -> _InFlight:
        ids = _ids_from(batch, prev)
        if prev is not None and not batch.is_prefill and (ids is None or len(ids) == 3):
            self.counts["early_host_rows"] += 1
        seqs, out = self.engine._launch(batch, ids)  # (a chunk that does not end its prompt samples nothing)
        index = [len(s.output_token_ids) for s in seqs]
        host, done = _copy_to_host(out)
        return _InFlight(list(seqs), out, host, done, index, {s: i for i, s in enumerate(seqs)}, batch.is_prefill)

    def _launchable(self, follow, cur: _InFlight) -> bool:
        """Whether ``follow`` can run before ``cur``'s tokens are read: its decode rows (a decode
        step's sequences, a mixed step's first ``num_decodes``) of ``cur``'s sequences sample
        independently of output values (their ids come from ``cur``'s device tensor, their output
        lists end in a placeholder); its other rows' inputs are on the host. Without
        ``RLSERVE_OVERLAP_AFTER_PREFILL`` a decode step only when all its sequences were in ``cur``."""
        row = cur.row
        dec = follow.seqs[:follow.num_decodes] if follow.is_prefill else follow.seqs
        if not self.after_prefill and not follow.is_prefill and not all(s in row for s in dec):
            return False
        return overlappable([s for s in dec if s in row])

    def _schedule_next(self, cur: _InFlight):
        """Placeholders for ``cur``'s tokens, then the scheduler's next batch."""
        eng = self.engine
        done = set()
        for s in cur.seqs:
            if s.is_finished:
                continue
            s.output_token_ids.append(PLACEHOLDER)
            if s.num_output_tokens >= s.params.max_tokens or len(s) >= eng.max_model_len:
                done.add(id(s))
        if done:
            eng.scheduler.running = [s for s in eng.scheduler.running if id(s) not in done]
        return eng.scheduler.schedule()

    def step(self, outputs_for) -> list:
        eng = self.engine
        outs, self.pending = self.pending, []
        cur, self.inflight = self.inflight, None
        if cur is None:
            batch = eng.scheduler.schedule()
            if batch is None:
                return outs
            cur = self._launch(batch, None)
        follow = None
        # prompts waiting: the next step is most likely their prefill, launchable at once (else,
        # a step of sequences whose sampling reads output values is read first: nothing to overlap)
        if eng.scheduler.waiting or eng.scheduler.prefilling or overlappable(cur.seqs):
            follow = self._schedule_next(cur)
            if follow is not None and self._launchable(follow, cur):
                self.inflight = self._launch(follow, cur)
                self.counts["early"] += 1
                follow = None
        outs += eng._finish_step(cur.seqs, cur.wait(), outputs_for, cur.token_index)
        if follow is not None:  # scheduled on placeholders but not launchable early: its ids are real now
            keep = [i for i, s in enumerate(follow.seqs) if not s.is_finished]  # some stopped at cur's tokens
            self.counts["after_read"] += 1
            if keep:
                batch = ScheduledBatch([follow.seqs[i] for i in keep], follow.is_prefill)
                if follow.starts is not None:  # a mixed step (or chunks): its spans, less the stopped rows
                    batch.starts, batch.ends = [follow.starts[i] for i in keep], [follow.ends[i] for i in keep]
                    batch.num_decodes = sum(i < follow.num_decodes for i in keep)
                # in flight until the next step(): prompts waiting then go out before it is read
                self.inflight = self._launch(batch, None)
        return outs

    def drain(self) -> None:
        """Finish the step in flight, if any (its outputs go to the next ``step()``)."""
        cur, self.inflight = self.inflight, None
        if cur is not None:
            self.pending += self.engine._finish_step(cur.seqs, cur.wait(), None, cur.token_index)
