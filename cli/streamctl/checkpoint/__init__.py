"""What a checkpoint is, with no I/O policy: safetensors header rules, the index, the serving file set,
vLLM's sharded-state names and the offline layout table, and what the Run:ai streamer can read."""
