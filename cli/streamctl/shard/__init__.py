"""`streamctl shard` as a library: vLLM sharded-state files written on a CPU. run.py (shard_checkpoint, and
run_shard: the one lifecycle every engine's run goes through), engine.py (what an engine is: plan, plan_dest,
write, checks), auto.py (--engine auto), plan.py and planning.py (what each rank's files hold), dest.py (what
DEST holds and --force removes), blocks.py and writer.py (bytes from SOURCE into part streams), checks.py
(verify-index --sharded and the reconstruction), result.py (result and manifest), lifecycle.py (begin, undo,
record). The engines, one package each under engines/ (its registry): offline/, vllm_gpu/ (`--engine
vllm-gpu`), vllm_cpu/ (`--engine vllm-cpu`, with the worker that runs in vLLM's Python)."""
