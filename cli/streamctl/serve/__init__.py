"""`streamctl serve` as a library: plan.py (ServeOptions and the launch plan), preflight.py (the header check
before the GPUs spin), tune.py + streamer_probe.py (streamer concurrency, measured in a subprocess),
vllm_args.py (vLLM's option table and secret flags), run.py (prepare_launch, exec_vllm)."""
