"""The shard engines, each in its own package: offline/, vllm_cpu/, vllm_gpu/."""
