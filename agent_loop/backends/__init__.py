"""Backends: the contract (:mod:`.base`), the registry and factory behind ``--backend`` (:mod:`.registry`),
and the backends: transformers (:mod:`.hf`), vLLM in-process (:mod:`.vllm_engine`), OpenAI-compatible
HTTP servers (:mod:`.openai_http`), scripted replies for tests (:mod:`.scripted`). docs/design.md section 6."""
