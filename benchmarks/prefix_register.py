"""Host cost of publishing a chunked prompt's KV blocks to the prefix cache (session 17): with chunked
prefill every chunk step calls :meth:`BlockManager.register_full_blocks` for its new full blocks, which
took each block's tokens with ``Sequence.block_tokens``; before session 17 that built the whole sequence
(``all_token_ids``) per block, O(blocks x length) per prompt. Window 1 of session 17 (H100, s16_chunk.sh,
`/work/gpu-results/s17/w1/chunk`) measured chunk steps ~5 ms slower than whole-prompt steps at every size.

Times registering one prompt's blocks chunk by chunk (2048-token chunks), main's way (the sequence built per
block, reproduced here) against today's :meth:`Sequence.block_tokens` (slices), interleaved, median of
``--reps``; checks both give the same block hashes.

    python benchmarks/prefix_register.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import time

from rlserve.engine.core import block_manager as bmm
from rlserve.engine.core.block_manager import BlockManager
from rlserve.engine.core.sequence import Sequence
from rlserve.engine.sampling_params import SamplingParams


def _whole_sequence_tokens(seq: Sequence, i: int) -> list[int]:
    """main's ``block_tokens`` before session 17: the whole sequence built, then sliced."""
    return seq.all_token_ids[i * seq.block_size : (i + 1) * seq.block_size]


def _register(bm: BlockManager, seq: Sequence, tokens_of) -> None:
    """``register_full_blocks`` with the block-token function ``tokens_of`` (prefix caching on, one epoch)."""
    bs = bm.block_size
    prev = bmm.prefix_root(seq)
    for i in range(min(seq.num_computed_tokens // bs, len(seq.block_table))):
        block = bm.blocks[seq.block_table[i]]
        if block.hash is None:
            chunk = tuple(tokens_of(seq, i))
            bm._register(block, bmm.chain_hash(prev, chunk), chunk)
        prev = block.hash


def run(tokens_of, length: int, chunk: int, seed: int) -> tuple[float, list]:
    bm = BlockManager(length // 16 + 64, 16)
    seq = Sequence("a", 0, [(seed * 7919 + j) % 50000 + 1 for j in range(length)], SamplingParams(max_tokens=4), 16)
    bm.allocate(seq, register=False)
    t0 = time.perf_counter()
    for end in list(range(chunk, length, chunk)) + [length]:
        seq.num_computed_tokens = end
        _register(bm, seq, tokens_of)
    return time.perf_counter() - t0, [bm.blocks[b].hash for b in seq.block_table]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", nargs="+", type=int, default=[512, 2048, 3891, 8192])
    p.add_argument("--chunk", type=int, default=2048)
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    rows = []
    for n in args.lengths:
        times: dict[str, list[float]] = {"whole_sequence": [], "slices": []}
        for r in range(args.reps):
            a, ha = run(_whole_sequence_tokens, n, args.chunk, r)
            b, hb = run(Sequence.block_tokens, n, args.chunk, r)
            if ha != hb:
                raise SystemExit(f"length {n}: the two ways gave different block hashes")
            times["whole_sequence"].append(a)
            times["slices"].append(b)
        med = {k: round(sorted(v)[len(v) // 2] * 1e3, 3) for k, v in times.items()}
        rows.append({"length": n, "chunk": args.chunk, "ms_whole_sequence": med["whole_sequence"], "ms_slices": med["slices"]})
        print(f"prompt of {n} tokens in {args.chunk}-token chunks: whole sequence per block {med['whole_sequence']} ms, "
              f"slices {med['slices']} ms (median of {args.reps})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
