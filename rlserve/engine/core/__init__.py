"""engine-core process: request bookkeeping, scheduler, KV blocks, the step pipeline, sampling, structured outputs, sleep mode's state machine."""
