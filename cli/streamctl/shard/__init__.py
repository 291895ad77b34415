"""`streamctl shard` as a library: vLLM sharded-state files written on a CPU."""
