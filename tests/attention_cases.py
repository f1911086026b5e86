"""Random paged-attention cases shared by the kernel tests (CPU interpreter and GPU). Not a
test module."""

from __future__ import annotations

import torch

from rlserve.layers.attention import AttentionMetadata


def make_paged_case(query_lens, seq_lens, H, Hkv, D, block_size, dtype, device="cpu", spare_blocks=3, seed=0):
    """Random ``q [T, H, D]``, a paged K/V cache ``[num_blocks, block_size, Hkv, D]`` whose blocks
    are handed to the sequences in a shuffled order (plus ``spare_blocks`` unused ones), and the
    step's :class:`AttentionMetadata`; everything in ``dtype`` on ``device``, seeded by ``seed``."""
    g = torch.Generator().manual_seed(seed)
    nb = sum(-(-s // block_size) for s in seq_lens) + spare_blocks
    perm = torch.randperm(nb, generator=g).tolist()
    tables, i = [], 0
    for s in seq_lens:
        n = -(-s // block_size)
        tables.append(perm[i : i + n])
        i += n
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, block_size, device)
    kc = torch.randn(nb, block_size, Hkv, D, generator=g).to(device, dtype)
    vc = torch.randn(nb, block_size, Hkv, D, generator=g).to(device, dtype)
    q = torch.randn(sum(query_lens), H, D, generator=g).to(device, dtype)
    return q, kc, vc, meta
