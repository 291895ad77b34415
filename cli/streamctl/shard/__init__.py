"""`streamctl shard` as a library: vLLM sharded-state files written on a CPU. plan.py and planning.py (what
each rank's files hold), dest.py (what DEST holds and --force removes), blocks.py and writer.py (bytes from
SOURCE into part streams), checks.py (verify-index --sharded and the reconstruction), result.py (result and
manifest), lifecycle.py, run.py (shard_checkpoint); vllm_engine.py + vllm_save.py (`--engine vllm-gpu`)."""
