"""LoRA adapters served per request (vLLM's ``--enable-lora``): :mod:`~rlserve.lora.adapter` reads
a PEFT adapter directory, :mod:`~rlserve.lora.layers` is the per-row math (CPU grouping; the seam
for a batched GPU kernel), :mod:`~rlserve.lora.model` holds one replica's adapters and hooks its
linears, :mod:`~rlserve.lora.engine_ops` is what the routes run on every replica, and
:mod:`~rlserve.lora.registry` is the API server's table of adapter names."""
