"""A request's structured-output constraint (vLLM's ``structured_outputs``, OpenAI's ``response_format``,
TRL's ``guided_decoding_regex``) checked in the API process before anything is queued: compiled once, in a
chat-template worker where the engine runs in its own process (killed past
:data:`~rlserve.server.limits.COMPILE_TIMEOUT_S`: :mod:`rlserve.server.template_pool`), else on a thread
with the engine's own compiler. Mixed into :class:`~rlserve.server.state.ServerState`."""

from __future__ import annotations

import asyncio
import logging

from rlserve.errors import InvalidRequestError
from rlserve.server.errors import APIError
from rlserve.server.limits import COMPILE_TIMEOUT_S, check_constraint

logger = logging.getLogger(__name__)

#: constraints remembered as compiled within the bound (as many as an engine core's compiler
#: keeps compiled: ``rlserve.engine.core.structured._CACHE_SIZE``)
CONSTRAINTS_KEPT = 256


def _constraint_timeout(param: str) -> APIError:
    return APIError(400, f"{param}: the constraint did not compile within {COMPILE_TIMEOUT_S:g} s; send a smaller one",
                    param=param, code="constraint_timeout")


class StructuredChecks:
    """Uses the state's ``aengine``, ``tokenizer``, ``vocab_size``, ``template_workers()``,
    ``_engine_compiles_here()``, ``_templates``, ``_constraints_ok`` and ``_grammar_compiler``."""

    async def structured_outputs(self, body, param: str = "structured_outputs"):
        """The request's output constraint as :class:`StructuredOutputsParams` (from vLLM's
        ``structured_outputs``, OpenAI's ``response_format``, or TRL's ``guided_decoding_regex``),
        compiled once here (off the event loop) so that a bad regex / schema / grammar is a 400
        naming the field before anything is queued. None: unconstrained."""
        spec_obj = None
        so = getattr(body, "structured_outputs", None)
        if so is not None:
            spec_obj = so.model_dump(by_alias=True, exclude_none=True)
        rf = getattr(body, "response_format", None)
        if rf is not None and rf.type != "text":
            if spec_obj is not None:
                raise APIError(400, "give structured_outputs or response_format, not both", param="response_format")
            param = "response_format"
            if rf.type == "json_object":
                spec_obj = {"json_object": True}
            else:
                schema = rf.json_schema.schema_ if rf.json_schema is not None else None
                if schema is None:
                    raise APIError(400, "response_format json_schema needs json_schema.schema",
                                   param="response_format.json_schema")
                spec_obj = {"json": schema}
        regex = getattr(body, "guided_decoding_regex", None)
        if regex is not None:
            param = "guided_decoding_regex"
            spec_obj = {"regex": regex}
        if spec_obj is None:
            return None
        return await self.compile_structured(spec_obj, param)

    async def compile_structured(self, spec_obj: dict, param: str):
        """vLLM's ``structured_outputs`` object (``{"json": schema}``, ``{"regex": ...}``, ...) as a
        compiled-once :class:`StructuredOutputsParams` (compiled off the event loop).

        Raises:
            APIError 400 naming ``param``: xgrammar is not installed (the message names ``param``'s
            field and the extra to install), a bad regex / schema / grammar, one over the size
            bound (``constraint_too_large``) or one that did not compile within
            :data:`~rlserve.server.limits.COMPILE_TIMEOUT_S` (``constraint_timeout``).
        """
        from rlserve.engine.core.structured import needs_xgrammar, structured_from_request, xgrammar_installed

        if not xgrammar_installed():  # (the field the request used, not the compiler's own word for it)
            raise APIError(400, needs_xgrammar(param), param=param)
        try:
            spec = structured_from_request(spec_obj)
            check_constraint(spec, param)
            if not await self._compile_in_worker(spec, param):
                compiling = asyncio.ensure_future(asyncio.to_thread(self.grammar_compiler().compile, spec))
                await asyncio.wait_for(asyncio.shield(compiling), COMPILE_TIMEOUT_S)
        except InvalidRequestError as e:
            raise APIError(400, str(e), param=param) from None
        except asyncio.TimeoutError:
            compiling.cancel()  # not needed: a compile queued behind others never starts (one running ends alone)
            raise _constraint_timeout(param) from None
        return spec

    async def _compile_in_worker(self, spec, param: str) -> bool:
        """The API's compile of a constraint in a template worker, killed when it overruns
        :data:`~rlserve.server.limits.COMPILE_TIMEOUT_S` (:meth:`TemplateWorkers.compile
        <rlserve.server.template_pool.TemplateWorkers.compile>`), where the engine runs in its
        own process (in thread mode the API's compile fills the engine's cache, so it stays
        here). Returns False where it did not run. Raises APIError 400 (invalid, timeout)."""
        from rlserve.server.template_pool import TemplateError

        if self._engine_compiles_here() or \
                self.tokenizer is None or (workers := await asyncio.to_thread(self.template_workers)) is None:
            return False
        from rlserve.engine.core.structured import constraint_key

        key = constraint_key(spec)
        if key in self._constraints_ok:  # compiled in a worker before: the engine core has it cached
            self._constraints_ok.move_to_end(key)
            return True
        eos = list(getattr(self.aengine, "eos_token_ids", ()) or ())
        try:
            await asyncio.to_thread(workers.compile, spec, self.vocab_size, eos, COMPILE_TIMEOUT_S)
        except TemplateError as e:
            raise (_constraint_timeout(param) if e.kind == "timeout" else APIError(400, str(e), param=param)) from None
        except RuntimeError as e:  # no worker could start (as render_chat): compiled here from now on
            logger.warning("structured-output constraints compile in the server process from now on: %s", e)
            self._templates = False
            workers.close()
            return False
        self._constraints_ok[key] = None
        while len(self._constraints_ok) > CONSTRAINTS_KEPT:
            self._constraints_ok.popitem(last=False)
        return True

    def grammar_compiler(self):
        """The structured-output compiler: the engine's own when it runs in this process (one
        cache: the engine's compile of the same constraint is then a hit), else one over this
        process's tokenizer. Raises InvalidRequestError without a tokenizer or xgrammar."""
        engine_compiler = getattr(getattr(self.aengine, "engine", None), "grammar_compiler", None)
        if engine_compiler is not None:
            return engine_compiler()
        if self._grammar_compiler is None:
            from rlserve.engine.core.structured import GrammarCompiler

            if self.tokenizer is None:
                raise InvalidRequestError("structured outputs need a tokenizer")
            self._grammar_compiler = GrammarCompiler(self.tokenizer, self.vocab_size,
                                                     getattr(self.aengine, "eos_token_ids", ()) or ())
        return self._grammar_compiler
