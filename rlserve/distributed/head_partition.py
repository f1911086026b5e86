"""Which attention heads a tensor-parallel rank owns, and exact division of sizes over the TP
size: the one partition rule that the fused qkv / o_proj layers (:mod:`rlserve.layers.linear`),
the models' per-rank head counts (:mod:`rlserve.models.llama`, :mod:`rlserve.models.opt`) and the
worker's KV-cache sizing (:mod:`rlserve.engine.worker.worker`) share."""

from __future__ import annotations


def divide(numerator: int, denominator: int, what: str = "size") -> int:
    """Exact integer division; raises ValueError when ``denominator`` does not divide."""
    if numerator % denominator:
        raise ValueError(f"{what}={numerator} is not divisible by tensor_parallel_size={denominator}")
    return numerator // denominator


def attention_head_partition(total_q_heads: int, total_kv_heads: int, tp_size: int,
                             tp_rank: int) -> tuple[int, int, int, int]:
    """The attention heads TP rank ``tp_rank`` owns: ``(q_start, q_count, kv_start, kv_count)``.

    The one partition rule for attention (fused qkv columns, o_proj rows, per-rank head
    counts). Query head ``h`` belongs to KV head ``h // (total_q_heads // total_kv_heads)``.

    - ``total_kv_heads >= tp_size``: each rank gets a contiguous range of whole GQA groups,
      sizes differing by at most one, the larger ranges first (3 KV heads / 9 query heads
      over 2 ranks: KV ``[0, 2)`` + q ``[0, 6)`` on rank 0, KV ``[2, 3)`` + q ``[6, 9)`` on
      rank 1). When ``tp_size`` divides ``total_kv_heads`` this is the usual even split.
    - ``total_kv_heads < tp_size``: KV heads are replicated, each rank holds one
      (``tp_rank // (tp_size / total_kv_heads)``) and an equal contiguous share of the query
      heads (``total_q_heads / tp_size``, which then lie inside that KV head's group).

    Raises:
        ValueError: ``total_q_heads`` not a multiple of ``total_kv_heads``; with fewer KV heads
            than ranks, ``tp_size`` not a multiple of ``total_kv_heads`` or ``total_q_heads``
            not divisible by ``tp_size``; a rank out of range.
    """
    if total_q_heads < 1 or total_kv_heads < 1 or tp_size < 1:
        raise ValueError(f"bad head partition request: {total_q_heads} query heads, {total_kv_heads} KV heads, "
                         f"tensor_parallel_size={tp_size}")
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"TP rank {tp_rank} out of range for tensor_parallel_size={tp_size}")
    if total_q_heads % total_kv_heads:
        raise ValueError(f"num_attention_heads={total_q_heads} is not divisible by "
                         f"num_key_value_heads={total_kv_heads}")
    group = total_q_heads // total_kv_heads
    if total_kv_heads >= tp_size:
        base, extra = divmod(total_kv_heads, tp_size)
        kv_count = base + (1 if tp_rank < extra else 0)
        kv_start = tp_rank * base + min(tp_rank, extra)
        return kv_start * group, kv_count * group, kv_start, kv_count
    if tp_size % total_kv_heads:
        raise ValueError(f"tensor_parallel_size={tp_size} is not divisible by num_key_value_heads={total_kv_heads} "
                         f"(with fewer KV heads than ranks each KV head is replicated on tp/num_kv_heads ranks)")
    if total_q_heads % tp_size:
        raise ValueError(f"num_attention_heads={total_q_heads} is not divisible by tensor_parallel_size={tp_size} "
                         f"(needed when num_key_value_heads={total_kv_heads} < tensor_parallel_size)")
    q_count = total_q_heads // tp_size
    return tp_rank * q_count, q_count, tp_rank // (tp_size // total_kv_heads), 1


def attention_head_partition_sizes(total_q_heads: int, total_kv_heads: int, tp_size: int) -> list[tuple[int, int]]:
    """``[(q_count, kv_count)]`` of every rank under :func:`attention_head_partition`."""
    return [attention_head_partition(total_q_heads, total_kv_heads, tp_size, r)[1::2] for r in range(tp_size)]
