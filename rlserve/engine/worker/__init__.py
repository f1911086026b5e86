"""one device rank: model, KV cache, forward pass, CUDA graphs, sleep-mode memory; the tensor-parallel executor that runs the ranks."""
