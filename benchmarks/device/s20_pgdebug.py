"""Session 20 device probe: why the engine's prefill / mixed steps never replay the piecewise prefill graphs
on a GPU (tests/gpu/test_prefill_graphs_gpu.py failed in session 19 with no run). Logs, per step that reaches
ModelRunner._prefill_with_graph, each condition that sends it eager, then runs the same staggered schedule."""
import sys
import collections
import os

import torch

sys.path.insert(0, ".")
import rlserve  # noqa: E402
LLM = getattr(rlserve, "LLM_PROBE", None) or rlserve.LLM
from rlserve.engine.worker import model_runner as mr  # noqa: E402
from tests.tiny_models import make_tiny_model  # noqa: E402
from tests.gpu.test_mixed_steps_gpu import KW, _prompts, _staggered  # noqa: E402
import tempfile  # noqa: E402

path = make_tiny_model("qwen3", tempfile.mkdtemp())
log = collections.Counter()
real = mr.ModelRunner._prefill_with_graph


def probe(self, step, input_ids, positions, meta):
    g = self.prefill_graphs
    why = []
    if not step.is_prefill:
        why.append("not is_prefill")
    if self._prefill_graphs_off is not None:
        why.append(f"off={self._prefill_graphs_off}")
    if step.lora_ids:
        why.append(f"lora_ids={step.lora_ids!r}"[:60])
    if g is not None and g.bucket_for(len(step.input_ids)) is None:
        why.append(f"no bucket for {len(step.input_ids)}")
    if any(a.calculate_kv_scales for a in self.attn_layers):
        why.append("kv scales")
    h = real(self, step, input_ids, positions, meta)
    log[(len(step.input_ids), h is not None, "; ".join(why) or "-", type(step.input_ids).__name__)] += 1
    return h


mr.ModelRunner._prefill_with_graph = probe
for mixed in (False, True):
    log.clear()
    kw = dict(max_num_batched_tokens=int(os.environ.get("PG_BUDGET", 64)), enable_chunked_prefill=True, mixed_prefill_decode=mixed, **KW)
    llm = LLM(path, extra={"prefill_cuda_graph_sizes": os.environ.get("PG_SIZES", "16,48")}, **kw)
    r = llm.engine.executor.runner
    print("mixed", mixed, "captured", r.prefill_graphs is not None, "off", r._prefill_graphs_off,
          "use_cuda_graphs", r.use_cuda_graphs, flush=True)
    got, _, kinds, _ = _staggered(llm, _prompts())
    print("kinds", kinds)
    for k, v in sorted(log.items(), key=str):
        print("  T=%s replayed=%s why=%s ids=%s: %d" % (*k, v))
    del llm
    torch.cuda.empty_cache()
