"""Process groups used by the engine (tensor parallelism). The weight-transfer group
lives in :mod:`rlserve.transfer` and is separate from these."""
