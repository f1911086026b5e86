"""The small-batch decode GEMM (``rlserve/layers/gemm_rows_kernels.py``) as an H100 runs it, without a GPU:
each linear of a model shape in each of its forms compiled ahead of time for sm_90 by the installed Triton's
CUDA backend, with the launch plan ``rlserve.layers.gemv.rows_tile`` makes on a 132-SM H100 (issue 37).

Per (linear, rows, form): the tile and split, the grid, the K loop's SASS (instructions a warp per K step,
MUFU among them, synchronous global loads ``LDG`` and CTA barriers left in it), registers, shared memory,
programs an SM (the smaller of what shared memory, registers and threads allow) and the waves the grid
takes. Forms: ``plain`` (``x @ W.T``, o_proj), ``norm`` (the add + RMSNorm folded in: qkv / gate_up with
``RLSERVE_DECODE_GEMM_ROWS_FOLD=1``), ``silu`` (SiLU-and-mul folded in: down). The default since session 18
runs every linear ``plain`` after a separate norm / SiLU-and-mul kernel.

Usage (CPU, no GPU needed; ~1 s a compile)::

    python benchmarks/rows_sass.py --shape qwen3-8b --rows 16,64 [--json out.json]

Numbers are the compiler's, not timings: the K loop's instructions against the ~1,270 cycles an SM has
per 16 KB weight tile at its share of an H100's 3 TB/s (132 SMs, 1.75 GHz) say whether the loop can keep
up with the weight stream; the waves say whether the split plan's programs run at once.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

H100_SMS = 132
SMEM_PER_SM = 228 * 1024  # bytes; 1 KB of it reserved per program
REGS_PER_SM = 65536
ARGS = ["X", "R", "NW", "W", "B", "OUT", "RES_OUT", "WS", "WSS", "CNT", "M", "N", "stride_x", "stride_r", "stride_o",
        "stride_ro", "stride_w", "eps"]
CONST = ["K", "K_PER", "PROLOGUE", "HAS_RES", "HAS_BIAS", "BLOCK_M", "BLOCK_N", "BLOCK_K", "SPLIT", "IEEE", "PDL"]
PROLOGUE = {"plain": 0, "norm": 1, "silu": 2}


def compile_sm90(K, K_PER, prologue, BM, BN, BK, SPLIT, stages):
    """The kernel compiled for sm_90 as the runtime specializes it (16-byte aligned pointers, N and strides
    multiples of 16; M not specialized), bf16."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from rlserve.layers import gemm_rows_kernels

    sig = dict(zip(ARGS, ["*bf16"] * 7 + ["*fp32", "*fp32", "*i32"] + ["i32"] * 7 + ["fp32"]))
    sig.update({c: "constexpr" for c in CONST})
    const = dict(K=K, K_PER=K_PER, PROLOGUE=prologue, HAS_RES=prologue == 1, HAS_BIAS=False, BLOCK_M=BM,
                 BLOCK_N=BN, BLOCK_K=BK, SPLIT=SPLIT, IEEE=False, PDL=True)
    attrs = {(i,): [["tt.divisibility", 16]] for i in (*range(10), 11, 12, 13, 14, 15, 16)}
    return triton.compile(ASTSource(gemm_rows_kernels._gemm_rows_kernel, sig, const, attrs),
                          target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": stages})


def _cuobjdump(kernel, flag: str) -> str:
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        return subprocess.run([tool, flag, f.name], capture_output=True, text=True, check=True).stdout


def k_loop(sass: str) -> list[str]:
    """The opcodes (predicates dropped) of the K loop: the body of the backward branch spanning most code."""
    code = [(int(m.group(1), 16), m.group(2)) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    loops = [(dst, at) for at, ins in code if (b := re.search(r"BRA (0x[0-9a-f]+)", ins))
             and (dst := int(b.group(1), 16)) < at]
    if not loops:
        return []
    lo, hi = max(loops, key=lambda d: d[1] - d[0])
    return [re.sub(r"^@!?U?P\w+\s+", "", ins).split()[0] for at, ins in code if lo <= at <= hi]


def analyse(linear: str, M: int, N: int, K: int, form: str) -> dict:
    import torch

    from rlserve.layers import gemv, triton_attention

    triton_attention._SM_COUNT[0] = H100_SMS
    bm, bn, bk, split, k_per = gemv.rows_tile(M, N, K, torch.device("cuda", 0))
    stages = gemv.rows_stages(bm, PROLOGUE[form])
    k = compile_sm90(K, k_per, PROLOGUE[form], bm, bn, bk, split, stages)
    ops = k_loop(_cuobjdump(k, "-sass"))
    regs = int(re.search(r"REG:(\d+)", _cuobjdump(k, "-res-usage")).group(1))
    per_sm = min(SMEM_PER_SM // (k.metadata.shared + 1024), REGS_PER_SM // (regs * 128), 16)
    grid = -(-N // bn) * split
    return {"linear": linear, "M": M, "form": form, "tile": [bm, bn, bk, stages], "split": split, "k_steps": k_per // bk,
            "grid": grid, "loop_instructions": len(ops), "loop_mufu": sum(o.startswith("MUFU") for o in ops),
            "loop_ldg": sum(o.startswith("LDG.") or o == "LDG" for o in ops),
            "loop_bar": sum(o.startswith("BAR") for o in ops), "regs": regs, "shared_kb": k.metadata.shared // 1024,
            "programs_per_sm": per_sm, "waves": round(grid / (per_sm * H100_SMS), 2)}


def shape_linears(shape: str) -> dict:
    from model_shapes import shape_config

    cfg = shape_config(shape)
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    H = cfg.hidden_size
    return {"qkv": ((cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * hd, H, "norm"),
            "o": (H, cfg.num_attention_heads * hd, "plain"),
            "gate_up": (2 * cfg.intermediate_size, H, "norm"),
            "down": (H, cfg.intermediate_size, "silu")}


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="qwen3-8b")
    ap.add_argument("--rows", default="16,64")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    out = []
    for M in (int(r) for r in args.rows.split(",")):
        for linear, (N, K, form) in shape_linears(args.shape).items():
            for f in ("plain", form) if form != "plain" else ("plain",):
                r = analyse(linear, M, N, K, f)
                out.append(r)
                print(f"{linear:8s} M={M:3d} {f:5s} tile {r['tile']} split {r['split']:2d} x {r['k_steps']:2d} K steps, "
                      f"grid {r['grid']:4d}: loop {r['loop_instructions']:4d} instr (MUFU {r['loop_mufu']:3d}, LDG "
                      f"{r['loop_ldg']}, BAR {r['loop_bar']}), {r['regs']} regs, {r['shared_kb']} KB, "
                      f"{r['programs_per_sm']} an SM, {r['waves']} waves", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"shape": args.shape, "h100_sms": H100_SMS, "rows": out}, f, indent=1)
    return out


if __name__ == "__main__":
    main()
