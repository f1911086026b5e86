"""The step pipeline of an :class:`~rlserve.engine.core.llm_engine.LLMEngine`: schedule, flatten the
batch into a :class:`~rlserve.engine.worker.model_runner.StepInput`, run the forward pass and sampler
(:meth:`EngineStep._launch`, tokens left on the device), then read the tokens back, apply the stop
rules and build the cumulative outputs (:meth:`EngineStep._finish_step`). The overlapped decode
(:mod:`rlserve.engine.core.overlap`) calls the same two halves with a step in flight between them.

:class:`EngineStep` is a base class of ``LLMEngine``; it uses the engine's ``config``,
``scheduler``, ``executor``, ``sampler``, ``requests``, ``eos_token_ids``, ``max_model_len``,
``stats_counters`` and ``_overlap``.
"""

from __future__ import annotations

import time

import torch

from rlserve.engine.worker.step_input import StepInput
from rlserve.engine.outputs import CompletionOutput, RequestOutput
from rlserve.engine.core.prompt_logprobs import ranked_logprob_dicts
from rlserve.engine.core.sampler import SamplerOutput, SamplingMetadata
from rlserve.engine.core.scheduler import ScheduledBatch
from rlserve.engine.core.sequence import Request, Sequence
from rlserve.h2d import to_device
from rlserve.engine.core.iteration_tokens import count_iteration_tokens


def _empty_output(device) -> SamplerOutput:
    """The sampler's output for a step that samples no row (every sequence in it is an
    unfinished chunk of a chunked prefill)."""
    ids = torch.empty(0, dtype=torch.long, device=device)
    lps = torch.empty(0, dtype=torch.float32, device=device)
    return SamplerOutput(ids, lps, ids.view(0, 0), lps.view(0, 0))


def _lora_ids(config, seqs) -> list[int] | None:
    """Each sequence's LoRA adapter id (``StepInput.lora_ids``), or None when all run on the base model
    (or the engine runs without ``enable_lora``: no per-sequence work then)."""
    if not getattr(config, "enable_lora", False):
        return None
    ids = [s.params.lora_int_id for s in seqs]
    return ids if any(ids) else None


