"""The builtin engine ("the bus"): paged KV cache, continuous batching, throughput first."""
