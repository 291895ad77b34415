"""`--engine vllm-gpu` (formerly `vllm`): vLLM's own save_sharded_state on GPUs (engine.py; save.py runs in vLLM's
Python, by path)."""
