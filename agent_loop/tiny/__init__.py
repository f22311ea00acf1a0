"""The built-in tiny agent: a local byte-level BPE tokenizer and a small Llama-shaped model that calls tools.

``tiny_agent_path(stage)`` returns its folder (built and cached on first use); both
``transformers.AutoTokenizer``/``AutoModelForCausalLM`` and vLLM load it.
"""

from agent_loop.tiny.build import RECIPE_VERSION, STAGES, build_record, tiny_agent_path
from masking.native import cache_root

__all__ = ["RECIPE_VERSION", "STAGES", "build_record", "cache_root", "tiny_agent_path"]
