"""`streamctl shard` as a library: vLLM sharded-state files written on a CPU. plan.py and planning.py (what
each rank's files hold), dest.py (what DEST holds and --force removes), blocks.py and writer.py (bytes from
SOURCE into part streams), checks.py (verify-index --sharded and the reconstruction), result.py (result and
manifest), lifecycle.py, run.py (shard_checkpoint); vllm_engine.py + vllm_save.py (`--engine vllm-gpu`);
`--engine vllm-cpu`: vllm_cpu_engine.py (plan from the worker, routed writer), vllm_worker.py (the worker's
client), vllm_checks.py, vllm_protocol.py (the pipe contract), vllm_env.py; in vLLM's Python, the worker:
vllm_cpu_worker.py (its loop) with vllm_worker_channel/_plan/_write/_check/_errors.py, vllm_shims.py,
vllm_wna16.py and vllm_compat.py (every private vLLM access, the supported releases, the start-up check)."""
