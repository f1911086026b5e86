"""Triton's compile key of a kernel launch, computed on the CPU for a CUDA target (no driver, no GPU).

A compiled ``JITFunction`` keeps one compiled variant per key of its launches: ``(specialization,
options)``, where the specialization holds each argument's type and, unless the kernel lists it in
``do_not_specialize`` / ``do_not_specialize_on_alignment``, whether an integer is 1 (then a constexpr)
or divisible by 16 and whether a pointer is 16-byte aligned, plus every ``tl.constexpr`` value; the
options are the launch's keywords (``num_warps``, ``num_stages``, ``launch_pdl``, ...). A launch whose
key the process has not seen compiles: in the middle of serving, a stall of every stream (BENCHMARKS.md
H25). Triton builds that key in ``JITFunction.run`` with a *binder* made from the kernel's signature
and the target's backend (``triton.runtime.jit.create_function_from_signature``); the binder needs the
backend class only, not a device (``JITFunction.create_binder`` passes ``make_backend`` of the driver's
target; here of ``GPUTarget("cuda", 90, 32)``: Triton 3.9's code), so the same function gives the CUDA key of
a launch that runs in Triton's interpreter on the CPU, or of one not run at all. The options part omits the
keywords ``JITFunction.run`` adds to every launch alike (``debug``, instrumentation). What it cannot see: the alignment the CUDA caching allocator gives (512 bytes, the
CPU allocator 64: both >= 16, so fresh tensors are aligned on both, and a view at an offset is aligned
on both or on neither).

:class:`KeyRecorder` wraps kernels (compiled ``JITFunction`` or ``InterpretedFunction``) so each launch
records its key, and still runs.
"""

from __future__ import annotations

import threading


def _jit_function(kernel, raw: bool = False):
    """The kernel as a ``JITFunction`` with its own ``do_not_specialize`` lists (an
    ``InterpretedFunction`` keeps the decorator's keywords in ``kwargs``); ``raw``: with none (every
    argument specialised, as an unmarked kernel would be)."""
    from triton.runtime.jit import JITFunction

    if isinstance(kernel, JITFunction) and not raw:
        return kernel
    from triton.runtime import jit

    kw = {} if raw else getattr(kernel, "kwargs", {})
    registry = jit._triton_jit_function_registry
    saved = dict(registry)
    try:  # the constructor registers itself under the kernel's name: keep the kernel's own entry
        return JITFunction(kernel.fn, do_not_specialize=kw.get("do_not_specialize"),
                           do_not_specialize_on_alignment=kw.get("do_not_specialize_on_alignment"))
    finally:
        registry.clear()
        registry.update(saved)


def binder(kernel, arch: int = 90, raw: bool = False):
    """Triton's binder of ``kernel`` for a CUDA ``sm_<arch>`` target: ``binder(*args, **kw) ->
    (bound_args, specialization, options)`` as in ``JITFunction.run`` (``raw``: of the kernel without its
    ``do_not_specialize`` lists)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    fn = _jit_function(kernel, raw)
    return create_function_from_signature(fn.signature, fn.params, make_backend(GPUTarget("cuda", arch, 32)))


def cuda_key(bind, args: tuple, kwargs: dict) -> tuple:
    """The launch's key as ``JITFunction.run`` forms it (``compute_cache_key``: the specialization and
    ``str(options)``), as a hashable tuple; tensors only through their type and alignment."""
    _, spec, options = bind(*args, **kwargs)
    return tuple(spec), str(options)


def key_text(name: str, key: tuple) -> str:
    """One line: the kernel name, its specialization, its options."""
    spec, options = key
    return f"{name}{list(spec)} {options}"


class KeyRecorder:
    """Record the CUDA key of every launch of ``kernels`` (``{name: kernel}``) while installed.

    ``keys``: ``{name: {key: launches}}``; ``raw_first_phase``: the same keys' phases for the kernels
    without their ``do_not_specialize`` lists (what an unmarked kernel would have compiled). ``phase``: a
    label, changed with :meth:`begin`; :meth:`new_since` gives the keys first seen after the phase named ``since``.
    ``launch=False``: record only (the launch is skipped, as Triton's ``jit_cache_hook`` returning True
    does: outputs are left unwritten). Use as a context manager (restores the kernels' own ``run``)."""

    def __init__(self, kernels: dict, launch: bool = True):
        self.kernels = kernels
        self.launch = launch
        self.keys: dict[str, dict[tuple, int]] = {n: {} for n in kernels}
        self.first_phase: dict[tuple, str] = {}
        self.raw_first_phase: dict[tuple, str] = {}
        self.phase = "start"
        self.phases = ["start"]
        self._lock = threading.Lock()
        self._saved = {}

    def __enter__(self):
        for name, k in self.kernels.items():
            bind, raw = binder(k), binder(k, raw=True)
            orig = k.run
            self._saved[name] = (k, "run" in vars(k), orig)

            def run(*args, _name=name, _bind=bind, _raw=raw, _orig=orig, **kwargs):
                kw = {a: b for a, b in kwargs.items() if a not in ("grid", "warmup")}
                key, raw_key = cuda_key(_bind, args, kw), cuda_key(_raw, args, kw)
                with self._lock:
                    seen = self.keys[_name]
                    seen[key] = seen.get(key, 0) + 1
                    self.first_phase.setdefault((_name, key), self.phase)
                    self.raw_first_phase.setdefault((_name, raw_key), self.phase)
                return _orig(*args, **kwargs) if self.launch else None

            k.run = run
        return self

    def __exit__(self, *exc):
        for name, (k, had, orig) in self._saved.items():
            if had:
                k.run = orig
            else:
                del k.run
        self._saved = {}

    def begin(self, phase: str) -> None:
        """Launches from now on belong to ``phase`` (a new name)."""
        self.phases.append(phase)
        self.phase = phase

    def new_since(self, since: str, raw: bool = False) -> list[str]:
        """Lines (:func:`key_text`) of the keys first seen in a phase that began after phase ``since`` (the
        warm-up: what would compile in the middle of serving), in first-seen order; ``raw``: of the kernels
        without their ``do_not_specialize`` lists."""
        first = self.raw_first_phase if raw else self.first_phase
        after = set(self.phases[self.phases.index(since) + 1:])
        return [key_text(n, k) for (n, k), p in first.items() if p in after]
