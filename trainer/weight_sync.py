"""The vLLM servers' weight pushers under their old import path (``benchmarks/weight_sync.py``, users' scripts);
they live in ``trainer.transports.vllm_servers``, beside the other weight transports."""

from agent_loop.backends.weight_files import WeightSyncError
from trainer.transports.vllm_servers import VLLMServerLoRASync, VLLMServerWeightSync

__all__ = ["VLLMServerLoRASync", "VLLMServerWeightSync", "WeightSyncError"]
