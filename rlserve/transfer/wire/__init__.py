"""What travels between trainer and server: JSON data classes, the byte layout of buckets and its header, CUDA IPC handles, and the only pickle reader (vLLM's formats included)."""