class EngineStep:
    """One engine step, in two halves (see the module docstring)."""

    #: :class:`rlserve.engine.routed_experts.RoutedExpertsRecorder` with routed-experts replay on
    routed_experts = None

    def _release(self, seq: Sequence) -> None:
        """Finish ``seq`` in the scheduler (its KV blocks go back), keeping its routed experts
        first (replay on: they are read from its blocks' slots)."""
        if self.routed_experts is not None and seq.block_table:
            seq.routed_experts = self.routed_experts.read(seq, seq.params.routed_experts_prompt_start)
        self.scheduler.finish(seq)

    def _drain(self) -> None:
        """Finish an overlapped step still in flight (before anything changes the engine
        from outside a step); its outputs come with the next :meth:`step`."""
        if self._overlap is not None:
            self._overlap.drain()

    def _build_step(self, batch: ScheduledBatch) -> tuple[StepInput, list[tuple], list[int] | None]:
        """Flatten a batch. Returns the step; per sequence wanting prompt logprobs from this
        step's tokens ``(seq, first_row, n_rows, first_position, final)`` (rows into the logits,
        row ``r`` predicting prompt token ``first_position + r - first_row + 1``; ``final``: the
        prompt's last chunk); and the logits rows to sample from, one per sequence of
        ``batch.sampled`` in order (None: every row, the common case)."""
        if not batch.is_prefill:  # one token per sequence: the common step, kept lean
            seqs = batch.seqs
            slens = [len(s) for s in seqs]
            B = len(seqs)
            step = StepInput([s.last_token_id for s in seqs], [n - 1 for n in slens], [1] * B, slens,
                             [s.block_table for s in seqs], list(range(B)), False, lora_ids=_lora_ids(self.config, seqs))
            return step, [], None
        # a mixed step's decode rows first: one token each (its last; ``all_token_ids`` would copy
        # the whole sequence), always sampled, never prompt logprobs (their prompts are done)
        nd = batch.num_decodes
        dec = batch.seqs[:nd]
        input_ids: list[int] = [s.last_token_id for s in dec]
        slens = [len(s) for s in dec]
        positions: list[int] = [n - 1 for n in slens]
        qlens, tables = [1] * nd, [s.block_table for s in dec]
        logit_rows, sample_rows = list(range(nd)), list(range(nd))
        prompt_rows: list[tuple] = []
        for i in range(nd, len(batch.seqs)):
            seq = batch.seqs[i]
            start, end = batch.span(i)
            base = len(input_ids)
            input_ids.extend(seq.all_token_ids[start:end])
            positions.extend(range(start, end))
            qlens.append(end - start)
            slens.append(end)
            tables.append(seq.block_table)
            req = self.requests[seq.request_id]
            if seq.params.prompt_logprobs is not None and not req.prompt_logprobs_done and seq.index == 0:
                # rows predicting prompt tokens 1..P-1 come from positions 0..P-2
                p = seq.num_prompt_tokens
                count = max(0, min(end, p - 1) - start)
                prompt_rows.append((seq, len(logit_rows), count, start, end >= p))
                logit_rows.extend(range(base, base + count))
            if end == len(seq):
                sample_rows.append(len(logit_rows))
            logit_rows.append(base + end - start - 1)
        step = StepInput(input_ids, positions, qlens, slens, tables, logit_rows, batch.is_prefill,
                         lora_ids=_lora_ids(self.config, batch.seqs))
        return step, prompt_rows, (None if len(sample_rows) == len(logit_rows) else sample_rows)

    def _prompt_logprobs(self, logits: torch.Tensor, prompt_rows: list[tuple]) -> None:
        """Prompt logprobs from this step's rows (``_build_step``'s ``prompt_rows``); a prompt
        prefilled in chunks collects its rows' entries chunk by chunk, and its request gets them
        with the last chunk (vLLM's format: ``compute_prompt_logprobs``)."""
        for seq, first, count, start, final in prompt_rows:
            req = self.requests[seq.request_id]
            if start == 0:  # a prompt's first chunk (again, after a preemption): no hits with prompt logprobs
                req.extra["prompt_logprob_parts"] = ([None], [None])
            parts = req.extra["prompt_logprob_parts"]
            if count:
                dicts, ranks = ranked_logprob_dicts(logits[first : first + count],
                                                    seq.prompt_token_ids[start + 1 : start + 1 + count],
                                                    seq.params.prompt_logprobs, self.config.logprobs_mode)
                parts[0].extend(dicts)
                parts[1].extend(ranks)
            if final:
                req.prompt_logprobs, req.extra["prompt_logprob_ranks"] = parts
                del req.extra["prompt_logprob_parts"]
                req.prompt_logprobs_done = True

    #: ``step`` takes ``outputs_for`` and sets ``last_step_request_ids`` (the async engine asks).
    supports_output_filter = True

    def step(self, outputs_for=None) -> list[RequestOutput]:
        """Run one scheduling step and forward pass.

        Args:
            outputs_for: ``None``: an output for every request that advanced. Else a container of
                request ids: outputs only for those and for requests that finished this step (a
                cumulative output copies every token list: O(length) per request per step, which
                offline and non-streamed callers need not pay).
        Requests whose structured-output constraint finished compiling join the scheduler first
        (:meth:`LLMEngine.admit_compiled`).

        Returns:
            cumulative outputs, as selected. ``self.last_step_request_ids`` lists every request
            that advanced (got tokens) in this step, in batch order.
        """
        failed = self.admit_compiled() if len(self._grammars) else []
        if self._overlap is not None:
            outs = self._overlap.step(outputs_for)
        else:
            batch = self.scheduler.schedule()
            outs = [] if batch is None else self._finish_step(*self._launch(batch), outputs_for)
        return failed + outs if failed else outs

    def _launch(self, batch: ScheduledBatch, ids_from: tuple | None = None) -> tuple[list[Sequence], SamplerOutput]:
        """Run ``batch``'s forward pass and sampler; the tokens stay on the device. Prompt
        logprobs are computed here. ``ids_from``: ``StepInput.input_ids_from``.

        Returns:
            the sequences that sampled a token, in the output's row order (``batch.seqs``, or
            ``batch.sampled`` when a chunk that does not end its prompt samples nothing: the one
            place that decides it, for the plain and the overlapped step), and the output."""
        step, prompt_rows, sample_rows = self._build_step(batch)
        step.input_ids_from = ids_from
        if batch.is_prefill:  # before the forward pass, as vLLM's scheduled_ts: the prefill
            now = time.monotonic()  # phase (scheduled -> first token) holds the forward
            for seq in batch.seqs[batch.num_decodes:]:  # the first prefill step of a request
                self.requests[seq.request_id].extra.setdefault("scheduled_time", now)
        logits = self.executor.execute(step)
        if self.routed_experts is not None:
            self.routed_experts.record_step(step)
        self.stats_counters["steps"] += 1
        count_iteration_tokens(self.stats_counters, len(step.input_ids))
        if batch.is_prefill:  # a mixed step's first num_decodes rows decode
            self.stats_counters["prefill_tokens_computed"] += len(step.input_ids) - batch.num_decodes
            self.stats_counters["decode_tokens"] += batch.num_decodes
        else:
            self.stats_counters["decode_tokens"] += len(step.input_ids)
        if prompt_rows:
            self._prompt_logprobs(logits, prompt_rows)
        seqs = batch.seqs
        if sample_rows is not None:
            seqs = batch.sampled
            if not seqs:  # only unfinished chunks of prompts: nothing to sample
                return seqs, _empty_output(logits.device)
            logits = logits[to_device(sample_rows, torch.long, logits.device)]
        meta = SamplingMetadata(
            params=[s.params for s in seqs],
            prompt_token_ids=[s.prompt_token_ids for s in seqs],
            output_token_ids=[s.output_token_ids for s in seqs],
            grammars=[s.grammar for s in seqs] if any(s.grammar is not None for s in seqs) else None,
        )
        return seqs, self.sampler(logits, meta)

    def _finish_step(self, seqs: list[Sequence], out: SamplerOutput, outputs_for, token_index=None) -> list[RequestOutput]:
        """Read a launched step's tokens (the host sync), append them, finish sequences and
        build outputs (see :meth:`step`). ``token_index``: per sequence, where this step's
        token goes in its output list (overlapped decode: placeholders from there on are
        replaced; sequences finished meanwhile are skipped)."""
        token_ids = out.token_ids.tolist()
        lps = out.logprobs.tolist()
        topk_ids = out.topk_token_ids.tolist() if out.topk_token_ids.numel() else None
        topk_lps = out.topk_logprobs.tolist() if out.topk_logprobs.numel() else None
        touched: dict[str, Request] = {}
        ended: set[str] = set()  # requests with a sequence that finished in this step
        requests = self.requests
        for i, seq in enumerate(seqs):
            if token_index is not None:
                if seq.is_finished:
                    continue
                del seq.output_token_ids[token_index[i]:]
            seq.num_computed_tokens = len(seq)
            rid = seq.request_id
            if self._append_token(seq, token_ids[i], lps[i], topk_ids[i] if topk_ids else None,
                                  topk_lps[i] if topk_lps else None):
                ended.add(rid)
            touched[rid] = requests[rid]
        outputs = []
        self.last_step_request_ids = list(touched)
        if outputs_for is not None and not outputs_for and not ended:
            return outputs  # offline: nothing finished, nothing asked for
        for rid, req in touched.items():
            if rid in ended and req.finished:
                outputs.append(self._make_output(req))
                del requests[rid]
            elif outputs_for is None or rid in outputs_for:
                outputs.append(self._make_output(req))
        return outputs

    def _append_token(self, seq: Sequence, tok: int, lp: float, top_ids, top_lps) -> bool:
        """Append one sampled token to ``seq`` and apply the stop rules; True when ``seq``
        finished with it."""
        p = seq.params
        seq.output_token_ids.append(tok)
        if seq.cumulative_logprob is not None:  # the request asked for logprobs (else lp is NaN)
            seq.cumulative_logprob += lp
            if seq.sampled_logprobs is not None:
                seq.sampled_logprobs.append(lp)
        self.stats_counters["generation_tokens"] += 1
        if seq.logprobs is not None:
            d = {tok: lp}
            if top_ids is not None and p.logprobs:
                for t, l in zip(top_ids[: p.logprobs], top_lps[: p.logprobs]):
                    d.setdefault(t, l)
            seq.logprobs.append(d)
        n_out = seq.num_output_tokens
        if seq.grammar is not None and (not seq.grammar.accept(tok) or seq.grammar.is_terminated):
            # the constraint is complete (its EOS was drawn), or nothing it allows was left to draw
            seq.finish_reason = "stop"
        if seq.finish_reason is not None:
            pass
        elif tok in p.stop_token_ids and n_out >= p.min_tokens:
            seq.finish_reason, seq.stop_reason = "stop", tok
        elif tok in self.eos_token_ids and not p.ignore_eos and n_out >= p.min_tokens:
            seq.finish_reason = "stop"
        # a terminating EOS / stop token is text only when asked for (vLLM's rule)
        if seq.finish_reason is None or p.include_stop_str_in_output:
            match = seq.detokenizer.add_tokens([tok])
            if match is not None and seq.finish_reason is None:
                seq.finish_reason, seq.stop_reason = "stop", match.stop_str
        if seq.finish_reason is None and (n_out >= p.max_tokens or len(seq) >= self.max_model_len):
            seq.finish_reason = "length"
        if seq.finish_reason is not None:
            seq.detokenizer.finish()
            self._release(seq)
            return True
        return False

    def _make_output(self, req: Request) -> RequestOutput:
        outs = []
        for s in req.seqs:
            outs.append(
                CompletionOutput(
                    index=s.index,
                    text=s.detokenizer.visible_text,
                    token_ids=list(s.output_token_ids),
                    cumulative_logprob=s.cumulative_logprob,
                    logprobs=list(s.logprobs) if s.logprobs is not None else None,
                    routed_experts=s.routed_experts if s.finish_reason is not None else None,
                    finish_reason=s.finish_reason,
                    stop_reason=s.stop_reason,
                )
            )
        return RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=req.prompt_token_ids,
            prompt_logprobs=req.prompt_logprobs,
            prompt_logprob_ranks=req.extra.get("prompt_logprob_ranks"),
            outputs=outs,
            finished=req.finished,
            scheduled_time=req.extra.get("scheduled_time"),
        )
