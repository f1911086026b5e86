"""Data planes: the transfer process group (gloo / NCCL), the ctypes NCCL binding, vLLM's NCCL wire."""
