"""`--engine offline`: streamctl's own table-driven writer (engine.py), planned by shard/planning.py from the
layout table (streamctl.checkpoint.vllm_layouts) and written by shard/writer.py."""
