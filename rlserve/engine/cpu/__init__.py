"""CPU-engine tuning: torch threads, micro-batches over cores, glibc malloc thresholds."""
