"""The offline workload's schedule through the overlapped loop on the CPU (issue 37, session 18): which steps
were launched before the step in flight was read, under ``RLSERVE_OVERLAP_AFTER_PREFILL`` 0 (the session-17
rule) or 1, and the host work the old rule leaves on the GPU's path after a prefill step.

``benchmarks/throughput.py``'s workload (256 sequences, prompts and outputs 100..1024, seed 0) through
``rlserve.LLM`` with a tiny stand-in (``--stand-in``, float32 on the CPU) and the CUDA engine's scheduler
settings (8192 tokens a step, one prefill step at a time while sequences run, a KV cache of ``--kv-tokens``:
659,040 is the 0.6B's on an H100 at 0.92, BENCHMARKS F2), overlap forced on (on the CPU it is synchronous:
the counts are the GPU's, the times are not). Prints one JSON line: ``OverlapScheduler.counts`` (``early``
steps launched before the read, ``early_host_rows`` decode steps among them with rows from the host,
``after_read`` the others), the steps, and the medians (ms, this CPU) of ``_finish_step`` and of a decode
step's ``_build_step`` at 200+ sequences: the host work of a decode step launched after the read.

    RLSERVE_OVERLAP_AFTER_PREFILL=0 python benchmarks/overlap_schedule.py
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from model_shapes import save_shape, shape_config  # noqa: E402
from throughput import make_workload  # noqa: E402


def main(argv=None) -> int:
    from rlserve import LLM, SamplingParams

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stand-in", default="tiny-llama")
    ap.add_argument("--shape", default="qwen3-0.6b", help="whose vocabulary draws the prompts")
    ap.add_argument("--kv-tokens", type=int, default=659040)
    args = ap.parse_args(argv)
    prompts, out_lens = make_workload(256, 100, 1024, shape_config(args.shape).vocab_size, 0)
    vocab = shape_config(args.stand_in).vocab_size
    prompts = [[t % vocab for t in p] for p in prompts]
    with tempfile.TemporaryDirectory() as root:
        llm = LLM(save_shape(args.stand_in, root), dtype="float32", device="cpu", load_format="dummy",
                  skip_tokenizer_init=True, max_model_len=2056, max_num_seqs=256, max_num_batched_tokens=8192,
                  max_consecutive_prefill_steps=1, num_kv_blocks=-(-args.kv_tokens // 16), seed=0,
                  extra={"async_scheduling": True})
        eng = llm.engine
        fin: list[tuple[int, float]] = []
        build: list[tuple[bool, int, float]] = []
        finish0, build0 = eng._finish_step, eng._build_step

        def finish(seqs, *a, **k):
            t = time.perf_counter()
            r = finish0(seqs, *a, **k)
            fin.append((len(seqs), time.perf_counter() - t))
            return r

        def build_step(batch):
            t = time.perf_counter()
            r = build0(batch)
            build.append((batch.is_prefill, len(batch.seqs), time.perf_counter() - t))
            return r

        eng._finish_step, eng._build_step = finish, build_step
        t0 = time.perf_counter()
        outs = llm.generate(prompts, [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n) for n in out_lens])
        cpu_s = time.perf_counter() - t0
        assert sum(len(o.outputs[0].token_ids) for o in outs) == sum(out_lens)
        med = lambda xs: round(statistics.median(xs) * 1e3, 3) if xs else None  # noqa: E731
        print(json.dumps({"overlap_after_prefill": eng._overlap.after_prefill, "counts": eng._overlap.counts,
                          "steps": eng.stats_counters["steps"], "cpu_s": round(cpu_s, 1),
                          "finish_ms_median_200plus": med([s for n, s in fin if n >= 200]),
                          "decode_build_ms_median_200plus": med([s for p, n, s in build if not p and n >= 200])}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
