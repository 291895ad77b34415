"""`--engine vllm-cpu`: vLLM's own model code lays the files out, in a worker run by a CPU-only vLLM environment.

Parent side: engine.py (the engine), client.py (starts the worker and talks to it), checks.py, env.py (the
environment). In vLLM's Python, the worker: worker.py (its loop, run as `python -P -m
streamctl.shard.engines.vllm_cpu.worker`) with worker_channel/_plan/_write/_check/_errors.py, shims.py, wna16.py,
quantized.py and compat.py (every private vLLM access). protocol.py (the pipe contract) is shared by both sides. This file
imports nothing: it runs in vLLM's Python too."""
