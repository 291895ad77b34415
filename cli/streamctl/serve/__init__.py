"""`streamctl serve` as a library: the launch plan and pre-flight (plan.py), vLLM's option table
(vllm_args.py), and the streamer concurrency probe (tune.py, run in a subprocess by streamer_probe.py)."""
