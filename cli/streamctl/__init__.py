"""streamctl: stage LLM checkpoints into object storage and serve them with vLLM."""

__version__ = "0.1.0"
