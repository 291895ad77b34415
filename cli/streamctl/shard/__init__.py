"""`streamctl shard` as a library: vLLM sharded-state files written on a CPU. plan.py and planning.py (what
each rank's files hold), dest.py (what DEST holds and --force removes), blocks.py and writer.py (bytes from
SOURCE into part streams), checks.py (verify-index --sharded and the reconstruction), result.py (result and
manifest), lifecycle.py, run.py (shard_checkpoint); shard/engines/vllm_gpu/engine.py + shard/engines/vllm_gpu/save.py (`--engine vllm-gpu`);
`--engine vllm-cpu`: shard/engines/vllm_cpu/engine.py (plan from the worker, routed writer), shard/engines/vllm_cpu/client.py (the worker's
client), shard/engines/vllm_cpu/checks.py, shard/engines/vllm_cpu/protocol.py (the pipe contract), shard/engines/vllm_cpu/env.py; in vLLM's Python, the worker:
shard/engines/vllm_cpu/worker.py (its loop) with vllm_worker_channel/_plan/_write/_check/_errors.py, shard/engines/vllm_cpu/shims.py,
shard/engines/vllm_cpu/wna16.py and shard/engines/vllm_cpu/compat.py (every private vLLM access, the supported releases, the start-up check)."""
