"""`streamctl shard` as a library: vLLM sharded-state files written on a CPU. run.py is the entry
(`shard_checkpoint`); plan/planning/dest decide, blocks/writer write, checks/result/lifecycle check and
record, vllm_engine (with vllm_save, its subprocess script) runs vLLM's own save instead."""
