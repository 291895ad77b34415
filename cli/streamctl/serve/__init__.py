"""`streamctl serve` as a library: run.py (the whole launch but the printing, and the exec into vLLM), the
pre-flight (preflight.py), the launch plan (plan.py), vLLM's option table (vllm_args.py), and the streamer
concurrency probe (tune.py, measuring in subprocesses that run streamer_probe.py)."""
