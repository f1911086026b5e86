"""What every route needs: the async engine, settings, metrics, and the request checks
shared by the OpenAI and TRL routes (prompt tokenization and length checks, sampling
parameters; the constraint check: :mod:`rlserve.server.structured_check`; logprob formatting:
:mod:`rlserve.server.logprob_json`)."""

from __future__ import annotations

import asyncio
import collections
import functools
import ipaddress
import logging
import threading
import time
from typing import Any, AsyncIterator

from rlserve.engine.core_protocol import InvalidParamsError, params_from_fields
from rlserve.engine.sampling_params import SamplingParams
from rlserve.server.chat_render import chat_message_dicts, render_chat, template_error
from rlserve.server.errors import APIError
from rlserve.server.limits import TOO_MANY_TOKENS_PARAM, RequestLimits, check_token_ids, max_prompt_chars
from rlserve.server.logprob_json import LogprobJSON
from rlserve.server.settings import ServerSettings  # noqa: F401 - importable here, as before
from rlserve.server.structured_check import StructuredChecks
from rlserve.server.text_check import check_text
from rlserve.server import tokenizer_threads
from rlserve.server.tokenizer_threads import TokenizerThreads


logger = logging.getLogger(__name__)


def is_loopback(host: str) -> bool:
    """True for localhost, 127.0.0.0/8 and ::1 (what only this machine can reach)."""
    if host in ("localhost", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def log_request(request_id: str, prompt_ids: list[int], params, max_log_len: int | None) -> None:
    """``--enable-log-requests``' line per request, as vLLM 0.32's ``RequestLogger`` writes it
    (INFO: id and sampling parameters; DEBUG: the prompt ids, at most ``max_log_len``)."""
    logger.info("Received request %s: params: %s, num_prompt_tokens: %d, lora_request: %s.", request_id, params,
                len(prompt_ids), getattr(params, "lora_int_id", None) or None)
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug("Request %s details: prompt_token_ids: %s.", request_id,
                     prompt_ids if max_log_len is None else prompt_ids[:max_log_len])


class ServerState(StructuredChecks, LogprobJSON):
    """Shared state of one server (attached to ``app.state.rlserve``)."""

    def __init__(self, aengine, settings: ServerSettings, metrics):
        self.aengine = aengine
        self.settings = settings
        self.metrics = metrics
        if hasattr(aengine, "token_sink"):  # the token counters follow the engines' steps (vLLM's)
            aengine.token_sink = metrics.add_tokens
        engine = aengine.engine
        self.tokenizer = engine.tokenizer
        if settings.chat_template is not None and self.tokenizer is not None:
            self.tokenizer.chat_template = settings.chat_template  # --chat-template (before the template workers copy it)
        self.vocab_size = int(engine.vocab_size)
        self.max_model_len = int(engine.max_model_len)
        self.max_logprobs = int(getattr(aengine.config, "max_logprobs", 20))
        self.limits = RequestLimits(
            max_body_bytes=settings.max_request_body_bytes,
            max_prompt_chars=max_prompt_chars(self.tokenizer, self.max_model_len),
            max_n=int(getattr(aengine.config, "max_num_seqs", 256)), max_request_sequences=settings.max_request_sequences,
            max_logprobs=self.max_logprobs, vocab_size=self.vocab_size)
        self.started = time.time()
        self.weight_manager = None
        self.lora = None  # rlserve.lora.registry.LoRARegistry with --enable-lora
        self._token_text: dict[int, str] = {}
        self._grammar_compiler = None
        self.tokenizer_threads = TokenizerThreads(self.tokenizer)
        self._templates = None  # TemplateWorkers, made on first use (False: render in this process)
        self._templates_lock = threading.Lock()
        # constraint_key()s of the constraints a worker compiled within the bound (most recent
        # last): the same constraint again is not compiled in a worker again
        self._constraints_ok: collections.OrderedDict = collections.OrderedDict()

    @property
    def model_name(self) -> str:
        return self.settings.served_model_names[0]

    async def off_loop(self, fn, *args, chars: int = 0):
        """``fn(*args)`` on a tokenizer thread, awaited (:mod:`rlserve.server.tokenizer_threads`:
        encoding a prompt must not stop the event loop, which serves every other request and
        stream of this process; ``chars``, the text's length, sends a long text to the thread of
        its own so that short ones do not wait behind it). ``fn`` encodes with
        ``self.tokenizer_threads.current()``. What ``fn`` raises is raised here."""
        return await self.tokenizer_threads.run(fn, *args, chars=chars)

    async def tokenize_many(self, prompts: list, params: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """:meth:`tokenize` of each prompt (``params[i]`` names prompt ``i`` in errors): short
        text (under ``LONG_TEXT_CHARS`` characters in all) is checked here and encoded in the
        tokenizer threads' micro-batch (:meth:`TokenizerThreads.encode_many`: with the texts of
        every other request waiting there, in parallel), longer text checked and encoded on the
        long-text thread; token-id prompts are only checked, here. Raises what
        :meth:`tokenize` raises, for the first prompt (in order) that fails."""
        def run():
            return [self.tokenize(p, q, add_special_tokens=add_special_tokens) for p, q in zip(prompts, params)]

        if not any(isinstance(p, str) for p in prompts):
            return run()
        chars = sum(len(p) for p in prompts if isinstance(p, str))
        if chars >= tokenizer_threads.LONG_TEXT_CHARS:  # checked and encoded on the long-text thread, alone
            return await self.off_loop(run, chars=chars)
        out: list = [None] * len(prompts)
        texts: list[int] = []  # indices of the text prompts before the first that fails its checks
        failed = None
        for i, (p, q) in enumerate(zip(prompts, params)):
            try:
                if isinstance(p, str):
                    self.check_prompt_text(p, q)
                    texts.append(i)
                else:
                    out[i] = self.tokenize(p, q)
            except APIError as e:
                failed = e
                break
        if texts:
            encoded = await self.tokenizer_threads.encode_many([prompts[i] for i in texts], add_special_tokens)
            for i, ids in zip(texts, encoded):
                if not ids:  # before a later prompt's error: the order of tokenize's checks
                    raise APIError(400, "prompt tokenizes to no tokens", param=params[i])
                out[i] = ids
        if failed is not None:
            raise failed
        return out

    def template_workers(self):
        """The chat-template worker pool (:class:`~rlserve.server.template_pool.TemplateWorkers`,
        made on first use), or None when the tokenizer cannot be sent to a process (a test
        fake): then templates render on the tokenizer thread, without the time bound."""
        with self._templates_lock:
            if self._templates is None:
                from rlserve.server.template_pool import TemplateWorkers

                # constraints compile in the workers where the engine runs in another process
                grammar = None if self._engine_compiles_here() else \
                    (self.vocab_size, list(getattr(self.aengine, "eos_token_ids", ()) or ()))
                try:
                    self._templates = TemplateWorkers(self.tokenizer, self.limits.max_prompt_chars, grammar=grammar)
                except Exception as e:  # noqa: BLE001 - pickling errors come in many types
                    from rlserve.server.template_pool import discard_prestarted

                    discard_prestarted()
                    logger.warning("chat templates render in the server process, without a time bound: the "
                                   "tokenizer cannot be sent to a worker process (%s: %s)", type(e).__name__, e)
                    self._templates = False
        return self._templates or None

    def start_template_workers(self) -> None:
        """Start the template / constraint workers now (the server's start-up, off the event
        loop; those ``rlserve serve`` prestarted beside its engine's start are taken first) and
        wait until one is warm, so that the server says it is ready only when a chat request
        needs no worker's start (:mod:`rlserve.server.template_pool`; the first chat request after
        ``ready`` waited 24 s for it at load 8 before, BENCHMARKS.md); the others warm on, niced.
        The wait ends early when the engine stops (Ctrl-C during the start-up); no worker warm
        after :data:`~rlserve.server.template_pool.START_TIMEOUT_S` is logged and the server serves.
        Without a tokenizer, or with ``RLSERVE_TEMPLATE_WORKERS_AT_START=0`` (they start at
        their first use): nothing."""
        from rlserve import envs

        if not envs.RLSERVE_TEMPLATE_WORKERS_AT_START:
            return
        if self.tokenizer is not None and (workers := self.template_workers()) is not None:
            from rlserve.startup_log import log_phase

            t = time.perf_counter()
            workers.start()
            if not workers.wait_warm(stop=lambda: not self.aengine.is_alive(), one=True) and self.aengine.is_alive():
                logger.warning("no chat-template worker warm after the start-up's wait: the first chat requests "
                               "wait for one")
            log_phase(logger, "a chat-template worker warm (wait after the app build)", time.perf_counter() - t)

    def _engine_compiles_here(self) -> bool:
        """The engine runs in this process (thread mode) with its constraint compiler: the API's
        compile fills its cache, so constraints do not compile in a worker."""
        return getattr(getattr(self.aengine, "engine", None), "grammar_compiler", None) is not None

    async def render_chat(self, messages: list, template_args: dict, param: str = "messages") -> str:
        """A conversation's prompt text through the chat template, rendered in a template worker
        process (:mod:`rlserve.server.template_pool`: bounded in time, memory and output size;
        the event loop and the tokenizer thread only wait). ``template_args``: the keyword
        arguments of :func:`~rlserve.server.chat_render.render_chat`; ``param`` names the
        conversation's field in errors (``messages``; ``input`` for the Responses API).

        Raises:
            APIError 400: a non-text content part; the template raised, took longer than
            :data:`~rlserve.server.template_pool.RENDER_TIMEOUT_S` (``chat_template_timeout``),
            overran the worker's memory, or rendered more characters than the context can hold
            (``context_length_exceeded``).
        """
        from rlserve.server.template_pool import TemplateError, template_call_kwargs

        workers = self.template_workers() if self._templates is not None else \
            await asyncio.to_thread(self.template_workers)  # the first: pickles the tokenizer
        if workers is None:
            def run() -> str:
                try:
                    return render_chat(self.tokenizer, messages, **template_args)
                except APIError as e:
                    e.param = param if e.param == "messages" else e.param
                    raise

            return await self.off_loop(run)
        dicts = chat_message_dicts(messages)
        kwargs = template_call_kwargs(**template_args)
        try:
            return await asyncio.to_thread(workers.render, dicts, kwargs)
        except TemplateError as e:
            raise template_error(e, template_args.get("chat_template"), param) from None
        except RuntimeError as e:  # no worker could start: render here from now on
            logger.warning("chat templates render in the server process from now on: %s", e)
            self._templates = False
            workers.close()
            return await self.render_chat(messages, template_args, param)

    async def tokenize_chat(self, messages: list, template_args: dict, param: str,
                            add_special_tokens: bool) -> list[int]:
        """A conversation's prompt token ids: :meth:`render_chat`, then :meth:`tokenize` on the
        tokenizer thread (:meth:`off_loop`: a long prompt must not stop the loop). ``param``
        names the conversation's field in errors (``messages``; ``input`` for the Responses API).

        Raises:
            APIError 400: as :meth:`render_chat` and :meth:`tokenize` raise.
        """
        prompt = await self.render_chat(messages, template_args, param)
        return await self.off_loop(functools.partial(self.tokenize, prompt, param=param,
                                                     add_special_tokens=add_special_tokens), chars=len(prompt))

    def close(self) -> None:
        """Stop the chat-template workers and the tokenizer threads (the server's stop)."""
        if self._templates:
            self._templates.close()
        self.tokenizer_threads.close()

    # ---- checks -----------------------------------------------------------------------
    def check_available(self) -> None:
        """Raises APIError 503 while the model is unavailable (a failed in-place weight
        update), asleep (sleep mode) or the engine is down; checked before a stream starts, so streams never
        begin with a 200 and then fail for this."""
        refusal = getattr(getattr(self.aengine, "front_sync", None), "refusal", None)
        if refusal is not None:  # API process 0 is asleep (--api-server-count; front_sync)
            from rlserve.server.errors import exception_to_error

            raise exception_to_error(refusal())
        sleep = getattr(self.aengine, "sleep_mode", None)
        if sleep is not None and sleep.is_sleeping():
            raise APIError(503, f"the model is sleeping (level {sleep.level}): POST /wake_up first; requests are "
                                "not held while asleep", code="model_sleeping")
        reason = self.aengine.unavailable_reason
        if reason is not None:
            raise APIError(503, f"the model is unavailable: {reason}",
                           code=getattr(self.aengine, "unavailable_code", None) or "model_unavailable")
        if not self.aengine.is_alive():
            reason = self.aengine.dead_reason() if hasattr(self.aengine, "dead_reason") else None
            raise APIError(503, f"the engine is not running: {reason}" if reason else "the engine is not running",
                           code="engine_dead")

    def check_model(self, name: str | None) -> str:
        """Returns the model name to report (a LoRA adapter's name is one, with ``--enable-lora``).
        Raises APIError 404 for an unknown name."""
        if name is None or name in self.settings.served_model_names or name == self.settings.model:
            return name or self.model_name
        if self.lora is not None and self.lora.lora_int_id(name):
            return name
        served = list(self.settings.served_model_names) + (sorted(self.lora.adapters) if self.lora else [])
        raise APIError(404, f"The model `{name}` does not exist. Served: {', '.join(served)}",
                       param="model", code="model_not_found")

    def lora_int_id(self, name: str | None) -> int:
        """The engines' id of the LoRA adapter a request's ``model`` names; 0: the base model.
        Read right after :meth:`check_model` (an unload in between: 0 would serve the base
        model, so an adapter name that vanished is a 404)."""
        if self.lora is None or not name or name in self.settings.served_model_names or name == self.settings.model:
            return 0
        adapter_id = self.lora.lora_int_id(name)
        if not adapter_id:
            raise APIError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")
        return adapter_id

    def tokenize(self, prompt: str | list[int], param: str = "prompt", add_special_tokens: bool = True) -> list[int]:
        """Prompt → token ids, checking emptiness and the vocabulary.

        Raises:
            APIError 400: empty prompt, ids outside ``[0, vocab_size)``, non-int ids.
        """
        if isinstance(prompt, str):
            if prompt == "":
                raise APIError(400, "prompt must not be empty", param=param)
            ids = self.encode_text(prompt, param, add_special_tokens)
            if not ids:
                raise APIError(400, "prompt tokenizes to no tokens", param=param)
            return ids
        ids = list(prompt)
        if not ids:
            raise APIError(400, "prompt must not be empty", param=param)
        check_token_ids(ids, self.vocab_size, "token ids", param=param)
        return ids

    def encode_text(self, text: str, param: str, add_special_tokens: bool) -> list[int]:
        """``text``'s token ids (empty text gives whatever the tokenizer gives: ``[]`` or its
        special tokens), after the checks every text prompt gets: valid Unicode and at most
        ``limits.max_prompt_chars`` characters (checked before encoding). Used by
        :meth:`tokenize` and ``/tokenize`` (which, as vLLM, allows an empty prompt).

        Raises:
            APIError 400 (``param``): a lone surrogate (:func:`check_text`), text too long for
            ``max_model_len`` (:meth:`RequestLimits.check_prompt_chars`).
        """
        check_text(text, param)
        self.limits.check_prompt_chars(text, param, self.max_model_len)  # before tokenizing
        return list(self.tokenizer_threads.current().encode(text, add_special_tokens=add_special_tokens))

    def check_prompt_text(self, text: str, param: str) -> None:
        """The checks of a text prompt before it is encoded (:meth:`tokenize`'s): not empty,
        then :meth:`encode_text`'s. Raises APIError 400 naming ``param``."""
        if text == "":
            raise APIError(400, "prompt must not be empty", param=param)
        check_text(text, param)
        self.limits.check_prompt_chars(text, param, self.max_model_len)

    def check_length(self, n_prompt: int, max_tokens: int | None, param: str = "max_tokens",
                     prompt_param: str | None = None) -> int:
        """Returns the effective ``max_tokens``: ``max_tokens`` clamped to the rest of the context
        (``max_model_len - n_prompt``), None → the rest of the context (at most ``--generation-config``'s
        ``max_new_tokens``). A ``max_tokens`` larger than the room left is an upper bound, not an error, as in
        vLLM 0.32 (``vllm/entrypoints/serve/utils/api_utils.py`` ``get_max_tokens``: the minimum of the room,
        ``max_tokens`` and the defaults; its own server answered 200 with 24 tokens for a 40-token prompt with
        ``max_tokens`` 40 at ``--max-model-len`` 64, session 22; vLLM 0.20 and older refused it with a 400).

        Raises:
            APIError 400: the prompt leaves no room (param ``prompt_param``; None: vLLM 0.32's, ``input_tokens``
                for a prompt over ``max_model_len`` and ``param`` for one of exactly ``max_model_len`` tokens,
                whose output would have no room: ``rlserve/server/limits.py``), or ``max_tokens`` < 1.
        """
        if n_prompt >= self.max_model_len:
            if prompt_param is None:
                prompt_param = TOO_MANY_TOKENS_PARAM if n_prompt > self.max_model_len else param
            raise APIError(400, f"This model's maximum context length is {self.max_model_len} tokens, but the prompt "
                                f"has {n_prompt} tokens (at least one must be left for the output).",
                           param=prompt_param, code="context_length_exceeded")
        if max_tokens is None:  # the rest of the context, at most --generation-config's max_new_tokens
            default = self.settings.sampling_defaults.get("max_tokens")
            return self.max_model_len - n_prompt if default is None else min(int(default), self.max_model_len - n_prompt)
        if max_tokens < 1:
            raise APIError(400, f"{param or 'max_tokens'} must be >= 1, got {max_tokens}", param=param)
        return min(max_tokens, self.max_model_len - n_prompt)

    def check_logprobs(self, k: int | None, param: str) -> int | None:
        """Returns the number of alternatives to compute (``-1``, allowed with ``--max-logprobs
        -1``, = the whole vocabulary). Raises APIError 400 outside ``[0, max_logprobs]``."""
        if k is None:
            return None
        if self.max_logprobs == -1:
            if k < -1:
                raise APIError(400, f"{param} must be >= 0, or -1 for the whole vocabulary; got {k}", param=param)
            return self.vocab_size if k == -1 else min(k, self.vocab_size)
        if not 0 <= k <= self.max_logprobs:
            raise APIError(400, f"{param} must be in [0, {self.max_logprobs}] (the server's --max-logprobs), got {k}",
                           param=param)
        return k

    def truncate(self, ids: list[int], k: int | None, param: str = "truncate_prompt_tokens",
                 side: str | None = None) -> list[int]:
        """vLLM's ``truncate_prompt_tokens``: keep the last ``k`` prompt tokens (``-1``:
        ``max_model_len``), the first ``k`` with ``side`` ``"right"`` (vLLM's ``truncation_side``).
        Raises APIError 400 for ``k`` < -1 or 0."""
        if k is None:
            return ids
        if k == -1:
            k = self.max_model_len
        if k < 1:
            raise APIError(400, f"{param} must be >= 1, or -1 for max_model_len; got {k}", param=param)
        return ids[:k] if side == "right" else ids[-k:]

    def sampling_params(self, names: dict[str, str] | None = None, **kw) -> SamplingParams:
        """Build the request's SamplingParams, the one place every generation route does:
        ``None`` values take the defaults; the size bounds of ``rlserve.server.limits`` (n,
        logprobs, stop lists); then the engine core's own schema
        (:func:`rlserve.engine.core_protocol.params_from_fields`: types as the core decodes
        them, ranges, what the wire carries), so that what is built here always reaches the
        engine.

        Args:
            names: how the request names a field where that is not the field's own name (TRL's
                ``{"top_k": "generation_kwargs.top_k"}``); errors name the request's field.
            kw: SamplingParams fields.

        Raises:
            APIError 400: naming the field (``param``) and what is wrong with it.
        """
        names = names or {}
        defaults = dict(temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.0,
                        presence_penalty=0.0, frequency_penalty=0.0)
        defaults.update((k, v) for k, v in self.settings.sampling_defaults.items() if k in defaults)
        args = {k: (defaults[k] if v is None and k in defaults else v) for k, v in kw.items()}
        try:
            self.limits.check_sampling(args)
        except APIError as e:
            if e.param in names:
                e.message, e.param = e.message.replace(e.param, names[e.param], 1), names[e.param]
            raise
        try:
            return params_from_fields(args)
        except InvalidParamsError as e:
            if e.field is None:
                raise APIError(400, str(e), code=e.code) from None
            top = e.field.split(".", 1)[0]
            param = names.get(top, top) + e.field[len(top):]
            raise APIError(400, e.renamed(param), param=param, code=e.code) from None

    # ---- generation with metrics --------------------------------------------------------
    async def generate(self, prompt_ids: list[int], params: SamplingParams, request_id: str,
                       endpoint: str, stream: bool = True, sink=None) -> AsyncIterator[Any]:
        """``aengine.generate`` plus metrics (TTFT, e2e latency, tokens, finish reasons).
        ``stream=False`` yields only the final output; ``sink``: ``aengine.generate``'s (a stream's
        direct writes: the outputs it takes are not yielded; the last one always is). An unfinished output's
        ``token_ids`` / ``logprobs`` may be read-only views (:mod:`rlserve.engine.prefix_view`): slice them.

        A request whose consumer leaves before its final output (a client that went away: the generator is
        closed or its task cancelled) is aborted and recorded once its abort's final output arrives, with
        the tokens it made by then (``on_abandoned``: vLLM counts every token the engine made, streamed or
        not; before, a non-streamed one counted 0, a streamed one what it had been sent)."""
        t0 = time.monotonic()
        last = None
        if self.settings.enable_log_requests:
            log_request(request_id, prompt_ids, params, self.settings.max_log_len)

        def on_abandoned(item) -> None:
            self._record(endpoint, request_id, prompt_ids, params, t0,
                         last if isinstance(item, BaseException) else item)

        record = True
        try:
            async for out in self.aengine.generate(prompt_ids, params, request_id, stream=stream, sink=sink,
                                                   views=True, on_abandoned=on_abandoned):  # (routes read views)
                last = out
                yield out
        except (GeneratorExit, asyncio.CancelledError):
            # left before the final output: aengine.generate hands it to on_abandoned (once its
            # generator is closed: at once when cancelled inside it, else when it is finalized)
            record = last is not None and last.finished
            raise
        finally:
            if record:
                self._record(endpoint, request_id, prompt_ids, params, t0, last)

    def _record(self, endpoint: str, request_id: str, prompt_ids: list[int], params: SamplingParams, t0: float,
                last) -> None:
        """Record one ended request in the metrics (and ``--enable-log-requests``' line): ``last`` its
        final output (None: it made nothing we know of), ``t0`` its start (``time.monotonic()``)."""
        first = getattr(last, "first_token_time", None)
        arrival = getattr(last, "arrival_time", None)
        ttft = (first - arrival) if first is not None and arrival is not None else None
        # a request whose client went away (or that failed) counts as aborted
        reasons = [c.finish_reason or "abort" for c in last.outputs] if last is not None else ["abort"] * params.n
        counts = [len(c.token_ids) for c in last.outputs] if last is not None else None
        end = time.monotonic()
        if self.settings.enable_log_requests:
            logger.info("Finished request %s: finish_reasons: %s, output tokens: %s, %.3f s", request_id, reasons,
                        counts or [], end - t0)
        self.metrics.record_request(
            endpoint, reasons, len(prompt_ids), sum(counts) if counts else 0, end - t0, ttft,
            decode_s=(end - first) if first is not None else None, sample_tokens=counts, n=params.n,
            max_tokens=params.max_tokens, timing=(arrival, getattr(last, "scheduled_time", None), first, end))
